"""The job contract on the CPU in fp32: a shared step equals each job's solo step; on-policy only."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from same_step import assert_same_adamw_state
from transformers import AutoConfig

from colora.config import JobConfig, TrainerConfig
from colora.models.base import load_base_model
from colora.training.batches import Datum, Row
from colora.training.grpo import group_advantages
from colora.training.losses import LossSpec
from colora.training.lora import AdapterBank, inject_lora
from colora.training.trainer import ForwardBackwardCall, MultiJobTrainer, Rollout, StaleRolloutError

JOB_A = JobConfig(name="a", task="addition", lora_rank=4, lora_alpha=8.0, learning_rate=1e-3,
                  target_modules=("q_proj", "v_proj", "down_proj"), grad_clip=1e-3, loss="grpo_seq",
                  prompts_per_step=3, samples_per_prompt=4, max_new_tokens=12)
JOB_B = JobConfig(name="b", task="addition", lora_rank=8, lora_alpha=8.0, learning_rate=5e-4, weight_decay=0.01,
                  grad_clip=100.0, loss="grpo_token", kl_coef=0.05, temperature=0.7,
                  prompts_per_step=2, samples_per_prompt=3, max_new_tokens=12)


def make_trainer(model_dir, jobs, micro_batch_tokens, device="cpu", dtype="float32", packed_rows=None):
    model = load_base_model(model_dir, getattr(torch, dtype), device)
    bank = AdapterBank(device, "torch")
    inject_lora(model, bank)
    for j in jobs:
        bank.add_job(j.name, j.lora_rank, j.lora_alpha, j.target_modules, 7, j.learning_rate, j.weight_decay)
    cfg = TrainerConfig(micro_batch_tokens=micro_batch_tokens, lora_backend="torch", logprob_backend="torch",
                        logprob_chunk=5)
    return MultiJobTrainer(model, bank, cfg, {j.name: j for j in jobs}, pad_id=0, packed_rows=packed_rows), bank, model


def fixed_rollouts(job: JobConfig, step: int, vocab: int) -> list[Rollout]:
    """Deterministic synthetic rollouts (prompts, completions of varied lengths, rewards)."""
    g = torch.Generator().manual_seed(1000 * step + len(job.name) + job.lora_rank)
    P, S = job.prompts_per_step, job.samples_per_prompt
    rewards = torch.randint(0, 2, (P, S), generator=g).double()
    rewards[0, 0], rewards[0, 1] = 1.0, 0.0  # at least one group with signal
    adv = group_advantages(rewards)
    out = []
    for p in range(P):
        prompt = torch.randint(3, vocab, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        for s in range(S):
            n = int(torch.randint(1, job.max_new_tokens + 1, (1,), generator=g))
            comp = torch.randint(3, vocab, (n,), generator=g).tolist()
            lps = (-torch.rand(n, generator=g) * 3).tolist()
            out.append(Rollout(job.name, step, prompt, comp, lps, p, float(rewards[p, s]), float(adv[p, s])))
    return out


def params_of(bank, name):
    job = bank.jobs[name]
    return {k: (job.A[k].detach().clone(), job.B[k].detach().clone()) for k in job.A}


def _states(bank, names) -> dict:
    """Each job's AdamW state dict, for `assert_same_adamw_state`."""
    return {j: bank.jobs[j].optimizer.state_dict() for j in names}


def test_shared_step_equals_solo_steps(tiny_model_dir):
    vocab = 500
    shared, bank_ab, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=80)
    solo_a, bank_a, _ = make_trainer(tiny_model_dir, [JOB_A], micro_batch_tokens=200)
    solo_b, bank_b, _ = make_trainer(tiny_model_dir, [JOB_B], micro_batch_tokens=64)
    start = params_of(bank_ab, "a")
    clip_a, clip_b = [], []
    for step in range(3):
        ra, rb = fixed_rollouts(JOB_A, step, vocab), fixed_rollouts(JOB_B, step, vocab)
        st = shared.step({"a": ra, "b": rb})
        sa = solo_a.step({"a": ra})["a"]
        sb = solo_b.step({"b": rb})["b"]
        clip_a.append(st["a"].clip_coef)
        clip_b.append(st["b"].clip_coef)
        for x, y in ((st["a"], sa), (st["b"], sb)):
            assert x.loss == pytest.approx(y.loss, rel=1e-5, abs=1e-7)
            assert x.grad_norm == pytest.approx(y.grad_norm, rel=1e-5)
        if step == 0:  # the moments of one step are the gradient itself: equal to summation order
            for name, solo_bank in (("a", bank_a), ("b", bank_b)):
                assert_same_adamw_state(bank_ab.jobs[name].optimizer.state_dict(),
                                        solo_bank.jobs[name].optimizer.state_dict())
    assert max(clip_a) < 1.0, "job a's clipping must be active for this test to mean anything"
    assert min(clip_b) == 1.0, "job b's clipping must stay inactive"
    assert st["b"].kl > 0  # the KL term ran for b
    for name, solo_bank in (("a", bank_a), ("b", bank_b)):
        got, want = params_of(bank_ab, name), params_of(solo_bank, name)
        assert got.keys() == want.keys()
        diff = max(max((got[k][0] - want[k][0]).abs().max().item(), (got[k][1] - want[k][1]).abs().max().item())
                   for k in got)
        assert diff <= 1e-5, f"job {name}: shared and solo adapters differ by {diff}"
        assert bank_ab.jobs[name].version == 3
    moved = max((params_of(bank_ab, "a")[k][1] - start[k][1]).abs().max().item() for k in start)
    assert moved > 0, "training did not change job a's adapter"
    # Same optimizer state after three steps too: step counts and moments. Looser than after one: AdamW's
    # first update is about lr * g / (|g| + eps), so where a gradient element is near eps the summation
    # order's noise moves the adapter, and the next steps' gradients with it (job b's moments came out
    # 4e-5 of their largest apart on an AVX-512 machine, 1e-6 after one step).
    for name, solo_bank in (("a", bank_a), ("b", bank_b)):
        want = solo_bank.jobs[name].optimizer.state_dict()
        assert all(float(s["step"]) == 3 for s in want["state"].values())
        assert_same_adamw_state(bank_ab.jobs[name].optimizer.state_dict(), want, rel=1e-4)


