"""The grouped-LoRA op against its plain torch reference: every dtype, mixed ranks, empty segments,
packed projections, the base product inside the op, fp32 gradients from low-precision copies.

    pytest tests/test_kernel_lora.py -q            (CPU: conftest.py sets TRITON_INTERPRET=1 without a GPU)

Small odd shapes (rows not a multiple of the tiles, mixed ranks including 0, empty segments, all three
dtypes); every check draws fresh random inputs and poisons the outputs it can. The realistic sweep is
tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_cases import DEV, DTYPES, K, LORA_TOL, lora_case, lora_grads, rel_err


LORA_CASES = [
    ("one_job", 24, 40, [37], [8]),
    ("mixed_ranks_empty_seg", 40, 24, [33, 0, 70, 5], [16, 64, 0, 8]),
    ("rank0_with_rows", 24, 24, [9, 20], [0, 4]),
    ("all_empty", 24, 40, [0, 0], [8, 16]),
    ("many_jobs", 24, 24, "64 jobs", "64 jobs"),
]


def _layout(tokens, ranks, seed):
    if tokens == "64 jobs":
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 7, (64,), generator=g).tolist()
        ranks = [[0, 4, 8, 16][i] for i in torch.randint(0, 4, (64,), generator=g).tolist()]
    return tokens, ranks


# 64 jobs under the interpreter cost ~15 s per dtype: that case runs in bf16 only
LORA_SWEEP = [(*c, dt) for c in LORA_CASES for dt in DTYPES if c[0] != "many_jobs" or dt == torch.bfloat16]


@pytest.mark.parametrize("name,d_in,d_out,tokens,ranks,dtype", LORA_SWEEP,
                         ids=[f"{c[0]}-{str(c[-1])[6:]}" for c in LORA_SWEEP])
def test_grouped_lora_matches_reference(name, d_in, d_out, tokens, ranks, dtype):
    tokens, ranks = _layout(tokens, ranks, seed=1)
    case = lora_case(tokens, ranks, d_in, d_out, dtype, DEV, seed=zlib.crc32(f"{name}/{dtype}".encode()))
    got = lora_grads(K.grouped_lora, case, backend="triton")
    ref = lora_grads(K.grouped_lora, case.double(), backend="torch")
    low = lora_grads(K.grouped_lora, case, backend="torch")  # the reference in the same dtype
    tol = LORA_TOL[dtype]
    for key in ("y", "dx", "dA", "dB"):
        assert got[key].dtype == dtype and got[key].shape == ref[key].shape
        assert torch.isfinite(got[key]).all(), key
        err = rel_err(got[key], ref[key])
        assert err <= tol, f"{key}: |triton - fp64| / |fp64| = {err:.2e} > {tol:.0e}"
        # the table is about the dtype's rounding: the torch loop in the same dtype must pass it too
        assert rel_err(low[key], ref[key]) <= tol, key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_launchers_write_every_element(dtype):
    """Outputs are poisoned with NaN; each launcher must write exactly what it promises."""
    from colora.kernels.lora.common import h_width
    from colora.kernels.lora.sgrad import lora_expand, lora_sgrad
    from colora.kernels.lora.shrink import lora_shrink, lora_shrink_expand, lora_shrink_sgrad

    tokens, ranks = [13, 0, 40, 7], [8, 16, 4, 0]
    case = lora_case(tokens, ranks, 40, 24, dtype, DEV, seed=7)
    meta, x, A, B = case.meta, case.x, case.A, case.B
    T = x.shape[0]
    h = torch.full((T, h_width(meta, 1)), float("nan"), dtype=dtype, device=DEV)
    lora_shrink(x, A, meta, h)
    for j in range(meta.num_jobs):  # shrink writes each job's own r_j columns only
        t0, t1, r0, r1 = meta.seg_start[j], meta.seg_start[j + 1], meta.rank_start[j], meta.rank_start[j + 1]
        want = x[t0:t1].double() @ A[r0:r1].double().t()
        assert rel_err(h[t0:t1, : r1 - r0], want) <= LORA_TOL[dtype]
        assert h[t0:t1, r1 - r0:].isnan().all()
    h_nan = h.clone()  # NaN in every lane the shrink did not write (lanes >= r_j, the rank-0 job's rows)
    h = h.nan_to_num(0.0)  # the autograd op zero-fills h before the shrink: expand reads padding lanes
    # ... but not when the expands are fused: h's other readers never store what those lanes give
    nan_dA, zero_dA = torch.empty_like(A), torch.empty_like(A)
    lora_sgrad(h_nan, x, meta, nan_dA)
    lora_sgrad(h, x, meta, zero_dA)
    assert torch.equal(nan_dA, zero_dA)
    dBts = [torch.empty(B.shape[::-1], dtype=dtype, device=DEV) for _ in range(2)]
    for p_, dBt in zip((h_nan, h), dBts):
        lora_shrink_sgrad(torch.ones_like(x[:, :B.shape[0]]), B.t().contiguous(), p_, meta, torch.empty_like(h), dBt)
    assert torch.equal(dBts[0], dBts[1])
    y = torch.full((T, B.shape[0]), float("nan"), dtype=dtype, device=DEV)
    lora_expand(h, B, meta, y, scale=True)
    assert torch.isfinite(y).all()
    assert (y[53:] == 0).all()  # the rank-0 job's rows
    # shrink and expand in one launch: the same h (own columns) and every element of y, rank-0 rows 0
    h2 = torch.full_like(h, float("nan"))
    y2 = torch.full_like(y, float("nan"))
    lora_shrink_expand(x, A, B, meta, h2, y2, scale_out=True)
    for j in range(meta.num_jobs):
        t0, t1, r = meta.seg_start[j], meta.seg_start[j + 1], meta.rank_start[j + 1] - meta.rank_start[j]
        assert torch.equal(h2[t0:t1, :r], h[t0:t1, :r])
    assert torch.isfinite(y2).all() and (y2[53:] == 0).all()
    assert rel_err(y2, y) <= LORA_TOL[dtype]
    dA = torch.full_like(A, float("nan"))
    lora_sgrad(h, x, meta, dA, chunk=16)  # small chunks: several per job, reduced in order
    assert torch.isfinite(dA).all()
    assert (dA[8:24] == 0).all()  # the job without rows: rank rows 8..23
    # the fused dy pass writes every element of dB^T too (the backward allocates it without a fill)
    dy = torch.randn_like(y)
    dBt = torch.full((B.shape[1], B.shape[0]), float("nan"), dtype=dtype, device=DEV)
    dh = torch.zeros_like(h)
    lora_shrink_sgrad(dy, B.t().contiguous(), h, meta, dh, dBt)
    assert torch.isfinite(dBt).all() and (dBt[8:24] == 0).all()


def test_sgrad_chunking_does_not_change_the_result():
    from colora.kernels.lora.sgrad import lora_sgrad

    case = lora_case([150, 3, 90], [16, 8, 4], 40, 24, torch.float32, DEV, seed=3)
    h = (case.x @ case.A.t()).contiguous()  # any [T, >= max rank] works as p
    outs = [lora_sgrad(h, case.x, case.meta, torch.empty_like(case.A), chunk=c) for c in (16, 64, 256, 8192)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(16, 1, 16), (16, 8, 8), (32, 2, 4), (64, 4, 16), (64, 16, 4)],
                         ids=lambda s: f"n{s[0]}-c{s[1]}-r{s[2]}")
def test_reduce_sums_each_jobs_partials_at_any_tile_shape(monkeypatch, shape):
    """The reduce's column width, partials per step and rank rows per program (reduce_shape) change
    how it walks the partials, not the sum: each job's rows of p^T q (10 partials for job 0, a
    partial last step at 8 per step, a rank-4 job without rows gets zeros, 24 columns under a 32- or
    64-wide tile, rank rows split over 1-4 programs), and the same bits on a second call (a fixed
    order, no atomics)."""
    from colora.kernels.lora import reduce
    from colora.kernels.lora.sgrad import lora_sgrad

    case = lora_case([150, 3, 0, 90], [16, 8, 4, 4], 40, 24, torch.float32, DEV, seed=5)
    h = (case.x @ case.A.t()).detach().contiguous()
    q = case.dy
    monkeypatch.setattr(reduce, "reduce_shape", lambda *a: shape)
    got = lora_sgrad(h, q, case.meta, torch.full((case.meta.total_rank, 24), float("nan")).to(DEV), chunk=16)
    again = lora_sgrad(h, q, case.meta, torch.empty((case.meta.total_rank, 24), device=DEV), chunk=16)
    assert torch.equal(got, again)
    meta = case.meta
    for j in range(meta.num_jobs):
        t0, t1, r0, r1 = meta.seg_start[j], meta.seg_start[j + 1], meta.rank_start[j], meta.rank_start[j + 1]
        if t1 == t0:
            assert (got[r0:r1] == 0).all()
        else:
            assert rel_err(got[r0:r1], h[t0:t1, : r1 - r0].double().t() @ q[t0:t1].double()) <= LORA_TOL[torch.float32]


def test_reduce_shape_keeps_the_wide_launch_for_few_partials():
    """Few partials a job (dA: 2-4): one partial a step, whole blocks and all rank rows, which the
    H200 measured faster there; many (dB: 96 a job): 16 a step over 4 rank rows."""
    from colora.kernels.lora.policy import reduce_shape

    assert reduce_shape(8, 3072, 16, 8 * 2, 128) == (128, 1, 16)
    assert reduce_shape(8, 1024, 64, 8 * 4, 64) == (64, 1, 64)
    # many partials: whole 64-column blocks, 4 rank rows a program, 16 partials a step
    assert reduce_shape(8, 1024, 16, 8 * 96, 64) == (64, 16, 4)
    assert reduce_shape(8, 3072, 16, 8 * 96, 128) == (128, 16, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_matches_separate_projections(dtype):
    """q|k|v packed: same outputs and gradients as three grouped_lora calls."""
    tokens, ranks = [21, 0, 44], [8, 4, 16]
    g = torch.Generator().manual_seed(11)
    base = lora_case(tokens, ranks, 40, 32, dtype, DEV, seed=11)
    R = base.meta.total_rank
    As = [(torch.randn(R, 40, generator=g) * 0.2).to(dtype).to(DEV).requires_grad_() for _ in range(3)]
    Bs = [(torch.randn(d, R, generator=g) * 0.2).to(dtype).to(DEV).requires_grad_() for d in (32, 16, 16)]
    x = base.x.detach().clone().requires_grad_()
    dys = [torch.randn(x.shape[0], d, generator=g).to(dtype).to(DEV) for d in (32, 16, 16)]

    def run(fn):
        ys = fn()
        grads = torch.autograd.grad(ys, [x, *As, *Bs], dys)
        return [t.detach() for t in ys] + [t.detach() for t in grads]

    got = run(lambda: K.grouped_lora_packed(x, As, Bs, base.meta, backend="triton"))
    ref = run(lambda: [K.grouped_lora(x, A, B, meta=base.meta, backend="triton") for A, B in zip(As, Bs)])
    for a, b in zip(got, ref):
        assert rel_err(a, b) <= LORA_TOL[dtype]


@pytest.mark.parametrize("slices", [1, 3])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_compute_copies_give_the_masters_fp32_gradients(slices, backend):
    """compute=: the arithmetic on bf16 copies, the gradients in the fp32 masters' dtype. Outputs and
    dx equal those of the bf16 tensors themselves (the same arithmetic); dA and dB equal the bf16
    path's gradients up to its rounding of them to bf16, against an fp64 reference."""
    tokens, ranks, d_in, outs = [21, 0, 44], [8, 4, 16], 40, (32, 16, 16)[:slices]
    g = torch.Generator().manual_seed(3)
    meta = lora_case(tokens, ranks, d_in, 8, torch.float32, DEV, seed=3).meta
    R, T = meta.total_rank, meta.num_tokens
    A32 = [(torch.randn(R, d_in, generator=g) * 0.2).to(DEV).requires_grad_() for _ in outs]
    B32 = [(torch.randn(R, d, generator=g) * 0.2).to(DEV).requires_grad_() for d in outs]  # B^T masters
    x = torch.randn(T, d_in, generator=g).to(torch.bfloat16).to(DEV).requires_grad_()
    dys = [torch.randn(T, d, generator=g).to(torch.bfloat16).to(DEV) for d in outs]
    A16 = [a.detach().to(torch.bfloat16) for a in A32]
    Bt16 = [b.detach().to(torch.bfloat16) for b in B32]

    def call(As, Bs, **kw):
        if slices == 1:
            return [K.grouped_lora(x, As[0], Bs[0], meta=meta, backend=backend,
                                   compute=None if "compute" not in kw else (kw["compute"][0][0], kw["compute"][1][0]))]
        return K.grouped_lora_packed(x, As, Bs, meta, backend=backend, **kw)

    ys = call(A32, [b.t() for b in B32], compute=(A16, Bt16))
    got = torch.autograd.grad(ys, [x, *A32, *B32], dys)
    assert all(t.dtype == torch.float32 for t in got[1:])  # the masters' own dtype
    leaves16 = [t.clone().requires_grad_() for t in A16 + Bt16]
    ys16 = call(leaves16[:slices], [b.t() for b in leaves16[slices:]])
    want = torch.autograd.grad(ys16, [x, *leaves16], dys)
    for y, y16 in zip(ys, ys16):
        assert torch.equal(y, y16)
    assert rel_err(got[0], want[0]) <= LORA_TOL[torch.bfloat16]
    # fp64 on the same bf16 values: the fp32 gradients are at least as close as the bf16 ones
    leaves64 = [t.double().requires_grad_() for t in A16 + Bt16]
    ys64 = [K.grouped_lora(x.double(), a, b.t(), meta=meta, backend="torch")
            for a, b in zip(leaves64[:slices], leaves64[slices:])]
    ref = torch.autograd.grad(ys64, leaves64, [d.double() for d in dys])
    for g32, g16, g64 in zip(got[1:], want[1:], ref):
        assert rel_err(g32, g16.float()) <= LORA_TOL[torch.bfloat16]
        assert rel_err(g32, g64) <= rel_err(g16, g64) + 1e-6


