"""A small, deterministic `Backend` for the protocol's tests and for trying the protocol: no vLLM, no GPU.

The "model" is a bigram language model over the served tokenizer's vocabulary: the next token's logits
after token p are `base[p] + (alpha / rank) * A[p] @ B`, with `base` a fixed random table (the frozen
base model) and each model's LoRA-like pair A [V, r], B [r, V] (B starts at zero, as LoRA's does, so a
new model equals the base). forward_backward computes real target log-probs and the Tinker losses of
`colora/service/backend.py` with torch autograd (over each datum's scored span alone with `score_weighted`, as
the co-runner), optim_step is torch.optim.AdamW with the step's
settings, snapshots are copies that later steps do not touch, and sampling draws from a snapshot on a
thread of its own. Sampled log-probs are the T=1 log-probs of the drawn tokens, like the trainer's.
"""

from __future__ import annotations

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from colora.service.backend import (
    Backend,
    BackendError,
    Capabilities,
    ForwardCall,
    ForwardResult,
    LoraSpec,
    OptimCall,
    SampleCall,
    SampledSequence,
    SampleResult,
    scored_span,
    scores_weighted,
)

ALPHA = 32.0  # colora's LoRA alpha; scale = alpha / rank


@dataclass
class _Adapter:
    spec: LoraSpec
    A: torch.Tensor  # [V, r], requires grad
    B: torch.Tensor  # [r, V], requires grad
    optim: torch.optim.AdamW

    @property
    def scale(self) -> float:
        return ALPHA / self.spec.rank


@dataclass(frozen=True)
class _Snapshot:
    """A frozen adapter (or the base model when A is None), what a sampler ref points to."""

    A: torch.Tensor | None
    B: torch.Tensor | None
    scale: float


