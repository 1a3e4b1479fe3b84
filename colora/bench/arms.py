"""Benchmark every arm of one workload on a GPU, each beside the dedicated baseline of its seed.

    colora bench arms experiments/reference8_throughput.toml --seeds 1 2 3 --out runs/bench/arms

The runs are made by colora/sweeps/orchestrate.py, each process group in a child process of its own with one
engine (vLLM's start is 80-160 s on the H200): the runs without MPS (dedicated, shared_sync, overlap)
in one, the MPS runs (mps, overlap_mps) of each pair of MPS shares in one each, since whether a
process is an MPS client, and with what share of the SMs, is fixed when it makes its CUDA context.
In each process the runs whose engine client is in-process come first, so a process starts at most
two engines however many seeds it holds (`engine.max_loras` must cover the largest job count).
`--jobs 2 4 16` also runs the headline arm with that many jobs (the config's jobs repeated with new
names); their baseline is the dedicated throughput of the seed's base workload, since a dedicated
job runs alone whatever the number of jobs (stated in the report). `--vary KEY=V1,V2` runs the
headline arm once per value of a config key or run option (the tuning sweep); `--vary K1=V1+K2=V2`
runs it once with several settings together. Runs take no checkpoints unless `--set
runtime.checkpoint_every=N` asks for them: a benchmark measures steps per hour, and a run that is
cut is run again whole.

Like with like: every arm runs the config's steps and warm-up, so each measured window covers the
same steps of every job (from the step after the warm-up to the last; `throughput.steps_per_job`,
in the per-run table). A job's first training steps at new shapes can stall (0.65-1.11 s against a
median of 0.32 s on the H200); measured over as many steps as the shared arms, such a
stall weighs on the dedicated figure as little as on theirs. Warming every shape before the window
instead would cost less device time but cannot be made sure of: a job's packed token count changes
every step, and which sizes make a kernel or a graph compile again is for Triton and Dynamo to
decide (colora/record/compilewatch.py), so no warm-up can list them. The report gives each main run's
throughput a second time with each job's first `--steady-from` - 1 steps out as well (measured
again from the same run's step times, `throughput.remeasure`), so the difference the first steps
make is known.

`--gpus N` runs the benchmark's runs N at once on a Ray cluster, one GPU each, each in a process
of its own, and a dedicated run's jobs each on a GPU of its own at once (colora/sweeps/on_cluster.py);
its throughput is the same quantity as on one GPU (steps summed over GPU-seconds summed).

Writes OUT.json (every run's summary and the ratios), OUT.md (tables that open with the command,
colora/studies/report_md.py) and OUT_timeline.png (one run per arm, colora/studies/report_figures.py), and the run
directories under --runs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

from colora.cluster import require_ray
from colora.config import ARMS, Config, load_config
from colora.engine.rollout import engine_process
from colora.output import session
from colora.record.phases import phase_stats
from colora.record.runlog import read_jsonl
from colora.record.throughput import remeasure, steps_per_job, throughput
from colora.run.preflight import MPS_ARMS
from colora.studies.report_data import load_run
from colora.studies.report_figures import fig_timeline
from colora.studies.report_md import arms_tables
from colora.sweeps.orchestrate import ProcessGroup, mps_shares, process_groups, run_plan
from colora.sweeps.plan import PlannedRun

NON_MPS = tuple(a for a in ARMS if a not in MPS_ARMS)
MPS = MPS_ARMS


def plan(cfg: Config, args) -> list[PlannedRun]:
    """Every run of the benchmark, each checked against the config (a ValueError names what is wrong).

    The main arms of every seed come first, then the job-count runs, then the tuning sweep: each process
    runs its part in this order, so a deadline cuts the extras before a seed's headline.
    """
    n = len(cfg.jobs)
    runs = []
    for seed in args.seeds:
        runs += [PlannedRun(arm, seed, "main", jobs=n) for arm in args.arms]
    for seed in args.seeds:
        for k in args.jobs:
            if k != n:  # fewer jobs than overlap.groups: as many groups as jobs, said in the run's config
                fit = (f"overlap.groups={k}",) if k < cfg.overlap.groups else ()
                runs += [PlannedRun(arm, seed, f"jobs{k}", jobs=k, set=fit)
                         for arm in args.scale_arms or [args.headline]]
    for spec in args.vary:
        runs += [PlannedRun(args.headline, args.seeds[0], label, jobs=n, set=tuple(sets))
                 for sets, label in vary_runs(spec)]
    for r in runs:
        r.config(cfg)  # a bad key or value of --vary is refused before anything runs
    return runs


def vary_runs(spec: str) -> list[tuple[list[str], str]]:
    """The headline runs of one `--vary` spec, as (config overrides, label).

    KEY=V1,V2,...: one run per value. KEY=V+KEY2=V2+...: one run with every setting at once (each
    with one value), e.g. `trainer.micro_batch_tokens=65536+overlap.groups=3`: settings that only pay
    together. A KEY is any config key, run options (runtime.*) included."""
    parts = re.split(r"\+(?=[A-Za-z_][\w.]*=)", spec)
    pairs = []
    for part in parts:
        key, sep, values = part.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--vary {spec}: {part!r} is not KEY=VALUE")
        pairs.append((key, values.split(",")))
    if len(pairs) > 1 and any(len(vs) > 1 for _, vs in pairs):
        raise ValueError(f"--vary {spec}: settings joined by + take one value each")
    combos = [[(k, v)] for k, vs in pairs for v in vs] if len(pairs) == 1 else [[(k, vs[0]) for k, vs in pairs]]
    return [([f"{k}={v}" for k, v in combo], "vary:" + "+".join(f"{k}={v}" for k, v in combo)) for combo in combos]


def order(cfg: Config, runs: list[PlannedRun]) -> list[PlannedRun]:
    """The runs in the order their processes take them: the runs without MPS, then the MPS runs of
    each pair of shares (CUDA reads a process's percentage once, when it makes its context, so runs
    that vary it cannot share a process, nor, for the engine's, an engine). Within each, the runs
    whose engine client is in-process first, each kind's in plan order: a process keeps one engine on
    a GPU (engine.EngineCache), so seeds must not alternate between the two kinds."""
    keys: list = []
    for r in runs:
        k = mps_shares(r.config(cfg))
        if k not in keys:
            keys.append(k)
    keys.sort(key=lambda k: k is not None)  # the runs without MPS first (stable: MPS shares by appearance)

    def client_apart(r: PlannedRun) -> bool:
        c = r.config(cfg)
        return engine_process(c.runtime.engine_process, c.experiment.arm)

    return [r for k in keys for r in sorted((r for r in runs if mps_shares(r.config(cfg)) == k), key=client_apart)]


def batches(cfg: Config, runs: list[PlannedRun]) -> list[ProcessGroup]:
    """The benchmark's processes, in order (see `order`)."""
    return process_groups(cfg, order(cfg, runs))


def collect(runs: list[PlannedRun], root: Path, steady_from: int = 0) -> list[dict]:
    """One row per planned run: its summary (None before it finished), its phase statistics
    (colora/record/phases.py), its steps per hour and the ratio to its seed's dedicated main run, the steps
    of each job its window counts, and (`steady_from` past the warm-up) the same two figures with
    each job's first `steady_from` - 1 steps out ("steady"; None where the summary kept no step ends)."""
    rows = []
    for r in runs:
        d = root / r.rel
        s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None
        tl = d / "timeline.jsonl"
        phases = phase_stats(read_jsonl(tl), s["window"]) if s and s.get("window") and tl.exists() else {}
        w = (s or {}).get("window") or {}
        again = remeasure(w, steady_from - 1) if w and steady_from > 1 else None
        rows.append({"arm": r.arm, "seed": r.seed, "jobs": r.jobs, "set": list(r.set), "label": r.tag, "dir": r.rel,
                     "summary": s, "phases": phases, "steps_per_job": steps_per_job(w),
                     "steady_steps_per_hour": throughput(again) if again and again["seconds"] > 0 else None})
    for r in rows:
        # a failed run's summary holds "nan" (as its JSON writes a NaN): no figure
        v = (r["summary"] or {}).get("steps_per_hour")
        r["steps_per_hour"] = v if isinstance(v, (int, float)) and math.isfinite(v) else None
    for key, ratio in (("steps_per_hour", "ratio"), ("steady_steps_per_hour", "steady_ratio")):
        base = {r["seed"]: r[key] for r in rows
                if r["arm"] == "dedicated" and r["label"] == "main" and r[key] is not None}
        for r in rows:
            r[ratio] = r[key] / base[r["seed"]] if r[key] is not None and r["seed"] in base else None
    return rows


def write_report(rows: list[dict], out: Path, command: str, cfg: Config, steady_from: int = 0) -> None:
    """OUT.json (every row, the summaries without their windows) and OUT.md (`report_md.arms_tables`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k != "summary"} |
            {"summary": {k: v for k, v in (r["summary"] or {}).items() if k != "window"}} for r in rows]
    (out.with_suffix(".json")).write_text(json.dumps({"command": command, "config_hash": cfg.hash(), "runs": slim},
                                                     indent=2, default=str))
    out.with_suffix(".md").write_text(arms_tables(rows, command, cfg, steady_from))


def draw_timeline(rows: list[dict], root: Path, path: Path) -> None:
    """The timeline figure of the first seed's main run of each arm (report_figures.fig_timeline)."""
    seed = min((r["seed"] for r in rows), default=None)
    runs = [load_run(root / r["dir"]) for r in rows if r["label"] == "main" and r["seed"] == seed and r["summary"]]
    runs = [r for r in runs if r is not None]
    if runs:
        fig_timeline(runs, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colora bench arms", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="experiment TOML file (experiments/reference8_throughput.toml is the workload)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="run seeds (default 1 2 3)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                   help="the arms to run, each over the config's steps (default: all)")
    p.add_argument("--jobs", type=int, nargs="*", default=[], help="also run the headline arm with these job counts")
    p.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                   help="tuning sweep of the headline arm over a config key or run option; "
                        "K1=V1+K2=V2: one run with several settings together")
    p.add_argument("--headline", default="overlap_mps", choices=list(ARMS),
                   help="the arm that --jobs and --vary run and the report leads with (default overlap_mps)")
    p.add_argument("--scale-arms", nargs="*", default=[], choices=list(ARMS),
                   help="arms run at each --jobs count (default: the headline arm)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--steady-from", type=int, default=5, metavar="STEP",
                   help="the report also gives each run's throughput from this step of each job on (its first "
                        "STEP-1 steps out, measured again from the same run); 0: not")
    p.add_argument("--gpus", type=int, default=1, help="runs at once, one GPU each, on a Ray cluster (the "
                                                       "dedicated arm's jobs each on its own GPU); default 1: as one GPU")
    p.add_argument("--address", help="the Ray cluster for --gpus: auto, HOST:PORT, or local (a new one); "
                                      "default: a new one when --gpus is more than 1")
    p.add_argument("--out", default="runs/bench/arms", help="report path without suffix")
    p.add_argument("--runs", default="runs/bench", help="where the run directories go")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds for the whole benchmark, its shutdown and report included (a run that the "
                        "finished runs' times say would not end in time is not started); 0: none")
    p.add_argument("--verbose", action="store_true", help="show every log line of every run, vLLM's and other "
                                                          "libraries' too (each run's run.log always has them)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the report from the run directories already under --runs")
    args = p.parse_args(argv)
    cfg = load_config(args.config, ["runtime.checkpoint_every=0", *args.set])
    root = Path(args.runs)
    try:
        runs = plan(cfg, args)
    except ValueError as e:
        p.error(str(e))
    if args.gpus < 1:
        p.error(f"--gpus ({args.gpus}) must be at least 1")
    if args.steady_from < 0:
        p.error(f"--steady-from ({args.steady_from}) must be a step (1 or more), or 0 for none")
    if not args.report_only and (args.gpus > 1 or args.address):
        require_ray(f"--gpus {args.gpus}" if args.gpus > 1 else f"--address {args.address}")
    command = "colora bench arms " + " ".join(argv if argv is not None else sys.argv[2:])
    failed = False
    if not args.report_only:
        with session(args.verbose, "stdout"):
            states = run_plan(cfg, order(cfg, runs), root, children=True, deadline_s=args.deadline or None,
                              verbose=args.verbose, gpus=args.gpus, address=args.address,
                              record={"config_path": args.config, "overrides": args.set, "command": command})
        failed = any(s in ("failed", "interrupted") for s in states.values())
    rows = collect(runs, root, args.steady_from)
    out = Path(args.out)
    write_report(rows, out, command, cfg, args.steady_from)
    draw_timeline(rows, root, out.with_name(out.name + "_timeline.png"))
    print(out.with_suffix(".md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
