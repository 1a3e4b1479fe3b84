"""colora.kernels against the plain torch reference, on the CPU through Triton's interpreter.

    pytest tests/test_kernels.py -q            (CPU: TRITON_INTERPRET=1 is set here when there is no GPU)

Small odd shapes (rows not a multiple of the tiles, d 24/40, mixed ranks including 0, empty
segments, up to 64 jobs, all three dtypes); every check draws fresh random inputs and poisons the
outputs it can. The realistic sweep is tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton's jit

import zlib  # noqa: E402

import pytest  # noqa: E402

from kernel_cases import LOGSOFTMAX_TOL, LORA_TOL, lora_case, lora_grads, rel_err  # noqa: E402

from colora.kernels.backend import interpreted_kernels  # noqa: E402

K = interpreted_kernels()  # re-imports the kernels if another test module imported them compiled
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (name, d_in, d_out, tokens per job, rank per job): sizes chosen to hit ragged tails of every tile
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


STREAM_SMALL = {"on": True, "block_m": 16, "block_k": 16, "block_n2": 16, "per_sm": 1}


def _stream_case(dtype=torch.bfloat16, d_in=40, d_out=24, R=16, seed=33):
    """Every rank BLOCK_R (lora_stream_kernel's batches); jobs of 2 full 16-row tiles + 1, none, 4 + 6, and 1 + 5
    rows: full tiles, short ones, a job without rows."""
    return lora_case([33, 0, 70, 21], [R] * 4, d_in, d_out, dtype, DEV, seed=seed)


@pytest.mark.parametrize("layout", ["B^T", "B"])
def test_stream_shrink_expand_equals_the_tile_launch(layout):
    """lora_shrink_expand by lora_stream_kernel (full tiles, TMA descriptors, nothing masked) and lora_shrink_kernel
    (the short tiles) writes what one program a tile writes: h, y or y + the delta, the scales on either side; with
    the expand's weight B^T's transpose view (as the op passes it) or B itself. A job without rows has non-finite
    weights: a full tile's descriptor blocks cover exactly its own job's rank rows, so nothing else reaches y."""
    from colora.kernels.lora.common import h_width
    from colora.kernels.lora.shrink import lora_shrink_expand
    from colora.kernels.lora.stream import stream_config

    case = _stream_case()
    meta, x, A, B = case.meta, case.x.detach(), case.A.detach().clone(), case.B.detach().clone()
    A[16:32], B[:, 16:32] = float("inf"), float("nan")
    w2 = B.t().contiguous().t() if layout == "B^T" else B.contiguous()
    T = x.shape[0]
    for scale_h, scale_out, accumulate in [(False, True, False), (True, False, True)]:
        outs = []
        for cfg in ({"on": False}, STREAM_SMALL):
            h = torch.full((T, h_width(meta, 1)), float("nan"), dtype=x.dtype, device=DEV)
            y = torch.randn(T, 24, generator=torch.Generator().manual_seed(5)).to(x.dtype).to(DEV)
            assert (stream_config("stream", x, A, w2, y, meta, {"stream": cfg}) is not None) == cfg["on"]
            lora_shrink_expand(x, A, w2, meta, h, y, scale_h=scale_h, scale_out=scale_out, accumulate=accumulate,
                               launch={"stream": cfg})
            outs.append((h, y))
        (h_tile, y_tile), (h, y) = outs
        assert torch.equal(h.isnan(), h_tile.isnan())  # the same lanes written
        assert rel_err(h.nan_to_num(0.0), h_tile.nan_to_num(0.0)) <= LORA_TOL[x.dtype]
        assert torch.isfinite(y).all() and rel_err(y, y_tile) <= LORA_TOL[x.dtype]


def test_stream_dy_pass_equals_the_tile_launch():
    """lora_shrink_sgrad with its dx by lora_stream_kernel (dh, dx, and dB's atomic partials from the full tiles; the
    short tiles by lora_shrink_kernel into the same partials) against one program a tile. One job's dy is not
    finite: the other jobs' dh, dx and dB stay finite and equal (a full tile reads its own job's rows only)."""
    from colora.kernels.lora.common import h_width
    from colora.kernels.lora.shrink import lora_shrink, lora_shrink_sgrad

    case = _stream_case(d_in=24, d_out=40)
    meta, x, A, B, dy = case.meta, case.x.detach(), case.A.detach(), case.B.detach(), case.dy.clone()
    dy[meta.seg_start[2]:meta.seg_start[3]] = float("inf")
    Bt = B.t().contiguous()
    T = x.shape[0]
    h = x.new_zeros((T, h_width(meta, 1)))
    lora_shrink(x, A, meta, h)
    outs = []
    for cfg in ({"on": False}, STREAM_SMALL):
        dh = x.new_zeros((T, h_width(meta, 1)))
        dx, dBt = torch.empty_like(x), torch.empty_like(Bt)
        lora_shrink_sgrad(dy, Bt, h, meta, dh, dBt, dx=(A.t(), dx, False),
                          launch={"stream_dy": cfg, "dy_pass": {"block_m": 16, "block_k": 16}})
        outs.append((dh, dx, dBt))
    rows = torch.ones(T, dtype=torch.bool, device=DEV)
    rows[meta.seg_start[2]:meta.seg_start[3]] = False
    for ref, got in zip(*outs):
        if got.shape[0] == T:
            ref, got = ref[rows], got[rows]
        else:  # dB^T: job 2's rank rows carry its non-finite dy
            ref, got = torch.cat([ref[:32], ref[48:]]), torch.cat([got[:32], got[48:]])
        assert torch.isfinite(got).all() and rel_err(got, ref) <= LORA_TOL[x.dtype]


def test_stream_in_the_op_matches_the_reference():
    """The op at rank 64 with lora_stream_kernel by default (the forward, and the dy pass: 256-row tiles from one
    such tile an SM on, 1,024 rows on the interpreter) against the fp64 reference, outputs and gradients."""
    from colora.kernels.lora.common import num_sms
    from colora.kernels.lora.stream import stream_config

    big = 256 * num_sms(torch.device(DEV))  # rows for 256-row tiles in the dy pass (1,024 interpreted)
    case = lora_case([300, 0, big - 203, 9], [64] * 4, 24, 16, torch.bfloat16, DEV, seed=27)
    meta, dy = case.meta, case.dy
    assert stream_config("stream", case.x, case.A, case.B, dy, meta) is not None
    assert stream_config("stream_dy", dy, case.B.t().contiguous(), case.A.t(), case.x, meta) is not None
    ref = lora_grads(K.grouped_lora, case.double(), backend="torch")
    got = lora_grads(K.grouped_lora, case, backend="triton")
    for key in ("y", "dx", "dA", "dB"):
        assert rel_err(got[key], ref[key]) <= LORA_TOL[torch.bfloat16], key


def test_stream_config_falls_back_where_it_cannot_run():
    """lora_stream_kernel only for batches whose every rank is BLOCK_R, 16-bit dtypes, unit column strides and
    16-byte row steps; by default at BLOCK_R 64 only, and the dy pass from one 256-row tile an SM on."""
    from colora.kernels.lora.common import num_sms
    from colora.kernels.lora.stream import stream_config

    bf16 = dict(device=DEV, dtype=torch.bfloat16)
    big = 256 * num_sms(torch.device(DEV))

    def meta(ranks, tokens):
        return K.LoRABatchMeta.build([0, tokens // 2, tokens], [0, ranks[0], sum(ranks)], [1.0, 1.0], DEV)

    x, w, w2 = torch.randn(64, 48, **bf16), torch.randn(128, 48, **bf16), torch.randn(128, 40, **bf16).t()
    y = torch.empty(64, 40, **bf16)

    def config(x=x, w=w, w2=w2, y=y, ranks=(64, 64), kernel="stream", launch=None):
        return stream_config(kernel, x, w, w2, y, meta(ranks, x.shape[0]), launch)

    assert config() is not None and config()["w2_nr"] is False  # the default at BLOCK_R 64; w2 = B^T's view
    assert config(w2=w2.contiguous())["w2_nr"] is True  # w2 = B itself
    assert config(ranks=(64, 32)) is None  # a rank below BLOCK_R
    assert config(x.float(), w.float(), w2.float(), y.float()) is None
    assert config(x.t().contiguous().t()) is None  # x column-major
    assert config(y=y.t().contiguous().t()) is None  # out column-major
    odd = torch.randn(64, 47, **bf16)[:, :46]  # rows 47 elements apart: not a 16-byte step
    assert config(odd, torch.randn(128, 46, **bf16)) is None
    assert config(w=w[:32], w2=w2[:, :32], ranks=(16, 16)) is None  # off at BLOCK_R 16 by default
    assert config(w=w[:32], w2=w2[:, :32], ranks=(16, 16), launch={"stream": {"on": True}}) is not None
    assert config(launch={"stream": {"on": False}}) is None
    xb, yb = torch.randn(big, 48, **bf16), torch.empty(big, 40, **bf16)
    assert config(xb, y=yb, kernel="stream_dy") is not None
    assert config(xb[:big - 2], y=yb[:big - 2], kernel="stream_dy") is None  # 64-row tiles below 256 x SMs rows


def test_full_tiles_split_every_job_rows():
    """LoRABatchMeta.full_tiles: the tiles of exactly `block` rows, then each job's short last one, covering every
    row once."""
    meta = K.LoRABatchMeta.build([0, 33, 33, 103, 112, 128], [0, 1, 2, 3, 4, 5], [1.0] * 5, DEV)
    full, short = meta.full_tiles(16)
    assert full.job.tolist() == [0, 0, 2, 2, 2, 2, 4] and full.row.tolist() == [0, 16, 33, 49, 65, 81, 112]
    assert short.job.tolist() == [0, 2, 3] and short.row.tolist() == [32, 97, 103]
    assert full.job_start.tolist() == [0, 2, 2, 6, 6, 7] and short.job_start.tolist() == [0, 1, 1, 2, 3, 3]
    assert meta.full_tiles(16) is meta.full_tiles(16)


def test_packed_call_with_distinct_weights_matches_the_reference():
    """A packed call (two slices, each with its own B) expands y and dx by lora_expand; outputs and gradients
    match the fp64 reference."""
    case = lora_case([300, 40], [16, 4], 24, 40, torch.float32, DEV, seed=22)
    dys = [torch.randn(340, 40, generator=torch.Generator().manual_seed(s)).to(DEV) for s in (1, 2)]
    B2 = case.B.detach().flip(0).clone().requires_grad_()

    def run(backend, dtype=torch.float32):
        x, A, B, B2_ = (t.detach().to(dtype).requires_grad_() for t in (case.x, case.A, case.B, B2))
        ys = K.grouped_lora_packed(x, [A, A], [B, B2_], case.meta, backend=backend)
        return [y.detach() for y in ys] + list(torch.autograd.grad(ys, (x, A, B, B2_), [d.to(dtype) for d in dys]))

    want = run("torch", torch.float64)
    for a, b in zip(run("triton"), want):
        assert rel_err(a, b) <= LORA_TOL[torch.float32]


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def test_triton_path_is_deterministic_when_torch_is_asked(deterministic, monkeypatch):
    """Under torch.use_deterministic_algorithms the fused dy pass writes one dB partial a tile, summed
    in tile order (no atomics), so two calls give the same bits; several 64-row tiles a job."""
    from colora.kernels.lora import shrink
    from colora.kernels.lora.policy import atomic_db

    atomic, real = [], shrink._launch_shrink
    monkeypatch.setattr(shrink, "_launch_shrink", lambda *a, **k: atomic.append(k.get("atomic")) or real(*a, **k))
    case = lora_case([150, 170], [16, 8], 40, 24, torch.bfloat16, DEV, seed=9)
    a = lora_grads(K.grouped_lora, case, backend="triton")
    b = lora_grads(K.grouped_lora, case, backend="triton")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [a for a in atomic if a is not None] == [False, False]  # the two dy passes (forwards: None)
    assert not atomic_db()


@pytest.mark.parametrize("tokens", [[150, 0, 90, 5], [1200, 0, 900, 7]], ids=["64-row tiles", "256-row tiles"])
def test_atomic_db_partials_equal_the_per_tile_ones(tokens, monkeypatch):
    """dB summed by atomic additions into one fp32 partial a job equals the per-tile partials summed
    in order (and the fp64 reference), with several tiles a job, a job without rows (zeros) and a
    rank-0 job with rows; it is the default unless torch is asked for determinism."""
    from colora.kernels.lora import shrink
    from colora.kernels.lora.policy import atomic_db

    atomic, real = [], shrink._launch_shrink
    monkeypatch.setattr(shrink, "_launch_shrink", lambda *a, **k: atomic.append(k.get("atomic")) or real(*a, **k))
    case = lora_case(tokens, [16, 8, 0, 4], 40, 24, torch.float32, DEV, seed=11)
    got = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=True)
    assert atomic[-1] is True and atomic_db()
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        per_tile = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=True)
    finally:
        torch.use_deterministic_algorithms(was)
    assert atomic[-1] is False
    ref = lora_grads(K.grouped_lora, case.double(), backend="torch")
    for key in ("dx", "dA", "dB"):
        assert rel_err(got[key], ref[key]) <= LORA_TOL[torch.float32], key
        assert rel_err(got[key], per_tile[key]) <= LORA_TOL[torch.float32], key
    r0, r1 = case.meta.rank_start[1], case.meta.rank_start[2]  # the job without rows
    assert (got["dB"][:, r0:r1] == 0).all()


def test_dy_pass_fuses_where_the_rule_says():
    """fuse_dy_pays: always at BLOCK_R <= 32; at BLOCK_R 64 only with atomic partials, 256-row tiles
    (256 x SMs rows: 1,024 on the interpreter) and a 16-bit dtype, whichever of dx and dy is wider; never
    above 64."""
    from colora.kernels.lora.common import num_sms
    from colora.kernels.lora.policy import fuse_dy_pays

    def meta(tokens, rank):
        return K.LoRABatchMeta.build([0, tokens // 2, tokens], [0, rank, 2 * rank], [1.0, 1.0], DEV)

    def pays(tokens, rank, d_in, d_out, dtype=torch.bfloat16):
        return fuse_dy_pays(meta(tokens, rank), d_in, d_out, dtype)

    big = 256 * num_sms(torch.device(DEV))
    assert pays(64, 16, 40, 24) and pays(big, 32, 40, 24) and pays(64, 16, 40, 24, torch.float32)
    assert pays(big, 64, 24, 40) and pays(big, 48, 24, 24) and pays(big, 64, 24, 40, torch.float16)
    assert pays(big, 64, 40, 24)  # dx wider than dy: it pays (measured at 8e23cbf)
    assert not pays(big - 2, 64, 24, 40)  # 64-row tiles
    assert not pays(big, 64, 24, 40, torch.float32)  # the fp32 pass would spill
    assert not pays(big, 128, 24, 40)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not pays(big, 64, 24, 40)
        assert pays(big, 16, 24, 40)  # per-tile partials at rank <= 32
    finally:
        torch.use_deterministic_algorithms(was)


def test_meta_rejects_bad_layouts():
    with pytest.raises(ValueError, match="seg_start must be non-decreasing"):
        K.LoRABatchMeta.build([0, 5, 3], [0, 4, 8], [1.0, 1.0])
    with pytest.raises(ValueError, match="rank_start must start at 0"):
        K.LoRABatchMeta.build([0, 5], [2, 4], [1.0])
    with pytest.raises(ValueError, match=r"scale 2 \(got 1\)"):
        K.LoRABatchMeta.build([0, 5, 6], [0, 4, 8], [1.0])
    case = lora_case([5, 6], [4, 4], 24, 24, torch.float32, DEV, seed=2)
    with pytest.raises(ValueError, match="seg_start"):
        K.grouped_lora(case.x[:10], case.A, case.B, meta=case.meta)
    with pytest.raises(ValueError, match="backend 'cuda'"):
        K.grouped_lora(case.x, case.A, case.B, meta=case.meta, backend="cuda")
    assert K.resolve_backend("auto", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("rows", [[1], [3, 0, 5], [64, 17, 1, 130], [7] * 9])
def test_kernel_metadata_starts_on_16_byte_boundaries(rows):
    """Triton compiles a kernel again for each new pattern of its pointers' 16-byte alignment. The
    tile arrays sat back to back (row at 4n bytes for n tiles), so micro-batches whose tile count
    was not a multiple of 4 compiled the LoRA kernels again mid-run; the values stay what they were."""
    seg = [0]
    for r in rows:
        seg.append(seg[-1] + r)
    ranks = [0] + [8 * (j + 1) for j in range(len(rows))]
    m = K.LoRABatchMeta.build(seg, ranks, [1.0] * len(rows))
    tensors = {"seg_start": m.seg_start_t, "rank_start": m.rank_start_t, "scale": m.scale_t}
    for block in (1, 2, 3, 16, 64):
        t = m.tiles(block)
        tensors |= {f"job/{block}": t.job, f"row/{block}": t.row, f"job_start/{block}": t.job_start}
        per_job = [-(-r // block) for r in rows]
        assert t.n == sum(per_job) and t.job_start.tolist() == [sum(per_job[:j]) for j in range(len(rows) + 1)]
        assert t.job.tolist() == [j for j, n in enumerate(per_job) for _ in range(n)]
        assert t.row.tolist() == [seg[j] + i * block for j, n in enumerate(per_job) for i in range(n)]
    assert m.seg_start_t.tolist() == seg and m.rank_start_t.tolist() == ranks
    misaligned = {k: v.data_ptr() % 16 for k, v in tensors.items() if v.data_ptr() % 16}
    assert not misaligned, misaligned


def test_upload_aligned_keeps_values_and_aligns_every_part():
    parts = [[1.5, 2.5, 3.5], [], [4.0], [5.0, 6.0, 7.0, 8.0, 9.0]]
    out = K.upload_aligned(parts, torch.float32, torch.device("cpu"))
    assert [o.tolist() for o in out] == parts
    assert all(o.data_ptr() % 16 == 0 and o.dtype == torch.float32 for o in out)


def test_log_softmax_hands_its_kernel_aligned_vectors():
    from colora.kernels.logsoftmax import _aligned

    base = torch.arange(9, dtype=torch.float32)
    odd = base[1:]  # 4 bytes past a 16-byte boundary
    assert odd.data_ptr() % 16 == 4
    fixed = _aligned(odd)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, odd)
    assert _aligned(base) is base  # aligned already: no copy


def test_lists_tensors_and_meta_give_the_same_result():
    case = lora_case([5, 9], [4, 8], 24, 24, torch.float32, DEV, seed=4)
    m = case.meta
    a = K.grouped_lora(case.x, case.A, case.B, list(m.seg_start), list(m.rank_start), list(m.scale), backend="triton")
    b = K.grouped_lora(case.x, case.A, case.B, torch.tensor(m.seg_start), torch.tensor(m.rank_start),
                       torch.tensor(m.scale), backend="triton")
    c = K.grouped_lora(case.x, case.A, case.B, meta=m, backend="triton")
    assert torch.equal(a, b) and torch.equal(a, c)


# -- selective log-softmax -------------------------------------------------------------------------

def _logsoftmax_problem(T, d, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, d, generator=g).to(dtype).to(DEV).requires_grad_()
    W = (torch.randn(V, d, generator=g) * 3 * d ** -0.5).to(dtype).to(DEV)  # logits of std ~3
    tgt = torch.randint(0, V, (T,), generator=g).to(DEV)
    temp = (torch.rand(T, generator=g) + 0.5).to(DEV)  # per row, as jobs sample at different temperatures
    gout = torch.randn(T, generator=g).to(DEV)
    return h, W, tgt, temp, gout


def _fp64_reference(h, W, tgt, temp):
    z = torch.log_softmax((h.double() @ W.double().t()) / temp.double()[:, None], -1)
    return z.gather(1, tgt[:, None]).squeeze(1), -(z.exp() * z).sum(-1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_selective_log_softmax_matches_fp64(dtype, backend):
    """V = 5000 spans two vocab tiles of the kernel; chunks of 16 rows leave a ragged last chunk."""
    h, W, tgt, temp, gout = _logsoftmax_problem(37, 24, 5000, dtype, seed=zlib.crc32(f"lsm/{dtype}".encode()))
    logp, ent = K.selective_log_softmax(h, W, tgt, temperature=temp, chunk_size=16, return_entropy=True,
                                        backend=backend)
    (dh,) = torch.autograd.grad(logp, h, gout)
    h64 = h.detach().double().requires_grad_()
    ref_logp, ref_ent = _fp64_reference(h64, W, tgt, temp)
    (ref_dh,) = torch.autograd.grad(ref_logp, h64, gout.double())
    atol, rtol = LOGSOFTMAX_TOL[dtype]
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32 and dh.dtype == dtype
    assert (logp.double() - ref_logp).abs().max() <= atol
    assert (ent.double() - ref_ent).abs().max() <= atol
    assert rel_err(dh, ref_dh) <= rtol


def test_selective_log_softmax_gradcheck_torch_path():
    """Finite differences in fp64 through the chunked reference's hand-written backward."""
    h, W, tgt, temp, _ = _logsoftmax_problem(5, 6, 11, torch.float64, seed=3)
    fn = lambda hh: K.selective_log_softmax(hh, W, tgt, temperature=temp, chunk_size=2, backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h,))


