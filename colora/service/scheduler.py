"""The trainer thread: every model's requests in seq_id order, all models' ready work in one backend call.

A model's requests arrive out of order (the SDK sends a forward_backward's chunks concurrently, the
first one last) and are run strictly in seq_id order, each seq_id once: a repeated (model_id, seq_id)
gets the first request's id back and runs nothing. A cycle takes, for every model, its ready requests
from its next seq_id on: forward_backward/forward calls up to the first barrier (optim_step, or a
save/load, which is a function run with the backend), and that barrier. All models' forward calls and
optim_steps go to the backend in ONE `train_cycle` call (forward calls first, in each model's seq
order; then the optim_steps, one per model at most), whose futures are answered then; then the other
barriers run, each answered as it ends; then the next cycle starts. A request that failed before it reached the
scheduler (invalid content) still takes its seq_id slot: it is answered with its error in its turn and
the model goes on. Control operations (create, delete, load into a new model) run on the same thread
at the start of a cycle, so the backend's training side is only ever touched from this thread.

With `save_in_step` a model's saves and loads right after its optim_step ride in the step's cycle, after
it (a client's save_weights_and_get_sampling_client then waits for no other model's next training). With
`gather` (colora/service/levers.py; both read from the backend's `levers` where it has them) a group's
models share each step's cycles as a native step's jobs do, forward_backward and optim_step: a model's
ready training work waits, at most `gather` times the last cycle's with a forward_backward (FIRST_TRAIN_S
before one ran). A forward_backward waits while models about to train have not sent theirs yet, until the
ready ones are 1/`gather_groups` of the models that are active: those ready and those about to train.
Models whose forward_backward calls ran in one cycle are partners: an optim_step waits for its partners'
(in that cycle it rides only beside all of theirs) and they run in one cycle; not for a partner gone away,
whose forward_backward failed or whose next request trains again (a step over several forward_backward
calls). Other work runs meanwhile, in cycles of its own (the stats' `held`: the seconds a cycle's held
work waited). A model is about to train while its work of the step before waits (its optim_step, its
save), while one of its samplers' samples decode (`sampling`, which the service calls), and for that bound
after its last forward_backward or its last sample: a client's loop goes from one to the other in far
less. Models that trained together get their next samplers together, sample together and come back
together: the cycles settle into `gather_groups` groups that alternate, one training while the others'
samples decode, as the native run's phase-offset groups (colora/corun/grouping.py); a job that does not
sample (sft) trains with the others, as in a native step. An evaluation's forward never waits.

Fairness: a model's share of one cycle is bounded (`cycle_datums`, `cycle_tokens` of forward calls; its
first ready call always runs, however large). What is left waits for the next cycle, where every model
again takes its share, the first model taken turning round from cycle to cycle. A tenant that
pipelines a large backlog therefore delays another's step by about one cycle of shares, never by its
whole backlog. What waits is bounded too: `submit` refuses a seq_id too far ahead of the one a model
runs next, more pending requests than a model may hold, and more pending bytes than their owner (the
tenant) may hold (`Backlog`, which the service answers 429).

Each cycle that did work is one line of `stats.jsonl` (written after its futures are answered, so a
full disk never leaves a request unanswered): which models, which (model, seq_id) forward calls with
how many datums, which optim_steps, its seconds (`train` of them in the backend's training pass), the seconds
its forward_backward calls waited for models about to train (`held`);
`stats()` sums them (cycles, models per cycle, ...).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from colora.service.backend import AdamParams, Backend, BackendError, ForwardCall, OptimCall

log = logging.getLogger("colora.service")
SEEN_KEPT = 4096  # a model's most recent seq_ids whose request ids answer a retried POST

FIRST_TRAIN_S = 1.0  # `gather`'s estimate of a training cycle's seconds before one has run
FAILED_WAIT_S = (0.05, 5.0)  # after a cycle that raised: the first wait, doubled each failure in a row to the second
HOLD_LOOK_S = 0.05  # while `gather` holds and nothing else is ready, how often the trainer looks again
STATS_MAX_BYTES = 256 << 20  # stats.jsonl is moved to stats.jsonl.1 (replacing it) past this size


@dataclass(frozen=True)
class Outcome:
    """What a request's future resolves to: a result, or an error with its category. `retry`: the failure
    is transient and the same request may succeed if sent again (an engine that restarted under it);
    `colora/service/futures.py` `failure_answer` is the one place that maps it to an HTTP answer."""

    result: Any = None
    error: str | None = None
    category: Literal["user", "server"] = "user"
    retry: bool = False


Done = Callable[[str, Outcome], None]  # (request_id, outcome), called on the trainer thread


@dataclass(frozen=True)
class Work:
    """One seq_id of one model. `payload`: a ForwardCall ("forward"), AdamParams ("optim"), or a
    function of the backend returning the result ("barrier": saves and loads); "optim" carries an OptimCall. With `error` set, the
    request only takes its slot and is answered with that error."""

    request_id: str
    model_id: str
    seq_id: int
    kind: Literal["forward", "optim", "barrier"]
    payload: Any = None
    error: str | None = None
    label: str = ""  # for the record: "save_weights", "load_weights", ...
    nbytes: int = 0  # the request's body, counted against its owner's pending bytes while it waits

    def size(self) -> tuple[int, int]:
        """(datums, tokens) of a forward call; (0, 0) for anything else."""
        if self.kind != "forward" or self.error is not None:
            return 0, 0
        return len(self.payload.datums), sum(len(d.tokens) for d in self.payload.datums)


@dataclass
class _Queue:
    next_seq: int
    owner: str = ""
    pending: dict[int, Work] = field(default_factory=dict)
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request_id, for retried POSTs


class SeqError(ValueError):
    """A seq_id that can no longer run (its turn has passed without it)."""


class Backlog(Exception):
    """A request refused because too much already waits: `limit` (a `Limits` field) of `value`, and the
    `count` it would exceed; the message says so."""

    def __init__(self, limit: str, value: int, count: int, message: str):
        super().__init__(message)
        self.limit, self.value, self.count, self.message = limit, value, count, message


class Scheduler:
    """See the module docstring. `submit`, `add_model`, `remove_model` and `control` are thread-safe;
    `run_cycle` runs on the trainer thread (`start`), or is called directly by tests."""

    def __init__(self, backend: Backend, done: Done, stats_path: Path | None = None, batch_window_s: float = 0.0,
                 cycle_datums: int = 1 << 62, cycle_tokens: int = 1 << 62,
                 observe: Callable[[list[tuple[Work, Outcome]]], None] | None = None,
                 save_in_step: bool | None = None, gather: float | None = None, gather_groups: int | None = None):
        self.backend = backend
        self._done = done
        self._stats_path = stats_path
        self._window = batch_window_s
        self._share = (cycle_datums, cycle_tokens)
        levers = getattr(backend, "levers", None)  # None: the module docstring's levers off
        self._save_in_step = bool(getattr(levers, "save_in_step", False) if save_in_step is None else save_in_step)
        self._gather = float(getattr(levers, "gather", 0.0) if gather is None else gather)
        self._groups = int(getattr(levers, "gather_groups", 1) if gather_groups is None else gather_groups)
        self._sampling: dict[str, int] = {}  # model -> its samplers' samples decoding
        self._sampled_at: dict[str, float] = {}  # model -> when its last sample finished (monotonic)
        self._trained_at: dict[str, float] = {}  # model -> when its training work last went into a cycle
        self._last_train_s = 0.0  # the last cycle with a forward_backward: its seconds
        self._held: dict[str, float] = {}  # model -> since when `gather` holds its ready work (monotonic)
        self._partners: dict[str, frozenset[str]] = {}  # model -> the models whose steps its optim_step waits for
        self._observe = observe  # called on the trainer thread with each cycle's (work, outcome) pairs
        self._models: dict[str, _Queue] = {}
        self._owner_bytes: dict[str, int] = {}
        self._turn = 0  # which model takes its share first this cycle
        self._control: list[tuple[str | None, Callable[[Backend], Any]]] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._stats_failing = 0  # rows not written since the stats file last failed (logged once per burst)
        self._totals = {"cycles": 0, "forward_calls": 0, "forward_datums": 0, "optim_steps": 0, "barriers": 0,
                        "max_models_per_cycle": 0, "multi_model_cycles": 0, "max_forward_calls_per_cycle": 0,
                        "max_optim_steps_per_pass": 0, "multi_model_optim_passes": 0, "cycle_seconds_sum": 0.0,
                        "last_cycle_seconds": 0.0, "cycle_models_sum": 0, "held_cycles": 0, "held_seconds": 0.0}

    # -- submission (any thread) -------------------------------------------------------------------
    def add_model(self, model_id: str, next_seq: int = 1, owner: str = "") -> None:
        with self._cond:
            self._models[model_id] = _Queue(next_seq, owner)

    def has_model(self, model_id: str) -> bool:
        with self._cond:
            return model_id in self._models

    def remove_model(self, model_id: str, reason: str) -> None:
        """Forgets the model; its requests still waiting are answered with `reason`."""
        with self._cond:
            q = self._models.pop(model_id, None)
            for d in (self._sampling, self._sampled_at, self._trained_at, self._held, self._partners):
                d.pop(model_id, None)
            for w in (q.pending.values() if q else ()):
                self._owner_bytes[q.owner] -= w.nbytes
        for w in (q.pending.values() if q else ()):
            self._done(w.request_id, Outcome(error=reason, category="user"))

    def submit(self, model_id: str, work: Work, window: int | None = None, max_pending: int | None = None,
               max_owner_bytes: int | None = None) -> tuple[str, bool]:
        """Queues `work` in its model's seq order. Returns (request_id, new): a seq_id seen before returns
        the first request's id and new=False. Raises KeyError for an unknown model, SeqError for a
        seq_id whose turn has passed, Backlog for a seq_id beyond the model's next plus `window`, a
        model holding `max_pending` requests already, or an owner whose pending bytes would pass
        `max_owner_bytes` (a request alone is never refused for its size: max_request_bytes bounds it)."""
        assert work.model_id == model_id, (work.model_id, model_id)
        with self._cond:
            q = self._models[model_id]
            if work.seq_id in q.seen:
                return q.seen[work.seq_id], False
            if work.seq_id < q.next_seq:
                raise SeqError(f"seq_id {work.seq_id} of model {model_id} comes after its turn (or is too old to "
                               f"answer again): the model is at seq_id {q.next_seq}")
            if window is not None and work.seq_id > q.next_seq + window:
                raise Backlog("seq_window", window, work.seq_id - q.next_seq,
                              f"seq_id {work.seq_id} of model {model_id} is {work.seq_id - q.next_seq} ahead of the "
                              f"one it runs next ({q.next_seq}); limits.seq_window = {window}")
            if max_pending is not None and len(q.pending) >= max_pending:
                raise Backlog("pending_requests", max_pending, len(q.pending),
                              f"model {model_id} holds {len(q.pending)} requests not yet run; limits.pending_requests = "
                              f"{max_pending}: wait for their results")
            held = self._owner_bytes.get(q.owner, 0)
            if max_owner_bytes is not None and held and held + work.nbytes > max_owner_bytes:
                raise Backlog("pending_bytes", max_owner_bytes, held,
                              f"requests of {held} bytes wait to run; this one's {work.nbytes} would pass "
                              f"limits.pending_bytes = {max_owner_bytes}: wait for their results")
            q.pending[work.seq_id] = work
            q.seen[work.seq_id] = work.request_id
            self._owner_bytes[q.owner] = held + work.nbytes
            self._cond.notify()
            return work.request_id, True

    def sampling(self, model_id: str, delta: int) -> None:
        """One of the model's samples starts decoding (+1) or finishes (-1): `gather`'s view of which
        models are about to train (module docstring)."""
        with self._cond:
            if model_id not in self._models:  # removed meanwhile (or never a model's)
                return
            n = self._sampling.get(model_id, 0) + delta
            if n > 0:
                self._sampling[model_id] = n
            else:
                self._sampling.pop(model_id, None)
                self._sampled_at[model_id] = time.monotonic()
                self._cond.notify()

    def pending(self, owner: str) -> tuple[int, int]:
        """(requests, bytes) of `owner`'s models accepted and not yet run."""
        with self._cond:
            return (sum(len(q.pending) for q in self._models.values() if q.owner == owner),
                    self._owner_bytes.get(owner, 0))

    def control(self, request_id: str | None, fn: Callable[[Backend], Any]) -> None:
        """Runs fn(backend) on the trainer thread before the next cycle; answers request_id with its
        result (a BackendError or exception answers with an error)."""
        with self._cond:
            self._control.append((request_id, fn))
            self._cond.notify()

    # -- the trainer thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="colora-trainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _ready(self) -> bool:
        return bool(self._control) or any(q.next_seq in q.pending for q in self._models.values())

    def _loop(self) -> None:
        failures = 0  # cycles in a row that raised: a bug that leaves its work queued must not spin the thread
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._ready())
                stopping = self._stopped
            if stopping:  # deletes still queued free their models; queued training is dropped
                self._run_control()
                return
            if self._window:
                time.sleep(self._window)  # let requests sent together (two clients, a call's chunks) share the cycle
            with self._cond:
                held, deferred = self._deferred() if self._gather else (0.0, set())
                if deferred and not self._control and all(m in deferred for m, q in self._models.items()
                                                          if q.next_seq in q.pending):
                    self._cond.wait(HOLD_LOOK_S)  # nothing else to run meanwhile: a submit or a sample's end wakes it
                    continue
            try:
                self.run_cycle(held, deferred) if self._gather else self.run_cycle()
                failures = 0
            except Exception:  # the thread must outlive any one cycle's bug; the cycle answered what it could
                failures += 1
                log.exception("trainer cycle failed (%d in a row)", failures)
                with self._cond:
                    self._cond.wait_for(lambda: self._stopped, timeout=min(FAILED_WAIT_S[1],
                                                                           FAILED_WAIT_S[0] * 2 ** (failures - 1)))

    def _deferred(self) -> tuple[float, set[str]]:
        """`gather` (module docstring), under the lock: (the seconds the models now let go were held, the models
        whose ready work waits). A hold (forward_backward calls; a group's optim_steps) ends whole at the bound."""
        now = time.monotonic()
        bound = self._gather * (self._last_train_s or FIRST_TRAIN_S)
        nxt = {m: q.pending[q.next_seq] for m, q in self._models.items() if q.next_seq in q.pending}
        ready = {m for m, w in nxt.items() if _trains(w)}
        steps = {m for m, w in nxt.items() if w.kind == "optim" and w.error is None}
        soon = {m for m in self._models if m not in ready and (m in nxt or m in self._sampling or max(
            self._trained_at.get(m, -math.inf), self._sampled_at.get(m, -math.inf)) > now - bound)}
        holds = [ready] if ready and soon and len(ready) < math.ceil((len(ready) + len(soon)) / self._groups) else []
        for group in {self._partners[m] for m in steps if m in self._partners}:
            mine = {m for m in group if self._partners.get(m) == group}
            if mine - steps - ready:  # a partner's step has not come yet
                holds.append(mine & steps)
        since = {m: self._held.get(m, now) for h in holds for m in h}
        deferred = set().union(*(h for h in holds if now - min(since[m] for m in h) < bound))
        held = max((now - t for m, t in self._held.items() if m in nxt and m not in deferred), default=0.0)
        self._held = {m: since[m] for m in deferred}
        return held, deferred

    def run_cycle(self, held: float = 0.0, skip: set[str] = frozenset()) -> bool:
        """One cycle (module docstring) of every model but those in `skip`; `held`: the seconds its models
        waited for models about to train. Returns whether it did anything."""
        control = self._run_control()
        forward, optim, barriers, failed = self._take(skip) if skip else self._take()
        for w in failed:
            self._done(w.request_id, Outcome(error=w.error, category="user"))
        if not (forward or optim or barriers):
            return bool(control or failed)
        t0 = time.perf_counter()
        fwd_out, opt_out = self._train(forward, optim)
        train = time.perf_counter() - t0
        if any(_trains(w) for w in forward):
            self._last_train_s = train
        if self._gather:
            self._pair(forward, fwd_out, optim)
        results = list(zip(forward, fwd_out)) + list(zip(optim, opt_out))
        # each answered as soon as it is done (a save after a step makes no other model's step wait for it), and
        # before anything else: whatever fails after, every request of the cycle is answered
        for w, outcome in results:
            self._done(w.request_id, outcome)
        for w in barriers:
            results.append((w, _call(lambda: w.payload(self.backend))))
            self._done(w.request_id, results[-1][1])
        seconds = time.perf_counter() - t0
        if self._observe is not None:
            try:
                self._observe(results)
            except Exception:
                log.exception("counting a cycle's results failed")
        self._record(forward, optim, barriers, seconds, held, train)
        return True

    def _run_control(self) -> list:
        with self._cond:
            control, self._control = self._control, []
        for rid, fn in control:
            outcome = _call(lambda: fn(self.backend))
            if rid is not None:
                self._done(rid, outcome)
        return control

    def _take(self, skip: set[str] = frozenset()) -> tuple[list[Work], list[Work], list[Work], list[Work]]:
        """Every model's share of ready requests (module docstring), up to and including its first barrier,
        out of the queues; none of the models in `skip`. With `gather`, the optim_steps right after forward_backward
        calls only if every model that trains in the cycle has one."""
        forward, optim, barriers, failed = [], [], [], []
        trained, stepping = set(), []  # the models training in the cycle; those of them whose optim_step follows
        with self._cond:
            queues = [(m, q) for m, q in self._models.items() if m not in skip]
            if queues:
                first = self._turn % len(queues)
                queues = queues[first:] + queues[:first]
                self._turn = first + 1
            now = time.monotonic()
            for model_id, q in queues:
                datums = tokens = 0
                while q.next_seq in q.pending:
                    w = q.pending[q.next_seq]
                    d, t = w.size()
                    if (datums or tokens) and (datums + d > self._share[0] or tokens + t > self._share[1]):
                        break  # the model's share of this cycle is spent: the rest waits for the next
                    if w.kind == "optim" and w.error is None and model_id in trained and self._gather:
                        stepping.append(q)  # beside its partners' steps, or in a cycle after (below)
                        break
                    _pop(q, self._owner_bytes)
                    datums, tokens = datums + d, tokens + t
                    if w.error is not None:
                        failed.append(w)
                    elif w.kind == "forward":
                        forward.append(w)
                        trained |= {model_id} if _trains(w) else set()
                    elif w.kind == "barrier":
                        barriers.append(w)
                        break
                    else:
                        self._take_step(q, w, optim, barriers)
                        break
                if model_id in trained:
                    self._trained_at[model_id] = now
                if len(q.seen) > 2 * SEEN_KEPT:  # retries come soon after the first POST: old ids can go
                    q.seen = {k: v for k, v in q.seen.items() if k >= q.next_seq - SEEN_KEPT}
            if len(stepping) == len(trained):
                for q in stepping:
                    self._take_step(q, _pop(q, self._owner_bytes), optim, barriers)
        return forward, optim, barriers, failed

    def _take_step(self, q: _Queue, w: Work, optim: list[Work], barriers: list[Work]) -> None:
        """An optim_step out of its queue, and with `save_in_step` the saves and loads after it (module docstring)."""
        optim.append(w)
        while self._save_in_step and q.next_seq in q.pending and q.pending[q.next_seq].kind == "barrier":
            barriers.append(_pop(q, self._owner_bytes))

    def _pair(self, forward: list[Work], fwd_out: list[Outcome], optim: list[Work]) -> None:
        """`gather`'s partners (module docstring) after a cycle: those that trained in it and wait to step."""
        stepped = {w.model_id for w in optim}
        done = stepped | {w.model_id for w in forward if _trains(w)}
        group = frozenset(done - stepped - {w.model_id for w, o in zip(forward, fwd_out) if o.error is not None})
        with self._cond:
            self._partners = {m: g for m, g in self._partners.items() if m not in done}
            if len(group) > 1:
                self._partners.update(dict.fromkeys((m for m in group if m in self._models), group))

    def _train(self, forward: list[Work], optim: list[Work]) -> tuple[list[Outcome], list[Outcome]]:
        if not (forward or optim):
            return [], []
        calls = [w.payload for w in forward]
        steps = [w.payload for w in optim]
        try:
            fr, orr = self.backend.train_cycle(calls, steps)
            if len(fr) != len(calls) or len(orr) != len(steps):
                raise RuntimeError(f"train_cycle returned {len(fr)}/{len(orr)} results for {len(calls)}/{len(steps)} calls")
        except Exception as e:
            log.exception("train_cycle failed")
            err = Outcome(error=f"the trainer failed: {type(e).__name__}: {e}", category="server")
            return [err] * len(calls), [err] * len(steps)
        steps_out = [r if isinstance(r, BackendError) else {"type": "optim_step", "metrics": r} for r in orr]
        return [_outcome(r) for r in fr], [_outcome(r) for r in steps_out]

    def _record(self, forward: list[Work], optim: list[Work], barriers: list[Work], seconds: float,
                held: float = 0.0, train: float = 0.0) -> None:
        models = sorted({w.model_id for w in forward + optim + barriers})
        t = self._totals
        t["cycles"] += 1
        t["forward_calls"] += len(forward)
        t["forward_datums"] += sum(len(w.payload.datums) for w in forward)
        t["optim_steps"] += len(optim)
        t["barriers"] += len(barriers)
        fwd_models = {w.model_id for w in forward}
        t["max_models_per_cycle"] = max(t["max_models_per_cycle"], len(fwd_models | {w.model_id for w in optim}))
        t["multi_model_cycles"] += len(fwd_models) > 1
        t["max_forward_calls_per_cycle"] = max(t["max_forward_calls_per_cycle"], len(forward))
        t["max_optim_steps_per_pass"] = max(t["max_optim_steps_per_pass"], len(optim))
        t["multi_model_optim_passes"] += len(optim) > 1
        t["cycle_seconds_sum"] += seconds
        t["last_cycle_seconds"] = seconds
        t["cycle_models_sum"] += len(models)
        t["held_cycles"] += held > 0.001
        t["held_seconds"] += held
        if self._stats_path is None:
            return
        row = {"cycle": t["cycles"], "time": round(time.time(), 3), "seconds": round(seconds, 6), "models": models,
               "forward": [[w.model_id, w.seq_id, len(w.payload.datums), w.payload.forward_only] for w in forward],
               "optim": [[w.model_id, w.seq_id] for w in optim],
               "barriers": [[w.model_id, w.seq_id, w.label] for w in barriers], "held": round(held, 6),
               "train": round(train, 6)}
        try:
            if self._stats_path.is_file() and self._stats_path.stat().st_size > STATS_MAX_BYTES:
                os.replace(self._stats_path, f"{self._stats_path}.1")
            with open(self._stats_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            if not self._stats_failing:
                log.error("writing %s failed (%s: %s); rows are dropped until it works again",
                          self._stats_path.name, type(e).__name__, e)
            self._stats_failing += 1
            return
        if self._stats_failing:
            log.info("%s is written again (%d rows were dropped)", self._stats_path.name, self._stats_failing)
            self._stats_failing = 0

    def stats(self) -> dict:
        """The counters of every cycle so far (module docstring)."""
        with self._cond:
            return dict(self._totals, models=len(self._models))


def _pop(q: _Queue, owner_bytes: dict[str, int]) -> Work:
    """The model's next request, out of its queue (its bytes no longer counted against its owner)."""
    w = q.pending.pop(q.next_seq)
    owner_bytes[q.owner] -= w.nbytes
    q.next_seq += 1
    return w


def _trains(w: Work) -> bool:
    """A forward_backward (not an evaluation's forward, not a request that only takes its slot)."""
    return w.kind == "forward" and w.error is None and not w.payload.forward_only


def _outcome(r: Any) -> Outcome:
    if isinstance(r, BackendError):
        return Outcome(error=r.message, category=r.category)
    return Outcome(result=r)


def _call(fn: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(result=fn())
    except BackendError as e:
        return Outcome(error=e.message, category=e.category)
    except Exception as e:
        log.exception("a trainer-thread operation failed")
        return Outcome(error=f"{type(e).__name__}: {e}", category="server")


def forward_work(request_id: str, call: ForwardCall) -> Work:
    return Work(request_id, call.model_id, call.seq_id, "forward", call)


def optim_work(request_id: str, model_id: str, seq_id: int, params: AdamParams) -> Work:
    return Work(request_id, model_id, seq_id, "optim", OptimCall(model_id, seq_id, params))


def barrier_work(request_id: str, model_id: str, seq_id: int, label: str, fn: Callable[[Backend], Any]) -> Work:
    return Work(request_id, model_id, seq_id, "barrier", fn, label=label)


def failed_work(request_id: str, model_id: str, seq_id: int, error: str, label: str = "") -> Work:
    return Work(request_id, model_id, seq_id, "forward", error=error, label=label)
