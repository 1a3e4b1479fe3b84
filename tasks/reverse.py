"""Reverse: "Write these words in reverse order: cat, dog, sun" -> "sun, dog, cat".

A copying task with one twist, learnable by very small models (they can copy; the order is what
they must learn), and a second list-answer task beside sorting.

Options (difficulty knobs):
    length  (2..12, default 3)  how many words (distinct, drawn from words.WORDS)
    eval_fraction (default 0.2)

Easiest setting: length=2.

Answer: the reversed list, comma-separated; extraction and checking in `lists.ListTask`.
Content key: the shown sequence.
"""

from __future__ import annotations

import random

from .base import Draft, check_int
from .lists import ListTask
from .words import WORDS


class Reverse(ListTask):
    """Write a short list of words in reverse order"""

    name = "reverse"

    def __init__(self, *, length: int = 3, eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)
        self.length = check_int(self.name, "length", length, 2, 12)

    def draw(self, rng: random.Random) -> Draft:
        shown = rng.sample(WORDS, self.length)
        answer = ", ".join(reversed(shown))
        return Draft(key=" ".join(shown), question=f"Write these words in reverse order: {', '.join(shown)}",
                     answer=answer, meta={"kind": "words", "items": shown})