def test_selective_log_softmax_inference_path_and_float_temperature():
    h, W, tgt, _, _ = _logsoftmax_problem(20, 24, 300, torch.float32, seed=4)
    with_grad = K.selective_log_softmax(h, W, tgt, temperature=0.7, chunk_size=8, backend="triton")
    with torch.no_grad():
        no_grad = K.selective_log_softmax(h, W, tgt, temperature=torch.full((20,), 0.7), chunk_size=8,
                                          backend="triton")
    # the same kernel without the gradient pass (another compiled variant: allow rounding-level drift)
    torch.testing.assert_close(with_grad.detach(), no_grad, rtol=0, atol=1e-6)
    assert not no_grad.requires_grad


def test_selective_log_softmax_rejects_a_trainable_head():
    h, W, tgt, _, _ = _logsoftmax_problem(4, 8, 16, torch.float32, seed=5)
    with pytest.raises(ValueError, match="frozen"):
        K.selective_log_softmax(h, W.requires_grad_(), tgt)


def test_bench_kernels_reduce_writes_its_table(tmp_path):
    """`colora bench kernels --quick --only reduce` on the CPU: one row per reduce case with both
    launches timed, the JSON and the Markdown table written."""
    import json

    from colora.bench.kernels import main

    assert main(["--quick", "--only", "reduce", "--out", str(tmp_path / "k")]) == 0
    rows = json.loads((tmp_path / "k.json").read_text())["reduce"]
    assert [r["case"] for r in rows] == ["dB tiny", "dA tiny packed"]
    assert all(r["before_us"] > 0 and r["now_us"] > 0 and r["shape_before"][1] == 1 for r in rows)
    md = (tmp_path / "k.md").read_text()
    assert "## Segment reduction" in md and "| dB tiny | 48 | 16 | 4 x 40 |" in md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 5, 100), (0, 32), (1, 3)], ids=str)
