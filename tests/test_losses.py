"""The per-token losses (colora/training/losses.py): values and gradients by hand and against a plain torch loop."""

from __future__ import annotations

import math

import pytest
import torch

from colora.training import grpo
from colora.training.losses import CODE, KINDS, LossSpec, token_losses


def _run(kinds: list[str], logp: list[float], q: list[float], adv: list[float], w: list[float] | None = None,
         lo: float = 0.8, hi: float = 1.2, present=None, dtype=torch.float64):
    """token_losses over one token per entry; returns (loss, d sum(loss) / d logp)."""
    n = len(kinds)
    x = torch.tensor(logp, dtype=dtype, requires_grad=True)
    t = lambda v: torch.tensor(v, dtype=dtype)  # noqa: E731
    loss, _ = token_losses(x, t([CODE[k] for k in kinds]), t(w or [1.0] * n), t(adv), t(q), t([lo] * n),
                           t([hi] * n), present=present or tuple(dict.fromkeys(kinds)))
    (g,) = torch.autograd.grad(loss.sum(), x)
    return loss.detach(), g


def test_cross_entropy_is_minus_the_weighted_log_prob():
    loss, g = _run(["cross_entropy"] * 3, [-0.5, -2.0, -1.0], [0.0] * 3, [0.0] * 3, w=[1.0, 0.0, 2.5])
    torch.testing.assert_close(loss, torch.tensor([0.5, 0.0, 2.5], dtype=torch.float64))
    torch.testing.assert_close(g, torch.tensor([-1.0, 0.0, -2.5], dtype=torch.float64))


# ratios 1.5, 1.5, 0.5, 0.5, 1.1 (q = 0, logp = log r) with advantages +1, -1, +1, -1, +2
R, A = [1.5, 1.5, 0.5, 0.5, 1.1], [1.0, -1.0, 1.0, -1.0, 2.0]
LOGR = [math.log(r) for r in R]


def test_importance_sampling_is_minus_ratio_times_advantage():
    # -r A, and d/dlogp of -exp(logp - q) A is -r A again
    loss, g = _run(["importance_sampling"] * 5, LOGR, [0.0] * 5, A)
    want = torch.tensor([-1.5, 1.5, -0.5, 0.5, -2.2], dtype=torch.float64)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(g, want)


def test_ppo_takes_the_pessimistic_of_the_clipped_and_unclipped_ratio():
    # clip [0.8, 1.2]: r 1.5 A +1 -> -1.2 (clamped, no gradient); r 1.5 A -1 -> 1.5 (gradient 1.5);
    # r 0.5 A +1 -> -0.5 (gradient -0.5); r 0.5 A -1 -> 0.8 (clamped); r 1.1 inside: -2.2
    loss, g = _run(["ppo"] * 5, LOGR, [0.0] * 5, A)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 1.5, -0.5, 0.8, -2.2], dtype=torch.float64))
    torch.testing.assert_close(g, torch.tensor([0.0, 1.5, -0.5, 0.0, -2.2], dtype=torch.float64))
    # thresholds are the call's: [0.4, 1.6] clamps none of them
    loss, g = _run(["ppo"] * 4, LOGR[:4], [0.0] * 4, A[:4], lo=0.4, hi=1.6)
    torch.testing.assert_close(loss, torch.tensor([-1.5, 1.5, -0.5, 0.5], dtype=torch.float64))


def test_cispo_weighs_the_policy_gradient_by_the_clipped_ratio_without_its_gradient():
    # -sg(clip(r)) logp A: clip(r) = 1.2, 1.2, 0.8, 0.8, 1.1; gradient -clip(r) A
    loss, g = _run(["cispo"] * 5, LOGR, [0.0] * 5, A)
    c = [1.2, 1.2, 0.8, 0.8, 1.1]
    want = torch.tensor([-ci * lr * a for ci, lr, a in zip(c, LOGR, A)], dtype=torch.float64)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(g, torch.tensor([-ci * a for ci, a in zip(c, A)], dtype=torch.float64))