def test_add_to_accumulates_in_place_and_passes_gradient():
    case = lora_case([30, 12], [8, 16], 24, 40, torch.float32, DEV, seed=5)
    x = case.x.detach().requires_grad_()
    base_w = torch.randn(40, 24, device=DEV, requires_grad=True)
    dy = torch.randn(42, 40, device=DEV)
    out = K.grouped_lora(x, case.A, case.B, meta=case.meta, backend="triton", add_to=x @ base_w.t())
    want = x @ base_w.t() + K.grouped_lora(x, case.A, case.B, meta=case.meta, backend="torch")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    g1 = torch.autograd.grad(out, (x, base_w, case.A, case.B), dy)
    g2 = torch.autograd.grad(want, (x, base_w, case.A, case.B), dy)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("slices", [1, 3])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x_grad", "x_frozen"])
def test_base_weight_inside_the_op_equals_adding_the_base_output(dtype, slices, backend, x_grad):
    """base=W: the op computes x W^T itself and adds dy W to dx in the same matmul; outputs and
    every gradient equal those of add_to=x W^T (autograd summing the base's dx), packed or not, and
    with an input that needs no gradient (the first layer's). Frozen weights only."""
    tokens, ranks, d_in, outs = [21, 0, 44], [8, 4, 16], 40, (32, 16, 16)[:slices]
    g = torch.Generator().manual_seed(7 + slices)
    meta = lora_case(tokens, ranks, d_in, 8, dtype, DEV, seed=7).meta
    R, T = meta.total_rank, meta.num_tokens
    As = [(torch.randn(R, d_in, generator=g) * 0.2).to(dtype).to(DEV).requires_grad_() for _ in outs]
    Bs = [(torch.randn(d, R, generator=g) * 0.2).to(dtype).to(DEV).requires_grad_() for d in outs]
    Ws = [(torch.randn(d, d_in, generator=g) * 0.2).to(dtype).to(DEV) for d in outs]
    x = torch.randn(T, d_in, generator=g).to(dtype).to(DEV).requires_grad_(x_grad)
    dys = [torch.randn(T, d, generator=g).to(dtype).to(DEV) for d in outs]

    def call(**kw):
        if slices == 1:
            return [K.grouped_lora(x, As[0], Bs[0], meta=meta, backend=backend,
                                   **{k: v[0] for k, v in kw.items()})]
        return K.grouped_lora_packed(x, As, Bs, meta, backend=backend, **kw)

    def run(ys):
        leaves = ([x] if x_grad else []) + As + Bs
        return [t.detach() for t in ys] + [t.detach() for t in torch.autograd.grad(ys, leaves, dys)]

    got = run(call(base=Ws))
    want = run(call(add_to=[x @ W.t() for W in Ws]))
    for a, b in zip(got, want):
        assert rel_err(a, b) <= LORA_TOL[dtype]
    with pytest.raises(ValueError, match="must be frozen"):
        call(base=[W.clone().requires_grad_() for W in Ws])
    with pytest.raises(ValueError, match="not both"):
        call(base=Ws, add_to=[x @ W.t() for W in Ws])
    with pytest.raises(ValueError, match="base weight"):
        call(base=[W[:, :-1] for W in Ws])


