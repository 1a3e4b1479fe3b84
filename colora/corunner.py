"""The co-runner: drives engine and trainer through the arms, one code path for all of them.

Jobs are split into groups. A group's cycle is: (engine thread) load the group's new adapter
versions and queue its rollouts in the running engine -> (main thread, the trainer) reward,
advantages, one optimizer step per job, export -> the group is queued again. The engine batches
continuously: a group queued while another group's sequences are still decoding joins them, so the
engine is never left finishing one group's long tail alone. With one group the phases simply
alternate; with two or more, one group generates while another trains. When the trainer frees up it
takes every group whose rollouts are ready in one shared step (`overlap.coalesce`). Groups start
staggered: group g+1's first rollouts are queued when group g's come back. A group's next
rollouts are queued only after its own step, so every rollout comes from its job's current adapter
(and the trainer checks the version of each).

Groups start balanced by the tokens of each job's first requests and are weighed again on measured
tokens after the warm-up (colora/grouping.py); a job moves only right after its own step, into a
group whose next rollouts it then joins, so it is never in flight twice and stays on-policy.

| arm          | groups                      | MPS (set up by the runner) |
| ------------ | --------------------------- | -------------------------- |
| dedicated    | one job at a time, alone    | no                         |
| shared_sync  | 1 (all jobs)                | no                         |
| overlap      | overlap.groups              | no                         |
| mps          | 1                           | yes                        |
| overlap_mps  | overlap.groups              | yes                        |

Reload first: after queueing a trained group, the trainer waits for the engine to load that group's
new adapters before it trains the next group. A load pauses the engine's decoding of the other group
and, run during a training step, takes about twice as long; overlap_mps made 11-20% more job-steps
per hour with this wait than without (H200, measured at 0e15773 and 55311e3).

The trainer (main thread) and the engine thread exchange small records through two queues
(colora/handoff.py). Every wait on a queue has a timeout, after which it looks at whether the other
side is still there and whether a stop was requested (colora/stopping.py: a signal). On a stop
request the engine thread takes no more work and ends, and the trainer finishes the step it is in,
if any, and raises `Interrupted` before it queues anything again: every job's state is then that of
its last completed step. An engine that failed after a stop request is the interruption (Ctrl-C
reaches vLLM's processes too).
"""

from __future__ import annotations

import contextlib
import queue
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import compilewatch, grpo
from .adapter_sync import AdapterTensors
from .config import OVERLAP_ARMS, Config, JobConfig
from .engine import GenRequest, GenResult, RolloutEngine
from .grouping import plan_regroup, request_tokens, split_groups
from .handoff import Drop, EngineFailure, Failed, Generate, Generated, Stop
from .lora import AdapterBank
from .replay import keep_failed_step
from .rollouts import Prompts, score, step_requests
from .runlog import JsonlWriter, Timeline
from .stopping import StopRequest
from .summary import NO_SIGNAL_STEPS
from .throughput import combine_windows, measure_window
from .trainer import JobFailure, MultiJobTrainer

QUEUE_WAIT_S = 0.5  # the longest a thread waits on its queue before it looks at the other side
JOIN_WAIT_S = 60.0  # the longest the trainer waits for the engine thread to end after a Stop
STOP_JOIN_S = 10.0  # the same after a stop request: the process is going, the thread is a daemon


@dataclass
class JobState:
    cfg: JobConfig
    task: Any  # colora.tasks.Task
    step: int = 0  # optimizer steps done
    status: str = "running"  # running | done | stopped
    reason: str = ""
    step_ends: list[float] = field(default_factory=list)  # timeline time at the end of each step
    pending: tuple[int, Path | AdapterTensors] | None = None  # exported adapter version waiting to be loaded

    @property
    def name(self) -> str:
        return self.cfg.name