@pytest.mark.parametrize("loss", ["grpo_seq", "grpo_token", "dr_grpo"])
def test_each_loss_weighs_its_jobs_tokens_as_it_says(tiny_model_dir, loss):
    """On policy and without KL every token's loss is -A (tests/test_grpo.py), so the step's loss
    is -sum_i w_i L_i A_i: -(1/n) sum_i A_i for grpo_seq, -sum_i L_i A_i / N for grpo_token and
    -sum_i L_i A_i / (n M) for dr_grpo (n sequences of L_i tokens, N = sum L_i, M max_new_tokens).
    dr_grpo's gradient is grpo_token's times N / (n M): the same tokens under another constant."""
    job = dataclasses.replace(JOB_B, name="c", loss=loss, kl_coef=0.0, grad_clip=0.0)
    # advantages off-centre, so that no normalisation's sum cancels
    rs = [dataclasses.replace(r, advantage=r.advantage + 0.3) for r in fixed_rollouts(job, 0, 500)]
    A = np.array([r.advantage for r in rs])
    L = np.array([len(r.completion_ids) for r in rs])
    n, N, M = len(rs), L.sum(), job.max_new_tokens
    assert len(set(L)) > 1 and N < n * M  # lengths differ, so the three normalisations do too
    want = {"grpo_seq": -A.mean(), "grpo_token": -(L * A).sum() / N, "dr_grpo": -(L * A).sum() / (n * M)}
    st = {}
    for name in ("grpo_token", "dr_grpo") if loss == "dr_grpo" else (loss,):
        trainer, bank, _ = make_trainer(tiny_model_dir, [dataclasses.replace(job, loss=name)], micro_batch_tokens=64)
        st[name] = (trainer.step({"c": rs})["c"], bank.jobs["c"].optimizer.state_dict()["state"])
    got, state = st[loss]
    assert got.loss == pytest.approx(want[loss], rel=1e-5)
    if loss == "dr_grpo":
        ref, ref_state = st["grpo_token"]
        c = N / (n * M)
        assert got.grad_norm == pytest.approx(c * ref.grad_norm, rel=1e-5)
        for i in state:
            scale = ref_state[i]["exp_avg"].abs().max().item()
            assert (state[i]["exp_avg"] - c * ref_state[i]["exp_avg"]).abs().max().item() <= 1e-5 * c * scale


def test_stale_rollout_is_refused(tiny_model_dir):
    trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A], micro_batch_tokens=256)
    r0 = fixed_rollouts(JOB_A, 0, 500)
    trainer.step({"a": r0})
    before = params_of(bank, "a")
    with pytest.raises(StaleRolloutError, match="version 0.*current version is 1"):
        trainer.step({"a": r0})  # sampled from v0, the job is at v1
    after = params_of(bank, "a")
    assert all(torch.equal(before[k][1], after[k][1]) for k in before), "a refused step must change nothing"
    assert bank.jobs["a"].version == 1


def test_base_weights_never_change(tiny_model_dir):
    trainer, bank, model = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=128)
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    trainer.step({"a": fixed_rollouts(JOB_A, 0, 500), "b": fixed_rollouts(JOB_B, 0, 500)})
    now = model.state_dict()
    assert all(torch.equal(base[k], now[k]) for k in base)
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_step_builds_no_kv_cache(tiny_model_dir, monkeypatch, packed):
    """The trainer's forwards (the policy's and the KL reference's) ask transformers for no KV cache:
    its default builds one in training too, concatenating every layer's K and V into it (and leaving
    them strided for the attention, a copy each: ~100 ms of the H200's 8-job step)."""
    from transformers import cache_utils

    updates = []
    for cls in (cache_utils.DynamicLayer, cache_utils.DynamicCache):
        real = cls.update
        monkeypatch.setattr(cls, "update", lambda self, *a, real=real, **k: updates.append(1) or real(self, *a, **k))
    trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=128, packed_rows=packed)
    assert trainer.packed == packed
    st = trainer.step({"a": fixed_rollouts(JOB_A, 0, 500), "b": fixed_rollouts(JOB_B, 0, 500)})  # b has a KL term
    assert st["a"].failure == st["b"].failure == "" and updates == []
    packed_kw = {"cu_seq_lens_q": torch.tensor([0, 3]), "max_length_q": 3} if packed else {}
    trainer.body(input_ids=torch.tensor([[5, 6, 7]]), **packed_kw)  # the model's default: a cache (the probe sees it)
    assert updates


