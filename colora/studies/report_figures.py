"""The figures of a report: throughput and its ratios, learning curves, paired differences, and the
timeline of one run per arm.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from colora.config import ARMS
from colora.studies import stats
from colora.studies.report_data import METRICS, RunData

ARM_COLORS = {"dedicated": "#7f7f7f", "shared_sync": "#1f77b4", "overlap": "#ff7f0e", "mps": "#2ca02c",
              "overlap_mps": "#d62728", "timeslice": "#9467bd"}
PHASE_COLORS = {"generate": "#4c72b0", "train": "#dd8452", "export": "#8c8c8c", "reload": "#55a868", "eval": "#8172b3",
                "checkpoint": "#937860", "checkpoint_write": "#c8b79e"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _arm_handles(arms: list[str], plt) -> list:
    return [plt.Rectangle((0, 0), 1, 1, color=ARM_COLORS[a], label=a) for a in arms]


def fig_throughput(runs: list[RunData], res: dict, gates: stats.Gates | None, path: Path):
    """Steps per device-hour per (arm, seed) and the ratio to dedicated; the gate's line only with a
    pre-registration's `gates`. One legend below both panels. Returns the figure (closed, saved)."""
    plt = _plt()
    arms, seeds = res["arms"], res["seeds"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    w = min(0.4, 0.8 / max(1, len(arms)))
    repeats = False
    for i, a in enumerate(arms):
        xs = [k + (i - (len(arms) - 1) / 2) * w for k in range(len(seeds))]
        ys = [res["steps_per_hour"][a].get(str(s), math.nan) for s in seeds]
        axes[0].bar(xs, ys, w, color=ARM_COLORS[a])
        for k, s in enumerate(seeds):
            reps = [r.steps_per_hour for r in runs if r.arm == a and r.seed == s]
            if len(reps) > 1:
                repeats = True
                axes[0].plot([xs[k]] * len(reps), reps, "k.", ms=6, zorder=3)
    axes[0].set_title("steps per device-hour" + (" (bar: mean over repeats; dots: repeats)" if repeats else ""))
    axes[0].set_ylabel("optimizer steps / device-hour, all jobs")
    others = [a for a in arms if a != "dedicated"]
    w2 = min(0.4, 0.8 / max(1, len(others)))
    for i, a in enumerate(others):
        xs = [k + (i - (len(others) - 1) / 2) * w2 for k in range(len(seeds))]
        ys = [res["ratio"].get(a, {}).get(str(s), math.nan) for s in seeds]
        bars = axes[1].bar(xs, ys, w2, color=ARM_COLORS[a])
        for b, y in zip(bars, ys):
            if math.isfinite(y):
                axes[1].annotate(f"{y:.3f}x", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
    if not others or "dedicated" not in arms:
        axes[1].text(0.5, 0.5, "no ratio: needs dedicated and another arm", ha="center", va="center",
                     transform=axes[1].transAxes)
    lines = [axes[1].axhline(1.0, color="k", lw=0.8, label="dedicated (1.0x)", zorder=3)]
    if gates is not None:
        lines.append(axes[1].axhline(gates.min_ratio, color="r", ls="--", lw=1, zorder=3,
                                     label=f"gate: {gates.min_ratio:g}x on every seed"))
    axes[1].set_title("ratio to dedicated, same seed")
    axes[1].set_ylabel("x dedicated steps per device-hour")
    ratios = [v for a in others for v in res["ratio"].get(a, {}).values()]
    top = max([1.0] + ([gates.min_ratio] if gates else []) + ratios)
    axes[1].set_ylim(0, top * 1.18)
    for ax in axes:
        ax.set_xticks(range(len(seeds)), [f"seed {s}" for s in seeds])
        ax.set_xlim(-0.6, len(seeds) - 0.4)
        ax.grid(axis="y", alpha=0.3)
    handles = _arm_handles(arms, plt) + lines
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def fig_learning_curves(runs: list[RunData], res: dict, path: Path):
    """Per job the mean reward of each step: each run thin, the mean over runs thick; one legend for
    the figure, below the panels. Returns the figure (closed, saved)."""
    plt = _plt()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    jobs = res["jobs"]
    ncol = min(4, max(1, len(jobs)))
    nrow = math.ceil(len(jobs) / ncol)
    width = max(6.5, 4 * ncol)  # a legend of five arms and the title need this much even for one job
    fig, axes = plt.subplots(nrow, ncol, figsize=(width, 3.2 * nrow + 1.2), squeeze=False, layout="constrained")
    counts: dict[str, int] = {}
    for ax, job in zip(axes.flat, jobs):
        for a in res["arms"]:
            curves = [dict(r.curves[job]) for r in runs if r.arm == a and job in r.curves]
            for c in curves:
                ax.plot(list(c), list(c.values()), color=ARM_COLORS[a], alpha=0.3, lw=0.8)
            steps = sorted({s for c in curves for s in c})
            if steps:
                counts[a] = max(counts.get(a, 0), len(curves))
                mean = [np.mean([c[s] for c in curves if s in c]) for s in steps]
                base = a == "dedicated"  # wide and underneath, so an arm on top of it still shows it
                ax.plot(steps, mean, color=ARM_COLORS[a], lw=5 if base else 2, alpha=0.55 if base else 1,
                        marker=None if base else "o", ms=3, zorder=1 if base else 2)
        ax.set_title(job)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step (rollouts of adapter version k)")
        ax.set_ylabel("mean reward of the step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(jobs):]:
        ax.axis("off")
    handles = [Line2D([], [], color=ARM_COLORS[a], lw=5 if a == "dedicated" else 2,
                      alpha=0.55 if a == "dedicated" else 1, marker=None if a == "dedicated" else "o", ms=3,
                      label=f"{a} (n={counts[a]} run{'s' if counts[a] > 1 else ''})")
               for a in res["arms"] if a in counts]
    handles.append(Line2D([], [], color="0.5", alpha=0.3, lw=0.8, label="each run"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 3 if width < 8 else 6), fontsize=8,
               frameon=False)
    fig.suptitle("training reward per step: thick = mean over runs (seeds x repeats), thin = each run; "
                 "dedicated wide and grey, underneath" if width >= 12 else
                 "training reward per step\nthick = mean over runs, thin = each run; dedicated wide, underneath",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def _paired_range(cells: list, gates: stats.Gates | None) -> tuple[float, float]:
    """The plotted x range: symmetric about 0 (the no-difference line sits in the middle, never at an
    edge), wide enough for every dot, bootstrap bound, the gate and the t bounds of >= 3 pairs."""
    xs = [0.0] + ([gates.min_lower_bound] if gates else []) + [p[2] for _, _, c in cells for p in c["pairs"]]
    xs += [v for _, _, c in cells for v in (c["bootstrap"]["low"], c["bootstrap"]["high"]) if math.isfinite(v)]
    xs += [v for _, _, c in cells if c["t"]["n"] >= 3 for v in (c["t"]["low"], c["t"]["high"]) if math.isfinite(v)]
    half = max(abs(x) for x in xs) * 1.15 or 0.05
    return -half, half


def fig_paired(res: dict, gates: stats.Gates | None, path: Path):
    """Per row (arm, then the A/A): each pair's difference as a dot, the mean, the t interval
    (thick) and the bootstrap interval (thin); where every pair is equal there is no interval to draw,
    and the panel says so.
    An interval reaching past the plotted range (a t interval over 2-3 pairs can be huge) is cut at
    the edge with its bound written there. The gate's line only with `gates`. Returns the figure."""
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    conf = res.get("conf", gates.conf if gates else 0.95)
    rows = [(a, res["learning"][a]) for a in res["learning"]]
    if res["aa"].get("eval_accuracy") or res["aa"].get("train_reward"):
        rows.append(("dedicated A/A (r1 - r0)", {m: res["aa"].get(m) for m, _ in METRICS}))
    fig, axes = plt.subplots(1, 2, figsize=(12, 2.2 + 1.0 * max(1, len(rows))), squeeze=False, layout="constrained")
    jitter = np.random.default_rng(0)  # only spreads the dots vertically
    for ax, (metric, title) in zip(axes[0], METRICS):
        cells = [(y, label, learn.get(metric) if learn else None) for y, (label, learn) in enumerate(rows)]
        cells = [(y, label, c) for y, label, c in cells if c]
        lo, hi = _paired_range(cells, gates)
        for y, label, c in cells:
            d = np.array([p[2] for p in c["pairs"]])
            ax.scatter(d, y + 0.3 + jitter.uniform(-0.06, 0.06, len(d)), s=12, color="0.5", zorder=2)
            col = ARM_COLORS.get(label, "k")
            if len(d) and np.ptp(d) == 0:  # one pair, or every pair equal: no interval to draw, say so
                right = d[0] > (lo + hi) / 2  # the note on the side with room
                ax.annotate(f"{'one pair' if len(d) == 1 else 'every pair'} {d[0]:+.3f}: no interval", (d[0], y - 0.06),
                            xytext=(-8 if right else 8, 0), textcoords="offset points", va="center",
                            ha="right" if right else "left", fontsize=8, color=col)
            for off, key, lw in ((-0.06, "t", 3.5), (0.1, "bootstrap", 1.5)):
                iv = c[key]
                if not (math.isfinite(iv["low"]) and math.isfinite(iv["high"]) and iv["high"] > iv["low"]):
                    continue
                a, b = max(iv["low"], lo), min(iv["high"], hi)
                ax.plot([a, b], [y + off] * 2, color=col, lw=lw, solid_capstyle="butt", alpha=1 if key == "t" else 0.55)
                for bound, edge, ha in ((iv["low"], lo, "left"), (iv["high"], hi, "right")):
                    if (bound < lo) if ha == "left" else (bound > hi):
                        ax.annotate(f"{'<' if ha == 'left' else ''}{bound:+.2f}{'>' if ha == 'right' else ''}",
                                    (edge, y + off), ha=ha, va="bottom", fontsize=7, color=col)
            ax.plot([c["t"]["mean"]], [y - 0.06], "o", color=col, ms=6, zorder=3)
        ax.axvline(0, color="k", lw=0.8)
        if gates is not None:
            ax.axvline(gates.min_lower_bound, color="r", ls="--", lw=1)
        ax.set_xlim(lo, hi)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
        ticks = []
        for label, learn in rows:
            c = (learn or {}).get(metric)
            n = len(c["pairs"]) if c else 0
            ticks.append(f"{label}\n({n} pair{'' if n == 1 else 's'})" if c else label)
        ax.set_yticks(range(len(rows)), ticks)
        ax.set_ylim(len(rows) - 0.4, -0.5)
        ax.set_xlabel("difference per (job, seed): arm - dedicated")
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], ls="", marker="o", ms=4, color="0.5", label="one (job, seed)"),
               Line2D([], [], lw=3.5, color="k", label=f"{conf:.0%} CI, t"),
               Line2D([], [], lw=1.5, color="k", alpha=0.55, label=f"{conf:.0%} CI, bootstrap"),
               Line2D([], [], ls="", marker="o", ms=6, color="k", label="mean")]
    if gates is not None:
        handles.append(Line2D([], [], ls="--", lw=1, color="r",
                              label=f"gate: lower bound >= {gates.min_lower_bound:+g}"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def fig_timeline(runs: list[RunData], path: Path):
    """The timeline of one run per arm (the first of `runs` of each), one lane per group (per job for
    dedicated, per tenant for timeslice), the measured window shaded; the phases' legend below the panels. Sweeps and the arms
    benchmark draw theirs with this. Returns the figure (closed, saved)."""
    plt = _plt()
    picks = [next(r for r in runs if r.arm == a) for a in ARMS if any(r.arm == a for r in runs)]
    fig, axes = plt.subplots(len(picks), 1, figsize=(12, 1.6 + 1.2 * len(picks) + 0.25 * sum(
        len(r.summary.get("groups") or r.eval_after or [0]) for r in picks)), squeeze=False, sharex=True,
        layout="constrained")
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
            if "tenant" in s:  # the timeslice arm: a lane per tenant, whose groups number from 0 each
                return [f"tenant {s['tenant']}: " + ",".join(r.summary["groups"][s["tenant"]])[:40]]
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
        busy, duty = r.summary.get("busy_fraction"), ((r.summary.get("timeslice") or {}).get("broker") or {}).get("duty")
        held = (f"busy {busy:.0%}" if busy is not None
                else f"the grant held {duty:.0%} of the broker's window" if duty is not None else "busy -")
        ax.set_title(f"{r.arm}, seed {r.seed} r{r.repeat}: {r.steps_per_hour:.0f} steps/h, {held} ({start})",
                     fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="y", alpha=0.3))
    fig.legend(handles, list(PHASE_COLORS) + ["measured window"], loc="outside lower center", ncol=len(handles),
               fontsize=8, frameon=False)
    axes[-1, 0].set_xlabel("seconds since the run's first phase")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
