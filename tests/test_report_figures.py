"""The report's figures as a reader sees them, at the sizes the report writes, with 1, 2 and 8 jobs
and 1-3 seeds: no text cut off at the figure's edge, no legend over a panel or a title, the caption
promising only what is drawn, gate lines only with a pre-registration. Checked on matplotlib's
bounding boxes, not on pixels."""

from __future__ import annotations

import numpy as np
import pytest
from test_report import write_fake_run

from colora.record.runlog import write_json_atomic
from colora.studies import report, report_figures, stats

NAMES = ["add2d", "add3", "countdown", "counting", "gsm", "linalg", "modular", "sorting"]
SPH = {"dedicated": 1000.0, "shared_sync": 2300.0, "overlap": 2500.0, "mps": 2400.0, "overlap_mps": 2700.0}


def fake_study(root, jobs: int, seeds: int, arms=("dedicated", "shared_sync", "overlap_mps"), aa: bool = True):
    """A sweep directory: every arm on seeds 1..seeds, the dedicated A/A on seed 1 when `aa`."""
    rng = np.random.default_rng(10 * jobs + seeds)
    names, listed = NAMES[:jobs], []
    for seed in range(1, seeds + 1):
        for arm in arms:
            for rep in ((0, 1) if arm == "dedicated" and aa and seed == 1 else (0,)):
                rewards = {j: list(np.clip(np.linspace(0, 0.6, 10) + rng.normal(0, 0.05, 10), 0, 1)) for j in names}
                acc = {j: float(rng.choice([0.25, 0.5, 0.75])) for j in names}
                rel = f"{arm}/seed{seed}-r{rep}"
                write_fake_run(root / rel, arm, seed, SPH[arm] * (1 + rng.normal(0, 0.03)), acc, rewards)
                listed.append({"dir": rel, "arm": arm, "seed": seed, "repeat": rep, "state": "complete"})
    write_json_atomic(root / "sweep.json", {"runs": listed})
    return root


