"""Seeded exponential noise for many requests at once, for sampling by the exponential race
(argmax of probs / q with q ~ Exp(1), which draws a token with probability probs).

vLLM draws a seeded request's noise with a torch.Generator of its own, one kernel launch per
request per decoding step (its sampler says "This can be slow because we handle each request one by
one"). With hundreds of requests in flight that loop is a large part of an engine step, and under
MPS every one of those small launches queues behind the trainer's kernels. Here every seeded row
is one launch: the noise of row r is a hash of (key_r, vocab index), key_r = mix(seed_r, counter_r),
so a request's draws depend on its seed and how many tokens it has sampled, never on its batch.

Two paths, one function: "triton" (`seeded_exponential_kernel`; CUDA, or the interpreter) and
"torch" (the reference, the same integer arithmetic in int64 masked to 32 bits).
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from .backend import resolve_backend
from .lora_meta import upload
from .noise_kernels import INV_2_23, seeded_exponential_kernel

_M32 = 0xFFFFFFFF
_BLOCK = 2048


def mix_keys(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """One 64-bit key per row from (seed, counter), by SplitMix64's finaliser applied twice: keys of
    neighbouring seeds or counters are unrelated. seeds, counters: integer [R] -> uint64 [R]."""
    def splitmix64(x: np.ndarray) -> np.ndarray:  # uint64 arithmetic wraps mod 2^64
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    s = np.asarray(seeds).astype(np.uint64)
    c = np.asarray(counters).astype(np.uint64)
    return splitmix64(splitmix64(s) ^ c)


def noise_meta(rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """int64 [3, R]: row indices, then each key's low and high 32 bits (the kernel's layout)."""
    keys = np.asarray(keys, dtype=np.uint64)
    return np.stack([np.asarray(rows, dtype=np.int64),
                     (keys & np.uint64(_M32)).astype(np.int64),
                     (keys >> np.uint64(32)).astype(np.int64)])


def _lowbias32_ref(x: torch.Tensor) -> torch.Tensor:  # x: int64 in [0, 2^32)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32  # the product may pass 2^63 and wrap: its low 32 bits are exact
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _fill_ref(q: torch.Tensor, meta: torch.Tensor) -> None:
    cols = torch.arange(q.shape[1], dtype=torch.int64, device=q.device)
    for row, k0, k1 in meta.t().tolist():
        x = _lowbias32_ref(_lowbias32_ref(cols ^ k0) ^ k1)
        u = ((x >> 9).to(torch.float32) + 0.5) * INV_2_23.value
        q[row] = -torch.log(u)


def seeded_exponential_(q: torch.Tensor, rows: np.ndarray, keys: np.ndarray, backend: str = "auto") -> torch.Tensor:
    """Overwrite rows `rows` of q with Exp(1) noise keyed by `keys`; other rows are left alone.
    q: fp32 [N, V], rows: int [R] (distinct, < N), keys: uint64 [R] (from `mix_keys`). Returns q."""
    if q.dim() != 2 or q.dtype != torch.float32 or q.stride(1) != 1:
        raise ValueError(f"q must be a row-major fp32 [N, V] tensor, got {q.dtype} {tuple(q.shape)} "
                         f"strides {q.stride()}")
    if len(rows) != len(keys):
        raise ValueError(f"{len(rows)} rows but {len(keys)} keys")
    if len(rows) == 0:
        return q
    if min(rows) < 0 or max(rows) >= q.shape[0]:
        raise ValueError(f"rows must lie in [0, {q.shape[0]}), got {min(rows)}..{max(rows)}")
    # pinned and non-blocking: a copy from pageable memory can make vLLM's host wait for the step's forward
    meta = upload(torch.from_numpy(noise_meta(rows, keys)), q.device)  # [3, R]
    if resolve_backend(backend, q.device) == "torch":
        _fill_ref(q, meta)
        return q
    R, V = meta.shape[1], q.shape[1]
    seeded_exponential_kernel[(R, triton.cdiv(V, _BLOCK))](q, meta, R, V, q.stride(0), BLOCK=_BLOCK)
    return q