def test_rms_norm_kernel_matches_the_model_code(dtype, shape):
    """kernels/rmsnorm.py against Hugging Face's RMSNorm arithmetic (rms_norm_ref), forward and the
    input's gradient: fp32 to rounding; bf16/fp16 within one rounding of the output (fp32 rsqrt
    against 1/sqrt can move a value across a rounding boundary), odd widths, 4-D (q/k norms per
    head), empty."""
    from colora.kernels.rmsnorm import rms_norm, rms_norm_ref

    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(DEV).requires_grad_()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(DEV)
    dy = torch.randn(*shape, generator=g).to(dtype).to(DEV)
    y = rms_norm(x, w, 1e-6)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = rms_norm_ref(x_ref, w, 1e-6)
    assert y.shape == y_ref.shape and y.dtype == dtype
    if x.numel() == 0:
        return
    (dx,), (dx_ref,) = torch.autograd.grad(y, x, dy), torch.autograd.grad(y_ref, x_ref, dy)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # fp32: rounding; else one step of a 8/11-bit mantissa
    assert rel_err(y, y_ref) <= tol and rel_err(dx, dx_ref) <= tol
    # a transposed input (not unit stride along the normalised dim) takes the same result
    xt = x.detach().transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() > 1 and shape[-1] > 1 else x.detach()
    assert torch.equal(rms_norm(xt, w, 1e-6), y.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [(1, 16, 8, 37, 128, 1), (2, 3, 1, 5, 16, 2), (2, 4, 2, 9, 24, 1), (1, 2, 2, 0, 8, 1)],
                         ids=["qwen3_heads", "batch2_odd_heads", "batch2_shared_cos_d24", "empty"])
