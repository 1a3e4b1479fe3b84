"""Shared by the kernel tests (CPU and GPU): the kernels package K (interpreted where there is no GPU),
the device and dtypes, random grouped-LoRA problems, the tolerance table, and the error measure.

Errors are ||out - ref|| / ||ref|| against the reference run in float64 on the same (rounded)
inputs. One tolerance per dtype, each set by what the dtype's rounding allows, not by what the
kernel happened to hit; the torch loop in the same dtype must pass the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from colora.kernels import LoRABatchMeta
from colora.kernels.backend import interpreted_kernels

K = interpreted_kernels()  # re-imports the kernels if a test module imported them compiled
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

LORA_TOL = {
    # fp32 in, IEEE fp32 dots and fp32 accumulation: only the summation order differs (K <= 3072
    # terms, about sqrt(K) * 6e-8; 1.5e-7 seen at K = 40).
    torch.float32: 2e-5,
    # fp16: h = x A^T and y are each rounded to fp16 (unit roundoff 4.9e-4); the backward rounds
    # dh and then dx / dA again: at most three roundings in a chain, 1.5e-3 (3e-4 seen).
    torch.float16: 1.5e-3,
    # bf16: the same chain with unit roundoff 3.9e-3, 1.2e-2; doubled to 2e-2 because Triton's CPU
    # interpreter truncates fp32 -> bf16 instead of rounding to nearest (seen with 3.9; the GPU
    # rounds to nearest). Seen: 6e-3 interpreted, 3e-3 for the torch loop.
    torch.bfloat16: 2e-2,
}

LOGSOFTMAX_TOL = {
    # (logp and entropy: max abs error, d hidden: relative error) against fp64 on the same inputs.
    # fp32: fp32 logits and softmax, only summation orders differ (2e-6 / 6e-7 seen at d = 24).
    torch.float32: (5e-5, 5e-5),
    # bf16 / fp16: both paths round the logits to the input dtype, as an LM head does, and that
    # rounding (not the kernel) is the error against fp64: 2^-9 of |z| ~ 10 is 0.02 for bf16
    # (2.5e-2 seen, the same for the torch path), 2^-12 * 10 = 2.4e-3 for fp16. d hidden is
    # formed from dlogits rounded to the input dtype (as autograd through .float() does): one
    # more rounding, 8e-3 (bf16) and 9e-4 (fp16) seen. On the H200 (2026-11-29) the GPU test's
    # inputs reached |z| of about 30 (one bf16 step there is 0.125, half a step 0.0625, and the
    # logsumexp adds its own): 0.091 seen for logp and 0.094 for entropy, so the bound is one full
    # bf16 step at that magnitude, 0.125, kept under 2x the error seen.
    torch.bfloat16: (1.25e-1, 3e-2),
    torch.float16: (1e-2, 5e-3),
}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (0 when both are empty or zero)."""
    got, ref = got.detach().double(), ref.detach().double()
    den = ref.norm().item()
    num = (got - ref).norm().item()
    return num / den if den > 0 else num


@dataclass
class LoRACase:
    meta: LoRABatchMeta
    x: torch.Tensor  # [T, d_in]
    A: torch.Tensor  # [R, d_in]
    B: torch.Tensor  # [d_out, R]
    dy: torch.Tensor  # [T, d_out]

    def double(self) -> LoRACase:
        return LoRACase(self.meta, *(t.detach().double().requires_grad_(t.requires_grad)
                                     for t in (self.x, self.A, self.B)), self.dy.double())


def lora_case(tokens: list[int], ranks: list[int], d_in: int, d_out: int, dtype: torch.dtype,
              device: torch.device | str, seed: int) -> LoRACase:
    """A random problem: job j has tokens[j] rows and rank ranks[j]; scales vary per job. B is
    random (not PEFT's zero init) so every path carries signal; values are O(1) at every stage."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where used: GPU cases reach 2e9 values
    seg, rs = [0], [0]
    for t, r in zip(tokens, ranks):
        seg.append(seg[-1] + t)
        rs.append(rs[-1] + r)
    scale = (torch.rand(len(tokens), generator=g, device=device) * 2 + 0.25).tolist()
    meta = LoRABatchMeta.build(seg, rs, scale, device)
    T, R = seg[-1], rs[-1]

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=device) * s).to(dtype)

    x = rnd(T, d_in).requires_grad_()
    A = rnd(R, d_in, s=d_in ** -0.5).requires_grad_()
    B = rnd(d_out, R, s=max(max(ranks), 1) ** -0.5).requires_grad_()
    return LoRACase(meta, x, A, B, rnd(T, d_out))


def lora_grads(fn, case: LoRACase, **kw) -> dict[str, torch.Tensor]:
    """y and (dx, dA, dB) of fn(x, A, B, meta=...) for the case's upstream gradient dy."""
    y = fn(case.x, case.A, case.B, meta=case.meta, **kw)
    dx, dA, dB = torch.autograd.grad(y, (case.x, case.A, case.B), case.dy, allow_unused=True)
    zero = torch.zeros_like
    return {"y": y.detach(), "dx": zero(case.x) if dx is None else dx, "dA": zero(case.A) if dA is None else dA,
            "dB": zero(case.B) if dB is None else dB}
