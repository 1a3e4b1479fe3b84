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


class Raising(CoinFlip):
    """A customer's broken reward function: raises from its second step's rollouts on."""

    name = "raising"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls = 0

    def reward(self, completion, item) -> float:
        self.calls += 1
        if self.calls > 6:
            raise ZeroDivisionError("customer code divided by zero")
        return super().reward(completion, item)


class HugeReward(CoinFlip):
    """A customer's reward on an absurd scale: finite, but its group statistics overflow, so the
    advantages and the loss are NaN."""

    name = "huge_reward"

    def reward(self, completion, item) -> float:
        return 1e308 if len(completion) % 2 == 0 else -1e308