def test_rotary_kernel_matches_the_model_code(dtype, case):
    """kernels/rotary.py against the model's apply_rotary_pos_emb (rotary_ref), forward and both
    inputs' gradients, from q and k laid out as the attention layers pass them ([B, H, T, D] views
    of [B, T, H, D]): fp32 to rounding, bf16/fp16 within one rounding (the kernel rounds where eager
    rounds; an FMA can move a product's last bit); the outputs and gradients in that same layout."""
    from colora.kernels.rotary import rotary, rotary_ref

    B, Hq, Hk, T, D, Bc = case
    g = torch.Generator().manual_seed(B * 100 + Hq * 10 + T)

    def draw(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(DEV)

    q0, k0 = draw(B, T, Hq, D), draw(B, T, Hk, D)
    cos, sin = draw(Bc, T, D), draw(Bc, T, D)
    dq, dk = draw(B, T, Hq, D).transpose(1, 2), draw(B, T, Hk, D).transpose(1, 2)

    def run(fn):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qe, ke = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        if T:
            torch.autograd.backward((qe, ke), (dq, dk))
        return qe, ke, q.grad, k.grad

    got, want = run(rotary), run(rotary_ref)
    assert got[0].shape == (B, Hq, T, D) and got[1].shape == (B, Hk, T, D) and got[0].dtype == dtype
    assert got[0].transpose(1, 2).is_contiguous() and got[1].transpose(1, 2).is_contiguous()
    if T == 0:
        return
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol
    # inputs in another layout ([B, H, T, D]-contiguous) take the same result
    qc, kc = q0.transpose(1, 2).contiguous(), k0.transpose(1, 2).contiguous()
    assert all(torch.equal(a, b) for a, b in zip(rotary(qc, kc, cos, sin), got[:2]))


def test_rotary_kernel_refuses_what_it_cannot_compute():
    from colora.kernels.rotary import rotary

    q, k, c = torch.randn(1, 2, 3, 8, device=DEV), torch.randn(1, 1, 3, 8, device=DEV), torch.randn(1, 3, 8, device=DEV)
    with pytest.raises(ValueError, match="rotary takes"):
        rotary(q, k, c.requires_grad_(), c.detach())
    with pytest.raises(ValueError, match="rotary takes"):
        rotary(q, k, c.detach().double(), c.detach().double())
    with pytest.raises(ValueError, match="rotary takes"):
        rotary(q[..., :7], k[..., :7], c.detach()[..., :7], c.detach()[..., :7])


def test_rms_norm_kernel_refuses_what_it_cannot_compute():
    from colora.kernels.rmsnorm import rms_norm

    x = torch.randn(4, 16, device=DEV)
    with pytest.raises(ValueError, match="must be frozen"):
        rms_norm(x, torch.ones(16, device=DEV, requires_grad=True), 1e-6)
    with pytest.raises(ValueError, match=r"must be \[16\]"):
        rms_norm(x, torch.ones(8, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="in x's dtype"):
        rms_norm(x, torch.ones(16, device=DEV, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 1500), (0, 16)], ids=str)
def test_swiglu_kernel_matches_the_model_code(dtype, shape):
    """kernels/swiglu.py against F.silu(gate) * up, forward and both gradients: fp32 to rounding,
    bf16/fp16 within one rounding (the sigmoid's last bit), across block edges, empty."""
    from colora.kernels.swiglu import swiglu, swiglu_ref

    gen = torch.Generator().manual_seed(sum(shape) + 2)
    gate, up, dy = ((torch.randn(*shape, generator=gen) * 3).to(dtype).to(DEV) for _ in range(3))
    got_in = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    ref_in = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    y, y_ref = swiglu(*got_in), swiglu_ref(*ref_in)
    assert y.shape == y_ref.shape and y.dtype == dtype
    if y.numel() == 0:
        return
    got = [y, *torch.autograd.grad(y, got_in, dy)]
    want = [y_ref, *torch.autograd.grad(y_ref, ref_in, dy)]
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol
    with pytest.raises(ValueError, match="must match"):
        swiglu(gate, up[..., :-1])


def test_bench_kernels_lora_table_on_the_cpu(tmp_path):
    """`colora bench kernels --quick --only lora` on the CPU: every row timed, no CUDA-graph timing
    there ('-' in the table)."""
    import json

    from colora.bench.kernels import main

    assert main(["--quick", "--only", "lora", "--out", str(tmp_path / "k")]) == 0
    rows = json.loads((tmp_path / "k.json").read_text())["lora"]
    # (run on the GPU host too, where the rows have their CUDA-graph timing)
    graphs = torch.cuda.is_available()
    assert rows and all(r["triton_ms"] > 0 and r["loop_ms"] > 0 and (r["graph_ms"] is not None) == graphs for r in rows)
    md = (tmp_path / "k.md").read_text()
    assert "| x bound (graph) |" in md and md.count(" | - | - | - |") == (0 if graphs else len(rows))


def test_bench_kernels_targets_read_the_graph_timing_where_every_row_has_one():
    from colora.bench.kernels import _targets

    rows = [{"shape": "q", "rank": 16, "jobs": 8, "tokens_per_job": 24576, "x_bound": 1.65, "x_bound_graph": 1.21},
            {"shape": "o", "rank": 16, "jobs": 8, "tokens_per_job": 24576, "x_bound": 1.25, "x_bound_graph": 1.12},
            {"shape": "q", "rank": 16, "jobs": 8, "tokens_per_job": 2048, "speedup": 3.7}]
    text = "\n".join(_targets(rows))
    assert "24576 tokens/job (x_bound_graph): q r16: 1.21x bound, o r16: 1.12x bound" in text
    assert "2048 tokens/job (speedup): q r16: 3.7x faster" in text
    rows[1]["x_bound_graph"] = None  # one row without a graph: the event timing for all
    assert "24576 tokens/job (x_bound): q r16: 1.65x bound, o r16: 1.25x bound" in "\n".join(_targets(rows))


def test_bench_kernels_base_plus_lora_table_on_the_cpu(tmp_path):
    """`colora bench kernels --quick --only add_to`: the base projection alone and the three ways of
    adding the LoRA to it (separate, add_to, the base inside the op), each timed, in the table."""
    import json

    from colora.bench.kernels import main

    assert main(["--quick", "--only", "add_to", "--out", str(tmp_path / "k")]) == 0
    (row,) = json.loads((tmp_path / "k.json").read_text())["add_to"]
    assert all(row[k] > 0 for k in ("base_ms", "separate_ms", "add_to_ms", "base_in_op_ms"))
    assert row["lora_overhead_base_in_op"] == pytest.approx(row["base_in_op_ms"] / row["base_ms"] - 1)
    md = (tmp_path / "k.md").read_text()
    assert "| base in op ms |" in md and "| tiny | 4 x 48 |" in md


def test_kernel_times_sum_each_kernel_per_call_largest_first():
    from types import SimpleNamespace as E

    from colora.bench.measure import kernel_times

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [E(name="lora_shrink_kernel", device_type=cuda, device_time_total=30.0),
              E(name="lora_expand_kernel", device_type=cuda, device_time_total=50.0),
              E(name="lora_shrink_kernel", device_type=cuda, device_time_total=40.0),
              E(name="aten::mm", device_type=cpu, device_time_total=999.0),  # a host op: its kernels count apart
              E(name="Optimizer.step", device_type=cuda, device_time_total=500.0, is_user_annotation=True)]
    assert list(kernel_times(events, calls=2).items()) == [("lora_shrink_kernel", 35.0), ("lora_expand_kernel", 25.0)]


def test_kernel_breakdown_table_in_the_markdown():
    from colora.bench.kernels import to_markdown

    row = {"shape": "k/v", "d_in": 1024, "d_out": 1024, "rank": 16, "jobs": 8, "tokens_per_job": 24576,
           "tokens": 196608, "triton_ms": 1.1, "fused_dy": True, "other_fuse_ms": 1.0, "loop_ms": 4.8,
           "speedup": 4.4, "TFLOPs": 34.0, "peak_share": 0.05, "bound_GBps": 1800.0, "x_bound": 2.3,
           "graph_ms": 0.638, "graph_GBps": 3150.0, "x_bound_graph": 1.33,
           "kernels_us": {"lora_shrink_kernel": 300.0, "lora_expand_kernel": 250.0}, "x_bound_kernels": 1.15,
           "fused_expand": True, "graph_ms_expand_other": 0.7004, "kernels_us_expand_other": 612.4,
           "cublas_graph_ms": 0.709, "x_bound_cublas": 1.49}
    result = {"command": "colora bench kernels", "calibration": {"copy_GBps": 4200.0, "bf16_matmul_TFLOPs": 800.0},
              "environment": {"device": "H200", "torch": "2.11", "triton": "3.6", "date": "today"},
              "lora": [row, dict(row, rank=64, fused_expand=False, graph_ms_expand_other=None,
                                 kernels_us_expand_other=None, cublas_graph_ms=None, x_bound_cublas=None)],
              "add_to": [], "logsoftmax": []}
    md = to_markdown(result)
    assert "### Kernel by kernel at 8 jobs x 24k tokens" in md
    assert ("| k/v | 16 | 550 | 1.15 | 638 | fused | 612 | 700 | 709 | 1.49 | lora_shrink_kernel 300, "
            "lora_expand_kernel 250 |") in md
    assert "| k/v | 64 | 550 | 1.15 | 638 | separate | - | - | - | - | lora_shrink_kernel 300, lora_expand_kernel 250 |" in md
    assert "24576 tokens/job (x_bound_graph): k/v r16: 1.33x bound" in md


def test_dense_lora_products_are_one_adapters_forward_and_backward():
    """The benchmark's cuBLAS ceiling computes what it stands for: y = x A^T B^T and autograd's dx, dA,
    dB of it for an incoming dy (float64, so the two orders of summation agree to rounding)."""
    from colora.bench.kernels import dense_lora_products

    g = torch.Generator().manual_seed(5)
    x, A, B, dy = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((37, 24), (8, 24), (40, 8), (37, 40)))
    leaves = [t.clone().requires_grad_() for t in (x, A, B)]
    y_ref = leaves[0] @ leaves[1].t() @ leaves[2].t()
    want = (y_ref.detach(), *torch.autograd.grad(y_ref, leaves, dy))
    got = dense_lora_products(x, A, B, dy)
    for name, a, b in zip(("y", "dx", "dA", "dB"), got, want):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=1e-12), name


