"""The elementwise kernels that colora/training/fusion.py routes the model through compute what the model's own
code does: same logits and same gradients, for Qwen3 and for Llama, and only modules of the known
pattern change (Triton's interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from colora.models.base import load_base_model
from colora.training.fusion import fuse_elementwise, restore_rotary, should_fuse


def _tiny_llama(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _logits_and_grads(model, ids):
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=emb).logits
    (out.float().pow(2).mean()).backward()
    return out.detach(), emb.grad.detach()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_model_computes_the_same_logits_and_gradients(tiny_model_dir, tmp_path, arch):
    path = tiny_model_dir if arch == "qwen3" else _tiny_llama(tmp_path)
    ids = torch.randint(0, 60, (3, 11), generator=torch.Generator().manual_seed(1))
    want = _logits_and_grads(_load(path), ids)
    model = _load(path)
    counts = fuse_elementwise(model)
    n_layers = model.config.num_hidden_layers
    extra_norms = 2 if arch == "qwen3" else 0  # Qwen3's q_norm and k_norm
    assert counts == {"rms_norm": n_layers * (2 + extra_norms) + 1, "mlp": n_layers, "rotary": 1}
    try:
        got = _logits_and_grads(model, ids)
    finally:
        restore_rotary()
    # The fused kernels sum in another order: fp32 rounding differences, which the backward carries
    # into the input gradient at the scale of its largest entries (~1e3 here), so an entry that
    # cancels to ~1 differs by ~1e-4-1e-3 depending on the CPU's kernels. The bound is relative to
    # each tensor's scale; a wrong kernel misses it by orders of magnitude.
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max().item())


def test_restore_gives_the_module_its_own_rotary_back(tiny_model_dir):
    import sys

    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    modeling = sys.modules[type(model).__module__]
    orig = modeling.apply_rotary_pos_emb
    fuse_elementwise(model)
    fuse_elementwise(model)  # idempotent: the patched function is not wrapped twice
    assert modeling.apply_rotary_pos_emb is not orig
    restore_rotary()
    assert modeling.apply_rotary_pos_emb is orig


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_rotary_keeps_the_projections_layout(tiny_model_dir, tmp_path, arch):
    """The attention layers hand the rotary q and k as [B, H, T, D] transposed views of the
    projections' [B, T, H, D] outputs; the fused rotary returns its results in that same layout (so
    FlashAttention takes them without a copy), with the model's own values and gradients."""
    import sys

    model = _load(tiny_model_dir if arch == "qwen3" else _tiny_llama(tmp_path))
    modeling = sys.modules[type(model).__module__]
    orig = modeling.apply_rotary_pos_emb
    g = torch.Generator().manual_seed(3)
    B, T, Hq, Hk, D = 2, 7, 4, 2, 8
    q0, k0 = torch.randn(B, T, Hq, D, generator=g), torch.randn(B, T, Hk, D, generator=g)
    cos, sin = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    dq, dk = torch.randn(B, T, Hq, D, generator=g), torch.randn(B, T, Hk, D, generator=g)

    def run(fn):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qe, ke = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        torch.autograd.backward((qe, ke), (dq.transpose(1, 2), dk.transpose(1, 2)))
        return qe, ke, q.grad, k.grad

    want = run(orig)
    fuse_elementwise(model)
    try:
        got = run(modeling.apply_rotary_pos_emb)
        other = modeling.apply_rotary_pos_emb(q0, k0, cos, sin, unsqueeze_dim=2)  # [B, T, H, D]: the original
    finally:
        restore_rotary()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    for t in got[:2]:
        assert t.transpose(1, 2).is_contiguous(), t.stride()  # [B, H, T, D] views of [B, T, H, D]
    torch.testing.assert_close(other[0], orig(q0, k0, cos, sin, unsqueeze_dim=2)[0])


def test_auto_fuses_on_cuda_only():
    assert should_fuse("auto", "cuda") and not should_fuse("auto", "cpu")
    assert should_fuse("on", "cpu") and not should_fuse("off", "cuda")


def test_elementwise_kernels_compute_the_same_logits_and_gradients(tiny_model_dir, monkeypatch):
    """The frozen model's RMSNorms, SiLU-gated products and rotary embedding through kernels/rmsnorm.py,
    kernels/swiglu.py and kernels/rotary.py (Triton's interpreter here) give the model's own logits and
    input gradients; a trainable norm keeps the model's own code (the kernel computes no weight gradient)."""
    import colora.kernels.rmsnorm as rk
    import colora.kernels.rotary as ro
    import colora.kernels.swiglu as sk

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ids = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(2))
    want = _logits_and_grads(_load(tiny_model_dir).requires_grad_(False), ids)
    calls = {"norm": 0, "swiglu": 0, "rotary": 0}
    for mod, fn, key in ((rk, "_RMSNorm", "norm"), (sk, "_SwiGLU", "swiglu"), (ro, "_Rotary", "rotary")):
        real = getattr(mod, fn).apply
        monkeypatch.setattr(getattr(mod, fn), "apply", lambda *a, real=real, key=key: calls.__setitem__(
            key, calls[key] + 1) or real(*a))
    model = _load(tiny_model_dir).requires_grad_(False)
    fuse_elementwise(model)
    try:
        got = _logits_and_grads(model, ids)
        seen = dict(calls)
        trainable = _load(tiny_model_dir)  # parameters require grad: the norms keep the model's code
        fuse_elementwise(trainable)
        _logits_and_grads(trainable, ids)
    finally:
        restore_rotary()
    n_layers = model.config.num_hidden_layers
    # input, post-attention, q and k norms a layer and the final one; one MLP and one rotary a layer
    assert seen == {"norm": n_layers * 4 + 1, "swiglu": n_layers, "rotary": n_layers}
    # the trainable model: norms the model's own, its MLPs' products and rotary through the kernels
    assert calls["norm"] == seen["norm"] and calls["swiglu"] == 2 * n_layers and calls["rotary"] == 2 * n_layers
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_elementwise_kernels_on_llama(tmp_path, monkeypatch):
    """The same for Llama (SmolLM2's architecture: no q/k norms, its own modeling module's rotary)."""
    import colora.kernels.rotary as ro

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = _tiny_llama(tmp_path)
    ids = torch.randint(0, 60, (2, 9), generator=torch.Generator().manual_seed(4))
    want = _logits_and_grads(_load(path).requires_grad_(False), ids)
    calls = []
    real = ro._Rotary.apply
    monkeypatch.setattr(ro._Rotary, "apply", lambda *a: calls.append(1) or real(*a))
    model = _load(path).requires_grad_(False)
    assert fuse_elementwise(model) == {"rms_norm": 2 * model.config.num_hidden_layers + 1,
                                                     "mlp": model.config.num_hidden_layers, "rotary": 1}
    try:
        got = _logits_and_grads(model, ids)
    finally:
        restore_rotary()
    assert len(calls) == model.config.num_hidden_layers
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
