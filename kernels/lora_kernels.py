"""Triton kernels of grouped LoRA over rows sorted into per-job segments.

The kernels below serve the forward and the backward of y_j = s_j * (x_j A_j^T) B_j^T (launchers in
`lora_ops.py`, which say which tensor plays which role):

  shrink   h[t, slice*r_j + k]  = (s_j *) sum_i x[t, i] W[rank_start[j] + k, i]    (x A^T; dy B)
           optionally fused with sgrad's partial over its row tile             (+ h^T dy)
           and with the expand of the h tile it computed (one slice)          (+ h B^T; dh A)
  sgrad    partial[c, k, n]     = sum_{t in chunk c} p[t, slice*r_j + k] q[t, n]  (h^T dy; dh^T x)
           or the expand of a chunk of rows, one [BLOCK_T, BLOCK_N] tile after another:
           y[t, n]             (+)= (s_j *) sum_k p[t, slice*r_j + k] W[n, rank_start[j] + k]
                                                                                  (h B^T; dh A)
  reduce   out[rank_start[j] + k, n] = (s_j *) sum_{chunks c of job j} partial[c, k, n]  (in chunk order)
  stream   the shrink with its expand (and the dy pass's dB partial) on persistent programs over full row tiles,
           x / dy and the weights through TMA descriptors, nothing masked (batches whose every rank is BLOCK_R;
           the default at BLOCK_R 64: lora_ops.stream_config)

The fp32 partials are stored in column blocks of the writer's tile width PB, one block after another:
part[n // PB, c, k, n % PB] (a [cdiv(N, PB), chunks, BLOCK_R, PB] buffer), so each tile a writer
stores is one contiguous run and a reduce program reads its job's chunks of one block as one run.
The shrink's fused sgrad (PART_ATOMIC) may instead add every tile's partial atomically into one
partial a job (c = job), which the reduce then reads as one chunk a job.

Every program handles rows of exactly one job (tiles from `LoRABatchMeta.tiles`), so each tile is a
dense matmul against that job's slice of the stacked weights. Ranks are padded to BLOCK_R >= 16
(tl.dot's minimum) with masks on k < r_j on the weight side. The h / p side is read WITHOUT a rank
mask (a mask along the contiguous dim would split every load into 2-byte loads): the caller
guarantees that columns [slice*r_j, slice*r_j + BLOCK_R) of every row exist and are finite (zero-
initialised h), so the padding lanes multiply zeros (expand) or land in accumulator rows that are
never stored (sgrad). Row offsets are int64: T * stride reaches 2^31 at 700k tokens of width 3072.
Accumulation is fp32; fp32 inputs use IEEE dots, not tf32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b. PRECISION "upcast" is for Triton's CPU interpreter, whose bf16 dot is wrong
    (seen with Triton 3.9): fp32 operands give the same sums, as bf16 products are exact in fp32."""
    if PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tile_of(tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr, pid, block):
    """(job, first row, end row, first rank row, rank) of tile `pid` (tiles of `block` rows)."""
    job = tl.load(tile_job_ptr + pid)
    row0 = tl.load(tile_row_ptr + pid)
    row_end = tl.minimum(row0 + block, tl.load(seg_start_ptr + job + 1))
    r0 = tl.load(rank_start_ptr + job)
    r = tl.load(rank_start_ptr + job + 1) - r0
    return job, row0, row_end, r0, r