def test_launch_parameters_reach_the_launches_and_keep_the_results():
    """The tuner's launch parameters (colora/bench/tune.py, grouped_lora's launch=): other tile sizes, warps,
    stages and chunks for every launcher give the same gradients within the table's tolerance; the expand's
    128-row chunks and the sgrad's 512-row chunks are the ones built; unknown kernels or parameters are refused."""
    launch = {"shrink": {"block_m": 128, "block_k": 32, "warps": 8, "stages": 2},
              "dy_pass": {"block_m": 128, "block_k": 16, "warps": 4, "stages": 2},
              "expand": {"block_t": 32, "block_n": 16, "warps": 8, "stages": 3, "chunk": 128},
              "sgrad": {"block_t": 32, "block_n": 16, "warps": 8, "stages": 2, "chunk": 512}}
    for fuse in (True, False):
        case = lora_case([300, 0, 170, 9], [16, 8, 0, 4], 40, 24, torch.bfloat16, DEV, seed=31)
        want = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=fuse)
        got = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=fuse, launch=launch)
        assert {128, 512} <= set(case.meta._tiles)
        for key in ("y", "dx", "dA", "dB"):
            assert rel_err(got[key], want[key]) <= LORA_TOL[torch.bfloat16], (fuse, key)
    for bad in ({"expand": {"block_k": 64}}, {"reduce": {"block_n": 64}}):
        with pytest.raises(ValueError, match="tunable"):
            lora_grads(K.grouped_lora, case, backend="triton", launch=bad)


