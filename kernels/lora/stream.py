"""lora_stream_kernel: the shrink with its expand (x -> h -> y, dy -> dh -> dx) and the dy pass's atomic dB partial
on persistent programs over the FULL row tiles of a batch whose every rank is BLOCK_R, x / dy and both weights
through TMA tensor descriptors, nothing masked but the expand's last column block. Each job's short last tile
goes to lora_shrink_kernel (shrink.py, which launches both). Where it runs (`stream_config`): the table's "on"
(policy: at BLOCK_R 64), 16-bit dtypes, Hopper or later (or the interpreter), unit column strides and 16-byte
aligned bases and row steps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..util import pow2
from .common import _dot, block_r, check_shrink, num_sms, precision
from .meta import LoRABatchMeta, Tiles
from .policy import Launch, dy_pass_block_m, stream_entry


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



def stream_config(kind: str, x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, out: torch.Tensor,
                  meta: LoRABatchMeta, launch: Launch | None = None) -> dict | None:
    """The launch of lora_stream_kernel for lora_shrink_expand (kind "stream": x -> h -> y, dy -> dh -> dx) or
    lora_shrink_sgrad's pass with its dx (kind "stream_dy"), or None for lora_shrink_kernel's one program a tile.
    It needs the table's "on" at this BLOCK_R, a batch whose every rank is BLOCK_R, 16-bit dtypes, Hopper or later
    (or the CPU's interpreter), x, w and out with unit column strides, w2 with a unit stride along either dim,
    16-byte aligned bases and row steps (TMA descriptors); the dy pass also tiles of no more rows than
    dy_pass_block_m (one 256-row tile an SM or more)."""
    cfg = stream_entry(kind, meta, x.dtype, launch)
    if not cfg["on"]:
        return None
    if meta.min_rank != block_r(meta.max_rank) or x.dtype not in (torch.bfloat16, torch.float16) or out.stride(1) != 1:
        return None
    if kind == "stream_dy" and cfg["block_m"] > dy_pass_block_m(meta):
        return None
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return None
    w2_nr = w2.stride(1) == 1  # w2 [N2, R] row-major (B itself), else its transpose is ([R, N2]: B^T, A)

    def aligned(t: torch.Tensor) -> bool:
        return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0

    if not (aligned(x) and aligned(w) and aligned(w2 if w2_nr else w2.t())):
        return None
    return {**cfg, "w2_nr": w2_nr}


def launch_stream(x, w, w2, meta: LoRABatchMeta, h, out, cfg: dict, scale_h: bool, scale_out: bool, accumulate: bool,
                  p=None, part=None) -> tuple[Tiles, int]:
    """lora_stream_kernel over the full tiles of cfg's block_m rows; returns (the other tiles: each job's last when
    block_m does not divide its rows, the K block) for lora_shrink_kernel. x: [T, K], w: [R, K], w2: [N2, R]
    (any strides, see stream_config), h: [T, H], out: [T, N2]; p, part: the dy pass's h and atomic dB partials."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    check_shrink(x, w, meta, h, 0)
    K, N2 = x.shape[1], w2.shape[0]
    block_m, br = cfg["block_m"], block_r(meta.max_rank)
    block_k = min(cfg["block_k"], max(16, pow2(K)))
    block_n2 = min(cfg["block_n2"], max(16, pow2(N2)))
    fused = part is not None
    if fused and part.shape[3] != block_k:
        raise ValueError(f"partials in column blocks of {part.shape[3]}, the pass's BLOCK_K is {block_k}")
    full, short = meta.full_tiles(block_m)

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    if full.n > 0:
        w2d = desc(w2, [block_n2, br]) if cfg["w2_nr"] else desc(w2.t(), [br, block_n2])
        programs = max(1, min(full.n, cfg["per_sm"] * num_sms(x.device)))
        lora_stream_kernel[(programs,)](
            desc(x, [block_m, block_k]), desc(w, [br, block_k]), h, p if fused else h, part if fused else h,
            w2d, out, full.job, full.row, meta.rank_start_t, meta.scale_t,
            full.n, programs, K, N2, part.shape[1] if fused else 0,
            h.stride(0), p.stride(0) if fused else 0, out.stride(0),
            BLOCK_M=block_m, BLOCK_R=br, BLOCK_K=block_k, BLOCK_N2=block_n2,
            W2_NR=cfg["w2_nr"], EVEN_N2=N2 % block_n2 == 0, FUSE_SGRAD=fused,
            HAS_SCALE=scale_h, EXPAND_SCALE=scale_out, ACCUMULATE=accumulate,
            PRECISION=precision(x.dtype, x.device), num_warps=cfg["warps"], num_stages=cfg["stages"],
        )
    return short, block_k
