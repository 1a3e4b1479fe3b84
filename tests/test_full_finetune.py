"""Full-parameter jobs on the CPU in fp32 with the tiny model: the trainer's step against plain torch (autograd
through the Hugging Face model, clip_grad_norm_, torch.optim.AdamW) on the same batch, park and restore bit
for bit, and the config's rules for `finetune` (a trained LM head's log-softmax: tests/test_kernel_logsoftmax.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer import fixed_rollouts

from colora.config import ConfigError, JobConfig, TrainerConfig, resolve
from colora.joining import join_bounds
from colora.models.base import load_base_model
from colora.tenancy import tenant_units
from colora.timeslice.parking import trainer_parker
from colora.training.batches import Datum
from colora.training.full import FullBank, FullTrainer, full_weights, state_bytes
from colora.training.grpo import sequence_token_weight
from colora.training.losses import LossSpec
from colora.training.trainer import ForwardBackwardCall, StaleRolloutError

VOCAB = 500  # token ids drawn below the tiny model's 512
# clip on (its norm is far above 1e-3), weight decay on, betas and eps off torch's defaults
JOB = JobConfig(name="f", task="addition", finetune="full", learning_rate=1e-3, weight_decay=0.01,
                adam_betas=(0.8, 0.95), adam_eps=1e-6, grad_clip=1e-3, loss="grpo_seq", temperature=0.7,
                prompts_per_step=3, samples_per_prompt=4, max_new_tokens=12)


def full_trainer(model_dir, job=JOB, dtype=torch.float32, micro_batch_tokens=4096, packed_rows=False,
                 backend="torch"):
    model = load_base_model(model_dir, dtype, "cpu")
    bank = FullBank(full_weights(job.name, model, job))
    cfg = TrainerConfig(micro_batch_tokens=micro_batch_tokens, logprob_backend=backend, logprob_chunk=7)
    return FullTrainer(bank, cfg, {job.name: job}, pad_id=0, packed_rows=packed_rows), bank, model


def sft_datums(step: int) -> list[Datum]:
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(5):
        ids = torch.randint(3, VOCAB, (int(torch.randint(6, 20, (1,), generator=g)),), generator=g).numpy()
        w = np.where(np.arange(len(ids) - 1) >= 2, 1.0 / 40, 0.0).astype(np.float32)  # the "assistant's" tokens
        out.append(Datum(ids, ids[1:], 0, w))
    return out


def reference_loss(model, job, rollouts=None, datums=None) -> torch.Tensor:
    """The job's loss by plain torch on the Hugging Face model's logits: GRPO's -w_i * A_i * logp (its
    gradient: the trainer's ppo at ratio 1), or SFT's -w * logp."""
    total = 0.0
    if rollouts is not None:
        weights = sequence_token_weight([len(r.completion_ids) for r in rollouts], job.loss, job.max_new_tokens)
        for r, w in zip(rollouts, weights):
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            lp = torch.log_softmax(model(input_ids=ids).logits[0].float() / job.temperature, -1)
            P = len(r.prompt_ids)
            logp = lp[P - 1: P - 1 + len(r.completion_ids)].gather(1, torch.tensor(r.completion_ids)[:, None])
            total = total - w * r.advantage * logp.sum()
    for d in datums or ():
        lp = torch.log_softmax(model(input_ids=torch.tensor(d.tokens)[None]).logits[0].float(), -1)
        logp = lp[:len(d.targets)].gather(1, torch.tensor(d.targets)[:, None]).squeeze(1)
        total = total - (torch.tensor(d.weights) * logp).sum()
    return total


@pytest.mark.parametrize("kind,packed,backend", [("grpo", False, "torch"), ("grpo", True, "torch"),
                                                 ("sft", False, "torch"), ("grpo", False, "triton")])
def test_a_full_step_equals_torch_adamw_on_the_same_batch(tiny_model_dir, kind, packed, backend):
    """Two steps of the trainer (micro-batches of a few rows, chunked log-softmax, on either backend: the
    trained head's gradient from the torch reference or the Triton kernel) against autograd through the
    whole model, clip_grad_norm_ on its own norm and torch.optim.AdamW with the job's settings: every
    weight, the tied embedding and LM head among them, and the gradient norm."""
    trainer, bank, model = full_trainer(tiny_model_dir, micro_batch_tokens=48, packed_rows=packed,  # several a step
                                        backend=backend)
    ref = load_base_model(tiny_model_dir, torch.float32, "cpu")
    params = list(ref.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=JOB.learning_rate, betas=JOB.adam_betas, eps=JOB.adam_eps,
                            weight_decay=JOB.weight_decay)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        if kind == "grpo":
            rs = fixed_rollouts(JOB, step, VOCAB)
            st = trainer.step({"f": rs})["f"]
            loss = reference_loss(ref, JOB, rollouts=rs)
        else:
            ds = sft_datums(step)
            st = trainer.step({}, {"f": ds})["f"]
            loss = reference_loss(ref, JOB, datums=ds)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, JOB.grad_clip)
        opt.step()
        assert st.failure == "" and st.version == step + 1
        assert st.grad_norm == pytest.approx(float(norm), rel=1e-5)
        assert st.clip_coef < 1  # clipping was active
        for (name, p), q in zip(model.named_parameters(), params):
            torch.testing.assert_close(p, q.detach(), atol=1e-6, rtol=1e-5, msg=name)
    assert all(not torch.equal(a, b) for a, b in zip(start, model.parameters()))  # every weight moved
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied


def test_on_policy_and_no_kl_term(tiny_model_dir):
    trainer, bank, _ = full_trainer(tiny_model_dir)
    with pytest.raises(StaleRolloutError, match="version 1"):
        trainer.step({"f": fixed_rollouts(JOB, 1, VOCAB)})  # rollouts tagged with version 1; weights at 0
    d = sft_datums(0)
    (res,) = trainer.forward_backward([ForwardBackwardCall("f", d, LossSpec("cross_entropy", kl_coef=0.1))])
    assert "kl_coef" in res.error and "no frozen base" in res.error


def test_a_step_for_another_job_or_with_bad_settings_is_refused_and_changes_nothing(tiny_model_dir):
    trainer, bank, model = full_trainer(tiny_model_dir)
    (res,) = trainer.forward_backward([ForwardBackwardCall("nobody", sft_datums(0), LossSpec("cross_entropy"))])
    assert res.error == "job 'nobody' has no weights in this trainer"
    trainer.forward_backward([ForwardBackwardCall("f", sft_datums(0), LossSpec("cross_entropy"))])
    before = _state(bank)
    out = trainer.optim_step({"nobody": trainer._adam_params("f"), "f": "lr=1"})
    assert out["nobody"].failure == "job 'nobody' has no weights in this trainer" and out["nobody"].version == -1
    assert out["f"].failure == "adam_params is a str" and out["f"].version == 0
    assert all(torch.equal(x, y) for x, y in zip(before, _state(bank)))  # the gradient stays for the next step
    assert trainer.optim_step({"f": trainer._adam_params("f")})["f"].version == 1


def test_a_non_finite_loss_refuses_the_update_and_keeps_the_weights(tiny_model_dir):
    trainer, bank, model = full_trainer(tiny_model_dir)
    before = [p.detach().clone() for p in model.parameters()]
    d = [dataclasses.replace(x, weights=np.full(len(x.targets), np.inf, np.float32)) for x in sft_datums(0)]
    st = trainer.step({}, {"f": d})["f"]
    assert "not finite" in st.failure and st.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def _live(bank) -> list[torch.Tensor]:
    """Every tensor a park must bring back, each once: the model's weights and gradients, the masters and
    their gradients (the weights themselves in fp32), AdamW's state."""
    (w,) = bank.jobs.values()
    out = [t for p in w.model.parameters() for t in (p, p.grad) if t is not None]
    out += [t for p in w.masters for t in (p, p.grad) if t is not None]
    out += [v for st in w.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return list({id(t): t for t in out}.values())


def _state(bank) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _live(bank)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_park_and_restore_of_a_full_tenant_are_bit_exact(tiny_model_dir, dtype):
    """A step (AdamW state made), then a forward_backward (gradients held): park frees every weight, master,
    gradient and moment, restore brings each back bit for bit, and the next step equals the step of a
    twin that was never parked."""
    (a, bank_a, model_a), (b, bank_b, _) = (full_trainer(tiny_model_dir, dtype=dtype) for _ in range(2))
    for t in (a, b):
        t.step({"f": fixed_rollouts(JOB, 0, VOCAB)})
        t.forward_backward([ForwardBackwardCall("f", sft_datums(1), LossSpec("cross_entropy"))])
    before = _state(bank_a)
    parker = trainer_parker(model_a, bank_a)
    stats = parker.park()
    assert all(p.numel() == 0 for p in model_a.parameters())
    assert all(p.numel() == 0 for p in bank_a.jobs["f"].masters)
    assert stats.bytes >= sum(t.numel() * t.element_size() for t in before)  # and the buffers (rotary)
    parker.restore()
    after = _state(bank_a)
    assert len(after) == len(before) and all(torch.equal(x, y) for x, y in zip(before, after))
    for t in (a, b):
        t.optim_step({"f": t._adam_params("f")})
        t.step({"f": fixed_rollouts(JOB, 2, VOCAB)})
    assert all(torch.equal(x, y) for x, y in zip(_state(bank_a), _state(bank_b)))


def test_bf16_weights_step_fp32_masters(tiny_model_dir):
    """In bf16 AdamW steps fp32 masters: each backward's gradient lands in the master's fp32 gradient (the
    model's own is freed), and after the step the model holds the masters, cast."""
    trainer, bank, model = full_trainer(tiny_model_dir, dtype=torch.bfloat16)
    w = bank.jobs["f"]
    assert w.mixed and all(m.dtype == torch.float32 for m in w.masters)
    trainer.forward_backward([ForwardBackwardCall("f", sft_datums(0), LossSpec("cross_entropy"))])
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in w.masters)
    st = trainer.optim_step({"f": trainer._adam_params("f")})["f"]
    assert st.failure == "" and st.version == 1
    for p, m in zip(model.parameters(), w.masters):
        assert torch.equal(p, m.detach().to(torch.bfloat16))
    assert state_bytes(1000, 2) == 18000 and state_bytes(1000, 4) == 16000


BASE = {"experiment": {"arm": "timeslice", "steps": 3}, "jobs": [
    {"name": "l0", "task": "addition"}, {"name": "full0", "task": "addition", "finetune": "full"},
    {"name": "l1", "task": "addition"}, {"name": "sft0", "kind": "sft", "data": "x.jsonl", "finetune": "full"},
    {"name": "l2", "task": "addition"}]}


def test_a_config_mixing_full_and_lora_jobs_in_the_timeslice_arm_is_accepted():
    cfg = resolve(BASE, ["timeslice.tenant_jobs=2"])
    assert tenant_units(cfg) == [["l0", "l1"], ["l2"], ["full0"], ["sft0"]]
    lone = resolve(BASE, ["experiment.arm=dedicated", "jobs=full0"])
    assert [j.finetune for j in lone.jobs] == ["full"]
    assert resolve(BASE).hash() != resolve(BASE, ["jobs.1.finetune=lora"]).hash()


@pytest.mark.parametrize("sets,key,says", [
    (["experiment.arm=overlap_mps"], "jobs.1.finetune", "runs in experiment.arm \"dedicated\" or \"timeslice\""),
    (["experiment.arm=shared_sync"], "jobs.1.finetune", "accepted there: finetune = \"lora\""),
    (["experiment.arm=dedicated"], "jobs.1.finetune", "is its run's only job (5 jobs here"),
    (["jobs.1.kl_coef=0.05"], "jobs.1.kl_coef", "must be 0 for finetune = \"full\""),
    (["jobs.1.start_after=1"], "jobs.1.start_after", "must be 0 for finetune = \"full\""),
    (["runtime.engine_process=on"], "runtime.engine_process", "must be \"auto\" or \"off\""),
    (["jobs.0.finetune=adapter"], "jobs.0.finetune", "expected one of 'lora', 'full'"),
    (["timeslice.memory_gib=40"], "timeslice.memory_gib", "is for timeslice.park = \"memory\""),
    (["timeslice.park=memory", "timeslice.memory_gib=-1"], "timeslice.memory_gib", "must be at least 0"),
])
def test_what_full_jobs_cannot_do_is_refused_naming_the_key(sets, key, says):
    with pytest.raises(ConfigError) as e:
        resolve(BASE, sets)
    assert str(e.value).startswith(key) and says in str(e.value)


def test_a_lora_job_joins_by_its_own_tenant_beside_full_jobs():
    """The LoRA jobs' tenants are cut without the full ones: l1 joins l0's tenant, which reaches 3 steps."""
    ok = resolve(BASE, ["timeslice.tenant_jobs=2", "jobs.2.start_after=2"])
    assert ok.jobs[2].start_after == 2
    with pytest.raises(ConfigError, match=r"jobs\.4\.start_after \(2\) must be below 0"):
        resolve(BASE, ["timeslice.tenant_jobs=2", "jobs.4.start_after=2"])  # l2 alone in its tenant


def test_a_full_job_between_lora_jobs_takes_no_place_in_their_tenant():
    """l0, full0, l1 with two jobs a tenant: the tenants are [l0, l1] and [full0], so l1 joins l0's tenant,
    which reaches 3 steps; the full job beside l0 in config order does not push l1 into a tenant alone."""
    raw = {**BASE, "jobs": BASE["jobs"][:3]}
    cfg = resolve(raw, ["timeslice.tenant_jobs=2", "jobs.2.start_after=2"])
    assert tenant_units(cfg) == [["l0", "l1"], ["full0"]] and cfg.jobs[2].start_after == 2
    assert {i: bound for i, (bound, _) in join_bounds(cfg).items()} == {2: 3}
    with pytest.raises(ConfigError, match=r"jobs\.2\.start_after \(3\) must be below 3, .* in its tenant"):
        resolve(raw, ["timeslice.tenant_jobs=2", "jobs.2.start_after=3"])


def test_the_full_state_bytes_per_parameter_match_the_trainers_tensors(tiny_model_dir):
    """state_bytes counts what a trained step holds: weights, masters (bf16), gradient, two moments."""
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        trainer, bank, model = full_trainer(tiny_model_dir, dtype=dtype)
        trainer.forward_backward([ForwardBackwardCall("f", sft_datums(0), LossSpec("cross_entropy"))])
        w = bank.jobs["f"]
        n = sum(p.numel() for p in model.parameters())
        w.optimizer.step()  # the moments exist; the gradient is still held
        held = sum(t.numel() * t.element_size() for t in _live(bank) if t.dim() > 0)  # not AdamW's step count
        assert held == state_bytes(n, size), (dtype, held, state_bytes(n, size))


def test_a_checkpoint_of_a_full_job_resumes_the_same_steps(tiny_model_dir):
    """job_state after a step, loaded into a fresh trainer: the next step is the same, bit for bit (the
    Checkpointer's and a resume's path for a full-parameter job)."""
    a, bank_a, _ = full_trainer(tiny_model_dir)
    a.step({"f": fixed_rollouts(JOB, 0, VOCAB)})
    state = bank_a.job_state("f")
    b, bank_b, _ = full_trainer(tiny_model_dir)
    bank_b.load_job_state("f", state)
    assert bank_b.jobs["f"].version == 1
    for t in (a, b):
        t.step({"f": fixed_rollouts(JOB, 1, VOCAB)})
    assert all(torch.equal(x, y) for x, y in zip(_state(bank_a), _state(bank_b)))
    with pytest.raises(ValueError, match="no full-parameter state"):
        bank_b.load_job_state("f", {"A": {}, "B": {}, "version": 1, "optimizer": {}})


def _full_run_config(tiny_model_dir):
    return resolve({"experiment": {"arm": "dedicated", "model": str(tiny_model_dir), "device": "cpu", "steps": 3},
                    "trainer": {"micro_batch_tokens": 4096, "logprob_backend": "torch"},
                    "jobs": [dataclasses.asdict(JOB) | {"response_length": {}}]})


def test_replay_step_runs_a_full_jobs_failed_step_on_its_full_trainer(tmp_path, tiny_model_dir):
    """A full job's step that failed (an advantage not finite) is kept as a run keeps it and replayed: the
    replay builds the full-parameter trainer, loads the kept weights and AdamW state, and fails the same way."""
    from colora.run import replay
    from colora.training.failed_step import keep_failed_step

    cfg = _full_run_config(tiny_model_dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"config": cfg.to_dict(), "hash": cfg.hash()}))
    trainer, bank, _ = full_trainer(tiny_model_dir)
    trainer.step({"f": fixed_rollouts(JOB, 0, VOCAB)})  # version 1, AdamW state made
    rs = fixed_rollouts(JOB, 1, VOCAB)
    rs[0].advantage = math.inf
    stats = trainer.step({"f": rs})
    assert "not finite" in stats["f"].failure and stats["f"].version == 1
    kept = keep_failed_step(run_dir, 1, 0, {"f": rs}, stats, bank)
    again = replay.replay(kept, [], None, log=lambda s: None)
    assert "not finite" in again["f"].failure and again["f"].version == 1
    assert replay.main([str(kept)]) == 1


def test_bench_adapter_sync_refuses_full_jobs_by_name():
    """A full-parameter job has no adapter to sync: the benchmark names it before an engine starts."""
    from colora.bench import adapter_sync
    from colora.run.preflight import RunError

    smoke = str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")
    with pytest.raises(RunError, match=r"job 'mod' is finetune = \"full\": it has no adapter"):
        adapter_sync.main([smoke, "--set", "experiment.arm=timeslice", "--set", "jobs.1.finetune=full"])
