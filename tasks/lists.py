"""Shared verifier for tasks whose answer is a list of numbers or words (sorting, reverse).

Extraction: the final span (extract.final_span: <answer> tags, else \\boxed{}, else "####"); inside
it, every number (no thousands separators: "3,7,12" is three numbers) or every word, in order, with
any brackets and separators ignored. With no marker at all, only the last line that holds an answer
is read: its numbers, or for words its last run of consecutive words that all belong to the item (so
"The answer is cat, dog, sun." reads cat, dog, sun, and no stray word can be skipped over). The list is
right when it equals the reference exactly (words case-insensitively), length included.
"""

from __future__ import annotations

from fractions import Fraction

from .base import Item, ProceduralTask
from .extract import numbers_in, words_in


def _last_run(words: list[str], allowed: set[str]) -> list[str]:
    end = len(words)
    while end > 0 and words[end - 1] not in allowed:
        end -= 1
    start = end
    while start > 0 and words[start - 1] in allowed:
        start -= 1
    return words[start:end]


class ListTask(ProceduralTask):
    """Base for list answers; items carry meta["kind"] ("numbers" or "words") and meta["items"]."""

    instruction = "Put your final answer, a comma-separated list, in <answer></answer> tags."

    def parse(self, span: str, source: str, item: Item) -> object | None:
        if source != "text":
            return self._parse_line(span, item)
        for line in reversed(span.splitlines()):
            values = self._parse_line(line, item, in_prose=True)
            if values is not None:
                return values
        return None

    def _parse_line(self, text: str, item: Item, in_prose: bool = False) -> list | None:
        if item.meta.get("kind") == "numbers":
            values: list | None = numbers_in(text)
        else:
            values = words_in(text)
            if values is not None and in_prose:
                values = _last_run(values, {str(w).lower() for w in item.meta.get("items", ())})
        return values or None

    def is_correct(self, value: object, item: Item) -> bool:
        if item.meta.get("kind") == "numbers":
            ref: list[Fraction] | list[str] | None = numbers_in(item.answer)
        else:
            ref = words_in(item.answer)
        return bool(ref) and value == ref