def test_bench_kernels_tune_searches_every_launcher_on_the_cpu(tmp_path):
    """`colora bench kernels --quick --only tune` through the interpreter: every launcher's candidates
    tried on the tiny problem (plumbing only: the CPU's times mean nothing), the best of each and all
    of them together recorded, and the tables written."""
    import json

    from colora.bench.kernels import main
    from colora.bench.tune import SEARCHED, candidates
    from colora.kernels.lora.policy import TUNABLE

    assert main(["--quick", "--only", "tune", "--out", str(tmp_path / "k")]) == 0
    (row,) = json.loads((tmp_path / "k.json").read_text())["tune"]
    assert row["problem"] == "tiny r16" and row["default_us"] > 0 and row["combined_us"] > 0
    assert [t["kernel"] for t in row["trials"]] == [k for k in SEARCHED for _ in candidates(k, quick=True)]
    assert all(t["error"] is None and t["us"] > 0 for t in row["trials"])
    assert set(row["best"]) <= set(TUNABLE)
    md = (tmp_path / "k.md").read_text()
    assert "## Launch parameters searched" in md and "| tiny r16 |" in md


def test_compile_check_covers_every_tuning_candidate():
    """`python -m colora.bench.compile_check --tune` compiles each of colora/bench/tune.py's candidates
    (ranks 16 and 64; the fused dy pass with its atomic dB partials, the default) with its block sizes,
    warps and stages."""
    from colora.bench.compile_check import tune_variants
    from colora.bench.tune import candidates

    got = list(tune_variants())
    for R in (16, 64):
        for kernel in ("shrink", "dy_pass", "expand", "sgrad"):
            mine = [v for v in got if v[0].startswith(f"tune {kernel} R{R} ")]
            assert len(mine) == len(candidates(kernel, quick=False))
            for (_, _, _, consts, _, _, warps, stages), cfg in zip(mine, candidates(kernel, quick=False)):
                assert (warps, stages) == (cfg["warps"], cfg["stages"])
                assert all(consts[c] == cfg[k] for k, c in (("block_m", "BLOCK_M"), ("block_k", "BLOCK_K"),
                                                            ("block_n", "BLOCK_N"), ("block_t", "BLOCK_T"),
                                                            ("block_n2", "BLOCK_N2")) if k in cfg)
                assert consts.get("FUSE_EXPAND", kernel not in ("shrink", "dy_pass"))  # as launched