def test_stable_reinforce_is_cispo_between_zero_and_its_cap():
    """stable_reinforce reaches the trainer as cispo with lo = 0, hi = C and q the sampler's recorded log-probs
    (colora/service/records.py): per token -sg(min(r, C)) A logp. A hand batch in fp32 with C = 2: ratios 0.25
    (not raised: lo = 0), 1, 1.5, 2 (at the cap), 6 (truncated) and a prompt token (A = 0, q = 0); against the
    hand values and a plain torch reference of the formula."""
    logp = [-0.5, -1.0, -2.0, -0.1, -3.0, -4.0]
    r, adv = [0.25, 1.0, 1.5, 2.0, 6.0], [1.0, -2.0, 0.5, 1.0, -1.0, 0.0]
    q = [lp - math.log(ri) for lp, ri in zip(logp, r)] + [0.0]
    loss, g = _run(["cispo"] * 6, logp, q, adv, lo=0.0, hi=2.0, dtype=torch.float32)
    f32 = dict(dtype=torch.float32)
    torch.testing.assert_close(loss, torch.tensor([0.125, -2.0, 1.5, 0.2, -6.0, 0.0], **f32))
    torch.testing.assert_close(g, torch.tensor([-0.25, 2.0, -0.75, -2.0, 2.0, 0.0], **f32))
    x = torch.tensor(logp, requires_grad=True)
    ref = -(torch.clamp(torch.exp(x - torch.tensor(q)), max=2.0).detach() * torch.tensor(adv) * x)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g, g_ref)


def test_a_nan_sampler_log_prob_is_the_trainers_own():
    # q = NaN: r = 1 in value, so every RL loss is -A and its gradient -A (cispo: -logp A, gradient -A)
    logp = [-0.3, -2.0, -1.1]
    adv = [0.8, -1.5, 0.25]
    for kind in ("importance_sampling", "ppo"):
        loss, g = _run([kind] * 3, logp, [math.nan] * 3, adv)
        torch.testing.assert_close(loss, -torch.tensor(adv, dtype=torch.float64), rtol=0, atol=0)
        torch.testing.assert_close(g, -torch.tensor(adv, dtype=torch.float64), rtol=0, atol=0)
    loss, g = _run(["cispo"] * 3, logp, [math.nan] * 3, adv)
    torch.testing.assert_close(g, -torch.tensor(adv, dtype=torch.float64), rtol=0, atol=0)


def _reference(kind: str, logp: torch.Tensor, q: float, adv: float, w: float, lo: float, hi: float) -> torch.Tensor:
    """One token's loss, written out from Tinker's definitions (colora/service/backend.py) in scalar ops."""
    if kind == "cross_entropy":
        return -w * logp
    if math.isnan(q):
        q = logp.item()
    r = torch.exp(logp - q)
    if kind == "importance_sampling":
        return -w * r * adv
    if kind == "ppo":
        return -w * torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)
    return -w * torch.clamp(r, lo, hi).detach() * logp * adv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mixed_kinds_in_one_batch_equal_a_plain_loop_over_tokens(dtype):
    """Tokens of every kind, with and without a sampler log-prob, weights and per-token clips: each
    token's loss and gradient equal the scalar reference's, as if alone."""
    g = torch.Generator().manual_seed(0)
    n = 64
    kinds = [KINDS[i % 4] for i in range(n)]
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    q = logp + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
    q[::5] = math.nan
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    w = torch.rand(n, generator=g, dtype=torch.float64) * 2
    lo = torch.where(torch.arange(n) % 3 == 0, 0.7, 0.8).double()
    hi = torch.where(torch.arange(n) % 3 == 0, 1.3, 1.2).double()
    loss, grad = _run(kinds, logp.tolist(), q.tolist(), adv.tolist(), w.tolist(), dtype=dtype)
    # per-token clips: run again with them as tensors
    x = logp.to(dtype).requires_grad_()
    got, _ = token_losses(x, torch.tensor([CODE[k] for k in kinds], dtype=dtype), w.to(dtype), adv.to(dtype),
                          q.to(dtype), lo.to(dtype), hi.to(dtype))
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    want, want_grad = [], []
    for i, k in enumerate(kinds):
        xi = logp[i].clone().requires_grad_()
        li = _reference(k, xi, q[i].item(), adv[i].item(), w[i].item(), lo[i].item(), hi[i].item())
        (gi,) = torch.autograd.grad(li, xi)
        want.append(li.item())
        want_grad.append(gi.item())
    want, want_grad = torch.tensor(want, dtype=dtype), torch.tensor(want_grad, dtype=dtype)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {}
    torch.testing.assert_close(got.detach(), want, **tol)
    torch.testing.assert_close(got_grad, want_grad, **tol)
    # with the default clips [0.8, 1.2] everywhere the first call agrees on the tokens that had them
    same = (torch.arange(n) % 3 != 0)
    torch.testing.assert_close(loss.to(dtype)[same], want[same], **tol)
    torch.testing.assert_close(grad.to(dtype)[same], want_grad[same], **tol)
    r = torch.exp(logp - q.nan_to_num(0.0))
    assert ((r < 0.8) | (r > 1.2)).any(), "some ratio must leave the clip band for this test to mean anything"