def test_nonfinite_job_is_not_stepped_and_others_are(tiny_model_dir):
    trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=128)
    solo, bank_b, _ = make_trainer(tiny_model_dir, [JOB_B], micro_batch_tokens=128)
    ra = fixed_rollouts(JOB_A, 0, 500)
    ra = [dataclasses.replace(r, advantage=float("nan")) for r in ra]
    rb = fixed_rollouts(JOB_B, 0, 500)
    a_before = params_of(bank, "a")
    st = trainer.step({"a": ra, "b": rb})
    alone = solo.step({"b": rb})["b"]
    assert "not finite" in st["a"].failure and bank.jobs["a"].version == 0
    assert not bank.jobs["a"].optimizer.state_dict()["state"], "the failed job's optimizer must not have stepped"
    assert all(torch.equal(a_before[k][i], params_of(bank, "a")[k][i]) for k in a_before for i in (0, 1))
    assert st["b"].failure == "" and bank.jobs["b"].version == 1
    # the healthy job took its solo step: the same loss, gradient norm and AdamW moments (its weights
    # after one AdamW step alone would hide a gradient error: see tests/same_step.py)
    assert st["b"].loss == pytest.approx(alone.loss, rel=1e-6)
    assert st["b"].grad_norm == pytest.approx(alone.grad_norm, rel=1e-6)
    assert_same_adamw_state(bank.jobs["b"].optimizer.state_dict(), bank_b.jobs["b"].optimizer.state_dict())
    got, want = params_of(bank, "b"), params_of(bank_b, "b")
    # weights within 1% of one AdamW step (about lr an element): lr * g / (sqrt(g^2) + eps) of a
    # gradient near 0 moves with fp32 sums in another order (1.3e-6 measured, lr 5e-4)
    assert max((got[k][1] - want[k][1]).abs().max().item() for k in got) <= 0.01 * JOB_B.learning_rate


def test_diverged_adapter_is_stopped_before_export(tiny_model_dir):
    big = dataclasses.replace(JOB_A, learning_rate=1e30, grad_clip=0.0)
    trainer, bank, _ = make_trainer(tiny_model_dir, [big, JOB_B], micro_batch_tokens=128)
    st = trainer.step({"a": fixed_rollouts(big, 0, 500), "b": fixed_rollouts(JOB_B, 0, 500)})
    assert "diverged" in st["a"].failure and bank.jobs["a"].version == 0
    assert st["b"].failure == "" and bank.jobs["b"].version == 1


def test_triton_kernels_give_the_reference_step(tiny_model_dir):
    """The trainer through the Triton kernels (on the GPU, or the interpreter on the CPU) takes the
    same step as through the torch reference, shared batch and all: the seam the GPU path uses.
    fp32 throughout (Triton's fp32 dot on a GPU is tf32: the tolerances below allow for it)."""
    import os

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter or a GPU")
    tol = 1e-4 if device == "cpu" else 2e-3
    results = []
    for backend in ("torch", "triton"):
        trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=96, device=device)
        trainer.cfg = dataclasses.replace(trainer.cfg, logprob_backend=backend)
        bank.lora_backend = backend
        st = trainer.step({"a": fixed_rollouts(JOB_A, 0, 500), "b": fixed_rollouts(JOB_B, 0, 500)})
        results.append((st, params_of(bank, "a"), params_of(bank, "b"), _states(bank, ("a", "b"))))
    (s_ref, a_ref, b_ref, o_ref), (s_tri, a_tri, b_tri, o_tri) = results
    for j in ("a", "b"):
        assert s_tri[j].loss == pytest.approx(s_ref[j].loss, rel=tol, abs=1e-6)
        assert s_tri[j].grad_norm == pytest.approx(s_ref[j].grad_norm, rel=tol)
        if device == "cpu":  # the gradients themselves, elementwise (tf32's on the GPU: not measured)
            assert_same_adamw_state(o_tri[j], o_ref[j], rel=tol)
    if device == "cpu":  # after one Adam step; tf32 noise on the GPU can flip the sign of tiny gradients
        for got, want in ((a_tri, a_ref), (b_tri, b_ref)):
            assert max((got[k][1] - want[k][1]).abs().max().item() for k in want) <= 1e-5


