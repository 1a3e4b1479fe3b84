"""Statistical reports over run directories: did sharing the GPU change what the jobs learned?

    colora report RUNS... [--prereg FILE] --out reports/NAME [--bootstrap-seed 0]

RUNS are run directories, directories holding them (a sweep's DIR), or `.tar.gz` / `.tgz` archives
of such directories (a study's committed evidence), read as the folder they hold: every
`summary.json` below them whose status.json says complete is one run (directories moved aside as
`*.incomplete-<n>` are left out). Each run's arm and seed come from its config.json; its repeat index from the sweep.json
that lists it, else from its order among runs of the same (arm, seed).

What is computed (colora.studies.stats has the definitions):
- throughput: each run's steps per device-hour (summary.json); per (arm, seed) the mean over
  repeats; per seed the ratio to dedicated; the A/A: dedicated repeat 1 against repeat 0.
- learning, per (job, seed) after averaging repeats, arm minus dedicated: final eval accuracy
  (eval.json "after") and mean training reward (the mean of every ok step's mean reward in
  metrics.jsonl, the reference's "mean training reward"); 95% t and bootstrap intervals.
- throughput from a short measured window (colora.record.throughput.short_window: under 30 s or fewer
  than 5 measured steps per job) is named as such beside the table.
- with `--prereg` only: the pre-registration's gates, PASS/FAIL/NOT EVALUATED for every arm but
  dedicated, with the numbers behind each, over the pre-registered seeds; runs of other seeds (a
  replication on fresh seeds) get a section of their own, their ratios and paired differences
  computed apart and never pooled into the gates. Without `--prereg` no gate is described or applied.

Writes into `--out`, which must be no run, nor lie inside or above one (`check_out`):
`report.md` (opening with the command that made it; colora/studies/report_md.py), `summary.json`
(every number in the report), and PNG figures (colora/studies/report_figures.py): throughput.png,
learning_curves.png, paired_differences.png, timeline.png.
"""

from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from colora.config import ARMS, ConfigError
from colora.record.runlog import write_json_atomic
from colora.record.throughput import short_window
from colora.studies import stats
from colora.studies.prereg import PreregError, load_prereg
from colora.studies.report_data import ReportError, RunData, display_path, find_run_dirs, load_runs
from colora.studies.report_figures import fig_learning_curves, fig_paired, fig_throughput, fig_timeline
from colora.studies.report_md import render

DEFAULT_CONF = 0.95  # the intervals' level without a pre-registration


# -- analysis -------------------------------------------------------------------------------------
def _per_job(runs: list[RunData], arm: str, attr: str, repeat: int | None = None) -> dict[tuple, float]:
    """{(job, seed): value averaged over repeats} (or of one repeat) for one arm."""
    vals = {(job, r.seed, r.repeat): v for r in runs if r.arm == arm and (repeat is None or r.repeat == repeat)
            for job, v in getattr(r, attr).items()}
    return stats.average_repeats(vals)


def _compare(arm_vals: dict, base_vals: dict, rng_seed: int, analysis: dict, conf: float) -> dict:
    """Paired differences on the (job, seed) keys both sides have, with both intervals."""
    common = {k for k in arm_vals if k in base_vals}
    dropped = sorted(set(arm_vals) ^ set(base_vals))
    a = {k: arm_vals[k] for k in common}
    b = {k: base_vals[k] for k in common}
    keys = stats.paired_keys(a, b)
    d = stats.paired_differences(a, b)
    rng = np.random.default_rng(rng_seed)
    return {"pairs": [[k[0], k[1], float(x)] for k, x in zip(keys, d)], "dropped": [list(k) for k in dropped],
            "t": stats.t_interval(d, conf).to_dict(),
            "bootstrap": stats.bootstrap_interval(d, rng, int(analysis.get("bootstrap_resamples", 10000)), conf,
                                                  str(analysis.get("bootstrap_method", "percentile"))).to_dict()}


def _iv(d: dict | None) -> stats.Interval | None:
    return None if d is None else stats.Interval(**d)


