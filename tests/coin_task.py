"""A task with a learnable-looking signal for random-weight models, used as a user-registered task
("coin_task:CoinFlip") in the end-to-end tests: reward 1 when the completion's length in characters
is even. A random model gets it about half the time, so groups have non-zero advantages."""

from __future__ import annotations

import random

from colora.tasks.base import Draft, ProceduralTask


class CoinFlip(ProceduralTask):
    """Reward even-length completions (a test signal, not a skill)"""

    name = "coin_flip"

    def __init__(self, *, eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)

    def draw(self, rng: random.Random) -> Draft:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        return Draft(key=f"{a},{b}", question=f"Say something about {a} and {b}.", answer="even", meta={})

    def reward(self, completion, item) -> float:
        return 1.0 if len(completion) % 2 == 0 else 0.0
