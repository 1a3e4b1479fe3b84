"""Several vLLM engines on one device, serving every job together (`engine.instances` > 1).

Why: on the H200 the engine core's host thread bounds the decode step, not the GPU: vLLM's
scheduler and output path cost about 20 us a running request a step, against 9-12 us of GPU work
(reports/engine_profile). One engine core steps every request in flight in one thread. N engines,
each its core in a process of its own, step 1/N of the requests each, at once, their GPU work
overlapping under the arm's MPS daemon.

How: every engine runs its client in a process of its own (engine_process.RemoteEngine) and holds
every job's current adapter: a new version goes to all of them at once (one command each, sent
before any reply is awaited) and is exported once (`export_adapter`: one shared-memory segment that
every engine's worker maps). A batch's requests are dealt over the engines, the longest first to the
engine with the fewest tokens dealt, so the engines stay even whatever the groups, the arm or the
number of jobs; the batch is done when every engine's part is back. Results are the engines'
`GenResult`s in the batch's order: per-request seeds make a request's completion the same on any
engine (tested). Each engine takes `gpu_memory_utilization / instances` of the device's memory and
starts after the one before it (vLLM sizes its KV cache from the free memory it measures).

Same interface as `RolloutEngine`; one thread makes every call.
"""

from __future__ import annotations

import dataclasses
import time
from multiprocessing.connection import wait as wait_any
from pathlib import Path
from typing import Any

from .adapter_sync import AdapterTensors
from .config import EngineConfig
from .engine import GenRequest, GenResult, RolloutEngine
from .engine_process import EngineProcessError, RemoteEngine


def deal(requests: list[GenRequest], n: int) -> list[list[int]]:
    """The request indices each of `n` engines takes: longest first (prompt plus the tokens it may
    generate), each to the engine with the fewest tokens so far; each engine's in request order."""
    load, parts = [0] * n, [[] for _ in range(n)]
    for i in sorted(range(len(requests)), key=lambda i: -(len(requests[i].prompt_ids) + requests[i].max_tokens)):
        e = min(range(n), key=lambda k: (load[k], k))
        parts[e].append(i)
        load[e] += len(requests[i].prompt_ids) + requests[i].max_tokens
    return [sorted(p) for p in parts]


class _PoolSteps:
    """`RolloutEngine.steps` of every engine: each engine's buckets, tagged with its index."""

    def __init__(self, pool: EnginePool):
        self._pool = pool

    def take(self) -> list[dict]:
        return [{**b, "engine": i} for i, e in enumerate(self._pool.engines) for b in e.steps.take()]


