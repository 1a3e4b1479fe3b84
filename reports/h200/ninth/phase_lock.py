"""Every overlap_mps run kept under reports/h200: its throughput, its groups' chain (bench arms'
`group_chain`, over the measured window) and its adapter loads, split by whether a training step ran
meanwhile. Run from the repository root: python reports/h200/ninth/phase_lock.py > reports/h200/ninth/phase_lock.txt"""

import glob
import json
import statistics

from colora import bench_arms

print("run | steps/h | cycle | generate | wait | train | export | engine idle | trainer busy | "
      "loads alone: n, median s | loads during training: n, median s")
for f in sorted(glob.glob("reports/h200/**/runs/**/overlap_mps/*/timeline.jsonl", recursive=True)):
    d = f.rsplit("/", 1)[0]
    if "incomplete" in f or not glob.glob(d + "/summary.json"):  # a run cut short has no summary
        continue
    summary = json.load(open(d + "/summary.json"))
    rows = [json.loads(line) for line in open(f)]
    w = summary.get("window") or {}
    ws = [x for x in (w.get("windows") or [w]) if x.get("seconds")]
    inside = [r for r in rows if any(x["start"] <= r["start"] < x["end"] for x in ws)]
    c = bench_arms.group_chain(inside)
    if not c:
        continue
    trains = [(r["start"], r["end"]) for r in inside if r["phase"] == "train"]
    loads: dict[bool, list[float]] = {False: [], True: []}
    for r in inside:
        if r["phase"] == "reload":
            loads[any(s < r["end"] and r["start"] < e for s, e in trains)].append(r["end"] - r["start"])
    cells = [f"{len(v)}, {statistics.median(v):.2f}" if v else "0, -" for v in (loads[False], loads[True])]
    print(f"{d.split('reports/h200/')[1]} | {summary['steps_per_hour']:.0f} | {c['cycle']:.2f} | {c['generate']:.2f} | "
          f"{c['wait']:.2f} | {c['train']:.2f} | {c['export']:.2f} | {100 * c['engine_idle']:.0f}% | "
          f"{100 * c['trainer_busy']:.0f}% | {cells[0]} | {cells[1]}")
