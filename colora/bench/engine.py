"""The rollout engine's decoding alone: how long one engine step takes against the batch size, with
and without the jobs' adapters and per-request seeds.

    colora bench engine CONFIG [--batches 32 128 256 512] [--tokens 128] [--prompt 64] [--out runs/bench/engine]
                               [--profile] [--set KEY=VALUE ...]

Why: under overlap a group's generation is the longest phase of its cycle, and it is as long as
its longest response (256 tokens in the reference workload) times the engine's step time, which
grows with the requests in flight: in overlap_mps on the H200, while no group trains, 6.3-7.8 ms
+ 13-15 us a request in flight (reports/arms_throughput), against about 2-3 ms that the weights and
KV reads of 300 sequences of a 0.6B model need. This program tells apart what a step costs:

- every request decodes exactly --tokens tokens (min_tokens = max_tokens, EOS ignored), so a batch
  holds its size for the whole run; the step time is the median over its steps (the few steps that
  prefill the prompts are outliers there);
- the same batch through the base model (no adapter) and round-robin through the config's jobs'
  adapters (what a run decodes), each with per-request seeds (what colora's runs use, so rollouts are
  reproducible) and without (vLLM's one generator for the batch);
- per combination, a straight line through the step times: ms per step = fixed + per-request x batch.
  A per-request cost that changes with seeds points at the sampler; with adapters, at the LoRA path;
- `waiting`: the share of the wall time the engine's client spent waiting for the engine core's
  output (high: the core bounds the step, its GPU work or its Python; low: the client's Python);
- --profile: vLLM's torch profiler around one batch (the jobs' adapters, seeded, the largest batch);
  its table of operator times (CPU and, on CUDA, GPU) is written to OUT.profile.txt.

One engine, started once as `colora run` starts it for the config's arm: its engine settings, and for an MPS arm under colora's MPS daemon with the arm's
shares (`--set experiment.arm=dedicated`: without MPS; the report says which). The adapters are the jobs' PEFT initialisation with B drawn
at random (every LoRA product is computed either way). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _adapters(cfg, model_dir: Path, dtype: str, scratch: Path) -> dict[str, Path]:
    """Each job's adapter in PEFT's format: its initialisation with B random (nonzero)."""
    import torch

    from ..lora import AdapterBank, inject_lora
    from ..models import load_base_model
    from ..resources import torch_dtype

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
    from ..engine import GenRequest

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
    return {"batch": batch, "adapters": jobs[0] is not None, "seeded": seeded, "steps": len(steps),
            "ms_per_step": 1e3 * statistics.median(steps), "wall_s": wall, "tokens_per_s": batch * tokens / wall,
            "waiting": (engine.waited - w0) / wall}


def _fit(rows: list[dict]) -> dict:
    """ms per step = fixed + per_request x batch, least squares over the batch sizes."""
    import numpy as np

    x = np.array([r["batch"] for r in rows], dtype=float)
    y = np.array([r["ms_per_step"] for r in rows])
    if len(set(x)) < 2:
        return {"fixed_ms": float(y.mean()), "per_request_us": None}
    slope, icept = np.polyfit(x, y, 1)
    return {"fixed_ms": float(icept), "per_request_us": float(1e3 * slope)}


def to_markdown(result: dict) -> str:
    env = result["environment"]
    out = ["# Engine decoding: step time against batch size", "", "```", result["command"], "```", "",
           f"{env['device']}; vLLM {env['vllm']}, torch {env['torch']}; {env['date']}. Model `{result['model']}` "
           f"({result['dtype']}), {len(result['jobs'])} adapters (ranks "
           f"{sorted(set(result['ranks']))}); every request decodes exactly {result['tokens']} tokens after a "
           f"{result['prompt']}-token prompt. Engine start {result['engine_start_s']:.0f} s (not in any figure). "
           f"Arm {result['arm']}: MPS {result['mps']}.", "",
           "| adapters | per-request seeds | batch | steps | ms per step (median) | tokens/s | waiting |",
           "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        out.append(f"| {'jobs' if r['adapters'] else 'none'} | {'yes' if r['seeded'] else 'no'} | {r['batch']} | "
                   f"{r['steps']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | {r['waiting']:.2f} |")
    out += ["", "A straight line through each combination's step times (ms per step = fixed + per request x batch):",
            "", "| adapters | per-request seeds | fixed ms | per request, us |", "|---|---|---|---|"]
    for f in result["fits"]:
        per = "-" if f["per_request_us"] is None else f"{f['per_request_us']:.1f}"
        out.append(f"| {'jobs' if f['adapters'] else 'none'} | {'yes' if f['seeded'] else 'no'} | "
                   f"{f['fixed_ms']:.2f} | {per} |")
    if result.get("profile"):
        out += ["", f"vLLM's profiler around one batch ({result['profile']['case']}): "
                    f"{Path(result['profile']['table']).name}."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="colora bench engine", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 128, 256, 512])
    p.add_argument("--tokens", type=int, default=128, help="tokens every request decodes")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--profile", action="store_true", help="vLLM's torch profiler around one batch (OUT.profile.txt)")
    p.add_argument("--out", default="runs/bench/engine", help="report path without suffix")
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.tokens < 1 or args.prompt < 1:
        p.error("--batches, --tokens and --prompt must be at least 1")
    import numpy as np

    from ..config import load_config
    from ..engine import RolloutEngine, plain_token_ids
    from ..resources import resolve_device, resolve_model, start_mps
    from ..runlog import write_report

    cfg = load_config(args.config, args.set)
    if args.prompt + args.tokens > cfg.engine.max_model_len:
        p.error(f"--prompt + --tokens ({args.prompt + args.tokens}) exceed engine.max_model_len "
                f"({cfg.engine.max_model_len})")
    model_dir = resolve_model(cfg.experiment.model)
    device, dtype = resolve_device(cfg)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="colora-bench-engine-"))
    prof_dir = scratch / "profile"
    extra = {"profiler_config": {"profiler": "torch", "torch_profiler_dir": str(prof_dir),
                                 "torch_profiler_with_stack": False}} if args.profile else None
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        _, mps_note = start_mps(cfg, stack, print, None)  # before any CUDA context, as a run does
        paths = _adapters(cfg, model_dir, dtype, scratch)
        max_loras = cfg.engine.max_loras or len(cfg.jobs)
        engine = RolloutEngine(str(model_dir), cfg.engine, max_loras=max_loras,
                               max_lora_rank=max(j.lora_rank for j in cfg.jobs), dtype=dtype, seed=cfg.experiment.seed,
                               device=device, engine_args=extra)
        stack.callback(engine.close)  # before the MPS daemon stops (registered after it)
        for name, path in paths.items():
            engine.set_adapter(name, 0, str(path))
        engine.warm_up(cfg.experiment.seed)
        vocab = plain_token_ids(engine.tokenizer)
        rng = np.random.default_rng(cfg.experiment.seed)
        prompts = [tuple(int(t) for t in rng.choice(vocab, args.prompt)) for _ in range(64)]
        names = [j.name for j in cfg.jobs]
        rows = []
        for jobs in ([None], names):
            for seeded in (True, False):
                for batch in args.batches:
                    r = _measure(engine, batch, args.tokens, prompts, jobs, seeded)
                    print(json.dumps(r), flush=True)
                    rows.append(r)
        profile = None
        if args.profile:
            batch = max(args.batches)
            engine.llm.start_profile()
            _measure(engine, batch, args.tokens, prompts, names, True)
            engine.llm.stop_profile()
            tables = sorted(prof_dir.glob("*profiler_out*.txt"))  # vLLM 0.26: profiler_out_0.txt; 0.32: WORKER.profiler_out.txt
            if not tables:
                raise RuntimeError(f"vLLM's profiler wrote no table under {prof_dir}")
            table = Path(args.out + ".profile.txt")
            shutil.copyfile(tables[0], table)
            profile = {"case": f"the jobs' adapters, seeded, batch {batch}", "table": str(table)}
        import torch
        import vllm

        result = {
            "command": "colora bench engine " + " ".join(argv),
            "environment": {"device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu"),
                            "vllm": vllm.__version__, "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
            "model": cfg.experiment.model, "dtype": dtype, "engine_start_s": engine.start_seconds,
            "arm": cfg.experiment.arm, "mps": mps_note,
            "jobs": names, "ranks": [j.lora_rank for j in cfg.jobs], "tokens": args.tokens, "prompt": args.prompt,
            "rows": rows,
            "fits": [{"adapters": a, "seeded": s, **_fit([r for r in rows if r["adapters"] == a and r["seeded"] == s])}
                     for a in (False, True) for s in (True, False)],
            "profile": profile,
        }
    write_report(args.out, result, to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