@pytest.mark.parametrize("packed", [False, True])
def test_bf16_step_computes_on_copies_and_accumulates_fp32_gradients(tiny_model_dir, packed):
    """In bf16 the trainer's LoRA calls compute on bf16 copies made once per step and write the
    gradients in fp32 straight into the step's fp32 leaves. Against casting the fp32 adapters to bf16
    in every micro-batch (the autograd cast, whose gradients come back rounded to bf16): the same
    forward to the bit (same bf16 values), so the same loss, and the same update up to that rounding."""
    import os

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter or a GPU")
    full = dataclasses.replace(JOB_B, name="c", lora_rank=4)  # adapts every projection: packs apply
    results, copies_seen = [], []
    for copies in (True, False):
        trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_B, full], micro_batch_tokens=96, device=device,
                                        dtype="bfloat16")
        trainer.cfg = dataclasses.replace(trainer.cfg, logprob_backend="triton")
        bank.lora_backend, bank.pack_projections = "triton", packed
        orig = bank.stacked

        def stacked(path, dtype, orig=orig, copies=copies):
            if not copies:  # the fp32 leaves, no copies: the per-micro-batch autograd cast instead
                st = orig(path, torch.float32)
                return None if st is None else (st[0].to(dtype), st[1].to(dtype), st[2], None)
            st = orig(path, dtype)
            if st is not None:
                copies_seen.append(st[3] is not None)
            return st

        bank.stacked = stacked
        ro = {j.name: fixed_rollouts(j, 0, 500) for j in (JOB_B, full)}
        assert len(trainer._micro_batches(trainer._sequences(ro), ("b", "c"))) > 1
        before = {j: params_of(bank, j) for j in ("b", "c")}
        st = trainer.step(ro)
        after = {j: params_of(bank, j) for j in ("b", "c")}
        upd = torch.cat([(after[j][k][i] - before[j][k][i]).flatten() for j in after for k in after[j] for i in (0, 1)])
        results.append((st, upd))
        assert all(p.dtype == torch.float32 for j in ("b", "c") for p in bank.jobs[j].parameters())
    assert copies_seen and all(copies_seen)
    (s0, u0), (s1, u1) = results
    for j in ("b", "c"):
        assert s0[j].loss == s1[j].loss
        assert s0[j].grad_norm == pytest.approx(s1[j].grad_norm, rel=2e-2)
    assert torch.nn.functional.cosine_similarity(u0, u1, dim=0) >= 0.98


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_projections_take_the_same_step(tiny_model_dir, backend, monkeypatch):
    """q/k/v and gate/up in one grouped call each give the unpacked step; a job that adapts only
    some of a pack's projections (JOB_A: q and v) makes that pack fall back to separate calls."""
    import os

    import colora.kernels as ck

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter or a GPU")
    full = dataclasses.replace(JOB_B, name="c", lora_rank=4)  # adapts every projection
    packed_calls = []
    real = ck.grouped_lora_packed
    monkeypatch.setattr(ck, "grouped_lora_packed", lambda x, As, *a, **k: packed_calls.append(len(As)) or real(x, As, *a, **k))
    results = []
    for packed in (False, True):
        trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B, full], micro_batch_tokens=128, device=device)
        trainer.cfg = dataclasses.replace(trainer.cfg, logprob_backend=backend)
        bank.lora_backend, bank.pack_projections = backend, packed
        st = trainer.step({j.name: fixed_rollouts(j, 0, 500) for j in (JOB_A, JOB_B, full)})
        results.append((st, {j: params_of(bank, j) for j in ("a", "b", "c")}, _states(bank, ("a", "b", "c"))))
    n_layers = AutoConfig.from_pretrained(tiny_model_dir).num_hidden_layers
    # gate/up packed in every layer of every micro-batch's forward; q/k/v fell back (a has no k)
    assert packed_calls and set(packed_calls) == {2} and len(packed_calls) % n_layers == 0
    (s0, p0, o0), (s1, p1, o1) = results
    for j in ("a", "b", "c"):
        assert s1[j].loss == pytest.approx(s0[j].loss, rel=1e-4, abs=1e-7)
        assert s1[j].grad_norm == pytest.approx(s0[j].grad_norm, rel=1e-4)
        if device == "cpu":  # the gradients elementwise (tf32's tolerance on the GPU: not measured)
            assert_same_adamw_state(o1[j], o0[j], rel=1e-4)
        assert max((p1[j][k][1] - p0[j][k][1]).abs().max().item() for k in p0[j]) <= 1e-5


def test_base_inside_the_lora_op_takes_the_same_step(tiny_model_dir, monkeypatch):
    """On the Triton path every adapted projection's base product runs inside the grouped-LoRA op
    (packed and not: JOB_A's q/v fall back to separate calls) and gives the step of the torch path's
    base linears beside it; a projection no active job adapts keeps its linear."""
    import os

    import colora.kernels as ck

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter or a GPU")
    full = dataclasses.replace(JOB_B, name="c", lora_rank=4)
    based = []
    for name in ("grouped_lora", "grouped_lora_packed"):
        real = getattr(ck, name)
        monkeypatch.setattr(ck, name, lambda *a, real=real, **k: based.append("base" in k) or real(*a, **k))
    results = []
    for backend in ("torch", "triton"):
        trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B, full], micro_batch_tokens=128, device=device)
        bank.lora_backend, bank.pack_projections = backend, True
        based.clear()
        st = trainer.step({j.name: fixed_rollouts(j, 0, 500) for j in (JOB_A, JOB_B, full)})
        results.append((st, {j: params_of(bank, j) for j in ("a", "b", "c")}, list(based), _states(bank, ("a", "b", "c"))))
    (s0, p0, b0, o0), (s1, p1, b1, o1) = results
    assert b0 and not any(b0) and all(b1) and len(b1) == len(b0)
    for j in ("a", "b", "c"):
        assert s1[j].loss == pytest.approx(s0[j].loss, rel=1e-4, abs=1e-7)
        assert s1[j].grad_norm == pytest.approx(s0[j].grad_norm, rel=1e-4)
        if device == "cpu":  # the gradients elementwise (tf32's tolerance on the GPU: not measured)
            assert_same_adamw_state(o1[j], o0[j], rel=1e-4)
        assert max((p1[j][k][1] - p0[j][k][1]).abs().max().item() for k in p0[j]) <= 1e-5


