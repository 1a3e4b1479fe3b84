"""The shrink family of grouped LoRA (lora_shrink_kernel), one program a row tile of one job:

  shrink   h[t, slice*r_j + k] = (s_j *) sum_i x[t, i] W[rank_start[j] + k, i]    (x A^T; dy B)
           optionally with sgrad's partial over its row tile                    (+ h^T dy: the dy pass's dB)
           and with the expand of the h tile it computed (one slice)           (+ h B^T; dh A)

and its launchers. The weights are passed as strided views, so the same kernel serves forward and backward
(Bt = B^T made contiguous once per forward):
  forward   h  = shrink(x, A)             y  = expand(h, Bt^T, scale)       (lora_shrink_expand: one launch)
  backward  dh = shrink(dy, Bt, scale)    dB^T = sgrad(h, dy, scale)        (lora_shrink_sgrad: one pass over dy)
                                          dx = expand(dh, A^T)              (its dx: in the same pass)
Where every rank of the batch is BLOCK_R the full tiles go to lora_stream_kernel (stream.py) and each job's
short last tile comes here. Tiles, warps and stages: policy.shrink_config.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..util import cdiv, pow2
from .common import _dot, _tile_of, block_r, check_2d, check_expand, check_shrink, precision
from .meta import LoRABatchMeta, Tiles
from .policy import Launch, atomic_db, shrink_config
from .reduce import launch_reduce
from .stream import launch_stream, stream_config


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



def lora_shrink(x: torch.Tensor, w: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, *,
                h_slice: int = 0, scale: bool = False, launch: Launch | None = None) -> torch.Tensor:
    """out[t, h_slice*r_j + k] = (scale_j *) sum_i x[t, i] * w[rank_start[j] + k, i] for t in job j.

    x: [T, K], w: [R, K] (any strides: A, or B^T for dh; fastest when K has stride 1), out: [T, H]
    with H >= (h_slice+1) * max_rank. Columns of out outside each job's slice are left as they were.
    """
    cfg = shrink_config(meta, x.dtype, x.shape[1], 0, launch=launch)
    _launch_shrink(x, w, meta, out, h_slice, scale, cfg)
    return out


def lora_shrink_expand(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, meta: LoRABatchMeta, h: torch.Tensor,
                       out: torch.Tensor, *, scale_h: bool = False, scale_out: bool = False,
                       accumulate: bool = False, launch: Launch | None = None) -> torch.Tensor:
    """h = lora_shrink(x, w, scale=scale_h) and out (+)= lora_expand(h, w2, scale=scale_out) in one
    launch (one slice: h_slice 0): each program reads its row tile of x and writes the same rows of
    out, so the op's reads and writes interleave as in a copy (the separate expand is a write-only
    pass). Forward: x, A, B -> h, y; backward: dy, B^T (scale_h), A^T -> dh, dx. w2: [N, R], out: [T, N]."""
    check_expand(h, w2, meta, out, 0)
    exp = (w2, out, scale_out, accumulate)
    K, N2 = x.shape[1], w2.shape[0]
    stream = stream_config("stream", x, w, w2, out, meta, launch)
    if stream is None:
        _launch_shrink(x, w, meta, h, 0, scale_h, shrink_config(meta, x.dtype, K, N2, launch=launch), exp=exp)
        return out
    short, block_k = launch_stream(x, w, w2, meta, h, out, stream, scale_h, scale_out, accumulate)
    cfg = shrink_config(meta, x.dtype, K, N2, launch=launch, rows=stream["block_m"], block_k=block_k)
    _launch_shrink(x, w, meta, h, 0, scale_h, cfg, exp=exp, tiles=short)
    return out


def lora_shrink_sgrad(dy: torch.Tensor, Bt: torch.Tensor, h: torch.Tensor, meta: LoRABatchMeta, dh: torch.Tensor,
                      dBt: torch.Tensor, *, h_slice: int = 0, dx: tuple | None = None,
                      launch: Launch | None = None) -> None:
    """dh = lora_shrink(dy, Bt, scale=True) and dBt = lora_sgrad(h, dy, scale=True) in one pass over dy.

    dy: [T, N], Bt: [R, N] (B^T), h: [T, H] as for lora_expand, dh: [T, H'] (written in its slice),
    dBt: [R, N] (any strides: pass dB.t()). Each program forms its row tile's part of dB in fp32
    (BLOCK_R x N) and, where `atomic_db`, adds it atomically to one fp32 partial a job, which stays in
    L2; else it writes it (reduce.py's blocked layout) for the reduce to sum in tile order.
    Tiles of 256 rows once there are enough of them (policy.dy_pass_block_m); see policy.fuse_dy_pays.
    dx: (A^T [d_in, R], dx [T, d_in], accumulate) to also write dx (+)= dh A from each tile (one
    slice only, h_slice 0), as `lora_shrink_expand` does.
    """
    if dx is not None:
        if h_slice != 0:
            raise ValueError("the dx expand fuses into the dy pass of one slice only (h_slice 0)")
        check_expand(dh, dx[0], meta, dx[1], 0)
    check_2d(meta, h, "h", meta.num_tokens)
    br = block_r(meta.max_rank)
    if h.shape[1] < h_slice * meta.max_rank + br or h.stride(1) != 1 or h.dtype != dy.dtype:
        raise ValueError(f"h {tuple(h.shape)} {h.dtype} must be row-major with at least "
                         f"{h_slice * meta.max_rank + br} columns (h_width) and dy's dtype {dy.dtype}")
    if dBt.shape != Bt.shape:
        raise ValueError(f"dBt has shape {tuple(dBt.shape)}, expected {tuple(Bt.shape)}")
    N, N2 = dy.shape[1], 0 if dx is None else dx[0].shape[0]
    exp = None if dx is None else (*dx[:2], False, dx[2])
    atomic = atomic_db()
    stream = stream_config("stream_dy", dy, Bt, dx[0], dx[1], meta, launch) if (dx is not None and atomic) else None
    if stream is None:
        cfg = shrink_config(meta, dy.dtype, N, N2, dy_pass=True, launch=launch)
    else:
        cfg = shrink_config(meta, dy.dtype, N, N2, dy_pass=True, launch=launch, rows=stream["block_m"],
                            block_k=min(stream["block_k"], max(16, pow2(N))))
    pb = cfg["block_k"]  # the partials' column block: the pass's BLOCK_K
    # one partial a job, every tile adding to it (fp32 atomics: the sum's order varies), or one a tile,
    # summed per job in tile order by the reduce
    table, alloc = (meta.per_job(), torch.zeros) if atomic else (meta.tiles(cfg["block_m"]), torch.empty)
    part = alloc((cdiv(N, pb), max(table.n, 1), br, pb), dtype=torch.float32, device=dy.device)
    tiles = None
    if stream is not None:
        tiles, _ = launch_stream(dy, Bt, dx[0], meta, dh, dx[1], stream, True, False, dx[2], p=h, part=part)
    _launch_shrink(dy, Bt, meta, dh, h_slice, True, cfg, p=h, part=part, exp=exp, atomic=atomic, tiles=tiles)
    launch_reduce(part, dBt, meta, table, br, scale=True)


def _launch_shrink(x, w, meta: LoRABatchMeta, out, h_slice: int, scale: bool, cfg: dict, *, p=None, part=None,
                   exp=None, atomic: bool = False, tiles: Tiles | None = None) -> None:
    """lora_shrink_kernel over `tiles` (meta.tiles(cfg["block_m"]) by default) with `cfg` (policy.shrink_config).
    p, part: the dy pass's h and dB partials; exp: None, or (w2, y, scale, accumulate) of a fused expand (see
    lora_shrink_expand); atomic: the partials one a job (meta.per_job), added to atomically."""
    check_shrink(x, w, meta, out, h_slice)
    K = x.shape[1]
    block_m, block_k = cfg["block_m"], cfg["block_k"]
    tiles = tiles or meta.tiles(block_m)
    if tiles.n == 0 or (meta.max_rank == 0 and exp is None):
        return
    fused = part is not None
    w2, y, scale2, accumulate = exp or (x, x, False, False)
    N2 = w2.shape[0] if exp else 0
    if fused and part.shape[3] != block_k:
        raise ValueError(f"partials in column blocks of {part.shape[3]}, the pass's BLOCK_K is {block_k}")
    lora_shrink_kernel[(tiles.n,)](
        x, w, out, p if fused else x, part if fused else x, w2, y,
        tiles.job, tiles.row, meta.seg_start_t, meta.rank_start_t, meta.scale_t,
        K, h_slice, N2, part.shape[1] if fused else 0,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), p.stride(0) if fused else 0,
        w2.stride(0) if exp else 0, w2.stride(1) if exp else 0, y.stride(0) if exp else 0, y.stride(1) if exp else 0,
        BLOCK_M=block_m, BLOCK_R=block_r(meta.max_rank), BLOCK_K=block_k,
        EVEN_K=K % block_k == 0, HAS_SCALE=scale, FUSE_SGRAD=fused, PRECISION=precision(x.dtype, x.device),
        FUSE_EXPAND=exp is not None, BLOCK_N2=cfg["block_n2"], EXPAND_SCALE=scale2, ACCUMULATE=accumulate,
        PART_ATOMIC=atomic, num_warps=cfg["warps"], num_stages=cfg["stages"],
    )
