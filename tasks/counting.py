"""Counting: how often a word occurs in a list, or a letter in a string.

    kind="words":   'How many times does the word "cat" appear in this list? dog, cat, sun, cat'
    kind="letters": 'How many times does the letter "b" appear in "abcabbac"?'

Options (difficulty knobs):
    kind    ("words" | "letters", default "words")
    length  (2..40, default 6)  list length (words) or string length (letters)
    vocab   (2..26, default 3)  distinct words (drawn per item from words.WORDS) or letters (the
                                first `vocab` letters of the alphabet) the sequence is made of
    eval_fraction (default 0.2)

The asked-for symbol is drawn from the vocabulary, so the answer is in [0, length] and usually
positive. Easiest setting: kind="words", length=3..4, vocab=2.

Answer: one integer; extraction as in `AnswerTask`. Content key: the sequence and the symbol asked.
"""

from __future__ import annotations

import random
import string

from .base import Draft, ProceduralTask, check_choice, check_int
from .words import WORDS


class Counting(ProceduralTask):
    """Count occurrences of a word in a list or of a letter in a string"""

    name = "counting"

    def __init__(self, *, kind: str = "words", length: int = 6, vocab: int = 3, eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)
        self.kind = check_choice(self.name, "kind", kind, ("words", "letters"))
        self.length = check_int(self.name, "length", length, 2, 40)
        self.vocab = check_int(self.name, "vocab", vocab, 2, 26)

    def draw(self, rng: random.Random) -> Draft:
        if self.kind == "words":
            pool = rng.sample(WORDS, self.vocab)
        else:
            pool = list(string.ascii_lowercase[: self.vocab])
        seq = [rng.choice(pool) for _ in range(self.length)]
        target = rng.choice(pool)
        count = seq.count(target)
        if self.kind == "words":
            question = f'How many times does the word "{target}" appear in this list? {", ".join(seq)}'
        else:
            question = f'How many times does the letter "{target}" appear in "{"".join(seq)}"?'
        return Draft(key=f"{self.kind}|{' '.join(seq)}|{target}", question=question, answer=str(count),
                     meta={"sequence": seq, "target": target})
