"""The co-runner's trainer thread: what it does with a group's rollouts.

One shared optimizer step for every job of the groups whose rollouts are back (each job's own update,
colora/training/trainer.py), its metrics, each new adapter version exported for the engine
(colora/training/export.py), a job stopped where its step failed, and the groups weighed again once
every job is past its warm-up (colora/corun/grouping.py). It never calls the engine: what the engine thread
needs goes in a `Generate` (colora/corun/handoff.py) that the co-runner queues.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from colora.config import JobConfig
from colora.corun.grouping import plan_regroup
from colora.corun.handoff import Generated, Shipping
from colora.corun.rollouts import score
from colora.engine.adapters import Adapter
from colora.engine.rollout import GenResult
from colora.record import compilewatch
from colora.record.runlog import JsonlWriter, Timeline
from colora.record.summary import NO_SIGNAL_STEPS
from colora.training import grpo
from colora.training.export import AdapterExport
from colora.training.failed_step import keep_failed_step
from colora.training.lora import AdapterBank
from colora.training.sft_data import datums as sft_datums
from colora.training.trainer import JobFailure, MultiJobTrainer


@dataclass
class JobState:
    cfg: JobConfig
    task: Any  # colora.tasks.Task
    step: int = 0  # optimizer steps done
    status: str = "running"  # waiting (to join the run) | running | done | stopped
    reason: str = ""
    step_ends: list[float] = field(default_factory=list)  # timeline time at the end of each step
    pending: Adapter | None = None  # the exported adapter version waiting to be loaded

    @property
    def name(self) -> str:
        return self.cfg.name


class TrainerSide:
    """steps and warmup_steps: experiment.steps and experiment.warmup_steps, what this side reads of
    the config; drop(job) takes a stopped job's adapter out of the engine (through the engine thread
    while it runs); decode(results) fills in the texts of the engine's results."""

    def __init__(self, jobs: dict[str, JobState], trainer: MultiJobTrainer, bank: AdapterBank,
                 export: AdapterExport, *, steps: int, warmup_steps: int, timeline: Timeline,
                 metrics: JsonlWriter, shipping: Shipping, drop: Callable[[str], None],
                 decode: Callable[[list[GenResult]], None], log: Callable[[str], None] = print,
                 on_step: Callable[[], None] | None = None, task_timeout_s: float = math.inf, gate=None):
        self.jobs = jobs
        self.trainer = trainer
        self.bank = bank
        self.export = export
        self.steps = steps
        self.warmup_steps = warmup_steps
        self.timeline = timeline
        self.metrics = metrics
        self.shipping = shipping
        self.drop = drop
        self.decode = decode
        self.log = log
        self.on_step = on_step  # checkpoint hook, called after each group step
        self.task_timeout_s = task_timeout_s  # runtime.task_timeout_s: a job's reward code, per step
        self.gate = gate  # the time-slicing arm's: the step and its export inside one grant (CoRunner)
        self._used_tokens: dict[str, list[int]] = {}  # job -> prompt + completion tokens of each step
        self._regroup: dict[str, int] | None = None  # job -> planned group, while moves are pending
        self._regroup_decided = False
        self._flat: dict[str, int] = {}  # job -> steps in a row whose groups all had equal rewards

    def train(self, ready: list[Generated], progress: str) -> None:
        """One shared optimizer step for every job of the ready groups (each job's own update)."""
        gen, t_gen, group_of = {}, {}, {}
        for r in ready:
            for name, why in r.failed.items():
                self.stop(self.jobs[name], why)
            for name, (items, results) in r.jobs.items():
                gen[name], t_gen[name], group_of[name] = (items, results), r.seconds, r.group
        groups = tuple(r.group for r in ready)
        group = groups[0] if len(groups) == 1 else -1
        rollouts, rewards, sft = {}, {}, {}
        for name, (items, results) in gen.items():
            js = self.jobs[name]
            if js.cfg.kind == "sft":  # its step's conversations: no rollouts to score
                sft[name] = sft_datums(items)
                continue
            self.decode(results)
            try:
                rollouts[name] = score(js.task, js.cfg, items, results, self.task_timeout_s)
                rewards[name] = float(np.mean([r.reward for r in rollouts[name]]))
            except JobFailure as f:
                self.stop(js, f.reason)
        if not rollouts and not sft:
            return
        if self.gate is not None:  # scoring ran on the CPU, outside the grant
            self.gate.acquire("train")
        t0 = time.perf_counter()
        before = compilewatch.snapshot()
        at = {n: self.jobs[n].step for n in (*rollouts, *sft)}  # each job's step being trained
        with self.timeline.span("train", group=group, groups=list(groups), jobs=(*rollouts, *sft)) as span:
            stats = self.trainer.step(rollouts, sft)
            self._count_steps(stats)  # first: a checkpoint taken after any later error holds whole steps
            compiled = compilewatch.since(before)
            if compiled:  # the usual cause of a step far slower than the others
                span["compiles"] = compiled
        if any(st.failure for st in stats.values()) and rollouts:  # sft datums alone: nothing to replay
            kept = keep_failed_step(self.metrics.path.parent, min(at.values()), group, rollouts, stats, self.bank)
            self.log(f"kept what the failed training step ran on in {kept} (colora replay-step DIR runs it again)")
        t_train = time.perf_counter() - t0
        parts, exports = [], []
        for name, st in stats.items():
            js = self.jobs[name]
            row = {"job": name, "step": at[name], "group": group_of[name], "kind": js.cfg.kind,
                   **(self._rl_row(rollouts[name], rewards[name]) if name in rollouts else {}),
                   "t_generate": t_gen[name], "t_train": t_train, **st.__dict__}
            if st.failure:
                self.metrics.write({**row, "status": "stopped"})
                self.stop(js, st.failure)
                continue
            exports.append(js)
            self._used_tokens.setdefault(name, []).append(
                sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts[name]) if name in rollouts
                else sum(len(d.tokens) for d in sft[name]))
            self.metrics.write({**row, "status": "ok"})
            if name in rollouts:
                self._warn_flat(name, row["flat_groups"] == 1.0)
            parts.append(f"{name} r={rewards[name]:.2f}" if name in rewards else f"{name} loss={st.loss:.3f}")
        self.export_adapters(exports, group, list(groups))
        self.log(f"{progress} | {' '.join(parts)} | gen {max(t_gen.values()):.1f}s train {t_train:.1f}s")
        if self.on_step is not None:  # the checkpoint's snapshot: inside the grant, before a PARK can empty it
            self.on_step()
        if self.gate is not None:
            self.gate.yield_()

    def _count_steps(self, stats: dict) -> None:
        """Each job whose update was applied has done one more step (at the timeline's time now); one
        that reached its steps is done. Runs right after the optimizer, before anything else can raise."""
        now = self.timeline.now()
        for name, st in stats.items():
            js = self.jobs[name]
            if st.failure:
                continue
            js.step += 1
            js.step_ends.append(now)
            if js.step >= (js.cfg.steps or self.steps):  # its own steps, else the experiment's
                js.status = "done"

    @staticmethod
    def _rl_row(rs: list, reward: float) -> dict:
        """What a grpo job's metrics row holds of its step's rollouts."""
        by_prompt: dict[int, list[float]] = {}
        for r in rs:
            by_prompt.setdefault(r.prompt_index, []).append(r.reward)
        return {"reward": reward, "rollout_versions": sorted({r.version for r in rs}),
                "reward_std": float(np.std([r.reward for r in rs])),
                # the share of its prompts whose samples all got one reward: no gradient from them
                "flat_groups": grpo.flat_groups(torch.tensor(list(by_prompt.values()), dtype=torch.float64)),
                "response_len": float(np.mean([len(r.completion_ids) for r in rs])),
                "truncated_frac": float(np.mean([r.finish_reason == "length" for r in rs]))}

    def _warn_flat(self, name: str, flat: bool) -> None:
        """Say so the moment a job has had no reward variance in any group for NO_SIGNAL_STEPS steps
        in a row (the summary counts every such step: colora/record/summary.py)."""
        self._flat[name] = self._flat.get(name, 0) + 1 if flat else 0
        if self._flat[name] == NO_SIGNAL_STEPS:
            self.log(f"warning: job {name}: every group's rewards were equal for {NO_SIGNAL_STEPS} steps in a row, so "
                     "it got no gradient from them (its task may be too hard or too easy for the model, or its "
                     "reward may not depend on the completion)")

    def export_adapters(self, exports: list[JobState], group: int, groups: list[int]) -> None:
        """Export each job's new adapter version for the engine (colora/training/export.py); the engine
        thread loads it before the job's next rollouts. The export span times each version
        (`adapter_seconds`)."""
        if not exports:  # every job of the step stopped
            return
        with self.shipping(), self.timeline.span("export", group=group, groups=groups, adapter_seconds={},
                                                 jobs=tuple(js.name for js in exports)) as span:
            for js in exports:
                t0 = time.perf_counter()
                try:
                    js.pending = self.export.export(self.bank, js.name)
                except OSError as e:  # a full disk or /dev/shm: this job's version cannot reach the engine
                    self.stop(js, f"its adapter version {self.bank.jobs[js.name].version} could not be exported "
                                  f"({type(e).__name__}: {e})")
                    continue
                span["adapter_seconds"][f"{js.name}@v{js.pending.version}"] = round(time.perf_counter() - t0, 6)

    def stop(self, js: JobState, reason: str) -> None:
        """Stop one job: recorded with its reason, its adapter taken out of the shared engine (a
        diverged adapter must not stay beside the others), the other jobs go on."""
        js.status, js.reason, js.pending = "stopped", reason, None
        self.metrics.write({"job": js.name, "step": js.step, "event": "stopped", "status": "stopped", "reason": reason})
        self.log(f"job {js.name} stopped: {reason}")
        self.drop(js.name)
        self.export.release(js.name)

    def regroup(self, groups: list[list[str]], ready: list[int]) -> None:
        """Weigh the split again on measured tokens once every job is past its warm-up (once per
        run), then move the planned jobs of the groups in `ready` (just trained, not yet queued
        again). Groups are replaced, never edited in place."""
        if len(groups) < 2:
            return
        running = [n for g in groups for n in g if self.jobs[n].status == "running"]
        if not self._regroup_decided:
            after = max(1, self.warmup_steps)
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

    def replan(self, groups: list[list[str]], cost: dict[str, float]) -> None:
        """Plan the split again after jobs joined or left (`cost`: each running job's tokens a step, as
        measured where it has run, else as its next requests ask); the moves happen as in `regroup`,
        each right after the job's own step. Only once the warm-up's split has been decided: before
        that, `regroup` weighs every running job anyway."""
        if len(groups) < 2 or not self._regroup_decided:
            return
        measured = {n: float(np.mean(v)) for n, v in self._used_tokens.items() if v}
        running = {n: measured.get(n, c) for n, c in cost.items()}
        live = [[n for n in g if n in running] for g in groups]
        if len(running) < 2:
            return
        self._regroup = plan_regroup(live, running)
        if self._regroup is not None:
            self.metrics.write({"event": "replan", "plan": self._regroup,
                                "loads": [round(sum(running[n] for n in g)) for g in live]})

    def take_pending(self, names: list[str]) -> tuple[Adapter, ...]:
        """The exported versions of these jobs not yet handed to the engine, handed over now."""
        out = []
        for n in names:
            js = self.jobs[n]
            if js.pending is not None:
                out.append(js.pending)
                js.pending = None
        return tuple(out)
