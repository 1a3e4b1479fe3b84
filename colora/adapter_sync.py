"""Adapter sync: how a new adapter version goes from the trainer's weights to vLLM's worker.

Two modes (`runtime.adapter_sync`; "auto", the default, takes "memory" where it works, else "disk"):

- "memory": the trainer writes the version into its job's shared-memory segment (a file in /dev/shm
  that vLLM's worker maps too, rewritten in place per version) and the engine sends the worker only
  the segment's name, the tensors' names and shapes and the PEFT config (`LLM.collective_rpc`, a few
  KB). The worker, through the extension `AdapterSync` below, copies the segment to its device in
  one copy, builds the adapter with vLLM's `LoRAModel.from_lora_tensors` and adds it through vLLM's
  own add path (LRU eviction, slot activation), under the name and id that `RolloutEngine.set_adapters`
  gives every version (`<job>@v<version>`, a new id each time: vLLM keys prefix-cache blocks by the
  LoRA, so a new version never meets KV computed under an old one). No safetensors file is written
  or parsed, and nothing is pinned or copied per tensor. A group's new versions go in one call,
  which also removes their previous versions (`add_loras`): a call into the engine core waits for
  its step in progress, and one wait serves them all.
- "disk": a PEFT directory per version (`AdapterBank.export_peft`, on tmpfs where there is one) and
  vLLM's `add_lora` from its path.

Disk is the fallback where the in-memory path cannot work (`memory_unsupported` says why, "auto"
logs it): a vLLM other than the versions this module is written against (`TESTED_VLLM`: the worker
internals it uses differ between versions, and an unknown one is not guessed at), a machine without
a writable /dev/shm, an engine started with another worker extension (`engine_args`), and, per
version, a /dev/shm too full to hold a job's segment (`RolloutEngine.export_adapter` then writes that
version to disk).
An engine started for "memory" loads PEFT directories as well; one started for "disk" refuses an
in-memory adapter. Both modes give vLLM the same tensors (the engine's dtype, the LoRA scale folded
into B): the log-probs are the same either way (tests/test_engine.py), and so are a run's rollouts
(tests/test_engine_process.py).

The bytes cross up to three processes (the trainer's, the engine client's under
`runtime.engine_process`, vLLM's engine core where the worker is) and are copied twice: into the
segment (from the trainer's device) and out of it (to the engine's device). The segment's file is
unlinked once the worker has mapped it, so a killed run leaves at most an empty folder in /dev/shm. CUDA IPC would
skip both copies on a GPU; it is not used, as it cannot be exercised without a GPU and its
behaviour under MPS is not measured. The adapter the worker builds lives on the engine's device
(about 20 MB per loaded version for Qwen3-0.6B at rank 16 in bf16), where vLLM's disk loader keeps
it in pinned host memory.

Every vLLM-internal name used is used here and only here: the worker's `remove_lora` and `model_runner.lora_manager`
(vLLM's LRUCacheWorkerLoRAManager) with its `add_adapter`, `list_adapters`, `_load_adapter`,
`_lora_model_cls`, `device`, `vocab_size`, `lora_config` and `max_position_embeddings`, and its
`_adapter_manager`'s `model`, `supported_lora_modules` and `packed_modules_mapping`; `PEFTHelper`;
and the WeightsMapper method its loader applies to LoRA names, which differs between the versions.
All of them are in vLLM 0.26 and 0.32 alike.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import torch

SETTINGS = ("auto", "memory", "disk")
SHM = Path("/dev/shm")
HEADER = 64  # bytes before a segment's tensors: int64 [the version it holds, -1 while being written]
EXTENSION = "colora.adapter_sync.AdapterSync"  # vLLM's worker_extension_cls for "memory"
# vLLM version (major.minor) -> the WeightsMapper method its WorkerLoRAManager._load_adapter applies
# to LoRA tensor names (renames only, the fused projections left apart); checked in both sources.
TESTED_VLLM = {"0.26": "get_unstacked_mapper", "0.32": "get_rename_mapper"}


class AdapterSyncUnsupported(RuntimeError):
    """The in-memory path cannot work here; the message says why and what to set instead."""


def _vllm_version() -> tuple[str, str]:
    """(vLLM's version, its major.minor)."""
    import vllm

    version = str(vllm.__version__)
    return version, ".".join(version.split(".")[:2])


def memory_unsupported() -> str:
    """Why the in-memory path cannot work in this process ('' where it can)."""
    version, minor = _vllm_version()
    if minor not in TESTED_VLLM:
        return (f"it is written against vLLM {' and '.join(TESTED_VLLM)}, not vLLM {version}, whose LoRA worker "
                "internals may differ")
    if not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        return f"it needs a writable {SHM}"
    return ""


def resolve(setting: str) -> tuple[str, str]:
    """(mode, why it is disk) for `runtime.adapter_sync`: "auto" is "memory" where that works, else
    "disk"; "memory" where it cannot work is an AdapterSyncUnsupported; anything else a ValueError."""
    if setting not in SETTINGS:
        raise ValueError(f"adapter_sync = {setting!r} is not valid: expected one of {', '.join(map(repr, SETTINGS))}")
    if setting == "disk":
        return "disk", "runtime.adapter_sync = 'disk'"
    why = memory_unsupported()
    if why and setting == "memory":
        raise AdapterSyncUnsupported(f"runtime.adapter_sync = 'memory' cannot work here: {why}; set it to "
                                     "'auto' or 'disk' to load adapters from PEFT directories")
    return ("disk", f"in-memory adapter sync cannot work here: {why}") if why else ("memory", "")


@dataclass(frozen=True)
class AdapterTensors:
    """One adapter version in a shared-memory segment: what vLLM's worker needs to build it."""

    job: str
    version: int
    path: str  # the segment's file (the worker maps it by this name the first time)
    nbytes: int  # of the tensors, after HEADER
    dtype: str  # torch dtype name
    names: tuple[str, ...]  # PEFT's tensor names
    shapes: tuple[tuple[int, ...], ...]
    config: dict  # PEFT's adapter_config

    def spec(self) -> dict:
        """Plain values only: vLLM's collective_rpc carries its arguments as msgpack."""
        return {"job": self.job, "version": self.version, "path": self.path, "nbytes": self.nbytes,
                "dtype": self.dtype, "names": list(self.names), "shapes": [list(s) for s in self.shapes],
                "config": self.config}


class ShmFull(RuntimeError):
    """/dev/shm cannot hold a job's segment."""


class SharedAdapters:
    """The trainer's side: one shared-memory segment per job, in a directory of its own in /dev/shm,
    rewritten in place for each version of the job. `write` runs on the trainer's thread while the
    engine's thread may call `mapped` or `release` (one lock guards the table).

    A version's bytes stay in the segment until the job's next write: the worker copies them out when
    it loads the version, and a job's next version is trained on rollouts of the loaded one. The
    header holds the version the segment holds (-1 while a write is under way), which the worker
    checks before and after its copy, so a load never builds an adapter from another version's
    bytes or from a half-written one."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="colora-adapter-sync-", dir=SHM))
        self._segments: dict[str, tuple[Path, torch.Tensor]] = {}  # job -> (its file, its bytes, mapped)
        self._made = 0
        self._lock = threading.Lock()

    def _segment(self, job: str, size: int) -> tuple[Path, torch.Tensor]:
        with self._lock:
            seg = self._segments.get(job)
            if seg is not None and seg[1].numel() == size:
                return seg
            if seg is not None:  # the job came back with another shape (a cached engine's next run)
                seg[0].unlink(missing_ok=True)
            self._made += 1
            path = self.dir / f"{self._made}-{job.replace('/', '_')}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                # Reserve the pages now: a write into tmpfs that has run out kills the writer (SIGBUS).
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                path.unlink(missing_ok=True)
                if e.errno != errno.ENOSPC:
                    raise
                raise ShmFull(f"{SHM} has {shutil.disk_usage(SHM).free / 2**20:.0f} MiB free, job {job}'s "
                              f"adapter needs {size / 2**20:.0f} MiB") from None
            finally:
                os.close(fd)
            seg = self._segments[job] = (path, torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8))
            return seg

    def write(self, bank, job: str, dtype: torch.dtype, base_model: str) -> AdapterTensors:
        """Write `job`'s current adapter (in `dtype`, its scale folded into B) into its segment."""
        names, shapes, flat = bank.flat_adapter(job, dtype, fold_scale=True)
        nbytes = flat.numel() * flat.element_size()
        path, seg = self._segment(job, HEADER + nbytes)
        held = seg[:HEADER].view(torch.int64)
        version = bank.jobs[job].version
        held[0] = -1
        seg[HEADER:].view(dtype).copy_(flat)  # from the GPU where the bank is there: synchronous
        held[0] = version
        return AdapterTensors(job, version, str(path), nbytes, str(dtype).removeprefix("torch."), tuple(names),
                              tuple(shapes), bank.peft_config(job, base_model, fold_scale=True))

    def mapped(self, job: str) -> None:
        """The worker has mapped the job's segment: its file's name goes (the memory stays while
        either side maps it)."""
        with self._lock:
            seg = self._segments.get(job)
        if seg is not None:
            seg[0].unlink(missing_ok=True)

    def release(self, job: str) -> None:
        with self._lock:
            seg = self._segments.pop(job, None)
        if seg is not None:
            seg[0].unlink(missing_ok=True)

    def close(self) -> None:
        for job in list(self._segments):
            self.release(job)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the engine's side (vLLM's client) ------------------------------------------------------------
