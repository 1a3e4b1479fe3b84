"""What a run's summary.json holds: `RunSummary`, written last, so that it marks a complete run.

Reports (colora/studies/report.py, the arms benchmark), sweeps and the command line read these keys.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

NO_SIGNAL_STEPS = 5  # steps in a row without reward variance that get a warning (here and during the run)


@dataclass
class JobSummary:
    """One job's outcome."""

    # done | stopped | failed (never joined: its start_after was not reached) | running (a run that ended before
    # the job's last step)
    status: str
    reason: str  # why it stopped or failed ("" otherwise)
    steps: int  # optimizer steps done
    version: int  # its adapter's version at the end
    mean_reward: float | None  # the mean over its ok steps of the step's mean reward
    eval_before: float | None  # held-out accuracy before training (greedy); None without eval
    eval_after: float | None
    # steps in which every group's rewards were equal (zero advantages: no gradient from the reward),
    # and the longest run of them in a row
    no_signal_steps: int = 0
    no_signal_streak: int = 0
    kind: str = "grpo"  # grpo | sft (an sft job has no reward: its loss and held-out loss instead)
    mean_loss: float | None = None  # an sft job's mean over its ok steps of the step's loss (NLL per token)
    eval_loss_before: float | None = None  # an sft job's held-out loss before training; None without eval
    eval_loss_after: float | None = None


@dataclass
class RunSummary:
    experiment: str
    arm: str
    seed: int
    config_hash: str  # Config.hash(): the experiment, not the run options
    code_version: dict  # the git commit and a hash of the source tree (colora/record/provenance.py)
    runtime: dict  # the run options ([runtime]) the run executed with
    model: str  # the model directory
    device: str
    dtype: str
    mps: str  # how MPS was used, or why not
    engine_start_s: float  # reported apart from the throughput
    engine_reused: bool  # the engine of an earlier run in this process (no start)
    engine_process: bool  # the engine's client ran in a process of its own
    adapter_sync: str  # how adapter versions reached the engine: memory or disk (colora/engine/adapters.py)
    packed_rows: bool  # the trainer packed each micro-batch's sequences into one row
    trainer_setup_s: float
    trainer_sm_count: int | None  # the SMs the trainer's CUDA context sees (fewer under an MPS share)
    steps_measured: int  # job-steps in the steady-state window (colora/record/throughput.py)
    seconds_measured: float
    steps_per_hour: float  # optimizer steps summed over jobs per device-hour
    groups: list[list[str]] | None  # the final split into phase-offset groups
    busy_fraction: float | None  # the share of the window with a phase running
    gpu_util: float | None  # NVML's mean busy share over the window; None without NVML
    wall_s: float  # the run's own wall time, engine start included
    jobs: dict[str, JobSummary] = field(default_factory=dict)
    window: dict[str, Any] = field(default_factory=dict)  # the measured window(s)
    warnings: list[str] = field(default_factory=list)  # what the run's outcome should be read with (`warnings`)
    # the trainer's process's caching-allocator peaks, GiB: {"allocated": ..., "reserved": ...}; None off a GPU
    trainer_peak_gib: dict[str, float] | None = None
    # the jobs that failed (stopped with a reason, or lost with their co-runner), from `jobs`: a run
    # with any is complete (its other jobs' results stand) but did not get every job through
    failed_jobs: list[str] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.failed_jobs = failed_jobs(self.jobs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def trainer_gpu_view(device: str) -> tuple[int | None, dict[str, float] | None]:
    """What the trainer's process saw of the GPU: the SMs its CUDA context has (fewer under an MPS share
    below 100) and its caching allocator's peaks in GiB (allocated, and reserved: allocated plus what the
    allocator held unused); (None, None) off a GPU."""
    if device != "cuda":
        return None, None
    import torch

    gib = 2**30
    return (torch.cuda.get_device_properties(0).multi_processor_count,
            {"allocated": round(torch.cuda.max_memory_allocated() / gib, 2),
             "reserved": round(torch.cuda.max_memory_reserved() / gib, 2)})


FAILED = ("stopped", "failed")  # a job's status when it did not get through: stopped by the run, lost with a co-runner


def never_joined(start_after: int, done: int) -> str:
    """The reason of a job that was still waiting to join when its run ended: the jobs that ran stopped
    or ended before any of them had done `start_after` steps (the most was `done`)."""
    return (f"never joined: start_after = {start_after} was not reached (the jobs that ran did at most {done} steps "
            "before they ended or stopped); it did not train, and no adapter of it is exported")


def failed_jobs(jobs: dict) -> list[str]:
    """The names of the jobs (JobSummary or its dict, as summary.json holds it) that failed."""
    return [n for n, j in jobs.items() if (j.get("status") if isinstance(j, dict) else j.status) in FAILED]


def job_summaries(jobs: dict, bank, rows: list[dict], before: dict, after: dict) -> dict[str, JobSummary]:
    """Each job's outcome from its state (`corunner.JobState`), the adapter bank, the run's metric
    rows and its evaluations before and after training."""
    out = {}
    for name, js in jobs.items():
        ok = sorted((r for r in rows if r.get("job") == name and r.get("status") == "ok"), key=lambda r: r["step"])
        rs = [r["reward"] for r in ok if "reward" in r]
        ls = [r["loss"] for r in ok if "reward" not in r and "loss" in r]
        steps, streak = no_signal([r.get("flat_groups") == 1.0 for r in ok if "reward" in r])
        out[name] = JobSummary(js.status, js.reason, js.step, bank.jobs[name].version,
                               sum(rs) / len(rs) if rs else None,
                               before.get(name, {}).get("accuracy"), after.get(name, {}).get("accuracy"),
                               steps, streak, js.cfg.kind, sum(ls) / len(ls) if ls else None,
                               before.get(name, {}).get("loss"), after.get(name, {}).get("loss"))
    return out


def no_signal(flat: list[bool]) -> tuple[int, int]:
    """(steps without reward variance, the longest run of them in a row) of one job's steps in order."""
    longest = run = 0
    for f in flat:
        run = run + 1 if f else 0
        longest = max(longest, run)
    return sum(flat), longest


def warnings(jobs: dict[str, JobSummary]) -> list[str]:
    """A line per job whose reward gave it no gradient in the whole run, or for NO_SIGNAL_STEPS steps in
    a row or more (a job can learn from its other steps: the line says how many there were)."""
    out = []
    for name, j in jobs.items():
        if j.steps and j.no_signal_steps == j.steps:
            out.append(f"job {name}: every group's rewards were equal at every one of its {j.steps} steps: it got "
                       "no gradient from its reward and learned nothing (a task too hard or too easy for the model, "
                       "or a reward that does not depend on the completion?)")
        elif j.no_signal_streak >= NO_SIGNAL_STEPS:
            out.append(f"job {name}: every group's rewards were equal for {j.no_signal_streak} steps in a row "
                       f"({j.no_signal_steps} of its {j.steps} steps in all): its reward gave it no gradient in "
                       f"those steps, only in the other {j.steps - j.no_signal_steps}")
    return out
