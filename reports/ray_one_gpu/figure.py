"""The figure of this report, from its JSON: python3 reports/ray_one_gpu/figure.py"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
window = json.loads((here / "corunner_summary.json").read_text())["window"]
plain_cycle = json.loads((here / "../arms_code_shape/arms.json").read_text())
plain_cycle = next(r for r in plain_cycle["runs"] if r["arm"] == "overlap_mps")["phases"]["chain"]["cycle"]
fig, ax = plt.subplots(figsize=(8, 3.6), layout="constrained")
for g, jobs in enumerate(window["groups"]):
    ends = window["ends"][jobs[0]]
    ax.plot(range(2, len(ends) + 1), [b - a for a, b in zip(ends, ends[1:])], "o-", ms=3, label=f"group {g} (Ray path)")
ax.axhline(plain_cycle, color="k", ls="--", lw=1, label=f"plain path, mean cycle {plain_cycle:.2f} s")
for s in (6, 11, 16):
    ax.axvline(s, color="#937860", alpha=0.3, lw=6)
ax.set_xlabel("step of the group (shaded: the cycle that held a checkpoint, taken after steps 5, 10, 15)")
ax.set_ylabel("cycle, s")
ax.set_ylim(0, None)
ax.legend(fontsize=8, loc="lower right")
fig.savefig(here / "report.png", dpi=120)
