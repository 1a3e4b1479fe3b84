"""What an adapter load costs the other group, and the reload-first run that the deadline cut.

    python3 reports/h200/tenth/reload_first.py > reports/h200/tenth/reload_first.txt

Reads the committed timelines of this folder's overlap_mps runs (packed_ab/runs, seeds/*/runs):
  1. per run: the median reload span (a group's four adapters loaded by the engine), the share of it
     that overlapped a training step, and the engine's decoding rate (engine steps per second, from
     the half-second `engine_steps` buckets with requests in flight) in buckets that lie mostly
     inside a reload against the others;
  2. the reload-first run of packed_ab (COLORA_RELOAD_FIRST=1, cut by the benchmark's deadline after
     about 44 s of its measured window, so `colora bench arms` reported nothing for it): its job-steps
     per hour over that span beside the other two runs of the same process over the same span of
     theirs. The window is `colora bench arms`'s (from the end of the step in which the last job
     finished its warm-up step to the last training step's end); over their whole windows the
     other two reproduce the report's 5098 and 6386 steps/h.
"""

from __future__ import annotations

import json
import statistics as st
from pathlib import Path

HERE = Path(__file__).parent


def load(run: Path) -> list[dict]:
    return [json.loads(line) for line in open(run / "timeline.jsonl")]


def overlap(a: dict, spans: list[dict]) -> float:
    return sum(max(0.0, min(a["end"], s["end"]) - max(a["start"], s["start"])) for s in spans)


def reload_cost(rows: list[dict]) -> str:
    rel = [r for r in rows if r["phase"] == "reload"]
    train = [r for r in rows if r["phase"] == "train"]
    inside, outside = [], []
    for b in (r for r in rows if r["phase"] == "engine_steps" and r["inflight"] > 0):
        width = b["end"] - b["start"]
        (inside if overlap(b, rel) / width > 0.5 else outside).append(b["steps"] / width)
    share = st.mean(overlap(r, train) / (r["end"] - r["start"]) for r in rel)
    rates = (f"engine steps/s inside a reload {st.median(inside):.0f} (n={len(inside)}), elsewhere "
             f"{st.median(outside):.0f} (n={len(outside)})") if inside else "no half-second bucket mostly inside a reload"
    return (f"reload median {st.median(r['end'] - r['start'] for r in rel):.2f} s (n={len(rel)}), "
            f"{share:.0%} of it during training; {rates}")


def steps_per_hour(rows: list[dict], jobs: int, span: float | None = None) -> tuple[int, float, float]:
    """(job-steps, seconds, job-steps per hour) from the warm-up's end over `span` seconds (None: all)."""
    train = sorted((r for r in rows if r["phase"] == "train"), key=lambda r: r["end"])
    seen: set[str] = set()
    start = None
    for r in train:
        seen |= set(r["jobs"])
        if len(seen) == jobs:
            start = r["end"]
            break
    steps, end = 0, start
    for r in train:
        if r["end"] > start and (span is None or r["end"] - start <= span):
            steps += len(r["jobs"])
            end = r["end"]
    return steps, end - start, steps / (end - start) * 3600.0


def main() -> None:
    runs = sorted(HERE.glob("*/runs/overlap_mps/*")) + sorted(HERE.glob("seeds/*/runs/overlap_mps/*"))
    print("1. An adapter load against the other group's decoding (overlap_mps, 8 jobs, 2 groups)\n")
    for run in runs:
        print(f"{run.relative_to(HERE)}:\n  {reload_cost(load(run))}")
    ab = sorted((HERE / "packed_ab" / "runs" / "overlap_mps").glob("seed1-*"))
    rf = next(r for r in ab if "RELOAD_FIRST" in r.name)
    steps, secs, rate = steps_per_hour(load(rf), 8)
    print(f"\n2. packed_ab, seed 1, one process: the reload-first run had {steps} job-steps in the first "
          f"{secs:.1f} s of its window when the deadline stopped it; over the same span of theirs:\n")
    for run in ab:
        part = steps_per_hour(load(run), 8, secs)
        whole = steps_per_hour(load(run), 8)
        print(f"  {run.name}: {part[0]} job-steps in {part[1]:.1f} s = {part[2]:.0f} steps/h "
              f"(whole window: {whole[2]:.0f} steps/h)")


if __name__ == "__main__":
    main()
