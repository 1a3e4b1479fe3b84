"""The engine's thread of `colora serve`'s co-runner backend (colora/service/corun.py): the only caller
of the engine, and what brings the engine back when its processes die.

Work arrives through `put` from any thread: ("sample", SampleCall, done), ("register", key, folder,
reply), ("register_many", [(key, adapter), ...]), ("release", key, then), ("snapshots", reply), ("load",
weights, loaded), and is done in the order it came. A sample's requests join the running batch at once
(`grouped`: a sample of n sequences is one engine request of n, else n requests; the same samples either
way, colora/engine/sampling.py); `done` is called when its last sequence finishes. A release is not waited for (it may come from a sample's `done`, on this thread);
`then` runs after it. A sampler's weights are the backend's own and never change (corun.py): a folder
that vLLM may evict and reload whenever its LRU likes, or a shared-memory segment that vLLM's worker
built the adapter from (pinned in vLLM's cache). "register_many" is not waited for either: its samplers
register in one call into the engine, before any sample that comes after it in the queue; one that the
engine refuses is kept as refused, and its samples fail saying why.

"load" is a full-parameter model's engine's (colora/service/full.py: its requests are served by the model,
`request`): `weights` into the engine (`set_adapters`) once the samples before it have finished, before the
work after it, which waits meanwhile; `loaded` is set once they are in the engine. They are the engine's
weights from then on: a new engine loads the newest before any sample runs in it, under `weights_lock` (held
by the writer of the weights while it writes them and queues their load, so that a new engine reads neither
a half-written segment nor weights whose load is not yet queued: the load queued by then is taken first).

Each failure is its own:
- a sample the engine refuses (a sampling setting vLLM does not take: `BatchRefused` from the engine's
  poll, or its submit raising while the engine lives) fails alone, category "user"; the engine and
  every other sample go on.
- the engine's death (its core or its client's process killed: a poll or call that raises, the look
  at its processes while it idles, or any other failure of its poll, after which it is not trusted)
  is logged once. The samples in flight are answered with a retryable server error (the protocol
  layer answers those with HTTP 410, on which the SDK sends the sample again), the dead engine is
  never called again, and a new engine of the same settings (`factory`) starts on a thread of its
  own. Every live sampler is registered in it again, then the samples that arrived meanwhile run.
  Until then samples wait (at most `max_waiting`; beyond that they are answered with a retryable
  error at once), registrations and releases are recorded, and `health` says "restarting". A load
  meanwhile is the weights the new engine loads; the samples that wait before it were asked of weights
  it replaced (their bytes are gone): they fail, category "user", and `loaded` is set at once.
- weights that do not load into a live engine leave it holding weights of no version: it is taken for
  dead, and the new engine loads them.
- a start that fails is logged and tried again after `backoff_s`, doubling up to `backoff_max_s`.
  From the `degraded_after`-th failure in a row `health` says "degraded" and samples are answered at
  once with a server error that is not retryable (the SDK would otherwise retry for up to two hours),
  until a start succeeds.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np

from colora.engine.adapters import Adapter, AdapterDir
from colora.engine.process import BatchRefused
from colora.engine.sampling import GenRequest, samples
from colora.service.backend import BackendError, SampleCall, SampledSequence, SampleResult

IDLE_WAIT_S = 0.5  # the longest the thread waits for work while nothing decodes; also how often an idle engine is looked at
MAX_WAITING = 256  # samples that wait for a restarting engine; a SampleCall holds at most one context of tokens
RESTART_BACKOFF_S = 2.0  # the wait before the second try at starting an engine, doubled for every later one
RESTART_BACKOFF_MAX_S = 60.0
DEGRADED_AFTER = 3  # failed starts in a row after which health says "degraded" and samples fail at once
RESTART_JOIN_S = 600.0  # the longest close() waits for an engine start under way (vLLM starts in 20-160 s)


class EngineLoop:
    """factory: starts an engine (RolloutEngine or RemoteEngine, or anything with their submit, poll,
    busy, dead, register_snapshots, release_snapshot, snapshots and close; set_adapters for "load"); the
    first is started here, on the caller's thread, so that a server whose engine cannot start does not
    start. log: one line a call. grouped: a sample of n sequences goes to the engine as one request of n.
    request: a sample's GenRequest. weights_lock: see the module docstring. name: the thread's."""

    def __init__(self, factory: Callable[[], object], log: Callable[[str], None], *, max_waiting: int = MAX_WAITING,
                 backoff_s: float = RESTART_BACKOFF_S, backoff_max_s: float = RESTART_BACKOFF_MAX_S,
                 degraded_after: int = DEGRADED_AFTER, grouped: bool = False,
                 request: Callable[[SampleCall], GenRequest] | None = None, weights_lock=None,
                 name: str = "colora-serve-engine"):
        self.factory = factory
        self.log = log
        self.grouped = grouped
        self.request = request or gen_request
        self.weights_lock = weights_lock or contextlib.nullcontext()
        self.max_waiting = max_waiting
        self.backoff_s, self.backoff_max_s, self.degraded_after = backoff_s, backoff_max_s, degraded_after
        self.engine = factory()  # None while a new one starts
        self.status = "ok"  # "ok" | "restarting" | "degraded"
        self.restarts = 0  # engines started in place of a dead one
        self.failures = 0  # failed starts since the engine died
        self.last_error: str | None = None
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._samplers: dict[str, Adapter] = {}  # live sampler key -> its weights (registered again in a new engine)
        self._lost: dict[str, str] = {}  # sampler key -> why the engine refused it
        self._inflight: dict[int, tuple[SampleCall, Callable]] = {}
        self._requests = 0  # engine requests (sequences) of the samples in flight
        self._waiting: deque = deque()  # (call, done) of samples that wait for a new engine
        self._held: deque = deque()  # work in its order, behind a load that waits for the samples in flight
        self._weights = None  # the newest "load": what a new engine loads first
        self._stopped = "the server is stopping"  # what work that comes after the stop is answered
        self._restarter: threading.Thread | None = None
        self._next_look = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, *item) -> None:
        self._q.put(item)

    def call(self, *item, timeout: float = 600.0):
        """put(item) and wait for its answer (register, snapshots); never from the engine's thread."""
        assert threading.current_thread() is not self._thread, "a call from the engine's thread waits for itself"
        box: dict = {}
        done = threading.Event()
        self.put(*item, (box, done))
        if not done.wait(timeout):
            raise BackendError(f"the engine did not answer {item[0]} within {timeout:.0f} s", "server")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def health(self) -> dict:
        """How the engine is (read from any thread; each figure is read once, not under a lock)."""
        return {"status": self.status, "engine_restarts": self.restarts, "last_engine_error": self.last_error,
                "samplers_loaded": len(self._samplers) - len(self._lost), "engine_requests_in_flight": self._requests,
                "samples_waiting": len(self._waiting)}

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = bool(self._held) or (self.engine is not None and self.engine.busy())
            items = []
            with contextlib.suppress(queue.Empty):
                items.append(self._q.get(timeout=IDLE_WAIT_S) if not busy else self._q.get_nowait())
            self._accept(items + self._queued())
            self._drain()
            if self.engine is None or self._stop.is_set():
                continue
            if self.engine.busy():
                self._poll()
            elif time.monotonic() >= self._next_look:  # an idle engine's death is noticed too
                self._next_look = time.monotonic() + IDLE_WAIT_S
                why = self.engine.dead()
                if why:
                    self._died(why)

    def _poll(self) -> None:
        try:
            finished = self.engine.poll()
        except BatchRefused as e:  # that sample's alone
            self._answer_key(e.key, BackendError(f"the engine refused this sample: {e.reason}", "user"))
            return
        except Exception as e:  # noqa: BLE001  (an engine whose poll fails is not trusted again)
            self._died(self.engine.dead() or f"its poll failed: {type(e).__name__}: {e}")
            return
        for key, results in finished:
            call, done = self._pop(key)
            if done is not None:
                answer(done, lambda: sample_result(call, results))

    def _queued(self) -> list:
        items = []
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self._q.get_nowait())
        return items

    def _accept(self, items: list) -> None:
        """The work of `items` behind what is held, in its order; then the thread's own items (a stop, an
        engine started: it takes what is queued after `items`)."""
        own = [item for item in items if item[0] in ("stop", "started", "closed")]
        for item in items:
            if self._stop.is_set() and item[0] != "started":
                _refuse_stopped(item, self._stopped)
            elif item[0] not in ("stop", "started", "closed"):
                self._held.append(item)
        for item in own:
            self._take(item)

    def _drain(self) -> None:
        """The held work in its order, up to a load while samples are in flight."""
        while self._held and not self._stop.is_set():
            if self._held[0][0] == "load" and self.engine is not None and self.engine.busy():
                return
            self._take(self._held.popleft())

    def _take(self, item) -> None:
        op = item[0]
        if op == "stop":
            self._stop.set()
            self._stopped = item[1]
            err = BackendError(self._stopped, "server")
            self._fail_inflight(err)
            while self._waiting:
                answer(self._waiting.popleft()[1], lambda: err)
            while self._held:
                _refuse_stopped(self._held.popleft(), self._stopped)
        elif op == "sample":
            self._sample(*item[1:])
        elif op == "register_many":
            self._register_many(item[1])
        elif op == "load":
            self._load(*item[1:])
        elif op == "release":
            _, key, then = item
            self._samplers.pop(key, None)
            self._lost.pop(key, None)
            self._engine_call(lambda: self.engine.release_snapshot(key), f"releasing sampler {key}")
            if then is not None:
                then()
        elif op == "started":
            self._started(*item[1:])
        elif op == "closed":
            self.log(f"closing the dead engine failed: {item[1]}")
        else:
            *args, (box, event) = item[1:]
            try:
                if op == "register":
                    self._register(*args, box)
                elif op == "snapshots":
                    box["value"] = sorted(self._samplers if self.engine is None else self.engine.snapshots())
            except Exception as e:  # noqa: BLE001  (handed to the caller's thread)
                box["error"] = BackendError(f"{type(e).__name__}: {e}", "server")
            event.set()

    def _sample(self, call: SampleCall, done: Callable) -> None:
        if call.sampler in self._lost:
            err = BackendError(f"sampler {call.sampler}: the engine refused its weights: {self._lost[call.sampler]}",
                               "server")
            answer(done, lambda: err)
        elif self.engine is not None:
            self._submit(call, done)
        elif self.status == "degraded":
            err = BackendError(f"the engine is down: {self.failures} starts failed in a row, the last with "
                               f"{self.last_error}", "server")
            answer(done, lambda: err)
        elif len(self._waiting) >= self.max_waiting:
            err = BackendError(f"the engine is restarting and {len(self._waiting)} samples wait for it already "
                               "(the most this server keeps)", "server", retryable=True)
            answer(done, lambda: err)
        else:
            self._waiting.append((call, done))

    def _submit(self, call: SampleCall, done: Callable) -> None:
        key = next(self._ids)
        try:
            self.engine.submit(key, samples(self.request(call), call.num_samples, self.grouped))
        except Exception as e:  # noqa: BLE001  (this sample's failure alone: an unknown sampler, say)
            why = self.engine.dead()
            if why:  # not the sample's fault: it runs on the next engine
                self._waiting.appendleft((call, done))
                self._died(why)
                return
            err = BackendError(f"{type(e).__name__}: {e}", "user")
            answer(done, lambda: err)
            return
        self._inflight[key] = (call, done)
        self._requests += call.num_samples

    def _load(self, weights, loaded: threading.Event) -> None:
        """The engine's new weights (module docstring); nothing is in flight (`_drain`)."""
        self._weights = weights
        if self.engine is None:  # the new engine loads them; what waits was asked of the ones they replace
            err = BackendError("newer weights replaced those this sample was asked of while the engine restarted: "
                               "sample from the newest sampler", "user")
            while self._waiting:
                answer(self._waiting.popleft()[1], lambda: err)
            loaded.set()
            return
        try:
            self.engine.set_adapters([weights])
        except Exception as e:  # noqa: BLE001  (its weights are of no version now: it is not used again)
            loaded.set()
            self._died(self.engine.dead() or f"loading new weights failed: {type(e).__name__}: {e}")
            return
        loaded.set()

    def _register(self, key: str, folder: Path, box: dict) -> None:
        """A sampler from its folder: registered in the engine now, or in the next one while it starts."""
        adapter = AdapterDir(key, 0, str(folder))
        self._samplers[key] = adapter
        if self.engine is None:
            return
        try:
            refused = self.engine.register_snapshots([(key, adapter)])
        except Exception:
            why = self.engine.dead()
            if why:  # the next engine registers it
                self._died(why)
                return
            del self._samplers[key]
            raise
        if refused:
            del self._samplers[key]
            raise RuntimeError(refused[key])

    def _register_many(self, items: list[tuple[str, Adapter]]) -> None:
        """Samplers registered in the engine in one call (or in the next one while it starts); one the engine
        refuses is kept as refused."""
        for key, adapter in items:
            self._samplers[key] = adapter
            self._lost.pop(key, None)
        if self.engine is None:
            return
        try:
            refused = self.engine.register_snapshots(items)
        except Exception as e:  # noqa: BLE001  (nobody waits for it: its samples hear of it)
            why = self.engine.dead()
            if why:  # the next engine registers them
                self._died(why)
                return
            refused = {key: f"{type(e).__name__}: {e}" for key, _ in items}
        for key, why in refused.items():
            self._lost[key] = why
            self.log(f"the engine refused sampler {key}: {why}")

    def _engine_call(self, fn: Callable, what: str) -> None:
        """fn() on the live engine; its death is handled, any other failure said (nobody waits for it)."""
        if self.engine is None:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            why = self.engine.dead()
            if why:
                self._died(why)
            else:
                self.log(f"{what} failed: {type(e).__name__}: {e}")

    # -- death and restart ------------------------------------------------------------------------
    def _died(self, why: str) -> None:
        """The engine is dead: said once, its samples in flight answered, a new one started."""
        dead, self.engine = self.engine, None
        n = len(self._inflight)
        self.status, self.failures, self.last_error = "restarting", 0, why  # before any sample hears of it
        self._fail_inflight(BackendError(f"the engine died while this sample decoded ({why}); it is restarting: "
                                         "send the sample again", "server", retryable=True))
        self.log(f"the engine died ({why}): {n} samples in flight failed (retryable); starting a new engine")
        self._restart(dead, 0.0)

    def _restart(self, dead, delay: float) -> None:
        """Close `dead` and start a new engine after `delay` s, on a thread of its own; its outcome comes
        back as a ("started", engine or None, error, seconds) item."""

        def start():
            if dead is not None:
                try:
                    dead.close()
                except Exception as e:  # noqa: BLE001  (what is left of it goes with the server's watcher)
                    self._q.put(("closed", f"{type(e).__name__}: {e}"))
            if self._stop.wait(delay):
                return
            t0 = time.perf_counter()
            try:
                new, error = self.factory(), None
            except Exception as e:  # noqa: BLE001  (reported by the engine's thread, and tried again)
                new, error = None, f"{type(e).__name__}: {e}"
            self._q.put(("started", new, error, time.perf_counter() - t0))

        self._restarter = threading.Thread(target=start, name="colora-serve-engine-start", daemon=True)
        self._restarter.start()

    def _started(self, new, error: str | None, seconds: float) -> None:
        if self._stop.is_set():  # the server stops: close() closes it
            self.engine = new
            return
        with self.weights_lock:
            self._ready(new, error, seconds)

    def _ready(self, new, error: str | None, seconds: float) -> None:
        lost: dict[str, str] = {}
        broken = None  # a new engine that died while its samplers were registered, or refused the weights
        self._accept(self._queued())  # a load queued by now is the newest: taken before the new engine loads
        self._drain()
        if self._stop.is_set():
            self.engine = new
            return
        if new is not None and self._weights is not None:
            try:
                new.set_adapters([self._weights])
            except Exception as e:  # noqa: BLE001  (no sample may run on other weights: a failed start)
                error = f"loading the newest weights into it failed ({new.dead() or 'it lives'}): {type(e).__name__}: {e}"
                broken, new = new, None
        if new is not None:
            try:
                lost = self._register_all(new)
            except Exception as e:  # noqa: BLE001  (it died again: a failed start)
                error = f"it died while the samplers were registered again ({new.dead()}): {type(e).__name__}: {e}"
                broken, new = new, None
        if new is None:
            self.failures += 1
            self.last_error = f"starting a new engine failed: {error}"
            delay = min(self.backoff_s * 2 ** (self.failures - 1), self.backoff_max_s)
            if self.failures >= self.degraded_after and self.status != "degraded":
                self.status = "degraded"
                err = BackendError(f"the engine is down: {self.failures} starts failed in a row, the last with "
                                   f"{error}", "server")
                while self._waiting:
                    answer(self._waiting.popleft()[1], lambda: err)
            degraded = ", the backend is degraded" if self.status == "degraded" else ""
            self.log(f"{self.last_error} ({self.failures} in a row{degraded}); trying again in {delay:.0f} s")
            self._restart(broken, delay)
            return
        self.engine, self.status, self.failures = new, "ok", 0
        self.restarts += 1
        refused = f", refused: {sorted(lost)}" if lost else ""
        self.log(f"the engine restarted in {seconds:.0f} s (restart {self.restarts}): {len(self._samplers)} samplers "
                 f"registered again{refused}; {len(self._waiting)} samples that waited go on")
        self._held.extendleft(("sample", *w) for w in reversed(self._waiting))  # before the work that came later
        self._waiting.clear()
        self._drain()

    def _register_all(self, engine) -> dict[str, str]:
        """Every live sampler into a new engine, in one call; those it refuses are kept as lost (their samples
        fail)."""
        self._lost.clear()
        if self._samplers:
            items = list(self._samplers.items())
            try:
                self._lost.update(engine.register_snapshots(items))
            except Exception as e:
                if engine.dead():
                    raise
                self._lost.update({key: f"{type(e).__name__}: {e}" for key, _ in items})
        return dict(self._lost)

    # -- answers ----------------------------------------------------------------------------------
    def _pop(self, key: int) -> tuple:
        call, done = self._inflight.pop(key, (None, None))
        if call is not None:
            self._requests -= call.num_samples
        return call, done

    def _answer_key(self, key: int, err: BackendError) -> None:
        _, done = self._pop(key)
        if done is not None:
            answer(done, lambda: err)

    def _fail_inflight(self, err: BackendError) -> None:
        for _, done in self._inflight.values():
            answer(done, lambda: err)
        self._inflight.clear()
        self._requests = 0

    def close(self, why: str = "the server is stopping") -> None:
        """Stop the thread (every sample in flight or waiting is answered with `why`, every load's `loaded`
        set), wait for an engine start under way, and close the engine."""
        self.put("stop", why)
        self._thread.join(timeout=30)
        if self._restarter is not None:
            self._restarter.join(timeout=RESTART_JOIN_S)
        engines = [self.engine]
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._q.get_nowait()
                if item[0] == "started":
                    engines.append(item[1])
                else:
                    _refuse_stopped(item, self._stopped)
        self.engine = None
        for eng in engines:
            if eng is not None:
                eng.close()


