"""The parkers: the trainer's park and restore are bit-exact (state and the next step, fp32), host
buffers are made once, a frozen base is copied once; the engine parker's calls and its CPU no-op;
the CUDA checkpoint parker's refusals here and its real run on a GPU (marked gpu)."""

from __future__ import annotations

import copy
import gc
import multiprocessing as mp
import os

import pytest
import torch

from colora.timeslice.parking import (
    NO_SLEEP_MODE,
    CudaCheckpointParker,
    EngineParker,
    NullParker,
    TrainerParker,
    engine_parker,
)


class _Tenant(torch.nn.Module):
    """A frozen base (two layers and a buffer) with a trainable low-rank adapter on its output."""

    def __init__(self, d: int = 12, r: int = 3):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.base = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, d))
        self.base.requires_grad_(False)
        self.register_buffer("scale", torch.rand(d, generator=g) + 0.5)
        self.A = torch.nn.Parameter(torch.randn(r, d, generator=g) * 0.1)
        self.B = torch.nn.Parameter(torch.randn(d, r, generator=g) * 0.1)

    def forward(self, x):  # x: [n, d]
        h = self.base(x) * self.scale
        return h + (x @ self.A.T) @ self.B.T


def _loss(model, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 12, generator=g), torch.randn(16, 12, generator=g)
    device = model.A.device
    return torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))


def _trained(steps: int = 2, device: str = "cpu"):
    model = _Tenant().to(device)
    opt = torch.optim.AdamW([model.A, model.B], lr=1e-2, weight_decay=0.1)
    for s in range(steps):
        _loss(model, s).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _assert_same(a, b, where: str = "") -> None:
    """Equal bit for bit, through dicts and lists (state dicts)."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def _state(model, opt):
    """A copy on the host of the model's and the optimizer's state."""
    return _cpu({"model": model.state_dict(), "opt": opt.state_dict()})


def test_trainer_park_frees_everything_and_restore_is_bit_exact():
    model, opt = _trained()
    before = _state(model, opt)
    parker = TrainerParker(model, [opt])
    stats = parker.park()
    assert all(t.numel() == 0 for t in model.state_dict().values())
    assert all(v.numel() == 0 for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    expect = sum(t.numel() * t.element_size() for t in before["model"].values())
    expect += sum(v.numel() * v.element_size() for st in before["opt"]["state"].values() for v in st.values())
    assert stats.bytes == expect and stats.copied_bytes == expect
    parker.restore()
    _assert_same(before, _state(model, opt))


def test_a_step_after_park_and_restore_equals_the_step_without():
    """Parked between backward and the optimizer step (gradients present), fp32: the same step."""
    model, opt = _trained()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW([twin.A, twin.B], lr=1e-2, weight_decay=0.1)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    parker = TrainerParker(model, [opt])
    for step in range(2, 5):
        _loss(model, step).backward()
        _loss(twin, step).backward()
        parker.park()
        assert model.A.grad is None  # the gradient is parked too
        parker.restore()
        _assert_same(model.A.grad, twin.A.grad, "grad")
        opt.step()
        twin_opt.step()
        opt.zero_grad(set_to_none=True)
        twin_opt.zero_grad(set_to_none=True)
    _assert_same(_state(twin, twin_opt), _state(model, opt))


def test_host_buffers_are_made_once_and_the_frozen_base_copied_once():
    model, opt = _trained()
    parker = TrainerParker(model, [opt])
    first = parker.park()
    parker.restore()
    allocations, host_bytes = parker.allocations, parker.host_bytes
    frozen = sum(p.numel() * p.element_size() for p in model.base.parameters())
    for _ in range(3):
        again = parker.park()
        parker.restore()
        assert again.bytes == first.bytes  # everything is freed at every park
        assert again.copied_bytes == first.copied_bytes - frozen  # but the base is not copied again
    assert parker.allocations == allocations and parker.host_bytes == host_bytes
    assert parker.pin == torch.cuda.is_available()


def test_state_made_after_construction_gets_its_buffer_at_the_first_park():
    model = _Tenant()
    opt = torch.optim.AdamW([model.A, model.B], lr=1e-2)
    parker = TrainerParker(model, [opt])  # AdamW has no moments yet
    made = parker.allocations
    _loss(model, 0).backward()
    opt.step()
    before = _state(model, opt)
    parker.park()
    assert parker.allocations > made
    parker.restore()
    _assert_same(before, _state(model, opt))


def test_trainer_parker_refuses_misuse():
    model, opt = _trained()
    parker = TrainerParker(model, [opt])
    with pytest.raises(RuntimeError, match="restore while not parked"):
        parker.restore()
    parker.park()
    with pytest.raises(RuntimeError, match="park while parked"):
        parker.park()

    tied = torch.nn.Module()
    w = torch.nn.Parameter(torch.zeros(4, 4))
    tied.w = w
    tied.v = torch.nn.Parameter(w.data[0])  # a second parameter on w's storage
    with pytest.raises(ValueError, match="shares its storage"):
        TrainerParker(tied)


class _FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def test_engine_parker_sleeps_level_1_and_wakes_weights_first():
    llm = _FakeLLM()
    p = EngineParker(llm)
    p.park()
    p.restore()
    assert llm.calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    with pytest.raises(ValueError, match="level 2 discards the weights"):
        EngineParker(llm, level=2)


def test_engine_parker_refuses_an_engine_built_without_sleep_mode():
    class Cfg:
        enable_sleep_mode = False

    llm = _FakeLLM()
    llm.llm_engine = type("E", (), {"vllm_config": type("V", (), {"model_config": Cfg})})
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        EngineParker(llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-op is the CPU's engine parker")
def test_engine_parker_on_this_cpu_is_a_labelled_no_op():
    p = engine_parker(_FakeLLM())
    assert isinstance(p, NullParker) and p.label == NO_SLEEP_MODE
    assert p.park().bytes == 0 and p.restore().seconds == 0.0


def test_cuda_checkpoint_parker_refusals():
    with pytest.raises(ValueError, match="cannot checkpoint itself"):
        CudaCheckpointParker([os.getpid()])
    with pytest.raises(ValueError, match="at least one PID"):
        CudaCheckpointParker([])
    try:
        import cuda.bindings  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="cuda-bindings"):
            CudaCheckpointParker([1])


def test_cuda_checkpoint_parker_leaves_out_processes_without_cuda(monkeypatch):
    """vLLM's engine core has a child without CUDA: the driver answers NOT_INITIALIZED for it."""
    from types import SimpleNamespace

    from colora.timeslice import parking

    R = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_NOT_INITIALIZED=3)
    calls = []
    drv = SimpleNamespace(
        CUresult=R, cuInit=lambda flags: (R.CUDA_SUCCESS,),
        cuCheckpointProcessGetState=lambda pid: (R.CUDA_SUCCESS if pid == 11 else R.CUDA_ERROR_NOT_INITIALIZED, None),
        CUcheckpointLockArgs=SimpleNamespace,
        cuCheckpointProcessLock=lambda pid, a: calls.append(("lock", pid)) or (R.CUDA_SUCCESS,),
        cuCheckpointProcessCheckpoint=lambda pid, a: calls.append(("checkpoint", pid)) or (R.CUDA_SUCCESS,))
    monkeypatch.setattr(parking, "_cuda_driver", lambda: drv)
    p = CudaCheckpointParker([10, 11])
    assert p.pids == [11] and p.without_cuda == [10] and p.label == "cuda-checkpoint: pids [11]"
    p.park()
    assert calls == [("lock", 11), ("checkpoint", 11)]
    with pytest.raises(ValueError, match="none of PIDs \\[10, 12\\] uses CUDA"):
        CudaCheckpointParker([10, 12])