def test_an_overflowing_ratio_of_one_kind_never_reaches_another_kinds_gradient():
    """A cispo token whose sampler log-prob is far below the trainer's has r = inf in fp32; its own
    loss clips r, so it is finite. With importance_sampling and ppo tokens in the same batch, their
    formulas must not see it (0 * inf would be a NaN gradient): the token's gradient is cispo's."""
    kinds = ["cispo", "importance_sampling", "ppo", "cross_entropy"]
    logp, q, adv = [-1.0, -1.0, -1.0, -1.0], [-200.0, -1.2, -0.9, 0.0], [0.5, 1.0, -1.0, 0.0]
    loss, g = _run(kinds, logp, q, adv, dtype=torch.float32)
    alone, g_alone = _run(["cispo"], logp[:1], q[:1], adv[:1], dtype=torch.float32)
    assert torch.isfinite(loss).all() and torch.isfinite(g).all()
    assert loss[0] == alone[0] and g[0] == g_alone[0]
    torch.testing.assert_close(g[0], torch.tensor(-1.2 * 0.5))  # clip(r) = 1.2


def test_the_native_grpo_loss_is_ppo_on_the_trainers_own_log_probs_times_its_weight():
    """colora's GRPO token loss (grpo.token_loss: on-policy ppo + k3 KL) times the sequence weight is
    token_losses' ppo with q = NaN and the KL coefficient, in value and gradient."""
    g = torch.Generator().manual_seed(1)
    n = 10
    logp = (-torch.rand(n, generator=g) * 2).requires_grad_()
    adv, w, ref = torch.randn(n, generator=g), torch.rand(n, generator=g), -torch.rand(n, generator=g) * 2
    klc = torch.tensor([0.0, 0.05] * 5)
    old, _ = grpo.token_loss(logp, logp.detach(), adv, ref, klc)
    (g_old,) = torch.autograd.grad((w * old).sum(), logp)
    full = lambda v: torch.full((n,), v)  # noqa: E731
    new, kl = token_losses(logp, full(CODE["ppo"]), w, adv, full(math.nan), full(0.8), full(1.2), ref, klc, ("ppo",))
    (g_new,) = torch.autograd.grad(new.sum(), logp)
    torch.testing.assert_close(new.detach(), (w * old).detach(), rtol=0, atol=0)
    torch.testing.assert_close(g_new, g_old, rtol=0, atol=0)
    assert (kl > 0).all()


def test_shapes_must_match():
    x = torch.zeros(3)
    with pytest.raises(AssertionError):
        token_losses(x, x, x, torch.zeros(1), x, x, x)  # one advantage would broadcast over every token
    with pytest.raises(AssertionError):
        token_losses(x, x, x, x, x, x, x, ref_logp=torch.zeros(2))


@pytest.mark.parametrize("spec, field", [
    (LossSpec("dro"), "loss.kind 'dro' is not one of cross_entropy, importance_sampling, ppo, cispo"),
    (LossSpec("ppo", clip_low=1.3, clip_high=1.2), "loss.clip_low (1.3) and loss.clip_high (1.2)"),
    (LossSpec("ppo", temperature=0.0), "loss.temperature (0.0)"),
    (LossSpec("ppo", kl_coef=-1.0), "loss.kl_coef (-1.0)"),
])
def test_a_bad_loss_spec_is_named(spec, field):
    assert field in spec.problem()
    assert LossSpec("cispo", 0.5, 2.0).problem() == ""
