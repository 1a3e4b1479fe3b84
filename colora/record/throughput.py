"""A run's measured window and what is computed over it: steps per device-hour, the busy share of
the timeline, the GPU's utilisation.

Throughput = optimizer steps summed over jobs / device-hours of the steady-state window: from the
moment every job has finished its warm-up steps to the last step's end. The dedicated arm runs each
job alone: its windows add up (one GPU per job, summed).
"""

from __future__ import annotations

from colora.record.runlog import busy_fraction


def measure_window(step_ends: dict[str, list[float]], t0: float, warmup: int) -> dict:
    """Steady-state window over each job's step end times (timeline seconds): from the moment every
    job has finished `warmup` steps (t0 if none) to the last step's end; counts the job-steps that
    ended inside it. The window keeps its inputs (`t0`, `ends`, `warmup`), so that `remeasure` can
    measure it again with another warm-up."""
    ends = {n: list(e) for n, e in step_ends.items() if e}
    if not ends:
        return {"steps": 0, "seconds": 0.0, "start": t0, "end": t0, "t0": t0, "ends": {}, "warmup": warmup}
    start = t0 if warmup == 0 else max((e[warmup - 1] if len(e) >= warmup else e[-1]) for e in ends.values())
    end = max(e[-1] for e in ends.values())
    steps = sum(1 for e in ends.values() for t in e if start < t <= end) if warmup else sum(len(e) for e in ends.values())
    return {"steps": steps, "seconds": end - start, "start": start, "end": end, "t0": t0, "ends": ends,
            "warmup": warmup}


def combine_windows(windows: list[dict]) -> dict:
    """Dedicated arm: each job alone; steps and seconds add up (one GPU per job, summed)."""
    return {"steps": sum(w["steps"] for w in windows), "seconds": sum(w["seconds"] for w in windows),
            "windows": windows}


def shared_window(windows: list[dict]) -> dict:
    """Several processes' windows over one GPU and one clock (the timeslice arm's tenants) measured as
    one run's: `measure_window` over every job's step ends, so the window opens when every job of every
    process has finished its warm-up, as a shared-GPU arm's does; `tenants` keeps the windows given."""
    ends = {n: e for w in windows for n, e in w.get("ends", {}).items()}
    t0 = min((w["t0"] for w in windows if "t0" in w), default=0.0)
    warmup = max((w.get("warmup", 0) for w in windows), default=0)
    return {**measure_window(ends, t0, warmup), "tenants": windows}


def remeasure(window: dict, warmup: int) -> dict | None:
    """The same run's window measured with another warm-up, from the step ends it kept; None for a
    window that kept none (summaries written before windows kept them)."""
    ws = window.get("windows", [window])
    if any("ends" not in w for w in ws):
        return None
    again = [measure_window(w["ends"], w["t0"], warmup) for w in ws]
    return combine_windows(again) if "windows" in window else {**again[0], "groups": window.get("groups")}


def steps_per_job(window: dict) -> dict[str, int]:
    """How many of each job's steps the window counts (`measure_window`'s rule); {} for a window that
    kept no step ends."""
    out: dict[str, int] = {}
    for w in window.get("windows", [window]):
        for n, e in w.get("ends", {}).items():
            out[n] = sum(1 for t in e if w["start"] < t <= w["end"]) if w.get("warmup") else len(e)
    return out


def throughput(window: dict) -> float:
    """Optimizer steps summed over jobs per device-hour."""
    return window["steps"] / window["seconds"] * 3600.0 if window["seconds"] > 0 else float("nan")


def busy(spans: list[dict], window: dict) -> float | None:
    """The share of the window in which the timeline shows work (busy_fraction); dedicated:
    time-weighted over each job's own window."""
    if "windows" in window:
        tot = sum(w["seconds"] for w in window["windows"])
        if tot <= 0:
            return None
        return sum(busy_fraction(spans, w["start"], w["end"]) * w["seconds"] for w in window["windows"]) / tot
    return busy_fraction(spans, window["start"], window["end"]) if window["seconds"] > 0 else None


def gpu_util(gpu, window: dict) -> float | None:
    """NVML's mean busy share over the measured window(s), time-weighted; None without NVML."""
    ws = window.get("windows", [window])
    vals = [(gpu.mean_between(w["start"], w["end"]), w["seconds"]) for w in ws if w["seconds"] > 0]
    vals = [(v, s) for v, s in vals if v is not None]
    tot = sum(s for _, s in vals)
    return sum(v * s for v, s in vals) / tot if tot else None


# A window's steps per hour is one ratio of two totals; over a few steps one slow step (a compile, a
# stall) moves it by a large share, and over a few seconds so do the timer and the scheduler. Below
# either bound a report says that the figure does not mean much (a judgement, not a measurement).
SHORT_WINDOW_S = 30.0
SHORT_WINDOW_STEPS = 5  # measured steps per job


def short_window(seconds: float, steps: int, jobs: int) -> str | None:
    """Why a measured window is too short for its steps per hour to mean much, or None."""
    per_job = steps / max(1, jobs)
    if seconds >= SHORT_WINDOW_S and per_job >= SHORT_WINDOW_STEPS:
        return None
    return (f"measured over {seconds:.1f} s and {per_job:.3g} step{'' if per_job == 1 else 's'} per job: too short "
            "for the figure to mean much "
            f"(under {SHORT_WINDOW_S:.0f} s or {SHORT_WINDOW_STEPS} steps per job)")


def rate_line(summary: dict) -> str:
    """A finished run's steps per device-hour for its line in a sweep, with the note the closing table
    and the report give where its measured window is too short for the figure to mean much, and how
    many of its jobs failed (the figure counts the others' steps only)."""
    sph = summary.get("steps_per_hour")
    rate = f"{sph:.0f} steps/h" if isinstance(sph, (int, float)) else f"steps/h {sph}"
    notes = [failed_note(summary), short_window(float(summary.get("seconds_measured") or 0.0),
                                                int(summary.get("steps_measured") or 0),
                                                len(summary.get("jobs") or {}) or 1)]
    notes = [n for n in notes if n]
    return f"{rate} ({'; '.join(notes)})" if notes else rate


def failed_note(summary: dict) -> str | None:
    """"N of M jobs failed" where a run's summary names failed jobs, else None."""
    failed = summary.get("failed_jobs") or []
    return f"{len(failed)} of {len(summary.get('jobs') or {}) or len(failed)} jobs failed" if failed else None
