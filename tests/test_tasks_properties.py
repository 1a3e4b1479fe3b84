"""colora.tasks property tests (hypothesis): every reference answer, written the way a model would,
gets reward 1; anything else, random or hostile, never raises and gets a reward in [0, 1].

    pytest tests/test_tasks_properties.py -q -s     # -s prints the timings of the hostile strings

Timings are printed, not asserted (no timed assertions); the bound is structural (verifiers read a
fixed-size tail with linear scans) and a regression would show as a hung test.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
from colora.tasks import Item, Task, get_task, list_tasks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_sample.jsonl"

# Settings per task: the default, the easiest (for a tiny model) and a harder one.
SETTINGS: dict[str, list[dict]] = {
    "addition": [{}, {"digits": 1, "terms": 3}, {"digits": 6, "terms": 4}],
    "countdown": [{}, {"numbers": 2, "max_number": 20}, {"numbers": 5, "max_number": 100, "max_target": 1000},
                  {"use_all": False}],
    "counting": [{}, {"length": 4, "vocab": 2}, {"kind": "letters", "length": 30, "vocab": 5}],
    "gsm8k": [{"path": str(FIXTURE)}],
    "gsm_synth": [{}, {"max_steps": 1, "max_number": 20}, {"min_steps": 4, "max_steps": 4, "max_number": 1000}],
    "linear_algebra": [{}, {"unknowns": 1, "max_value": 20}, {"unknowns": 3, "max_value": 100, "max_coef": 9}],
    "modular": [{}, {"terms": 1, "max_operand": 100, "max_modulus": 5}, {"terms": 5, "max_modulus": 97}],
    "reverse": [{}, {"length": 2}, {"length": 12}],
    "sorting": [{}, {"length": 2, "max_value": 50}, {"length": 3, "max_value": 20}, {"kind": "words", "length": 8},
                {"length": 20, "max_value": 10**6}],
}
CASES = [(name, i) for name in list_tasks() for i in range(len(SETTINGS[name]))]


def test_every_task_has_settings():
    assert set(SETTINGS) == set(list_tasks())


@functools.cache
def task_for(name: str, i: int) -> Task:
    return get_task(name, **SETTINGS[name][i])


@functools.cache
def some_items(name: str, i: int) -> tuple[Item, ...]:
    return tuple(task_for(name, i).sample(2, 0, "train") + task_for(name, i).sample(2, 0, "eval"))


def as_a_model_writes(answer: str) -> list[str]:
    return [
        f"Let me think step by step.\n<answer>{answer}</answer>",
        f"<answer> {answer} </answer>",
        f"So the final result is \\boxed{{{answer}}}.",
        f"The answer is {answer}.",
        f"Working it out...\nThe answer is: {answer}",
        f"<answer>{answer}",
    ]


@pytest.mark.parametrize("name, i", CASES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**40), split=st.sampled_from(["train", "eval"]))
def test_reference_answer_gets_reward_one(name, i, seed, split):
    task = task_for(name, i)
    n = 3 if name != "gsm8k" else 1
    for item in task.sample(n, seed, split):
        for completion in as_a_model_writes(item.answer):
            assert task.reward(completion, item) == 1.0, (completion, item)
        assert task.format_reward(f"<answer>{item.answer}</answer>", item) == 1.0


@pytest.mark.parametrize("name, i", [c for c in CASES if c[0] in
                                     ("addition", "gsm_synth", "linear_algebra", "modular", "counting")])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**40), delta=st.integers(1, 1000))
def test_a_wrong_number_gets_zero(name, i, seed, delta):
    task = task_for(name, i)
    for item in task.sample(2, seed, "train"):
        wrong = int(item.answer) + delta
        assert task.reward(f"<answer>{wrong}</answer>", item) == 0.0
        assert task.reward(f"{item.answer} is what I first thought, but it is {wrong}.", item) == 0.0


# Pieces that exercise the parsers' edges more than uniform text does.
FRAGMENTS = ["<answer>", "</answer>", "<ANSWER>", "\\boxed{", "{", "}", "####", "(", ")", "*", "**", "/", "+",
             "-", "\u2212", "\u00d7", "=", " ", "\n", ",", ".", "$", "0", "1", "9", "1,234", "3.5", "99999999",
             "cat", "dog", "sun", "apple", "\\text{", "\\frac{1}{2}", "\u0663", "\x00", "\ud7ff"]


def _check(task: Task, completion: str, item: Item) -> None:
    r, f = task.reward(completion, item), task.format_reward(completion, item)
    assert isinstance(r, float) and r in (0.0, 1.0)
    assert isinstance(f, float) and 0.0 <= f <= 1.0


@pytest.mark.parametrize("name", list_tasks())
@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=300))
def test_random_text_never_raises(name, text):
    task = task_for(name, 0)
    for item in some_items(name, 0):
        _check(task, text, item)


@pytest.mark.parametrize("name", list_tasks())
@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=40))
def test_fragment_soup_never_raises(name, pieces):
    task = task_for(name, 0)
    items = some_items(name, 0)
    for item in items:
        _check(task, "".join(pieces), item)
        _check(task, "".join(pieces) + item.answer, item)


HOSTILE = {
    "power tower": "9**9**9**9",
    "power tower in tags": "<answer>9**9**9**9</answer>",
    "10 MB of digits": "9" * 10_000_000,
    "10 MB of letters": "a" * 10_000_000,
    "nested parens": "<answer>" + "(" * 100_000 + "1" + ")" * 100_000 + "</answer>",
    "unclosed parens": "(" * 1_000_000,
    "many open tags": "<answer>" * 200_000,
    "many boxes": "\\boxed{" * 200_000,
    "thousands chain": "1" + ",234" * 1_000_000,
    "almost thousands": "1" + ",234" * 100_000 + "5",
    "long expression": "<answer>" + "1+" * 500_000 + "1</answer>",
    "huge product": "<answer>" + "*".join(["999999"] * 50) + "</answer>",
    "many lines": "1\n" * 1_000_000,
    "answer at the head of 10 MB": "<answer>1</answer>" + " " * 10_000_000,
    "many hashes": "####" * 500_000,
    "unicode digits": "\u0663" * 100_000,
    "lone surrogates": "\ud800\udfff" * 1000,
}


@pytest.mark.parametrize("name", list_tasks())
def test_hostile_strings_are_fast_and_score_zero(name):
    task = task_for(name, 0)
    item = some_items(name, 0)[0]
    timings = {}
    for label, text in HOSTILE.items():
        start = time.perf_counter()
        _check(task, text, item)
        timings[label] = time.perf_counter() - start
        if label not in ("many lines", "almost thousands"):  # these end in a plain number (1, 2345)
            assert task.reward(text, item) == 0.0, label
    slowest = max(timings, key=timings.get)
    print(f"\n{name}: slowest hostile string {slowest!r}: {timings[slowest] * 1e3:.1f} ms (reward and format)")


@pytest.mark.parametrize("name, i", [c for c in CASES if c[0] != "gsm8k"])
def test_every_setting_holds_a_64_item_eval_split(name, i):
    """The reference study evaluates on 64 held-out items; the easy settings must allow that."""
    items = task_for(name, i).sample(64, 0, "eval")
    assert len({it.meta["key"] for it in items}) == 64