@triton.jit
def lora_shrink_kernel(
    x_ptr, w_ptr, h_ptr,  # x: [T, K], w: [R, K] (strided), h: [T, H]
    p_ptr, part_ptr,  # FUSE_SGRAD only: p: [T, P] (h of the forward), part: fp32 (blocked: see below)
    w2_ptr, y_ptr,  # FUSE_EXPAND only: w2: [N2, R] (strided), y: [T, N2] (strided)
    tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr, scale_ptr,
    K, h_slice, N2, n_part,
    stride_xm, stride_xk, stride_wr, stride_wk, stride_hm, stride_pm,
    stride_w2n, stride_w2r, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_SCALE: tl.constexpr, FUSE_SGRAD: tl.constexpr, PRECISION: tl.constexpr,
    FUSE_EXPAND: tl.constexpr, BLOCK_N2: tl.constexpr, EXPAND_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr,
    PART_ATOMIC: tl.constexpr = False,
):
    """shrink; with FUSE_SGRAD also part[tile] = p_tile^T x_tile (the sgrad partial of this row
    tile), so the backward reads dy once for both dh and dB; with FUSE_EXPAND also the expand of
    the h tile just computed (rounded to h's dtype, as the separate expand reads it) into y, so
    each row tile is read and its output written by one program (x -> h -> y, dy -> dh -> dx)."""
    pid = tl.program_id(0)
    job, row0, row_end, r0, r = _tile_of(tile_job_ptr, tile_row_ptr, seg_start_ptr, rank_start_ptr, pid, BLOCK_M)
    if not FUSE_EXPAND:
        if r == 0:  # nothing of h belongs to a rank-0 job; its y rows are zeroed by expand
            return
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < row_end
    rows = rows.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < r
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + (r0 + offs_r)[None, :] * stride_wr + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_R]
    if FUSE_SGRAD:
        pt = tl.load(p_ptr + rows[:, None] * stride_pm + (h_slice * r + offs_r)[None, :],
                     mask=row_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_R], lanes >= r unused
        pt = tl.trans(pt)  # [BLOCK_R, BLOCK_M]
        # blocked layout (module docstring): [cdiv(K, BLOCK_K), n_part, BLOCK_R, BLOCK_K], one partial a tile,
        # or with PART_ATOMIC one a job, zeroed and added to atomically (a multiple of BLOCK_R x BLOCK_K
        # apart, so the compiler knows the pointers' alignment and vectorises the stores)
        part_step = tl.cast(n_part, tl.int64) * BLOCK_R * BLOCK_K
        part_row = job if PART_ATOMIC else pid
        part_ptrs = part_ptr + part_row.to(tl.int64) * BLOCK_R * BLOCK_K + offs_r[:, None] * BLOCK_K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_end = tl.where(r > 0, K, 0)  # a rank-0 job's tile (FUSE_EXPAND only) reads nothing, writes zeros
    for k0 in range(0, k_end, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs, mask=r_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        acc = _dot(xt, wt, acc, PRECISION)
        if FUSE_SGRAD:
            pb = _dot(pt, xt, tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32), PRECISION)  # [BLOCK_R, BLOCK_K]
            if PART_ATOMIC:
                if EVEN_K:
                    tl.atomic_add(part_ptrs, pb, sem="relaxed")
                else:
                    tl.atomic_add(part_ptrs, pb, mask=k_ok[None, :], sem="relaxed")
            elif EVEN_K:
                tl.store(part_ptrs, pb)
            else:
                tl.store(part_ptrs, pb, mask=k_ok[None, :])
            part_ptrs += part_step
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + job)
    hb = acc.to(h_ptr.dtype.element_ty)  # lanes >= r are 0: their weights were masked to 0
    h_ptrs = h_ptr + rows[:, None] * stride_hm + (h_slice * r + offs_r)[None, :]
    tl.store(h_ptrs, hb, mask=row_ok[:, None] & r_ok[None, :])
    if FUSE_EXPAND:  # y[tile] (+)= (s_j *) hb @ w2[:, r0:r0+r]^T, BLOCK_N2 columns at a time
        if EXPAND_SCALE:
            s2 = tl.load(scale_ptr + job)
        offs_n = tl.arange(0, BLOCK_N2)
        w2_ptrs = w2_ptr + offs_n[None, :] * stride_w2n + (r0 + offs_r)[:, None] * stride_w2r  # [BLOCK_R, BLOCK_N2]
        y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn  # [BLOCK_M, BLOCK_N2]
        for n0 in range(0, N2, BLOCK_N2):
            n_ok = offs_n < N2 - n0
            w2t = tl.load(w2_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            yacc = _dot(hb, w2t, tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32), PRECISION)
            if EXPAND_SCALE:
                yacc = yacc * s2
            mask = row_ok[:, None] & n_ok[None, :]
            if ACCUMULATE:
                yacc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, yacc.to(y_ptr.dtype.element_ty), mask=mask)
            w2_ptrs += BLOCK_N2 * stride_w2n
            y_ptrs += BLOCK_N2 * stride_yn


