"""Statistical reports over run directories: did sharing the GPU change what the jobs learned?

    colora report RUNS... [--prereg FILE] --out reports/NAME [--bootstrap-seed 0]

RUNS are run directories, directories holding them (a sweep's DIR), or `.tar.gz` / `.tgz` archives
of such directories (a study's committed evidence), read as the folder they hold: every
`summary.json` below them whose status.json says complete is one run (directories moved aside as
`*.incomplete-<n>` are left out). Each run's arm and seed come from its config.json; its repeat index from the sweep.json
that lists it, else from its order among runs of the same (arm, seed).

What is computed (colora.stats has the definitions):
- throughput: each run's steps per device-hour (summary.json); per (arm, seed) the mean over
  repeats; per seed the ratio to dedicated; the A/A: dedicated repeat 1 against repeat 0.
- learning, per (job, seed) after averaging repeats, arm minus dedicated: final eval accuracy
  (eval.json "after") and mean training reward (the mean of every ok step's mean reward in
  metrics.jsonl, the reference's "mean training reward"); 95% t and bootstrap intervals.
- throughput from a short measured window (colora.throughput.short_window: under 30 s or fewer
  than 5 measured steps per job) is named as such beside the table.
- with `--prereg` only: the pre-registration's gates, PASS/FAIL/NOT EVALUATED for every arm but
  dedicated, with the numbers behind each, over the pre-registered seeds; runs of other seeds (a
  replication on fresh seeds) get a section of their own, their ratios and paired differences
  computed apart and never pooled into the gates. Without `--prereg` no gate is described or applied.

Writes `report.md` (opening with the command that made it; colora/report_md.py), `summary.json`
(every number in the report), and PNG figures (colora/report_figures.py): throughput.png,
learning_curves.png, paired_differences.png, timeline.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import tarfile
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import stats
from .config import ARMS, ConfigError, from_dict
from .runlog import read_jsonl, write_json_atomic

METRICS = (("eval_accuracy", "final eval accuracy"), ("train_reward", "mean training reward"))
DEFAULT_CONF = 0.95  # the intervals' level without a pre-registration


class ReportError(ValueError):
    """Nothing to report on, or an input that cannot be read; the message names the path."""


@dataclass
class RunData:
    path: Path
    arm: str
    seed: int
    repeat: int | None
    lock_hash: str
    summary: dict
    eval_after: dict[str, float]  # job -> final eval accuracy
    reward_mean: dict[str, float]  # job -> mean over ok steps of the step's mean reward
    curves: dict[str, list[tuple[int, float]]]  # job -> [(step, reward)]
    spans: list[dict] = field(default_factory=list)
    eval_before: dict[str, float] = field(default_factory=dict)  # job -> eval accuracy before training

    @property
    def steps_per_hour(self) -> float:
        v = self.summary.get("steps_per_hour")
        try:
            return float(v)
        except (TypeError, ValueError):
            return math.nan


# -- reading runs ---------------------------------------------------------------------------------
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
_unpacked: dict[Path, tuple[Path, tempfile.TemporaryDirectory]] = {}  # archive -> (its folder, the temp dir)


def is_archive(p: Path) -> bool:
    return p.is_file() and p.name.endswith(ARCHIVE_SUFFIXES)


def unpack(archive: Path) -> Path:
    """The folder an archive of run directories holds, unpacked once per process into a temporary
    directory (removed at exit). Members that would land outside it, links and devices are refused."""
    archive = archive.resolve()
    if archive not in _unpacked:
        tmp = tempfile.TemporaryDirectory(prefix="colora-report-")
        try:
            with tarfile.open(archive, "r:gz") as tf:
                tf.extractall(tmp.name, filter="data")
        except (tarfile.TarError, OSError, EOFError) as e:
            tmp.cleanup()
            raise ReportError(f"{str(archive)!r}: not a readable .tar.gz of run directories ({e})") from None
        _unpacked[archive] = (Path(tmp.name), tmp)
    return _unpacked[archive][0]


def display_path(p: Path) -> str:
    """A run directory as a reader finds it: inside an archive, `ARCHIVE:member/path`."""
    for archive, (root, _) in _unpacked.items():
        if p.is_relative_to(root):
            return f"{archive.name}:{p.relative_to(root).as_posix()}"
    return str(p)


def find_run_dirs(paths: list[str | Path]) -> list[Path]:
    """Every run directory (one holding summary.json) given or below the given paths (folders or
    archives of them)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ReportError(f"{str(p)!r} does not exist")
        if is_archive(p):
            p = unpack(p)
        if (p / "summary.json").is_file():
            found.append(p)
            continue
        below = sorted(s.parent for s in p.rglob("summary.json")
                       if not any(".incomplete-" in part for part in s.relative_to(p).parts))
        if not below:
            raise ReportError(f"{str(p)!r} holds no run directory (none has a summary.json)")
        found += below
    return sorted(dict.fromkeys(q.resolve() for q in found))


