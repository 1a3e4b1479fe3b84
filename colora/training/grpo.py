"""GRPO maths as pure functions: group-relative advantages, per-token loss weights, per-token loss.

One optimizer step per batch of rollouts, strictly on-policy: the "old" log-probabilities are the
trainer's own, detached (`old_logp = logp.detach()`), so the importance ratio is 1 in value and the
PPO clip never binds; the gradient is the group-baselined policy gradient. The ratio form is kept so
that the same loss serves several epochs over one batch should that ever be wanted. Three
normalisations, chosen per job:

- `grpo_seq`   (DeepSeekMath GRPO): mean over each sequence's tokens, then mean over sequences;
- `grpo_token` (DAPO's token-level): sum over all tokens of the job's step / their number;
- `dr_grpo`    (Dr. GRPO): sum over tokens / (sequences x max_new_tokens), advantages not divided by
  the group's standard deviation.

Weights are computed over a job's whole step before micro-batching, so splitting the step into
micro-batches (or sharing them with other jobs) changes only the order of floating-point sums.
"""

from __future__ import annotations

import torch

from colora.training import losses


def group_advantages(rewards: torch.Tensor, std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages.

    rewards: [groups, samples] (one group = the samples of one prompt)
    returns  [groups, samples]: (r - mean_g) / (std_g + eps), std unbiased as in TRL; r - mean_g if
    not std_normalize. A group whose rewards are all equal gets zero advantage (no signal).
    """
    assert rewards.dim() == 2 and rewards.shape[1] >= 2, rewards.shape
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not std_normalize:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + eps)


def flat_groups(rewards: torch.Tensor) -> float:
    """The share of groups whose rewards are all equal: their advantages are zero, so they give the
    policy no gradient. rewards: [groups, samples]."""
    assert rewards.dim() == 2 and rewards.shape[0] >= 1, rewards.shape
    return float((rewards.max(dim=1).values == rewards.min(dim=1).values).double().mean())


def sequence_token_weight(lengths: list[int], loss: str, max_new_tokens: int) -> list[float]:
    """Per-sequence weight applied to each of its completion tokens, for one job's whole step.

    lengths: completion tokens of each of the job's sequences this step. The job's loss is
    sum_i sum_t weight_i * loss_{i,t}.
    """
    n = len(lengths)
    assert n > 0
    if loss == "grpo_seq":
        return [1.0 / (n * max(L, 1)) for L in lengths]
    if loss == "grpo_token":
        total = max(sum(lengths), 1)
        return [1.0 / total] * n
    if loss == "dr_grpo":
        return [1.0 / (n * max_new_tokens)] * n
    raise ValueError(f"loss {loss!r} is not one of grpo_seq, grpo_token, dr_grpo")


def token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantage: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    kl_coef: torch.Tensor | float = 0.0,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GRPO loss and per-token KL: Tinker's ppo loss (colora/training/losses.py) against
    `old_logp` with the ratio clipped to [1 - clip_eps, 1 + clip_eps], plus kl_coef times the k3 KL.
    The trainer computes the same through `losses.token_losses` (ppo with q = NaN: old_logp = logp.detach()).

    logp, old_logp, advantage: [tokens] fp32 (advantage repeated over each sequence's tokens)
    ref_logp: [tokens] log-probs under the frozen base model, or None (no KL term)
    kl_coef: scalar or [tokens] (jobs differ)
    returns (loss [tokens], kl [tokens]); kl is the k3 estimator exp(ref - logp) - (ref - logp) - 1,
    unbiased and non-negative (Schulman's approximation, as in GRPO).
    """
    assert logp.shape == old_logp.shape == advantage.shape, (logp.shape, old_logp.shape, advantage.shape)
    pg = losses.ppo(logp, old_logp, advantage, 1 - clip_eps, 1 + clip_eps)
    if ref_logp is None:
        return pg, torch.zeros_like(pg)
    assert ref_logp.shape == logp.shape
    kl = losses.kl_k3(logp, ref_logp)
    return pg + kl_coef * kl, kl
