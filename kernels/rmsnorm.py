"""RMSNorm with a frozen weight, one Triton launch forward and one backward: the trainer's four norms
a layer (input, post-attention, q and k per head), which torch.compile fuses just as well on the GPU
but calls through Dynamo's guards, AOTAutograd's wrappers and Inductor's launcher: about 0.5 ms of
host time per call and its backward on the H200 (measured at c41a630: 167 us a compiled call,
286 us its backward, 47 us Dynamo's cache lookup; the step bound by host work), against one
`autograd.Function` and two launches here. The trainer's with the other elementwise kernels
(colora/training/fusion.py, where the measurement that chose them is).

The arithmetic of Hugging Face's Qwen3RMSNorm / LlamaRMSNorm, its roundings included (the tests:
equal within one rounding of the output, where fp32 rsqrt's last bit moves a value across one):
    y = w * bf16(x32 * rsqrt(mean(x32^2) + eps))       (bf16: x's dtype; the product rounded to it)
and the gradient of x as autograd computes it through that graph (the frozen weight gets none):
    g = round(dy * w);  dx = round(rstd * (g - xhat * mean(g * xhat))),  xhat = x32 * rstd.
`rms_norm_ref` is the same in plain torch (the tests' reference); the kernels are in rmsnorm_kernels.py.
"""

from __future__ import annotations

import torch

from .util import cdiv, pow2
from .rmsnorm_kernels import rms_norm_bwd_kernel, rms_norm_fwd_kernel


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm forward, operation for operation (x: [..., N], weight: [N])."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _blocks(N: int) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N columns, warps) of a program: about 2,048 values each (16 rows of the q
    and k norms' 128), one row of up to 16,384 where rows are long."""
    block_n = pow2(N)
    return max(1, 2048 // block_n), block_n, 4 if block_n <= 2048 else 8


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps):  # x2: [rows, N] with unit stride along N, weight: [N]
        M, N = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(M, dtype=torch.float32, device=x2.device)
        block_m, block_n, warps = _blocks(N)
        if M:
            rms_norm_fwd_kernel[(cdiv(M, block_m),)](x2, weight, y, rstd, M, N, x2.stride(0), y.stride(0), eps,
                                                            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        ctx.save_for_backward(x2, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dx = torch.empty_like(x2)
        block_m, block_n, warps = _blocks(N)
        if M:
            rms_norm_bwd_kernel[(cdiv(M, block_m),)](dy, x2, weight, rstd, dx, M, N, dy.stride(0), x2.stride(0),
                                                            dx.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                                                            num_warps=warps)
        return dx, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_ref(x, weight, eps)` in one launch each way, for a frozen `weight` (no gradient).
    x: [..., N] in bf16/fp16/fp32 with N <= 16384, weight: [N] in x's dtype, on x's device."""
    if weight.requires_grad:
        raise ValueError("rms_norm's weight must be frozen (requires_grad=False): it computes no weight gradient")
    N = x.shape[-1]
    if weight.shape != (N,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device} must be [{N}] "
                         f"in x's dtype {x.dtype} on {x.device}")
    if N > 16384:
        raise ValueError(f"rms_norm normalises rows of at most 16384 values in one program, got {N}")
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return _RMSNorm.apply(x2, weight, float(eps)).view(x.shape)
