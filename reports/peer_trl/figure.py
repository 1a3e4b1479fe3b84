"""The figure of this report, from its JSON: python3 reports/peer_trl/figure.py"""
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
trl = json.loads((here / "trl.json").read_text())
arms = {r["arm"]: r for r in json.loads((here / "arms.json").read_text())["runs"]}
rows = [("TRL GRPOTrainer,\none job, vLLM colocated", trl["steps_per_device_hour"], "#8c8c8c"),
        ("colora dedicated,\na GPU per job", arms["dedicated"]["steps_per_hour"], "#4c72b0"),
        ("colora overlap_mps,\n8 jobs on one GPU", arms["overlap_mps"]["steps_per_hour"], "#dd8452")]
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
bars = ax.barh([r[0] for r in rows][::-1], [r[1] for r in rows][::-1], color=[r[2] for r in rows][::-1])
for b, (_, v, _) in zip(bars, rows[::-1]):
    ax.text(v, b.get_y() + b.get_height() / 2, f" {v:,.0f} ({v / rows[0][1]:.2f}x TRL)", va="center", fontsize=8)
ax.set_xlabel("optimizer steps per device-hour (every response 256 tokens)")
ax.set_xlim(0, max(r[1] for r in rows) * 1.35)
fig.savefig(here / "report.png", dpi=120)
