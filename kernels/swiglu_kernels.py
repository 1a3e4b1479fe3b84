"""Triton kernels of the SiLU-gated product silu(gate) * up (launchers and the autograd function:
swiglu.py). Elementwise over the flattened tensors, BLOCK values a program; fp32 inside, each
intermediate rounded to the tensors' dtype where the model's own code rounds it."""

import triton
import triton.language as tl


@triton.jit
def swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty).to(tl.float32)  # F.silu(gate), in gate's dtype
    tl.store(y_ptr + offs, (act * u).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    dy = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    act = (g * sig).to(dg_ptr.dtype.element_ty).to(tl.float32)
    dact = (dy * u).to(dg_ptr.dtype.element_ty).to(tl.float32)  # the product's gradient wrt silu(gate)
    tl.store(du_ptr + offs, (dy * act).to(du_ptr.dtype.element_ty), mask=ok)
    tl.store(dg_ptr + offs, (dact * sig * (1.0 + g * (1.0 - sig))).to(dg_ptr.dtype.element_ty), mask=ok)
