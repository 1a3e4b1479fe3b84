"""Adapter bank: PEFT export round trip, deterministic init, checkpoint state round trip."""

from __future__ import annotations

import json

import pytest
import torch

from colora.models.base import load_base_model
from colora.training.lora import AdapterBank, inject_lora


def _bank_with_jobs(model_dir, seed=3, device="cpu"):
    model = load_base_model(model_dir, torch.float32, device)
    bank = AdapterBank(device, "torch")
    inject_lora(model, bank)
    bank.add_job("a", 4, 8.0, ("q_proj", "v_proj", "down_proj"), seed, 1e-3)
    bank.add_job("b", 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed, 1e-3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # nonzero B so the adapters actually change the output
        for job in bank.jobs.values():
            for k in job.B:
                job.B[k].copy_(torch.randn(job.B[k].shape, generator=g).to(device) * 0.05)
    return model, bank


@pytest.mark.parametrize("fold_scale", [False, True])
def test_peft_loads_export_with_the_trainers_logits(tiny_model_dir, tmp_path, fold_scale):
    """Both forms of the file are the job's adapter: lora_alpha as configured, or (the engine's
    copies) the scale folded into B and lora_alpha = r."""
    from peft import PeftModel
    from safetensors.torch import load_file

    model, bank = _bank_with_jobs(tiny_model_dir)
    ids = torch.tensor([[5, 9, 17, 33, 2, 41, 7, 100, 250, 3]])
    for name in ("a", "b"):
        job = bank.jobs[name]
        out = bank.export_peft(name, tmp_path / name, str(tiny_model_dir), fold_scale=fold_scale)
        meta = json.loads((out / "adapter_config.json").read_text())
        assert meta["r"] == job.rank and meta["peft_type"] == "LORA"
        assert meta["lora_alpha"] == (job.rank if fold_scale else job.alpha) and job.scale == 2.0
        got = load_file(out / "adapter_model.safetensors")
        for path in job.A:
            assert torch.equal(got[f"base_model.model.{path}.lora_A.weight"], job.A[path].detach())
            want_b = job.B[path].detach() * (job.scale if fold_scale else 1.0)
            assert torch.equal(got[f"base_model.model.{path}.lora_B.weight"], want_b)
        with torch.no_grad(), bank.activate((name,), [ids.numel()]):
            ours = model(input_ids=ids).logits
        base = load_base_model(tiny_model_dir, torch.float32, "cpu")
        peft_model = PeftModel.from_pretrained(base, str(out)).eval()
        with torch.no_grad():
            theirs = peft_model(input_ids=ids).logits
        assert (ours - theirs).abs().max().item() < 1e-5
        with torch.no_grad():  # and the adapter matters: without it the logits differ
            plain = model(input_ids=ids).logits
        assert (ours - plain).abs().max().item() > 1e-3


def test_init_depends_only_on_seed_and_job_name(tiny_model_dir):
    _, b1 = _bank_with_jobs(tiny_model_dir, seed=3)
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    b2 = AdapterBank("cpu", "torch")
    inject_lora(model, b2)
    b2.add_job("a", 4, 8.0, ("q_proj", "v_proj", "down_proj"), 3, 1e-3)  # alone, no job b
    assert all(torch.equal(b1.jobs["a"].A[k], b2.jobs["a"].A[k]) for k in b2.jobs["a"].A)
    b3 = AdapterBank("cpu", "torch")
    inject_lora(load_base_model(tiny_model_dir, torch.float32, "cpu"), b3)
    b3.add_job("a", 4, 8.0, ("q_proj", "v_proj", "down_proj"), 4, 1e-3)  # another seed
    assert not all(torch.equal(b1.jobs["a"].A[k], b3.jobs["a"].A[k]) for k in b3.jobs["a"].A)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_job_state_round_trip(tiny_model_dir, device):
    """Through a checkpoint (CPU tensors) and back, on the CPU and on CUDA (torch's fused AdamW there,
    whose step count lives on the GPU): the same weights, version and optimizer state, and the next
    update is the same in both banks."""
    _, bank = _bank_with_jobs(tiny_model_dir, device=device)
    job = bank.jobs["a"]
    for p in job.parameters():
        p.grad = torch.ones_like(p)
    job.optimizer.step()
    job.version = 5
    state = bank.job_state("a")
    assert all(t.device.type == "cpu" for t in state["A"].values())
    assert all(t.device.type == "cpu" for st in state["optimizer"]["state"].values() for t in st.values()
               if isinstance(t, torch.Tensor))
    _, other = _bank_with_jobs(tiny_model_dir, seed=9, device=device)
    other.load_job_state("a", state)
    assert other.jobs["a"].version == 5
    assert all(torch.equal(other.jobs["a"].A[k], job.A[k]) and torch.equal(other.jobs["a"].B[k], job.B[k]) for k in job.A)
    assert float(other.jobs["a"].optimizer.state_dict()["state"][0]["step"]) == 1.0
    for b in (bank, other):
        for p in b.jobs["a"].parameters():
            p.grad = torch.full_like(p, 0.5)
        b.jobs["a"].optimizer.step()
    assert all(torch.equal(other.jobs["a"].A[k], job.A[k]) and torch.equal(other.jobs["a"].B[k], job.B[k]) for k in job.A)


def test_export_in_the_engines_dtype_is_the_cast_of_the_fp32_export(tiny_model_dir, tmp_path):
    """vLLM casts an adapter to its own dtype on loading: a bf16 file must hold exactly that cast."""
    from safetensors.torch import load_file

    _, bank = _bank_with_jobs(tiny_model_dir)
    full = load_file(str(bank.export_peft("a", tmp_path / "f32", "tiny") / "adapter_model.safetensors"))
    half = load_file(str(bank.export_peft("a", tmp_path / "bf16", "tiny", torch.bfloat16) / "adapter_model.safetensors"))
    assert full.keys() == half.keys() and all(t.dtype == torch.float32 for t in full.values())
    for k in full:
        assert half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].to(torch.bfloat16)), k
    assert any(t.abs().max() > 0 for t in half.values())
    size = {d: (tmp_path / d / "adapter_model.safetensors").stat().st_size for d in ("bf16", "f32")}
    assert size["bf16"] < 0.6 * size["f32"]


