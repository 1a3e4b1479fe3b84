"""The co-runner's engine thread: the only thread that calls the engine.

It takes `Generate` records from the trainer's thread (colora/corun/handoff.py), loads each group's new
adapter versions in one call, queues the group's rollouts into the running engine, steps the engine
and hands every finished group back. vLLM batches continuously: a group queued while another is still
decoding joins those sequences instead of waiting for their long tail. It reads nothing of the
trainer's job state: a `Generate` names each job's step and carries its new adapter version.
"""

from __future__ import annotations

import contextlib
import math
import queue
import shutil
from pathlib import Path
from typing import Any

from colora.config import JobConfig
from colora.corun.handoff import Drop, EngineFailure, Failed, Generate, Generated, Shipping, Stop
from colora.corun.rollouts import Prompts, step_requests
from colora.engine.adapters import Adapter, AdapterDir
from colora.engine.rollout import GenRequest, GenResult
from colora.record.runlog import JsonlWriter, Timeline
from colora.stopping import StopRequest
from colora.training.trainer import JobFailure

QUEUE_WAIT_S = 0.5  # the longest the thread waits on its queue before it looks whether a stop was requested


class EngineSide:
    """engine: a RolloutEngine or RemoteEngine; specs: each job's config and task (read only); seed:
    the run's seed, from which every request's seed is derived (colora/corun/rollouts.py)."""

    def __init__(self, engine, prompts: Prompts, specs: dict[str, tuple[JobConfig, Any]], seed: int,
                 timeline: Timeline, metrics: JsonlWriter, shipping: Shipping, stop_request: StopRequest,
                 task_timeout_s: float = math.inf):
        self.engine = engine
        self.prompts = prompts
        self.specs = specs
        self.seed = seed
        self.timeline = timeline
        self.metrics = metrics
        self.shipping = shipping
        self.stop_request = stop_request
        self.task_timeout_s = task_timeout_s  # runtime.task_timeout_s: a job's task code, per call

    def requests(self, job: str, step: int) -> tuple[list, list[GenRequest]]:
        """The job's items and engine requests of `step` (a function of the run seed, job and step); a
        JobFailure where the job's task fails to make them or makes a prompt the engine cannot take. An
        sft job's items are its step's conversations, and it asks nothing of the engine."""
        cfg, task = self.specs[job]
        if cfg.kind == "sft":  # `task` is its SftData (colora/training/sft_data.py)
            return task.batch(step, cfg.prompts_per_step), []
        return step_requests(task, cfg, self.seed, step, self.prompts, getattr(self.engine, "max_model_len", 0),
                             self.task_timeout_s)

    def load(self, adapters: list[Adapter], group: int) -> None:
        """Load a group's exported adapter versions into the engine in one call (`set_adapters`).
        Each version's `adapter_seconds` in the reload span is its share of that call: the call's
        seconds over the versions it loaded. A version that went by disk replaces the directory of
        its predecessor, which is removed."""
        if not adapters:
            return
        with self.shipping(), self.timeline.span("reload", group=group, jobs=tuple(a.job for a in adapters),
                                                 adapter_seconds={}) as span:
            share = self.engine.set_adapters(list(adapters)) / len(adapters)
            for a in adapters:
                span["adapter_seconds"][f"{a.job}@v{a.version}"] = round(share, 6)
                via = "disk" if isinstance(a, AdapterDir) else "memory"
                self.metrics.write({"job": a.job, "event": "reload", "version": a.version, "seconds": share,
                                    "via": via, "batch": len(adapters)})
                if via == "disk":
                    old = Path(a.path).parent / f"v{a.version - 1}"
                    if old.exists():
                        shutil.rmtree(old, ignore_errors=True)

    def submit(self, msg: Generate) -> tuple[dict, dict]:
        """Load the group's new adapters, then queue one step of rollouts for its running jobs.
        Returns ({job: items} for the scoring of this step, {job: why} for the jobs that failed to make
        their requests: the others' go to the engine as ever). Stopped jobs' adapters leave it first."""
        for job in msg.drops:
            self.engine.drop(job)
        self.load(list(msg.adapters), msg.group)
        items, reqs, failed = {}, [], {}
        for name, step in msg.jobs:
            try:
                items[name], rq = self.requests(name, step)
            except JobFailure as f:
                failed[name] = f.reason
                continue
            reqs += rq
        self.engine.submit(msg.group, reqs)
        return items, failed

    def loop(self, submit_q: queue.Queue, done_q: queue.Queue) -> None:
        """Take groups to generate for, keep the engine stepping, hand every finished group's rollouts
        to the trainer. Any exception is handed over too. Ends on a Stop or a stop request."""
        inflight: dict[int, tuple[dict, dict, float, float]] = {}
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
                    inflight[msg.group] = (*self.submit(msg), t0, msg.queued_at)
                    msg.loaded.set()
                for g, results in self.engine.poll():
                    items, failed, t0, queued = inflight.pop(g)
                    end = self.timeline.now()
                    # queued: when the trainer handed the group over (t0 - queued: the engine thread's delay)
                    self.timeline.add("generate", t0, end, group=g, jobs=tuple(items), sequences=len(results),
                                      queued=round(queued, 6))
                    by_job: dict[str, list[GenResult]] = {n: [] for n in items}
                    for r in results:
                        by_job[r.request.job].append(r)
                    done_q.put(Generated(g, {n: (items[n], by_job[n]) for n in items}, end - t0, failed))
        except BaseException as e:  # the trainer thread re-raises it
            err = EngineFailure(f"{type(e).__name__}: {e}")
            err.__cause__ = e
            done_q.put(Failed(err))
