"""Per-token losses, as pure functions: Tinker's four and colora's native GRPO, one row's loss beside another's.

Every row of a shared micro-batch brings its own loss. Per token, `kind` says which and the other arrays
give its inputs. With logp the trainer's log-prob of the target (at the row's temperature), q the
sampler's log-prob (Tinker's `logprobs`; NaN: the trainer's own, detached, so r = 1 in value), A the
advantage, w the weight and r = exp(logp - q), the losses as Tinker defines them (colora/service/backend.py,
`ForwardCall`; summed over tokens and datums by the caller, never normalised):

    cross_entropy          -w * logp
    importance_sampling    -w * r * A
    ppo                    -w * min(r * A, clip(r, lo, hi) * A)
    cispo                  -w * sg(clip(r, lo, hi)) * logp * A        (sg: no gradient through it)

Tinker's stable_reinforce arrives as cispo with lo = 0, hi = its cap C and q the sampler's log-probs as
the server recorded them: -sg(min(r, C)) * logp * A (colora/service/records.py defines it).
Tinker's RL losses have w = 1 (its `weights` input belongs to cross_entropy). colora's native GRPO step
is ppo with q = NaN, lo/hi = 0.8/1.2 and w the job's normalisation weight (grpo.sequence_token_weight):
the ratio is 1 in value, so the clip never binds and the gradient is -w * A * dlogp, the same as
importance_sampling with A' = w * A and q = the trainer's own log-probs (tests/test_primitives.py).
A KL term to the frozen base model (k3, as `grpo.token_loss`) is added times a per-token coefficient,
inside w: colora's native `kl_coef`; Tinker's losses have none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KINDS = ("cross_entropy", "importance_sampling", "ppo", "cispo")  # a kind's code is its index
CODE = {k: i for i, k in enumerate(KINDS)}


@dataclass(frozen=True)
class LossSpec:
    """One forward_backward call's loss: its kind, ppo's and cispo's ratio clip [clip_low, clip_high]
    (absolute ratios; Tinker's `clip_low_threshold`/`clip_high_threshold`), the temperature of the
    trainer's log-probs (Tinker's are at 1; colora's GRPO uses its job's sampling temperature) and the
    coefficient of the KL term to the base model (0: none, and no reference forward)."""

    kind: str = "cross_entropy"
    clip_low: float = 0.8
    clip_high: float = 1.2
    temperature: float = 1.0
    kl_coef: float = 0.0

    def problem(self) -> str:
        """What is wrong with this spec, naming the field and the value, or "" when nothing is."""
        if self.kind not in CODE:
            return f"loss.kind {self.kind!r} is not one of {', '.join(KINDS)}"
        if not 0 <= self.clip_low <= self.clip_high < math.inf:
            return (f"loss.clip_low ({self.clip_low}) and loss.clip_high ({self.clip_high}) must satisfy "
                    "0 <= clip_low <= clip_high < inf")
        if not 0 < self.temperature < math.inf:
            return f"loss.temperature ({self.temperature}) must be positive and finite"
        if not 0 <= self.kl_coef < math.inf:
            return f"loss.kl_coef ({self.kl_coef}) must be at least 0 and finite"
        return ""


def ratio(logp: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """r = exp(logp - q): the trainer's probability of the target over the sampler's. [N] -> [N]."""
    return torch.exp(logp - q)


def importance_sampling(logp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """-r * A per token. logp, q, adv: [N]."""
    return -ratio(logp, q) * adv


def ppo(logp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor, lo, hi) -> torch.Tensor:
    """-min(r * A, clip(r, lo, hi) * A) per token. logp, q, adv: [N]; lo, hi: floats or [N]."""
    r = ratio(logp, q)
    return -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)


def cispo(logp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor, lo, hi) -> torch.Tensor:
    """-sg(clip(r, lo, hi)) * logp * A per token: the clipped ratio is a constant weight of the
    policy gradient. logp, q, adv: [N]; lo, hi: floats or [N]."""
    return -torch.clamp(ratio(logp, q), lo, hi).detach() * logp * adv


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The k3 estimate of KL(policy || base) per token: exp(d) - d - 1 with d = ref - logp; unbiased
    and non-negative (Schulman's approximation, as in GRPO). [N] -> [N]."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def token_losses(logp: torch.Tensor, kind: torch.Tensor, w: torch.Tensor, adv: torch.Tensor, q: torch.Tensor,
                 lo: torch.Tensor, hi: torch.Tensor, ref_logp: torch.Tensor | None = None,
                 kl_coef: torch.Tensor | float = 0.0, present: tuple[str, ...] = KINDS
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's loss, w * (its kind's loss + kl_coef * k3), and its k3 KL (zeros without ref_logp).

    logp: [N] (differentiable); kind: [N] codes (`CODE`); w, adv, q, lo, hi: [N]; ref_logp: [N] or None;
    kl_coef: float or [N]. `present`: the kinds that occur in `kind`, known to the caller from its
    rows (no look at the device): a micro-batch of one kind computes that kind's loss alone. Where
    several kinds share a micro-batch, each kind's formula sees the other kinds' tokens with r = 1 and
    A = 0, so it adds exactly 0 there in value and gradient: a ratio that overflows in one kind's
    formula never reaches a token of another kind as a NaN gradient (0 * inf)."""
    for name, t in (("kind", kind), ("w", w), ("adv", adv), ("q", q), ("lo", lo), ("hi", hi)):
        assert t.shape == logp.shape, (name, t.shape, logp.shape)
    assert present and all(k in CODE for k in present), present
    own = logp.detach()
    q = torch.where(torch.isnan(q), own, q)  # NaN: the trainer's own log-prob, r = 1
    total = None
    for name in present:
        if len(present) == 1:
            qk, ak, mine = q, adv, None
        else:
            mine = kind == CODE[name]
            qk, ak = torch.where(mine, q, own), torch.where(mine, adv, torch.zeros_like(adv))
        if name == "cross_entropy":
            term = -logp if mine is None else -mine.to(logp.dtype) * logp
        elif name == "importance_sampling":
            term = importance_sampling(logp, qk, ak)
        elif name == "ppo":
            term = ppo(logp, qk, ak, lo, hi)
        else:
            term = cispo(logp, qk, ak, lo, hi)
        total = term if total is None else total + term
    if ref_logp is None:
        return w * total, torch.zeros_like(total)
    assert ref_logp.shape == logp.shape, (ref_logp.shape, logp.shape)
    kl = kl_k3(logp, ref_logp)
    return w * (total + kl_coef * kl), kl
