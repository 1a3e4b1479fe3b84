"""Row-chunk passes of grouped LoRA (lora_sgrad_kernel): a program takes a chunk of one job's rows and BLOCK_N
columns and either forms the weight gradient's fp32 partial over the chunk (sgrad: dA = dh^T x, dB^T = h^T dy,
summed per job by reduce.py) or writes the expand of the chunk's rows one [BLOCK_T, BLOCK_N] tile after another,
its weight tile loaded once (y = h B^T, dx = dh A where they do not fuse into the shrink).

  sgrad    partial[c, k, n] = sum_{t in chunk c} p[t, slice*r_j + k] q[t, n]              (h^T dy; dh^T x)
  expand   y[t, n]        (+)= (s_j *) sum_k p[t, slice*r_j + k] W[n, rank_start[j] + k]   (h B^T; dh A)

Split over rows (not atomics), the weight gradients are deterministic while filling the GPU when one job owns
all rows. Tiles and chunks: policy.rows_config.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..util import cdiv
from .common import _dot, _tile_of, block_r, check_2d, check_expand, precision
from .meta import LoRABatchMeta
from .policy import Launch, rows_config
from .reduce import launch_reduce


@triton.jit
def lora_sgrad_kernel(
    p_ptr, q_ptr, part_ptr,  # p: [T, H], q: [T, N], part: fp32 [cdiv(N, BLOCK_N), chunks, BLOCK_R, BLOCK_N]
    w_ptr, y_ptr, scale_ptr,  # EXPAND only: w: [N, R] (strided), y: [T, N] (strided)
    tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr,
    N, p_slice, chunk,
    stride_pm, stride_qm, stride_qn, stride_wn, stride_wr, stride_ym, stride_yn,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SGRAD: tl.constexpr = True, EXPAND: tl.constexpr = False,
    EXPAND_SCALE: tl.constexpr = False, ACCUMULATE: tl.constexpr = False,
):
    """One chunk of one job's rows, BLOCK_N columns: partial[c] = p_chunk^T q_chunk (SGRAD), or with EXPAND
    (and not SGRAD) y[t, n] (+)= (s_j *) sum_k p[t, p_slice*r_j + k] w[n, rank_start[j] + k] for the chunk's
    rows, one BLOCK_T tile after another, the weight tile loaded once."""
    pid_c = tl.program_id(0)
    pid_n = tl.program_id(1)
    job, row0, row_end, r0, r = _tile_of(tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr, pid_c, chunk)
    if not EXPAND:
        if r == 0:  # reduce skips rank-0 jobs, so their partials are never read
            return
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_t = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    if EXPAND:  # a rank-0 job's weight tile is all zeros: its rows get y = 0 (or keep y when accumulating)
        wt = tl.load(w_ptr + offs_n[None, :] * stride_wn + (r0 + offs_r)[:, None] * stride_wr,
                     mask=(offs_r < r)[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
        if EXPAND_SCALE:
            s2 = tl.load(scale_ptr + job)
    for t0 in range(row0, row_end, BLOCK_T):
        rows = t0 + offs_t
        t_ok = rows < row_end
        rows = rows.to(tl.int64)
        pt = tl.load(p_ptr + rows[:, None] * stride_pm + (p_slice * r + offs_r)[None, :],
                     mask=t_ok[:, None], other=0.0)  # [BLOCK_T, BLOCK_R], lanes >= r unused (finite: EXPAND)
        if SGRAD:
            qt = tl.load(q_ptr + rows[:, None] * stride_qm + offs_n[None, :] * stride_qn,
                         mask=t_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_T, BLOCK_N]
            acc = _dot(tl.trans(pt), qt, acc, PRECISION)
        if EXPAND:
            yacc = _dot(pt, wt, tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32), PRECISION)
            if EXPAND_SCALE:
                yacc = yacc * s2
            y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
            mask = t_ok[:, None] & n_ok[None, :]
            if ACCUMULATE:
                yacc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, yacc.to(y_ptr.dtype.element_ty), mask=mask)
    if SGRAD:
        # blocked layout (module docstring): [cdiv(N, BLOCK_N), chunks, BLOCK_R, BLOCK_N]
        blk = (pid_n.to(tl.int64) * tl.num_programs(0) + pid_c) * BLOCK_R * BLOCK_N
        part = part_ptr + blk + offs_r[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part, acc, mask=n_ok[None, :])



def lora_sgrad(p: torch.Tensor, q: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, *,
               p_slice: int = 0, scale: bool = False, chunk: int | None = None,
               launch: Launch | None = None) -> torch.Tensor:
    """out[rank_start[j] + k, n] = (scale_j *) sum_{t in job j} p[t, p_slice*r_j + k] * q[t, n].

    p: [T, H] (h or dh; as h in lora_expand), q: [T, N] (dy or x), out: [R, N] (any strides: dA,
    or dB^T). Every row of out is written (zeros for a job without rows). Two launches: per-chunk
    fp32 partials, then a per-job sum in chunk order, so the result does not depend on scheduling.
    chunk: rows a program (policy.sgrad_chunk's by default).
    """
    T, N = q.shape
    check_2d(meta, p, "p", meta.num_tokens)
    check_2d(meta, q, "q", meta.num_tokens)
    if out.shape != (meta.total_rank, N):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected [total rank {meta.total_rank}, {N}]")
    br = block_r(meta.max_rank)
    if p.shape[1] < p_slice * meta.max_rank + br or p.stride(1) != 1:
        raise ValueError(f"p {tuple(p.shape)} must be row-major with at least {p_slice * meta.max_rank + br} "
                         "columns (h_width), finite everywhere")
    if not (p.dtype == q.dtype):
        raise ValueError(f"dtypes differ: p {p.dtype}, q {q.dtype}")
    if meta.total_rank == 0:
        return out
    cfg = rows_config("sgrad", meta, N, p.dtype, launch, chunk)
    part, chunks = _launch_rows(p, meta, p_slice, cfg, q=q)
    launch_reduce(part, out, meta, chunks, br, scale)
    return out


def lora_expand(h: torch.Tensor, w: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, *,
                h_slice: int = 0, scale: bool = False, accumulate: bool = False,
                launch: Launch | None = None) -> torch.Tensor:
    """out[t, n] (+)= (scale_j *) sum_k h[t, h_slice*r_j + k] * w[n, rank_start[j] + k] for t in job j.

    h: [T, H >= h_slice * max_rank + BLOCK_R], finite in every column (zero-filled before the
    shrink); w: [N, R] (any strides: B, or A^T for dx; fastest when the N dim has stride 1);
    out: [T, N] (any strides). Every row of out is written, rows of rank-0 jobs with 0 (or left
    unchanged when accumulating).
    """
    N = w.shape[0]
    check_expand(h, w, meta, out, h_slice)
    _launch_rows(h, meta, h_slice, rows_config("expand", meta, N, h.dtype, launch), expand=(w, out, scale, accumulate))
    return out


def _launch_rows(p, meta, p_slice, cfg, *, q=None, expand=None):
    """lora_sgrad_kernel over chunks of cfg["chunk"] rows and cfg["block_n"] columns: the sgrad's
    partials of p^T q where q is given, or else the expand (w, y, scale, accumulate). Returns (the
    partials or None, the chunks' table)."""
    br = block_r(meta.max_rank)
    block_n, chunk = cfg["block_n"], cfg["chunk"]
    w, y, scale2, accumulate = expand or (p, p, False, False)
    N = q.shape[1] if q is not None else w.shape[0]
    n_tiles_n = cdiv(N, block_n)
    chunks = meta.tiles(chunk)
    part = None
    if q is not None:
        part = torch.empty((n_tiles_n, max(chunks.n, 1), br, block_n), dtype=torch.float32, device=p.device)
    if chunks.n > 0:
        lora_sgrad_kernel[(chunks.n, n_tiles_n)](
            p, q if q is not None else p, part if q is not None else p, w, y, meta.scale_t,
            chunks.job, chunks.row, meta.seg_start_t, meta.rank_start_t,
            N, p_slice, chunk,
            p.stride(0), q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0,
            w.stride(0) if expand else 0, w.stride(1) if expand else 0,
            y.stride(0) if expand else 0, y.stride(1) if expand else 0,
            BLOCK_T=cfg["block_t"], BLOCK_R=br, BLOCK_N=block_n, PRECISION=precision(p.dtype, p.device),
            SGRAD=q is not None, EXPAND=expand is not None, EXPAND_SCALE=scale2, ACCUMULATE=accumulate,
            num_warps=cfg["warps"], num_stages=cfg["stages"],
        )
    return part, chunks