class CoRunner:
    def __init__(self, cfg: Config, engine: RolloutEngine, trainer: MultiJobTrainer, bank: AdapterBank,
                 tokenizer, jobs: dict[str, JobState], timeline: Timeline, metrics: JsonlWriter,
                 adapter_root: Path, log: Callable[[str], None] = print,
                 on_step: Callable[[], None] | None = None, stop_request: StopRequest | None = None):
        self.cfg = cfg
        self.engine = engine
        self.trainer = trainer
        self.bank = bank
        self.prompts = Prompts(tokenizer)  # the jobs' prompts as token ids, each once
        self.jobs = jobs
        self.timeline = timeline
        self.metrics = metrics
        self.adapter_root = adapter_root  # where adapters that go by disk are written
        self.log = log
        self.on_step = on_step  # checkpoint hook, called on the main thread after each group step
        self.stop_request = stop_request or StopRequest()  # set by a signal (colora/stopping.py)
        self._submit_q: queue.Queue | None = None  # set while the engine thread runs
        self._queued_at: dict[int, float] = {}  # group -> when it was handed to the engine thread
        self._ship_lock = threading.Lock()  # see `shipping`
        self._used_tokens: dict[str, list[int]] = {}  # job -> prompt + completion tokens of each step
        self._regroup: dict[str, int] | None = None  # job -> planned group, while moves are pending
        self._regroup_decided = False
        self._loaded: dict[int, threading.Event] = {}  # group -> set once its adapters are loaded, queued
        self._flat: dict[str, int] = {}  # job -> steps in a row whose groups all had equal rewards

    # -- prompts and requests ------------------------------------------------------------------
    def step_requests(self, js: JobState, step: int) -> tuple[list, list[GenRequest]]:
        return step_requests(js.task, js.cfg, self.cfg.experiment.seed, step, self.prompts)

    # -- the engine side (engine thread) ---------------------------------------------------------
    def load_pending(self, names: list[str], group: int) -> None:
        """Load the group's exported adapter versions into the engine in one call (`set_adapters`).
        Each version's `adapter_seconds` in the reload span is its share of that call: the call's
        seconds over the versions it loaded."""
        todo = [self.jobs[n] for n in names if self.jobs[n].pending is not None]
        if not todo:
            return
        with self.shipping(), self.timeline.span("reload", group=group, jobs=tuple(j.name for j in todo),
                                                 adapter_seconds={}) as span:
            loads = [(js.name, *js.pending) for js in todo]
            for js in todo:
                js.pending = None
            share = self.engine.set_adapters(loads) / len(loads)
            for name, version, adapter in loads:
                span["adapter_seconds"][f"{name}@v{version}"] = round(share, 6)
                via = "disk" if isinstance(adapter, Path) else "memory"
                self.metrics.write({"job": name, "event": "reload", "version": version, "seconds": share, "via": via,
                                    "batch": len(loads)})
                old = adapter.parent / f"v{version - 1}" if via == "disk" else None
                if old is not None and old.exists():
                    shutil.rmtree(old, ignore_errors=True)

    @contextlib.contextmanager
    def shipping(self):
        """One adapter transfer at a time: the trainer's export of one group and the engine's load of
        another. On the H200 under MPS, run at once, each took 1-3 s instead of 0.1-0.3 s (measured at
        39baa4c). The wait gives up if the engine dies meanwhile (its thread may never let go) or a
        stop is requested."""
        while not self._ship_lock.acquire(timeout=0.5):
            why = self.engine.dead()
            if why:
                raise EngineFailure(why)
            self.stop_request.check()
        try:
            yield
        finally:
            self._ship_lock.release()

    def submit_group(self, group: int, names: list[str]) -> dict:
        """Load the group's new adapters, then queue one step of rollouts for its running jobs.
        Returns {job: items} for the scoring of this step."""
        self.load_pending(names, group)
        items, reqs = {}, []
        for n in names:
            js = self.jobs[n]
            if js.status == "running":
                items[n], rq = self.step_requests(js, js.step)
                reqs += rq
        self.engine.submit(group, reqs)
        return items

    def engine_loop(self, groups: list[list[str]], submit_q: queue.Queue, done_q: queue.Queue) -> None:
        """The engine thread: take groups to generate for, keep the engine stepping, hand every
        finished group's rollouts to the trainer. Any exception is handed over too. Ends on a Stop or
        a stop request."""
        inflight: dict[int, tuple[dict, float]] = {}
        try:
            while not self.stop_request.requested:
                todo = []
                with contextlib.suppress(queue.Empty):
                    # nothing decoding: wait for work (a Stop wakes the wait; the timeout bounds it)
                    todo.append(submit_q.get(timeout=QUEUE_WAIT_S) if not self.engine.busy() else submit_q.get_nowait())
                    while True:
                        todo.append(submit_q.get_nowait())
                for msg in todo:
                    if isinstance(msg, Stop):
                        return
                    if isinstance(msg, Drop):
                        self.engine.drop(msg.job)
                        continue
                    t0 = self.timeline.now()
                    inflight[msg.group] = (self.submit_group(msg.group, groups[msg.group]), t0)
                    self._loaded[msg.group].set()
                for g, results in self.engine.poll():
                    items, t0 = inflight.pop(g)
                    end = self.timeline.now()
                    # queued: when the trainer handed the group over (t0 - queued: the engine thread's delay)
                    self.timeline.add("generate", t0, end, group=g, jobs=tuple(items), sequences=len(results),
                                      queued=round(self._queued_at.pop(g, t0), 6))
                    by_job: dict[str, list[GenResult]] = {n: [] for n in items}
                    for r in results:
                        by_job[r.request.job].append(r)
                    done_q.put(Generated(g, {n: (items[n], by_job[n]) for n in items}, end - t0))
        except BaseException as e:  # the trainer thread re-raises it
            err = EngineFailure(f"{type(e).__name__}: {e}")
            err.__cause__ = e
            done_q.put(Failed(err))

    # -- the trainer side (main thread) ----------------------------------------------------------
    def train_task(self, ready: list[Generated], progress: str) -> None:
        """One shared optimizer step for every job of the ready groups (each job's own update)."""
        gen, t_gen, group_of = {}, {}, {}
        for r in ready:
            for name, (items, results) in r.jobs.items():
                gen[name], t_gen[name], group_of[name] = (items, results), r.seconds, r.group
        groups = tuple(r.group for r in ready)
        group = groups[0] if len(groups) == 1 else -1
        rollouts, rewards = {}, {}
        for name, (items, results) in gen.items():
            js = self.jobs[name]
            self.engine.decode(results)
            try:
                rollouts[name] = score(js.task, js.cfg, items, results)
                rewards[name] = float(np.mean([r.reward for r in rollouts[name]]))
            except JobFailure as f:
                self.stop(js, f.reason)
        if not rollouts:
            return
        t0 = time.perf_counter()
        before = compilewatch.snapshot()
        with self.timeline.span("train", group=group, groups=list(groups), jobs=tuple(rollouts)) as span:
            stats = self.trainer.step(rollouts)
            compiled = compilewatch.since(before)
            if compiled:  # the usual cause of a step far slower than the others
                span["compiles"] = compiled
        if any(st.failure for st in stats.values()):
            step = min(self.jobs[n].step for n in rollouts)
            kept = keep_failed_step(self.metrics.path.parent, step, group, rollouts, stats, self.bank)
            self.log(f"kept what the failed training step ran on in {kept} (colora replay-step DIR runs it again)")
        t_train = time.perf_counter() - t0
        now = self.timeline.now()
        parts, exports = [], []
        for name, st in stats.items():
            js = self.jobs[name]
            rs = rollouts[name]
            by_prompt: dict[int, list[float]] = {}
            for r in rs:
                by_prompt.setdefault(r.prompt_index, []).append(r.reward)
            row = {"job": name, "step": js.step, "group": group_of[name], "reward": rewards[name],
                   "rollout_versions": sorted({r.version for r in rs}),
                   "reward_std": float(np.std([r.reward for r in rs])),
                   # the share of its prompts whose samples all got one reward: no gradient from them
                   "flat_groups": grpo.flat_groups(torch.tensor(list(by_prompt.values()), dtype=torch.float64)),
                   "response_len": float(np.mean([len(r.completion_ids) for r in rs])),
                   "truncated_frac": float(np.mean([r.finish_reason == "length" for r in rs])),
                   "t_generate": t_gen[name], "t_train": t_train, **st.__dict__}
            if st.failure:
                self.metrics.write({**row, "status": "stopped"})
                self.stop(js, st.failure)
                continue
            exports.append((js, st.version))
            self._used_tokens.setdefault(name, []).append(sum(len(r.prompt_ids) + len(r.completion_ids) for r in rs))
            js.step += 1
            js.step_ends.append(now)
            self.metrics.write({**row, "status": "ok"})
            self._warn_flat(name, row["flat_groups"] == 1.0)
            if js.step >= self.cfg.experiment.steps:
                js.status = "done"
            parts.append(f"{name} r={rewards[name]:.2f}")
        self.export_adapters(exports, group, list(groups))
        self.log(f"{progress} | {' '.join(parts)} | gen {max(t_gen.values()):.1f}s train {t_train:.1f}s")
        if self.on_step is not None:
            self.on_step()

    def _warn_flat(self, name: str, flat: bool) -> None:
        """Say so the moment a job has had no reward variance in any group for NO_SIGNAL_STEPS steps
        in a row (the summary counts every such step: colora/summary.py)."""
        self._flat[name] = self._flat.get(name, 0) + 1 if flat else 0
        if self._flat[name] == NO_SIGNAL_STEPS:
            self.log(f"warning: job {name}: every group's rewards were equal for {NO_SIGNAL_STEPS} steps in a row, so "
                     "it got no gradient from them (its task may be too hard or too easy for the model, or its "
                     "reward may not depend on the completion)")

    def export_adapters(self, exports: list[tuple[JobState, int]], group: int, groups: list[int]) -> None:
        """Make the engine's copy of each new adapter version (`engine.export_adapter`: into shared
        memory or as a PEFT directory, colora/adapter_sync.py); the engine thread loads it before the
        job's next rollouts. The export and reload spans time each version (`adapter_seconds`)."""
        if not exports:  # every job of the step stopped
            return
        with self.shipping(), self.timeline.span("export", group=group, groups=groups, adapter_seconds={},
                                                 jobs=tuple(js.name for js, _ in exports)) as span:
            for js, version in exports:
                t0 = time.perf_counter()
                js.pending = (version, self.engine.export_adapter(self.bank, js.name,
                                                                  self.adapter_root / js.name / f"v{version}"))
                span["adapter_seconds"][f"{js.name}@v{version}"] = round(time.perf_counter() - t0, 6)

    def stop(self, js: JobState, reason: str) -> None:
        """Stop one job: recorded with its reason, its adapter taken out of the shared engine (a
        diverged adapter must not stay beside the others), the other jobs go on."""
        js.status, js.reason, js.pending = "stopped", reason, None
        self.metrics.write({"job": js.name, "step": js.step, "event": "stopped", "status": "stopped", "reason": reason})
        self.log(f"job {js.name} stopped: {reason}")
        if self._submit_q is not None:
            self._submit_q.put(Drop(js.name))  # the engine thread owns the engine
        else:
            self.engine.drop(js.name)

    def regroup(self, groups: list[list[str]], ready: list[int]) -> None:
        """Weigh the split again on measured tokens once every job is past its warm-up (once per
        run), then move the planned jobs of the groups in `ready` (just trained, not yet queued
        again). Groups are replaced, never edited in place: the engine thread reads a group's list
        when it submits the group, so it sees the old list or the new one, not half of each."""
        if len(groups) < 2:
            return
        running = [n for g in groups for n in g if self.jobs[n].status == "running"]
        if not self._regroup_decided:
            after = max(1, self.cfg.experiment.warmup_steps)
            if not running or any(len(self._used_tokens.get(n, ())) < after for n in running):
                return
            self._regroup_decided = True
            cost = {n: float(np.mean(self._used_tokens.get(n) or [0])) for g in groups for n in g}
            self._regroup = plan_regroup(groups, cost)
            loads = [round(sum(cost[n] for n in g)) for g in groups]
            if self._regroup is None:
                self.metrics.write({"event": "regroup", "planned_moves": [], "loads": loads})
                return
            self.metrics.write({"event": "regroup", "loads": loads,
                                "planned_moves": sorted(n for g, names in enumerate(groups) for n in names
                                                if self._regroup.get(n, g) != g),
                                "plan": self._regroup})
            self.log(f"regrouping on measured tokens per step (group loads {loads}): {self._regroup}")
        if self._regroup is None:
            return
        cycling = {g for g, names in enumerate(groups) if any(self.jobs[n].status == "running" for n in names)}
        for g in ready:
            for n in list(groups[g]):
                dst = self._regroup.get(n, g)
                # a group left with no running job is queued no more: a job moved into it would starve
                if dst != g and dst in cycling and len(groups[g]) > 1 and self.jobs[n].status == "running":
                    groups[g] = [x for x in groups[g] if x != n]
                    groups[dst] = groups[dst] + [n]
                self._regroup.pop(n, None)
        if not self._regroup:
            self._regroup = None

    def _queue(self, submit_q: queue.Queue, group: int) -> None:
        self._queued_at[group] = self.timeline.now()
        self._loaded[group] = threading.Event()
        submit_q.put(Generate(group))

    # -- arms --------------------------------------------------------------------------------
    def run_groups(self, groups: list[list[str]]) -> None:
        """Phase-offset groups over the continuous engine (see the module docstring). Returns when
        every job is done or stopped."""
        steps = self.cfg.experiment.steps
        submit_q: queue.Queue = queue.Queue()
        done_q: queue.Queue = queue.Queue()
        thread = threading.Thread(target=self.engine_loop, args=(groups, submit_q, done_q), name="colora-engine",
                                  daemon=True)
        # Staggered start: group g+1 is first queued when group g's first rollouts are back, so the
        # groups begin phase-offset (one generating while the other trains) instead of in lockstep.
        waiting = deque(g for g, names in enumerate(groups) if any(self.jobs[n].status == "running" for n in names))
        outstanding = 0
        if waiting:
            self._queue(submit_q, waiting.popleft())
            outstanding = 1
        self._submit_q = submit_q
        stop_watch = threading.Event()

        def watchdog() -> None:  # the engine thread may hang forever in a call into a dead engine
            while not stop_watch.wait(0.5):
                why = self.engine.dead()
                if why:
                    done_q.put(Failed(EngineFailure(why)))
                    return

        watcher = threading.Thread(target=watchdog, name="colora-engine-watchdog", daemon=True)
        thread.start()
        watcher.start()
        try:
            while outstanding:
                ready = [self._next(done_q, thread)]
                while self.cfg.overlap.coalesce:
                    try:
                        ready.append(done_q.get_nowait())
                    except queue.Empty:
                        break
                for item in ready:
                    if isinstance(item, Failed):
                        self.stop_request.check()  # the engine died of the signal that asked to stop
                        raise item.error
                self.stop_request.check()  # rollouts back, but no new step is begun after a stop request
                outstanding -= len(ready)
                if waiting:
                    self._queue(submit_q, waiting.popleft())
                    outstanding += 1
                step = max(self.jobs[n].step for r in ready for n in groups[r.group]) + 1
                label = "groups " + ",".join(str(r.group) for r in ready) if len(groups) > 1 else "step"
                self.train_task(ready, f"{label} {step}/{steps}")
                self.stop_request.check()  # the step is whole: stop before queueing the next
                self.regroup(groups, [r.group for r in ready])
                queued = [r.group for r in ready if any(self.jobs[n].status == "running" for n in groups[r.group])]
                for g in queued:
                    self._queue(submit_q, g)
                    outstanding += 1
                self._wait_loaded(queued, thread)
        finally:
            stop_watch.set()
            submit_q.put(Stop())
            # a daemon thread stuck in a call into a dead engine stays behind
            wait = 5.0 if self.engine.dead() else STOP_JOIN_S if self.stop_request.requested else JOIN_WAIT_S
            thread.join(timeout=wait)
            if thread.is_alive():
                self.log(f"warning: the engine thread did not stop within {wait:.0f} s; left behind")
            self._submit_q = None
        for g, names in enumerate(groups):  # the final adapters, for evaluation
            self.load_pending(names, g)

    def _next(self, done_q: queue.Queue, engine_thread: threading.Thread) -> Generated | Failed:
        """The engine thread's next record; a thread that ended without one is a failure too. Raises
        Interrupted on a stop request."""
        while True:
            self.stop_request.check()
            try:
                return done_q.get(timeout=QUEUE_WAIT_S)
            except queue.Empty:
                if not engine_thread.is_alive() and done_q.empty():
                    return Failed(EngineFailure("the engine thread ended without a word"))

    def _wait_loaded(self, groups: list[int], engine_thread: threading.Thread) -> None:
        """Until the engine thread has loaded these groups' adapters and queued their rollouts, or has
        stopped (its error is then the next item of the trainer's queue). Raises Interrupted on a stop
        request."""
        for g in groups:
            while not self._loaded[g].wait(0.05):
                self.stop_request.check()
                if not engine_thread.is_alive() or self.engine.dead():
                    return

    def run(self) -> dict:
        """Run the configured arm; returns the throughput windows (see `throughput`)."""
        arm = self.cfg.experiment.arm
        names = [n for n, js in self.jobs.items() if js.status == "running"]
        if arm == "dedicated":
            windows = []
            for n in names:
                t0 = self.timeline.now()
                self.run_groups([[n]])
                windows.append(measure_window({n: self.jobs[n].step_ends}, t0, self.cfg.experiment.warmup_steps))
            return combine_windows(windows)
        n_groups = self.cfg.overlap.groups if arm in OVERLAP_ARMS else 1
        # Each job's cost: the tokens of its next step's actual requests (its prompts, tokenized,
        # and the response lengths drawn for them): prompt lengths differ by task, lengths by config.
        cost = {n: request_tokens(self.step_requests(self.jobs[n], self.jobs[n].step)[1]) for n in names} \
            if n_groups > 1 else None
        groups = split_groups(names, n_groups, cost)
        t0 = self.timeline.now()
        self.run_groups(groups)
        w = measure_window({n: self.jobs[n].step_ends for n in names}, t0, self.cfg.experiment.warmup_steps)
        w["groups"] = groups
        return w

