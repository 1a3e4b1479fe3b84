"""Triton kernel of the selective log-softmax: one program per row of a logits chunk.

Pass 1 streams the row once with an online (running max) log-sum-exp, in fp32 whatever the logits'
dtype, and, if asked, the entropy through the running sum of exp(z - m) * z. The chosen token's
logit is one load. Pass 2 (training only) overwrites the row in place with the row's gradient of
logp for an upstream gradient of 1, (onehot(target) - softmax(z)) / temperature, so the caller can
form d hidden = dlogits @ W without a second buffer. This is Liger-Kernel's cross-entropy pattern.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def selective_logsoftmax_kernel(
    logits_ptr,  # [C, V], stride_l per row; in: logits, out (HAS_GRAD): d logp / d logits
    targets_ptr,  # int64 [C]
    temp_ptr,  # fp32 [C]
    logp_ptr,  # fp32 [C]
    ent_ptr,  # fp32 [C] (written if HAS_ENTROPY)
    V, stride_l,
    BLOCK_V: tl.constexpr, HAS_GRAD: tl.constexpr, HAS_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_l  # C * V passes 2^31 at chunks of 14k rows
    tgt = tl.load(targets_ptr + row)
    temp = tl.load(temp_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    w = 0.0
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offs
        ok = cols < V
        z = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, tl.max(z, 0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # 0 on masked lanes
        s = s * alpha + tl.sum(e, 0)
        if HAS_ENTROPY:
            w = w * alpha + tl.sum(e * tl.where(ok, z, 0.0), 0)  # masked lanes: z = -inf, e = 0
        m = m_new
    lse = m + tl.log(s)
    # a target outside [0, V) is not read (no fault); its logp is then -lse, documented as undefined
    tgt_ok = (tgt >= 0) & (tgt < V)
    z_t = tl.load(base + tgt, mask=tgt_ok, other=0.0).to(tl.float32) / temp
    tl.store(logp_ptr + row, z_t - lse)
    if HAS_ENTROPY:
        tl.store(ent_ptr + row, lse - w / s)  # H = lse - E_p[z]
    if HAS_GRAD:
        for v0 in range(0, V, BLOCK_V):
            cols = v0 + offs
            ok = cols < V
            z = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32) / temp
            g = (tl.where(cols == tgt, 1.0, 0.0) - tl.exp(z - lse)) / temp
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=ok)
