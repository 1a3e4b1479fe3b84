"""colora.training.grpo against hand-computed values: advantages, the three losses' weights, the k3 KL, the clip.

Every expected number is worked out in the comment beside it; the tensors are small enough to check
by hand. The trainer's fidelity tests (tests/test_trainer.py) compare shared and solo steps with
each other, so only these tests pin the maths itself.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from colora.training.grpo import group_advantages, sequence_token_weight, token_loss

# -- group-relative advantages ------------------------------------------------------------------
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0],   # mean 0.5, centred +-0.5, unbiased var (4 * 0.25) / 3 = 1/3
                        [2.0, 2.0, 2.0, 2.0],   # all equal: no signal
                        [0.0, 0.0, 0.0, 3.0]],  # mean 0.75, centred -0.75 x3 and 2.25, var (3*0.5625 + 5.0625)/3 = 2.25
                       dtype=torch.float64)


def test_advantages_divide_by_the_unbiased_std_plus_eps():
    adv = group_advantages(REWARDS)
    s1 = math.sqrt(1 / 3) + 1e-6  # std of group 0, plus eps
    want = torch.tensor([[0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1],  # +-0.8660...
                         [0.0, 0.0, 0.0, 0.0],                         # 0 / (0 + eps): zero, not NaN
                         [-0.75 / 1.500001] * 3 + [2.25 / 1.500001]],  # -0.5 x3, 1.5 (std 1.5)
                        dtype=torch.float64)
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=0)
    # two samples tell the unbiased std (sqrt(0.5)) from the biased one (0.5): +-0.7071, not +-1
    torch.testing.assert_close(group_advantages(torch.tensor([[0.0, 1.0]])),
                               torch.tensor([[-0.5, 0.5]]) / (math.sqrt(0.5) + 1e-6))


def test_eps_is_added_to_the_std_not_under_the_root():
    # group 2: centred -0.75 x3, 2.25 over std 1.5 + eps 0.5 = 2: -0.375 x3, 1.125
    # (eps under the root would divide by sqrt(2.25 + 0.5) = 1.658)
    adv = group_advantages(REWARDS[2:], eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.375, -0.375, -0.375, 1.125]], dtype=torch.float64))


def test_advantages_without_std_normalisation_are_centred_rewards():
    adv = group_advantages(REWARDS, std_normalize=False)
    want = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-0.75, -0.75, -0.75, 2.25]], dtype=torch.float64)
    torch.testing.assert_close(adv, want, rtol=0, atol=0)


def test_advantages_refuse_a_group_of_one():
    with pytest.raises(AssertionError):
        group_advantages(torch.tensor([[1.0], [0.0]]))  # [groups, 1]: no baseline
    with pytest.raises(AssertionError):
        group_advantages(torch.tensor([1.0, 0.0]))  # 1-d: which samples form a group is unknown


def test_a_dr_grpo_job_is_not_std_normalised_and_the_others_are():
    """A job's step is scored with centred rewards only for dr_grpo (Dr. GRPO drops the division by
    the group's std), and with the std-normalised advantage for grpo_seq / grpo_token jobs."""
    from colora.config import load_config, resolve
    from colora.corun.rollouts import score
    from colora.engine.rollout import GenRequest, GenResult

    d = load_config(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml").to_dict()
    d["jobs"] = [{**d["jobs"][0], "name": loss, "loss": loss, "prompts_per_step": 1, "samples_per_prompt": 4}
                 for loss in ("grpo_seq", "grpo_token", "dr_grpo")]
    cfg = resolve(d)
    rewards = [0.0, 0.0, 0.0, 1.0]  # centred -0.25 x3, 0.75; std 0.5 (rewards in [0, 1]: the task contract)
    task = SimpleNamespace(reward=lambda text, item: float(text))
    items = [SimpleNamespace(id=0)]
    jobs = {j.name: j for j in cfg.jobs}
    for name, want in (("grpo_seq", [-0.5, -0.5, -0.5, 1.5]), ("grpo_token", [-0.5, -0.5, -0.5, 1.5]),
                       ("dr_grpo", [-0.25, -0.25, -0.25, 0.75])):
        results = [GenResult(GenRequest(name, (1, 2), 4, 1.0, tag=(0, s)), 0, [3], [-0.1], str(r), "stop")
                   for s, r in enumerate(rewards)]
        got = [r.advantage for r in score(task, jobs[name], items, results)]
        assert got == pytest.approx(want, rel=1e-5), name


# -- per-token weights of the three losses ------------------------------------------------------
LENGTHS = [2, 4, 0]  # completion tokens of a job's three sequences this step; the empty one counts as 1 token


def test_grpo_seq_weights_are_one_over_sequences_times_length():
    # 1 / (3 * 2), 1 / (3 * 4), 1 / (3 * max(0, 1))
    assert sequence_token_weight(LENGTHS, "grpo_seq", 8) == pytest.approx([1 / 6, 1 / 12, 1 / 3], rel=1e-15)


def test_grpo_token_weights_are_one_over_the_steps_tokens():
    assert sequence_token_weight(LENGTHS, "grpo_token", 8) == pytest.approx([1 / 6] * 3, rel=1e-15)  # 2 + 4 + 0
    assert sequence_token_weight([0, 0], "grpo_token", 8) == [1.0, 1.0]  # no tokens: 1 / max(0, 1)


def test_dr_grpo_weights_are_one_over_sequences_times_max_new_tokens():
    # 1 / (3 * 8), whatever the lengths: Dr. GRPO's constant normaliser
    assert sequence_token_weight(LENGTHS, "dr_grpo", 8) == pytest.approx([1 / 24] * 3, rel=1e-15)
    assert sequence_token_weight([7], "dr_grpo", 16) == [1 / 16]


@pytest.mark.parametrize("loss, want", [
    ("grpo_seq", 2.5),          # mean of sequence means: ((1 + 3) / 2 + (2 + 2 + 2 + 6) / 4) / 2 = (2 + 3) / 2
    ("grpo_token", 16 / 6),     # all tokens' mean: (4 + 12) / 6
    ("dr_grpo", 1.0),           # sum over (sequences x max_new_tokens): 16 / (2 * 8)
])
def test_a_jobs_loss_is_the_weighted_sum_of_its_token_losses(loss, want):
    per_seq = [torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0, 2.0, 6.0])]
    w = sequence_token_weight([len(t) for t in per_seq], loss, max_new_tokens=8)
    got = sum(wi * t.sum().item() for wi, t in zip(w, per_seq))
    assert got == pytest.approx(want, rel=1e-12)


