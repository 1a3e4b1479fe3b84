"""silu(gate) * up, one Triton launch forward and one backward: the trainer's MLP activation a layer,
which torch.compile also fuses into one kernel each way but calls through Dynamo's guards and
AOTAutograd's and Inductor's wrappers, the step's host time (see rmsnorm.py). The trainer's with the
other elementwise kernels (colora/training/fusion.py, where the measurement that chose them is).

The arithmetic of the model's `act_fn(gate) * up` with each result rounded to the inputs' dtype as
eager torch rounds it: y = round(round(silu(g)) * u); du = round(dy * round(silu(g))),
dg = round(round(dy * u) * silu'(g)). `swiglu_ref` is the same in plain torch (the tests' reference);
the kernels are in swiglu_kernels.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .util import cdiv
from .swiglu_kernels import swiglu_bwd_kernel, swiglu_fwd_kernel

BLOCK = 1024


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # contiguous, same shape and dtype
        y = torch.empty_like(gate)
        n = gate.numel()
        if n:
            swiglu_fwd_kernel[(cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            swiglu_bwd_kernel[(cdiv(n, BLOCK),)](dy, gate, up, dg, du, n, BLOCK=BLOCK)
        return dg, du


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`swiglu_ref(gate, up)` in one launch each way. gate, up: the same shape and dtype (bf16, fp16
    or fp32), on one device."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} on {gate.device} and up {tuple(up.shape)} "
                         f"{up.dtype} on {up.device} must match")
    return _SwiGLU.apply(gate.contiguous(), up.contiguous())
