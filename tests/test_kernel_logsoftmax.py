"""The selective log-softmax over the LM head against an fp64 reference, and the aligned uploads its
kernel reads.

    pytest tests/test_kernel_logsoftmax.py -q            (CPU: conftest.py sets TRITON_INTERPRET=1 without a GPU)

Small odd shapes (rows not a multiple of the tiles, mixed ranks including 0, empty segments, all three
dtypes); every check draws fresh random inputs and poisons the outputs it can. The realistic sweep is
tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_cases import DEV, DTYPES, K, LOGSOFTMAX_TOL, lora_case, rel_err


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


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_trained_head_gets_its_gradient(dtype, backend):
    """A head that requires a gradient (a full-parameter job's): logp and d hidden as for a frozen head,
    and d weight, against fp64 autograd. d weight sums rows' products of the same rounded dlogits as d
    hidden, so d hidden's tolerance holds it."""
    h, W, tgt, temp, gout = _logsoftmax_problem(37, 24, 5000, dtype, seed=zlib.crc32(f"head/{dtype}".encode()))
    W.requires_grad_()
    logp = K.selective_log_softmax(h, W, tgt, temperature=temp, chunk_size=16, backend=backend)
    dh, dW = torch.autograd.grad(logp, (h, W), gout)
    h64, W64 = (t.detach().double().requires_grad_() for t in (h, W))
    ref_logp, _ = _fp64_reference(h64, W64, tgt, temp)
    ref_dh, ref_dW = torch.autograd.grad(ref_logp, (h64, W64), gout.double())
    atol, rtol = LOGSOFTMAX_TOL[dtype]
    assert dh.dtype == dW.dtype == dtype and dW.shape == W.shape
    assert (logp.double() - ref_logp).abs().max() <= atol
    assert rel_err(dh, ref_dh) <= rtol and rel_err(dW, ref_dW) <= rtol


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_trained_head_alone_gets_its_gradient_and_the_frozen_head_keeps_the_fused_path(backend):
    """Only the head requires a gradient: d weight, no d hidden. A frozen head's step is the same with
    and without this (the fused path of the forward)."""
    h, W, tgt, temp, gout = _logsoftmax_problem(9, 8, 130, torch.float32, seed=6)
    h.requires_grad_(False)
    W.requires_grad_()
    (dW,) = torch.autograd.grad(K.selective_log_softmax(h, W, tgt, temperature=temp, chunk_size=4,
                                                        backend=backend), W, gout)
    W64 = W.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(_fp64_reference(h.double(), W64, tgt, temp)[0], W64, gout.double())
    assert rel_err(dW, ref) <= LOGSOFTMAX_TOL[torch.float32][1]
    h.requires_grad_()
    frozen = W.detach()
    (dh_frozen,) = torch.autograd.grad(K.selective_log_softmax(h, frozen, tgt, temperature=temp, chunk_size=4,
                                                               backend=backend), h, gout)
    dh_trained, _ = torch.autograd.grad(K.selective_log_softmax(h, W, tgt, temperature=temp, chunk_size=4,
                                                                backend=backend), (h, W), gout)
    torch.testing.assert_close(dh_trained, dh_frozen, rtol=1e-5, atol=1e-6)


def test_a_trained_head_gradcheck_torch_path():
    """Finite differences in fp64 through the reference's backward, in hidden and the head together."""
    h, W, tgt, temp, _ = _logsoftmax_problem(5, 6, 11, torch.float64, seed=7)
    fn = lambda hh, ww: K.selective_log_softmax(hh, ww, tgt, temperature=temp, chunk_size=2, backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (h, W.requires_grad_()))