@pytest.mark.parametrize("fuse_expand", [True, False], ids=["expand fused", "expand separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [[33, 0, 70, 5], [1200, 0, 900, 7]], ids=["64-row tiles", "256-row tiles"])
def test_fused_dy_pass_matches_separate_kernels(tokens, dtype, fuse_expand, monkeypatch):
    """dh and dB from one pass over dy (fuse_dy) equal the separate shrink + sgrad, with dx written by
    that pass (fuse_expand) or by its own expand. From 256 x SMs rows on (SMs = 4 on the
    interpreter: 1,024) the fused pass uses 256-row tiles. A rank-0 job with rows is among them."""
    from colora.kernels.lora import shrink
    from colora.kernels.lora.common import num_sms

    case = lora_case(tokens, [16, 8, 0, 4], 40, 24, dtype, DEV, seed=len(tokens) + sum(tokens))
    launches, real = [], shrink._launch_shrink
    # (dy pass with dB partials?, rows per tile, expand fused?) of every shrink launch
    monkeypatch.setattr(shrink, "_launch_shrink",
                        lambda *a, **k: launches.append((k.get("part") is not None, a[6]["block_m"],
                                                         k.get("exp") is not None)) or real(*a, **k))
    fused = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=True, fuse_expand=fuse_expand)
    tile = 256 if sum(tokens) >= 256 * num_sms(torch.device(DEV)) else 64
    assert launches == [(False, 64, fuse_expand), (True, tile, fuse_expand)]
    separate = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=False, fuse_expand=not fuse_expand)
    ref = lora_grads(K.grouped_lora, case.double(), backend="torch")
    for key in ("dx", "dA", "dB"):
        assert rel_err(fused[key], ref[key]) <= LORA_TOL[dtype], key
        assert rel_err(fused[key], separate[key]) <= LORA_TOL[dtype], key


