"""What the trainer trains on: datums, their checks, their micro-batches and the host arrays of one micro-batch.

A `Datum` is one sequence with explicit targets: the model reads `tokens` and is scored on `targets`,
target i predicted by the hidden state at position `first + i`. Tinker's datums have first = 0 and one
target per input position (clients send target 0 with weight 0 on prompt positions: targets are read,
never inferred from the input); colora's GRPO rollouts have tokens = prompt + completion, first = P - 1
and the completion as targets. A `Row` is a datum of one call in a shared micro-batch: its job (whose
adapter it runs through and whose gradient it adds to), its call (whose metrics it adds to) and the
call's loss.

The host arrays are built with numpy rather than per-token Python lists: this is host time between two
micro-batches' GPU work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from colora.training.losses import CODE, LossSpec
from colora.training.packing import cumulative_starts

FLOAT_INPUTS = ("weights", "advantages", "logprobs")  # per target: an [n] array or one value for all


@dataclass(frozen=True)
class Datum:
    """One sequence. tokens: [L] int, the model's input; targets: [n] int, targets[i] is predicted at
    position first + i. weights, advantages, logprobs: [n] float or one value for every target
    (losses.py says which loss reads which; logprobs NaN: the trainer's own, so the ratio is 1).
    engine_logprobs: the sampler's log-prob of each target, for diagnostics only (the log-prob gap
    and clip fraction colora's GRPO step records); used where it has n entries."""

    tokens: np.ndarray
    targets: np.ndarray
    first: int = 0
    weights: np.ndarray | float = 1.0
    advantages: np.ndarray | float = 0.0
    logprobs: np.ndarray | float = math.nan
    engine_logprobs: np.ndarray | list[float] = field(default_factory=list)

    def __post_init__(self):
        # arrays as given (their dtype is checked by `datum_problem`, not cast: a float token is an error)
        for name in ("tokens", "targets", *(f for f in FLOAT_INPUTS if not np.isscalar(getattr(self, f)))):
            object.__setattr__(self, name, np.asarray(getattr(self, name)))

    @classmethod
    def tinker(cls, tokens: np.ndarray, loss: str, inputs: dict[str, np.ndarray]) -> "Datum":
        """A Tinker datum: `tokens` [N] the model input, position i predicts inputs["target_tokens"][i];
        cross_entropy reads `weights`, the RL losses `logprobs` and `advantages` (weight 1)."""
        d = {"tokens": tokens, "targets": inputs["target_tokens"], "first": 0}
        if loss == "cross_entropy":
            d["weights"] = inputs["weights"]
        else:
            d["logprobs"], d["advantages"] = inputs["logprobs"], inputs["advantages"]
        return cls(**d)


def datum_problem(d: Datum) -> str:
    """What is wrong with the datum's shapes and types, naming the field and its value, or ""."""
    for name in ("tokens", "targets"):
        a = getattr(d, name)
        if a.ndim != 1 or a.dtype.kind not in "iu" or len(a) == 0:
            return f"{name} must be a non-empty 1-D integer array, got {a.dtype} of shape {a.shape}"
    L, n = len(d.tokens), len(d.targets)
    if not isinstance(d.first, (int, np.integer)) or d.first < 0 or d.first + n > L:
        return (f"first ({d.first}) + len(targets) ({n}) must be at most len(tokens) ({L}), first >= 0: "
                f"targets[i] is predicted at position first + i")
    for name in FLOAT_INPUTS:
        v = getattr(d, name)
        if np.isscalar(v):
            if not isinstance(v, (float, int, np.floating, np.integer)):
                return f"{name} must be a number or a 1-D float array, got {type(v).__name__}"
        elif v.ndim != 1 or len(v) != n or v.dtype.kind not in "fiu":
            return f"{name} has shape {v.shape} ({v.dtype}), targets has {n} entries: one {name[:-1]} per target"
    return ""


def datums_problem(datums, vocab: int) -> str:
    """The first problem of a call's datums ("datums[3].targets[7] = 151936 is outside ..."), or "".
    The token range is checked in one pass over the call's tokens; the message then names the datum."""
    for i, d in enumerate(datums):
        if not isinstance(d, Datum):
            return f"datums[{i}] is a {type(d).__name__}, not a Datum"
        p = datum_problem(d)
        if p:
            return f"datums[{i}].{p}"
    if not datums:
        return ""
    ids = np.concatenate([a for d in datums for a in (d.tokens, d.targets)])
    if ids.min() >= 0 and ids.max() < vocab:
        return ""
    for i, d in enumerate(datums):
        for name in ("tokens", "targets"):
            a = getattr(d, name)
            bad = np.flatnonzero((a < 0) | (a >= vocab))
            if len(bad):
                return f"datums[{i}].{name}[{bad[0]}] = {a[bad[0]]} is outside the vocabulary [0, {vocab})"
    return ""


@dataclass(frozen=True)
class Row:
    """A datum in a shared micro-batch: `job` (its adapter and gradient), `call` (the index of its
    call in the pass: its metrics' row), the call's loss and `index`, the datum's in its call."""

    job: str
    call: int
    datum: Datum
    loss: LossSpec
    index: int = 0


def micro_batches(rows: list[Row], order: tuple[str, ...], budget: int, packed: bool) -> list[list[Row]]:
    """Greedy packing by padded tokens (rows x longest row <= budget), longest first to waste little
    padding, or with packed rows by tokens (their sum <= budget); inside a micro-batch rows are
    sorted by job in `order` (contiguous segments). A row longer than the budget is a micro-batch
    of its own."""
    rank = {j: i for i, j in enumerate(order)}
    mbs: list[list[Row]] = []
    cur: list[Row] = []
    used = 0  # packed rows: the micro-batch's tokens so far
    for r in sorted(rows, key=lambda r: -len(r.datum.tokens)):
        size = len(r.datum.tokens)
        width = len(cur[0].datum.tokens) if cur else size
        full = used + size > budget if packed else (len(cur) + 1) * width > budget
        if cur and full:
            mbs.append(cur)
            cur, used = [], 0
        cur.append(r)
        used += size
    if cur:
        mbs.append(cur)
    return [sorted(mb, key=lambda r: rank[r.job]) for mb in mbs]


def pack_micro_batch(mb: list[Row], pad_id: int) -> tuple[np.ndarray, dict, np.ndarray]:
    """A micro-batch's host arrays, padded: (longs, per_tok, targets).

    longs is int64 [ids (B*L, right-padded with pad_id) | mask (B*L) | pos (N) | call (N)], where pos[i]
    is the flat position of the hidden state that predicts the i-th target (b*L + first + i for the
    targets of row b) and call[i] its row's call; targets int64 [N] the targets back to back; per_tok
    holds float32 [N] arrays (`_per_token`)."""
    B, lens = len(mb), np.fromiter((len(r.datum.tokens) for r in mb), np.int64, len(mb))
    L = int(lens.max())
    n = np.fromiter((len(r.datum.targets) for r in mb), np.int64, B)
    first = np.fromiter((r.datum.first for r in mb), np.int64, B)
    rows = np.repeat(np.arange(B), lens)
    cols = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    ids = np.full((B, L), pad_id, np.int64)
    ids[rows, cols] = np.concatenate([r.datum.tokens for r in mb])
    mask = np.zeros((B, L), np.int64)
    mask[rows, cols] = 1
    pos = _positions(np.arange(B) * L + first, n)
    call = np.repeat(np.fromiter((r.call for r in mb), np.int64, B), n)
    return np.concatenate([ids.reshape(-1), mask.reshape(-1), pos, call]), _per_token(mb, n), _targets(mb)


def pack_micro_batch_rows(mb: list[Row]) -> tuple[np.ndarray, dict, np.ndarray]:
    """`pack_micro_batch` without padding (colora/training/packing.py): the micro-batch's sequences back to
    back in one row of T tokens. Returns (longs, per_tok, targets): longs is int64 [ids (T) | position
    ids (T), 0 at each sequence's start | pos (N) | call (N) | cu (S+1), each sequence's start and T],
    pos[i] the position in the row of the hidden state that predicts the i-th target; per_tok and
    targets as `pack_micro_batch`'s."""
    B, lens = len(mb), np.fromiter((len(r.datum.tokens) for r in mb), np.int64, len(mb))
    n = np.fromiter((len(r.datum.targets) for r in mb), np.int64, B)
    first = np.fromiter((r.datum.first for r in mb), np.int64, B)
    T = int(lens.sum())
    cu = cumulative_starts(lens)
    ids = np.concatenate([r.datum.tokens for r in mb]).astype(np.int64, copy=False)
    positions = np.arange(T) - np.repeat(cu[:-1], lens)
    pos = _positions(cu[:-1] + first, n)
    call = np.repeat(np.fromiter((r.call for r in mb), np.int64, B), n)
    return np.concatenate([ids, positions, pos, call, cu]), _per_token(mb, n), _targets(mb)


def _positions(starts: np.ndarray, n: np.ndarray) -> np.ndarray:
    """int64 [sum n]: starts[b] + 0..n[b]-1 for every row b, back to back."""
    N = int(n.sum())
    return np.repeat(starts, n) + (np.arange(N) - np.repeat(np.cumsum(n) - n, n))


def _targets(mb: list[Row]) -> np.ndarray:
    return np.concatenate([r.datum.targets for r in mb]).astype(np.int64, copy=False)


def _per_token(mb: list[Row], n: np.ndarray) -> dict:
    """float32 [N] arrays: w, adv, q (each datum's weights, advantages and logprobs), kind (the loss's
    code, losses.CODE), lo, hi (its clip), temp, kl (its temperature and KL coefficient), each row's value
    repeated over its targets, and elp (the engine's log-probs where a datum has one per target, else NaN)."""
    B, N = len(mb), int(n.sum())
    spec = {"kind": lambda s: CODE[s.kind], "lo": lambda s: s.clip_low, "hi": lambda s: s.clip_high,
            "temp": lambda s: s.temperature, "kl": lambda s: s.kl_coef}
    per_tok = {k: np.repeat(np.fromiter((get(r.loss) for r in mb), np.float32, B), n) for k, get in spec.items()}
    for k, name in (("w", "weights"), ("adv", "advantages"), ("q", "logprobs")):
        per_tok[k] = _spread([getattr(r.datum, name) for r in mb], n)
    elp = np.full(N, np.nan, np.float32)
    for r, start, k in zip(mb, np.cumsum(n) - n, n):
        if len(r.datum.engine_logprobs) == k:
            elp[start: start + k] = r.datum.engine_logprobs
    per_tok["elp"] = elp
    return per_tok


def _spread(values: list, n: np.ndarray) -> np.ndarray:
    """float32 [sum n]: each row's value repeated over its n targets, or its [n] array as it is."""
    if all(np.isscalar(v) for v in values):  # colora's GRPO rows: one weight and advantage a sequence
        return np.repeat(np.asarray(values, np.float32), n)
    return np.concatenate([np.full(k, v, np.float32) if np.isscalar(v) else np.asarray(v, np.float32)
                           for v, k in zip(values, n)])
