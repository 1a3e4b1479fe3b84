"""Engine step time against requests in flight, from the runs' timelines (engine_steps records: per
half-second bucket, the client's engine steps, their busy seconds and the requests in flight summed
over them), split by whether a training step overlapped the bucket's middle.

    python reports/h200/eighth/engine_steps.py > reports/h200/eighth/engine_steps.txt
"""
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent / "runs"
RUNS = ["main/dedicated/seed1-main", "main/overlap_mps/seed1-main", "groups4/overlap_mps/seed1-main",
        "groups4/overlap_mps/seed1-vary-overlap.groups-4"]
BINS = [(0, 50), (50, 150), (150, 250), (250, 350), (350, 600)]
for run in RUNS:
    ev = [json.loads(line) for line in (HERE / run / "timeline.jsonl").open()]
    train = [(e["start"], e["end"]) for e in ev if e["phase"] == "train"]
    pts = []
    for e in ev:
        if e["phase"] != "engine_steps" or e["steps"] < 3:
            continue
        mid = (e["start"] + e["end"]) / 2
        pts.append((e["inflight"] / e["steps"], 1e3 * e["busy"] / e["steps"], any(s <= mid <= t for s, t in train)))
    for training in (False, True):
        sel = [(x, y) for x, y, t in pts if t == training]
        if len(sel) < 3:
            continue
        x, y = np.array(sel).T
        slope, icept = np.polyfit(x, y, 1)
        med = ", ".join(f"{lo}-{hi}: " + (f"{np.median(y[(x >= lo) & (x < hi)]):.1f}" if ((x >= lo) & (x < hi)).any()
                                          else "-") for lo, hi in BINS)
        print(f"{run} ({'training' if training else 'not training'}, {len(sel)} buckets): ms per step = "
              f"{icept:.2f} + {slope * 1e3:.1f} us x in flight; median ms per step by in flight: {med}")

# A group's training waits when the other group is training: from its generation's end to its
# training's start, over every training step after the first (the first compiles).
print()
for run in ["main/overlap_mps/seed1-main", "groups4/overlap_mps/seed1-main", "engine_process/overlap_mps/seed1-main",
            "engine_process2/overlap_mps/seed1-main", "groups4/overlap_mps/seed1-vary-overlap.groups-4"]:
    ev = [json.loads(line) for line in (HERE / run / "timeline.jsonl").open()]
    trains = sorted((e for e in ev if e["phase"] == "train"), key=lambda e: e["start"])[1:]
    waits = []
    for t in trains:
        ends = [g["end"] for g in ev if g["phase"] == "generate" and g["group"] == t["group"] and g["end"] <= t["start"] + 1e-6]
        if ends:  # a training step of several groups at once carries no single group's generation
            waits.append(t["start"] - max(ends))
    w = np.array(waits)
    print(f"{run}: {len(w)} training steps; {int((w > 0.1).sum())} started > 0.1 s after their group's generation "
          f"ended; wait mean {w.mean():.2f} s, median {np.median(w):.2f} s, largest {w.max():.2f} s")
