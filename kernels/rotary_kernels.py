"""Triton kernel of the rotary embedding (launcher and the autograd function: rotary.py). One program
rotates BLOCK_H heads of one token: cos and sin of the token loaded once, each head's two halves
rotated in fp32, each product rounded to the tensors' dtype where the model's eager code rounds it.
The same kernel serves the backward (BACKWARD: the transposed rotation of the gradient)."""

import triton
import triton.language as tl


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr,
                  T, H,
                  stride_xb, stride_xh, stride_xt, stride_cb, stride_ct, stride_yb, stride_yh, stride_yt,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    """forward:  y1 = x1 c1 - x2 s1,  y2 = x2 c2 + x1 s2     (x * cos + rotate_half(x) * sin)
    backward: y1 = x1 c1 + x2 s2,  y2 = x2 c2 - x1 s1     (x: the output's gradient, y: the input's)
    with 1 / 2 the halves of the head dimension. x: [B, H, T, 2 * HALF] (any strides, unit along the
    last dim), cos / sin: [B or 1, T, 2 * HALF] (stride_cb 0 when shared by the batch)."""
    row = tl.program_id(0)  # b * T + t
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HALF
    mask = (offs_h < H)[:, None] & d_ok[None, :]
    cs = b * stride_cb + t * stride_ct + offs_d
    c1 = tl.load(cos_ptr + cs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + cs + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + cs, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + cs + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    xs = x_ptr + b * stride_xb + t * stride_xt + offs_h.to(tl.int64)[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(xs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xs + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    # eager rounds each product to the dtype, then their sum (autograd: each gradient term, then the sum)
    if BACKWARD:
        y1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s2).to(dt).to(tl.float32)
        y2 = (x2 * c2).to(dt).to(tl.float32) - (x1 * s1).to(dt).to(tl.float32)
    else:
        y1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
        y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    ys = y_ptr + b * stride_yb + t * stride_yt + offs_h.to(tl.int64)[:, None] * stride_yh + offs_d[None, :]
    tl.store(ys, y1.to(dt), mask=mask)
    tl.store(ys + HALF, y2.to(dt), mask=mask)