@triton.jit
def lora_stream_kernel(
    x, w, h_ptr, p_ptr, part_ptr, w2, y_ptr,  # x: [T, K], w: [R, K], w2: [N2, R] (W2_NR) or [R, N2] descriptors
    tile_job_ptr, tile_row_ptr, rank_start_ptr, scale_ptr,
    n_tiles, programs, K, N2, n_part,
    stride_hm, stride_pm, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N2: tl.constexpr,
    W2_NR: tl.constexpr, EVEN_N2: tl.constexpr, FUSE_SGRAD: tl.constexpr,
    HAS_SCALE: tl.constexpr, EXPAND_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """lora_shrink_kernel's shrink with its expand (x -> h -> y; dy -> dh -> dx) and, with FUSE_SGRAD, the
    atomic dB partial of the dy pass (PART_ATOMIC: one fp32 partial a job), on `programs` persistent programs
    over FULL row tiles (BLOCK_M rows of one job each) of a batch whose every rank is BLOCK_R: nothing is
    masked but y's columns past N2 (not EVEN_N2), so h, dh and y are stored as whole tiles. x, w and w2 are
    TMA tensor descriptors (blocks [BLOCK_M, BLOCK_K], [BLOCK_R, BLOCK_K], and [BLOCK_N2, BLOCK_R] with W2_NR
    (the forward's B) or [BLOCK_R, BLOCK_N2] (the backward's A)); columns past K or N2 are zero-filled. The
    launcher gives the tiles of fewer rows (a job's last) to lora_shrink_kernel. p: [T, P] (h of the forward),
    part as lora_shrink_kernel's with PART_ATOMIC."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N2)
    for tile in tl.range(tl.program_id(0), n_tiles, programs):
        job = tl.load(tile_job_ptr + tile)
        row0 = tl.load(tile_row_ptr + tile)
        r0 = tl.load(rank_start_ptr + job)
        rows = (row0 + offs_m).to(tl.int64)
        if FUSE_SGRAD:
            pt = tl.trans(tl.load(p_ptr + rows[:, None] * stride_pm + offs_r[None, :]))  # [BLOCK_R, BLOCK_M]
            part_ptrs = part_ptr + job.to(tl.int64) * BLOCK_R * BLOCK_K + offs_r[:, None] * BLOCK_K + offs_k[None, :]
            part_step = tl.cast(n_part, tl.int64) * BLOCK_R * BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xt = x.load([row0, k0])
            acc = _dot(xt, tl.trans(w.load([r0, k0])), acc, PRECISION)
            if FUSE_SGRAD:  # columns past K are zeros: their partial lanes add nothing
                pb = _dot(pt, xt, tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32), PRECISION)
                tl.atomic_add(part_ptrs, pb, sem="relaxed")
                part_ptrs += part_step
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + job)
        hb = acc.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + rows[:, None] * stride_hm + offs_r[None, :], hb)
        if EXPAND_SCALE:
            s2 = tl.load(scale_ptr + job)
        for n0 in range(0, N2, BLOCK_N2):
            if W2_NR:
                w2t = tl.trans(w2.load([n0, r0]))
            else:
                w2t = w2.load([r0, n0])
            yacc = _dot(hb, w2t, tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32), PRECISION)
            if EXPAND_SCALE:
                yacc = yacc * s2
            y_ptrs = y_ptr + rows[:, None] * stride_ym + (n0 + offs_n)[None, :]
            if EVEN_N2:
                if ACCUMULATE:
                    yacc += tl.load(y_ptrs).to(tl.float32)
                tl.store(y_ptrs, yacc.to(y_ptr.dtype.element_ty))
            else:
                n_ok = (offs_n < N2 - n0)[None, :]
                if ACCUMULATE:
                    yacc += tl.load(y_ptrs, mask=n_ok, other=0.0).to(tl.float32)
                tl.store(y_ptrs, yacc.to(y_ptr.dtype.element_ty), mask=n_ok)


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
    """One chunk of one job's rows, BLOCK_N columns: partial[c] = p_chunk^T q_chunk (SGRAD). Split over
    rows (not atomics) keeps the weight gradients deterministic while filling the GPU when one job owns
    all rows. With EXPAND also y[t, n] (+)= (s_j *) sum_k p[t, p_slice*r_j + k] w[n, rank_start[j] + k]
    for the same rows and columns, one BLOCK_T tile after another: dA = dh^T x and dx = dh A in one pass
    that reads each x tile and writes the dx tile of the same rows and columns (as a copy does), or,
    without SGRAD, the expand alone on long programs that load their weight tile once."""
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