class FakeBackend(Backend):
    """See the module docstring. `decode` (token ids -> text) is needed only for stop strings."""

    def __init__(self, model_name: str, vocab_size: int, eos_token_id: int, *, max_context: int = 2048,
                 max_lora_rank: int = 64, seed: int = 0, decode: Callable[[list[int]], str] | None = None,
                 tokenizer_id: str | None = None):
        self._caps = Capabilities(model_name=model_name, max_context=max_context, vocab_size=vocab_size,
                                  max_lora_rank=max_lora_rank, tokenizer_id=tokenizer_id, arch="fake-bigram")
        self.eos_token_id = eos_token_id
        self._decode = decode
        gen = torch.Generator().manual_seed(seed)
        self._base = torch.randn(vocab_size, vocab_size, generator=gen)  # [V, V]: logits of next | prev
        self._models: dict[str, _Adapter] = {}
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-engine")
        self._live_samplers = 0
        self._lock = threading.Lock()  # guards _live_samplers only

    # -- training side (the trainer thread) --------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return self._caps

    def create_model(self, model_id: str, spec: LoraSpec) -> None:
        if not isinstance(spec, LoraSpec):  # a full-parameter model (colora/service/full.py)
            raise BackendError("the fake backend trains LoRA adapters only: full-parameter models need the co-runner "
                               "backend (colora serve without --fake)", "user")
        V = self._caps.vocab_size
        gen = torch.Generator().manual_seed(spec.seed)
        A = (torch.randn(V, spec.rank, generator=gen) / math.sqrt(spec.rank)).requires_grad_()
        B = torch.zeros(spec.rank, V, requires_grad=True)
        self._models[model_id] = _Adapter(spec, A, B, torch.optim.AdamW([A, B]))

    def delete_model(self, model_id: str) -> None:
        self._models.pop(model_id, None)

    def _model(self, model_id: str) -> _Adapter:
        if model_id not in self._models:
            raise BackendError(f"model {model_id!r} is not loaded", "server")
        return self._models[model_id]

    def _logits(self, prev: torch.Tensor, A, B, scale: float) -> torch.Tensor:
        # prev: [N] -> [N, V]
        out = self._base[prev]
        return out if A is None else out + scale * (A[prev] @ B)

    def train_cycle(self, forward, optim):
        fwd = [self._guard(lambda c=c: self._forward(c)) for c in forward]
        opt = [self._guard(lambda c=c: self._optim_step(c)) for c in optim]
        return fwd, opt

    @staticmethod
    def _guard(fn):
        try:
            return fn()
        except BackendError as e:
            return e
        except Exception as e:  # one call's bug must not fail the cycle's other calls
            return BackendError(f"{type(e).__name__}: {e}", "server")

    def _forward(self, call: ForwardCall) -> ForwardResult:
        m = self._model(call.model_id)
        weighted = scores_weighted(call.loss_fn_config)
        outputs, total = [], torch.zeros(())
        with torch.set_grad_enabled(not call.forward_only):
            for d in call.datums:
                # score_weighted: the span alone; the bigram's logits at a position read that position's token only
                lo, hi = scored_span(call.loss_fn, d.inputs) if weighted else (0, len(d.tokens))
                out = np.zeros(len(d.tokens), np.float32)  # [N]: 0.0 outside the span
                if hi > lo:
                    inputs = {k: v[lo:hi] for k, v in d.inputs.items()}
                    tokens = torch.from_numpy(d.tokens[lo:hi])
                    target = torch.from_numpy(inputs["target_tokens"])
                    logp = torch.log_softmax(self._logits(tokens, m.A, m.B, m.scale), -1)
                    logp = logp.gather(1, target[:, None])[:, 0]  # [hi - lo]
                    total = total + _loss(call.loss_fn, call.loss_fn_config, logp, inputs)
                    out[lo:hi] = logp.detach().numpy()
                outputs.append({"logprobs": out})
            if not torch.isfinite(total):
                raise BackendError(f"loss of {call.loss_fn} is not finite ({total.item()})", "user")
            if not call.forward_only and total.requires_grad:  # not when no datum weighs anything
                total.backward()
        return ForwardResult(outputs=outputs, metrics={"loss:sum": float(total.item())})

    def _optim_step(self, call: OptimCall) -> dict[str, float]:
        m, p = self._model(call.model_id), call.params
        for g in m.optim.param_groups:
            g.update(lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)
        params = [m.A, m.B]
        for t in params:
            if t.grad is None:
                t.grad = torch.zeros_like(t)
        norm = torch.nn.utils.clip_grad_norm_(params, p.grad_clip_norm if p.grad_clip_norm > 0 else math.inf)
        m.optim.step()
        m.optim.zero_grad(set_to_none=False)
        return {"grad_norm": float(norm)}

    def save_state(self, model_id, directory, optimizer=True):
        m = self._model(model_id)
        state = {"A": m.A.detach().clone(), "B": m.B.detach().clone()}
        if optimizer:
            state["optim"] = m.optim.state_dict()
        torch.save(state, Path(directory) / "adapter.pt")
        (Path(directory) / "spec.json").write_text(json.dumps(m.spec.__dict__))

    def load_state(self, model_id, directory, optimizer):
        m = self._model(model_id)
        state = torch.load(Path(directory) / "adapter.pt")
        if state["A"].shape != m.A.shape:
            raise BackendError(f"checkpoint {directory} has rank {state['A'].shape[1]}, the model has "
                               f"rank {m.spec.rank}", "user")
        if optimizer and "optim" not in state:
            raise BackendError(f"checkpoint {directory} holds no optimizer state", "user")
        with torch.no_grad():
            m.A.copy_(state["A"])
            m.B.copy_(state["B"])
        m.A.grad = m.B.grad = None
        m.optim = torch.optim.AdamW([m.A, m.B])
        if optimizer:
            m.optim.load_state_dict(state["optim"])

    def save_for_sampler(self, model_id, directory):
        m = self._model(model_id)
        snap = _Snapshot(m.A.detach().clone(), m.B.detach().clone(), m.scale)
        if directory is not None:
            torch.save({"A": snap.A, "B": snap.B, "scale": snap.scale}, Path(directory) / "sampler.pt")
        return self._acquire(snap)

    def load_sampler(self, directory):
        state = torch.load(Path(directory) / "sampler.pt")
        return self._acquire(_Snapshot(state["A"], state["B"], state["scale"]))

    def _acquire(self, snap: _Snapshot) -> _Snapshot:
        with self._lock:
            self._live_samplers += 1
        return snap

    def release_sampler(self, ref) -> None:
        with self._lock:
            self._live_samplers -= 1

    @property
    def live_samplers(self) -> int:
        """Sampler refs handed out and not released (the tests check that sessions release theirs)."""
        with self._lock:
            return self._live_samplers

    @property
    def model_ids(self) -> list[str]:
        return list(self._models)

    # -- sampling side (any thread; the work runs on the engine thread) ----------------------------
    def sample(self, call: SampleCall, done) -> None:
        def run():
            try:
                result = self._sample(call)
            except BackendError as e:
                result = e
            except Exception as e:
                result = BackendError(f"{type(e).__name__}: {e}", "server")
            done(result)

        self._engine.submit(run)

    def _sample(self, call: SampleCall) -> SampleResult:
        snap = call.sampler if call.sampler is not None else _Snapshot(None, None, 0.0)
        if call.stop.strings and self._decode is None:
            raise BackendError("stop strings need the model's tokenizer; send stop token ids", "user")
        gen = torch.Generator().manual_seed(call.seed)
        prompt = torch.from_numpy(call.prompt)
        seqs = [self._draw(snap, int(prompt[-1]), call, gen) for _ in range(call.num_samples)]
        prompt_lp = None
        if call.prompt_logprobs:
            with torch.no_grad():
                lp = torch.log_softmax(self._logits(prompt[:-1], snap.A, snap.B, snap.scale), -1)
                lp = lp.gather(1, prompt[1:, None])[:, 0]
            prompt_lp = np.concatenate([[np.nan], lp.numpy()]).astype(np.float32)
        return SampleResult(sequences=seqs, prompt_logprobs=prompt_lp)

    def _draw(self, snap: _Snapshot, prev: int, call: SampleCall, gen: torch.Generator) -> SampledSequence:
        tokens, logprobs, reason = [], [], "length"
        with torch.no_grad():
            for _ in range(call.max_tokens):
                logits = self._logits(torch.tensor([prev]), snap.A, snap.B, snap.scale)[0]
                lp = torch.log_softmax(logits, -1)
                tok = _pick(logits, call.temperature, call.top_k, call.top_p, gen)
                tokens.append(tok)
                logprobs.append(float(lp[tok]))
                prev = tok
                if (call.stop.eos and tok == self.eos_token_id) or tok in call.stop.token_ids or (
                        call.stop.strings and any(s in self._decode(tokens) for s in call.stop.strings)):
                    reason = "stop"
                    break
        return SampledSequence(np.array(tokens, np.int64), np.array(logprobs, np.float32), reason)

    def close(self) -> None:
        self._engine.shutdown(wait=False, cancel_futures=True)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """One token from logits [V] under temperature (0: greedy), top-k (-1: all) and top-p."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, -1)
    if 0 < top_k < probs.numel():
        kth = probs.topk(top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p * sorted_p.sum()  # the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def _loss(loss_fn: str, config: dict[str, float], logp: torch.Tensor, inputs: dict[str, np.ndarray]) -> torch.Tensor:
    """The Tinker per-token losses of `colora/service/backend.py`, summed over positions."""
    if loss_fn == "cross_entropy":
        return -(torch.from_numpy(inputs["weights"]) * logp).sum()
    q, adv = torch.from_numpy(inputs["logprobs"]), torch.from_numpy(inputs["advantages"])
    ratio = torch.exp(logp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    if loss_fn == "ppo":
        return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv).sum()
    if loss_fn == "cispo":
        return -(ratio.clamp(lo, hi).detach() * logp * adv).sum()
    raise BackendError(f"loss_fn {loss_fn!r} is not implemented", "user")


def fake_from_model_dir(model_dir: str | Path, **kwargs) -> FakeBackend:
    """A FakeBackend over a Hugging Face model directory's tokenizer: vocab size and EOS from its
    config.json, stop strings through its tokenizer.json. The weights are not read."""
    from tokenizers import Tokenizer

    d = Path(model_dir)
    cfg = json.loads((d / "config.json").read_text())
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        raise ValueError(f"{d / 'config.json'}: no eos_token_id")
    return FakeBackend(str(model_dir), int(cfg["vocab_size"]), int(eos),
                       decode=lambda ids: tok.decode(ids, skip_special_tokens=False), **kwargs)

