"""Modular arithmetic: "What is (17 + 23 * 4) mod 7?"

Options (difficulty knobs):
    terms        (1..5, default 2)      operands in the expression (1: "What is 37 mod 5?")
    max_operand  (2..10**6, default 50) operands are uniform in [0, max_operand]
    max_modulus  (2..1000, default 10)  the modulus is uniform in [2, max_modulus]
    ops          (default "+-*")        operators to draw from, any non-empty subset of "+-*"
    eval_fraction (default 0.2)

The expression uses the usual precedence (* before + and -); the answer is the mathematical residue
in [0, modulus - 1], also for a negative expression (the prompt says so). Easiest setting:
terms=1, max_operand=100, max_modulus=5 (about 400 problems; fewer operands would leave too few for
64 eval items).

Answer: one integer; extraction as in `AnswerTask`. Content key: the expression and the modulus.
"""

from __future__ import annotations

import random

from .base import Draft, ProceduralTask, TaskError, check_int


def _value(operands: list[int], ops: list[str]) -> int:
    """The value of operands joined by ops with * before + and - (no eval)."""
    total, product = 0, operands[0]
    sign = 1
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            product *= x
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), x
    return total + sign * product


class Modular(ProceduralTask):
    """Evaluate a short integer expression modulo a small modulus"""

    name = "modular"

    def __init__(self, *, terms: int = 2, max_operand: int = 50, max_modulus: int = 10, ops: str = "+-*",
                 eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)
        self.terms = check_int(self.name, "terms", terms, 1, 5)
        self.max_operand = check_int(self.name, "max_operand", max_operand, 2, 10**6)
        self.max_modulus = check_int(self.name, "max_modulus", max_modulus, 2, 1000)
        if not isinstance(ops, str) or not ops or not set(ops) <= set("+-*") or len(set(ops)) != len(ops):
            raise TaskError(f"{self.name}: option ops ({ops!r}) must be a non-empty subset of '+-*', e.g. '+*'")
        self.ops = ops

    def draw(self, rng: random.Random) -> Draft:
        operands = [rng.randint(0, self.max_operand) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        modulus = rng.randint(2, self.max_modulus)
        expr = str(operands[0]) + "".join(f" {op} {x}" for op, x in zip(ops, operands[1:]))
        shown = f"({expr})" if self.terms > 1 else expr
        residue = _value(operands, ops) % modulus  # Python's % is the residue in [0, modulus)
        question = (f"What is {shown} mod {modulus}? "
                    f"Give the remainder as a number from 0 to {modulus - 1}.")
        return Draft(key=f"{expr.replace(' ', '')}%{modulus}", question=question, answer=str(residue),
                     meta={"operands": operands, "ops": ops, "modulus": modulus})