def add_loras(llm, loads: list[tuple[object, AdapterTensors, int | None]]) -> list[str]:
    """Have every worker of `llm` build each (lora_request, adapter, id to remove) in one call into the
    engine core, removing the previous version's id (None: none) once the new one is in. One call,
    however many adapters: each call waits for the engine core's step in progress to end (9-11 ms
    on the H200 while the engine decodes, reports/engine_levers), so a group's versions and their
    removals share one wait.
    Returns per load '' or why a worker refused it (a refused load removes nothing)."""
    items = [[req.lora_name, req.lora_int_id, adapter.spec(), -1 if old is None else old]
             for req, adapter, old in loads]
    per_worker = llm.collective_rpc("colora_add_loras", args=(items,))
    return [next((w[i] for w in per_worker if w[i]), "") for i in range(len(items))]


def release(llm, job: str) -> None:
    """Unmap the job's segment in every worker (the adapters built from it stay as they are)."""
    llm.collective_rpc("colora_release_segment", args=(job,))


def in_memory_path(job: str, version: int) -> str:
    """The lora_path of an adapter built from memory: absolute and not there, so that vLLM, should it
    ever read the adapter back from disk (an LRU eviction and reload), fails naming it instead of
    serving another."""
    return f"/colora-in-memory/{job}@v{version}"