def eval_by_job(runs: list[RunData], arms: list[str]) -> dict:
    """{arm: {job: {"before", "after", "change", "seeds"}}}: eval accuracy before and after training,
    averaged over repeats per seed and then over seeds (jobs evaluated both times only)."""
    out = {}
    for a in arms:
        before, after = _per_job(runs, a, "eval_before"), _per_job(runs, a, "eval_after")
        keys = sorted(set(before) & set(after))
        jobs = {}
        for job in sorted({j for j, _ in keys}):
            ks = [k for k in keys if k[0] == job]
            b, f = float(np.mean([before[k] for k in ks])), float(np.mean([after[k] for k in ks]))
            jobs[job] = {"before": b, "after": f, "change": f - b, "seeds": [s for _, s in ks]}
        if jobs:
            out[a] = jobs
    return out


def analyse(runs: list[RunData], gates: stats.Gates | None, analysis: dict, expected_seeds: list[int] | None) -> dict:
    """Every number of the report, keyed by arm and seed (seeds as strings: JSON keys); gates only
    when `gates` (a pre-registration's) are given."""
    seed = int(analysis.get("bootstrap_seed", 0))
    conf = gates.conf if gates is not None else DEFAULT_CONF
    arms = [a for a in ARMS if any(r.arm == a for r in runs)]
    sph: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        sph[r.arm][r.seed].append(r.steps_per_hour)
    mean_sph = {a: {s: float(np.mean(v)) for s, v in sorted(sph[a].items())} for a in arms}
    out: dict = {"arms": arms, "seeds": sorted({r.seed for r in runs}),
                 "jobs": sorted({j for r in runs for j in r.eval_after} | {j for r in runs for j in r.reward_mean}),
                 "steps_per_hour": {a: {str(s): v for s, v in mean_sph[a].items()} for a in arms},
                 "ratio": {}, "ratio_mean": {}, "learning": {}, "gates": {}, "notes": [], "conf": conf,
                 "short_windows": short_windows(runs)}
    base = mean_sph.get("dedicated", {})
    aa = {}
    for s in sph.get("dedicated", {}):
        reps = {r.repeat: r.steps_per_hour for r in runs if r.arm == "dedicated" and r.seed == s}
        if 0 in reps and 1 in reps and all(math.isfinite(x) and x > 0 for x in (reps[0], reps[1])):
            aa[s] = stats.aa_spread(reps[0], reps[1])
    out["aa"] = {"throughput": {str(s): v for s, v in aa.items()}}
    out["eval_by_job"] = eval_by_job(runs, arms)
    if "dedicated" not in arms:
        out["notes"].append("no dedicated run: no ratios, paired differences or gates")
        return out
    aa_seeds = sorted(aa)
    for metric, attr in (("eval_accuracy", "eval_after"), ("train_reward", "reward_mean")):
        r0 = {k: v for k, v in _per_job(runs, "dedicated", attr, 0).items() if k[1] in aa_seeds}
        r1 = {k: v for k, v in _per_job(runs, "dedicated", attr, 1).items() if k[1] in aa_seeds}
        out["aa"][metric] = _compare(r1, r0, seed, analysis, conf) if r0 and r1 else None
    for a in arms:
        if a == "dedicated":
            continue
        common = sorted(s for s in set(mean_sph[a]) & set(base)
                        if math.isfinite(mean_sph[a][s]) and math.isfinite(base[s]) and base[s] > 0)
        if len(common) < len(set(mean_sph[a]) & set(base)):
            out["notes"].append(f"{a}: seeds without a finite steps per hour (no measured steps) are left out of "
                                "the ratios")
        ratios = (stats.throughput_ratios({s: mean_sph[a][s] for s in common}, {s: base[s] for s in common})
                  if common else {})
        out["ratio"][a] = {str(s): v for s, v in ratios.items()}
        out["ratio_mean"][a] = float(np.mean(list(ratios.values()))) if ratios else None
        learn = {}
        for metric, attr in (("eval_accuracy", "eval_after"), ("train_reward", "reward_mean")):
            av, bv = _per_job(runs, a, attr), _per_job(runs, "dedicated", attr)
            learn[metric] = _compare(av, bv, seed, analysis, conf) if (set(av) & set(bv)) else None
        out["learning"][a] = learn
        if gates is None:
            continue
        pick = "t" if gates.interval == "t" else "bootstrap"
        res = stats.evaluate_gates(ratios, aa, _iv((learn["eval_accuracy"] or {}).get(pick)),
                                   _iv((learn["train_reward"] or {}).get(pick)), gates, expected_seeds)
        out["gates"][a] = {"overall": stats.overall(res), "results": [g.to_dict() for g in res]}
    return out


