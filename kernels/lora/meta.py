"""Per-micro-batch metadata for the grouped-LoRA kernels, built once on the host and reused by every layer.

The rows of a micro-batch are sorted by job: job j owns rows [seg_start[j], seg_start[j+1]) and rank
rows [rank_start[j], rank_start[j+1]) of the stacked adapters. The kernels need, for every program,
which job and which rows it works on. Computing that on the device would need the segment lengths on
the host anyway (grid sizes), so it is done here once, from Python ints, and uploaded in one copy per
tile size: no host-device synchronisation inside the layers (the role of vLLM's
`lora_kernel_metadata.py`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..util import upload, upload_aligned

IntsLike = Sequence[int] | torch.Tensor
FloatsLike = Sequence[float] | torch.Tensor


def _as_ints(v: IntsLike, name: str) -> tuple[int, ...]:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(v.shape)} dtype {v.dtype}")
        return tuple(int(a) for a in v.tolist())  # one sync when v lives on the GPU
    return tuple(int(a) for a in v)


def _check_offsets(v: tuple[int, ...], name: str) -> None:
    if len(v) < 1 or v[0] != 0:
        raise ValueError(f"{name} must start at 0, got {list(v[:4])}...")
    for i in range(len(v) - 1):
        if v[i + 1] < v[i]:
            raise ValueError(f"{name} must be non-decreasing: {name}[{i}]={v[i]} > {name}[{i + 1}]={v[i + 1]}")


@dataclass(frozen=True, eq=False)
class Tiles:
    """Row tiles of at most `block` rows that never straddle two jobs, ordered by job.

    job:        int32 [n] on the device, the job of each tile
    row:        int32 [n] on the device, the first row of each tile (the tile ends at
                min(row + block, seg_start[job + 1]))
    job_start:  int32 [J+1] on the device, job j's tiles are job_start[j]:job_start[j+1]
    """

    block: int
    n: int
    job: torch.Tensor
    row: torch.Tensor
    job_start: torch.Tensor


@dataclass(frozen=True, eq=False)
class LoRABatchMeta:
    """Segment and rank layout of one micro-batch. Build with `LoRABatchMeta.build`.

    seg_start / rank_start / scale: Python copies (host decisions: grid sizes, block sizes);
    *_t: the same on the device, for the kernels. `tiles(block)` is cached per block size and shared
    with metas derived by `with_ranks` (same rows, other adapters).

    The device tables are uploaded without blocking (`upload`) on the stream current when they are made: `build`'s
    at once, the tile tables when a launcher first asks for them. Like any tensor written on one stream, they are
    ready on another only after that stream waits for the first (`torch.cuda.synchronize`, `Stream.wait_stream`).
    """

    seg_start: tuple[int, ...]  # [J+1]
    rank_start: tuple[int, ...]  # [J+1]
    scale: tuple[float, ...]  # [J]
    device: torch.device
    seg_start_t: torch.Tensor  # int32 [J+1]
    rank_start_t: torch.Tensor  # int32 [J+1]
    scale_t: torch.Tensor  # fp32 [J]
    _tiles: dict = field(default_factory=dict, repr=False)  # block (or "job") -> Tiles, shared by with_ranks
    _derived: dict = field(default_factory=dict, repr=False)  # per rank layout: packed metas, perms

    @staticmethod
    def build(seg_start: IntsLike, rank_start: IntsLike, scale: FloatsLike,
              device: torch.device | str | None = None) -> LoRABatchMeta:
        """Validate the layout and upload it. Tensors on the GPU cost one sync each here, once per
        micro-batch; pass Python lists to avoid even that."""
        seg = _as_ints(seg_start, "seg_start")
        _check_offsets(seg, "seg_start")
        if device is None:
            device = seg_start.device if isinstance(seg_start, torch.Tensor) else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # tensors report cuda:N; compare like with like
            device = torch.device("cuda", torch.cuda.current_device())
        return LoRABatchMeta._make(seg, rank_start, scale, device, {})

    @staticmethod
    def _make(seg: tuple[int, ...], rank_start: IntsLike, scale: FloatsLike, device: torch.device,
              tiles: dict) -> LoRABatchMeta:
        rs = _as_ints(rank_start, "rank_start")
        _check_offsets(rs, "rank_start")
        sc = tuple(float(s) for s in (scale.tolist() if isinstance(scale, torch.Tensor) else scale))
        J = len(seg) - 1
        if J < 1:
            raise ValueError(f"seg_start must have at least 2 entries (one job), got {list(seg)}")
        if len(rs) != J + 1 or len(sc) != J:
            raise ValueError(f"seg_start has {J + 1} entries (J={J}); rank_start must have {J + 1} "
                             f"(got {len(rs)}) and scale {J} (got {len(sc)})")
        if not all(math.isfinite(s) for s in sc):
            raise ValueError(f"scale must be finite, got {list(sc)}")
        if seg[-1] >= 2**31 or rs[-1] >= 2**31:
            raise ValueError(f"tokens ({seg[-1]}) and total rank ({rs[-1]}) must fit int32")
        seg_t, rs_t = upload_aligned([seg, rs], torch.int32, device)
        scale_t = upload(torch.tensor(sc, dtype=torch.float32), device)
        return LoRABatchMeta(seg, rs, sc, device, seg_t, rs_t, scale_t, tiles)

    def with_ranks(self, rank_start: IntsLike, scale: FloatsLike) -> LoRABatchMeta:
        """The same rows with another adapter layout (e.g. a module that some jobs do not adapt).
        Shares the tile cache."""
        return LoRABatchMeta._make(self.seg_start, rank_start, scale, self.device, self._tiles)

    def packed(self, slices: int) -> LoRABatchMeta:
        """The layout of `slices` adapters stacked per job (q|k|v): job j owns rank rows
        [slices * rank_start[j], slices * rank_start[j+1])."""
        if slices == 1:
            return self
        key = ("packed", slices)
        if key not in self._derived:
            self._derived[key] = self.with_ranks([slices * r for r in self.rank_start], self.scale)
        return self._derived[key]

    def pack_index(self, slices: int) -> torch.Tensor:
        """int64 [slices * R] on the device: row i of the packed A is row pack_index[i] of
        torch.cat(As) (As[s]: [R, d_in]), so each job's slices sit side by side (q_j | k_j | v_j)."""
        key = ("pack_index", slices)
        if key not in self._derived:
            R, idx = self.total_rank, []
            for j in range(self.num_jobs):
                r0, r1 = self.rank_start[j], self.rank_start[j + 1]
                for s in range(slices):
                    idx.extend(range(s * R + r0, s * R + r1))
            self._derived[key] = upload(torch.tensor(idx, dtype=torch.int64), self.device)
        return self._derived[key]

    @property
    def num_jobs(self) -> int:
        return len(self.seg_start) - 1

    @property
    def num_tokens(self) -> int:
        return self.seg_start[-1]

    @property
    def total_rank(self) -> int:
        return self.rank_start[-1]

    # Cached: the launchers ask for these tens of times per grouped-LoRA call, host time that a
    # layer stack pays per micro-batch (util.pow2). The fields they read are frozen.
    @functools.cached_property
    def max_rank(self) -> int:
        return max((b - a for a, b in zip(self.rank_start[:-1], self.rank_start[1:])), default=0)

    @functools.cached_property
    def min_rank(self) -> int:
        return min((b - a for a, b in zip(self.rank_start[:-1], self.rank_start[1:])), default=0)

    @functools.cached_property
    def max_tokens(self) -> int:
        return max((b - a for a, b in zip(self.seg_start[:-1], self.seg_start[1:])), default=0)

    def per_job(self) -> Tiles:
        """One entry per job, empty jobs included (row: the job's first row; block 0: not a row tile):
        the partial table of the dy pass's atomic dB, one partial a job (shrink.lora_shrink_sgrad)."""
        hit = self._tiles.get("job")
        if hit is None:
            J = self.num_jobs
            hit = Tiles(0, J, *upload_aligned([np.arange(J), np.asarray(self.seg_start[:-1]), np.arange(J + 1)],
                                              torch.int32, self.device))
            self._tiles["job"] = hit
        return hit

    def full_tiles(self, block: int) -> tuple[Tiles, Tiles]:
        """(the tiles of exactly `block` rows, the others: each job's last when block does not divide its
        rows), as `tiles(block)` splits them (cached; job_start counts each part's tiles)."""
        key = ("full", block)
        hit = self._tiles.get(key)
        if hit is None:
            job, row = self._tile_rows(block)
            full = row + block <= np.asarray(self.seg_start, dtype=np.int64)[job + 1]
            hit = self._tiles[key] = tuple(self._upload_tiles(block, job[keep], row[keep]) for keep in (full, ~full))
        return hit

    def tiles(self, block: int) -> Tiles:
        """Row tiles of `block` rows per job (cached): sum_j ceil(T_j / block) tiles."""
        hit = self._tiles.get(block)
        if hit is None:
            hit = self._tiles[block] = self._upload_tiles(block, *self._tile_rows(block))
        return hit

    def _tile_rows(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(job, first row) of each tile of `block` rows, by job, on the host."""
        seg = np.asarray(self.seg_start, dtype=np.int64)
        per_job = (seg[1:] - seg[:-1] + block - 1) // block  # [J] tiles per job
        job_start = np.concatenate([[0], np.cumsum(per_job)])  # [J+1]
        job = np.repeat(np.arange(self.num_jobs), per_job)  # [n]
        return job, seg[job] + (np.arange(len(job)) - job_start[job]) * block

    def _upload_tiles(self, block: int, job: np.ndarray, row: np.ndarray) -> Tiles:
        job_start = np.concatenate([[0], np.cumsum(np.bincount(job, minlength=self.num_jobs))])
        return Tiles(block, len(job), *upload_aligned([job, row, job_start], torch.int32, self.device))
