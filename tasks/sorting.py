"""Sorting: "Sort these numbers from smallest to largest: 42, 7, 19".

Options (difficulty knobs):
    kind       ("numbers" | "words", default "numbers"); words sort alphabetically
    length     (2..20, default 3)     how many items
    max_value  (9..10**6, default 99) numbers are distinct, uniform in [0, max_value]
    eval_fraction (default 0.2)

Easiest setting: length=3, max_value=20 (1,330 problems) or length=2, max_value=50 (1,275); fewer
leave too few for 64 eval items. Items are distinct, so the answer is unique; from 3 items on, the
list is never shown already sorted (copying the question scores 0).

Answer: the sorted list, comma-separated; extraction and checking in `lists.ListTask`.
Content key: the sorted list (the answer), so the same set shown in another order is the same
problem and always in the same split.
"""

from __future__ import annotations

import random

from .base import Draft, TaskError, check_choice, check_int
from .lists import ListTask
from .words import WORDS


class Sorting(ListTask):
    """Sort a short list of distinct numbers or words in ascending order"""

    name = "sorting"

    def __init__(self, *, kind: str = "numbers", length: int = 3, max_value: int = 99,
                 eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)
        self.kind = check_choice(self.name, "kind", kind, ("numbers", "words"))
        self.length = check_int(self.name, "length", length, 2, 20)
        self.max_value = check_int(self.name, "max_value", max_value, 9, 10**6)
        if self.kind == "numbers" and self.length > self.max_value + 1:
            raise TaskError(f"{self.name}: option length ({length}) must be at most max_value + 1 "
                            f"({self.max_value + 1}) for distinct numbers")

    def draw(self, rng: random.Random) -> Draft:
        pool = range(self.max_value + 1) if self.kind == "numbers" else WORDS
        shown = rng.sample(pool, self.length)
        if self.length >= 3:  # never show a sorted list: copying the question must not score
            while shown == sorted(shown):
                rng.shuffle(shown)
        if self.kind == "numbers":
            ordered = [str(x) for x in sorted(shown)]
            question = f"Sort these numbers from smallest to largest: {', '.join(map(str, shown))}"
        else:
            ordered = sorted(shown)
            question = f"Sort these words in alphabetical order: {', '.join(shown)}"
        answer = ", ".join(ordered)
        return Draft(key=f"{self.kind}|{answer}", question=question, answer=answer,
                     meta={"kind": self.kind, "items": [str(x) for x in shown]})