def short_windows(runs: list[RunData]) -> list[dict]:
    """The runs whose steps per hour come from a window too short to mean much, with why."""
    out = []
    for r in runs:
        s = r.summary
        jobs = len(s.get("jobs") or r.curves or r.eval_after) or 1
        note = short_window(float(s.get("seconds_measured") or 0.0), int(s.get("steps_measured") or 0), jobs)
        if note:
            out.append({"dir": display_path(r.path), "arm": r.arm, "seed": r.seed, "repeat": r.repeat, "note": note})
    return out


# -- entry point ----------------------------------------------------------------------------------
def check_out(out: Path, paths: list[str]) -> None:
    """Refuse (ReportError) a report folder that is a run directory (config.json and status.json),
    lies inside one, holds one of the runs it reads, or holds a sweep: a report never writes into a
    run (its summary.json would replace the run's) nor above runs (a summary.json there would read as
    a run and hide a sweep's runs). A folder beside the runs is fine, also inside the folder given: a
    report's folder has no config.json, so it never reads as a run."""
    o = out.resolve()
    for a in (o, *o.parents):
        if (a / "config.json").is_file() and (a / "status.json").is_file():
            raise ReportError(f"--out {str(out)!r} {'is' if a == o else 'lies inside'} the run directory {a}: a "
                              "report never writes into a run; choose another folder, e.g. reports/NAME")
    held = [r for r in find_run_dirs(paths) if r.is_relative_to(o)]
    if held or (o / "sweep.json").exists():
        what = f"the run {display_path(held[0])}" if held else "a sweep (sweep.json)"
        raise ReportError(f"--out {str(out)!r} holds {what}: a report never writes above runs; choose another "
                          "folder, e.g. reports/NAME")


