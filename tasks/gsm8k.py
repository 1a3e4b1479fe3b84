"""GSM8K from a local JSONL file in GSM8K's own format (these machines reach no dataset hub).

    {"question": "Weng earns $12 an hour ...", "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 ...\\n#### 10"}

    get_task("gsm8k", path="train.jsonl")                          # one file, split by hash
    get_task("gsm8k", path="train.jsonl", eval_path="test.jsonl")  # the files are the splits

Options:
    path       (required) JSONL file, one {"question", "answer"} object per line; blank lines skipped
    eval_path  (optional) a second file that is the eval split; then `path` is the train split,
               minus any question that also appears in eval_path (counted in `dropped_overlap`)
    eval_fraction (default 0.2) with a single file, the share of questions hashed into eval

Splits: with one file, a question's split is a hash of its normalised text (whitespace collapsed,
lower case), like the procedural tasks, so it never depends on the seed or on line order. Questions
repeated within a file are kept once. Difficulty is whatever the file holds.

The reference answer is the text after the last "####", with thousands separators removed, as in
OpenAI's grade-school-math code. A missing file, bad JSON, a missing field or an answer without a
"#### <number>" is a TaskError naming the file and line.

Answer extraction from completions: as in `AnswerTask` (tags, \\boxed{}, "####", last number).
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

from .base import (ANSWER_INSTRUCTION, AnswerTask, Item, TaskError, check_fraction, check_sample_args,
                   derive_seed, item_id, split_of)

_FINAL_RE = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


@dataclass(frozen=True)
class GsmRow:
    line: int
    question: str
    solution: str
    answer: str

    @property
    def key(self) -> str:
        return " ".join(self.question.split()).lower()


def load_gsm8k(path: str | os.PathLike) -> list[GsmRow]:
    """Every row of a GSM8K JSONL file (first occurrence of each question), checked."""
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"gsm8k: file {str(p)!r} does not exist (option path/eval_path)")
    rows: list[GsmRow] = []
    seen: set[str] = set()
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"gsm8k: {p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("question"), str) \
                    or not isinstance(obj.get("answer"), str):
                raise TaskError(f"{where}: expected an object with string fields 'question' and 'answer'")
            if "####" not in obj["answer"]:
                raise TaskError(f"{where}: answer has no '#### <number>' final line")
            final = obj["answer"].rsplit("####", 1)[1].strip().replace(",", "")
            if not _FINAL_RE.fullmatch(final):
                raise TaskError(f"{where}: final answer {final[:40]!r} after '####' is not a number")
            row = GsmRow(line=lineno, question=obj["question"].strip(), solution=obj["answer"], answer=final)
            if row.key not in seen:
                seen.add(row.key)
                rows.append(row)
    if not rows:
        raise TaskError(f"gsm8k: file {str(p)!r} holds no rows")
    return rows


class GSM8K(AnswerTask):
    """Grade-school math word problems from a GSM8K JSONL file"""

    name = "gsm8k"

    def __init__(self, *, path: str, eval_path: str | None = None, eval_fraction: float = 0.2) -> None:
        self.path = str(path)
        self.eval_path = None if eval_path is None else str(eval_path)
        self.eval_fraction = check_fraction(self.name, "eval_fraction", eval_fraction, 0.01, 0.99)
        rows = load_gsm8k(self.path)
        if self.eval_path is None:
            self.dropped_overlap = 0
            self._rows = {s: [r for r in rows if split_of(self.name, r.key, self.eval_fraction) == s]
                          for s in ("train", "eval")}
        else:
            eval_rows = load_gsm8k(self.eval_path)
            eval_keys = {r.key for r in eval_rows}
            train_rows = [r for r in rows if r.key not in eval_keys]
            self.dropped_overlap = len(rows) - len(train_rows)
            self._rows = {"train": train_rows, "eval": eval_rows}

    def size(self, split: str) -> int:
        """How many items the split holds."""
        check_sample_args(self.name, 0, split)  # checks the split name
        return len(self._rows[split])

    def sample(self, n: int, seed: int, split: str = "train") -> list[Item]:
        check_sample_args(self.name, n, split)
        rows = self._rows[split]
        source = self.eval_path if split == "eval" and self.eval_path else self.path
        if n > len(rows):
            raise TaskError(f"{self.name}: asked for {n} {split} items but the {split} split of {source} "
                            f"holds {len(rows)}")
        order = list(range(len(rows)))  # a full shuffle, so sample(n) is a prefix of sample(n + 1)
        random.Random(derive_seed(self.name, split, seed)).shuffle(order)
        return [Item(id=item_id(self.name, split, r.key),
                     messages=({"role": "user", "content": f"{r.question}\n{ANSWER_INSTRUCTION}"},),
                     answer=r.answer, meta={"key": r.key, "file": os.path.basename(source), "line": r.line})
                for r in (rows[i] for i in order[:n])]
