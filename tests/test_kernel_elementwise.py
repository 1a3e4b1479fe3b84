"""RMSNorm, rotary embedding and SiLU*up kernels against the model's own code.

    pytest tests/test_kernel_elementwise.py -q            (CPU: conftest.py sets TRITON_INTERPRET=1 without a GPU)

Small odd shapes (odd widths, empty inputs, all three dtypes). The realistic sweep is
tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEV, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 5, 100), (0, 32), (1, 3)], ids=str)
def test_rms_norm_kernel_matches_the_model_code(dtype, shape):
    """kernels/rmsnorm.py against Hugging Face's RMSNorm arithmetic (rms_norm_ref), forward and the
    input's gradient: fp32 to rounding; bf16/fp16 within one rounding of the output (fp32 rsqrt
    against 1/sqrt can move a value across a rounding boundary), odd widths, 4-D (q/k norms per
    head), empty."""
    from colora.kernels.rmsnorm import rms_norm, rms_norm_ref

    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV).requires_grad_()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(DEV)
    dy = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    y = rms_norm(x, w, 1e-6)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = rms_norm_ref(x_ref, w, 1e-6)
    assert y.shape == y_ref.shape and y.dtype == dtype
    if x.numel() == 0:
        return
    (dx,), (dx_ref,) = torch.autograd.grad(y, x, dy), torch.autograd.grad(y_ref, x_ref, dy)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # fp32: rounding; else one step of a 8/11-bit mantissa
    assert rel_err(y, y_ref) <= tol and rel_err(dx, dx_ref) <= tol
    # a transposed input (not unit stride along the normalised dim) takes the same result
    xt = x.detach().transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() > 1 and shape[-1] > 1 else x.detach()
    assert torch.equal(rms_norm(xt, w, 1e-6), y.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [(1, 16, 8, 37, 128, 1), (2, 3, 1, 5, 16, 2), (2, 4, 2, 9, 24, 1), (1, 2, 2, 0, 8, 1)],
                         ids=["qwen3_heads", "batch2_odd_heads", "batch2_shared_cos_d24", "empty"])
def test_rotary_kernel_matches_the_model_code(dtype, case):
    """kernels/rotary.py against the model's apply_rotary_pos_emb (rotary_ref), forward and both
    inputs' gradients, from q and k laid out as the attention layers pass them ([B, H, T, D] views
    of [B, T, H, D]): fp32 to rounding, bf16/fp16 within one rounding (the kernel rounds where eager
    rounds; an FMA can move a product's last bit); the outputs and gradients in that same layout."""
    from colora.kernels.rotary import rotary, rotary_ref

    B, Hq, Hk, T, D, Bc = case
    g = torch.Generator().manual_seed(B * 100 + Hq * 10 + T)

    def draw(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    q0, k0 = draw(B, T, Hq, D), draw(B, T, Hk, D)
    cos, sin = draw(Bc, T, D), draw(Bc, T, D)
    dq, dk = draw(B, T, Hq, D).transpose(1, 2), draw(B, T, Hk, D).transpose(1, 2)

    def run(fn):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qe, ke = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if T:
            torch.autograd.backward((qe, ke), (dq, dk))
        return qe, ke, q.grad, k.grad

    got, want = run(rotary), run(rotary_ref)
    assert got[0].shape == (B, Hq, T, D) and got[1].shape == (B, Hk, T, D) and got[0].dtype == dtype
    assert got[0].transpose(1, 2).is_contiguous() and got[1].transpose(1, 2).is_contiguous()
    if T == 0:
        return
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol
    # inputs in another layout ([B, H, T, D]-contiguous) take the same result
    qc, kc = q0.transpose(1, 2).contiguous(), k0.transpose(1, 2).contiguous()
    assert all(torch.equal(a, b) for a, b in zip(rotary(qc, kc, cos, sin), got[:2]))


def test_rotary_kernel_refuses_what_it_cannot_compute():
    from colora.kernels.rotary import rotary

    q, k, c = torch.randn(1, 2, 3, 8, device=DEV), torch.randn(1, 1, 3, 8, device=DEV), torch.randn(1, 3, 8, device=DEV)
    with pytest.raises(ValueError, match="rotary takes"):
        rotary(q, k, c.requires_grad_(), c.detach())
    with pytest.raises(ValueError, match="rotary takes"):
        rotary(q, k, c.detach().double(), c.detach().double())
    with pytest.raises(ValueError, match="rotary takes"):
        rotary(q[..., :7], k[..., :7], c.detach()[..., :7], c.detach()[..., :7])


def test_rms_norm_kernel_refuses_what_it_cannot_compute():
    from colora.kernels.rmsnorm import rms_norm

    x = torch.randn(4, 16, device=DEV)
    with pytest.raises(ValueError, match="must be frozen"):
        rms_norm(x, torch.ones(16, device=DEV, requires_grad=True), 1e-6)
    with pytest.raises(ValueError, match=r"must be \[16\]"):
        rms_norm(x, torch.ones(8, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="in x's dtype"):
        rms_norm(x, torch.ones(16, device=DEV, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 1500), (0, 16)], ids=str)
def test_swiglu_kernel_matches_the_model_code(dtype, shape):
    """kernels/swiglu.py against F.silu(gate) * up, forward and both gradients: fp32 to rounding,
    bf16/fp16 within one rounding (the sigmoid's last bit), across block edges, empty."""
    from colora.kernels.swiglu import swiglu, swiglu_ref

    gen = torch.Generator().manual_seed(sum(shape) + 2)
    gate, up, dy = ((torch.randn(*shape, generator=gen) * 3).to(dtype).to(DEV) for _ in range(3))
    got_in = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    ref_in = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    y, y_ref = swiglu(*got_in), swiglu_ref(*ref_in)
    assert y.shape == y_ref.shape and y.dtype == dtype
    if y.numel() == 0:
        return
    got = [y, *torch.autograd.grad(y, got_in, dy)]
    want = [y_ref, *torch.autograd.grad(y_ref, ref_in, dy)]
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol
    with pytest.raises(ValueError, match="must match"):
        swiglu(gate, up[..., :-1])
