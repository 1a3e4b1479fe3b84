"""Answer extraction from untrusted model text: bounded, linear-time, never raising.

Order (`final_span`): the last <answer>...</answer> (case-insensitive; an <answer> left open at the
end, as when generation hits its token limit, runs to the end), else the last \\boxed{...} (braces
balanced), else the rest of the line after the last "####" (GSM8K's marker), else the whole text.
Tasks then parse that span: a number (`last_number`), a list (`numbers_in`, `words_in`), or an
expression (countdown).

Bounds: only the last TAIL_CHARS characters of a completion are read. A final answer sits at the
end, and 16k characters is about 4k tokens, more than any colora generation budget, so no honest
answer is lost; a 10-MB string costs one slice. Every search is a `str.rfind`/`count` or a regex
without nested quantifiers, so the work is linear in the tail. A number of more than
MAX_NUMBER_DIGITS digits is treated as no number (it never converts to a huge int, which would be
slow and hits Python's int-string limit).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

TAIL_CHARS = 16_384
MAX_NUMBER_DIGITS = 30

# A number not glued to a word or a decimal point before it: "-3", "1,234", "3.5", "$5", "42km".
# The thousands group only counts when exactly 3-digit groups follow ("1,2345" reads 1 then 2345).
_NUMBER_RE = re.compile(r"(?<![\w.])([-\u2212]?)([0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(\.[0-9]+)?")
# Numbers in a list never have thousands separators: "3,7,12" is three numbers.
_LIST_NUMBER_RE = re.compile(r"(?<![\w.])([-\u2212]?)([0-9]+)(\.[0-9]+)?")
_WORD_RE = re.compile(r"[A-Za-z]+")
_LATEX_COMMAND_RE = re.compile(r"\\[A-Za-z]+")

_OPEN, _CLOSE = "<answer>", "</answer>"
# Lower-cases A-Z only. str.lower() changes some strings' length ('\u0130' becomes two code points),
# so positions found in t.lower() would slice t at the wrong place; this fold keeps every index.
_ASCII_FOLD = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def ascii_fold(text: str) -> str:
    """`text` with A-Z lower-cased and nothing else changed: same length, same positions."""
    return text.translate(_ASCII_FOLD)


def tail(text: object) -> str:
    """The part of a completion that verifiers read (the last TAIL_CHARS characters)."""
    if not isinstance(text, str):
        return ""
    return text[-TAIL_CHARS:]


def final_span(text: object) -> tuple[str, str]:
    """(span, source): the text holding the final answer and where it came from:
    "answer" (tags), "boxed", "####", or "text" (no marker: the whole tail)."""
    t = tail(text)
    low = ascii_fold(t)
    close = low.rfind(_CLOSE)
    open_ = low.rfind(_OPEN)
    if open_ != -1 and open_ > close:  # the last tag is left open: read to the end
        return t[open_ + len(_OPEN):], "answer"
    if close != -1:
        open_ = low.rfind(_OPEN, 0, close)
        if open_ != -1:
            return t[open_ + len(_OPEN):close], "answer"
    boxed = t.rfind("\\boxed{")
    if boxed != -1:
        return _braced(t, boxed + len("\\boxed{")), "boxed"
    hashes = t.rfind("####")
    if hashes != -1:
        return t[hashes + 4:].split("\n", 1)[0], "####"
    return t, "text"


def _braced(t: str, start: int) -> str:
    """The text from `start` up to the brace that closes an already-open one (or the end)."""
    depth = 1
    for i in range(start, len(t)):
        c = t[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return t[start:i]
    return t[start:]


def format_score(text: object, parses: Callable[[str], bool]) -> float:
    """1.0: exactly one <answer>...</answer>, in order, with content that `parses`; 0.5: answer
    tags present but not that; 0.0: no answer tags."""
    t = tail(text)
    low = ascii_fold(t)
    opens, closes = low.count(_OPEN), low.count(_CLOSE)
    if opens == 0 and closes == 0:
        return 0.0
    if opens == 1 and closes == 1:
        o, c = low.find(_OPEN), low.find(_CLOSE)
        content = t[o + len(_OPEN):c]
        if o < c and content.strip() and parses(content):
            return 1.0
    return 0.5


def _to_fraction(sign: str, digits: str, frac: str | None) -> Fraction | None:
    digits = digits.replace(",", "")
    decimals = frac[1:] if frac else ""
    if len(digits) + len(decimals) > MAX_NUMBER_DIGITS:
        return None
    value = Fraction(int(digits))
    if decimals:
        value += Fraction(int(decimals), 10 ** len(decimals))
    return -value if sign else value


def _latex_numbers(span: str) -> str:
    # LaTeX writes thousands as "1{,}234" or "1\,234".
    return span.replace("{,}", ",").replace("\\,", "").replace("\\!", "")


def last_number(span: str) -> Fraction | None:
    """The last number in `span` as an exact fraction ("1,234" -> 1234, "$5." -> 5, "-3" -> -3,
    "42 apples" -> 42); None when there is none or it is longer than MAX_NUMBER_DIGITS."""
    found = list(_NUMBER_RE.finditer(_latex_numbers(tail(span))))
    if not found:
        return None
    last = found[-1]
    return _to_fraction(last.group(1), last.group(2), last.group(3))


def parse_number(text: str) -> Fraction | None:
    """A reference answer written as text ("72", "-3", "1,000", "2.5") as an exact fraction."""
    return last_number(text)


def numbers_in(span: str, limit: int = 1000) -> list[Fraction] | None:
    """Every number in `span`, in order (no thousands separators in lists); None if any number is
    overlong or there are more than `limit`."""
    out: list[Fraction] = []
    for m in _LIST_NUMBER_RE.finditer(tail(span)):
        value = _to_fraction(m.group(1), m.group(2), m.group(3))
        if value is None or len(out) >= limit:
            return None
        out.append(value)
    return out


def words_in(span: str, limit: int = 1000) -> list[str] | None:
    """Every ASCII word in `span`, lower-cased, in order, LaTeX commands (\\text) skipped; None if
    there are more than `limit`."""
    words = _WORD_RE.findall(_LATEX_COMMAND_RE.sub(" ", tail(span)))
    return [w.lower() for w in words] if len(words) <= limit else None