# -- the worker's side (in vLLM's engine-core process) --------------------------------------------
class AdapterSync:
    """The worker extension vLLM mixes into its worker class (`worker_extension_cls`)."""

    def colora_adapter_sync(self) -> str:
        """'' once this worker runs the extension in a vLLM it is written against, else why not."""
        return memory_unsupported()

    def colora_add_loras(self, items: list) -> list[str]:
        """items: [lora_name, lora_int_id, spec, id to remove or -1]; per item '' or why it failed."""
        out = []
        for lora_name, lora_int_id, spec, old in items:
            try:
                if not _add_lora(self, lora_name, lora_int_id, spec):
                    out.append(f"{lora_name}: vLLM's add_adapter refused it")
                    continue
            except Exception as e:  # noqa: BLE001  (one refused version must not hide the others' results)
                out.append(f"{lora_name}: {type(e).__name__}: {e}")
                continue
            if old >= 0:
                self.remove_lora(old)  # the worker's own remove path, as LLMEngine.remove_lora reaches it
            out.append("")
        return out

    def colora_release_segment(self, job: str) -> None:
        self.__dict__.get("_colora_segments", {}).pop(job, None)


def _read(worker, spec: dict, device) -> dict[str, torch.Tensor]:
    """The segment's tensors, copied to `device` in one copy: PEFT name -> tensor."""
    segments = worker.__dict__.setdefault("_colora_segments", {})  # job -> (file, its bytes, mapped)
    size = HEADER + spec["nbytes"]
    seg = segments.get(spec["job"])
    if seg is None or seg[0] != spec["path"] or seg[1].numel() != size:
        seg = segments[spec["job"]] = (spec["path"], torch.from_file(spec["path"], shared=True, size=size,
                                                                     dtype=torch.uint8))
    held = seg[1][:HEADER].view(torch.int64)
    want = spec["version"]
    if int(held[0]) != want:
        raise RuntimeError(f"{spec['job']}: the shared segment holds version {int(held[0])}, not {want}")
    data = seg[1][HEADER:].to(device, copy=True)  # synchronous: the bytes are the worker's once it returns
    if int(held[0]) != want:
        raise RuntimeError(f"{spec['job']}: version {want} was overwritten while the engine read it")
    flat = data.view(getattr(torch, spec["dtype"]))
    sizes = [int(torch.Size(s).numel()) for s in spec["shapes"]]
    if sum(sizes) != flat.numel():
        raise ValueError(f"{spec['job']}: the shapes hold {sum(sizes)} elements, the segment {flat.numel()}")
    return {n: t.view(s) for n, t, s in zip(spec["names"], flat.split(sizes), spec["shapes"], strict=True)}


