"""Addition: "What is 23 + 45?", the easiest learnable task.

Options (difficulty knobs):
    digits   (1..12, default 2)  each operand is uniform in [0, 10**digits - 1]
    terms    (2..6, default 2)   how many operands
    eval_fraction (default 0.2)  share of the problem space held out for eval

Where SmolLM2-135M-Instruct starts on these settings: reports/smollm2/report.md.
Tiny spaces: digits=1, terms=2 has only 100 problems (about 20 eval), too few for 64 eval items;
use terms=3 or a larger eval_fraction there.

Answer: one integer; extraction as in `AnswerTask` (last number of the final span).
Content key: the operands in order ("3+4" and "4+3" are different prompts and may sit in
different splits; they share the answer but not the question).
"""

from __future__ import annotations

import random

from .base import Draft, ProceduralTask, check_int


class Addition(ProceduralTask):
    """Add a few integers of a few digits each"""

    name = "addition"

    def __init__(self, *, digits: int = 2, terms: int = 2, eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)
        self.digits = check_int(self.name, "digits", digits, 1, 12)
        self.terms = check_int(self.name, "terms", terms, 2, 6)

    def draw(self, rng: random.Random) -> Draft:
        hi = 10**self.digits - 1
        operands = [rng.randint(0, hi) for _ in range(self.terms)]
        expr = " + ".join(str(x) for x in operands)
        return Draft(key=expr.replace(" ", ""), question=f"What is {expr}?", answer=str(sum(operands)),
                     meta={"operands": operands})
