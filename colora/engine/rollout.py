"""The rollout engine: one `vllm.LLM` serving every job's current LoRA adapter, frozen snapshots of
adapters, and the base model.

After every optimizer step the trainer exports the job's adapter (colora/training/export.py: into
shared memory that vLLM's worker reads, or as a PEFT directory; colora/engine/adapters.py says which
where) and `set_adapters` loads a group's new versions, each under a LoRA id of its own and a name
unique for the engine's lifetime, `<job>@v<version>#<lora id>`, and removes the old version at once.
vLLM 0.32 keys prefix-cache blocks by the LoRA's name and path, not its id: that name keeps KV computed
under other weights from a request, an old version's (an in-place reload kept serving the old KV,
docs/architecture.md) and another run's on an engine kept across runs (a repeated `a@v1` was served the
previous run's `a@v1` KV: a log-prob error of 4.02). Every result is tagged with the (job, version) of
the adapter that produced it; the trainer refuses any other version.

Snapshots (`register_snapshots`) are adapters frozen under a key of their own and a LoRA id each, served
until released whatever versions their job loads since: a PEFT directory, or a shared-memory segment that
nobody writes again (an `AdapterTensors` whose `job` is the snapshot's key; `colora serve`'s samplers).
vLLM keeps at most `max_cpu_loras` adapters loaded and `max_loras` in use per step, evicting the least
recently used and reloading it from its directory when a request needs it; adapters built in memory are
pinned in that cache (colora/engine/worker.py), as they cannot be reloaded, so an engine that holds
snapshots in memory needs `max_cpu_loras` above their number (a registration past it is refused). A
snapshot's segment file stays where it is (whoever wrote it removes it after the release): a new engine
can register the same snapshot from it. Several snapshots register in one call into the engine core.

Per-request seeds make a run's rollouts a function of its seed; what a request may ask and what comes
back: colora/engine/sampling.py. Generation is continuous: `submit(key, requests)` queues a batch in
the running engine at any time and `poll()` runs one engine step and returns the batches that finished.
One thread owns the engine and makes every call.

An adapter never leaves vLLM while a request decodes with it: vLLM would load it again for the next
step, and a load that fails (an adapter built in memory has no path) kills the engine core, after which
vLLM's client waits forever for any call. So `drop`, `release_snapshot` and `drop_all` abort the
requests first, `set_adapters` refuses to replace a version in use, and every call into the engine core
ends when the core dies. `EngineCache` (colora/engine/cache.py) hands a kept engine on only alive and
clean (`reset`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from colora import environment
from colora.config import OVERLAP_ARMS, EngineConfig
from colora.engine import adapters as sync
from colora.engine.adapters import Adapter, AdapterDir, AdapterTensors
from colora.engine.cache import EngineCache, release_cuda_cache  # noqa: F401  (imported from here by the runner and sweeps)
from colora.engine.sampling import GenRequest, GenResult, aborted, sampling_params
from colora.engine.sampling import results as outputs_of
from colora.engine.liveness import bounded, dead_process, shm_segments, unlink_segments
from colora.engine.steprate import StepRate, time_waits
from colora.engine.vllm_args import vllm_engine_args


@dataclass
class _Batch:
    results: list
    remaining: int


def plain_token_ids(tokenizer, limit: int = 32768):
    """The token ids below `limit` that are not special tokens (numpy int array): the ids random
    prompts are drawn from (warm-up batches, the engine benchmark)."""
    special = set(tokenizer.all_special_ids)
    return np.array([i for i in range(min(len(tokenizer), limit)) if i not in special])


def engine_process(setting: str, arm: str) -> bool:
    """Whether the engine's client runs in a process of its own (colora/engine/process.py), from the
    run option `runtime.engine_process`: "on", "off", or "auto" for the arms whose groups overlap.

    Why auto: in the overlapping arms vLLM's client threads run Python every engine step while the
    trainer's thread runs its step in the same interpreter; on the H200 overlap_mps ran 5.8% faster
    with the client apart (measured at f954d65). In the sequential arms nothing runs beside the
    engine to compete for the interpreter, and the one dedicated run with the client apart had
    unexplained 1.9-3.2 s training steps: the baseline keeps the in-process client."""
    return setting == "on" or (setting == "auto" and arm in OVERLAP_ARMS)


class RolloutEngine:
    own_process = False  # the client runs in this process (engine_process.RemoteEngine: in its own)

    def __init__(self, model_dir: str, cfg: EngineConfig, *, max_loras: int, max_lora_rank: int,
                 dtype: str, seed: int, device: str, adapter_sync: str = "auto",
                 engine_args: dict[str, Any] | None = None):
        """adapter_sync: how new adapter versions reach the engine, `runtime.adapter_sync`'s values
        (colora/engine/adapters.py). engine_args: more of vLLM's engine arguments, over colora's
        (benchmarks: its profiler); another worker extension among them leaves adapters on disk."""
        self.adapter_sync, self.adapter_sync_note = sync.resolve(adapter_sync)  # before vLLM starts
        environment.prepare_vllm(device, cfg.lora_dual_stream)
        from vllm import LLM

        kwargs = vllm_engine_args(model_dir, cfg, max_loras=max_loras, max_lora_rank=max_lora_rank, dtype=dtype,
                                  seed=seed, device=device)
        if self.adapter_sync == "memory":
            kwargs["worker_extension_cls"] = sync.EXTENSION
        kwargs.update(engine_args or {})
        if self.adapter_sync == "memory" and kwargs["worker_extension_cls"] != sync.EXTENSION:
            self.adapter_sync, self.adapter_sync_note = "disk", "the engine runs another worker extension"
        import psutil

        before = {p.pid for p in psutil.Process().children()}
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        if self.adapter_sync == "memory":
            why = next((w for w in self.llm.collective_rpc("colora_adapter_sync") if w), "")
            if why:  # the worker's vLLM is not this process's: say so rather than guess at it
                self.close()
                raise sync.AdapterSyncUnsupported(f"vLLM's worker: in-memory adapter sync cannot work: {why}")
        # vLLM's engine core runs in a process of its own (a direct child). A call into a dead one can
        # wait forever (seen: add_lora after the engine core was killed), so colora watches it.
        self._procs = [p for p in psutil.Process().children() if p.pid not in before]
        self._segments = shm_segments(self._procs)  # what a killed engine core leaves in /dev/shm
        self.tokenizer = self.llm.get_tokenizer()
        self.model_dir = str(model_dir)
        self._from_memory: set[str] = set()  # jobs whose adapter the worker built from a segment
        self.max_model_len = cfg.max_model_len
        self.dtype = dtype
        self.warmed = False  # set by `warm_up`
        self.logprobs = cfg.logprobs
        self._adapters: dict[str, tuple[int, Any]] = {}  # job -> (version, LoRARequest)
        self._snapshots: dict[str, tuple[int, Any]] = {}  # snapshot key -> (its version, LoRARequest)
        self._snapshot_memory: set[str] = set()  # snapshots built from a segment (no directory to check)
        self._next_id = 1  # LoRA ids (and so LoRA names) are never given twice in an engine's lifetime
        self._next_request = 0
        self._inflight: dict[str, tuple[Any, int, GenRequest, int]] = {}  # request id -> (batch, index, request, version)
        self._batches: dict[Any, _Batch] = {}
        self._done: list[tuple[Any, list[GenResult]]] = []
        self.steps = StepRate()  # engine steps per time bucket: how fast decoding went, and when
        self._waited = time_waits(self.llm.llm_engine.engine_core)  # seconds steps waited for the core

    def _lora(self, label: str, path: str | None = None):
        """A LoRARequest under a new id, named `<label>#<id>` (adapters.lora_name); `path` None: the
        in-memory path of that name."""
        from vllm.lora.request import LoRARequest

        name = sync.lora_name(label, self._next_id)
        req = LoRARequest(name, self._next_id, path or sync.in_memory_path(name))
        self._next_id += 1
        return req

    def set_adapter(self, job: str, version: int, adapter: str | Path | Adapter) -> float:
        """`set_adapters` of one version: an exported adapter (colora/training/export.py) or the path of a
        PEFT directory written as the engine's copy of it."""
        if not isinstance(adapter, (AdapterTensors, AdapterDir)):
            adapter = AdapterDir(job, version, str(adapter))
        if (adapter.job, adapter.version) != (job, version):
            raise ValueError(f"adapter of {adapter.job} v{adapter.version} given as {job} v{version}")
        return self.set_adapters([adapter])

    def set_adapters(self, adapters: list[Adapter]) -> float:
        """Load each adapter version now (not lazily at the next request), every version under a LoRA
        id of its own and a name unique for the engine's lifetime, `<job>@v<version>#<lora id>`, and
        drop each job's previous version. Versions from shared memory (colora/training/export.py's) go
        in one call into the engine core that also removes their previous versions; PEFT directories
        through vLLM's add_lora and remove_lora. Returns the seconds the whole call took. A refused
        adapter is a RuntimeError naming it, raised after the others are in (the job keeps its previous
        version). A job whose requests are in flight is a ValueError before anything loads: its
        previous version would leave vLLM while they decode with it."""
        t0 = time.perf_counter()
        engine = self.llm.llm_engine
        for adapter in adapters:
            busy = [r for _, _, r, _ in self._inflight.values() if r.job == adapter.job]
            if busy:
                raise ValueError(f"job {adapter.job!r}: {len(busy)} requests of version {self.version(adapter.job)} "
                                 f"are in flight; loading version {adapter.version} would take their adapter away")
        memory, disk = [], []
        for adapter in adapters:
            in_memory = isinstance(adapter, AdapterTensors)
            if in_memory and self.adapter_sync != "memory":
                raise ValueError(f"{adapter.job}: an in-memory adapter for an engine whose adapters go by disk "
                                 f"({self.adapter_sync_note})")
            req = self._lora(f"{adapter.job}@v{adapter.version}", None if in_memory else adapter.path)
            (memory if in_memory else disk).append((adapter, req))
        refused = []
        if memory:
            old = [self._adapters[a.job][1].lora_int_id if a.job in self._adapters else None for a, _ in memory]
            errors = self._core("add_loras", sync.add_loras, self.llm,
                                [(req, a, o) for (a, req), o in zip(memory, old)])
            for (adapter, req), why in zip(memory, errors):
                if why:
                    refused.append(why)
                    continue
                self._from_memory.add(adapter.job)
                sync.unlink_segment(adapter)  # the worker has it mapped now
                self._adapters[adapter.job] = (adapter.version, req)
        for adapter, req in disk:
            if not self._core("add_lora", engine.add_lora, req):
                refused.append(f"vLLM refused adapter {req.lora_name} from {adapter.path}")
                continue
            old = self._adapters.get(adapter.job)
            self._adapters[adapter.job] = (adapter.version, req)
            if old is not None:
                self._core("remove_lora", engine.remove_lora, old[1].lora_int_id)
        if refused:
            raise RuntimeError("; ".join(refused))
        return time.perf_counter() - t0

    # -- snapshots: adapters frozen under a key of their own --------------------------------------
    def register_snapshot(self, key: str, adapter: Adapter) -> int:
        """`register_snapshots` of one; a refusal raises (RuntimeError naming it). Returns its LoRA id."""
        refused = self.register_snapshots([(key, adapter)])
        if refused:
            raise RuntimeError(refused[key])
        return self._snapshots[key][1].lora_int_id

    def register_snapshots(self, items: list[tuple[str, Adapter]]) -> dict[str, str]:
        """Serve each adapter to requests that name its key (GenRequest.snapshot) until
        `release_snapshot(key)`, whatever versions of its job are loaded meanwhile (module docstring).
        Each is loaded now, so an adapter vLLM refuses is refused here, not in a later step: those in
        memory in one call into the engine core, PEFT directories one add_lora each. A key in use, or an
        adapter in memory for an engine whose adapters go by disk, is a ValueError before anything
        loads. Returns {key: why} of those vLLM refused (the others are registered). Results carry
        each adapter's version."""
        keys = [k for k, _ in items]
        for key, adapter in items:
            if key in self._snapshots or keys.count(key) > 1:
                raise ValueError(f"snapshot {key!r} is registered already")
            if isinstance(adapter, AdapterTensors) and (adapter.job != key or self.adapter_sync != "memory"):
                raise ValueError(f"snapshot {key!r}: an adapter in memory is a snapshot of an engine whose adapters "
                                 f"go by memory, in a segment of its own named by the key ({self.adapter_sync_note})")
            if not isinstance(adapter, (AdapterTensors, AdapterDir)):
                raise TypeError(f"snapshot {key!r}: an AdapterDir or AdapterTensors, not a {type(adapter).__name__}")
        refused: dict[str, str] = {}
        memory = [(k, a, self._lora(k)) for k, a in items if isinstance(a, AdapterTensors)]
        if memory:
            errors = self._core("add_loras", sync.add_loras, self.llm, [(req, a, None) for _, a, req in memory])
            for (key, adapter, req), why in zip(memory, errors):
                if why:
                    refused[key] = f"vLLM refused snapshot {key!r} from memory: {why}"
                else:
                    self._snapshots[key] = (adapter.version, req)
                    self._snapshot_memory.add(key)
        for key, adapter in items:
            if isinstance(adapter, AdapterDir):
                req = self._lora(key, adapter.path)
                if self._core("add_lora", self.llm.llm_engine.add_lora, req):
                    self._snapshots[key] = (adapter.version, req)
                else:
                    refused[key] = f"vLLM refused snapshot {key!r} from {adapter.path}"
        return refused

    def release_snapshot(self, key: str) -> None:
        """The snapshot leaves the engine; its requests in flight are aborted first (each comes back in
        its batch as an "abort" result) and later requests naming it are refused; vLLM's worker lets go
        of its segment. Releasing an unknown or released key does nothing."""
        self._abort(lambda r: r.snapshot == key)
        got = self._snapshots.pop(key, None)
        memory = key in self._snapshot_memory
        self._snapshot_memory.discard(key)
        if got is not None and not self.dead():
            self._core("remove_lora", self.llm.llm_engine.remove_lora, got[1].lora_int_id)
            if memory:
                self._core("release_segment", sync.release, self.llm, key)

    def snapshots(self) -> dict[str, int]:
        """The registered snapshots' keys and their adapters' versions."""
        return {k: v for k, (v, _) in self._snapshots.items()}

    def warm_up(self, seed: int = 0) -> float:
        """Generate a few throwaway batches through every loaded adapter so that the kernels a run
        will need are compiled before its first measured step. Returns the seconds it took.

        vLLM compiles its Triton LoRA kernels per specialisation of the token count (below or above
        128 rows, divisible by 16 or not) and captures CUDA graphs only for padded decode sizes, so
        a batch of mixed prefill and decode whose size is above the largest captured size and not a
        multiple of 16 compiled them mid-run on the H200 ("Triton kernel JIT compilation during
        inference: _lora_shrink_kernel", a second-long stall inside a measured step). Three rounds
        of odd token counts (below 128, above 128, above the largest captured size), each queued
        while the previous one decodes, cover those cases. Seeded per request: the engine's own
        random state, which real requests never use either, is left alone."""
        t0 = time.perf_counter()
        jobs = list(self._adapters) or [None]
        ids = plain_token_ids(self.tokenizer)
        rng = np.random.default_rng(seed)
        largest = self._largest_graph()
        longest = max(8, self.max_model_len - 8)
        rounds, k = [], 0
        for total in (97, 397, largest + 397):
            reqs = []
            while total > 0:
                n = min(total, longest)
                total -= n
                reqs.append(GenRequest(jobs[k % len(jobs)], tuple(int(t) for t in rng.choice(ids, n)), max_tokens=4,
                                       temperature=1.0, seed=int(rng.integers(2**31)), min_tokens=4,
                                       ignore_eos=True))
                k += 1
            rounds.append(reqs)
        pending = set()
        for i, reqs in enumerate(rounds):  # each round joins the previous one's decoding
            self.submit(("warm-up", i), reqs)
            pending.add(("warm-up", i))
            pending.difference_update(key for key, _ in self.poll())
        while pending:
            pending.difference_update(key for key, _ in self.poll())
        self.warmed = True
        return time.perf_counter() - t0

    @property
    def waited(self) -> float:
        """Seconds the client's steps have spent waiting for the engine core, since the start."""
        return self._waited[0]

    def _largest_graph(self) -> int:
        """The largest batch vLLM captured a CUDA graph for (0 when it runs eagerly)."""
        cfg = getattr(self.llm.llm_engine, "vllm_config", None)
        comp = getattr(cfg, "compilation_config", None)
        sizes = getattr(comp, "cudagraph_capture_sizes", None) or []
        return max(sizes, default=0) if not getattr(getattr(cfg, "model_config", None), "enforce_eager", False) else 0

    def dead(self) -> str:
        """Why the engine's processes are gone ('' while they all live)."""
        return dead_process(self._procs)

    def _core(self, what: str, fn: Callable, *args):
        """fn(*args), a call that waits for vLLM's engine core, ended by the core's death (liveness.bounded)."""
        return bounded(what, self.dead, fn, *args)

    def version(self, job: str) -> int:
        return self._adapters[job][0]

    def loaded_adapters(self) -> set[int]:
        """The LoRA ids vLLM holds loaded (every job's version it has not removed; snapshots while vLLM's
        LRU keeps them)."""
        return set(self._core("list_loras", self.llm.llm_engine.list_loras))

    def drop(self, job: str) -> None:
        """The job's adapter leaves the engine. Its requests in flight are aborted first, each coming back
        in its batch as an "abort" result. Dropping a job that has none does nothing."""
        self._abort(lambda r: r.job == job)
        old = self._adapters.pop(job, None)
        memory = job in self._from_memory
        self._from_memory.discard(job)
        if self.dead():  # a dead engine holds nothing any more
            return
        if old is not None:
            self._core("remove_lora", self.llm.llm_engine.remove_lora, old[1].lora_int_id)
        if memory:
            self._core("release_segment", sync.release, self.llm, job)

    def drop_all(self) -> None:
        """Every request in flight aborted and every batch forgotten (`abort_all`), then every job's
        adapter and every snapshot out of the engine."""
        self.abort_all()
        for job in list(self._adapters):
            self.drop(job)
        for key in list(self._snapshots):
            self.release_snapshot(key)

    def abort_all(self) -> list:
        """Abort every request in flight and forget every batch not yet returned by `poll`, finished or
        not: nothing is in flight afterwards and `poll` returns nothing until the next `submit`. Returns
        the keys of the batches forgotten."""
        keys = list(self._batches) + [k for k, _ in self._done]
        if self._inflight and not self.dead():
            self.llm.llm_engine.abort_request(list(self._inflight))  # queued to the core ahead of later calls
        self._inflight.clear()
        self._batches.clear()
        self._done.clear()
        return keys

    def reset(self) -> bool:
        """The engine as a fresh one: `drop_all`, then vLLM's prefix cache emptied. Returns whether vLLM
        emptied it (it does not while any block is in use)."""
        self.drop_all()
        return bool(self._core("reset_prefix_cache", self.llm.llm_engine.reset_prefix_cache))

    def _abort(self, which: Callable[[GenRequest], bool]) -> None:
        """Abort the requests in flight for which `which` holds; each becomes an "abort" result in its
        batch, and a batch that has no request left in flight is returned by the next poll."""
        rids = [rid for rid, (_, _, r, _) in self._inflight.items() if which(r)]
        if not rids:
            return
        if not self.dead():
            self.llm.llm_engine.abort_request(rids)
        for rid in rids:
            self._finish(rid, None)

    def _finish(self, rid: str, output) -> None:
        """Request `rid` ends: with vLLM's output, or aborted (None)."""
        key, first, r, version = self._inflight.pop(rid)
        batch = self._batches[key]
        batch.results[first:first + r.n] = aborted(r, version) if output is None else outputs_of(output, r, version)
        batch.remaining -= r.n
        if batch.remaining == 0:
            self._done.append((key, self._batches.pop(key).results))

    # -- continuous batching: submit batches at any time, poll the engine one step at a time --------
    def _adapter_of(self, r: GenRequest) -> tuple[int, Any]:
        """(version, LoRARequest) that serves `r`: its snapshot's, its job's current one, or the base
        model's (-1, None). A KeyError for a job or snapshot the engine does not hold."""
        if r.snapshot is not None:
            got = self._snapshots.get(r.snapshot)
            if got is None:
                raise KeyError(f"snapshot {r.snapshot!r} is not registered in the engine (released, or never registered)")
            return got
        if r.job is None:
            return -1, None
        if r.job not in self._adapters:
            raise KeyError(f"job {r.job!r} has no adapter loaded in the engine")
        return self._adapters[r.job]

    def submit(self, key: Any, requests: list[GenRequest]) -> None:
        """Queue a batch in the running engine now, each request with its job's current adapter, its
        snapshot or the base model. Batches submitted while others decode join them in vLLM's continuous
        batch. Only the thread that polls may submit. A request the engine cannot serve (an unknown job
        or snapshot, a snapshot whose directory is gone) refuses the whole batch."""
        if key in self._batches:
            raise KeyError(f"batch {key!r} is already in flight")
        if not requests:
            self._done.append((key, []))
            return
        served = [self._adapter_of(r) for r in requests]
        for key_, path in {(r.snapshot, lora.lora_path) for r, (_, lora) in zip(requests, served)
                           if r.snapshot and r.snapshot not in self._snapshot_memory}:
            # vLLM reads an evicted snapshot again from there, and a load that fails in a step kills the core
            if not os.path.isfile(os.path.join(path, "adapter_config.json")):
                raise FileNotFoundError(f"snapshot {key_!r}: its directory {path} has no adapter_config.json; "
                                        "it must stay until the snapshot is released")
        for r in requests:
            if not 0 < len(r.prompt_ids) < self.max_model_len:
                raise ValueError(f"prompt_ids: {len(r.prompt_ids)} tokens; a prompt needs 1 to "
                                 f"engine.max_model_len - 1 ({self.max_model_len - 1})")
        # vLLM checks the values here
        params = [sampling_params(r, self.logprobs) for r in requests]
        engine = self.llm.llm_engine
        total = sum(r.n for r in requests)  # a request of n samples fills n places of the batch, from its first
        self._batches[key] = _Batch([None] * total, total)
        added, first = [], 0
        try:
            for r, (version, lora), sp in zip(requests, served, params):
                rid = f"colora-{self._next_request}"  # outputs carry this external id
                self._next_request += 1
                engine.add_request(rid, {"prompt_token_ids": list(r.prompt_ids)}, sp, lora_request=lora)
                added.append(rid)
                self._inflight[rid] = (key, first, r, version)
                first += r.n
        except BaseException:  # the batch goes whole or not at all
            if added:
                engine.abort_request(added)
            for rid in added:
                del self._inflight[rid]
            del self._batches[key]
            raise

    def poll(self) -> list[tuple[Any, list[GenResult]]]:
        """Run one engine step; return the batches that completed in it (and those whose last requests
        were aborted since the last poll), in the order they completed."""
        if not self._inflight:
            done, self._done = self._done, []
            return done
        t0, inflight, w0 = time.perf_counter(), len(self._inflight), self._waited[0]
        outputs = self.llm.llm_engine.step()
        self.steps.record(t0, time.perf_counter(), inflight, self._waited[0] - w0)
        for o in outputs:
            if o.finished and o.request_id in self._inflight:
                self._finish(o.request_id, o)
        done, self._done = self._done, []
        return done

    def busy(self) -> bool:
        return bool(self._inflight) or bool(self._done)

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Generate a batch to completion (nothing else may be in flight). Texts are decoded."""
        key = ("generate", self._next_request)
        self.submit(key, requests)
        while True:
            for k, results in self.poll():
                if k == key:
                    self.decode(results)
                    return results
                raise RuntimeError(f"batch {k!r} completed during a blocking generate")

    def decode(self, results: list[GenResult]) -> None:
        texts = self.tokenizer.batch_decode([r.completion_ids for r in results], skip_special_tokens=True)
        for r, t in zip(results, texts):
            r.text = t

    def close(self) -> None:
        """Shut vLLM's engine down; of one whose core died, also remove the shared memory it left."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        died = self.dead() if hasattr(self, "_procs") else ""
        shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
            getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        try:
            if shutdown is not None:
                shutdown()
        except Exception:  # a dead engine process: nothing left to shut down
            pass
        del llm
        if died:
            unlink_segments(getattr(self, "_segments", ()))
