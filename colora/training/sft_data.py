"""An SFT job's data: chat conversations from a JSONL file, tokenized with the model's chat template,
the loss on the assistant's tokens.

Each line of the file is one conversation: `{"messages": [{"role": "system" | "user" | "assistant",
"content": "..."}, ...]}` with at least one assistant message. A conversation is rendered once with
the tokenizer's chat template and tokenized once; a token counts for the loss (its mask is true) when
it lies in an assistant message's span: its content and the template's end of turn, so the model
learns where to stop; never the generation prompt before it (`<|im_start|>assistant\\n` in ChatML).
The spans come from the template itself: the text rendered up to a message (with the generation prompt
before an assistant message) must be a prefix of the text rendered through it, as it is for ChatML
and Llama-style templates; a template that rewrites earlier turns is refused by name.

The held-out split (`eval_size` conversations) and each step's batch are drawn with seeds derived from
the run's seed and the job's name (`derive_seed`), so a job's batches are the same alone or beside
others, and on every resume.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colora.seeding import derive_seed
from colora.training.batches import Datum

ROLES = ("system", "user", "assistant")


class SftDataError(ValueError):
    """The data file or one of its conversations cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Conversation:
    line: int  # its line in the file (1-based)
    tokens: tuple[int, ...]
    mask: tuple[bool, ...]  # per token: whether it is the assistant's (its prediction counts for the loss)

    @property
    def targets(self) -> int:
        """The tokens whose prediction counts: the assistant's, past the first token."""
        return sum(self.mask[1:])


def read_conversations(path: Path) -> list[tuple[int, list[dict]]]:
    """(line, messages) of every non-blank line of a JSONL file; a malformed line is an SftDataError
    naming the file, the line and what is wrong."""
    out = []
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SftDataError(f"{path}: cannot read the SFT data file ({e.strerror})") from None
    for i, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{path}:{i}"
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SftDataError(f"{where}: not JSON ({e.msg})") from None
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not msgs:
            raise SftDataError(f"{where}: expected {{\"messages\": [{{\"role\": ..., \"content\": ...}}, ...]}}")
        for k, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise SftDataError(f"{where}: messages[{k}] must be {{\"role\": one of {list(ROLES)}, "
                                   f"\"content\": a string}}, got {json.dumps(m)[:80]}")
        if not any(m["role"] == "assistant" for m in msgs):
            raise SftDataError(f"{where}: no assistant message, so nothing to train on")
        out.append((i, [{"role": m["role"], "content": m["content"]} for m in msgs]))
    if not out:
        raise SftDataError(f"{path}: holds no conversation")
    return out


def tokenize(tokenizer, messages: list[dict], where: str = "") -> tuple[list[int], list[bool]]:
    """The conversation's tokens and, per token, whether it is the assistant's (module docstring)."""
    def render(msgs: list[dict], prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)

    text = render(messages, False)
    spans = []  # [start, end) in characters of each assistant turn
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:k], True), render(messages[: k + 1], False)
        if not (through.startswith(before) and text.startswith(through)):
            raise SftDataError(f"{where}: the tokenizer's chat template renders earlier turns differently once later "
                               "ones follow, so the assistant's tokens cannot be told apart; use a model whose "
                               "template appends each turn (ChatML, Llama)")
        spans.append((len(before), len(through)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    tokens, mask = list(enc["input_ids"]), []
    for start, end in enc["offset_mapping"]:
        mask.append(any(a <= start < b for a, b in spans) and end > start)
    return tokens, mask


class SftData:
    """One sft job's conversations, tokenized and split: `eval` (eval_size of them, held out) and
    `train` (the rest), each conversation at most `max_len` tokens."""

    def __init__(self, path: Path, tokenizer, *, job: str, run_seed: int, eval_size: int, max_len: int):
        self.path = Path(path)
        self.job = job
        self.run_seed = run_seed
        convs = []
        for line, msgs in read_conversations(self.path):
            where = f"{self.path}:{line}"
            tokens, mask = tokenize(tokenizer, msgs, where)
            if len(tokens) > max_len:
                raise SftDataError(f"{where}: {len(tokens)} tokens, more than engine.max_model_len ({max_len}); "
                                   "shorten the conversation or raise engine.max_model_len")
            if not any(mask[1:]):
                raise SftDataError(f"{where}: the assistant's turns hold no token to train on")
            convs.append(Conversation(line, tuple(tokens), tuple(mask)))
        if len(convs) < eval_size + 1:
            raise SftDataError(f"{self.path}: {len(convs)} conversations; the job needs experiment.eval_size "
                               f"({eval_size}) held out and at least one to train on")
        order = np.random.default_rng(derive_seed(run_seed, job, "sft_split")).permutation(len(convs))
        self.eval = [convs[i] for i in sorted(order[:eval_size])]
        self.train = [convs[i] for i in sorted(order[eval_size:])]

    def batch(self, step: int, n: int) -> list[Conversation]:
        """The `n` training conversations of the job's `step` (without repeats where the split holds n)."""
        rng = np.random.default_rng(derive_seed(self.run_seed, self.job, step, "sft_batch"))
        picks = rng.choice(len(self.train), size=n, replace=n > len(self.train))
        return [self.train[i] for i in picks]


def datums(convs: list[Conversation]) -> list[Datum]:
    """The conversations as cross_entropy datums of one step (or one evaluation): token i predicts
    token i + 1, each assistant target weighted 1 / (the assistant targets of them all), so the loss is
    the mean NLL per assistant token and a step's size does not scale the learning rate."""
    total = sum(c.targets for c in convs)
    out = []
    for c in convs:
        tokens = np.asarray(c.tokens, np.int64)
        w = np.asarray(c.mask[1:], np.float32) / max(total, 1)
        out.append(Datum(tokens, tokens[1:], 0, w))
    return out


def resolve_data_path(data: str, dirs: list[Path]) -> Path:
    """An sft job's `data` as a file: absolute as it is, else the first of `dirs` (the config's folder,
    then the current directory) that holds it; an SftDataError naming where it was looked for."""
    p = Path(data).expanduser()
    if p.is_absolute():
        if p.is_file():
            return p
        raise SftDataError(f"data file {data!r} does not exist")
    for d in dirs:
        if (Path(d) / p).is_file():
            return (Path(d) / p).resolve()
    raise SftDataError(f"data file {data!r} is in none of {[str(d) for d in dirs]}")