def test_step_scoped_stacks_take_the_per_activation_step(tiny_model_dir):
    """The step scope (each module's adapters stacked once per step, gradients handed over at its
    end) gives the same step as stacking per micro-batch, over several micro-batches; an exception
    inside the scope hands no gradient over."""
    import contextlib

    results = []
    for scoped in (True, False):
        trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=64)
        if not scoped:
            bank.step_scope = lambda jobs: contextlib.nullcontext()
        ro = {j.name: fixed_rollouts(j, 0, 500) for j in (JOB_A, JOB_B)}
        assert len(trainer._micro_batches(trainer._sequences(ro), ("a", "b"))) > 2
        st = trainer.step(ro)
        results.append((st, {j: params_of(bank, j) for j in ("a", "b")}))
    (s0, p0), (s1, p1) = results
    for j in ("a", "b"):
        assert s0[j].grad_norm == s1[j].grad_norm and s0[j].loss == s1[j].loss
        assert all(torch.equal(p0[j][k][i], p1[j][k][i]) for k in p0[j] for i in (0, 1))

    trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=64)
    ro = {j.name: fixed_rollouts(j, 0, 500) for j in (JOB_A, JOB_B)}
    with pytest.raises(RuntimeError, match="boom"):
        with bank.step_scope(("a", "b")):
            trainer._forward_backward(trainer._micro_batches(trainer._sequences(ro), ("a", "b"))[0], ("a", "b"),
                                      torch.zeros(2, 6, dtype=torch.float64))
            raise RuntimeError("boom")
    assert all(p.grad is None for j in ("a", "b") for p in bank.jobs[j].parameters())


class _Seq(Row):
    """A GRPO rollout's row as these tests write it: prompt + completion scored on the completion, one
    weight and advantage, ppo on the trainer's own log-probs; `call` is its call's index in the pass."""

    def __init__(self, job, ids, prompt_len, weight, advantage, temperature, kl_coef, engine_logprobs, call=0):
        ids = np.array(ids, np.int64)
        super().__init__(job, call, Datum(ids, ids[prompt_len:], prompt_len - 1, weight, advantage, float("nan"),
                                          engine_logprobs), LossSpec("ppo", 0.8, 1.2, temperature, kl_coef))

    ids = property(lambda self: self.datum.tokens.tolist())
    prompt_len = property(lambda self: self.datum.first + 1)
    n_completion = property(lambda self: len(self.datum.targets))
    weight = property(lambda self: self.datum.weights)
    advantage = property(lambda self: self.datum.advantages)
    temperature = property(lambda self: self.loss.temperature)
    kl_coef = property(lambda self: self.loss.kl_coef)
    engine_logprobs = property(lambda self: self.datum.engine_logprobs)


def _pack_reference(mb, order, pad_id):
    """The per-token Python loop pack_micro_batch replaced, kept as its specification."""
    import math

    from colora.training.losses import CODE

    B, L = len(mb), max(len(s.ids) for s in mb)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    pos, per_tok = [], {k: [] for k in ("w", "adv", "q", "kind", "lo", "hi", "temp", "kl", "elp", "job")}
    for b, s in enumerate(mb):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
        mask[b, : len(s.ids)] = 1
        n = s.n_completion
        pos.extend(range(b * L + s.prompt_len - 1, b * L + s.prompt_len - 1 + n))
        per_tok["w"] += [s.weight] * n
        per_tok["adv"] += [s.advantage] * n
        per_tok["q"] += [math.nan] * n
        per_tok["kind"] += [CODE[s.loss.kind]] * n
        per_tok["lo"] += [s.loss.clip_low] * n
        per_tok["hi"] += [s.loss.clip_high] * n
        per_tok["temp"] += [s.temperature] * n
        per_tok["kl"] += [s.kl_coef] * n
        per_tok["elp"] += s.engine_logprobs if len(s.engine_logprobs) == n else [math.nan] * n
        per_tok["job"] += [s.call] * n
    longs = torch.cat([ids.view(-1), mask.view(-1), torch.tensor(pos), torch.tensor(per_tok.pop("job"))])
    return longs, {k: torch.tensor(v, dtype=torch.float32) for k, v in per_tok.items()}