def test_an_unknown_loss_is_named_with_the_accepted_ones():
    with pytest.raises(ValueError, match="loss 'ppo' is not one of grpo_seq, grpo_token, dr_grpo"):
        sequence_token_weight([1], "ppo", 8)


# -- the per-token loss: ratio clip and k3 KL ---------------------------------------------------
def _loss_and_grad(ratio: list[float], adv: list[float], **kw):
    """token_loss at logp = log(ratio) against old_logp = 0, and d loss / d logp."""
    logp = torch.tensor([math.log(r) for r in ratio], dtype=torch.float64, requires_grad=True)
    loss, kl = token_loss(logp, torch.zeros_like(logp), torch.tensor(adv, dtype=torch.float64), **kw)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    return loss.detach(), kl.detach(), g


def test_on_policy_the_loss_is_minus_the_advantage_and_so_is_its_gradient():
    # ratio 1: -min(1 * A, clamp(1) * A) = -A; d/dlogp (-exp(logp - old) * A) = -A at logp = old
    logp = torch.tensor([-0.3, -2.0, -1.1], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([0.8, -1.5, 0.0], dtype=torch.float64)
    loss, kl = token_loss(logp, logp.detach(), adv)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(loss.detach(), -adv, rtol=0, atol=0)
    torch.testing.assert_close(g, -adv, rtol=0, atol=0)
    assert torch.equal(kl, torch.zeros(3, dtype=torch.float64))  # no reference: no KL


def test_the_ratio_is_clipped_to_one_plus_minus_eps_where_it_would_gain():
    # clip_eps 0.2, so the ratio is clamped to [0.8, 1.2]; the loss is -min(r A, clamp(r) A):
    #   r 1.5, A +1: -min(1.5, 1.2)  = -1.2, the clamped branch: no gradient
    #   r 1.5, A -1: -min(-1.5, -1.2) = 1.5, the unclamped branch: gradient -r A = 1.5
    #   r 0.5, A +1: -min(0.5, 0.8)  = -0.5, unclamped: gradient -0.5
    #   r 0.5, A -1: -min(-0.5, -0.8) = 0.8, clamped: no gradient
    #   r 1.1, A +2: inside the band: -2.2, gradient -2.2
    loss, _, g = _loss_and_grad([1.5, 1.5, 0.5, 0.5, 1.1], [1.0, -1.0, 1.0, -1.0, 2.0])
    torch.testing.assert_close(loss, torch.tensor([-1.2, 1.5, -0.5, 0.8, -2.2], dtype=torch.float64))
    torch.testing.assert_close(g, torch.tensor([0.0, 1.5, -0.5, 0.0, -2.2], dtype=torch.float64))
    # a wider band (clip_eps 0.6: [0.4, 1.6]) clamps none of them: loss -r A throughout
    loss, _, g = _loss_and_grad([1.5, 1.5, 0.5, 0.5], [1.0, -1.0, 1.0, -1.0], clip_eps=0.6)
    torch.testing.assert_close(loss, torch.tensor([-1.5, 1.5, -0.5, 0.5], dtype=torch.float64))
    torch.testing.assert_close(g, torch.tensor([-1.5, 1.5, -0.5, 0.5], dtype=torch.float64))


def test_the_kl_is_k3_and_enters_the_loss_with_its_coefficient():
    # d = ref - logp; k3 = exp(d) - d - 1:
    #   d = log 2: 2 - 0.693147 - 1 = 0.306853;  d = 0: 0;  d = -1: e^-1 + 1 - 1 = 0.367879
    # d k3 / d logp = 1 - exp(d): -1, 0, 1 - e^-1 = 0.632121
    logp = torch.tensor([-2.0, -1.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0 + math.log(2.0), -1.0, -1.5], dtype=torch.float64)
    adv = torch.tensor([0.5, 0.0, -1.0], dtype=torch.float64)
    loss, kl = token_loss(logp, logp.detach(), adv, ref, kl_coef=0.1)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    k3 = torch.tensor([1 - math.log(2.0), 0.0, math.exp(-1.0)], dtype=torch.float64)
    torch.testing.assert_close(kl.detach(), k3)
    torch.testing.assert_close(loss.detach(), -adv + 0.1 * k3)  # on policy: -A + beta k3
    torch.testing.assert_close(g, -adv + 0.1 * torch.tensor([-1.0, 0.0, 1 - math.exp(-1.0)], dtype=torch.float64))
    assert (kl >= 0).all()


def test_a_per_token_kl_coefficient_weighs_each_token_alone():
    # the same token (d = -1, k3 = e^-1) under coefficients 0, 0.1 and 1 (three jobs in one batch)
    logp = torch.full((3,), -0.5, dtype=torch.float64)
    ref = torch.full((3,), -1.5, dtype=torch.float64)
    coef = torch.tensor([0.0, 0.1, 1.0], dtype=torch.float64)
    loss, kl = token_loss(logp, logp, torch.zeros(3, dtype=torch.float64), ref, kl_coef=coef)
    torch.testing.assert_close(loss, coef * math.exp(-1.0))


def test_token_loss_refuses_mismatched_shapes():
    x = torch.zeros(3)
    with pytest.raises(AssertionError):
        token_loss(x, x, torch.zeros(1))  # one advantage would broadcast over every token
    with pytest.raises(AssertionError):
        token_loss(x, x, x, ref_logp=torch.zeros(2))
