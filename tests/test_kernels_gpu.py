"""colora.kernels on the GPU at realistic shapes, against the float64 reference.

    pytest tests/test_kernels_gpu.py -m gpu -q -rA
    COLORA_KERNEL_TEST_LOG=runs/kernels/gpu_tests.jsonl pytest tests/test_kernels_gpu.py -m gpu -q

Qwen3-0.6B projection shapes, 1-32 jobs with mixed ranks 8/16/64 (and 0), empty segments, every
dtype; int64 offsets past 2^31 elements; the selective log-softmax over the real 151,936 vocab. With
COLORA_KERNEL_TEST_LOG set, every comparison appends its measured error to that JSON-lines file (a
record of the sweep for a report).
"""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import colora.kernels as K  # noqa: E402
from kernel_cases import LOGSOFTMAX_TOL, LORA_TOL, lora_case, lora_grads, rel_err  # noqa: E402

DEV = torch.device("cuda")
SHAPES = [(1024, 2048), (1024, 1024), (2048, 1024), (1024, 3072), (3072, 1024)]  # q, k/v, o, gate/up, down


def _record(test: str, **fields) -> None:
    path = os.environ.get("COLORA_KERNEL_TEST_LOG")
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **fields}) + "\n")


def _layout(J: int, seed: int):
    """Tokens per job around 2k (one job empty when J > 1), ranks from {8, 16, 64} (one 0 when J > 2)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 3000, (J,), generator=g).tolist()
    ranks = [[8, 16, 64][i] for i in torch.randint(0, 3, (J,), generator=g).tolist()]
    if J > 1:
        tokens[J // 2] = 0
    if J > 2:
        ranks[-1] = 0
    return tokens, ranks


SWEEP = [(J, d_in, d_out, torch.bfloat16) for J in (1, 8, 32) for d_in, d_out in SHAPES]
SWEEP += [(8, 1024, 3072, torch.float16), (8, 3072, 1024, torch.float32), (64, 1024, 1024, torch.bfloat16)]


@pytest.mark.parametrize("J,d_in,d_out,dtype", SWEEP, ids=[f"J{c[0]}-{c[1]}x{c[2]}-{str(c[3])[6:]}" for c in SWEEP])
def test_grouped_lora_gpu_sweep(J, d_in, d_out, dtype):
    seed = zlib.crc32(f"{J}/{d_in}/{d_out}/{dtype}".encode())
    tokens, ranks = _layout(J, seed)
    case = lora_case(tokens, ranks, d_in, d_out, dtype, DEV, seed)
    got = lora_grads(K.grouped_lora, case, backend="triton")
    ref = lora_grads(K.grouped_lora, case.double(), backend="torch")
    errs = {k: rel_err(got[k], ref[k]) for k in got}
    _record("grouped_lora", J=J, d_in=d_in, d_out=d_out, dtype=str(dtype), tokens=sum(tokens), errors=errs,
            tol=LORA_TOL[dtype])
    for k in got:
        assert torch.isfinite(got[k]).all(), k
        assert errs[k] <= LORA_TOL[dtype], f"{k}: {errs[k]:.2e}"


@pytest.mark.parametrize("fuse_dy", [True, False])
def test_fused_dy_large_tiles_gpu(fuse_dy):
    """80k rows: past 256 x SMs, the fused dy pass runs 256-row tiles; both paths match fp64."""
    dtype = torch.bfloat16
    case = lora_case([40_000, 0, 35_000, 5_000], [16, 8, 0, 4], 1024, 3072, dtype, DEV, seed=13)
    got = lora_grads(K.grouped_lora, case, backend="triton", fuse_dy=fuse_dy)
    ref = lora_grads(K.grouped_lora, case.double(), backend="torch")
    errs = {k: rel_err(got[k], ref[k]) for k in got}
    _record("fused_dy_large_tiles", fuse_dy=fuse_dy, errors=errs, tol=LORA_TOL[dtype])
    assert max(errs.values()) <= LORA_TOL[dtype], errs


@pytest.mark.parametrize("add_to", [False, True])
def test_packed_qkv_gpu(add_to):
    tokens, ranks = _layout(8, seed=21)
    dtype = torch.bfloat16
    base = lora_case(tokens, ranks, 1024, 16, dtype, DEV, seed=21)
    g = torch.Generator(device=DEV).manual_seed(21)
    R, T = base.meta.total_rank, base.x.shape[0]
    outs = (2048, 1024, 1024)
    As = [(torch.randn(R, 1024, device=DEV, generator=g) / 32).to(dtype).requires_grad_() for _ in outs]
    Bs = [(torch.randn(d, R, device=DEV, generator=g) / 8).to(dtype).requires_grad_() for d in outs]
    dys = [torch.randn(T, d, device=DEV, generator=g).to(dtype) for d in outs]
    bases = [torch.randn(T, d, device=DEV, generator=g).to(dtype) for d in outs]
    x = base.x

    def run(xx, AA, BB, be):
        if be == "triton":
            ys = K.grouped_lora_packed(xx, AA, BB, base.meta, backend=be,
                                       add_to=[b.clone().to(xx.dtype) for b in bases] if add_to else None)
        else:
            ys = [K.grouped_lora(xx, A, B, meta=base.meta, backend=be) for A, B in zip(AA, BB)]
            ys = [b.to(xx.dtype) + y for b, y in zip(bases, ys)] if add_to else ys
        grads = torch.autograd.grad(ys, [xx, *AA, *BB], [d.to(xx.dtype) for d in dys])
        return [y.detach() for y in ys] + list(grads)

    got = run(x, As, Bs, "triton")
    d = lambda t: t.detach().double().requires_grad_()  # noqa: E731
    ref = run(d(x), [d(a) for a in As], [d(b) for b in Bs], "torch")
    errs = [rel_err(a, b) for a, b in zip(got, ref)]
    _record("packed_qkv", add_to=add_to, errors=errs, tol=LORA_TOL[dtype])
    assert max(errs) <= LORA_TOL[dtype], errs


@pytest.mark.parametrize("d_in,d_out", SHAPES, ids=["q", "k/v", "o", "gate/up", "down"])
def test_stream_gpu(d_in, d_out):
    """The op at rank 64 as it runs by default at 8 jobs x ~5k tokens (one empty): lora_stream_kernel's forward
    and dy pass (TMA descriptors, full tiles; each job's short last tile by lora_shrink_kernel), against fp64; and
    the same with the stream launches off."""
    from colora.kernels.lora.stream import stream_config

    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(d_in + d_out)
    tokens = (5000 + torch.randint(0, 600, (8,), generator=g)).tolist()  # over 256 rows an SM: 256-row dy tiles
    tokens[3] = 0
    case = lora_case(tokens, [64] * 8, d_in, d_out, dtype, DEV, seed=d_in + 3 * d_out)
    assert stream_config("stream_dy", case.dy, case.B.t().contiguous(), case.A.t(), case.x, case.meta)
    ref = lora_grads(K.grouped_lora, case.double(), backend="torch")
    errs = {}
    for on in (True, False):
        got = lora_grads(K.grouped_lora, case, backend="triton", launch={"stream": {"on": on}, "stream_dy": {"on": on}})
        errs.update({f"{k} {'stream' if on else 'tiles'}": rel_err(got[k], ref[k]) for k in ("y", "dx", "dA", "dB")})
    _record("stream", d_in=d_in, d_out=d_out, errors=errs, tol=LORA_TOL[dtype])
    assert max(errs.values()) <= LORA_TOL[dtype], errs


def test_grouped_lora_offsets_past_int32():
    """720k tokens x 3072 outputs = 2.2e9 elements of y: the row offsets must be int64."""
    dtype, d_in, d_out = torch.bfloat16, 1024, 3072
    tokens, ranks = [400_000, 320_000], [16, 8]
    case = lora_case(tokens, ranks, d_in, d_out, dtype, DEV, seed=5)
    y = K.grouped_lora(case.x, case.A, case.B, meta=case.meta, backend="triton")
    dx, dA, dB = torch.autograd.grad(y, (case.x, case.A, case.B), case.dy)
    rows = torch.cat([torch.arange(0, 500), torch.arange(399_500, 400_500), torch.arange(719_500, 720_000)]).to(DEV)
    m = case.meta
    ref = torch.empty(len(rows), d_out, dtype=torch.float64, device=DEV)
    ref_dx = torch.empty(len(rows), d_in, dtype=torch.float64, device=DEV)
    for j in range(2):
        sel = (rows >= m.seg_start[j]) & (rows < m.seg_start[j + 1])
        r0, r1 = m.rank_start[j], m.rank_start[j + 1]
        A, B = case.A[r0:r1].double(), case.B[:, r0:r1].double()
        ref[sel] = m.scale[j] * (case.x[rows[sel]].double() @ A.t()) @ B.t()
        ref_dx[sel] = m.scale[j] * (case.dy[rows[sel]].double() @ B) @ A
    errs = {"y": rel_err(y[rows], ref), "dx": rel_err(dx[rows], ref_dx)}
    ref_dA, ref_dB = torch.empty_like(dA, dtype=torch.float32), torch.empty_like(dB, dtype=torch.float32)
    for j in range(2):  # weight gradients over all rows, in fp32 on the same bf16 inputs
        t0, t1, r0, r1 = m.seg_start[j], m.seg_start[j + 1], m.rank_start[j], m.rank_start[j + 1]
        A, B, xj, dyj = case.A[r0:r1].float(), case.B[:, r0:r1].float(), case.x[t0:t1].float(), case.dy[t0:t1].float()
        h = xj @ A.t()
        dh = m.scale[j] * (dyj @ B)
        ref_dB[:, r0:r1] = m.scale[j] * (dyj.t() @ h)
        ref_dA[r0:r1] = dh.t() @ xj
    errs.update(dA=rel_err(dA, ref_dA), dB=rel_err(dB, ref_dB))
    _record("grouped_lora_int64", tokens=sum(tokens), d_out=d_out, errors=errs, tol=LORA_TOL[dtype])
    for k, e in errs.items():
        assert e <= LORA_TOL[dtype], f"{k}: {e:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_selective_log_softmax_gpu(dtype):
    """Qwen3's vocabulary; rows not a multiple of the chunk; per-row temperatures."""
    T, d, V = 3000, 1024, 151936
    g = torch.Generator(device=DEV).manual_seed(8)
    h = torch.randn(T, d, device=DEV, generator=g).to(dtype).requires_grad_()
    W = (torch.randn(V, d, device=DEV, generator=g) * 3 / 32).to(dtype)
    tgt = torch.randint(0, V, (T,), device=DEV, generator=g)
    temp = torch.rand(T, device=DEV, generator=g) + 0.5
    gout = torch.randn(T, device=DEV, generator=g)
    logp, ent = K.selective_log_softmax(h, W, tgt, temperature=temp, chunk_size=1024, return_entropy=True,
                                        backend="triton")
    (dh,) = torch.autograd.grad(logp, h, gout)
    h64 = h.detach().double().requires_grad_()
    z = torch.log_softmax((h64 @ W.double().t()) / temp.double()[:, None], -1)
    ref_logp, ref_ent = z.gather(1, tgt[:, None]).squeeze(1), -(z.exp() * z).sum(-1)
    (ref_dh,) = torch.autograd.grad(ref_logp, h64, gout.double())
    atol, rtol = LOGSOFTMAX_TOL[dtype]
    errs = {"logp": (logp.double() - ref_logp).abs().max().item(),
            "entropy": (ent.double() - ref_ent).abs().max().item(), "dh": rel_err(dh, ref_dh)}
    _record("selective_log_softmax", dtype=str(dtype), T=T, V=V, errors=errs, tol=[atol, rtol])
    assert errs["logp"] <= atol and errs["entropy"] <= atol and errs["dh"] <= rtol, errs


def test_selective_log_softmax_offsets_past_int32():
    """A chunk of 16384 rows x 151936 logits is 2.5e9 elements: the row offset must be int64."""
    T, d, V = 16384 + 100, 1024, 151936
    g = torch.Generator(device=DEV).manual_seed(9)
    h = torch.randn(T, d, device=DEV, generator=g).bfloat16()
    W = (torch.randn(V, d, device=DEV, generator=g) * 3 / 32).bfloat16()
    tgt = torch.randint(0, V, (T,), device=DEV, generator=g)
    big = K.selective_log_softmax(h, W, tgt, chunk_size=16384, backend="triton")
    small = K.selective_log_softmax(h, W, tgt, chunk_size=1024, backend="torch")
    err = (big - small).abs().max().item()
    _record("selective_log_softmax_int64", T=T, chunk=16384, max_abs=err)
    assert err <= LOGSOFTMAX_TOL[torch.bfloat16][0]