def test_pack_micro_batch_equals_the_per_token_loop():
    import random

    from colora.training.batches import pack_micro_batch

    rng = random.Random(0)
    order = ("b", "a", "c")
    mb = []
    for i in range(23):
        p, n = rng.randint(1, 9), rng.randint(1, 12)
        elp = [rng.random() for _ in range(n)] if i % 3 else [0.5] * (n + 1)  # a wrong count: NaN
        mb.append(_Seq(order[i % 3], [rng.randrange(1, 500) for _ in range(p + n)], p, rng.random(),
                       rng.uniform(-2, 2), rng.choice([0.7, 1.0]), rng.choice([0.0, 0.05]), elp, call=i % 3))
    mb.sort(key=lambda s: order.index(s.job))
    want_longs, want = _pack_reference(mb, order, pad_id=7)
    longs, got, _ = pack_micro_batch(mb, pad_id=7)
    assert longs.dtype == np.int64 and torch.equal(torch.from_numpy(longs), want_longs)
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == np.float32
        assert torch.equal(torch.from_numpy(got[k]).nan_to_num(-9.0), want[k].nan_to_num(-9.0)), k
    assert np.isnan(got["elp"]).sum() == sum(s.n_completion for i, s in enumerate(mb) if len(s.engine_logprobs) != s.n_completion)


@pytest.mark.parametrize("micro_batch_tokens", [100, 1000])
def test_packed_rows_take_the_padded_step(tiny_model_dir, micro_batch_tokens):
    """packed_rows=True: each micro-batch's sequences back to back in one row, attention kept
    inside each sequence, no padding: the same losses, gradient norms, KL and updates as the padded
    trainer (job b's KL term runs the base model packed too), in fewer micro-batches where the
    padding filled the budget."""
    vocab, results, counts = 500, [], []
    for packed in (False, True):
        trainer, bank, model = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=micro_batch_tokens,
                                            packed_rows=packed)
        assert trainer.packed is packed
        ro = {j.name: fixed_rollouts(j, 0, vocab) for j in (JOB_A, JOB_B)}
        counts.append(len(trainer._micro_batches(trainer._sequences(ro), ("a", "b"))))
        trainer.step(ro)
        st = trainer.step({j.name: fixed_rollouts(j, 1, vocab) for j in (JOB_A, JOB_B)})  # KL > 0 once moved
        results.append((st, {j: params_of(bank, j) for j in ("a", "b")}, _states(bank, ("a", "b"))))
    (s0, p0, o0), (s1, p1, o1) = results
    lr = {j.name: j.learning_rate for j in (JOB_A, JOB_B)}
    for j in ("a", "b"):
        assert s1[j].loss == pytest.approx(s0[j].loss, rel=1e-5, abs=1e-7)
        assert s1[j].grad_norm == pytest.approx(s0[j].grad_norm, rel=1e-5)
        assert_same_adamw_state(o1[j], o0[j], rel=1e-4)  # two steps: 3.5e-5 apart measured
        # KL of a barely moved policy (~4e-6): a difference of fp32 log-probs summed in another order
        assert s1[j].kl == pytest.approx(s0[j].kl, rel=1e-5, abs=1e-8)
        assert s1[j].entropy == pytest.approx(s0[j].entropy, rel=1e-5)
        # weights within 1% of one AdamW step (1.4e-6 measured, lr 5e-4 and 1e-3)
        assert max((p1[j][k][i] - p0[j][k][i]).abs().max().item() for k in p0[j] for i in (0, 1)) <= 0.01 * lr[j]
    assert s0["b"].kl > 0
    assert counts == ([3, 2] if micro_batch_tokens == 100 else [1, 1])  # at 100 tokens the padding took one more


def test_packed_rows_layout():
    """pack_micro_batch_rows: ids back to back, positions restarting at each sequence, the hidden
    state that predicts each completion token, its job, and the sequences' starts."""
    from colora.training.batches import pack_micro_batch_rows

    mb = [_Seq("b", [5, 6, 7, 8], 2, 1.0, 0.5, 1.0, 0.0, [-0.1, -0.2], call=0),
          _Seq("a", [9, 10, 11], 1, 2.0, -0.5, 0.7, 0.1, [], call=1)]
    longs, per_tok, _ = pack_micro_batch_rows(mb)
    T, N = 7, 4
    assert longs[:T].tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert longs[T:2 * T].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert longs[2 * T:2 * T + N].tolist() == [1, 2, 4, 5]  # 7 and 8 from positions 1, 2; 10, 11 from 4, 5
    assert longs[2 * T + N:2 * T + 2 * N].tolist() == [0, 0, 1, 1]
    assert longs[2 * T + 2 * N:].tolist() == [0, 4, 7]
    assert per_tok["w"].tolist() == [1.0, 1.0, 2.0, 2.0] and np.isnan(per_tok["elp"][2:]).all()