def _refuse_stopped(item, why: str) -> None:
    """An item that came after the stop: a sample is answered, a caller that waits is woken."""
    err = BackendError(why, "server")
    if item[0] == "sample":
        answer(item[2], lambda: err)
    elif item[0] == "load":
        item[2].set()
    elif item[0] == "release" and item[2] is not None:
        item[2]()
    elif item[0] in ("register", "snapshots"):
        box, event = item[-1]
        box["error"] = err
        event.set()


def answer(done: Callable, make: Callable) -> None:
    try:
        value = make()
    except Exception as e:  # noqa: BLE001  (a result that cannot be built is that sample's failure)
        value = BackendError(f"{type(e).__name__}: {e}", "server")
    try:
        done(value)
    except Exception:  # noqa: BLE001  (the protocol layer's callback: never kill the engine's thread)
        pass


def gen_request(call: SampleCall) -> GenRequest:
    """One sample's GenRequest; `samples` makes num_samples of them, seeds derived from call.seed."""
    return GenRequest(None, tuple(int(t) for t in call.prompt), int(call.max_tokens), float(call.temperature),
                      float(call.top_p), int(call.seed), ignore_eos=not call.stop.eos, snapshot=call.sampler,
                      top_k=int(call.top_k), stop=tuple(call.stop.strings), stop_token_ids=tuple(call.stop.token_ids),
                      prompt_logprobs=bool(call.prompt_logprobs))


def sample_result(call: SampleCall, results) -> SampleResult:
    results = sorted(results, key=lambda r: r.request.tag[1])
    seqs = [SampledSequence(np.asarray(r.completion_ids, np.int64), np.asarray(r.logprobs, np.float32),
                            r.stop_reason) for r in results]
    first = results[0].prompt_logprobs if results else None
    return SampleResult(seqs, None if first is None else np.asarray(first, np.float32))