class EnginePool:
    own_process = True
    generate = RolloutEngine.generate
    decode = RolloutEngine.decode
    export_adapter = RolloutEngine.export_adapter  # once, in the trainer's process, for every engine

    def __init__(self, instances: int, model_dir: str, cfg: EngineConfig, *, max_loras: int, max_lora_rank: int,
                 dtype: str, seed: int, device: str, adapter_sync: str = "auto"):
        if instances < 2:
            raise ValueError(f"an engine pool needs at least 2 engines, not {instances}")
        self.engines: list[RemoteEngine] = []
        self._shared = None  # made at the first in-memory export (RolloutEngine.export_adapter)
        share = dataclasses.replace(cfg, gpu_memory_utilization=cfg.gpu_memory_utilization / instances)
        t0 = time.perf_counter()
        try:
            for _ in range(instances):
                self.engines.append(RemoteEngine(model_dir, share, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                                 dtype=dtype, seed=seed, device=device, adapter_sync=adapter_sync))
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.perf_counter() - t0
        first = self.engines[0]
        self.adapter_sync, self.adapter_sync_note = first.adapter_sync, first.adapter_sync_note
        self.tokenizer, self.model_dir, self.max_model_len, self.dtype = (first.tokenizer, first.model_dir,
                                                                         first.max_model_len, first.dtype)
        self.warmed = False
        self._adapters: dict[str, int] = {}  # job -> version loaded in every engine
        self._batches: dict[Any, tuple[list, set[int], list[list[int]]]] = {}  # key -> (results, engines left, parts)
        self._done: list[tuple[Any, list[GenResult]]] = []
        self._next_request = 0  # makes generate()'s batch keys unique
        self.steps = _PoolSteps(self)

    def _all(self, op: str, *args) -> list:
        """`op` in every engine at once: sent to each, then every reply read (the first error raised
        after all of them, so that no engine's reply is left unread)."""
        for e in self.engines:
            e._send(op, *args)
        out, err = [], None
        for e in self.engines:
            try:
                out.append(e._reply(op))
            except EngineProcessError as ex:
                err = err or ex
        if err is not None:
            raise err
        return out

    # -- RolloutEngine's interface ----------------------------------------------------------------
    def set_adapter(self, job: str, version: int, adapter: str | Path | AdapterTensors) -> float:
        return self.set_adapters([(job, version, adapter)])

    def set_adapters(self, loads: list[tuple[str, int, str | Path | AdapterTensors]]) -> float:
        """RolloutEngine.set_adapters in every engine at once; the seconds are this call's."""
        t0 = time.perf_counter()
        self._all("set_adapters", RemoteEngine.payload(loads))
        for e in self.engines:
            e.loaded(loads)
        for job, version, adapter in loads:
            self._adapters[job] = version
            if isinstance(adapter, AdapterTensors) and self._shared is not None:
                self._shared.mapped(job)  # every engine's worker has it mapped now
        return time.perf_counter() - t0

    def version(self, job: str) -> int:
        return self._adapters[job]

    def loaded_adapters(self) -> set[int]:
        """The LoRA ids the first engine holds (every engine is given the same versions in the same order)."""
        return self.engines[0].loaded_adapters()

    def drop(self, job: str) -> None:
        if self._adapters.pop(job, None) is not None:
            for e in self.engines:
                e.drop(job)
        if self._shared is not None:
            self._shared.release(job)

    def drop_all(self) -> None:
        for job in list(self._adapters):
            self.drop(job)

    def warm_up(self, seed: int = 0) -> float:
        t0 = time.perf_counter()
        self._all("warm_up", seed)
        return time.perf_counter() - t0

    def _largest_graph(self) -> int:
        return self.engines[0]._largest_graph()

    def submit(self, key: Any, requests: list[GenRequest]) -> None:
        if key in self._batches:
            raise KeyError(f"batch {key!r} is already in flight")
        for r in requests:
            if r.job is not None and r.job not in self._adapters:
                raise KeyError(f"job {r.job!r} has no adapter loaded in the engine")
        if not requests:
            self._done.append((key, []))
            return
        self._next_request += len(requests)
        parts = deal(requests, len(self.engines))
        busy = {i for i, p in enumerate(parts) if p}
        self._batches[key] = ([None] * len(requests), busy, parts)
        for i in busy:
            self.engines[i].submit(key, [requests[k] for k in parts[i]])

    def poll(self) -> list[tuple[Any, list[GenResult]]]:
        """The batches every engine has finished its part of since the last call, waiting at most
        RemoteEngine.POLL_WAIT_S for any engine's part while one is in flight."""
        waiting = [e for e in self.engines if e.busy()]
        if waiting and not self._done and not any(e._done for e in waiting):
            wait_any([e._conn for e in waiting], RemoteEngine.POLL_WAIT_S)
        for i, e in enumerate(self.engines):
            for key, results in e.poll(wait=0):
                out, left, parts = self._batches[key]
                for k, r in zip(parts[i], results, strict=True):
                    out[k] = r
                left.discard(i)
                if not left:
                    self._done.append((key, self._batches.pop(key)[0]))
        done, self._done = self._done, []
        return done

    def busy(self) -> bool:
        return bool(self._batches) or bool(self._done)

    def dead(self) -> str:
        return next((why for e in self.engines if (why := e.dead())), "")

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()
        for e in self.engines:
            e.close()


def start_engine(model_dir: str, cfg: EngineConfig, *, remote: bool, **kwargs):
    """The engine of a run: a pool of `cfg.instances` engines, else one engine with its client in a
    process of its own (`remote`, RemoteEngine) or in this one (RolloutEngine). kwargs: the engines'
    own (max_loras, max_lora_rank, dtype, seed, device, adapter_sync)."""
    if cfg.instances > 1:
        return EnginePool(cfg.instances, model_dir, cfg, **kwargs)
    return (RemoteEngine if remote else RolloutEngine)(model_dir, cfg, **kwargs)