def make_report(paths: list[str], out: str | Path, prereg_path: str | None = None, command: str = "",
                bootstrap_seed: int | None = None, figures: bool = True) -> dict:
    """Write report.md, summary.json and (unless `figures` is False) the PNG figures into `out`."""
    pr = load_prereg(prereg_path) if prereg_path else None
    if not command:
        pre = ["--prereg", prereg_path] if prereg_path else []
        command = shlex.join(["colora", "report", *map(str, paths), *pre, "--out", str(out)])
    runs, warnings = load_runs(paths)
    gates = pr.gates if pr else None
    analysis = dict(pr.analysis) if pr else {}
    if bootstrap_seed is not None:
        analysis["bootstrap_seed"] = bootstrap_seed
    prinfo, left_out = None, []
    if pr:
        # the pre-registered seeds only: other seeds are a replication, reported apart, never pooled
        left_out = [r for r in runs if r.seed not in pr.seeds]
        runs = [r for r in runs if r.seed in pr.seeds]
        if left_out:
            warnings.append(f"seeds {sorted({r.seed for r in left_out})} are not pre-registered in {pr.path}: their "
                            f"{len(left_out)} run(s) are reported apart (Replication on fresh seeds), not pooled "
                            "into the gates")
        if not runs:
            raise ReportError(f"no run of the pre-registered seeds {list(pr.seeds)} among {', '.join(map(str, paths))}")
        extra = sorted({r.arm for r in runs if r.arm not in pr.arms})
        if extra:
            warnings.append(f"arm(s) {', '.join(extra)} are not pre-registered in {pr.path}: exploratory")
        bad = [f"{r.arm} seed {r.seed} r{r.repeat} ({r.lock_hash})" for r in runs + left_out
               if r.lock_hash != pr.config_hash]
        prinfo = {**pr.header_dict(), "matches": not bad, "mismatched_runs": bad,
                  "left_out_runs": [display_path(r.path) for r in left_out]}
    hashes = sorted({r.lock_hash for r in runs})
    if len(hashes) > 1:
        warnings.append(f"the runs come from {len(hashes)} different configs (beyond arm and seed: "
                        f"{', '.join(hashes)}); "
                        "see the last column of 'Runs used'")
    res = analyse(runs, gates, analysis, list(pr.seeds) if pr else None)
    res["replication"] = analyse(left_out, None, analysis, None) if left_out else None
    out = Path(out)
    check_out(out, paths)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    if figures:
        names = ["throughput.png", "learning_curves.png", "paired_differences.png", "timeline.png"]
        fig_throughput(runs, res, gates, out / names[0])
        fig_learning_curves(runs, res, out / names[1])
        if res["learning"] or res["aa"].get("eval_accuracy") or res["aa"].get("train_reward"):
            fig_paired(res, gates, out / names[2])
        else:
            names.remove("paired_differences.png")
        fig_timeline(runs, out / names[-1])
    figures = names
    summary = {"command": command, "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "gates_config": gates.__dict__ if gates else None, "analysis": analysis, "prereg": prinfo,
               "warnings": warnings,
               "figures": figures, **res,
               "runs": [{"dir": display_path(r.path), "arm": r.arm, "seed": r.seed, "repeat": r.repeat, "lock_hash": r.lock_hash,
                         "steps_per_hour": r.steps_per_hour, "steps_measured": r.summary.get("steps_measured"),
                         "seconds_measured": r.summary.get("seconds_measured"), "eval_accuracy": r.eval_after,
                         "train_reward": r.reward_mean} for r in runs + left_out]}

    (out / "report.md").write_text(render(res, runs + left_out, command, gates, prinfo, warnings, figures, analysis))
    write_json_atomic(out / "summary.json", summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora report", description="Ratios, paired differences and figures over run "
                                "directories; with --prereg, the pre-registration's gates.")
    p.add_argument("runs", nargs="+", help="run directories, directories holding them (a sweep's --out), or "
                                           ".tar.gz archives of them")
    p.add_argument("--prereg", help="pre-registration whose gates and analysis plan to apply (without it, no gates)")
    p.add_argument("--out", required=True, help="report directory, e.g. reports/NAME")
    p.add_argument("--bootstrap-seed", type=int, help="seed of the bootstrap's numpy Generator (default: the "
                                                      "pre-registration's, else 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (or --help): return its status
        return int(e.code or 0)
    command = shlex.join(["colora", "report", *argv])
    try:
        s = make_report(args.runs, args.out, args.prereg, command, args.bootstrap_seed)
    except (ReportError, PreregError, ConfigError) as e:
        print(f"colora: error: {e}", file=sys.stderr)
        return 2
    print(f"report on {len(s['runs'])} runs in {args.out}/report.md")
    for a, g in s["gates"].items():
        print(f"  {a}: {g['overall']} (" + ", ".join(f"{r['name']} {r['status']}" for r in g["results"]) + ")")
    for part, res in (("", s), ("replication: ", s.get("replication") or {})):
        if part or not s["gates"]:
            for a, m in (res.get("ratio_mean") or {}).items():
                if m is not None:
                    seeds = list(res["ratio"][a])
                    print(f"  {part}{a}: {m:.3f}x dedicated (mean over seed{'s' if len(seeds) > 1 else ''} "
                          f"{', '.join(seeds)})")
    if not args.prereg:
        print("  no gates: none is applied without --prereg")
    if s["short_windows"]:
        print(f"  {len(s['short_windows'])} run(s) measured over a window too short to mean much (see the report)")
    return 0
