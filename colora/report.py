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
- gates (the pre-registration's, else the reference study's numbers), PASS/FAIL/NOT EVALUATED for
  every arm but dedicated, with the numbers behind each.

Writes `report.md` (opening with the command that made it), `summary.json` (every number in the
report), and PNG figures: throughput.png, learning_curves.png, paired_differences.png, timeline.png.
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

ARM_COLORS = {"dedicated": "#7f7f7f", "shared_sync": "#1f77b4", "overlap": "#ff7f0e", "mps": "#2ca02c",
              "overlap_mps": "#d62728"}
PHASE_COLORS = {"generate": "#4c72b0", "train": "#dd8452", "export": "#8c8c8c", "reload": "#55a868", "eval": "#8172b3"}
METRICS = (("eval_accuracy", "final eval accuracy"), ("train_reward", "mean training reward"))


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


def analyse(runs: list[RunData], gates: stats.Gates, analysis: dict, expected_seeds: list[int] | None) -> dict:
    """Every number of the report, keyed by arm and seed (seeds as strings: JSON keys)."""
    seed = int(analysis.get("bootstrap_seed", 0))
    arms = [a for a in ARMS if any(r.arm == a for r in runs)]
    sph: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        sph[r.arm][r.seed].append(r.steps_per_hour)
    mean_sph = {a: {s: float(np.mean(v)) for s, v in sorted(sph[a].items())} for a in arms}
    out: dict = {"arms": arms, "seeds": sorted({r.seed for r in runs}),
                 "jobs": sorted({j for r in runs for j in r.eval_after} | {j for r in runs for j in r.reward_mean}),
                 "steps_per_hour": {a: {str(s): v for s, v in mean_sph[a].items()} for a in arms},
                 "ratio": {}, "ratio_mean": {}, "learning": {}, "gates": {}, "notes": []}
    base = mean_sph.get("dedicated", {})
    aa = {}
    for s, v in sph.get("dedicated", {}).items():
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
        out["aa"][metric] = _compare(r1, r0, seed, analysis, gates.conf) if r0 and r1 else None
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
            learn[metric] = _compare(av, bv, seed, analysis, gates.conf) if (set(av) & set(bv)) else None
        out["learning"][a] = learn
        pick = "t" if gates.interval == "t" else "bootstrap"
        res = stats.evaluate_gates(ratios, aa, _iv((learn["eval_accuracy"] or {}).get(pick)),
                                   _iv((learn["train_reward"] or {}).get(pick)), gates, expected_seeds)
        out["gates"][a] = {"overall": stats.overall(res), "results": [g.to_dict() for g in res]}
    return out