def _inside(inner, outer, tol: float = 1.0) -> bool:
    return (inner.x0 >= outer.x0 - tol and inner.y0 >= outer.y0 - tol and inner.x1 <= outer.x1 + tol
            and inner.y1 <= outer.y1 + tol)


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def layout_problems(fig) -> list[str]:
    """Text cut off at the figure's edge, and legends over panels or titles (the figure drawn again
    as savefig drew it: a closed figure has lost its canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    box = fig.bbox
    axes = [ax for ax in fig.axes if ax.axison]
    texts = [t for t in [fig._suptitle] if t is not None] + [t for ax in axes for t in ax.texts]
    problems = [f"cut off: {t.get_text()!r}" for t in texts
                if t.get_text() and not _inside(t.get_window_extent(r), box)]
    # an axes' tight box holds what it draws: title, axis labels, tick labels
    problems += [f"cut off: the panel {ax.get_title()!r} or its labels" for ax in axes
                 if not _inside(ax.get_tightbbox(r), box)]
    legends = [(leg, True) for leg in fig.legends] + [(ax.get_legend(), False) for ax in axes if ax.get_legend()]
    titles = [ax.title for ax in axes if ax.title.get_text()] + [t for t in [fig._suptitle] if t is not None]
    for leg, figure_level in legends:
        lb = leg.get_window_extent(r)
        if not _inside(lb, box):
            problems.append("legend cut off")
        problems += [f"legend over the title {t.get_text()!r}" for t in titles if _overlap(lb, t.get_window_extent(r))]
        if figure_level:
            problems += [f"legend over the panel {ax.get_title()!r}" for ax in axes
                         if _overlap(lb, ax.get_window_extent(r))]
            problems += [f"legend over the label {ax.xaxis.label.get_text()!r}" for ax in axes
                         if ax.xaxis.label.get_text() and _overlap(lb, ax.xaxis.label.get_window_extent(r))]
    return problems


def _legend_texts(fig) -> list[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    return [t.get_text() for leg in legends for t in leg.get_texts()]


@pytest.mark.parametrize("jobs, seeds", [(1, 1), (2, 2), (8, 3), (8, 1)])
def test_figures_keep_every_text_and_legend_clear(tmp_path, jobs, seeds):
    runs, _ = report.load_runs([fake_study(tmp_path / "s", jobs, seeds)])
    gates = stats.Gates()
    for g in (None, gates):  # without and with a pre-registration's gates
        res = report.analyse(runs, g, {}, None)
        figs = {"throughput": report_figures.fig_throughput(runs, res, g, tmp_path / "t.png"),
                "learning_curves": report_figures.fig_learning_curves(runs, res, tmp_path / "l.png"),
                "paired": report_figures.fig_paired(res, g, tmp_path / "p.png"),
                "timeline": report_figures.fig_timeline(runs, tmp_path / "tl.png")}
        for name, fig in figs.items():
            assert layout_problems(fig) == [], (name, g)
        gate_lines = [t for f in ("throughput", "paired") for t in _legend_texts(figs[f]) if t.startswith("gate")]
        assert len(gate_lines) == (0 if g is None else 2)
    # one legend for the learning curves' figure, none inside a panel
    lc = figs["learning_curves"]
    assert len(lc.legends) == 1 and not any(ax.get_legend() for ax in lc.axes)
    assert [t for t in _legend_texts(lc) if t.startswith("dedicated")] == [f"dedicated (n={seeds + 1} runs)"]
    for f in ("t.png", "l.png", "p.png", "tl.png"):
        assert (tmp_path / f).stat().st_size > 10_000


def test_throughput_caption_promises_dots_only_where_repeats_are_drawn(tmp_path):
    for aa, dots in ((False, False), (True, True)):
        runs, _ = report.load_runs([fake_study(tmp_path / f"s{aa}", 2, 2, aa=aa)])
        res = report.analyse(runs, None, {}, None)
        fig = report_figures.fig_throughput(runs, res, None, tmp_path / "t.png")
        left = fig.axes[0]
        assert ("dots: repeats" in left.get_title()) == dots
        drawn = [ln for ln in left.get_lines() if ln.get_marker() == "."]
        assert bool(drawn) == dots


def test_paired_differences_say_so_where_every_pair_is_equal(tmp_path):
    root = tmp_path / "s"
    listed = []
    for arm, sph in (("dedicated", 1000.0), ("shared_sync", 2000.0)):
        for seed in (1, 2):
            write_fake_run(root / f"{arm}/seed{seed}-r0", arm, seed, sph, {"a": 0.5, "b": 0.5},
                           {"a": [0.1, 0.2], "b": [0.3, 0.3]})
            listed.append({"dir": f"{arm}/seed{seed}-r0", "arm": arm, "seed": seed, "repeat": 0, "state": "complete"})
    write_json_atomic(root / "sweep.json", {"runs": listed})
    runs, _ = report.load_runs([root])
    res = report.analyse(runs, None, {}, None)
    fig = report_figures.fig_paired(res, None, tmp_path / "p.png")
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        assert lo < 0 < hi and abs(lo + hi) < 1e-9  # 0 in the middle, not at an edge
        assert any("every pair +0.000: no interval" in t.get_text() for t in ax.texts)
        # no line of zero length drawn as an interval
        assert not any(len(ln.get_xdata()) == 2 and ln.get_xdata()[0] == ln.get_xdata()[1] for ln in ax.get_lines()
                       if ln.get_linestyle() == "-" and ln.get_linewidth() > 1)
    assert layout_problems(fig) == []


def test_a_timeslice_timeline_has_a_lane_per_tenant_and_the_brokers_duty(tmp_path):
    """The timeslice arm's tenants each number their groups from 0: the timeline keeps them apart, a lane
    per tenant named by its jobs, and its title gives the broker's duty where the arm has no busy share."""
    from colora.studies.report_data import RunData

    spans = [{"phase": ph, "group": 0, "jobs": [job], "tenant": k, "start": t, "end": t + 0.9}
             for k, job in enumerate(("gsm", "countdown")) for i, ph in enumerate(("generate", "train"))
             for t in [2.0 * i + k]]
    spans.append({"phase": "eval", "group": -1, "jobs": ["gsm"], "tenant": 0, "start": 5.0, "end": 5.5})
    run = RunData(tmp_path, "timeslice", 1, 0, "", {"steps_per_hour": 1540.0, "groups": [["gsm"], ["countdown"]],
                                                     "busy_fraction": None, "timeslice": {"broker": {"duty": 0.92}},
                                                     "window": {"start": 1.0, "end": 4.0, "seconds": 3.0}},
                  {}, {}, {}, spans)
    fig = report_figures.fig_timeline([run], tmp_path / "tl.png")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["tenant 0: gsm", "tenant 1: countdown",
                                                             "eval, checkpoints (all jobs)"]
    assert "the grant held 92% of the broker's window" in ax.get_title()
    assert layout_problems(fig) == []
