"""The grouped-LoRA op's launch routes, each against the tile launch or the reference: streamed
launches, fused dy passes, atomic dB partials, determinism, the metadata's layout and alignment.

    pytest tests/test_kernel_lora_routes.py -q            (CPU: conftest.py sets TRITON_INTERPRET=1 without a GPU)

Small odd shapes (rows not a multiple of the tiles, mixed ranks including 0, empty segments, all three
dtypes); every check draws fresh random inputs and poisons the outputs it can. The realistic sweep is
tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEV, K, LORA_TOL, lora_case, lora_grads, rel_err


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
