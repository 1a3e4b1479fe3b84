"""Adapter sync per adapter, from the trainer's weights to an engine serving them: in memory against
from disk, in one engine.

    colora bench adapter-sync CONFIG [--rounds 11] [--decoding 64] [--out runs/bench/adapter_sync]
                                     [--set KEY=VALUE ...]

One engine, started as `colora run` starts it for CONFIG (its model, dtype, device and engine
section; its client in a process of its own where `runtime.engine_process` says so for the config's
arm; for an MPS arm under colora's MPS daemon with the arm's shares), for in-memory adapter sync
(an engine started so loads PEFT directories too), and the trainer's adapter bank as a run builds it
(`build_trainer`: the config's jobs on the trainer's device; a full-parameter job, which has no adapter,
is refused by name). Each round gives every job a new version (B drawn at random) and moves it to the
engine by each path in turn, every time as a version of its own (a new LoRA name and id):

- disk: `AdapterBank.export_peft` into a directory on tmpfs where there is one (as a run's adapter
  scratch is), then vLLM's `add_lora` from its path (`runtime.adapter_sync = "disk"`);
- memory: `AdapterExport.export` into the job's shared-memory segment, from which vLLM's worker builds the
  adapter (`runtime.adapter_sync = "memory"`, colora/engine/adapters.py).

Both under two conditions: the engine idle (every job's version in turn), and the engine decoding,
as in a run, where one group's adapters load while another group decodes: the jobs split in two
halves, each half's versions move while --decoding requests through the other half's adapters (the
base model, with a single job) decode. A version is never replaced while requests of it are in
flight, which a run never does either (vLLM would need the replaced version's adapter again). Export and load are timed per adapter on the trainer's side (time.perf_counter around
each call, after the new weights are on the device; a load returns once the engine holds the adapter
in a slot, ready to serve). The first round is a warm-up and left out. Prints per path and condition
the p50 and largest export, load and their sum, and writes OUT.json (every time) and OUT.md.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from colora.config import load_config
from colora.engine.adapters import memory_unsupported
from colora.engine.process import RemoteEngine
from colora.engine.rollout import GenRequest, RolloutEngine, engine_process, plain_token_ids
from colora.record.runlog import write_report
from colora.run.preflight import RunError, adapter_scratch, resolve_device, resolve_model, start_mps, torch_dtype
from colora.training.export import AdapterExport
from colora.training.trainer import build_trainer

PATHS = ("disk", "memory")
CONDITIONS = ("idle", "decoding")


def summary(xs: list[float]) -> dict:
    """p50 and largest of `xs` (seconds), in milliseconds."""
    return {"n": len(xs), "p50_ms": 1e3 * statistics.median(xs), "max_ms": 1e3 * max(xs)}


def to_markdown(result: dict) -> str:
    env = result["environment"]
    out = ["# Adapter sync per adapter: in memory against from disk", "", "```", result["command"], "```", "",
           f"{env['device']}; vLLM {env['vllm']}, torch {env['torch']}; {env['date']}. Model `{result['model']}` "
           f"({result['dtype']}), {len(result['jobs'])} adapters of rank {sorted(set(result['ranks']))}, "
           f"{result['bytes_per_adapter'] / 1e6:.1f} MB each in the engine's dtype ({result['tensors_per_adapter']} "
           f"tensors); the engine's client {'in a process of its own' if result['engine_process'] else 'in the trainer process'}"
           f"; arm {result['arm']}, MPS {result['mps']}. {result['rounds']} rounds after a warm-up round; decoding: "
           f"{result['decoding']} requests in flight during the loads.", "",
           "| path | engine | adapters | export ms (p50 / max) | load ms (p50 / max) | export + load ms (p50 / max) |",
           "|---|---|---|---|---|---|"]
    for path in PATHS:
        for cond in CONDITIONS:
            r = result["paths"][path][cond]
            cells = [f"{r[k]['p50_ms']:.1f} / {r[k]['max_ms']:.1f}" for k in ("export", "load", "sync")]
            out.append(f"| {path} | {cond} | {r['sync']['n']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="colora bench adapter-sync", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--rounds", type=int, default=11, help="rounds, the first of them a warm-up (default 11)")
    p.add_argument("--decoding", type=int, default=64, help="requests decoding during the loads of the "
                                                            "'decoding' condition (default 64)")
    p.add_argument("--out", default="runs/bench/adapter_sync", help="report path without suffix")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error(f"--rounds ({args.rounds}) must be at least 2: the first is a warm-up")
    if args.decoding < 1:
        p.error(f"--decoding ({args.decoding}) must be at least 1")
    return args


def _steps(cond: str, jobs: list[str]) -> list[tuple[list[str], list[str | None]]]:
    """A round's steps under `cond`: (the jobs whose versions move, the adapters that decode meanwhile;
    None: the base model)."""
    if cond == "idle":
        return [(jobs, [])]
    halves = [jobs[0::2], jobs[1::2]]  # as a run's two groups
    return [(halves[0], halves[1]), (halves[1], halves[0])] if halves[1] else [(halves[0], [None])]


def _sync_round(engine, bank, jobs: list[str], export: AdapterExport, device: str, g, times: dict | None) -> None:
    """Every job's next version (B random) to the engine by `export`; each export and load timed."""
    for name in jobs:
        job = bank.jobs[name]
        with torch.no_grad():
            for b in job.B.values():
                b.copy_(torch.randn(b.shape, generator=g, device=device) * 0.01)
        job.version += 1
        if device == "cuda":
            torch.cuda.synchronize()  # the new weights are there before the export starts
        t0 = time.perf_counter()
        adapter = export.export(bank, name)
        t1 = time.perf_counter()
        engine.set_adapters([adapter])
        t2 = time.perf_counter()
        if times is not None:
            for k, secs in (("export", t1 - t0), ("load", t2 - t1), ("sync", t2 - t0)):
                times[k].append(secs)
        if export.mode == "disk":
            shutil.rmtree(adapter.path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    cfg = load_config(args.config, args.set)
    for j in cfg.jobs:
        if j.finetune == "full":
            raise RunError(f"job {j.name!r} is finetune = \"full\": it has no adapter to sync (its weights reach its "
                           "own engine as colora/engine/weights.py says); bench the config's LoRA jobs")
    import vllm

    why = memory_unsupported()
    if why:
        raise RunError(f"in-memory adapter sync cannot work here ({why}): nothing to compare")
    model_dir = resolve_model(cfg.experiment.model)
    device, dtype = resolve_device(cfg)
    remote = engine_process(cfg.runtime.engine_process, cfg.experiment.arm)
    max_loras = cfg.engine.max_loras or len(cfg.jobs)
    if max_loras < len(cfg.jobs):
        raise RunError(f"engine.max_loras ({max_loras}) must be at least the number of jobs ({len(cfg.jobs)})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    jobs = [j.name for j in cfg.jobs]
    times = {p: {c: {"export": [], "load": [], "sync": []} for c in CONDITIONS} for p in PATHS}
    with contextlib.ExitStack() as stack:
        _, mps_note = start_mps(cfg, stack, print, None)  # before any CUDA context, as a run does
        scratch = adapter_scratch(Path(args.out).parent)
        stack.callback(shutil.rmtree, scratch, True)
        Engine = RemoteEngine if remote else RolloutEngine
        engine = Engine(str(model_dir), cfg.engine, max_loras=max_loras, max_lora_rank=max(j.lora_rank for j in cfg.jobs),
                        dtype=dtype, seed=cfg.experiment.seed, device=device, adapter_sync="memory")
        stack.callback(engine.close)  # before the MPS daemon stops (registered after it)
        exports = {path: AdapterExport(path, dtype, str(model_dir), scratch) for path in PATHS}
        for export in exports.values():
            stack.callback(export.close)
        bank, _ = build_trainer(cfg, model_dir, device, torch_dtype(dtype), engine.tokenizer.pad_token_id)
        g = torch.Generator(device=device).manual_seed(cfg.experiment.seed)
        vocab = plain_token_ids(engine.tokenizer)
        rng = np.random.default_rng(cfg.experiment.seed)
        tokens = min(256, cfg.engine.max_model_len - 16)  # each decoding request's, after a 16-token prompt
        for r in range(args.rounds):
            for cond in CONDITIONS:
                for path in PATHS:
                    for moved, serving in _steps(cond, jobs):
                        key = ("decoding", r, path, tuple(moved))
                        engine.submit(key, [GenRequest(serving[i % len(serving)], tuple(int(t) for t in rng.choice(vocab, 16)),
                                                       tokens, 1.0, seed=i, min_tokens=tokens, ignore_eos=True)
                                            for i in range(args.decoding if serving else 0)])
                        _sync_round(engine, bank, moved, exports[path], device, g, times[path][cond] if r else None)
                        while key not in {k for k, _ in engine.poll()}:
                            pass
                # every job's newest version serves a request
                engine.generate([GenRequest(n, tuple(range(10, 26)), 2, 1.0, seed=i) for i, n in enumerate(jobs)])
        names, _, flat = bank.flat_adapter(jobs[0], torch_dtype(dtype))
        result = {
            "command": "colora bench adapter-sync " + " ".join(argv),
            "environment": {"device": torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or "cpu"),
                            "vllm": vllm.__version__, "torch": torch.__version__,
                            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
            "model": cfg.experiment.model, "dtype": dtype, "arm": cfg.experiment.arm, "mps": mps_note,
            "engine_process": remote, "jobs": jobs, "ranks": [j.lora_rank for j in cfg.jobs],
            "tensors_per_adapter": len(names), "bytes_per_adapter": flat.numel() * flat.element_size(),
            "rounds": args.rounds - 1, "decoding": args.decoding,
            "paths": {p: {c: {k: summary(v) for k, v in t.items()} for c, t in byc.items()} for p, byc in times.items()},
            "seconds": times,
        }
    write_report(args.out, result, to_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