def test_expands_fuse_where_the_rule_says_by_default(monkeypatch):
    """fuse_expand=None follows policy.fuse_expand_pays: one slice, BLOCK_R <= 64, and at BLOCK_R
    <= 32 only d_in <= d_out (the H200's measurements: at rank 16 fused was slower where the dy pass
    writes a dx wider than dy; at rank 64 it was faster there too)."""
    from colora.kernels.lora import shrink
    from colora.kernels.lora.policy import fuse_expand_pays

    launches, real = [], shrink._launch_shrink
    monkeypatch.setattr(shrink, "_launch_shrink", lambda *a, **k: launches.append(k.get("exp") is not None)
                        or real(*a, **k))
    for (d_in, d_out, ranks), want in (((24, 40, [8, 16]), True), ((40, 24, [8, 16]), False),
                                       ((24, 40, [64, 8]), True), ((40, 24, [64, 8]), True),
                                       ((40, 24, [33, 8]), True), ((24, 40, [100, 8]), False),
                                       ((40, 24, [100, 8]), False)):
        case = lora_case([20, 30], ranks, d_in, d_out, torch.float32, DEV, seed=d_in + ranks[0])
        launches.clear()
        lora_grads(K.grouped_lora, case, backend="triton")
        assert launches and all(f == want for f in launches), (d_in, d_out, ranks, launches)
        assert fuse_expand_pays(case.meta, 1, d_in, d_out) == want
    case = lora_case([20, 30], [8, 16], 24, 40, torch.float32, DEV, seed=1)
    launches.clear()
    K.grouped_lora_packed(case.x, [case.A, case.A], [case.B, case.B], case.meta, backend="triton")
    assert launches == [False] and not fuse_expand_pays(case.meta, 2, 24, 40)