def test_packed_rows_by_default_on_cuda_only(tiny_model_dir):
    """Packed rows unless told otherwise on CUDA only (an H200 A/B, measured at 0e15773);
    `packed_rows=` decides on any device."""
    from colora.training.packing import packed_by_default

    assert (packed_by_default(torch.device("cpu")), packed_by_default("cuda")) == (False, True)
    for packed_rows, want in ((None, False), (True, True), (False, False)):
        assert make_trainer(tiny_model_dir, [JOB_A], 128, packed_rows=packed_rows)[0].packed is want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_rows_on_the_gpu_take_the_padded_step(tiny_model_dir, dtype):
    """The CUDA paths of colora/training/packing.py: in bf16 torch's varlen attention (whatever its torch
    version's signature), in fp32 one SDPA call per sequence (FlashAttention has no fp32; the first
    run of this test on the H200 failed there, at 0e15773): the same step
    as the padded trainer, within fp32's or bf16's rounding of the flash and cuBLAS kernels."""
    results = []
    for packed in (False, True):
        trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=100, device="cuda",
                                        dtype=dtype, packed_rows=packed)
        for step in range(2):
            st = trainer.step({j.name: fixed_rollouts(j, step, 500) for j in (JOB_A, JOB_B)})
        results.append((st, {j: params_of(bank, j) for j in ("a", "b")}))
    (s0, p0), (s1, p1) = results
    for j in ("a", "b"):
        # B starts at zero: after two steps it is the update (entries ~1e-3 at these learning rates)
        d0 = torch.cat([p0[j][k][1].float().flatten() for k in p0[j]])
        d1 = torch.cat([p1[j][k][1].float().flatten() for k in p0[j]])
        if dtype == "float32":
            assert s1[j].loss == pytest.approx(s0[j].loss, rel=2e-3, abs=1e-5)
            assert s1[j].grad_norm == pytest.approx(s0[j].grad_norm, rel=2e-3)
            assert (d1 - d0).abs().max().item() <= 1e-4
        else:  # bf16 activations: other kernels and shapes round differently; the update must agree
            assert s1[j].loss == pytest.approx(s0[j].loss, rel=5e-2, abs=5e-3)
            assert s1[j].grad_norm == pytest.approx(s0[j].grad_norm, rel=5e-2)
            assert torch.nn.functional.cosine_similarity(d0, d1, dim=0).item() >= 0.98
            assert (d1.norm() / d0.norm()).item() == pytest.approx(1.0, abs=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attention_on_the_gpu_equals_one_sdpa_call_per_sequence(dtype):
    from colora.training.packing import varlen_attention

    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 1, 64, 30]
    T = sum(lens)
    q = torch.randn(1, 16, T, 128, generator=g).to("cuda", dtype)
    k, v = (torch.randn(1, 8, T, 128, generator=g).to("cuda", dtype) for _ in range(2))
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device="cuda")
    got, _ = varlen_attention(None, q, k, v, None, scaling=0.088, cu_seq_lens_q=cu, max_length_q=max(lens))
    want, _ = varlen_attention(None, q.cpu().float(), k.cpu().float(), v.cpu().float(), None, scaling=0.088,
                               cu_seq_lens_q=cu.cpu(), max_length_q=max(lens))
    assert got.shape == (1, T, 16, 128)
    assert (got.float().cpu() - want).abs().max().item() <= 2e-2


@pytest.mark.gpu
def test_varlen_attention_on_the_gpu_takes_grouped_kv_as_they_are(monkeypatch):
    """K/V with fewer heads than Q go to FlashAttention as they are (no repeat: colora/training/packing.py);
    output and gradients equal those of the same call with K/V repeated (the fallback for a torch
    that refused them), and the inputs' gradients come back in their [1, T, H, D] layout."""
    import colora.training.packing as packing

    g = torch.Generator().manual_seed(1)
    lens = [7, 33, 1, 90]
    T = sum(lens)
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32, device="cuda")
    base = [torch.randn(1, T, h, 128, generator=g).to("cuda", torch.bfloat16) for h in (16, 8, 8)]
    grad_out = torch.randn(1, T, 16, 128, generator=g).to("cuda", torch.bfloat16)

    def run(repeat):
        monkeypatch.setattr(packing, "_repeat_kv", [True] if repeat else [])
        leaves = [t.clone().requires_grad_() for t in base]
        q, k, v = (t.transpose(1, 2) for t in leaves)  # as the attention layers pass them
        out, _ = packing.varlen_attention(None, q, k, v, None, scaling=0.088, cu_seq_lens_q=cu,
                                          max_length_q=max(lens))
        out.backward(grad_out)
        return out, [t.grad for t in leaves]

    out, grads = run(repeat=False)
    ref, ref_grads = run(repeat=True)
    assert (out.float() - ref.float()).abs().max().item() <= 1e-2
    for gr, rg in zip(grads, ref_grads):
        assert gr.shape == rg.shape and gr.is_contiguous()
        assert (gr.float() - rg.float()).abs().max().item() <= 2e-2 * max(1.0, rg.float().abs().max().item())


def test_gradients_reach_the_optimizer_in_the_parameters_layout(tiny_model_dir):
    """torch's fused AdamW (CUDA) requires each gradient and its state to have the parameter's
    strides: the step's gradients, handed over as views of the stacked leaves, must match the jobs'
    parameters (B is stored column-major for this), on every path that hands them over."""
    trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=100)
    seen = []
    for name in ("a", "b"):
        opt = bank.jobs[name].optimizer
        real = opt.step
        opt.step = lambda real=real, name=name: seen.extend(
            (name, p.stride() == p.grad.stride()) for p in bank.jobs[name].parameters()) or real()
    trainer.step({j.name: fixed_rollouts(j, 0, 500) for j in (JOB_A, JOB_B)})
    assert seen and all(ok for _, ok in seen), [s for s in seen if not s[1]][:3]
    assert {n for n, _ in seen} == {"a", "b"}
    assert all(not b.is_contiguous() and b.t().is_contiguous() for b in bank.jobs["b"].B.values())


