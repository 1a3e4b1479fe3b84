"""The plain torch reference for grouped LoRA: a per-job loop of matmuls, differentiated by autograd.

It is the CPU trainer's path, the tests' ground truth and the benchmark's "per-job loop" baseline.
Every op is a standard torch op in the inputs' dtype, so it computes what a peft LoRA layer would
compute for the same rows (h = x A^T rounded to the input dtype, then scale * h B^T).
"""

from __future__ import annotations

import torch

from .meta import LoRABatchMeta


def grouped_lora_ref(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, meta: LoRABatchMeta) -> torch.Tensor:
    """y[rows of job j] = scale_j * (x_j @ A_j^T) @ B_j^T; rows of jobs with rank 0 are 0.

    x: [T, d_in], A: [R, d_in], B: [d_out, R] -> y: [T, d_out] in x.dtype.
    """
    T, d_in = x.shape
    R, d_out = A.shape[0], B.shape[0]
    assert A.shape == (R, d_in) and B.shape == (d_out, R), (x.shape, A.shape, B.shape)
    assert T == meta.num_tokens and R == meta.total_rank, (T, meta.num_tokens, R, meta.total_rank)
    parts = []
    for j in range(meta.num_jobs):
        t0, t1 = meta.seg_start[j], meta.seg_start[j + 1]
        r0, r1 = meta.rank_start[j], meta.rank_start[j + 1]
        # empty segments and rank-0 jobs go through the same matmuls (with a 0-sized dim): their
        # rows are 0 and stay connected to the graph, so gradients are zeros rather than None
        h = x[t0:t1] @ A[r0:r1].t()  # [T_j, r_j]
        parts.append((h @ B[:, r0:r1].t()) * meta.scale[j])  # [T_j, d_out]
    return torch.cat(parts, 0)


def grouped_lora_packed_ref(x: torch.Tensor, As: list[torch.Tensor], Bs: list[torch.Tensor],
                            meta: LoRABatchMeta) -> list[torch.Tensor]:
    """One `grouped_lora_ref` per slice (q, k, v): x: [T, d_in], As[s]: [R, d_in], Bs[s]: [d_out_s, R]."""
    return [grouped_lora_ref(x, A, B, meta) for A, B in zip(As, Bs)]
