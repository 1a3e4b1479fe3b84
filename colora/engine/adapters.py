"""Adapter sync: how a new adapter version goes from the trainer's weights to vLLM's worker.

Two modes (`runtime.adapter_sync`; "auto", the default, takes "memory" where it works, else "disk"):

- "memory": the trainer writes the version into its job's shared-memory segment (a file in /dev/shm
  that vLLM's worker maps too, rewritten in place per version) and the engine sends the worker only
  the segment's name, the tensors' names and shapes and the PEFT config (`LLM.collective_rpc`, a few
  KB). The worker, through the extension `AdapterSync` below, copies the segment to its device in
  one copy, builds the adapter with vLLM's `LoRAModel.from_lora_tensors` and adds it through vLLM's
  own add path (LRU eviction, slot activation), under the name, path and id that
  `RolloutEngine.set_adapters` gives every version (`lora_name`: `<job>@v<version>#<lora id>`, the id
  new each time, so the name is unique for the engine's lifetime). vLLM 0.32 keys prefix-cache blocks
  by the LoRA's name and path (`vllm/v1/core/kv_cache_utils.py`, `_gen_lora_extra_hash_keys`), not its
  id: a name that repeats, as `<job>@v<version>` did from one run to the next on one engine, is served
  the KV computed under the other weights. The worker pins the adapter in vLLM's CPU cache: it cannot
  be reloaded from its path, so vLLM's LRU must never evict it (snapshots from disk share that cache).
  No safetensors file is written or parsed, and nothing is copied per tensor. A group's new versions go in one call,
  which also removes their previous versions (`add_loras`): a call into the engine core waits for
  its step in progress, and one wait serves them all.
- "disk": a PEFT directory per version (`AdapterBank.export_peft`, on tmpfs where there is one) and
  vLLM's `add_lora` from its path.

Disk is the fallback where the in-memory path cannot work (`memory_unsupported` says why, "auto"
logs it): a vLLM other than the versions this module is written against (`TESTED_VLLM`: the worker
internals it uses differ between versions, and an unknown one is not guessed at), a machine without
a writable /dev/shm, an engine started with another worker extension (`engine_args`), and, per
version, a /dev/shm too full to hold a job's segment (`AdapterExport.export` then writes that
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
`_adapter_manager`'s `model`, `supported_lora_modules`, `packed_modules_mapping` and
`_pin_lora_in_cpu_cache`; `PEFTHelper`;
and the WeightsMapper method its loader applies to LoRA names, which differs between the versions.
All of them are in vLLM 0.26 and 0.32 alike.
The hand-off has one owner per side: the trainer's side writes each version
(colora/training/export.py: `AdapterExport`), the engine's client loads it (`RolloutEngine.set_adapters`
with this module's `add_loras`), and vLLM's worker builds it (colora/engine/worker.py, the worker
extension). What passes between them is an `AdapterTensors` or an `AdapterDir`: each names its job and
the version it holds, the one place the hand-off keeps it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

SETTINGS = ("auto", "memory", "disk")
SHM = Path("/dev/shm")
HEADER = 64  # bytes before a segment's tensors: int64 [the version it holds, -1 while being written]
EXTENSION = "colora.engine.worker.AdapterSync"  # vLLM's worker_extension_cls for "memory"
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


@dataclass(frozen=True)
class AdapterDir:
    """One adapter version as a PEFT directory (the disk path): what vLLM's add_lora reads."""

    job: str
    version: int
    path: str


Adapter = AdapterTensors | AdapterDir  # what the trainer's side hands the engine's client


class ShmFull(RuntimeError):
    """/dev/shm cannot hold a job's segment."""


# -- the engine's client ------------------------------------------------------------------------
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


def lora_name(label: str, lora_id: int) -> str:
    """The LoRA name of an adapter the engine loads: its label (`<job>@v<version>`, a snapshot's key)
    and its LoRA id, which the engine never gives twice. vLLM keys prefix-cache blocks by the name and
    path, so neither may repeat within an engine's lifetime: a repeated label (the same job and version
    in the next run on a cached engine) was served the previous run's KV."""
    return f"{label}#{lora_id}"


def in_memory_path(name: str) -> str:
    """The lora_path of an adapter built from memory, from its `lora_name`: absolute and not there, so
    that vLLM, should it ever read the adapter back from disk (an LRU eviction and reload, which the
    worker's pin prevents), fails naming it instead of serving another."""
    return f"/colora-in-memory/{name}"


def unlink_segment(adapter: AdapterTensors) -> None:
    """The worker has mapped the version's segment: its file's name goes (the memory stays while the
    trainer's side or the worker maps it), so a killed run leaves at most an empty folder in /dev/shm."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(adapter.path)
