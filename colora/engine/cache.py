"""Engines kept alive across the runs of one process (sweeps, benchmarks), handed out only alive and
clean.

Two guards keep one run's KV cache from another's requests on a shared engine, each against its own
trap:
- LoRA names unique for the engine's lifetime (colora/engine/adapters.py's `lora_name`): vLLM keys
  prefix-cache blocks by the LoRA's name and path, so a block computed under one run's `a@v1` is never
  found by the next run's `a@v1` (or by a snapshot, or a later version), whatever runs in between.
  This is what correctness rests on, within a run as across runs.
- The prefix cache emptied when a cached engine is handed to a new run (`RolloutEngine.reset`): no
  block of an earlier run is kept, whatever its key. Blocks keyed by tokens alone (the base model's:
  evaluation, warm-up) would otherwise carry over and speed the next run's prefills, so that a
  benchmark's figures would depend on the order of its runs.

A run that failed may leave requests in flight and adapters loaded; `get` aborts and drops them
(reset) before it hands the engine on, and replaces an engine whose processes died or that cannot be
reset. Engines are duck-typed: `RolloutEngine` and `RemoteEngine` alike (`dead`, `reset`, `close`).
"""

from __future__ import annotations

from typing import Callable


class EngineCache:
    """Engines kept alive across runs of one process (sweeps, benchmarks): vLLM's start costs
    20-160 s, and rollouts do not depend on the engine's own seed (every request carries one), so
    runs whose engine settings match share one engine. MPS arms never take a cached engine: whether a
    process is an MPS client is fixed when its CUDA context is made."""

    def __init__(self):
        self._engines: dict[tuple, object] = {}
        self.replaced: list[str] = []  # why each cached engine that was not handed out again was closed

    def get(self, key: tuple, factory: Callable[[], object], *, exclusive: bool = False):
        """The engine for `key`: the cached one, reset (nothing in flight, no adapter, an empty prefix
        cache), else one started by `factory`, also in place of a cached engine that died or could not
        be reset (closed; why is in `replaced`). exclusive: before starting one, close every other
        engine and free this process's cached GPU memory. On a GPU each engine reserves its
        `gpu_memory_utilization` of the whole device and vLLM refuses to start when that much is not
        free: on the H200 an overlap run's engine (its client in a process of its own, so another key)
        failed to start beside the cached engine of the run before it and the previous trainer's cached
        blocks (13 of 140 GiB free; seen at 55311e3)."""
        eng = self._engines.get(key)
        if eng is not None:
            why = eng.dead() or _reset(eng)
            if not why:
                eng.reused = True
                return eng
            self.replaced.append(why)
            del self._engines[key]
            eng.close()
        if exclusive:
            self.close()
            release_cuda_cache()
        eng = self._engines[key] = factory()
        eng.reused = False
        return eng

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()


def _reset(eng) -> str:
    """'' once `eng` is as a fresh engine (its `reset`), else why it is not."""
    try:
        return "" if eng.reset() else "vLLM did not empty its prefix cache"
    except Exception as e:  # noqa: BLE001  (any failure means: not clean, start another)
        return f"the reset failed: {type(e).__name__}: {e}"


def release_cuda_cache() -> None:
    """Give the GPU memory this process's allocator caches (a finished run's trainer: tens of GiB)
    back to the device, so an engine started next finds it free. A no-op where CUDA is not in use."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