EXPAND_FUSE = [(fuse_expand, fuse_dy) for fuse_expand in (True, False) for fuse_dy in (True, False)]


@pytest.mark.parametrize("fuse_expand,fuse_dy", EXPAND_FUSE,
                         ids=[f"fuse_expand {e}, fuse_dy {f}" for e, f in EXPAND_FUSE])
def test_every_expand_route_matches_the_reference(fuse_expand, fuse_dy):
    """y and dx expanded in the launches that compute h and dh (fuse_expand) or by lora_expand, with dh and dB
    from one pass over dy or two: every route gives the reference's y and gradients, with mixed ranks, a job
    without rows, a rank-0 job with rows, and 2-3 chunks a job (sgrad_chunk's 256 rows); with the base weight
    inside the op too (dx = dy W + dh A)."""
    case = lora_case([600, 0, 300, 9], [16, 8, 0, 4], 40, 24, torch.bfloat16, DEV, seed=21)
    W = (torch.randn(24, 40, generator=torch.Generator().manual_seed(3)) * 0.2).to(torch.bfloat16).to(DEV)
    ref = lora_grads(K.grouped_lora, case.double(), backend="torch")
    ref_w = lora_grads(K.grouped_lora, case.double(), backend="torch", base=W.double())
    got = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=fuse_dy, fuse_expand=fuse_expand)
    got_w = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=fuse_dy, base=W, fuse_expand=fuse_expand)
    for key in ("y", "dx", "dA", "dB"):
        assert rel_err(got[key], ref[key]) <= LORA_TOL[torch.bfloat16], key
        assert rel_err(got_w[key], ref_w[key]) <= LORA_TOL[torch.bfloat16], key
