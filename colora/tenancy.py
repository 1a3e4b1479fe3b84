"""Which jobs run how: each job's `finetune`, and the time-slicing arm's tenants.

A LoRA job (`finetune = "lora"`, the default) trains an adapter over the base model the run's jobs share,
on one engine and one trainer. A full-parameter job (`finetune = "full"`) trains every weight of a model of
its own, with an engine and a trainer of its own (colora/training/full.py, colora/engine/weights.py), so it
runs where a job has those to itself:

- `experiment.arm = "dedicated"`, as the run's only job (a dedicated run's jobs share one engine and one
  trainer, each alone in its turn; a full job's weights would not be the next job's base);
- `experiment.arm = "timeslice"`, as a tenant of its own beside the other tenants, LoRA ones included
  (`tenant_units`: every full job alone, the LoRA jobs `timeslice.tenant_jobs` at a time, in config order).

Not built, and refused by name: a full job in the arms that share one engine and trainer (shared_sync,
overlap, mps, overlap_mps), a KL term (its reference is the frozen base, which a full job does not keep), a
full job that joins later (`start_after`: its tenant holds it alone), and its engine's client in a process
of its own (`runtime.engine_process = "on"`: the weight load goes through vLLM's collective_rpc in the
trainer's process). This module also checks the `[timeslice]` section.
"""

from __future__ import annotations

from typing import Any, Callable

FULL_ARMS = ("dedicated", "timeslice")


def tenant_units(cfg) -> list[list[str]]:
    """The jobs of each tenant of the time-slicing arm: the LoRA jobs `timeslice.tenant_jobs` at a time in
    config order, then every full-parameter job alone."""
    lora = [j.name for j in cfg.jobs if j.finetune == "lora"]
    k = cfg.timeslice.tenant_jobs
    return [lora[i:i + k] for i in range(0, len(lora), k)] + [[j.name] for j in cfg.jobs if j.finetune == "full"]


def is_full(cfg) -> bool:
    """Whether the run's job is a full-parameter one (such a run holds that job alone)."""
    return any(j.finetune == "full" for j in cfg.jobs)


def check_tenancy(cfg, need: Callable[[bool, str, Any, str], None]) -> None:
    """The checks above; `need(ok, key, value, accepted)` raises the config's error naming the key."""
    ts, arm = cfg.timeslice, cfg.experiment.arm
    need(ts.tenant_jobs >= 1, "timeslice.tenant_jobs", ts.tenant_jobs, "must be at least 1")
    need(ts.hold_timeout_s > 0, "timeslice.hold_timeout_s", ts.hold_timeout_s, "must be above 0")
    need(ts.memory_gib >= 0, "timeslice.memory_gib", ts.memory_gib, "must be at least 0 (0: the GPU's memory)")
    need(not ts.memory_gib or ts.park == "memory", "timeslice.memory_gib", ts.memory_gib,
         f"is for timeslice.park = \"memory\" (it is {ts.park!r}): set it to 0, or park = \"memory\"")
    full = [(i, j) for i, j in enumerate(cfg.jobs) if j.finetune == "full"]
    for i, j in full:
        p = f"jobs.{i}"
        need(arm in FULL_ARMS, f"{p}.finetune", j.finetune,
             f"runs in experiment.arm \"dedicated\" or \"timeslice\" (its own weights, engine and trainer), not in "
             f"{arm!r}, whose jobs share one engine and trainer; accepted there: finetune = \"lora\"")
        need(arm != "dedicated" or len(cfg.jobs) == 1, f"{p}.finetune", j.finetune,
             f"in the dedicated arm is its run's only job ({len(cfg.jobs)} jobs here: a dedicated run's jobs share "
             f"one engine and trainer); run it alone (--set jobs={j.name}) or in experiment.arm = \"timeslice\"")
        need(j.kl_coef == 0, f"{p}.kl_coef", j.kl_coef,
             "must be 0 for finetune = \"full\": the KL term's reference is the frozen base model, which a "
             "full-parameter job does not keep (not built)")
        need(j.start_after == 0, f"{p}.start_after", j.start_after,
             "must be 0 for finetune = \"full\": its engine and trainer are its own, there is no run to join")
    if full:
        need(cfg.runtime.engine_process != "on", "runtime.engine_process", cfg.runtime.engine_process,
             "must be \"auto\" or \"off\" with a finetune = \"full\" job: its weights reach its engine through "
             "vLLM's collective_rpc in the trainer's process")
