"""The task contract: items, the `Task` interface, held-out splits and option checks.

Every colora job learns from a `Task`: `sample(n, seed, split)` gives prompts with reference answers,
`reward(completion, item)` judges what the model wrote. The verifiers judge untrusted text, so the
contract is strict: `reward` and `format_reward` never raise and take bounded time on any string.

Held-out splits are provably disjoint: an item's split is a pure function of its canonical content
key (a hash of task name and key, compared with `eval_fraction`), never of the seed, and `sample`
rejection-samples candidates until they land in the requested split. Two items with the same key are
the same problem (e.g. countdown's key is the sorted numbers and the target, so a permutation of an
eval puzzle is never a training item), so no problem can appear in both splits, for any seeds.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import json
import random
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from .extract import final_span, format_score, last_number, parse_number

SPLITS = ("train", "eval")


class TaskError(ValueError):
    """A bad task name, option or request (names the key, the value and what is accepted)."""


@dataclass(frozen=True)
class Item:
    """One prompt with its reference answer.

    `id` is stable and unique within (task, options, split): "<task>/<split>/<hash of content key>".
    `meta["key"]` is the canonical content key that decides the split.
    """

    id: str
    messages: tuple[dict[str, str], ...]
    answer: str
    meta: Mapping[str, Any]

    def __hash__(self) -> int:  # meta and messages hold dicts; the id identifies the item
        return hash(self.id)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (for run directories and rollout logs)."""
        return {"id": self.id, "messages": [dict(m) for m in self.messages],
                "answer": self.answer, "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Item:
        return cls(id=d["id"], messages=tuple(dict(m) for m in d["messages"]),
                   answer=d["answer"], meta=dict(d["meta"]))


class Task(abc.ABC):
    """A verifiable-reward task. Subclasses set `name` and take their options as keyword arguments
    stored as attributes of the same name (so `options()` and `describe()` can report them)."""

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def sample(self, n: int, seed: int, split: str = "train") -> list[Item]:
        """n distinct items of `split` ("train" or "eval"); the same (n, seed, split) gives the same
        items. Raises TaskError when the split holds fewer than n items."""

    @abc.abstractmethod
    def reward(self, completion: str, item: Item) -> float:
        """Correctness in [0, 1]. Never raises; bounded time on any string."""

    def format_reward(self, completion: str, item: Item) -> float:
        """1.0 for exactly one <answer>...</answer> pair whose content parses, 0.5 for tags that are
        there but malformed (several, unclosed, unparseable content), 0.0 for none."""
        return format_score(completion, lambda content: True)

    def options(self) -> dict[str, Any]:
        """The constructor options in effect (attributes named like the __init__ parameters)."""
        params = inspect.signature(type(self).__init__).parameters
        kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return {k: getattr(self, k) for k, p in params.items() if k != "self" and p.kind in kinds and hasattr(self, k)}

    def describe(self) -> str:
        """One line for `colora tasks list`: name, first docstring line, options in effect."""
        doc = (inspect.getdoc(type(self)) or "").strip().splitlines()
        summary = doc[0].rstrip(".") if doc else ""
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{self.name}: {summary} ({opts})" if opts else f"{self.name}: {summary}"


# --------------------------------------------------------------------------- seeds and splits


def derive_seed(*parts: object) -> int:
    """A 64-bit seed from any printable parts; stable across processes (unlike `hash`)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def split_of(task: str, key: str, eval_fraction: float) -> str:
    """The split of the item with content `key`: "eval" for a fraction `eval_fraction` of keys.

    Depends only on the task name and the key, so it is the same for every seed and every
    difficulty setting that can produce the same problem."""
    digest = hashlib.sha256(f"{task}\x00split\x00{key}".encode()).digest()
    u = int.from_bytes(digest[:8], "little") / 2.0**64
    return "eval" if u < eval_fraction else "train"


def item_id(task: str, split: str, key: str) -> str:
    return f"{task}/{split}/{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def check_sample_args(task: str, n: object, split: object) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise TaskError(f"{task}: n ({n!r}) must be a non-negative integer")
    if split not in SPLITS:
        raise TaskError(f"{task}: split ({split!r}) must be one of {', '.join(SPLITS)}")


# --------------------------------------------------------------------------- option checks


def check_int(task: str, key: str, value: object, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise TaskError(f"{task}: option {key} ({value!r}) must be an integer in [{lo}, {hi}]")
    return value


def check_fraction(task: str, key: str, value: object, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise TaskError(f"{task}: option {key} ({value!r}) must be a number in [{lo}, {hi}]")
    return float(value)


def check_choice(task: str, key: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise TaskError(f"{task}: option {key} ({value!r}) must be one of {', '.join(choices)}")
    return value  # type: ignore[return-value]


def check_bool(task: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TaskError(f"{task}: option {key} ({value!r}) must be true or false")
    return value


# --------------------------------------------------------------------------- shared implementations


ANSWER_INSTRUCTION = "Put your final answer in <answer></answer> tags."


class AnswerTask(Task):
    """Reward = the parsed final answer equals the reference (default: one number, exactly).

    Extraction (extract.final_span): the last <answer>...</answer>, else the last \\boxed{...}, else
    the text after the last "####", else the whole text; a numeric answer is the last number in that
    span (thousands separators, units, "$", trailing punctuation and negatives are fine; a number of
    more than 30 digits counts as no number). Subclasses with other answer kinds override `parse`
    (span -> value or None) and `is_correct`."""

    def parse(self, span: str, source: str, item: Item) -> object | None:
        return last_number(span)

    def is_correct(self, value: object, item: Item) -> bool:
        ref = parse_number(item.answer)
        return ref is not None and isinstance(value, Fraction) and value == ref

    def reward(self, completion: str, item: Item) -> float:
        if not isinstance(completion, str):
            return 0.0
        span, source = final_span(completion)
        value = self.parse(span, source, item)
        return 1.0 if value is not None and self.is_correct(value, item) else 0.0

    def format_reward(self, completion: str, item: Item) -> float:
        return format_score(completion, lambda content: self.parse(content, "answer", item) is not None)


@dataclass(frozen=True)
class Draft:
    """A candidate problem before it is assigned an id: `key` is its canonical content."""

    key: str
    question: str
    answer: str
    meta: dict[str, Any]


class ProceduralTask(AnswerTask):
    """A task that draws problems from a generator: subclasses implement `draw(rng)`.

    `sample` walks one RNG stream derived from (task, split, seed), keeps candidates whose key lands
    in the split and has not been seen, and stops after `n`; so `sample(n)` is a prefix of
    `sample(n + 1)`. When the split is too small for n distinct items it raises TaskError instead of
    looping forever: once draws stop finding new items (`STALE_DRAWS` plus `STALE_FACTOR` times the
    draws it took to find the last one), or after `2000 + 200 n` draws in all."""

    instruction: ClassVar[str] = ANSWER_INSTRUCTION
    eval_fraction: float = 0.2
    # A split is taken as exhausted after this many draws without a new item, plus STALE_FACTOR times
    # the draws that found the last one. The additive part covers sparse hits (eval_fraction 0.01:
    # a hit every ~100 draws misses 2000 in a row with probability ~2e-9); the factor covers a space
    # nearly found, whose last items take longer to hit (a uniform space of S items is found whole
    # after ~(S / fraction) ln S draws, so 4 times that bounds the wait for any one of them). The
    # run's item space once found is refused in milliseconds, not after 2000 + 200 n draws (an
    # eval_size of 100,000 over a space of 32 items took 20,002,000 draws, 137 s).
    STALE_DRAWS: ClassVar[int] = 2000
    STALE_FACTOR: ClassVar[int] = 4

    def __init__(self, *, eval_fraction: float = 0.2) -> None:
        self.eval_fraction = check_fraction(self.name, "eval_fraction", eval_fraction, 0.01, 0.99)

    @abc.abstractmethod
    def draw(self, rng: random.Random) -> Draft | None:
        """One candidate problem (None when this draw failed a constraint)."""

    def prompt(self, question: str) -> str:
        return f"{question}\n{self.instruction}"

    def sample(self, n: int, seed: int, split: str = "train") -> list[Item]:
        check_sample_args(self.name, n, split)
        rng = random.Random(derive_seed(self.name, split, seed))
        items: list[Item] = []
        seen: set[str] = set()
        max_draws = 2000 + 200 * n
        draws = last_new = 0  # draws so far; the draw that found the latest new item
        while len(items) < n:
            if draws >= max_draws or draws - last_new > self.STALE_DRAWS + self.STALE_FACTOR * last_new:
                raise TaskError(
                    f"{self.name}: found only {len(items)} distinct {split} items of the {n} asked "
                    f"after {draws} draws (the last {draws - last_new} found none new); the item space for "
                    f"options {self.options()} is too small "
                    f"(raise the difficulty knobs, or eval_fraction for the eval split)")
            draws += 1
            draft = self.draw(rng)
            if draft is None or draft.key in seen or split_of(self.name, draft.key, self.eval_fraction) != split:
                continue
            seen.add(draft.key)
            last_new = draws
            meta = {"key": draft.key, **draft.meta}
            json.dumps(meta)  # meta must be JSON-serialisable: fail here, not in a run directory
            items.append(Item(id=item_id(self.name, split, draft.key),
                              messages=({"role": "user", "content": self.prompt(draft.question)},),
                              answer=draft.answer, meta=meta))
        return items
