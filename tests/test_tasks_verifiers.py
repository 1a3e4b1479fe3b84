"""colora.tasks verifiers on hand-written completions: right, wrong and malformed, per task; answer
extraction; the safe arithmetic parser.

    pytest tests/test_tasks_verifiers.py -q
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from colora.tasks import Item, get_task
from colora.tasks.arith import MAX_DEPTH, MAX_TOKENS, ArithError, evaluate
from colora.tasks.extract import final_span, last_number, numbers_in, words_in


def item(answer: str, **meta) -> Item:
    return Item(id="test/eval/0", messages=({"role": "user", "content": "?"},), answer=answer, meta=meta)


NUMERIC = item("68")
BIG = item("1234")
COUNTDOWN = item("(3 + 5) * 3", numbers=[3, 5, 3], target=24, use_all=True)
SORT_NUMBERS = item("5, 31, 42", kind="numbers", items=["42", "5", "31"])
SORT_WORDS = item("cat, dog, sun", kind="words", items=["sun", "cat", "dog"])
REVERSE = item("sun, dog, cat", kind="words", items=["cat", "dog", "sun"])

# (task, item, completion, reward): right, wrong and malformed completions for every task.
CASES = [
    # addition (numeric extraction shared by gsm_synth, gsm8k, modular, linear_algebra, counting)
    ("addition", NUMERIC, "<answer>68</answer>", 1.0),
    ("addition", NUMERIC, "45 + 23 = 68", 1.0),
    ("addition", NUMERIC, "So the sum is \\boxed{68}.", 1.0),
    ("addition", NUMERIC, "<answer> 68 apples.</answer>", 1.0),
    ("addition", NUMERIC, "<answer>68.0</answer>", 1.0),
    ("addition", NUMERIC, "<answer>68", 1.0),  # cut off at the token limit: still read
    ("addition", NUMERIC, "<answer>67</answer>", 0.0),
    ("addition", NUMERIC, "<answer>68</answer> no wait <answer>70</answer>", 0.0),
    ("addition", NUMERIC, "68 is 45 + 23", 0.0),  # no marker: the last number is 23
    ("addition", NUMERIC, "<answer>sixty-eight</answer> 68", 0.0),  # the tag is the answer
    ("addition", NUMERIC, "", 0.0),
    ("addition", NUMERIC, "<answer></answer>", 0.0),
    ("addition", NUMERIC, "<answer>" + "6" * 100 + "</answer>", 0.0),
    # gsm_synth / gsm8k: thousands separators, currency, units, GSM8K's marker
    ("gsm_synth", BIG, "She has $1,234 left. <answer>$1,234</answer>", 1.0),
    ("gsm_synth", BIG, "The answer is 1,234 dollars.", 1.0),
    ("gsm_synth", BIG, "\\boxed{1{,}234}", 1.0),
    ("gsm_synth", BIG, "1000 + 234 = 1234\n#### 1234", 1.0),
    ("gsm_synth", BIG, "<answer>-1234</answer>", 0.0),
    ("gsm_synth", BIG, "<answer>1,23,4</answer>", 0.0),
    ("gsm_synth", BIG, "<answer>1234 or 1235</answer>", 0.0),
    # modular: the residue itself, not another member of its class
    ("modular", item("3", modulus=5), "38 = 7 * 5 + 3, so <answer>3</answer>", 1.0),
    ("modular", item("3", modulus=5), "<answer>8</answer>", 0.0),
    ("modular", item("3", modulus=5), "<answer>-2</answer>", 0.0),
    ("modular", item("3", modulus=5), "<answer>3 mod 5</answer>", 0.0),
    # linear_algebra
    ("linear_algebra", item("4"), "Let x = 4 and y = 3.\n<answer>4</answer>", 1.0),
    ("linear_algebra", item("4"), "<answer>x = 4</answer>", 1.0),
    ("linear_algebra", item("4"), "<answer>3</answer>", 0.0),
    ("linear_algebra", item("4"), "<answer>x</answer>", 0.0),
    # counting: digits only
    ("counting", item("2"), "cat appears at 2 and 4. <answer>2</answer>", 1.0),
    ("counting", item("2"), "There are 2.", 1.0),
    ("counting", item("2"), "<answer>3</answer>", 0.0),
    ("counting", item("2"), "<answer>two</answer>", 0.0),
    # countdown (use_all: each number exactly once)
    ("countdown", COUNTDOWN, "<answer>(3 + 5) * 3</answer>", 1.0),
    ("countdown", COUNTDOWN, "<answer>3 * (5 + 3)</answer>", 1.0),
    ("countdown", COUNTDOWN, "<answer>(3+5)*3 = 24</answer>", 1.0),
    ("countdown", COUNTDOWN, "<answer>24 = (3 + 5) × 3</answer>", 1.0),
    ("countdown", COUNTDOWN, "The answer is (3 + 5) * 3.", 1.0),
    ("countdown", COUNTDOWN, "<answer>3 * 5 + 3</answer>", 0.0),  # 18
    ("countdown", COUNTDOWN, "<answer>3 * 8</answer>", 0.0),  # 8 is not given
    ("countdown", COUNTDOWN, "<answer>(3 + 5) * 3 * 1</answer>", 0.0),  # 1 is not given
    ("countdown", COUNTDOWN, "<answer>(5 + 3) * 3 - 3 + 3</answer>", 0.0),  # 3 used four times
    ("countdown", COUNTDOWN, "<answer>(3 + 5) * 3 + 0</answer>", 0.0),
    ("countdown", COUNTDOWN, "<answer>24</answer>", 0.0),
    ("countdown", COUNTDOWN, "<answer>9**9**9**9</answer>", 0.0),
    ("countdown", COUNTDOWN, "<answer>(3 + 5) ** 3</answer>", 0.0),
    ("countdown", COUNTDOWN, "<answer>-3 + 27</answer>", 0.0),
    ("countdown", COUNTDOWN, "<answer>__import__('os').system('true')</answer>", 0.0),
    ("countdown", COUNTDOWN, "<answer>" + "(" * 10_000 + "3" + ")" * 10_000 + "</answer>", 0.0),
    ("countdown", COUNTDOWN, "<answer>(3 + 5) * 3 / 0</answer>", 0.0),
    ("countdown", item("8 / (3 - 8 / 3)", numbers=[3, 3, 8, 8], target=24, use_all=True),
     "<answer>8 / (3 - 8 / 3)</answer>", 1.0),  # exact rationals: 8 / (1/3)
    ("countdown", item("2 + 7", numbers=[2, 3, 7], target=9, use_all=False), "<answer>2 + 7</answer>", 1.0),
    ("countdown", item("2 + 7", numbers=[2, 3, 7], target=9, use_all=True), "<answer>2 + 7</answer>", 0.0),
    # sorting
    ("sorting", SORT_NUMBERS, "<answer>5, 31, 42</answer>", 1.0),
    ("sorting", SORT_NUMBERS, "<answer>[5, 31, 42]</answer>", 1.0),
    ("sorting", SORT_NUMBERS, "<answer>5 31 42</answer>", 1.0),
    ("sorting", SORT_NUMBERS, "Sorting 42, 5, 31 gives:\n5, 31, 42.", 1.0),
    ("sorting", SORT_NUMBERS, "<answer>42, 31, 5</answer>", 0.0),
    ("sorting", SORT_NUMBERS, "<answer>5, 31</answer>", 0.0),
    ("sorting", SORT_NUMBERS, "<answer>5, 31, 42, 42</answer>", 0.0),
    ("sorting", SORT_NUMBERS, "<answer>5,31,42</answer> and then 42, 5, 31", 1.0),
    ("sorting", SORT_NUMBERS, "<answer></answer>", 0.0),
    ("sorting", SORT_WORDS, "<answer>cat, dog, sun</answer>", 1.0),
    ("sorting", SORT_WORDS, "<answer>Cat, Dog, Sun</answer>", 1.0),
    ("sorting", SORT_WORDS, "The answer is cat, dog, sun.", 1.0),
    ("sorting", SORT_WORDS, "The answer is cat, moon, dog, sun.", 0.0),  # no word skipped over
    ("sorting", SORT_WORDS, "<answer>sun, dog, cat</answer>", 0.0),
    ("sorting", SORT_WORDS, "<answer>cat dog</answer>", 0.0),
    # reverse
    ("reverse", REVERSE, "<answer>sun, dog, cat</answer>", 1.0),
    ("reverse", REVERSE, "\\boxed{\\text{sun, dog, cat}}", 1.0),
    ("reverse", REVERSE, "<answer>cat, dog, sun</answer>", 0.0),
    ("reverse", REVERSE, "<answer>sun, dog, cat, cat</answer>", 0.0),
    ("reverse", REVERSE, "<answer>1, 2, 3</answer>", 0.0),
]


@pytest.mark.parametrize("name, it, completion, expected", CASES)
def test_reward_examples(name, it, completion, expected):
    task = get_task(name)
    reward = task.reward(completion, it)
    assert isinstance(reward, float) and reward == expected


def test_gsm8k_uses_the_same_numeric_verifier():
    from pathlib import Path

    task = get_task("gsm8k", path=str(Path(__file__).parent / "fixtures" / "gsm8k_sample.jsonl"))
    assert task.reward("<answer>1,234</answer>", BIG) == 1.0
    assert task.reward("#### 1235", BIG) == 0.0
    assert task.reward("<answer>1234", BIG) == 1.0


@pytest.mark.parametrize("completion, expected", [
    ("<answer>68</answer>", 1.0),
    ("I think <answer>68 apples</answer>", 1.0),
    ("68", 0.0),
    ("\\boxed{68}", 0.0),  # right answer, not the requested format
    ("<answer>68", 0.5),
    ("<answer>68</answer><answer>68</answer>", 0.5),
    ("<answer></answer>", 0.5),
    ("<answer>lots</answer>", 0.5),
    ("</answer>68<answer>", 0.5),
])
def test_format_reward(completion, expected):
    assert get_task("addition").format_reward(completion, NUMERIC) == expected


def test_format_reward_parses_per_task():
    assert get_task("countdown").format_reward("<answer>(1 + 2) * 3</answer>", COUNTDOWN) == 1.0  # wrong, well-formed
    assert get_task("countdown").format_reward("<answer>1 +* 2</answer>", COUNTDOWN) == 0.5
    assert get_task("sorting").format_reward("<answer>1, 2, 3</answer>", SORT_NUMBERS) == 1.0
    assert get_task("sorting").format_reward("<answer>none</answer>", SORT_NUMBERS) == 0.5


# --------------------------------------------------------------------------- extraction


@pytest.mark.parametrize("text, span, source", [
    ("a <answer>1</answer> b <answer>2</answer> c", "2", "answer"),
    ("<ANSWER>7</ANSWER>", "7", "answer"),
    ("<answer>1</answer> then <answer>2 and more", "2 and more", "answer"),
    ("stray </answer> \\boxed{5}", "5", "boxed"),
    ("\\boxed{1} and \\boxed{\\frac{1}{2}} end", "\\frac{1}{2}", "boxed"),
    ("\\boxed{unclosed", "unclosed", "boxed"),
    ("work\n#### 72\nextra", " 72", "####"),
    ("just 5 words", "just 5 words", "text"),
])
def test_final_span_order(text, span, source):
    assert final_span(text) == (span, source)


@pytest.mark.parametrize("text, value", [
    ("x = -3.", Fraction(-3)),
    ("\u22123", Fraction(-3)),
    ("5-3", Fraction(3)),
    ("costs $5.", Fraction(5)),
    ("1,234,567 people", Fraction(1234567)),
    ("1,2345", Fraction(2345)),
    ("3.50", Fraction(7, 2)),
    ("42km", Fraction(42)),
    ("x2", None),
    ("no digits", None),
    ("9" * 31, None),
    ("1 2 " + "9" * 31, None),  # an overlong last number is no number, not the one before it
])
def test_last_number(text, value):
    assert last_number(text) == value


def test_list_parsing():
    assert numbers_in("[3,7,12]") == [3, 7, 12]
    assert numbers_in("-1, 2.5") == [-1, Fraction(5, 2)]
    assert numbers_in("1 " + "9" * 40) is None
    assert words_in("\\text{Sun}, dog") == ["sun", "dog"]


# --------------------------------------------------------------------------- safe arithmetic


def test_evaluate_is_exact_and_reports_literals():
    assert evaluate("(3 + 5) * 3") == (24, (3, 5, 3))
    assert evaluate("8 / (3 - 8 / 3)") == (24, (8, 3, 8, 3))
    assert evaluate("7 \u2212 2 \u00d7 3 \u00f7 2") == (4, (7, 2, 3, 2))
    assert evaluate("1 - 2 - 3") == (-4, (1, 2, 3))  # left-associative
    assert evaluate("2 * 3 + 4 * 5") == (26, (2, 3, 4, 5))


@pytest.mark.parametrize("text, reason", [
    ("9**9**9**9", "unexpected"),
    ("2 ^ 3", "unexpected character"),
    ("-3", "unexpected"),
    ("3 +", "ends early"),
    ("(3 + 4", "ends early"),
    ("3 4", "after a complete expression"),
    ("1 / 0", "division by zero"),
    ("1 / (2 - 2)", "division by zero"),
    ("1234567", "digits"),
    ("999999 * 999999 * 999999", "beyond"),
    ("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1), "nested"),
    ("+".join(["1"] * (MAX_TOKENS // 2 + 1)), "tokens"),
    ("1" + " " * 1000, "longer"),
    ("", "empty"),
    ("1.5 + 2", "unexpected character"),
])
def test_evaluate_rejects(text, reason):
    with pytest.raises(ArithError, match=reason):
        evaluate(text)


@pytest.mark.parametrize("name, it, completion", [
    ("countdown", COUNTDOWN, "(3 + 5) * 3\nThat is my answer."),
    ("countdown", COUNTDOWN, "3 + 5 = 8\n8 * 3 = 24\nSo: (3 + 5) * 3"),
    ("sorting", SORT_NUMBERS, "Sorted:\n5, 31, 42\nHope this helps!"),
    ("reverse", REVERSE, "Reversed:\nsun, dog, cat\nDone."),
])
def test_answer_before_a_closing_remark_without_tags(name, it, completion):
    assert get_task(name).reward(completion, it) == 1.0


# Characters whose lower case is longer ('\u0130' -> 'i' + U+0307) or that are not ASCII letters at all must
# not shift where the answer tags are found: positions come from the text itself.
_WIDE = ["\u0130", "\u0130" * 5, "\u1e9e", "\u2126", "K\u0130", "\ufb03"]


@pytest.mark.parametrize("prefix", _WIDE)
def test_answer_tags_after_characters_that_lower_case_longer(prefix):
    assert final_span(f"{prefix} <answer>129</answer>") == ("129", "answer")
    assert final_span(f"{prefix} <ANSWER>129</Answer> tail") == ("129", "answer")
    assert final_span(f"{prefix}<answer>129") == ("129", "answer")
    task = get_task("addition")
    assert task.reward(f"{prefix} <answer>129</answer>", item("129")) == 1.0
    assert task.reward(f"{prefix} <answer>129</answer>", item("29")) == 0.0
    assert task.format_reward(f"{prefix} <answer>129</answer>", item("129")) == 1.0


def test_countdown_stated_value_must_agree_with_the_expression():
    task = get_task("countdown")
    assert task.reward("<answer>(3 + 5) * 3 = 25</answer>", COUNTDOWN) == 0.0
    assert task.reward("<answer>25 = (3 + 5) * 3</answer>", COUNTDOWN) == 0.0
    assert task.reward("<answer>(3 + 5) * 3 = 24 = 25</answer>", COUNTDOWN) == 0.0
    assert task.reward("<answer>(3 + 5) * 3 = 8 * 3 = 24</answer>", COUNTDOWN) == 1.0
    assert task.reward("<answer>(3 + 5) * 3 = 24</answer>", COUNTDOWN) == 1.0
    assert task.reward("<answer>(3 + 5) * 3 = </answer>", COUNTDOWN) == 1.0  # nothing stated
    assert task.reward("<answer>(3 + 5) * 3 = 3 +</answer>", COUNTDOWN) == 0.0  # a side that does not evaluate
