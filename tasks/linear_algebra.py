"""Linear-algebra word problems: a small linear system with one integer solution, told as a story.

    "At a market, 2 apples and 3 pears cost 13 coins. 1 apple and 1 pear cost 5 coins.
     How many coins does one pear cost?"  ->  3

Stories (drawn at random where the number of unknowns allows):
    prices   any number of unknowns: goods with unknown prices, one purchase per equation
    fee      1 unknown: some goods plus a fixed fee (a * x + c = b)
    legs     2 unknowns: chickens and cows (or spiders and beetles), heads and legs
    sumdiff  2 unknowns: two numbers from their sum and difference

Options (difficulty knobs):
    unknowns   (1..3, default 2)   size of the system (1: "3 apples cost 12 coins")
    max_value  (2..1000, default 10) the solution's entries are uniform in [1, max_value]
    max_coef   (1..20, default 4)  "prices" coefficients are uniform in [1, max_coef]
    eval_fraction (default 0.2)

The coefficient matrix is redrawn until it is non-singular (exact integer determinant), so the
solution is unique and integral by construction. Easiest setting: unknowns=1, max_value=20 (smaller
values leave fewer than 64 eval problems).

Answer: one integer (the unknown asked for); extraction as in `AnswerTask`.
Content key: the story, the system (coefficients and right-hand sides) and the unknown asked for.
"""

from __future__ import annotations

import random

from .base import Draft, ProceduralTask, TaskError, check_int
from .words import GOODS


def _det(m: list[list[int]]) -> int:
    """Exact determinant of a 1x1, 2x2 or 3x3 integer matrix."""
    if len(m) == 1:
        return m[0][0]
    if len(m) == 2:
        return m[0][0] * m[1][1] - m[0][1] * m[1][0]
    return sum((-1) ** j * m[0][j] * _det([row[:j] + row[j + 1:] for row in m[1:]]) for j in range(3))


def _count(n: int, singular: str, plural: str) -> str:
    return f"{n} {singular if n == 1 else plural}"


class LinearAlgebra(ProceduralTask):
    """Solve a small linear system told as a word problem"""

    name = "linear_algebra"

    def __init__(self, *, unknowns: int = 2, max_value: int = 10, max_coef: int = 4,
                 eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)
        self.unknowns = check_int(self.name, "unknowns", unknowns, 1, 3)
        self.max_value = check_int(self.name, "max_value", max_value, 2, 1000)
        self.max_coef = check_int(self.name, "max_coef", max_coef, 1, 20)
        if self.unknowns > 1 and self.max_coef < 2:  # an all-ones matrix is singular
            raise TaskError(f"{self.name}: option max_coef ({max_coef}) must be at least 2 when unknowns > 1")

    def draw(self, rng: random.Random) -> Draft | None:
        n = self.unknowns
        x = [rng.randint(1, self.max_value) for _ in range(n)]
        story = {1: ("prices", "fee"), 2: ("prices", "legs", "sumdiff"), 3: ("prices",)}[n]
        story = rng.choice(story)
        ask = rng.randrange(n)
        if story == "fee":
            return self._fee(rng, x[0])
        if story == "prices":
            return self._prices(rng, x, ask)
        if story == "legs":
            return self._legs(rng, x, ask)
        return self._sumdiff(x, ask)

    def _prices(self, rng: random.Random, x: list[int], ask: int) -> Draft | None:
        n = len(x)
        a = [[rng.randint(1, self.max_coef) for _ in range(n)] for _ in range(n)]
        if _det(a) == 0:
            return None
        b = [sum(c * v for c, v in zip(row, x)) for row in a]
        goods = rng.sample(GOODS, n)
        lines = []
        for row, total in zip(a, b):
            parts = [_count(c, g[0], g[1]) for c, g in zip(row, goods)]
            listed = parts[0] if n == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
            lines.append(f"{listed} cost{'s' if n == 1 and row[0] == 1 else ''} {total} coins.")
        question = ("At a market, " + " ".join(lines) +
                    f" How many coins does one {goods[ask][0]} cost?")
        key = f"prices|{a}|{b}|{ask}"
        return Draft(key=key, question=question, answer=str(x[ask]),
                     meta={"story": "prices", "matrix": a, "rhs": b, "solution": x, "ask": ask})

    def _fee(self, rng: random.Random, x: int) -> Draft:
        a, fee = rng.randint(1, self.max_coef), rng.randint(1, self.max_value)
        good = rng.choice(GOODS)
        question = (f"At a market, {_count(a, good[0], good[1])} and a bag that costs {fee} coins cost "
                    f"{a * x + fee} coins together. How many coins does one {good[0]} cost?")
        return Draft(key=f"fee|{a}|{fee}|{a * x + fee}", question=question, answer=str(x),
                     meta={"story": "fee", "matrix": [[a]], "rhs": [a * x + fee], "fee": fee,
                           "solution": [x], "ask": 0})

    def _legs(self, rng: random.Random, x: list[int], ask: int) -> Draft:
        (two, four) = rng.choice((("chickens", "cows"), ("ducks", "goats")))
        a = [[1, 1], [2, 4]]
        heads, legs = x[0] + x[1], 2 * x[0] + 4 * x[1]
        question = (f"A farm has only {two} and {four}. Together they have {heads} heads and {legs} legs. "
                    f"How many {(two, four)[ask]} are there?")
        return Draft(key=f"legs|{heads}|{legs}|{ask}", question=question, answer=str(x[ask]),
                     meta={"story": "legs", "matrix": a, "rhs": [heads, legs], "solution": x, "ask": ask})

    def _sumdiff(self, x: list[int], ask: int) -> Draft | None:
        big, small = max(x), min(x)
        if big == small:
            return None
        s, d = big + small, big - small
        which = ("larger", "smaller")[ask]
        question = f"Two numbers add up to {s}, and one is {d} more than the other. What is the {which} number?"
        return Draft(key=f"sumdiff|{s}|{d}|{ask}", question=question, answer=str((big, small)[ask]),
                     meta={"story": "sumdiff", "matrix": [[1, 1], [1, -1]], "rhs": [s, d],
                           "solution": [big, small], "ask": ask})
