"""A safe evaluator for the arithmetic expressions a model writes (countdown answers).

Nothing is `eval`ed and no Python AST is built: a tokenizer accepts only non-negative integer
literals, + - * / (also written "×", "÷", "−") and parentheses, and a recursive-descent
parser evaluates in exact rational arithmetic (`fractions.Fraction`):

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := INTEGER | "(" expr ")"

There is no unary minus and no power: "**" is a syntax error, so `9**9**9**9` costs a few
microseconds. Every cost is bounded before it is paid: at most MAX_CHARS characters, MAX_TOKENS
tokens, MAX_DEPTH nested parentheses, literals of at most MAX_LITERAL_DIGITS digits, and every
intermediate numerator and denominator at most MAX_MAGNITUDE in absolute value (products of two
bounded values stay small, so no step can build a huge number).
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 400
MAX_TOKENS = 64
MAX_DEPTH = 16
MAX_LITERAL_DIGITS = 6
MAX_MAGNITUDE = 10**12

_TOKEN_RE = re.compile(r"\s*(?:([0-9]+)|([-+*/()\u00d7\u00f7\u2212]))")
_CANONICAL_OP = {"\u00d7": "*", "\u00f7": "/", "\u2212": "-"}


class ArithError(ValueError):
    """The text is not a bounded arithmetic expression (or divides by zero)."""


def tokenize(text: str) -> list[str]:
    if len(text) > MAX_CHARS:
        raise ArithError(f"expression longer than {MAX_CHARS} characters")
    tokens: list[str] = []
    pos, end = 0, len(text.rstrip())
    while pos < end:
        m = _TOKEN_RE.match(text, pos)
        if m is None:
            raise ArithError(f"unexpected character {text[pos:pos + 1].strip()[:1]!r} at {pos}")
        number, op = m.group(1), m.group(2)
        if number is not None and len(number) > MAX_LITERAL_DIGITS:
            raise ArithError(f"literal of more than {MAX_LITERAL_DIGITS} digits")
        tokens.append(number if number is not None else _CANONICAL_OP.get(op, op))
        if len(tokens) > MAX_TOKENS:
            raise ArithError(f"more than {MAX_TOKENS} tokens")
        pos = m.end()
    if not tokens:
        raise ArithError("empty expression")
    return tokens


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.literals: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        token = self.peek()
        if token is None:
            raise ArithError("expression ends early")
        self.pos += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            value = _bounded(value + self.term(depth) if op == "+" else value - self.term(depth))
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            rhs = self.factor(depth)
            if op == "/" and rhs == 0:
                raise ArithError("division by zero")
            value = _bounded(value * rhs if op == "*" else value / rhs)
        return value

    def factor(self, depth: int) -> Fraction:
        token = self.take()
        if token == "(":
            if depth >= MAX_DEPTH:
                raise ArithError(f"more than {MAX_DEPTH} nested parentheses")
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ArithError("missing ')'")
            return value
        if token.isdigit():
            self.literals.append(int(token))
            return Fraction(int(token))
        raise ArithError(f"unexpected {token!r}")


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise ArithError(f"intermediate value beyond {MAX_MAGNITUDE}")
    return value


def evaluate(text: str) -> tuple[Fraction, tuple[int, ...]]:
    """(value, integer literals in order of appearance); raises ArithError."""
    parser = _Parser(tokenize(text))
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ArithError(f"unexpected {parser.peek()!r} after a complete expression")
    return value, tuple(parser.literals)


def safe_evaluate(text: str) -> tuple[Fraction, tuple[int, ...]] | None:
    """`evaluate`, or None for anything that is not a bounded expression."""
    try:
        return evaluate(text)
    except ArithError:
        return None
