"""The figure of this report, from its JSON: python3 reports/ray_one_gpu/figure.py"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
runs = [("plain path, no checkpoints", "plain_summary.json", "k"),
        ("Ray path, no checkpoints", "corunner_summary.json", "#4c72b0"),
        ("plain path, checkpoints every 5 steps", "checkpoints_summary.json", "#dd8452")]
fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
for label, name, color in runs:
    window = json.loads((here / name).read_text())["window"]
    for g, jobs in enumerate(window["groups"]):
        ends = window["ends"][jobs[0]]
        ax.plot(range(2, len(ends) + 1), [b - a for a, b in zip(ends, ends[1:])], "o-" if g == 0 else "s--",
                ms=3, lw=1, color=color, label=f"{label}, group {g}")
for s in (6, 11, 16):
    ax.axvline(s, color="#dd8452", alpha=0.15, lw=6)
ax.set_xlabel("step of the group (shaded: the cycle after a checkpoint's snapshot, steps 5, 10, 15)")
ax.set_ylabel("cycle, s")
ax.set_ylim(0, None)
ax.legend(fontsize=7, loc="lower right", ncol=2)
fig.savefig(here / "report.png", dpi=120)