def test_flash_varlen_repeats_grouped_kv_only_for_a_torch_that_refuses_them(monkeypatch):
    """colora/training/packing.py's call of torch's varlen attention, with a stand-in for it: grouped K/V go
    as they are; a torch that refuses them (a RuntimeError on the heads) gets them repeated from
    then on; running out of memory is not taken for a refusal."""
    import colora.training.packing as packing

    monkeypatch.setattr(packing, "_repeat_kv", [])
    q, k = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8)
    seen = []

    def accepts(q, k, v, *a, **kw):
        seen.append(k.shape[1])
        return q

    def refuses(q, k, v, *a, **kw):
        seen.append(k.shape[1])
        if k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must divide number of heads in query")
        return q

    def oom(q, k, v, *a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory")

    cu = torch.tensor([0, 5], dtype=torch.int32)
    packing._flash_varlen(accepts, q, k, k, cu, 5, None, {}, False)
    assert seen == [2] and packing._repeat_kv == []
    with pytest.raises(torch.OutOfMemoryError):
        packing._flash_varlen(oom, q, k, k, cu, 5, None, {}, False)
    assert packing._repeat_kv == []
    seen.clear()
    packing._flash_varlen(refuses, q, k, k, cu, 5, None, {}, False)
    packing._flash_varlen(refuses, q, k, k, cu, 5, None, {}, False)
    assert seen == [2, 4, 4] and packing._repeat_kv == [True]


def _grads(bank, name) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in bank.jobs[name].parameters()]


def _weights_and_moments(bank, name) -> list[torch.Tensor]:
    job = bank.jobs[name]
    st = job.optimizer.state
    return [t.detach().clone() for p in job.parameters() for t in (p, *(st[p][k] for k in sorted(st.get(p, {}))))]


@pytest.mark.parametrize("when", ["before_any_change", "after_a_weight_changed"])
def test_an_optimizer_step_that_raises_for_one_job_leaves_it_as_it_was_and_steps_the_others(
        tiny_model_dir, monkeypatch, when):
    """optim_step over two jobs where the second's AdamW step raises (as CUDA running out of memory for
    its first moments would), before touching anything or after changing a weight: the first job takes
    its step; the second answers the error and is exactly as before the call (weights, AdamW state,
    version and its gradient); the same optim_step again applies that gradient once, as a job that
    never failed does."""
    from colora.training.adamw import AdamParams

    p = AdamParams(learning_rate=1e-3, grad_clip_norm=1e-3)  # the clip scales the gradient: it must be undone
    trainer, bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=128)
    twin, twin_bank, _ = make_trainer(tiny_model_dir, [JOB_A, JOB_B], micro_batch_tokens=128)
    for t in (trainer, twin):  # one step each, so that both jobs have AdamW moments to keep
        t.step({j.name: fixed_rollouts(j, 0, 500) for j in (JOB_A, JOB_B)})
    calls = [ForwardBackwardCall(j.name, [Datum(np.arange(3, 40), np.arange(4, 40), 0)]) for j in (JOB_A, JOB_B)]
    trainer.forward_backward(calls)
    twin.forward_backward(calls)
    grad_b, state_b = _grads(bank, "b"), _weights_and_moments(bank, "b")
    b = bank.jobs["b"]
    real_step = b.optimizer.step

    def failing_step():
        if when == "after_a_weight_changed":
            with torch.no_grad():
                next(iter(b.A.values())).add_(1.0)
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(b.optimizer, "step", failing_step)
    got = trainer.optim_step({"a": p, "b": p})
    want = twin.optim_step({"a": p})["a"]
    assert got["a"].failure == "" and got["a"].version == want.version == 2
    assert all(torch.equal(x, y) for x, y in zip(_weights_and_moments(bank, "a"), _weights_and_moments(twin_bank, "a")))
    assert "OutOfMemoryError" in got["b"].failure and "injected" in got["b"].failure and got["b"].version == 1
    assert got["b"].raised and not got["a"].raised
    assert all(torch.equal(x, y) for x, y in zip(_weights_and_moments(bank, "b"), state_b))
    assert all(torch.equal(x, y) for x, y in zip(_grads(bank, "b"), grad_b)), "the gradient must be as it was"
    monkeypatch.setattr(b.optimizer, "step", real_step)
    again, alone = trainer.optim_step({"b": p})["b"], twin.optim_step({"b": p})["b"]
    assert again.failure == "" and again.version == alone.version == 2 and again.grad_norm == alone.grad_norm
    assert all(torch.equal(x, y) for x, y in zip(_weights_and_moments(bank, "b"), _weights_and_moments(twin_bank, "b")))
    assert trainer.optim_step({"b": p})["b"].grad_norm == 0.0, "a gradient is applied once, then cleared"
