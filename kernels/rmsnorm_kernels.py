"""Triton kernels of the frozen-weight RMSNorm (launchers and the autograd function: rmsnorm.py).
Each program normalises BLOCK_M rows of N <= BLOCK_N values (several rows where N is small, as for
the q and k norms' 128 values a head, so the grid is not one tiny program per row); fp32 inside,
results in the output's dtype."""

import triton
import triton.language as tl


@triton.jit
def _row_block(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows (int64 offsets [BLOCK_M, 1]), columns [BLOCK_N], valid rows and element mask."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    return rows, rows.to(tl.int64)[:, None], cols, row_ok, row_ok[:, None] & (cols < N)[None, :]


@triton.jit
def rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, N, stride_x, stride_y, eps,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, r64, cols, row_ok, mask = _row_block(M, N, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_N]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)  # [BLOCK_M]
    xhat = (x * rstd[:, None]).to(y_ptr.dtype.element_ty)  # hidden_states.to(input_dtype)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (w[None, :] * xhat.to(tl.float32)).to(y_ptr.dtype.element_ty)  # weight * hidden, in x's dtype
    tl.store(y_ptr + r64 * stride_y + cols[None, :], y, mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, M, N, stride_dy, stride_x, stride_dx,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, r64, cols, row_ok, mask = _row_block(M, N, BLOCK_M, BLOCK_N)
    dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    g = (dy * w[None, :]).to(dx_ptr.dtype.element_ty).to(tl.float32)  # the product's gradient, in x's dtype
    xhat = x * rstd[:, None]
    dx = rstd[:, None] * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None])
    tl.store(dx_ptr + r64 * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