def test_write_safetensors_gives_the_librarys_tensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file

    from colora.training.lora import write_safetensors

    g = torch.Generator().manual_seed(1)
    shapes = [(3, 5), (7,), (2, 1, 4), (1,)]
    tensors = [torch.randn(s, generator=g) for s in shapes]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        flat = torch.cat([t.reshape(-1) for t in tensors]).to(dtype)
        names = [f"t{i}.weight" for i in range(len(shapes))]
        write_safetensors(tmp_path / "x.safetensors", names, shapes, flat)
        got = load_file(tmp_path / "x.safetensors")
        assert list(got) == sorted(names)
        for n, t in zip(names, tensors):
            assert got[n].dtype == dtype and torch.equal(got[n], t.to(dtype))
        with safe_open(tmp_path / "x.safetensors", "pt") as f:
            assert f.metadata() == {"format": "pt"}
        header_len = int.from_bytes((tmp_path / "x.safetensors").read_bytes()[:8], "little")
        assert header_len % 8 == 0  # the body starts 8-byte aligned, as the library writes it
    with pytest.raises(ValueError, match="the shapes hold 31 elements, flat has 30"):
        write_safetensors(tmp_path / "y.safetensors", names, shapes, flat[:-1])
    with pytest.raises(ValueError, match="1-D CPU tensor"):
        write_safetensors(tmp_path / "y.safetensors", names, shapes, flat.to(torch.float64))


def test_export_writes_the_jobs_weights_in_the_asked_dtype(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    _, bank = _bank_with_jobs(tiny_model_dir)
    for dtype in (torch.float32, torch.bfloat16):
        out = bank.export_peft("b", tmp_path / f"b-{dtype}", str(tiny_model_dir), dtype)
        got = load_file(out / "adapter_model.safetensors")
        job = bank.jobs["b"]
        assert len(got) == 2 * len(job.A)
        for path in job.A:
            assert torch.equal(got[f"base_model.model.{path}.lora_A.weight"], job.A[path].detach().to(dtype))
            assert torch.equal(got[f"base_model.model.{path}.lora_B.weight"], job.B[path].detach().to(dtype))


@pytest.mark.gpu
def test_export_from_the_gpu_writes_the_current_weights(tiny_model_dir, tmp_path):
    """The CUDA branch: one flatten, one copy into a page-locked buffer kept per job and dtype. The
    buffer is reused, so a second export after an update must carry the new weights, not the old."""
    from safetensors.torch import load_file

    _, bank = _bank_with_jobs(tiny_model_dir, device="cuda")
    job = bank.jobs["b"]
    for dtype in (torch.bfloat16, torch.float32):
        for round_ in range(2):
            with torch.no_grad():
                for k in job.B:
                    job.B[k].add_(0.01 * (round_ + 1))
            out = bank.export_peft("b", tmp_path / f"b-{dtype}-{round_}", str(tiny_model_dir), dtype)
            got = load_file(out / "adapter_model.safetensors")
            for path in job.A:
                assert torch.equal(got[f"base_model.model.{path}.lora_A.weight"], job.A[path].detach().to(dtype).cpu())
                assert torch.equal(got[f"base_model.model.{path}.lora_B.weight"], job.B[path].detach().to(dtype).cpu())
    out = bank.export_peft("b", tmp_path / "b-folded", str(tiny_model_dir), torch.bfloat16, fold_scale=True)
    got = load_file(out / "adapter_model.safetensors")
    for path in job.A:  # the scale multiplies the fp32 B on the device, before the cast
        want = (job.B[path].detach() * job.scale).to(torch.bfloat16).cpu()
        assert torch.equal(got[f"base_model.model.{path}.lora_B.weight"], want)
    assert {k[1] for k in bank._host if k[0] == "b"} == {torch.bfloat16, torch.float32}
    assert all(buf.is_pinned() for buf in bank._host.values())
