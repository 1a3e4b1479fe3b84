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
tokens after the warm-up (colora/corun/grouping.py); a job moves only right after its own step, into a
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

The co-runner wires the two threads: the trainer's side (main thread, colora/corun/trainer_side.py) and
the engine's side (colora/corun/engine_side.py), which share only the records and the one-transfer lock of
colora/corun/handoff.py. Every wait on a queue has a timeout, after which it looks at whether the other
side is still there and whether a stop was requested (colora/stopping.py: a signal). On a stop
request the engine thread takes no more work and ends, and the trainer finishes the step it is in,
if any, and raises `Interrupted` before it queues anything again: every job's state is then that of
its last completed step. An engine that failed after a stop request is the interruption (Ctrl-C
reaches vLLM's processes too).
"""

from __future__ import annotations

import math
import queue
import threading
from collections import deque
from dataclasses import dataclass

from colora.config import OVERLAP_ARMS, Config
from colora.corun.engine_side import EngineSide
from colora.corun.grouping import request_tokens, split_groups
from colora.corun.handoff import Drop, EngineFailure, Failed, Generate, Generated, Shipping, Stop
from colora.corun.rollouts import Prompts
from colora.corun.trainer_side import JobState, TrainerSide
from colora.record.runlog import JsonlWriter, Timeline
from colora.record.summary import never_joined
from colora.record.throughput import combine_windows, measure_window
from colora.stopping import StopRequest
from colora.training.export import AdapterExport
from colora.training.lora import AdapterBank
from colora.training.trainer import MultiJobTrainer

QUEUE_WAIT_S = 0.5  # the longest a thread waits on its queue before it looks at the other side
JOIN_WAIT_S = 60.0  # the longest the trainer waits for the engine thread to end after a Stop
STOP_JOIN_S = 10.0  # the same after a stop request: the process is going, the thread is a daemon


@dataclass(frozen=True)
class Schedule:
    """What the co-runner reads of the config: the arm, its groups and the steps."""

    arm: str
    groups: int  # overlap.groups (the overlap arms), else 1
    coalesce: bool  # overlap.coalesce
    steps: int  # experiment.steps
    warmup_steps: int  # experiment.warmup_steps
    seed: int  # experiment.seed
    task_timeout_s: float = math.inf  # runtime.task_timeout_s

    @classmethod
    def of(cls, cfg: Config) -> "Schedule":
        exp = cfg.experiment
        return cls(exp.arm, cfg.overlap.groups if exp.arm in OVERLAP_ARMS else 1, cfg.overlap.coalesce, exp.steps,
                   exp.warmup_steps, exp.seed, cfg.runtime.task_timeout_s)


class CoRunner:
    """jobs: every job's state (the trainer's side owns it); export: how new adapter versions reach
    the engine (colora/training/export.py); on_step: the checkpoint hook, after each group step."""

    def __init__(self, schedule: Schedule, engine, trainer: MultiJobTrainer, bank: AdapterBank,
                 export: AdapterExport, tokenizer, jobs: dict[str, JobState], timeline: Timeline,
                 metrics: JsonlWriter, log=print, on_step=None, stop_request: StopRequest | None = None,
                 gate=None):
        self.schedule = schedule
        self.engine = engine
        self.jobs = jobs
        self.timeline = timeline
        self.metrics = metrics
        self._stop_request = stop_request or StopRequest()  # set by a signal (colora/stopping.py)
        self.prompts = Prompts(tokenizer)  # the jobs' prompts as token ids, each once
        self.shipping = Shipping(engine.dead, self._stop_request)
        # The time-slicing arm's grant around each GPU phase (colora/timeslice/gate.py: acquire(phase),
        # yield_()); None in every other arm. Phases alternate only with one group: a gated run has one.
        assert gate is None or schedule.groups == 1, "a gated co-runner runs one group"
        self.gate = gate
        self.engine_side = EngineSide(engine, self.prompts, {n: (js.cfg, js.task) for n, js in jobs.items()},
                                      schedule.seed, timeline, metrics, self.shipping, self._stop_request,
                                      schedule.task_timeout_s)
        self.trainer_side = TrainerSide(jobs, trainer, bank, export, steps=schedule.steps,
                                        warmup_steps=schedule.warmup_steps, timeline=timeline, metrics=metrics,
                                        shipping=self.shipping, drop=self._drop, decode=engine.decode, log=log,
                                        on_step=on_step, task_timeout_s=schedule.task_timeout_s, gate=gate)
        self._submit_q: queue.Queue | None = None  # set while the engine thread runs
        self._loaded: dict[int, threading.Event] = {}  # group -> set once its adapters are loaded, queued
        self._in_flight: set[int] = set()  # groups handed to the engine thread, their rollouts not yet back
        self._running: set[str] = set()  # the running jobs at the last step boundary (who joined, who left)
        self._drops: list[str] = []  # gated: stopped jobs whose adapters leave the engine in its next grant

    @property
    def stop_request(self) -> StopRequest:
        """The stop request every wait of both threads looks at (a signal sets it)."""
        return self._stop_request

    @stop_request.setter
    def stop_request(self, stop: StopRequest) -> None:
        self._stop_request = self.shipping.stop_request = self.engine_side.stop_request = stop

    def _drop(self, job: str) -> None:
        """A stopped job's adapter out of the engine: through the engine thread while it runs (it owns
        the engine), else here. Gated, with the engine's next grant (the next `Generate`, else the final
        reload): a job may stop outside any grant, while it scores its step, and the engine is then
        another tenant's GPU's, or parked."""
        if self.gate is not None:
            self._drops.append(job)
        elif self._submit_q is not None:
            self._submit_q.put(Drop(job))
        else:
            self.engine.drop(job)

    def _queue(self, submit_q: queue.Queue, groups: list[list[str]], group: int) -> None:
        """Hand a group to the engine thread: its running jobs' steps and their new adapter versions."""
        names = groups[group]
        running = tuple((n, self.jobs[n].step) for n in names if self.jobs[n].status == "running")
        if self.gate is not None:  # the group's adapter loads and its generation, inside one grant
            self.gate.acquire("generate")
        self._loaded[group] = threading.Event()
        self._in_flight.add(group)
        drops, self._drops = tuple(self._drops), []
        submit_q.put(Generate(group, running, self.trainer_side.take_pending(names), self.timeline.now(),
                              self._loaded[group], drops))

    def load_pending(self) -> None:
        """The adapter versions exported and not yet loaded (each job's last), into the engine now:
        for the evaluation after training. Only where no engine thread runs."""
        assert self._submit_q is None, "the engine thread owns the engine while it runs"
        drops, self._drops = self._drops, []
        for job in drops:  # gated: stopped since the last generation
            self.engine.drop(job)
        self.engine_side.load(list(self.trainer_side.take_pending(list(self.jobs))), -1)

    def run_groups(self, groups: list[list[str]]) -> None:
        """Phase-offset groups over the continuous engine (see the module docstring). Returns when
        every job is done or stopped."""
        steps = self.schedule.steps
        self._running = {n for g in groups for n in g if self.jobs[n].status == "running"}
        submit_q: queue.Queue = queue.Queue()
        done_q: queue.Queue = queue.Queue()
        thread = threading.Thread(target=self.engine_side.loop, args=(submit_q, done_q), name="colora-engine",
                                  daemon=True)
        # Staggered start: group g+1 is first queued when group g's first rollouts are back, so the
        # groups begin phase-offset (one generating while the other trains) instead of in lockstep.
        waiting = deque(g for g, names in enumerate(groups) if any(self.jobs[n].status == "running" for n in names))
        outstanding = 0
        if waiting:
            self._queue(submit_q, groups, waiting.popleft())
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
                if self.gate is not None and not isinstance(ready[0], Failed):
                    self.gate.yield_()
                while self.schedule.coalesce:
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
                    self._queue(submit_q, groups, waiting.popleft())
                    outstanding += 1
                step = max(self.jobs[n].step for r in ready for n in groups[r.group]) + 1
                label = "groups " + ",".join(str(r.group) for r in ready) if len(groups) > 1 else "step"
                self.trainer_side.train(ready, f"{label} {step}/{steps}")
                self.stop_request.check()  # the step is whole: stop before queueing the next
                self._in_flight -= {r.group for r in ready}
                self.trainer_side.regroup(groups, [r.group for r in ready])
                self._admit(groups, [r.group for r in ready])
                queued = [r.group for r in ready if any(self.jobs[n].status == "running" for n in groups[r.group])]
                for g in queued:
                    self._queue(submit_q, groups, g)
                    outstanding += 1
                self._wait_loaded(queued, thread)
        finally:
            stop_watch.set()
            submit_q.put(Stop())
            # a daemon thread stuck in a call into a dead engine stays behind
            wait = 5.0 if self.engine.dead() else STOP_JOIN_S if self.stop_request.requested else JOIN_WAIT_S
            thread.join(timeout=wait)
            if thread.is_alive():
                self.trainer_side.log(f"warning: the engine thread did not stop within {wait:.0f} s; left behind")
            elif self.engine.busy() and not self.engine.dead():  # a stop with rollouts in flight: none outlive
                self.engine.abort_all()  # the loop (the next user of the engine gets it clean)
            self._submit_q = None
        if self.gate is not None:  # an engine call: inside a grant like every other
            with self.gate.phase("reload"):
                self.load_pending()  # the final adapters, for evaluation
        else:
            self.load_pending()

    def _admit(self, groups: list[list[str]], ready: list[int]) -> None:
        """Jobs that join now (`start_after`: once some job of the run has done that many steps) go into
        the lightest group that is generating or has just trained (queued again after this step), with
        their first adapter version exported for that group's next rollouts; when jobs joined or left,
        the split is planned again. Called at a step boundary, on the trainer's thread."""
        done = max((js.step for js in self.jobs.values() if js.status != "waiting"), default=0)
        joining = [n for n, js in self.jobs.items() if js.status == "waiting" and js.cfg.start_after <= done]
        running = {n for n, js in self.jobs.items() if js.status == "running"}
        left, self._running = self._running - running, running | set(joining)
        if not joining and not left:
            return
        cost = {n: float(request_tokens(self.engine_side.requests(n, self.jobs[n].step)[1])) for n in self._running}
        for n in joining:
            js = self.jobs[n]
            js.status = "running"
            self.trainer_side.export_adapters([js], -1, [])
            g = min(set(ready) | self._in_flight, key=lambda g: sum(cost.get(m, 0.0) for m in groups[g]))
            groups[g] = groups[g] + [n]
            self.metrics.write({"job": n, "step": js.step, "event": "joined", "group": g})
            self.trainer_side.log(f"job {n} joins the run in group {g} (start_after = {js.cfg.start_after})")
        self.trainer_side.replan(groups, cost)

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

    # -- arms ----------------------------------------------------------------------------------
    def run(self) -> dict:
        """Run the configured arm; returns the throughput windows (see `throughput`)."""
        sch = self.schedule
        if sch.arm == "dedicated":  # every job alone in its turn: a job that joins later just runs
            for js in self.jobs.values():
                if js.status == "waiting":
                    js.status = "running"
        names = [n for n, js in self.jobs.items() if js.status == "running"]
        if sch.arm == "dedicated":
            windows = []
            for n in names:
                t0 = self.timeline.now()
                self.run_groups([[n]])
                windows.append(measure_window({n: self.jobs[n].step_ends}, t0, sch.warmup_steps))
            return combine_windows(windows)
        n_groups = sch.groups
        # Each job's cost: the tokens of its next step's actual requests (its prompts, tokenized,
        # and the response lengths drawn for them): prompt lengths differ by task, lengths by config.
        cost = {n: request_tokens(self.engine_side.requests(n, self.jobs[n].step)[1]) for n in names} \
            if n_groups > 1 else None
        groups = split_groups(names, n_groups, cost)
        t0 = self.timeline.now()
        self.run_groups(groups)
        self._never_joined()
        w = measure_window({n: self.jobs[n].step_ends for n in names}, t0, sch.warmup_steps)
        w["groups"] = groups
        return w

    def _never_joined(self) -> None:
        """The jobs still waiting to join once the run has ended (the jobs that ran stopped, or ended, before
        their start_after) failed: recorded with why, as a stopped job is."""
        done = max((js.step for js in self.jobs.values() if js.status != "waiting"), default=0)
        for js in self.jobs.values():
            if js.status == "waiting":
                js.status, js.reason = "failed", never_joined(js.cfg.start_after, done)
                self.metrics.write({"job": js.name, "step": js.step, "event": "stopped", "status": "failed",
                                    "reason": js.reason})
                self.trainer_side.log(f"job {js.name} failed: {js.reason}")

