"""Which jobs go to which co-runner, and one summary from the co-runners' summaries: pure functions.

A job's phase cost is the tokens it makes a step (prompts x samples x expected response length):
the engine decodes them and the trainer runs every one forward and back, so both phases scale with
it. Jobs are placed longest-first on the least-loaded co-runner that has room, K = ceil(jobs / GPUs)
a co-runner at most, so the co-runners' cycles are about equally long and none holds more adapters
than the others need.

Throughput over several GPUs keeps the one-GPU definition (docs/architecture.md): optimizer steps summed over
jobs per GPU-hour, here summed steps over summed GPU-seconds of the co-runners' measured windows, so
the figure of N co-runners compares with one GPU's as it is; `aggregate_steps_per_hour` is the
cluster's rate with every co-runner running at once (the sum of their rates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from colora.config import Config, JobConfig, from_dict
from colora.record.summary import failed_jobs


def job_cost(job: JobConfig) -> float:
    """Tokens one step of `job` generates, expected: workloads that set lengths give them (the mean
    of the lognormal draw, capped at max_new_tokens); natural EOS counts max_new_tokens, a bound."""
    r = job.response_length
    length = job.max_new_tokens
    if r.dist == "lognormal":
        length = min(job.max_new_tokens, max(r.min, r.median * math.exp(r.sigma ** 2 / 2)))
    return float(job.prompts_per_step * job.samples_per_prompt * length)


def place_jobs(cost: dict[str, float], n: int) -> list[list[str]]:
    """`n` shares of the jobs in `cost` ({job: phase cost}), each at most ceil(jobs / n) long,
    balanced longest-processing-time-first (ties by name); each share keeps the jobs' given order."""
    jobs = list(cost)
    if not 1 <= n <= len(jobs):
        raise ValueError(f"--gpus ({n}) must be from 1 to the number of jobs ({len(jobs)}): a co-runner without "
                         "jobs would hold a GPU for nothing")
    cap = math.ceil(len(jobs) / n)
    shares: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for j in sorted(jobs, key=lambda j: (-cost[j], j)):
        i = min((i for i in range(n) if len(shares[i]) < cap), key=lambda i: (load[i], len(shares[i]), i))
        shares[i].append(j)
        load[i] += cost[j]
    order = {j: k for k, j in enumerate(jobs)}
    return [sorted(s, key=order.__getitem__) for s in shares]


def share_config(cfg: Config, names: list[str]) -> Config:
    """The experiment with only the jobs `names`: every other setting (seed, arm, engine) as it is.
    Per-request seeds derive from (run seed, job, step), so a job samples the same prompts and
    seeds in whichever co-runner it runs."""
    d = cfg.to_dict()
    d["jobs"] = [j for j in d["jobs"] if j["name"] in set(names)]
    return from_dict(d)


@dataclass
class Outcome:
    """How one co-runner's run ended: its summary when complete, else the reason it failed and the
    optimizer steps each of its jobs had finished (from its metrics)."""

    index: int
    dir: str  # the run directory, relative to the merged one
    jobs: list[str]
    summary: dict | None = None
    error: str | None = None
    steps_done: dict[str, int] = field(default_factory=dict)
    started: float = 0.0  # wall-clock seconds (time.time) when its co-runner was asked for ...
    ended: float = 0.0  # ... and when it was let go: the span it held its GPU, start-up included
    info: dict = field(default_factory=dict)  # where it ran: host, pid, GPU ids

    @property
    def held_s(self) -> float:
        return self.ended - self.started

    @property
    def state(self) -> str:
        return "complete" if self.summary is not None else "failed"


def merge_summaries(cfg: Config, outcomes: list[Outcome]) -> dict:
    """One summary for a run over several co-runners (module docstring: the throughput); a failed
    co-runner's jobs are `failed` with its reason and its steps are not counted."""
    done = [o for o in outcomes if o.summary is not None]
    steps = sum(o.summary["steps_measured"] for o in done)
    secs = sum(o.summary["seconds_measured"] for o in done)
    jobs = {}
    for o in outcomes:
        for name in o.jobs:
            if o.summary is not None:
                jobs[name] = {**o.summary["jobs"][name], "corunner": o.index}
            else:
                jobs[name] = {"status": "failed", "reason": f"co-runner {o.index} failed: {o.error}",
                              "steps": o.steps_done.get(name, 0), "version": None, "mean_reward": None,
                              "eval_before": None, "eval_after": None, "corunner": o.index}
    rates = [o.summary["steps_per_hour"] for o in done]
    return {
        "experiment": cfg.experiment.name, "arm": cfg.experiment.arm, "seed": cfg.experiment.seed,
        "config_hash": cfg.hash(), "gpus": len(outcomes),
        "steps_measured": steps, "seconds_measured": secs,
        "steps_per_hour": steps / secs * 3600.0 if secs > 0 else float("nan"),
        "aggregate_steps_per_hour": sum(r for r in rates if math.isfinite(r)),
        "gpu_seconds_held": sum(o.held_s for o in outcomes),
        "engine_start_s": max((o.summary["engine_start_s"] for o in done), default=float("nan")),
        "failed_corunners": [o.index for o in outcomes if o.summary is None],
        "corunners": {str(o.index): {"state": o.state, "dir": o.dir, "jobs": o.jobs, "error": o.error,
                                     "held_s": o.held_s, **o.info,
                                     **({k: o.summary[k] for k in ("steps_measured", "seconds_measured",
                                                                   "steps_per_hour", "engine_start_s", "wall_s",
                                                                   "device", "mps")} if o.summary else {})}
                      for o in outcomes},
        "jobs": jobs,
        "failed_jobs": failed_jobs(jobs),  # as a one-GPU run's summary names them (colora/record/summary.py)
    }


def merge_eval(evals: list[dict]) -> dict:
    """One eval.json from the co-runners' ({n, before, after} each; jobs are disjoint)."""
    out: dict = {"n": None, "before": {}, "after": {}}
    for e in evals:
        out["n"] = e.get("n", out["n"])
        out["before"].update(e.get("before", {}))
        out["after"].update(e.get("after", {}))
    return out
