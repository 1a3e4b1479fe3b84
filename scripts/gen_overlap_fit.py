"""Least-squares fit of each generation's duration in an overlap run's timeline against the seconds
it overlapped the other groups' generation and training (the first two generations, the pipeline
filling, left out). Used in reports/h200/README.md (fifth session):

    python scripts/gen_overlap_fit.py reports/h200/fourth/final/runs/overlap_mps/seed*-main/timeline.jsonl \\
        reports/h200/fifth/*/runs/overlap_mps/seed*-main/timeline.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys

import numpy as np


def overlap(a: dict, b: dict) -> float:
    return max(0.0, min(a["end"], b["end"]) - max(a["start"], b["start"]))


def fit(path: str) -> tuple[int, float, np.ndarray]:
    spans = [json.loads(line) for line in open(path)]
    spans = [s for s in spans if s["phase"] in ("generate", "train")]
    gens = [s for s in spans if s["phase"] == "generate"][2:]
    X, y = [], []
    for g in gens:
        other = [s for s in spans if s["group"] != g["group"]]
        X.append([1.0, sum(overlap(g, s) for s in other if s["phase"] == "generate"),
                  sum(overlap(g, s) for s in other if s["phase"] == "train")])
        y.append(g["end"] - g["start"])
    return len(y), statistics.median(y), np.linalg.lstsq(np.array(X), np.array(y), rcond=None)[0]


if __name__ == "__main__":
    for p in sys.argv[1:]:
        n, med, (c0, c_gen, c_train) = fit(p)
        print(f"{p}: n={n}, median {med:.2f} s = {c0:.2f} + {c_gen:.2f} x s overlapping generation "
              f"+ {c_train:.2f} x s overlapping training")
