"""Countdown: reach a target with the given numbers and + - * / (TinyZero's countdown task).

    "Using the numbers 3, 5, 3, write an expression that equals 24. ..."  ->  "(3 + 5) * 3"

Options (difficulty knobs):
    numbers     (2..6, default 3)     how many numbers are given
    max_number  (2..100, default 20) each number is uniform in [1, max_number] (repeats allowed)
    max_target  (1..10**4, default 100) targets are integers in [1, max_target]
    use_all     (default True)       True: every given number exactly once (TinyZero's rule);
                                     False: each at most once
    eval_fraction (default 0.2)

Targets come from a random expression over all the numbers with integer intermediates (subtraction
never negative, division only when exact), so every item has a solution: the reference answer.
Easiest setting: numbers=2 (max_number at least 20, or fewer than 64 eval puzzles exist).

Verification (safe: tasks/arith.py, no eval): the final span (tags, \\boxed{}, "####", else the
whole text); in it, the last run of expression characters within one line (digits, + - * / × ÷ −,
parentheses, "=", spaces) that holds a digit, so "The answer is (3 + 5) * 3." works. The run is
split at "=" (at most 4 parts, so "(3 + 5) * 3 = 24" and "24 = (3 + 5) * 3" both work) and the
completion is right when every part evaluates exactly to the target and one of them uses the given
numbers as the rule says: a stated value that disagrees with the expression ("(3 + 5) * 3 = 25")
scores 0, and so does a part that does not evaluate. "**", unary minus, decimals, letters (also "x"
for times), huge literals or values: reward 0.
Content key: the sorted numbers and the target (a permutation is the same puzzle).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

from .arith import safe_evaluate
from .base import Draft, Item, ProceduralTask, check_bool, check_int

_EXPR_RUN_RE = re.compile(r"[0-9+\-*/()\u00d7\u00f7\u2212= \t]+")  # never crosses a line
_MAX_PARTS = 4


class Countdown(ProceduralTask):
    """Reach a target number with the given numbers and + - * /"""

    name = "countdown"

    def __init__(self, *, numbers: int = 3, max_number: int = 20, max_target: int = 100, use_all: bool = True,
                 eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)
        self.numbers = check_int(self.name, "numbers", numbers, 2, 6)
        self.max_number = check_int(self.name, "max_number", max_number, 2, 100)
        self.max_target = check_int(self.name, "max_target", max_target, 1, 10**4)
        self.use_all = check_bool(self.name, "use_all", use_all)

    def prompt(self, question: str) -> str:
        rule = "each number exactly once" if self.use_all else "each number at most once"
        return (f"{question} Use + - * / and parentheses, and {rule}. "
                "Put the expression in <answer></answer> tags, for example <answer>(1 + 2) * 3</answer>.")

    def draw(self, rng: random.Random) -> Draft | None:
        nums = [rng.randint(1, self.max_number) for _ in range(self.numbers)]
        pool: list[tuple[int, str]] = [(x, str(x)) for x in nums]
        while len(pool) > 1:
            (a, ea), (b, eb) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
            if a < b:  # subtraction never goes negative; division is tried as big / small
                (a, ea), (b, eb) = (b, eb), (a, ea)
            ops = ["+", "-", "*", "/"]
            rng.shuffle(ops)
            op = next(o for o in ops if o != "/" or a % b == 0)  # b >= 1: numbers start at 1 ...
            if op == "-" and a == b or op == "/" and b == 1:
                op = "+" if rng.random() < 0.5 else "*"  # ... and a 0 or a "/ 1" makes a dull step
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
            pool.append((value, f"({ea} {op} {eb})"))
        target, expr = pool[0]
        if not 1 <= target <= self.max_target:
            return None
        expr = expr[1:-1]
        question = f"Using the numbers {', '.join(map(str, nums))}, write an expression that equals {target}."
        key = f"{','.join(map(str, sorted(nums)))}->{target}"
        return Draft(key=key, question=question, answer=expr,
                     meta={"numbers": nums, "target": target, "use_all": self.use_all})

    def parse(self, span: str, source: str, item: Item) -> object | None:
        run = None
        for m in _EXPR_RUN_RE.finditer(span):
            if any(c.isdigit() for c in m.group()):
                run = m.group()
        if run is None:
            return None
        parts = [p for p in run.split("=", _MAX_PARTS)[:_MAX_PARTS] if p.strip()]
        values = [safe_evaluate(p) for p in parts]
        if not values or any(v is None for v in values):
            return None  # every side of an equation must be an expression colora can evaluate
        return values

    def is_correct(self, value: object, item: Item) -> bool:
        meta = item.meta
        target, given = Fraction(int(meta["target"])), Counter(int(x) for x in meta["numbers"])
        if any(result != target for result, _ in value):  # type: ignore[attr-defined]
            return False  # every side must equal the target: "(3 + 5) * 3 = 25" is wrong
        for _, literals in value:  # type: ignore[attr-defined]
            used = Counter(literals)
            if meta.get("use_all", True):
                ok_usage = used == given
            else:
                ok_usage = all(used[k] <= given[k] for k in used)
            if ok_usage:
                return True
        return False
