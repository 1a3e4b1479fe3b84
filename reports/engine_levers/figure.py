"""The figure of this report, from its run directories: python3 reports/engine_levers/figure.py

Each point is one half-second bucket of one engine's steps (the timeline's `engine_steps`) with three
steps or more: the mean step time against the requests in flight, while no group trained."""
import json
import tarfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
runs = [("one engine, prefix cache on (main)", "seed4-main", "k", "o"),
        ("two engines (engine.instances=2)", "seed4-vary-engine.instances-2", "#dd8452", "s"),
        ("one engine, prefix cache off", "seed4-vary-engine.enable_prefix_caching-false", "#4c72b0", "^")]
with tarfile.open(here / "runs.tgz") as tar:
    timelines = {name: [json.loads(line) for line in tar.extractfile(f"colora-runs2/overlap_mps/{name}/timeline.jsonl")]
                 for _, name, _, _ in runs}
fig, ax = plt.subplots(figsize=(8, 3.8), layout="constrained")
for label, name, color, marker in runs:
    spans = timelines[name]
    trains = [(s["start"], s["end"]) for s in spans if s["phase"] == "train"]
    pts = []
    for b in spans:
        if b["phase"] != "engine_steps" or b["steps"] < 3:
            continue
        covered = sum(max(0.0, min(e, b["end"]) - max(s, b["start"])) for s, e in trains)
        if covered < (b["end"] - b["start"]) / 2:
            pts.append((b["inflight"] / b["steps"], 1e3 * b["busy"] / b["steps"]))
    ax.scatter(*zip(*pts), s=12, color=color, marker=marker, alpha=0.7, label=label)
ax.set_xlabel("requests in flight in the engine (each engine's own, for two engines)")
ax.set_ylabel("ms per engine step")
ax.set_xlim(0, None)
ax.set_ylim(0, None)
ax.legend(fontsize=8, loc="upper left")
fig.savefig(here / "report.png", dpi=120)