def _add_lora(worker, lora_name: str, lora_int_id: int, spec: dict) -> bool:
    """Build the adapter from its segment and add it the way vLLM's LRUCacheWorkerLoRAManager adds one
    it loads from disk: its add path runs as ever, with this adapter for what its `_load_adapter`
    reads (the same config checks, eviction and activation)."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest

    mapper_method = TESTED_VLLM[_vllm_version()[1]]  # the worker refused other versions at the start
    mgr = worker.model_runner.lora_manager
    manager = mgr._adapter_manager
    if lora_int_id in mgr.list_adapters():
        raise ValueError(f"LoRA id {lora_int_id} is loaded already: every adapter version needs an id of its own")
    # What vLLM's disk loader refuses: a module the model has no LoRA layer for (from tensors vLLM
    # would drop it silently, and serve an adapter other than the trainer's).
    expected = {m for s in manager.supported_lora_modules for m in manager.packed_modules_mapping.get(s, [s])}
    unexpected = sorted(set(spec["config"]["target_modules"]) - expected)
    if unexpected:
        raise ValueError(f"{lora_name}: vLLM has no LoRA layer for {unexpected} (it has {sorted(expected)})")

    def load(_request) -> object:
        peft = PEFTHelper.from_dict({**spec["config"], "vllm_max_position_embeddings": mgr.max_position_embeddings})
        peft.validate_legal(mgr.lora_config)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = getattr(mapper, mapper_method)()
        return mgr._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_int_id, tensors=_read(worker, spec, mgr.device), peft_helper=peft,
            device=str(mgr.device), dtype=mgr.lora_config.lora_dtype, model_vocab_size=mgr.vocab_size,
            weights_mapper=mapper, skip_prefixes=getattr(model, "lora_skip_prefixes", None))

    mgr._load_adapter = load
    try:
        return mgr.add_adapter(LoRARequest(lora_name, lora_int_id, in_memory_path(spec["job"], spec["version"])))
    finally:
        del mgr._load_adapter
