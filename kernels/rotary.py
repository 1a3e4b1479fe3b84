"""The rotary embedding of Llama / Qwen3 attention, one Triton launch per tensor each way, results in
the projections' layout.

The attention layers pass q and k as [B, H, T, D] transposed views of the projections' [B, T, H, D]
outputs. torch.compile's version of the model's function (and a layout-keeping compiled one) cost the
H200 ~0.5 ms forward and 0.5-1 ms backward per tensor at 49,152 tokens, several times the bytes moved
(measured at 4139214). Here the outputs and the inputs' gradients are written [B, T, H, D]-contiguous and
returned as the same transposed views, so FlashAttention and the norms' backward take them without a
copy. The trainer's with the other elementwise kernels (colora/training/fusion.py, where the measurement that
chose them is).

The arithmetic of the model's eager code, its roundings included:
    y = round(round(x * cos) + round(rotate_half(x) * sin))
and its gradient as autograd computes it through that graph (cos and sin get none).
`rotary_ref` is the model's function (the tests' reference); the kernel is in rotary_kernels.py.
"""

from __future__ import annotations

import torch

from .util import cdiv, pow2
from .rotary_kernels import rotary_kernel


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Llama's / Qwen3's apply_rotary_pos_emb with unsqueeze_dim=1, operation for operation."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * c) + (rotate_half(q) * s), (k * c) + (rotate_half(k) * s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, H, T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device).transpose(1, 2)  # [B, H, T, D] view
    if y.numel():
        half = D // 2
        block_d = pow2(half)
        block_h = min(pow2(H), max(1, 1024 // block_d))
        stride_cb = cos.stride(0) if cos.shape[0] > 1 else 0
        rotary_kernel[(B * T, cdiv(H, block_h))](
            x, cos, sin, y, T, H,
            x.stride(0), x.stride(1), x.stride(2), stride_cb, cos.stride(1),
            y.stride(0), y.stride(1), y.stride(2),
            HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, BACKWARD=backward, num_warps=4)
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)
        return _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        return (None if dq is None else _rotate(dq, cos, sin, True),
                None if dk is None else _rotate(dk, cos, sin, True), None, None)


def supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary` computes this call: q, k [B, H, T, D] and cos, sin [B or 1, T, D] of one dtype
    and device, D even, cos and sin without gradient, each with unit stride along D."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    B, _, T, D = q.shape
    return (k.shape[0] == B and k.shape[2:] == (T, D) and D % 2 == 0 and cos.shape[1:] == (T, D)
            and cos.shape[0] in (1, B) and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and q.dtype == k.dtype == cos.dtype == sin.dtype and q.device == k.device == cos.device == sin.device
            and not (cos.requires_grad or sin.requires_grad))


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rotary_ref(q, k, cos, sin)`, results as [B, H, T, D] views of [B, T, H, D]-contiguous tensors.
    See `supported` for what it takes (a ValueError otherwise)."""
    if not supported(q, k, cos, sin):
        raise ValueError(f"rotary takes q, k [B, H, T, D] and cos, sin [B or 1, T, D] of one dtype and device, "
                         f"D even, cos/sin without gradient: got q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}")
    return _Rotary.apply(q, k, cos, sin)
