"""The weight gradients' segment reduction: each job's fp32 partials (of lora_sgrad's row chunks or of the dy pass's
row tiles) summed in a fixed order into its rank rows of dA or dB^T.

The partials are stored in column blocks of the writer's tile width PB, one block after another:
part[n // PB, c, k, n % PB] (a [cdiv(N, PB), chunks, BLOCK_R, PB] buffer), so each tile a writer stores is one
contiguous run and a reduce program reads its job's chunks of one block as one run. The dy pass's atomic
partials (lora_shrink_kernel's PART_ATOMIC) are one chunk a job.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..util import cdiv
from .meta import LoRABatchMeta, Tiles
from .policy import reduce_shape


@triton.jit
def lora_reduce_kernel(
    part_ptr, out_ptr,  # part: fp32 [cdiv(N, PB), n_chunks, BLOCK_R, PB] (blocked), out: [R, N] (strided)
    job_chunk_ptr, rank_start_ptr, scale_ptr,
    N, n_chunks,
    stride_or, stride_on,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PB: tl.constexpr, CHUNKS: tl.constexpr, HAS_SCALE: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out rows of job j = scale_j * sum of its chunks' partials, CHUNKS at a time in chunk order (a
    fixed order: deterministic); a job with rank > 0 and no rows gets zeros. With CHUNKS > 1 a program
    has CHUNKS loads in flight per step instead of one: the sum is a chain of small dependent loads.
    Each program sums ROWS of the BLOCK_R rank rows (grid axis 2: BLOCK_R // ROWS programs)."""
    job = tl.program_id(0)
    pid_n = tl.program_id(1)
    r0 = tl.load(rank_start_ptr + job)
    r = tl.load(rank_start_ptr + job + 1) - r0
    if r == 0:
        return
    c0 = tl.load(job_chunk_ptr + job)
    c1 = tl.load(job_chunk_ptr + job + 1)
    offs_c = tl.arange(0, CHUNKS)
    offs_r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    n0 = pid_n * BLOCK_N  # BLOCK_N divides PB: the program's columns lie in one block
    blk = part_ptr + (n0 // PB).to(tl.int64) * n_chunks * BLOCK_R * PB + n0 % PB
    tile = offs_r[None, :, None] * PB + tl.arange(0, BLOCK_N)[None, None, :]  # [1, ROWS, BLOCK_N]
    for c in range(c0, c1, CHUNKS):
        cs = c + offs_c
        part = blk + cs.to(tl.int64)[:, None, None] * BLOCK_R * PB + tile
        acc += tl.sum(tl.load(part, mask=(cs < c1)[:, None, None] & n_ok[None, None, :], other=0.0), axis=0)
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + job)
    out = out_ptr + (r0 + offs_r)[:, None] * stride_or + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_r < r)[:, None] & n_ok[None, :])


def launch_reduce(part: torch.Tensor, out: torch.Tensor, meta: LoRABatchMeta, chunks: Tiles, br: int, scale: bool,
                  *, shape: tuple[int, int, int] | None = None) -> None:
    """out[rank rows of job j] = (scale_j *) sum of job j's partials in chunk order. part: fp32 [cdiv(N, PB),
    chunks, BLOCK_R, PB] (the blocked layout above), out: [R, N] (any strides), chunks: the table whose
    job_start says which partials are each job's. shape: (BLOCK_N, CHUNKS, ROWS) instead of `reduce_shape`'s
    (the benchmark's baseline; tests); BLOCK_N is capped at PB (powers of 2: it divides PB, so each program's
    columns lie in one block)."""
    N, pb = out.shape[1], part.shape[3]
    if part.shape[0] != cdiv(N, pb) or part.shape[2] != br:
        raise ValueError(f"partials {tuple(part.shape)}: expected [{cdiv(N, pb)}, chunks, {br}, {pb}]")
    block_n, per_step, rows = shape or reduce_shape(meta.num_jobs, N, br, chunks.n, pb)
    block_n = min(block_n, pb)
    lora_reduce_kernel[(meta.num_jobs, cdiv(N, block_n), br // rows)](
        part, out,
        chunks.job_start, meta.rank_start_t, meta.scale_t,
        N, part.shape[1],
        out.stride(0), out.stride(1),
        BLOCK_R=br, BLOCK_N=block_n, PB=pb, CHUNKS=per_step, HAS_SCALE=scale, ROWS=rows,
        num_warps=8 if rows * block_n * per_step >= 16384 else 4,
    )
