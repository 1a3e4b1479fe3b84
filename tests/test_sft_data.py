"""An sft job's data: conversations read, tokenized with the chat template, the assistant's tokens
masked for the loss, split and batched by derived seeds; bad input named by file and line."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from colora.training.sft_data import SftData, SftDataError, read_conversations, resolve_data_path, tokenize

CHATS = [
    {"messages": [{"role": "user", "content": "two plus two"}, {"role": "assistant", "content": "four"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
                  {"role": "assistant", "content": "see you"}]},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_mask_holds_each_assistant_turn_and_its_end_of_turn_and_nothing_else(tok):
    msgs = CHATS[1]["messages"]
    tokens, mask = tokenize(tok, msgs)
    assert len(tokens) == len(mask)
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(tokens) == text
    trained = tok.decode([t for t, m in zip(tokens, mask) if m])
    # both replies, each with the end of its turn; no prompt, no generation prompt, no user text
    assert "hello" in trained and "see you" in trained and trained.count("<|im_end|>") == 2
    assert "hi" not in trained.replace("hello", "") and "bye" not in trained and "assistant" not in trained
    assert "be brief" not in trained and not mask[0]


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(tok):
    class Rewriting:
        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            return "|".join(m["content"] for m in reversed(msgs)) + ("|>" if add_generation_prompt else "")

    with pytest.raises(SftDataError, match="renders earlier turns differently"):
        tokenize(Rewriting(), CHATS[0]["messages"], "f.jsonl:1")


@pytest.mark.parametrize("line,needle", [
    ("{not json", "f.jsonl:2: not JSON"),
    (json.dumps({"msgs": []}), "f.jsonl:2: expected"),
    (json.dumps({"messages": [{"role": "bot", "content": "x"}]}), r"messages\[0\] must be"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant message"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, line, needle):
    p = _write(tmp_path / "f.jsonl", [CHATS[0], line])
    with pytest.raises(SftDataError, match=needle):
        read_conversations(p)


def test_split_and_batches_are_functions_of_the_seed_and_the_job(tmp_path, tok):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(20)]
    p = _write(tmp_path / "d.jsonl", rows)

    def make(job, seed):
        return SftData(p, tok, job=job, run_seed=seed, eval_size=5, max_len=512)

    a, again, other = make("x", 1), make("x", 1), make("y", 1)
    assert len(a.eval) == 5 and len(a.train) == 15
    assert {c.line for c in a.eval}.isdisjoint({c.line for c in a.train})
    assert [c.line for c in a.eval] == [c.line for c in again.eval]
    assert [c.line for c in a.batch(3, 4)] == [c.line for c in again.batch(3, 4)]
    assert len({c.line for c in a.batch(3, 4)}) == 4  # no repeats where the split holds enough
    assert [c.line for c in a.eval] != [c.line for c in other.eval] or \
        [c.line for c in a.batch(0, 8)] != [c.line for c in other.batch(0, 8)]
    with pytest.raises(SftDataError, match=r"20 conversations; the job needs experiment.eval_size \(20\)"):
        SftData(p, tok, job="x", run_seed=1, eval_size=20, max_len=512)
    with pytest.raises(SftDataError, match=r"d.jsonl:1: \d+ tokens, more than engine.max_model_len \(4\)"):
        SftData(p, tok, job="x", run_seed=1, eval_size=0, max_len=4)


def test_a_relative_data_path_is_looked_for_in_the_given_folders(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _write(tmp_path / "b" / "d.jsonl", CHATS)
    assert resolve_data_path("d.jsonl", [tmp_path / "a", tmp_path / "b"]) == (tmp_path / "b" / "d.jsonl").resolve()
    with pytest.raises(SftDataError, match="'nope.jsonl' is in none of"):
        resolve_data_path("nope.jsonl", [tmp_path / "a"])