def _sweep_repeat(run: Path) -> int | None:
    """The repeat index a sweep.json in one of the run's parents gives this run."""
    for parent in list(run.parents)[:3]:
        sj = parent / "sweep.json"
        if sj.is_file():
            try:
                runs = json.loads(sj.read_text()).get("runs", [])
            except (json.JSONDecodeError, AttributeError):
                return None
            rel = str(run.relative_to(parent))
            for r in runs:
                if r.get("dir") == rel:
                    return int(r["repeat"])
    return None


def load_run(path: Path) -> RunData | None:
    """One run's numbers; None (skipped) when its status is not complete."""
    from .prereg import lock_hash

    try:
        status = json.loads((path / "status.json").read_text()).get("state")
        summary = json.loads((path / "summary.json").read_text())
        cfg = from_dict(json.loads((path / "config.json").read_text())["config"])
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ReportError(f"{path}: cannot read the run ({type(e).__name__}: {e})") from None
    except ConfigError as e:
        raise ReportError(f"{path}/config.json: {e}") from None
    if status != "complete":
        return None
    ev = json.loads((path / "eval.json").read_text()) if (path / "eval.json").is_file() else {}
    eval_after = {j: float(v["accuracy"]) for j, v in ev.get("after", {}).items() if "accuracy" in v}
    eval_before = {j: float(v["accuracy"]) for j, v in ev.get("before", {}).items() if "accuracy" in v}
    rows = [r for r in read_jsonl(path / "metrics.jsonl")
            if r.get("status") == "ok" and "reward" in r and "event" not in r]
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        curves[r["job"]].append((int(r["step"]), float(r["reward"])))
    curves = {j: sorted(v) for j, v in curves.items()}
    reward_mean = {j: float(np.mean([r for _, r in v])) for j, v in curves.items()}
    return RunData(path, cfg.experiment.arm, cfg.experiment.seed, _sweep_repeat(path), lock_hash(cfg), summary,
                   eval_after, reward_mean, curves, read_jsonl(path / "timeline.jsonl"), eval_before)


def load_runs(paths: list[str | Path]) -> tuple[list[RunData], list[str]]:
    """Complete runs with repeat indices filled in, and warnings about what was left out."""
    runs, warnings = [], []
    for d in find_run_dirs(paths):
        r = load_run(d)
        if r is None:
            warnings.append(f"{d}: not complete (status.json), left out")
        else:
            runs.append(r)
    if not runs:
        raise ReportError("no complete run among " + ", ".join(map(str, paths)))
    by_key: dict[tuple, list[RunData]] = defaultdict(list)
    for r in runs:
        by_key[(r.arm, r.seed)].append(r)
    for key, rs in by_key.items():
        taken = {r.repeat for r in rs if r.repeat is not None}
        free = (i for i in range(len(rs) + len(taken)) if i not in taken)
        for r in sorted((r for r in rs if r.repeat is None), key=lambda r: str(r.path)):
            r.repeat = next(free)
        reps = [r.repeat for r in rs]
        if len(set(reps)) != len(reps):
            raise ReportError(f"{key[0]} seed {key[1]}: several runs claim the same repeat ({sorted(reps)}): "
                              + ", ".join(display_path(r.path) for r in rs))
    arm_order = {a: i for i, a in enumerate(ARMS)}
    runs.sort(key=lambda r: (arm_order[r.arm], r.seed, r.repeat))
    return runs, warnings


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
    from .throughput import short_window

    out = []
    for r in runs:
        s = r.summary
        jobs = len(s.get("jobs") or r.curves or r.eval_after) or 1
        note = short_window(float(s.get("seconds_measured") or 0.0), int(s.get("steps_measured") or 0), jobs)
        if note:
            out.append({"dir": display_path(r.path), "arm": r.arm, "seed": r.seed, "repeat": r.repeat, "note": note})
    return out


# -- entry point ----------------------------------------------------------------------------------
def make_report(paths: list[str], out: str | Path, prereg_path: str | None = None, command: str = "",
                bootstrap_seed: int | None = None, figures: bool = True) -> dict:
    """Write report.md, summary.json and (unless `figures` is False) the PNG figures into `out`."""
    from .prereg import load_prereg

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
    out.mkdir(parents=True, exist_ok=True)
    names = []
    if figures:
        from .report_figures import fig_learning_curves, fig_paired, fig_throughput, fig_timeline

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
    from .report_md import render

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
    from .prereg import PreregError

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
