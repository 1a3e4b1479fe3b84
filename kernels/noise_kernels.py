"""Triton kernel of per-request seeded exponential noise: one program per (row, block of vocab).

Each row r has a 64-bit key (two 32-bit halves k0, k1) made on the host from the request's seed and
how many tokens it has sampled. Element v of the row is Exp(1) noise from a counter-based hash of
(v, key): lowbias32 (Chris Wellons' integer hash, a bijection on 32 bits) applied twice, the top 23
bits turned into a uniform in (0, 1). The noise depends on nothing but (seed, counter, v): not on
the row's position in the batch, nor on which other requests share it.
"""

from __future__ import annotations

import triton
import triton.language as tl

INV_2_23 = tl.constexpr(1.0 / 8388608.0)  # 2^-23: 23 bits of the hash make a uniform fp32 holds exactly


@triton.jit
def _lowbias32(x):  # x: uint32; multiplication wraps mod 2^32
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit(do_not_specialize=["n_rows"])  # a new batch size must not compile a new kernel
def seeded_exponential_kernel(
    q_ptr,  # fp32 [N, V], stride_q per row; rows listed in meta are overwritten
    meta_ptr,  # int64 [3, n_rows]: row index, k0, k1 (each half of the key in [0, 2^32))
    n_rows, V, stride_q,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(meta_ptr + i)
    k0 = tl.load(meta_ptr + n_rows + i).to(tl.uint32)
    k1 = tl.load(meta_ptr + 2 * n_rows + i).to(tl.uint32)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = _lowbias32(cols.to(tl.uint32) ^ k0)
    x = _lowbias32(x ^ k1)
    u = ((x >> 9).to(tl.float32) + 0.5) * INV_2_23  # in (0, 1): never log(0)
    tl.store(q_ptr + row * stride_q + cols, -tl.log(u), mask=cols < V)
