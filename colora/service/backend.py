"""The boundary between the Tinker protocol layer and what trains and samples: `Backend`.

The protocol layer (`colora/service/app.py`, `colora/service/scheduler.py`) owns HTTP, auth, futures,
per-model ordering by seq_id, deduplication and checkpoint names. A backend owns weights, gradients,
optimizer state and sampling. Everything crossing this boundary is numpy arrays and plain dataclasses;
no protobuf, no HTTP, no tenant.

Threading contract:
- The training side (`create_model`, `delete_model`, `train_cycle`, `save_state`, `load_state`,
  `save_for_sampler`) is called from one thread only, the scheduler's trainer thread, one call at a
  time. A backend needs no locks for its training state.
- The sampling side (`sample`, `load_sampler`, `release_sampler`) and `capabilities` are called from
  other threads (the server's event loop and its worker threads) while the trainer thread may be inside
  `train_cycle`. `sample` returns at once and calls `done` later, from any thread, exactly once; a backend
  runs its engine on a thread of its own and never makes a sample wait for training. `load_sampler` may
  block (it reads a directory).
- A sampler ref from `save_for_sampler` / `load_sampler` stays valid, with the weights it froze, until
  `release_sampler(ref)`, whatever `train_cycle`, `load_state` or `delete_model` do to the model. The
  protocol layer releases a ref only when none of its samples is in flight, and releases every ref once.
  A full-parameter model's (FullSpec) are the exception: its one engine holds one set of weights, so its
  samplers serve its newest save only (an older one's samples are refused, saying so) and end with the model.

Errors: a call that fails for one model returns (or, for the single-model calls, raises) `BackendError`
with `category` "user" (the client's input is wrong: out-of-range token, non-finite loss) or "server";
a failure in one call of `train_cycle` never fails the other calls. The protocol layer has already
checked what it can (known loss, shapes, token range, rank) before a call reaches the backend. A
server error marked `retryable` failed for a passing reason (the sample was decoding when the engine
died; the engine restarts): the same call sent again is expected to succeed. The protocol layer
answers the retrieve_future of such a sample with HTTP 410, on which the SDK's sampling retry handler
sends the sample again (tinker 0.38.0: lib/api_future_impl.py turns a 410 into RetryableException,
which lib/retry_handler.py's RetryConfig retries with backoff, 0.5 s doubling to 10 s).

`health()` says how the backend is (any thread): the protocol layer serves it at /healthz and /metrics.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from colora.training.adamw import AdamParams  # the service's optimizer settings are the trainer's

# The losses the protocol layer passes to a backend; every other Tinker loss is refused before it
# (dro and gspo need inputs that are not specified here yet), but stable_reinforce, which the protocol
# layer serves itself and passes on as cispo (colora/service/records.py).
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
# loss_fn_inputs each loss needs: 1-D, one entry per position of the datum's tokens
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
# loss_fn_config keys each loss accepts, with their defaults (ratio clip bounds as absolute ratios;
# SCORE_WEIGHTED: `scored_span`)
SCORE_WEIGHTED = "score_weighted"
LOSS_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {SCORE_WEIGHTED: 0.0},
    "importance_sampling": {SCORE_WEIGHTED: 0.0},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, SCORE_WEIGHTED: 0.0},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, SCORE_WEIGHTED: 0.0},
}

Category = Literal["user", "server"]


class BackendError(Exception):
    """One call's failure; `category` is "user" when the client's input caused it, else "server".
    `retryable` (server errors only): the same call sent again is expected to succeed."""

    def __init__(self, message: str, category: Category = "server", *, retryable: bool = False):
        if retryable and category != "server":
            raise ValueError(f"a retryable BackendError is a server error, not category {category!r}")
        super().__init__(message)
        self.message = message
        self.category: Category = category
        self.retryable = retryable


@dataclass(frozen=True)
class Capabilities:
    """What the backend serves: one base model, its limits and the adapters it can train."""

    model_name: str  # the name clients pass as base_model (a Hugging Face directory or hub id)
    max_context: int  # longest datum / prompt + completion, in tokens
    vocab_size: int  # token ids are in [0, vocab_size)
    max_lora_rank: int  # create_model refuses larger ranks (vLLM fixes max_lora_rank at engine start)
    losses: tuple[str, ...] = LOSSES  # the subset of LOSSES it implements
    train_unembed: bool = False  # whether lm_head adapters are trained; when False the request's flag is ignored
    tokenizer_id: str | None = None  # what clients load the tokenizer from; None: model_name
    arch: str = "unknown"  # reported by get_info (e.g. "qwen3")


@dataclass(frozen=True)
class LoraSpec:
    """A new adapter: Tinker's LoraConfig. alpha is not part of the API (colora uses 32)."""

    rank: int
    seed: int  # the initialisation's seed (the protocol layer derives one when the client sends none)
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = False


