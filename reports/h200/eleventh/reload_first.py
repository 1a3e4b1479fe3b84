"""Reload-first against its absence in the eleventh session's benchmark, over the span both ran.

    python3 reports/h200/eleventh/reload_first.py > reports/h200/eleventh/reload_first.txt

The five-arm benchmark (five/) ran overlap_mps on seed 1 with reload-first (the default since the
tenth session) and, last in the same MPS process on the same engine, with `COLORA_RELOAD_FIRST=0`;
the deadline stopped the second before its 20 steps, so `colora bench arms` reported nothing for
it. This compares the two over the span of measured window the cut run completed, with the tenth
session's script (same window as the benchmark's; reload cost and the engine's rate in and out
of adapter loads).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tenth"))
from reload_first import load, reload_cost, steps_per_hour  # noqa: E402


def main() -> None:
    runs = HERE / "five" / "runs" / "overlap_mps"
    on, off = runs / "seed1-main", runs / "seed1-vary-env-COLORA_RELOAD_FIRST-0"
    steps, secs, rate = steps_per_hour(load(off), 8)
    print(f"COLORA_RELOAD_FIRST=0 (cut by the deadline): {steps} job-steps in the first {secs:.1f} s of its "
          f"window = {rate:.0f} steps/h")
    part, whole = steps_per_hour(load(on), 8, secs), steps_per_hour(load(on), 8)
    print(f"reload-first (the default): {part[0]} job-steps in {part[1]:.1f} s = {part[2]:.0f} steps/h "
          f"(whole window: {whole[2]:.0f} steps/h)\n")
    for name, run in (("reload-first", on), ("COLORA_RELOAD_FIRST=0", off)):
        print(f"{name}: {reload_cost(load(run))}")


if __name__ == "__main__":
    main()
