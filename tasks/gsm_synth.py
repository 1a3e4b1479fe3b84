"""Synthetic grade-school math: procedural multi-step word problems in GSM8K's style.

    "A baker makes 4 trays of 6 cookies. She sells 8 cookies in the morning and half of the
     remaining cookies in the afternoon. How many cookies are left?"  ->  8

Fifteen story templates, each tagged with its number of arithmetic steps (1 to 4); every number is
drawn so that each intermediate result is a non-negative integer (no fractions of cookies), and the
answer is computed from the same numbers that are printed.

Options (difficulty knobs):
    min_steps, max_steps  (1..4, defaults 1 and 3)  templates with that many steps are drawn from
    max_number            (5..1000, default 20)     scale of the quantities in the story
    eval_fraction         (default 0.2)

Easiest setting: max_steps=1, max_number=20 (with max_number=10 the one-step space has fewer
than 400 problems, too few for 64 eval items at eval_fraction 0.2). For real GSM8K see tasks/gsm8k.py.

Answer: one integer; extraction as in `AnswerTask`.
Content key: the template and its numbers (names and goods are decoration, so the same arithmetic
with another name is the same problem and in the same split).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from .base import Draft, ProceduralTask, TaskError, check_int
from .words import GOODS, NAMES

# A story: (question, answer, the numbers that define it) or None when the draw fails a constraint.
Story = tuple[str, int, tuple[int, ...]] | None
_NOTES = tuple(m * 10**e for e in range(8) for m in (1, 2, 5) if m * 10**e >= 5)


def _bill(cost: int) -> int:
    return next(note for note in _NOTES if note >= cost)


def give_away(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    a = rng.randint(2, hi)
    b = rng.randint(1, a - 1)
    return (f"{name} has {a} {good[1]}. {name} gives {b} of them to a friend. "
            f"How many {good[1]} does {name} have left?", a - b, (a, b))


def boxes(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    a, b = rng.randint(2, hi), rng.randint(2, hi)
    return (f"{name} has {a} boxes with {b} {good[1]} in each box. "
            f"How many {good[1]} does {name} have in total?", a * b, (a, b))


def find_more(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    return (f"{name} has {a} {good[1]}. {name} gets {b} more {good[1]} from a friend. "
            f"How many {good[1]} does {name} have now?", a + b, (a, b))


def share(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    each, friends = rng.randint(1, hi), rng.randint(2, hi)
    return (f"{name} shares {each * friends} {good[1]} equally among {friends} friends. "
            f"How many {good[1]} does each friend get?", each, (each, friends))


def buy_then_give(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    c = rng.randint(1, a + b)
    return (f"{name} has {a} {good[1]}. {name} buys {b} more and then gives {c} to a friend. "
            f"How many {good[1]} does {name} have now?", a + b - c, (a, b, c))


def change(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    p, q = rng.randint(1, hi), rng.randint(2, _small(hi))
    bill = _bill(p * q)
    return (f"One {good[0]} costs ${p}. {name} buys {q} {good[1]} and pays with a ${bill} bill. "
            f"How many dollars of change does {name} get?", bill - p * q, (p, q))


def pages_left(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    a, d, r = rng.randint(2, hi), rng.randint(2, _small(hi)), rng.randint(1, hi)
    return (f"A book has {a * d + r} pages. {name} reads {a} pages every day for {d} days. "
            f"How many pages are left to read?", r, (a, d, r))


def percent(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    p = rng.choice((10, 20, 25, 50))
    unit = 100 // math.gcd(p, 100)
    n = unit * rng.randint(1, max(1, hi // unit))
    return (f"A class has {n} students, and {p}% of them are girls. How many boys are in the class?",
            n - n * p // 100, (n, p))


def ages(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    a, b, c = rng.randint(2, hi), rng.randint(1, hi), rng.randint(1, hi)
    other = NAMES[(NAMES.index(name) + 1) % len(NAMES)]
    return (f"{name} is {a} years old. {other} is {b} years older than {name}. "
            f"How old will {other} be in {c} years?", a + b + c, (a, b, c))


def two_rates(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    d1, d2 = rng.randint(2, _small(hi)), rng.randint(2, _small(hi))
    return (f"{name} walks {a} km a day for {d1} days, then {b} km a day for {d2} days. "
            f"How many km does {name} walk in total?", a * d1 + b * d2, (a, d1, b, d2))


def bake_sell_half(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    a, b = rng.randint(2, _small(hi)), rng.randint(2, hi)
    left = rng.randint(1, (a * b - 1) // 2)
    sold = a * b - 2 * left
    return (f"A baker makes {a} trays of {b} cookies. She sells {sold} cookies in the morning and half "
            f"of the remaining cookies in the afternoon. How many cookies are left?", left, (a, b, sold))


def weekly_savings(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    w, h, d = rng.randint(2, hi), rng.randint(2, 8), rng.randint(2, 6)
    week = w * h * d
    s = rng.randint(1, week - 1)
    return (f"{name} earns ${w} an hour and works {h} hours a day, {d} days a week. {name} spends ${s} "
            f"each week. How many dollars does {name} save each week?", week - s, (w, h, d, s))


def teams(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    c, s, t = rng.randint(2, _small(hi)), rng.randint(2, hi), rng.randint(2, _small(hi))
    total = c * s
    if total - 1 < t:
        return None
    k = rng.randint(1, (total - 1) // t)
    absent = total - k * t
    return (f"A school has {c} classes with {s} students each. {absent} students are absent today, and "
            f"the others are split into teams of {t}. How many teams are there?", k, (c, s, absent, t))


def shopping_change(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    other = GOODS[(GOODS.index(good) + 1) % len(GOODS)]
    q1, q2 = rng.randint(1, _small(hi)), rng.randint(1, _small(hi))
    p1, p2 = rng.randint(1, hi), rng.randint(1, hi)
    cost = q1 * p1 + q2 * p2
    bill = _bill(cost)
    return (f"{name} buys {q1} {good[1] if q1 > 1 else good[0]} at ${p1} each and {q2} "
            f"{other[1] if q2 > 1 else other[0]} at ${p2} each, and pays with a ${bill} bill. "
            f"How many dollars of change does {name} get?", bill - cost, (q1, p1, q2, p2))


def orchard(rng: random.Random, hi: int, name: str, good: tuple[str, str]) -> Story:
    r, p, q, g = rng.randint(2, _small(hi)), rng.randint(2, hi), rng.randint(2, hi), rng.randint(2, _small(hi))
    total = r * p * q
    if total - 1 < g:
        return None
    bags = rng.randint(1, (total - 1) // g)
    keep = total - bags * g
    return (f"A farmer has {r} rows of {p} apple trees, and each tree gives {q} apples. The farmer keeps "
            f"{keep} apples and sells the rest in bags of {g}. How many bags does the farmer sell?",
            bags, (r, p, q, keep, g))


def _small(hi: int) -> int:
    """Upper bound for counts that multiply (days, trays, quantities): keeps products modest."""
    return max(2, min(10, hi))


TEMPLATES: dict[str, tuple[int, Callable[..., Story]]] = {
    "give_away": (1, give_away), "boxes": (1, boxes), "find_more": (1, find_more), "share": (1, share),
    "buy_then_give": (2, buy_then_give), "change": (2, change), "pages_left": (2, pages_left),
    "percent": (2, percent), "ages": (2, ages),
    "two_rates": (3, two_rates), "bake_sell_half": (3, bake_sell_half),
    "weekly_savings": (3, weekly_savings), "teams": (3, teams),
    "shopping_change": (4, shopping_change), "orchard": (4, orchard),
}


class GsmSynth(ProceduralTask):
    """Procedural multi-step grade-school math word problems"""

    name = "gsm_synth"

    def __init__(self, *, min_steps: int = 1, max_steps: int = 3, max_number: int = 20,
                 eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)
        self.min_steps = check_int(self.name, "min_steps", min_steps, 1, 4)
        self.max_steps = check_int(self.name, "max_steps", max_steps, 1, 4)
        if self.min_steps > self.max_steps:
            raise TaskError(f"{self.name}: option min_steps ({min_steps}) must be at most max_steps ({max_steps})")
        self.max_number = check_int(self.name, "max_number", max_number, 5, 1000)
        self._templates = sorted(k for k, (steps, _) in TEMPLATES.items() if min_steps <= steps <= max_steps)

    def draw(self, rng: random.Random) -> Draft | None:
        template = rng.choice(self._templates)
        steps, make = TEMPLATES[template]
        story = make(rng, self.max_number, rng.choice(NAMES), rng.choice(GOODS))
        if story is None:
            return None
        question, answer, numbers = story
        assert answer >= 0, (template, numbers)
        return Draft(key=f"{template}|{','.join(map(str, numbers))}", question=question, answer=str(answer),
                     meta={"template": template, "steps": steps, "numbers": list(numbers)})
