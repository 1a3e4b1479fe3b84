"""The fake backend (colora/service/fake.py) computes the Tinker losses as specified, so the protocol tests
exercise real numbers: log-probs, gradients that follow the loss, AdamW steps, frozen snapshots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colora.service.backend import (
    AdamParams,
    BackendError,
    Datum,
    ForwardCall,
    LoraSpec,
    OptimCall,
    SampleCall,
    Stop,
)
from colora.service.fake import FakeBackend

TOKENS = np.array([1, 5, 7, 2, 9], np.int64)
TARGETS = np.array([5, 7, 2, 9, 3], np.int64)


def backend(*models: str) -> FakeBackend:
    b = FakeBackend("fake", vocab_size=16, eos_token_id=0)
    for m in models:
        b.create_model(m, LoraSpec(rank=4, seed=1))
    return b


def call(model, loss, forward_only=False, config=None, **inputs):
    return ForwardCall(model, 1, (Datum(TOKENS, {"target_tokens": TARGETS, **inputs}),), loss, config or {}, forward_only)


def grads(b: FakeBackend, model: str) -> list[torch.Tensor]:
    m = b._models[model]
    return [m.A.grad.clone(), m.B.grad.clone()]


def test_a_new_model_is_the_base_and_cross_entropy_is_minus_the_weighted_logprob_sum():
    b = backend("m")
    w = np.array([0, 1, 1, 0.5, 2], np.float32)
    (res,), _ = b.train_cycle([call("m", "cross_entropy", True, weights=w)], [])
    lp = res.outputs[0]["logprobs"]
    ref = torch.log_softmax(b._base[torch.from_numpy(TOKENS)], -1)[range(5), torch.from_numpy(TARGETS)].numpy()
    np.testing.assert_allclose(lp, ref, atol=1e-6)
    assert res.metrics["loss:sum"] == pytest.approx(-(w * lp).sum(), abs=1e-5)


def test_importance_sampling_on_its_own_logprobs_has_the_gradient_of_weighted_cross_entropy():
    b = backend("is", "ce")
    adv = np.array([1.0, -0.5, 2.0, 0.0, 0.25], np.float32)
    own = b.train_cycle([call("is", "cross_entropy", True, weights=adv)], [])[0][0].outputs[0]["logprobs"]
    b.train_cycle([call("is", "importance_sampling", logprobs=own, advantages=adv),
                   call("ce", "cross_entropy", weights=adv)], [])
    for g_is, g_ce in zip(grads(b, "is"), grads(b, "ce")):
        torch.testing.assert_close(g_is, g_ce, atol=1e-5, rtol=1e-4)


def test_ppo_clips_a_ratio_above_its_threshold_and_cispo_stops_its_gradient():
    b = backend("m")
    own = b.train_cycle([call("m", "cross_entropy", True, weights=np.ones(5, np.float32))], [])[0][0].outputs[0]["logprobs"]
    adv = np.ones(5, np.float32)
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    (res,), _ = b.train_cycle([call("m", "ppo", config=cfg, logprobs=own - 1.0, advantages=adv)], [])  # r = e > 1.2
    assert res.metrics["loss:sum"] == pytest.approx(-1.2 * 5, abs=1e-4)
    assert all(float(g.abs().max()) == 0 for g in grads(b, "m"))  # min() picked the clipped, constant term
    (res,), _ = b.train_cycle([call("m", "cispo", True, config=cfg, logprobs=own - 1.0, advantages=adv)], [])
    assert res.metrics["loss:sum"] == pytest.approx(-1.2 * own.sum(), rel=1e-5)


def test_optim_step_is_adamw_with_the_steps_settings_and_clips_the_models_own_norm():
    b = backend("m")
    w = np.ones(5, np.float32)
    b.train_cycle([call("m", "cross_entropy", weights=w)], [])
    m = b._models["m"]
    A, B = m.A.detach().clone().requires_grad_(), m.B.detach().clone().requires_grad_()
    A.grad, B.grad = m.A.grad.clone(), m.B.grad.clone()
    norm = float(torch.cat([A.grad.flatten(), B.grad.flatten()]).norm())
    p = AdamParams(learning_rate=0.01, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=norm / 2)
    torch.nn.utils.clip_grad_norm_([A, B], p.grad_clip_norm)
    torch.optim.AdamW([A, B], lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay).step()
    _, (metrics,) = b.train_cycle([], [OptimCall("m", 2, p)])
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    torch.testing.assert_close(m.A.detach(), A.detach())
    torch.testing.assert_close(m.B.detach(), B.detach())
    assert float(m.B.grad.abs().max()) == 0  # the step cleared the accumulated gradient


def test_a_snapshot_samples_its_own_weights_after_later_steps_and_a_seed_repeats(tmp_path):
    b = backend("m")
    w = np.ones(5, np.float32)
    for _ in range(2):
        b.train_cycle([call("m", "cross_entropy", weights=w)], [OptimCall("m", 2, AdamParams(learning_rate=0.5))])
    snap = b.save_for_sampler("m", tmp_path)
    sc = SampleCall(snap, TOKENS, num_samples=2, max_tokens=8, seed=3, stop=Stop(eos=False))
    got = []
    got.append(b._sample(sc))
    b.train_cycle([call("m", "cross_entropy", weights=w)], [OptimCall("m", 3, AdamParams(learning_rate=0.5))])
    got.append(b._sample(sc))
    got.append(b._sample(SampleCall(b.load_sampler(tmp_path), TOKENS, 2, 8, seed=3, stop=Stop(eos=False))))
    toks = [[s.tokens.tolist() for s in r.sequences] for r in got]
    assert toks[0] == toks[1] == toks[2] and all(len(t) == 8 for t in toks[0])
    assert b.live_samplers == 2
    b.release_sampler(snap)
    assert b.live_samplers == 1


def test_loading_a_checkpoint_of_another_rank_is_the_clients_error(tmp_path):
    b = backend("m")
    b.save_state("m", tmp_path)
    b.create_model("r8", LoraSpec(rank=8, seed=0))
    with pytest.raises(BackendError, match="rank 4") as e:
        b.load_state("r8", tmp_path, optimizer=False)
    assert e.value.category == "user"
