"""What every grouped-LoRA kernel and launcher shares: the dot with its precision, a tile's job and rows, the
rank padding (BLOCK_R, h's width), and the operand checks.

Every program handles rows of exactly one job (tiles from `LoRABatchMeta.tiles`), so each tile is a dense
matmul against that job's slice of the stacked weights. Ranks are padded to BLOCK_R >= 16 (tl.dot's minimum)
with masks on k < r_j on the weight side. The h / p side is read WITHOUT a rank mask (a mask along the
contiguous dim splits every load into 2-byte loads, LDG.E.U16 in SASS): the caller guarantees that columns
[slice*r_j, slice*r_j + BLOCK_R) of every row exist and are finite (zero-initialised h, `h_width`), so the
padding lanes multiply zeros (expand) or land in accumulator rows that are never stored (sgrad). Row offsets
are int64: T * stride reaches 2^31 at 700k tokens of width 3072. Accumulation is fp32; fp32 inputs use IEEE
dots, not tf32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..util import pow2
from .meta import LoRABatchMeta


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


def precision(dtype: torch.dtype, device: torch.device) -> str:
    """The kernels' PRECISION for inputs of `dtype` on `device`."""
    if device.type != "cuda":
        return "upcast"  # Triton's interpreter: see _dot
    # fp32 callers (tests, the CPU trainer's dtype) expect fp32 results, not tf32's 10-bit mantissa
    return "ieee" if dtype == torch.float32 else "tf32"


def block_r(rank: int) -> int:
    """BLOCK_R of a batch whose largest rank is `rank`: tl.dot needs every dim >= 16."""
    return max(16, pow2(rank))


def h_width(meta: LoRABatchMeta, slices: int) -> int:
    """Columns of the h / dh buffer of a `slices`-way packed call: the packed shrink writes
    [0, slices * r_j) per row, and every slice's expand or sgrad reads BLOCK_R columns from
    slice * r_j on (the reads carry no rank mask: module docstring). Allocate it zero-filled."""
    R = meta.max_rank
    return max(block_r(slices * R), (slices - 1) * R + block_r(R))


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few chunks, so the tests exercise the cross-chunk reduction
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_2d(meta: LoRABatchMeta, t: torch.Tensor, name: str, rows: int | None = None) -> None:
    if t.device != meta.device:
        raise ValueError(f"{name} is on {t.device}, the batch metadata on {meta.device}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if rows is not None and t.shape[0] != rows:
        raise ValueError(f"{name} has {t.shape[0]} rows, the batch has {rows} tokens")


def check_shrink(x: torch.Tensor, w: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, h_slice: int) -> None:
    """x: [T, K], w: [R, K], out: [T, >= (h_slice + 1) * max_rank] row-major, one dtype."""
    T, K = x.shape
    check_2d(meta, x, "x", meta.num_tokens)
    check_2d(meta, out, "out", T)
    if w.shape != (meta.total_rank, K):
        raise ValueError(f"weight has shape {tuple(w.shape)}, expected [total rank {meta.total_rank}, {K}]")
    if out.shape[1] < (h_slice + 1) * meta.max_rank or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} (strides {out.stride()}) must be row-major with at least "
                         f"{(h_slice + 1) * meta.max_rank} columns")
    if not (x.dtype == w.dtype == out.dtype):
        raise ValueError(f"dtypes differ: x {x.dtype}, weight {w.dtype}, out {out.dtype}")


def check_expand(h: torch.Tensor, w: torch.Tensor, meta: LoRABatchMeta, out: torch.Tensor, h_slice: int) -> None:
    """h: [T, >= h_slice * max_rank + BLOCK_R] row-major, w: [N, R], out: [T, N], one dtype."""
    N = w.shape[0]
    check_2d(meta, h, "h", meta.num_tokens)
    check_2d(meta, out, "out", h.shape[0])
    if w.dim() != 2 or w.shape != (N, meta.total_rank) or out.shape[1] != N:
        raise ValueError(f"weight {tuple(w.shape)} / out {tuple(out.shape)}: expected [N, total rank "
                         f"{meta.total_rank}] and [T, N]")
    br = block_r(meta.max_rank)
    if h.shape[1] < h_slice * meta.max_rank + br or h.stride(1) != 1:
        raise ValueError(f"h {tuple(h.shape)} must be row-major with at least {h_slice * meta.max_rank + br} "
                         "columns (h_width), zero-filled where the shrink did not write")
    if not (h.dtype == w.dtype == out.dtype):
        raise ValueError(f"dtypes differ: h {h.dtype}, weight {w.dtype}, out {out.dtype}")