@dataclass(frozen=True)
class FullSpec:
    """A full-parameter model (create_model without lora_config, where the server allows it): no adapter,
    every weight trained; its samplers serve its newest save only (colora/service/full.py)."""


def spec_of(lora: dict | None) -> LoraSpec | FullSpec:
    """A model's spec from its record's "lora" (None: a full-parameter model's)."""
    return FullSpec() if lora is None else LoraSpec(**lora)


@dataclass(frozen=True)
class Datum:
    """One sequence. `tokens` are the model input (the client's chunks concatenated); position i predicts
    `inputs["target_tokens"][i]`. Every input has the same length N = len(tokens)."""

    tokens: np.ndarray  # [N] int64
    inputs: dict[str, np.ndarray]  # name -> [N]; target_tokens int64, the others float32


def scores_weighted(config: dict | None) -> bool:
    """Whether a call's loss_fn_config asks to score only the positions its loss weighs (`scored_span`):
    `score_weighted` 1.0, or 0.0 / absent for every position. Any other value is the client's error."""
    v = (config or {}).get(SCORE_WEIGHTED, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or v not in (0.0, 1.0):
        raise BackendError(f"loss_fn_config[{SCORE_WEIGHTED!r}] ({v!r}) must be 1.0 (score only the positions "
                           "with a nonzero weight or advantage) or 0.0 (score every position, the default)", "user")
    return v == 1.0


def scored_span(loss_fn: str, inputs: dict[str, np.ndarray]) -> tuple[int, int]:
    """[first, end): the positions from the first to the last whose weight (cross_entropy) or advantage (the RL
    losses) is nonzero; (0, 0) when none is. Outside it a position adds nothing to the loss, its sums or the
    gradient (every RL loss term is proportional to its advantage), and a causal model's positions before `end`
    do not read the tokens after it: with `score_weighted`, a backend computes this span alone and returns 0.0
    for every other position's outputs."""
    nonzero = np.flatnonzero(inputs["weights" if loss_fn == "cross_entropy" else "advantages"])  # NaN counts
    return (int(nonzero[0]), int(nonzero[-1]) + 1) if len(nonzero) else (0, 0)


@dataclass(frozen=True)
class ForwardCall:
    """One forward_backward (or forward, when forward_only) request of one model.

    The loss is a sum over datums and positions, never normalised (Tinker's convention):
    cross_entropy -sum(w*logp); importance_sampling -sum(r*A); ppo -sum(min(r*A, clip(r,lo,hi)*A));
    cispo -sum(sg(clip(r,lo,hi))*logp*A), with logp the trainer's log-prob of the target at T=1,
    r = exp(logp - inputs["logprobs"]) and A = inputs["advantages"]. Unless forward_only, its gradient
    is added to the model's accumulated gradient, which the next OptimCall applies and clears. With
    loss_fn_config["score_weighted"] 1.0 each datum is computed over its `scored_span` only (none at all
    when it is empty): the same loss and gradient, and 0.0 in its outputs outside the span.
    """

    model_id: str
    seq_id: int  # for logs and records only: the scheduler already ordered the calls
    datums: tuple[Datum, ...]
    loss_fn: str  # one of LOSSES
    loss_fn_config: dict[str, float]  # LOSS_CONFIG's keys for this loss, defaults filled in
    forward_only: bool = False


@dataclass(frozen=True)
class ForwardResult:
    """Per datum, `outputs[i]["logprobs"]`: float32 [N], the target tokens' log-probs at T=1 (+ any other
    per-datum float32 fields); `metrics` keys are `name:reduction` (`loss:sum` is required)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class OptimCall:
    model_id: str
    seq_id: int
    params: AdamParams


@dataclass(frozen=True)
class Stop:
    """When a sequence stops, besides max_tokens. `eos`: stop at the model's EOS (Tinker's `stop=None`);
    `strings`: stop once the decoded completion contains one; `token_ids`: stop at any of them.
    The stopping token(s) are part of the returned tokens."""

    eos: bool = True
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SampleCall:
    sampler: Any  # a ref from save_for_sampler / load_sampler, or None for the base model
    prompt: np.ndarray  # [P] int64
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1  # -1: no limit
    top_p: float = 1.0
    seed: int = 0  # always set: the protocol layer derives one when the client sends none
    stop: Stop = field(default_factory=Stop)
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class SampledSequence:
    tokens: np.ndarray  # [T] int64, including the stop token(s)
    logprobs: np.ndarray  # [T] float32, the sampled tokens' log-probs
    stop_reason: Literal["stop", "length"]


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: np.ndarray | None = None  # [P] float32, NaN at position 0


class Backend(abc.ABC):
    """What the Tinker service trains and samples with. See the module docstring for the threading
    and error contracts; `colora/service/fake.py` is a small complete implementation."""

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abc.abstractmethod
    def create_model(self, model_id: str, spec: LoraSpec | FullSpec) -> None:
        """A fresh adapter (or, for a FullSpec, a model of its own) with zero accumulated gradient and fresh
        AdamW state."""

    @abc.abstractmethod
    def delete_model(self, model_id: str) -> None:
        """Frees the adapter and its optimizer state; live sampler refs of it stay valid."""

    @abc.abstractmethod
    def train_cycle(self, forward: list[ForwardCall], optim: list[OptimCall]
                    ) -> tuple[list[ForwardResult | BackendError], list[dict[str, float] | BackendError]]:
        """Runs every ForwardCall (all models in shared passes; a model's calls in list order), then every
        OptimCall (at most one per model). Returns one result per call, in the order given."""

    @abc.abstractmethod
    def save_state(self, model_id: str, directory: Path, optimizer: bool = True) -> None:
        """Writes the adapter (and AdamW state when `optimizer`) into the existing empty `directory`."""

    @abc.abstractmethod
    def load_state(self, model_id: str, directory: Path, optimizer: bool) -> None:
        """Replaces the model's adapter (and AdamW state when `optimizer`, else fresh AdamW state) with
        what `save_state` wrote there; clears the accumulated gradient."""

    @abc.abstractmethod
    def save_for_sampler(self, model_id: str, directory: Path | None) -> Any:
        """Freezes the model's current adapter for sampling and returns its ref. With `directory`, also
        writes it there (for `load_sampler`, also after a restart)."""

    @abc.abstractmethod
    def load_sampler(self, directory: Path) -> Any:
        """A sampler ref for what `save_for_sampler` wrote into `directory`."""

    @abc.abstractmethod
    def release_sampler(self, ref: Any) -> None:
        """The ref is no longer used; its weights may be freed."""

    @abc.abstractmethod
    def sample(self, call: SampleCall, done: Callable[[SampleResult | BackendError], None]) -> None:
        """Starts sampling and returns at once; `done` is called once, from any thread."""

    def health(self) -> dict:
        """How the backend is, from any thread, at once: {"status": "ok" | "degraded" | "restarting", ...}.
        A backend with an engine that can die and come back adds "engine_restarts",
        "last_engine_error", "samplers_loaded", "engine_requests_in_flight", "samples_waiting" and
        "gpu_memory_bytes" (colora/service/corun.py)."""
        return {"status": "ok"}

    @abc.abstractmethod
    def close(self) -> None:
        """Stops the backend's threads; called once when the server stops."""
