"""The figures of `colora bench serve` (colora/bench/serve.py) from what its runs wrote: the server's stats.jsonl
(a row per trainer cycle, colora/service/scheduler.py) and the client runs' metrics.jsonl and summary.json;
and its report.md. Pure functions of those rows.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from colora.record.runlog import read_jsonl


def _inside(t: float, windows: list[tuple[float, float]]) -> bool:
    return any(a < t <= b for a, b in windows)


def cycles(rows: list[dict], windows: list[tuple[float, float]]) -> dict:
    """The server's trainer cycles that ended inside the windows (time.time() spans): how many; of those with
    training work (forward or optimizer), the models per cycle (mean, max), the share holding several models'
    training, several models' forward_backward calls, several models' optim_steps, the share of forward calls
    and of optim_steps that ran beside another model's, datums and optim_steps per cycle (means); where the
    windows' seconds went on the trainer's thread: training passes, saves and loads (barriers), waits for
    models about to train (`held`, the gather lever), and the rest idle."""
    inside = [r for r in rows if _inside(r["time"], windows)]
    seconds = sum(b - a for a, b in windows)
    work = [r for r in inside if r["forward"] or r["optim"]]
    if not work:
        return {"cycles": len(inside), "training_cycles": 0}
    fwd_models = [{f[0] for f in r["forward"]} for r in work]
    opt_models = [{o[0] for o in r["optim"]} for r in work]
    models = [len(f | o) for f, o in zip(fwd_models, opt_models)]
    calls = sum(len(r["forward"]) for r in work)
    steps = sum(len(r["optim"]) for r in work)
    train = sum(r.get("train", r["seconds"]) for r in inside)
    busy = sum(r["seconds"] for r in inside)
    held = sum(r.get("held", 0.0) for r in inside)
    share = (lambda x: x / seconds) if seconds > 0 else (lambda x: None)
    return {"cycles": len(inside), "training_cycles": len(work), "models_mean": statistics.fmean(models),
            "models_max": max(models), "multi_model_share": sum(m > 1 for m in models) / len(models),
            "multi_forward_share": sum(len(f) > 1 for f in fwd_models) / len(work),
            "multi_optim_share": sum(len(o) > 1 for o in opt_models) / len(work),
            "forward_calls_shared": sum(len(r["forward"]) for r, f in zip(work, fwd_models) if len(f) > 1) / calls
            if calls else None,
            "optim_steps_shared": sum(len(r["optim"]) for r, o in zip(work, opt_models) if len(o) > 1) / steps
            if steps else None,
            "datums_mean": statistics.fmean(sum(f[2] for f in r["forward"]) for r in work),
            "optim_steps_mean": statistics.fmean(len(r["optim"]) for r in work),
            "cycle_s_median": statistics.median(r["seconds"] for r in work),
            "trainer_busy": share(busy), "trainer_training": share(train), "trainer_saving": share(busy - train),
            "trainer_held": share(held), "trainer_idle": share(seconds - busy - held) if seconds > 0 else None}


def step_medians(run_dirs: list[Path], windows: list[tuple[float, float]]) -> dict:
    """Median seconds a step spent sampling, in forward_backward + optim_step, and saving its sampler, over the
    steps of these runs that ended inside the windows."""
    ok = [r for d in run_dirs for r in read_jsonl(d / "metrics.jsonl")
          if r.get("status") == "ok" and "end" in r and _inside(r["end"], windows)]
    return {k: statistics.median(r[k] for r in ok if k in r) for k in ("t_generate", "t_train", "t_save")
            if any(k in r for r in ok)}


def _p90(xs: list[float]) -> float:
    """The 90th percentile, linear between the closest ranks (numpy's default)."""
    xs = sorted(xs)
    k = 0.9 * (len(xs) - 1)
    lo = math.floor(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def latencies(run_dirs: list[Path], windows: list[tuple[float, float]]) -> dict:
    """Each client's step latency: the seconds between the ends of its consecutive steps, for the steps that
    ended inside the windows: per job (median, p90, steps) and over every job's steps together."""
    per: dict[str, list[float]] = {}
    for d in run_dirs:
        rows = [r for r in read_jsonl(d / "metrics.jsonl") if r.get("status") == "ok" and "end" in r]
        for job in {r["job"] for r in rows}:
            ends = sorted(r["end"] for r in rows if r["job"] == job)
            per.setdefault(job, []).extend(b - a for a, b in zip(ends, ends[1:]) if _inside(b, windows))
    every = [x for xs in per.values() for x in xs]
    out = {"jobs": {j: {"median": statistics.median(xs), "p90": _p90(xs), "steps": len(xs)}
                    for j, xs in sorted(per.items()) if xs}}
    if every:
        out.update(median=statistics.median(every), p90=_p90(every), steps=len(every))
    return out


def figures(summary: dict) -> dict:
    w = summary["window"]
    return {"steps_per_hour": summary["steps_per_hour"], "steps_measured": summary["steps_measured"],
            "seconds_measured": summary["seconds_measured"], "window": [w.get("start"), w.get("end")],
            "failed_jobs": summary.get("failed_jobs", [])}


def _n(x, fmt: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def to_markdown(r: dict) -> str:
    """report.md: the command, then a row per run of the clients (each variant's concurrent run, one at a time,
    more clients, the engine killed), the server's cycles, the clients' step latencies, the restart."""
    rows = r["rows"]
    first = rows[0]["steps_per_hour"] if rows else None
    alone = (r.get("sequential") or {}).get("steps_per_hour")
    native = (r.get("beside") or {}).get("steps_per_hour")
    out = [f"```\n{r['command']}\n```", "",
           f"{r['environment']['device']}; jobs of {r['config']}, {r['steps']} steps each, the first "
           f"{r['warmup_steps']} outside the window; servers started in {_n(r['server_start_s'], '.0f')} s "
           "(outside every figure).", "",
           "| run | levers | clients | steps per device-hour | x first row | x one at a time | x native | job-steps "
           "| seconds | step latency median / p90 s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows + ([r["sequential"]] if r.get("sequential") else []):
        sph = row.get("steps_per_hour")
        lat = row.get("latency") or {}
        out.append(f"| {row['label']} | {row.get('levers') or 'defaults'} | {row['clients']} | **{_n(sph)}** | "
                   f"{_n(sph / first if sph and first else None, '.2f')} | "
                   f"{_n(sph / alone if sph and alone else None, '.2f')} | "
                   f"{_n(sph / native if sph and native else None, '.2f')} | {_n(row.get('steps_measured'), 'd')} | "
                   f"{_n(row.get('seconds_measured'), '.1f')} | {_n(lat.get('median'), '.2f')} / "
                   f"{_n(lat.get('p90'), '.2f')} |")
    if r.get("beside"):
        b = r["beside"]
        out.append(f"| `colora run`, {b['arm']} arm, seed {b['seed']} ({b['run']}) | native | {len(b['jobs'])} | "
                   f"**{_n(native)}** | {_n(native / first if native and first else None, '.2f')} | "
                   f"{_n(native / alone if native and alone else None, '.2f')} | 1.00 | "
                   f"{_n(b.get('steps_measured'), 'd')} | {_n(b.get('seconds_measured'), '.1f')} | - |")
    out += ["", "Trainer cycles (those with training work): models per cycle, the share of cycles holding several "
            "models' forward_backward calls and optim_steps, the share of all forward calls and optim_steps that ran "
            "beside another model's; where the trainer thread's time went.", "",
            "| run | training cycles | models mean / max | several forward / optim | forward calls / optim steps "
            "shared | cycle median s | training | saves | held | idle |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows + ([r["sequential"]] if r.get("sequential") else []):
        c = row.get("cycles") or {}
        out.append(f"| {row['label']} | {_n(c.get('training_cycles'), 'd')} | {_n(c.get('models_mean'), '.2f')} / "
                   f"{_n(c.get('models_max'), 'd')} | {_n(c.get('multi_forward_share'), '.0%')} / "
                   f"{_n(c.get('multi_optim_share'), '.0%')} | {_n(c.get('forward_calls_shared'), '.0%')} / "
                   f"{_n(c.get('optim_steps_shared'), '.0%')} | {_n(c.get('cycle_s_median'), '.2f')} | "
                   f"{_n(c.get('trainer_training'), '.0%')} | {_n(c.get('trainer_saving'), '.0%')} | "
                   f"{_n(c.get('trainer_held'), '.0%')} | {_n(c.get('trainer_idle'), '.0%')} |")
    out += ["", "| run | median seconds a step: sampling | forward_backward + optim_step | sampler save |",
            "|---|---|---|---|"]
    for row in rows + ([r["sequential"]] if r.get("sequential") else []):
        m = row.get("step_medians") or {}
        out.append(f"| {row['label']} | {_n(m.get('t_generate'), '.2f')} | {_n(m.get('t_train'), '.2f')} | "
                   f"{_n(m.get('t_save'), '.2f')} |")
    for row in rows:
        k = row.get("kill")
        if k:
            base = next((x for x in rows if x["label"] == k["beside"]), None)
            cost = 1 - row["steps_per_hour"] / base["steps_per_hour"] if base and base.get("steps_per_hour") else None
            out += ["", f"{row['label']}: the engine core (pid {k.get('pid')}) killed with SIGKILL when a client reached "
                        f"step {k['at_step']}; the server was healthy again {_n(k.get('healthy_after_s'), '.1f')} s later "
                        f"(its engine's start: {_n(k.get('engine_start_s'), '.0f')} s); steps per device-hour "
                        f"{_n(row.get('steps_per_hour'))} against {_n(base and base.get('steps_per_hour'))} without the "
                        f"kill ({_n(cost, '.0%')} fewer)."]
    notes = [f"{row['label']}: {row['short_window']}" for row in rows if row.get("short_window")]
    if r.get("beside") and not r["beside"]["same_jobs"]:
        notes.append(f"beside: its jobs ({', '.join(r['beside']['jobs'])}) are not the clients' jobs")
    return "\n".join(out + ([""] + notes if notes else [])) + "\n"
