"""The figures of a report: throughput and its ratios, learning curves, paired differences, and the
timeline of one run per arm.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from . import stats
from .config import ARMS
from .report import METRICS, RunData

ARM_COLORS = {"dedicated": "#7f7f7f", "shared_sync": "#1f77b4", "overlap": "#ff7f0e", "mps": "#2ca02c",
              "overlap_mps": "#d62728"}
PHASE_COLORS = {"generate": "#4c72b0", "train": "#dd8452", "export": "#8c8c8c", "reload": "#55a868", "eval": "#8172b3",
                "checkpoint": "#937860"}


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


def fig_timeline(runs: list[RunData], path: Path) -> None:
    """The timeline of one run per arm (the first of `runs` of each), one lane per group (per job for
    dedicated), the measured window shaded. Sweeps and the arms benchmark draw theirs with this."""
    plt = _plt()
    picks = [next(r for r in runs if r.arm == a) for a in ARMS if any(r.arm == a for r in runs)]
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
            if s["phase"] in ("eval", "checkpoint"):
                return ["eval, checkpoints (all jobs)"]
            if r.arm == "dedicated":
                return ["job " + ",".join(s["jobs"])]
            if s["group"] < 0 and s.get("groups"):  # one training step for several ready groups
                return [group_lane(g) for g in s["groups"]]
            return [group_lane(s["group"])] if s["group"] >= 0 else ["eval, checkpoints (all jobs)"]

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
