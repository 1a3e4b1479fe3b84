"""Seed sweeps: one run directory per (arm, seed, repeat), resumable, with one progress line per run.

    colora sweep CONFIG --seeds 1 2 3 [--arms dedicated shared_sync ...] [--repeats N]
                 [--aa-seeds 1] [--set key=value ...] [--prereg FILE] --out DIR [--deadline S]
                 [--gpus N [--address ADDR]] [--dry-run] [--verbose]

Layout: `DIR/<arm>/seed<seed>-r<repeat>/` is a run directory (colora.run.runner), its log is beside it
as `seed<seed>-r<repeat>.log`, and `DIR/sweep.json` lists every run with its state. The runs are
made by colora/sweeps/orchestrate.py: resumable (complete runs skipped, unfinished ones moved aside and run
again), MPS runs on a GPU in processes of their own, `--deadline` starting no run that the finished
ones say would not end in time. With `--gpus N` (the `ray` extra) N runs go at once on a Ray
cluster, one GPU each, and a dedicated run's jobs each on a GPU of its own, side by side
(colora/sweeps/on_cluster.py); the directories, sweep.json and the report are the same.

Order: seed by seed, and within a seed repeat by repeat and arm by arm, the MPS arms after the others
(consecutive MPS runs share a process), so slow drift of the machine falls on every arm alike rather
than on the arm run last. The dedicated arm runs twice (repeats 0 and 1) on the `--aa-seeds` (the
A/A: two runs of the baseline that should not differ).

With `--prereg`, the config (with `--set`) must be the one the pre-registration locked, except
experiment.arm and experiment.seed, which the sweep sets, and the run options ([runtime]); otherwise
nothing runs. Arms, seeds, repeats and A/A seeds default to the pre-registration's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from colora.cluster import require_ray
from colora.config import ARMS, ConfigError, load_config
from colora.output import session
from colora.run.preflight import MPS_ARMS, RunError
from colora.studies.prereg import PreregError, PreregMismatch, load_prereg, require_match
from colora.sweeps.orchestrate import RunFn, check_existing, run_in_process, run_plan
from colora.sweeps.plan import PlannedRun


def plan_runs(arms: list[str], seeds: list[int], repeats: int = 1, aa_seeds: list[int] = ()) -> list[PlannedRun]:
    """Every (arm, seed, repeat) in run order (see the module docstring)."""
    if repeats < 1:
        raise ConfigError(f"--repeats ({repeats}) must be at least 1")
    for name, xs in (("--arms", arms), ("--seeds", seeds)):
        if not xs:
            raise ConfigError(f"{name} must name at least one value")
        if len(set(xs)) != len(xs):
            raise ConfigError(f"{name} {list(xs)} repeats a value")
    for a in arms:
        if a not in ARMS:
            raise ConfigError(f"--arms: {a!r} is not an arm; accepted: {', '.join(ARMS)}")
    extra = sorted(set(aa_seeds) - set(seeds))
    if extra:
        raise ConfigError(f"--aa-seeds {extra} are not among --seeds {list(seeds)}")
    if aa_seeds and "dedicated" not in arms:
        raise ConfigError("--aa-seeds repeat the dedicated arm, which is not among --arms")
    out = []
    for s in seeds:
        n = {a: max(repeats, 2) if (a == "dedicated" and s in aa_seeds) else repeats for a in arms}
        for r in range(max(n.values())):
            ordered = [a for a in arms if a not in MPS_ARMS] + [a for a in arms if a in MPS_ARMS]
            out += [PlannedRun(a, s, f"r{r}", repeat=r) for a in ordered if r < n[a]]
    return out


# -- command line ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora sweep", description="Run a config over arms, seeds and repeats.")
    p.add_argument("config", help="experiment TOML file")
    p.add_argument("--seeds", type=int, nargs="+", help="run seeds (default: the pre-registration's)")
    p.add_argument("--arms", nargs="+", choices=ARMS, help="arms (default: the pre-registration's, else dedicated "
                                                          "and the config's arm)")
    p.add_argument("--repeats", type=int, help="runs per (arm, seed) (default: the pre-registration's, else 1)")
    p.add_argument("--aa-seeds", type=int, nargs="*", help="seeds on which dedicated also runs repeat 1, the A/A "
                                                           "(default: the pre-registration's, else none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--prereg", help="refuse to run unless the config is the one this pre-registration locked")
    p.add_argument("--out", required=True, help="sweep directory")
    p.add_argument("--deadline", type=float, default=0, metavar="SECONDS",
                   help="start no run that the finished runs say would not end within SECONDS of the start; "
                        "0: no limit")
    p.add_argument("--gpus", type=int, default=1, help="runs at once, one GPU each, on a Ray cluster (the dedicated "
                                                       "arm's jobs each on its own GPU); default 1: one after another")
    p.add_argument("--address", help="the Ray cluster for --gpus: auto (this node's), HOST:PORT, or local (a new one, "
                                     "also with --gpus 1); default: a new one when --gpus is more than 1")
    p.add_argument("--dry-run", action="store_true", help="print the plan and each run's state; run nothing")
    p.add_argument("--verbose", action="store_true", help="show every log line of every run, vLLM's and other "
                                                          "libraries' too (each run's run.log always has them)")
    return p


def main(argv: list[str] | None = None, run_fn: RunFn = run_in_process) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (or --help): return its status
        return int(e.code or 0)
    command = "colora sweep " + " ".join(argv)
    try:
        for o in args.set:
            if o.split("=", 1)[0].strip() in ("experiment.arm", "experiment.seed"):
                raise ConfigError(f"--set {o}: the sweep sets experiment.arm and experiment.seed per run; "
                                  "use --arms and --seeds")
        base = load_config(args.config, args.set)
        pr = load_prereg(args.prereg) if args.prereg else None
        if pr is not None:
            require_match(pr, base, f"{args.config}" + (f" with --set {' '.join(args.set)}" if args.set else ""))
        arms = args.arms or (list(pr.arms) if pr else list(dict.fromkeys(["dedicated", base.experiment.arm])))
        if args.seeds is None and pr is None:
            raise ConfigError("give --seeds (e.g. --seeds 1 2 3) or a --prereg that lists them")
        seeds = args.seeds or list(pr.seeds)
        repeats = args.repeats if args.repeats is not None else (pr.repeats if pr else 1)
        aa = args.aa_seeds if args.aa_seeds is not None else ([s for s in pr.aa_seeds if s in seeds] if pr else [])
        planned = plan_runs(arms, seeds, repeats, aa)
        if args.gpus < 1:
            raise ConfigError(f"--gpus ({args.gpus}) must be at least 1")
        if pr is not None:
            extra = [f"arm {a}" for a in arms if a not in pr.arms] + [f"seed {s}" for s in seeds if s not in pr.seeds]
            if extra:
                print(f"note: {', '.join(extra)} not pre-registered in {pr.path}: exploratory", file=sys.stderr)
        if args.dry_run:
            states = check_existing(Path(args.out), base, planned)
            for i, p in enumerate(planned, 1):
                print(f"[{i}/{len(planned)}] {p.label} -> {Path(args.out) / p.rel}: {states[p.rel]}")
            return 0
        if args.gpus > 1 or args.address:
            require_ray(f"--gpus {args.gpus}" if args.gpus > 1 else f"--address {args.address}")
        record = {"config_path": args.config, "overrides": list(args.set), "command": command, "prereg": args.prereg}
        with session(args.verbose, "stderr"):
            states = run_plan(base, planned, args.out, record=record, run_fn=run_fn, verbose=args.verbose,
                              deadline_s=args.deadline or None, gpus=args.gpus, address=args.address)
    except PreregMismatch as e:
        print(f"colora: error: refusing to sweep: {e}", file=sys.stderr)
        return 2
    except (ConfigError, PreregError, RunError) as e:
        print(f"colora: error: {e}", file=sys.stderr)
        return 2
    return 1 if any(s in ("failed", "interrupted") for s in states.values()) else 0