# -- figures --------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fig_throughput(runs: list[RunData], res: dict, gates: stats.Gates, path: Path) -> None:
    plt = _plt()
    arms, seeds = res["arms"], res["seeds"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    w = min(0.4, 0.8 / max(1, len(arms)))
    for i, a in enumerate(arms):
        xs = [k + (i - (len(arms) - 1) / 2) * w for k in range(len(seeds))]
        ys = [res["steps_per_hour"][a].get(str(s), math.nan) for s in seeds]
        axes[0].bar(xs, ys, w, color=ARM_COLORS[a], label=a)
        for k, s in enumerate(seeds):
            reps = [r.steps_per_hour for r in runs if r.arm == a and r.seed == s]
            if len(reps) > 1:
                axes[0].plot([xs[k]] * len(reps), reps, "k.", ms=5)
    axes[0].set_title("steps per device-hour (bar: mean over repeats; dots: repeats)")
    axes[0].set_ylabel("optimizer steps / device-hour, all jobs")
    others = [a for a in arms if a != "dedicated"]
    w2 = min(0.4, 0.8 / max(1, len(others)))
    for i, a in enumerate(others):
        xs = [k + (i - (len(others) - 1) / 2) * w2 for k in range(len(seeds))]
        ys = [res["ratio"].get(a, {}).get(str(s), math.nan) for s in seeds]
        bars = axes[1].bar(xs, ys, w2, color=ARM_COLORS[a], label=a)
        for b, y in zip(bars, ys):
            if math.isfinite(y):
                axes[1].annotate(f"{y:.3f}x", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
    if not others or "dedicated" not in arms:
        axes[1].text(0.5, 0.5, "no ratio: needs dedicated and another arm", ha="center", va="center",
                     transform=axes[1].transAxes)
    axes[1].axhline(1.0, color="k", lw=0.8, label="dedicated (1.0x)", zorder=3)
    axes[1].axhline(gates.min_ratio, color="r", ls="--", lw=1, label=f"gate: {gates.min_ratio:g}x on every seed",
                    zorder=3)
    axes[1].set_title("ratio to dedicated, same seed")
    axes[1].set_ylabel("x dedicated steps per device-hour")
    top = max([gates.min_ratio] + [v for a in others for v in res["ratio"].get(a, {}).values()])
    axes[1].set_ylim(0, top * 1.18)
    for ax in axes:
        ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
        ax.set_xlim(-0.6, len(seeds) - 0.4)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, frameon=False)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fig_learning_curves(runs: list[RunData], res: dict, path: Path) -> None:
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    jobs = res["jobs"]
    ncol = min(4, max(1, len(jobs)))
    nrow = math.ceil(len(jobs) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4 * ncol, 3.2 * nrow), squeeze=False)
    for ax, job in zip(axes.flat, jobs):
        for a in res["arms"]:
            curves = [dict(r.curves[job]) for r in runs if r.arm == a and job in r.curves]
            for c in curves:
                ax.plot(list(c), list(c.values()), color=ARM_COLORS[a], alpha=0.3, lw=0.8)
            steps = sorted({s for c in curves for s in c})
            if steps:
                mean = [np.mean([c[s] for c in curves if s in c]) for s in steps]
                base = a == "dedicated"  # wide and underneath, so an arm on top of it still shows it
                ax.plot(steps, mean, color=ARM_COLORS[a], lw=5 if base else 2, alpha=0.55 if base else 1,
                        marker=None if base else "o", ms=3, label=f"{a} (n={len(curves)} runs)",
                        zorder=1 if base else 2)
        ax.set_title(job)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step (rollouts of adapter version k)")
        ax.set_ylabel("mean reward of the step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(jobs):]:
        ax.axis("off")
    fig.suptitle("training reward per step: thick = mean over runs (seeds x repeats), thin = each run; "
                 "dedicated wide and grey, underneath", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fig_paired(res: dict, gates: stats.Gates, path: Path) -> None:
    """Per row (arm, then the A/A): each pair's difference as a dot, the mean, the t interval
    (thick) and the bootstrap interval (thin). An interval reaching past the plotted range (a t
    interval over 2-3 pairs can be huge) is cut at the edge with its bound written there."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    rows = [(a, res["learning"][a]) for a in res["learning"]]
    if res["aa"].get("eval_accuracy") or res["aa"].get("train_reward"):
        rows.append(("dedicated A/A (r1 - r0)", {m: res["aa"].get(m) for m, _ in METRICS}))
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.6 + 1.0 * max(1, len(rows))), squeeze=False)
    jitter = np.random.default_rng(0)  # only spreads the dots vertically
    for ax, (metric, title) in zip(axes[0], METRICS):
        cells = [(y, label, learn.get(metric) if learn else None) for y, (label, learn) in enumerate(rows)]
        cells = [(y, label, c) for y, label, c in cells if c]
        # the plotted range: every dot, bootstrap bound, 0 and the gate, and t bounds of >= 3 pairs
        xs = [0.0, gates.min_lower_bound] + [p[2] for _, _, c in cells for p in c["pairs"]]
        xs += [v for _, _, c in cells for v in (c["bootstrap"]["low"], c["bootstrap"]["high"]) if math.isfinite(v)]
        xs += [v for _, _, c in cells if c["t"]["n"] >= 3 for v in (c["t"]["low"], c["t"]["high"]) if math.isfinite(v)]
        lo, hi = min(xs), max(xs)
        pad = 0.12 * (hi - lo or 0.1)
        lo, hi = lo - pad, hi + pad
        for y, label, c in cells:
            d = np.array([p[2] for p in c["pairs"]])
            ax.scatter(d, y + 0.3 + jitter.uniform(-0.06, 0.06, len(d)), s=12, color="0.5", zorder=2,
                       label="one (job, seed)" if y == 0 else None)
            col = ARM_COLORS.get(label, "k")
            for off, key, lw in ((-0.06, "t", 3.5), (0.1, "bootstrap", 1.5)):
                iv = c[key]
                if not math.isfinite(iv["low"]):
                    continue
                a, b = max(iv["low"], lo), min(iv["high"], hi)
                ax.plot([a, b], [y + off] * 2, color=col, lw=lw, solid_capstyle="butt", alpha=1 if key == "t" else 0.55,
                        label=f"{gates.conf:.0%} CI, {key}" if y == 0 else None)
                for bound, edge, ha in ((iv["low"], lo, "left"), (iv["high"], hi, "right")):
                    if (bound < lo) if ha == "left" else (bound > hi):
                        ax.annotate(f"{'<' if ha == 'left' else ''}{bound:+.2f}{'>' if ha == 'right' else ''}",
                                    (edge, y + off), ha=ha, va="bottom", fontsize=7, color=col)
            ax.plot([c["t"]["mean"]], [y - 0.06], "o", color=col, ms=6, zorder=3, label="mean" if y == 0 else None)
        ax.axvline(0, color="k", lw=0.8)
        ax.axvline(gates.min_lower_bound, color="r", ls="--", lw=1,
                   label=f"gate: lower bound >= {gates.min_lower_bound:+g}")
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
        ticks = []
        for label, learn in rows:
            c = (learn or {}).get(metric)
            ticks.append(f"{label}\n({len(c['pairs'])} pairs)" if c else label)
        ax.set_yticks(range(len(rows)), ticks)
        ax.set_ylim(len(rows) - 0.4, -0.5)
        ax.set_xlabel("difference per (job, seed): arm - dedicated (A/A: repeat 1 - repeat 0)")
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    h, lab = axes[0, 0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=len(lab), fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fig_timeline(runs: list[RunData], res: dict, path: Path) -> None:
    """One run per arm (lowest seed, repeat 0): one lane per group (per job for dedicated)."""
    plt = _plt()
    picks = [next(r for r in runs if r.arm == a) for a in res["arms"]]
    fig, axes = plt.subplots(len(picks), 1, figsize=(12, 1.0 + 1.2 * len(picks) + 0.25 * sum(
        len(r.summary.get("groups") or r.eval_after or [0]) for r in picks)), squeeze=False, sharex=True)
    for ax, r in zip(axes[:, 0], picks):
        spans = [s for s in r.spans if s["phase"] not in ("engine_start", "engine_warmup", "engine_steps")]
        if not spans:
            ax.set_title(f"{r.arm}: no timeline")
            continue
        t0 = min(s["start"] for s in spans)

        def group_lane(g: int) -> str:
            names = ",".join(r.summary["groups"][g]) if r.summary.get("groups") else ""
            return f"group {g}: {names[:40]}"

        def lanes_of(s: dict) -> list[str]:
            if s["phase"] == "eval":
                return ["eval (all jobs)"]
            if r.arm == "dedicated":
                return ["job " + ",".join(s["jobs"])]
            if s["group"] < 0 and s.get("groups"):  # one training step for several ready groups
                return [group_lane(g) for g in s["groups"]]
            return [group_lane(s["group"])] if s["group"] >= 0 else ["eval (all jobs)"]

        names = sorted({n for s in spans for n in lanes_of(s)}, key=lambda n: (n.startswith("eval"), n))
        lanes = {n: i for i, n in enumerate(names)}
        for s in spans:
            for n in lanes_of(s):
                ax.barh(lanes[n], s["end"] - s["start"], left=s["start"] - t0, height=0.7, zorder=2,
                        color=PHASE_COLORS.get(s["phase"], "k"), edgecolor="white", lw=0.3)
        w = r.summary.get("window", {})
        for win in w.get("windows", [w]):
            if win.get("seconds"):
                ax.axvspan(win["start"] - t0, win["end"] - t0, color="y", alpha=0.25, lw=0, zorder=0)
        ax.set_yticks(range(len(lanes)), list(lanes))
        ax.invert_yaxis()
        start = ("engine reused" if r.summary.get("engine_reused")
                 else f"engine start {r.summary.get('engine_start_s', 0):.0f}s not drawn")
        ax.set_title(f"{r.arm}, seed {r.seed} r{r.repeat}: {r.steps_per_hour:.0f} steps/h, "
                     f"busy {r.summary.get('busy_fraction') or 0:.0%} ({start})", fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="y", alpha=0.3))
    fig.legend(handles, list(PHASE_COLORS) + ["measured window"], loc="upper right", ncol=5, fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the run's first phase")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- report.md ------------------------------------------------------------------------------------
def _f(v, fmt=".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, fmt)


def _ci(iv: dict) -> str:
    return f"[{_f(iv['low'], '+.4f')}, {_f(iv['high'], '+.4f')}]"


def render(res: dict, runs: list[RunData], command: str, gates: stats.Gates, prereg: dict | None,
           warnings: list[str], figures: list[str], analysis: dict) -> str:
    seeds = res["seeds"]
    L = [f"# colora report: {', '.join(res['arms'])} over seeds {', '.join(map(str, seeds))}", "",
         "Generated by:", "", f"    {command}", ""]
    for w in warnings + res["notes"]:
        L.append(f"> **Warning:** {w}")
    if warnings or res["notes"]:
        L.append("")
    if res["gates"]:
        L += ["## Result", ""]
        for a, g in res["gates"].items():
            ratio = res["ratio_mean"].get(a)
            failed = [r["name"] for r in g["results"] if r["status"] != stats.PASS]
            L.append(f"- **{a}: {g['overall']}**" + (f" ({_f(ratio)}x dedicated, mean over seeds)" if ratio else "")
                     + (f"; not passed: {', '.join(failed)}" if failed else "; every gate passed")
                     + (" (primary arm)" if prereg and a == prereg["primary_arm"] else ""))
        L.append("")
    L += ["## Throughput: optimizer steps per device-hour, all jobs", "",
          "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ratio |", "|---" * (len(seeds) + 2) + "|"]
    for a in res["arms"]:
        cells = []
        for s in seeds:
            v, r = res["steps_per_hour"][a].get(str(s)), res["ratio"].get(a, {}).get(str(s))
            cells.append(_f(v, ".1f") + (f" ({r:.3f}x)" if r is not None else ""))
        mean = _f(res["ratio_mean"].get(a), ".3f") + "x" if a != "dedicated" else "1x (baseline)"
        L.append(f"| {a} | " + " | ".join(cells) + f" | {mean} |")
    L += ["", "Ratio: the arm's steps per hour over dedicated's on the same seed, each averaged over repeats first.",
          ""]
    if res["aa"]["throughput"]:
        L.append("A/A (dedicated repeat 1 vs repeat 0, relative): " + ", ".join(
            f"seed {s}: {v:+.1%}" for s, v in res["aa"]["throughput"].items()) + ".")
    else:
        L.append("A/A: no seed has two dedicated repeats, so the gain-vs-A/A gate cannot be evaluated.")
    L += ["", "## Learning: paired differences, arm - dedicated, per (job, seed)", "",
          f"Repeats are averaged per (job, seed) first. t: Student-t interval; bootstrap: "
          f"{analysis.get('bootstrap_method', 'percentile')} method, {analysis.get('bootstrap_resamples', 10000)} "
          f"resamples, numpy Generator seed {analysis.get('bootstrap_seed', 0)}. Pairs sharing a seed share a run; "
          "the intervals treat them as independent.", "",
          f"| arm | metric | pairs | mean diff | {gates.conf:.0%} CI (t) | {gates.conf:.0%} CI (bootstrap) |",
          "|---|---|---|---|---|---|"]
    rows = [(a, res["learning"][a]) for a in res["learning"]] + [("dedicated A/A (r1 - r0)", res["aa"])]
    for a, learn in rows:
        for m, title in METRICS:
            c = learn.get(m)
            if c:
                L.append(f"| {a} | {title} | {len(c['pairs'])} | {_f(c['t']['mean'], '+.4f')} | {_ci(c['t'])} | "
                         f"{_ci(c['bootstrap'])} |")
                if c["dropped"]:
                    L.append(f"| | unpaired, left out | {', '.join(f'{j} seed {s}' for j, s in c['dropped'])} | | | |")
    ebj = res.get("eval_by_job") or {}
    if ebj:
        arms_e = [a for a in res["arms"] if a in ebj]
        jobs = sorted({j for a in arms_e for j in ebj[a]})
        L += ["", "## Eval accuracy before and after training, per job", "",
              "Held-out eval split, greedy; each cell: before -> after (change), the mean over seeds (and "
              "repeats). The last row counts the jobs whose accuracy rose.", "",
              "| job | " + " | ".join(arms_e) + " |", "|---" * (len(arms_e) + 1) + "|"]
        for j in jobs:
            cells = [(f"{ebj[a][j]['before']:.3f} -> {ebj[a][j]['after']:.3f} ({ebj[a][j]['change']:+.3f})"
                      if j in ebj[a] else "-") for a in arms_e]
            L.append(f"| {j} | " + " | ".join(cells) + " |")
        L.append("| rose on | " + " | ".join(
            f"{sum(v['change'] > 0 for v in ebj[a].values())} of {len(ebj[a])}" for a in arms_e) + " |")
    src = f"pre-registered in `{prereg['path']}`" if prereg else "the reference study's numbers; no --prereg given"
    L += ["", f"## Gates ({src})", "",
          f"throughput >= {gates.min_ratio:g}x dedicated on every seed; mean gain (ratio - 1) > "
          f"{gates.aa_multiple:g} x "
          f"the largest |A/A|; paired {gates.conf:.0%} {gates.interval} lower bounds of eval accuracy and training "
          f"reward differences >= {gates.min_lower_bound:+g}.", ""]
    if prereg and not prereg["matches"]:
        L += ["> **Not a pre-registered test:** these runs' configs differ from the locked one: "
              + ", ".join(prereg["mismatched_runs"]), ""]
    if not res["gates"]:
        L += ["No arm besides dedicated (or no dedicated baseline): no gate can be evaluated.", ""]
    L += ["| arm | gate | result | value | threshold | numbers |", "|---|---|---|---|---|---|"]
    for a, g in res["gates"].items():
        for r in g["results"]:
            L.append(f"| {a} | {r['name']} | **{r['status']}** | {_f(r['value'], '.4f')} | "
                     f"{_f(r['threshold'], '.4f')} | "
                     f"{r['detail']} |")
        L.append(f"| {a} | **all gates** | **{g['overall']}** | | | |")
    if prereg:
        L += ["", "Hypotheses:", ""] + [f"- {h['id']} ({h.get('arm') or 'all arms'}): {h['statement']}"
                                        for h in prereg["hypotheses"]]
    L += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
    L += ["", "## Runs used", "",
          "config hash: the hash a pre-registration locks (every setting but experiment.arm and experiment.seed); "
          "code: the hash of the source tree that ran (colora.provenance).",
          "", "| arm | seed | repeat | steps | seconds | steps/h | device | MPS | engine | config hash | code | directory |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = r.summary
        L.append(f"| {r.arm} | {r.seed} | {r.repeat} | {s.get('steps_measured')} | "
                 f"{_f(s.get('seconds_measured'), '.1f')} | "
                 f"{_f(r.steps_per_hour, '.1f')} | {s.get('device')} | {s.get('mps')} | "
                 f"{'reused' if s.get('engine_reused') else 'started'} | {r.lock_hash} | {_code(s)} | {display_path(r.path)} |")
    return "\n".join(L) + "\n"


def _code(summary: dict) -> str:
    """The source hash of the code that made a run (colora.provenance), '-' for runs that predate it."""
    return (summary.get("code_version") or {}).get("source_hash") or "-"


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
    gates = pr.gates if pr else stats.Gates()
    analysis = dict(pr.analysis) if pr else {}
    if bootstrap_seed is not None:
        analysis["bootstrap_seed"] = bootstrap_seed
    prinfo, left_out = None, []
    if pr:
        # the pre-registered seeds only: later seeds are verification, reported apart, never pooled
        left_out = [r for r in runs if r.seed not in pr.seeds]
        runs = [r for r in runs if r.seed in pr.seeds]
        if left_out:
            warnings.append(f"seeds {sorted({r.seed for r in left_out})} are not pre-registered in {pr.path}: their "
                            f"{len(left_out)} run(s) are left out; report them separately, without --prereg")
        if not runs:
            raise ReportError(f"no run of the pre-registered seeds {list(pr.seeds)} among {', '.join(map(str, paths))}")
        extra = sorted({r.arm for r in runs if r.arm not in pr.arms})
        if extra:
            warnings.append(f"arm(s) {', '.join(extra)} are not pre-registered in {pr.path}: exploratory")
        bad = [f"{r.arm} seed {r.seed} r{r.repeat} ({r.lock_hash})" for r in runs if r.lock_hash != pr.config_hash]
        prinfo = {**pr.header_dict(), "matches": not bad, "mismatched_runs": bad,
                  "left_out_runs": [display_path(r.path) for r in left_out]}
    hashes = sorted({r.lock_hash for r in runs})
    if len(hashes) > 1:
        warnings.append(f"the runs come from {len(hashes)} different configs (beyond arm and seed: "
                        f"{', '.join(hashes)}); "
                        "see the last column of 'Runs used'")
    res = analyse(runs, gates, analysis, list(pr.seeds) if pr else None)
    out = Path(out)
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
        fig_timeline(runs, res, out / names[-1])
    figures = names
    summary = {"command": command, "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "gates_config": gates.__dict__, "analysis": analysis, "prereg": prinfo, "warnings": warnings,
               "figures": figures, **res,
               "runs": [{"dir": display_path(r.path), "arm": r.arm, "seed": r.seed, "repeat": r.repeat, "lock_hash": r.lock_hash,
                         "steps_per_hour": r.steps_per_hour, "steps_measured": r.summary.get("steps_measured"),
                         "seconds_measured": r.summary.get("seconds_measured"), "eval_accuracy": r.eval_after,
                         "train_reward": r.reward_mean} for r in runs]}
    (out / "report.md").write_text(render(res, runs, command, gates, prinfo, warnings, figures, analysis))
    write_json_atomic(out / "summary.json", summary)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora report", description="Paired statistics and gates over run directories.")
    p.add_argument("runs", nargs="+", help="run directories, directories holding them (a sweep's --out), or "
                                           ".tar.gz archives of them")
    p.add_argument("--prereg", help="pre-registration whose gates and analysis plan to apply")
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
    return 0