# ---- on a GPU


@pytest.mark.gpu
def test_trainer_parker_on_cuda_frees_the_device_and_restores_bit_exact():
    """Parked, the tenant holds as much device memory as if it had been deleted: none."""
    gc.collect()  # an earlier test's garbage, freed by this test's collect below, would move the count
    model, opt = _trained(device="cuda")
    before = _state(model, opt)
    parker = TrainerParker(model, [opt])
    assert all(s.host.is_pinned() for s in parker._slots.values())
    held = torch.cuda.memory_allocated()  # the tenant's tensors and this process's cuBLAS workspace
    assert parker.park().bytes > 0
    parked = torch.cuda.memory_allocated()
    assert parked < held
    parker.restore()
    assert torch.cuda.memory_allocated() == held
    _assert_same(before, _state(model, opt))
    del model, opt, parker
    gc.collect()
    assert torch.cuda.memory_allocated() == parked


@pytest.mark.gpu
def test_a_cuda_step_after_park_and_restore_equals_the_step_without():
    model, opt = _trained(device="cuda")
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW([twin.A, twin.B], lr=1e-2, weight_decay=0.1)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    parker = TrainerParker(model, [opt])
    for step in range(2, 4):
        _loss(model, step).backward()
        _loss(twin, step).backward()
        parker.park()
        parker.restore()
        opt.step()
        twin_opt.step()
        opt.zero_grad(set_to_none=True)
        twin_opt.zero_grad(set_to_none=True)
    _assert_same(_state(twin, twin_opt), _state(model, opt))


def _cuda_child(ready, go, out):
    x = torch.arange(64 << 20, dtype=torch.float32, device="cuda")  # 256 MiB
    expect = float(x.double().sum())
    ready.set()
    go.wait(120)
    out.put((expect, float(x.double().sum())))


@pytest.mark.gpu
def test_cuda_checkpoint_parker_parks_another_process():
    pytest.importorskip("cuda.bindings", reason="cuda-bindings is not installed here")
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_cuda_child, args=(ready, go, out), daemon=True)
    child.start()
    try:
        assert ready.wait(120)
        parker = CudaCheckpointParker([child.pid])
        park = parker.park()
        assert parker.state(child.pid).endswith("CHECKPOINTED")
        assert park.bytes >= 256 << 20
        parker.restore()
        assert parker.state(child.pid).endswith("RUNNING")
        go.set()
        expect, got = out.get(timeout=120)
        assert got == expect
    finally:
        go.set()
        child.join(30)
        if child.is_alive():
            child.kill()
