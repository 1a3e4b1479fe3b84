"""Triton kernels of the frozen-weight RMSNorm (launchers and the autograd function: rmsnorm.py).
One program per row of N <= BLOCK_N values; fp32 inside, results in the output's dtype."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, N, stride_x, stride_y, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    xhat = (x * rstd).to(y_ptr.dtype.element_ty)  # hidden_states.to(input_dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * xhat.to(tl.float32)).to(y_ptr.dtype.element_ty)  # weight * hidden, rounded to x's dtype
    tl.store(y_ptr + row.to(tl.int64) * stride_y + cols, y, mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, N, stride_dy, stride_x, stride_dx,
                         BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dy = tl.load(dy_ptr + row.to(tl.int64) * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    g = (dy * w).to(dx_ptr.dtype.element_ty).to(tl.float32)  # the product's gradient, in x's dtype
    xhat = x * rstd
    dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / N))
    tl.store(dx_ptr + row.to(tl.int64) * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
