"""A whole trainer step, colora's against peft's, at the reference study's shapes.

    colora bench trainer --out runs/bench/trainer_step [--jobs 8] [--seqs 64] [--prompt 128] [--completion 256]
    colora bench trainer --model builtin:qwen3-8b-shape --impls triton+packed+fused --micro-batch-tokens 12288 \
        --gradient-checkpointing --out runs/bench/trainer_8b      # the memory planner's estimate against the peak

One optimizer step for J jobs x S sequences of (prompt + completion) tokens on Qwen3-0.6B's shape
(random weights, bf16, LoRA rank 16 on every linear layer): colora's multi-job trainer with the Triton
kernels, the same trainer with the torch reference ops, and peft with one adapter for all rows
(the standard path: full logits, log-softmax, gather), each timed after a warm-up step, with peak
memory. --impls names the implementations: peft, or triton / torch with +packed (q/k/v and gate/up
in one grouped call each: trainer.pack_projections) and +fused (the elementwise kernels:
trainer.fuse_elementwise); the trainer packs its rows on CUDA (colora/training/packing.py). Beside each colora
implementation's peak is the memory planner's estimate of it (colora/training/memory.py: weights, adapters'
state and one pass, the allocator's slack included), so that a run on a larger shape checks the estimate,
and each step's share of the card's bf16 dense peak (MFU: `step_flops` over the seconds, over
BF16_DENSE_PEAK of the card where its name is known). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from colora.config import JobConfig, TrainerConfig
from colora.models.base import load_base_model
from colora.models.shape import ModelShape
from colora.run.heap import frozen_heap
from colora.run.preflight import resolve_model
from colora.training import memory as tm
from colora.training.fusion import fuse_elementwise, restore_rotary
from colora.training.lora import AdapterBank, inject_lora
from colora.training.trainer import MultiJobTrainer, Rollout


# NVIDIA's datasheet bf16 dense (no sparsity) tensor-core peaks, FLOP/s, by a part of the card's name
BF16_DENSE_PEAK = {"H200": 989.4e12, "H100 80GB HBM3": 989.4e12, "H100 NVL": 835.5e12, "H100 PCIe": 756.5e12}


def step_flops(shape: ModelShape, tokens: int) -> float:
    """A LoRA step's model FLOPs: per token, 4 x the matmul weights (every decoder layer's projections and
    the LM head): the forward's 2 and the backward's 2 for its input gradients, the frozen base having no
    weight gradients. Attention's score and value products and the adapters' own FLOPs are not counted."""
    weights = shape.layers * sum(a * b for a, b in shape.projections().values()) + shape.vocab * shape.hidden
    return 4.0 * weights * tokens


def peak_flops(device: str) -> float | None:
    """The card's bf16 dense peak, FLOP/s (None where BF16_DENSE_PEAK does not know it)."""
    return next((v for k, v in BF16_DENSE_PEAK.items() if k in device), None)


def _rollouts(jobs: list[str], seqs: int, prompt: int, completion: int, vocab: int, version: int):
    g = torch.Generator().manual_seed(version)
    out = {}
    for j in jobs:
        rs = []
        for i in range(seqs):
            p = torch.randint(10, vocab, (prompt,), generator=g).tolist()
            c = torch.randint(10, vocab, (completion,), generator=g).tolist()
            rs.append(Rollout(j, version, p, c, [], i // 8, 0.0, float(torch.randn(1, generator=g))))
        out[j] = rs
    return out


def _reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")


def bench_colora(model_dir: str, args, backend: str) -> dict:
    _reset(args.device)
    model = load_base_model(model_dir, args.dtype, args.device)
    backend, *flags = backend.split("+")
    packed, fused = "packed" in flags, "fused" in flags
    if fused:
        fuse_elementwise(model)
    bank = AdapterBank(args.device, backend, pack_projections=packed)
    inject_lora(model, bank)
    names = [f"job{i}" for i in range(args.jobs)]
    jobs = {}
    for n in names:
        jobs[n] = JobConfig(name=n, task="addition", lora_rank=args.rank, lora_alpha=2.0 * args.rank,
                            max_new_tokens=args.completion)
        bank.add_job(n, args.rank, 2.0 * args.rank, jobs[n].target_modules, 0, 1e-5)
    cfg = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, lora_backend=backend, logprob_backend=backend,
                        pack_projections=packed, fuse_elementwise="on" if fused else "off",
                        gradient_checkpointing=args.gradient_checkpointing)
    trainer = MultiJobTrainer(model, bank, cfg, jobs, pad_id=0)
    vocab = model.config.vocab_size
    times = []
    with frozen_heap():  # as a run's steps (colora/run/heap.py)
        for step in range(args.repeats + 1):
            ro = _rollouts(names, args.seqs, args.prompt, args.completion, vocab, step)
            _sync(args.device)
            t0 = time.perf_counter()
            trainer.step(ro)
            _sync(args.device)
            if step > 0:  # the first step compiles and autotunes
                times.append(time.perf_counter() - t0)
    peak = _peak(args.device)
    impl = f"colora ({backend}{', packed q/k/v and gate/up' if packed else ''}{', fused elementwise' if fused else ''})"
    out = {"impl": impl, "seconds": sorted(times)[len(times) // 2], "all": times, "peak_gib": peak,
           "estimated_gib": estimate(model_dir, args, backend)}
    if args.profile:
        ro = _rollouts(names, args.seqs, args.prompt, args.completion, vocab, args.repeats + 1)
        out["profile"] = profile_step(lambda: trainer.step(ro), args.device, f"{args.out}.profile.txt", impl)
    if args.profile_sources:
        ro = _rollouts(names, args.seqs, args.prompt, args.completion, vocab, bank.jobs[names[0]].version)
        profile_sources(lambda: trainer.step(ro), args.device, f"{args.out}.sources.txt", impl)
    trainer = bank = model = None  # frees them before the next implementation loads (the closures hold them)
    if fused:
        restore_rotary()  # the next implementation measures the model's own code
    return out


def estimate(model_dir: str, args, backend: str) -> float:
    """The memory planner's estimate of the step's peak, GiB: the base weights, every job's adapter state and
    one pass of --micro-batch-tokens (what torch's allocator counts; the CUDA context is not in either)."""
    shape = ModelShape.from_dir(model_dir)
    dtype_bytes = torch.tensor([], dtype=args.dtype).element_size()
    modules = tuple(shape.projections())
    one = tm.pass_at(max(args.micro_batch_tokens, args.prompt + args.completion), shape, dtype_bytes, args.device,
                     rank=args.rank, modules=modules, logprob_chunk=TrainerConfig().logprob_chunk,
                     triton=backend == "triton", checkpointing=args.gradient_checkpointing)
    return (shape.weight_bytes(dtype_bytes) + args.jobs * tm.lora_state_bytes(shape, args.rank, modules) + one.bytes) / 2**30


def _profiled(device: str) -> tuple[list, str]:
    """The profiler's activities on `device` and the key its tables sort the device's time by."""
    if device == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA], "self_cuda_time_total"
    return [ProfilerActivity.CPU], "self_cpu_time_total"


def profile_step(step, device: str, path: str, title: str) -> dict:
    """One step under torch.profiler: wall time, the time the GPU spent in kernels, how many ops
    the host dispatched and kernels it launched, and the top ops by host and by device time
    (appended to `path`). Tells a host-bound step (GPU busy share well under 1) from a GPU-bound one."""
    acts, dev_key = _profiled(device)
    _sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        _sync(device)
        wall = time.perf_counter() - t0
    events = prof.events()
    # the device's kernels and copies, not the GPU-side ranges of record_function annotations (the
    # optimizer's step, each compiled function's call), which span kernels already counted
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    gpu_s = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total for e in kernels) / 1e6
    ops = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    avg = prof.key_averages()
    summary = {"wall_s": wall, "gpu_kernel_s": gpu_s, "gpu_busy_share": gpu_s / wall, "host_ops": ops,
               "kernels": len(kernels)}
    with open(path, "a") as f:
        f.write(f"## {title}\n{json.dumps(summary)}\n\n")
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
        f.write(avg.table(sort_by=dev_key, row_limit=25) + "\n\n")
    return summary


def profile_sources(step, device: str, path: str, title: str) -> None:
    """Where the device time comes from: one more step under torch.profiler with input shapes and
    Python stacks, the ops by device time grouped by their caller (`ops_by_caller`) and by their
    input shapes (appended to `path`). Slower on the host than `profile_step` (recording stacks), so
    its wall time is not reported; the tables say which line of code launched which kernels."""
    acts, dev_key = _profiled(device)
    _sync(device)
    verbose = torch._C._profiler._ExperimentalConfig(verbose=True)  # attaches the stacks to the ops
    with profile(activities=acts, record_shapes=True, with_stack=True, experimental_config=verbose) as prof:
        step()
        _sync(device)
    with open(path, "a") as f:
        f.write(f"## {title}\n\n### by caller: the op, its shapes, the ops around it and 8 Python frames\n")
        f.write(ops_by_caller(prof.events(), device) + "\n")
        f.write("### by input shapes\n")
        f.write(prof.key_averages(group_by_input_shape=True).table(sort_by=dev_key, row_limit=40,
                                                                   max_name_column_width=60) + "\n\n")


def ops_by_caller(events, device: str, rows: int = 50) -> str:
    """The profiled ops that launched device time themselves (host time on the CPU), summed by op,
    input shapes, the enclosing ops (an autograd node's name says which backward ran it) and the 8
    innermost Python frames, with each module instance's number dropped: torch's own grouping by
    stack keeps `nn.Module: Linear_3` and `Linear_7` apart, which splits a per-layer op into one
    small row per layer, where a per-layer op (two concatenations a layer, say) gets lost."""

    def self_time(e) -> float:
        if device == "cpu":
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    def instance_free(name: str) -> str:  # "nn.Module: Qwen3MLP_7" -> "nn.Module: Qwen3MLP"
        return re.sub(r"^(nn\.Module: \w+?)_\d+$", r"\1", name)

    def python_frame(name: str) -> bool:  # with_stack's events of Python calls, not ops
        return name.startswith("<built-in") or re.search(r"\.py\(\d+\)", name) is not None

    totals: dict[tuple, list] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or python_frame(e.name) or (us := self_time(e)) <= 0:
            continue
        parents, p = [], e.cpu_parent
        while p is not None and len(parents) < 3:
            if not python_frame(p.name):
                parents.append(instance_free(p.name))
            p = p.cpu_parent
        stack = tuple(instance_free(s) for s in (e.stack or [])[:8])
        key = (instance_free(e.name), str(e.input_shapes)[:120], " < ".join(parents), stack)
        row = totals.setdefault(key, [0.0, 0])
        row[0] += us
        row[1] += 1
    total = sum(t for t, _ in totals.values()) or 1.0
    lines = [f"{'ms':>9} {'share':>6} {'calls':>6}  op [input shapes] < enclosing ops, then Python frames (innermost first)"]
    for (name, shapes, parents, stack), (us, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{us / 1e3:9.2f} {us / total:6.1%} {n:6d}  {name} {shapes}" + (f" < {parents}" if parents else ""))
        lines += [f"{'':24}  {frame}" for frame in stack]
    return "\n".join(lines) + "\n"


def bench_peft(model_dir: str, args) -> dict:
    from peft import LoraConfig, get_peft_model


    _reset(args.device)
    base = load_base_model(model_dir, args.dtype, args.device)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    n = args.jobs * args.seqs
    L = args.prompt + args.completion
    mb = args.peft_micro_seqs  # full fp32 logits: [mb, completion, 151936] per micro-batch
    vocab = base.config.vocab_size
    times = []
    for step in range(args.repeats + 1):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(10, vocab, (n, L), generator=g).to(args.device)
        adv = torch.randn(n, generator=g).to(args.device)
        _sync(args.device)
        t0 = time.perf_counter()
        for s in range(0, n, mb):
            x = ids[s:s + mb]
            logits = model(input_ids=x, use_cache=False).logits[:, args.prompt - 1:-1].float()  # [b, completion, V]
            logp = torch.log_softmax(logits, -1).gather(-1, x[:, args.prompt:, None]).squeeze(-1)
            loss = -(adv[s:s + mb, None] * logp).mean() * x.shape[0] / n
            loss.backward()
            del logits, logp, loss
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(args.device)
        if step > 0:
            times.append(time.perf_counter() - t0)
    peak = _peak(args.device)
    del model, base, opt
    return {"impl": "peft (one adapter, all rows)", "seconds": sorted(times)[len(times) // 2], "all": times,
            "peak_gib": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colora bench trainer")
    p.add_argument("--out", default="runs/bench/trainer_step")
    p.add_argument("--model", default="builtin:qwen3-0.6b-shape")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--micro-batch-tokens", type=int, default=49152,
                   help="the experiments' (reference8_throughput.toml): 4 micro-batches for the default step")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="colora's trainer recomputes each layer's activations in the backward (trainer.gradient_checkpointing)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peft-micro-seqs", type=int, default=32, help="peft's micro-batch (sequences)")
    p.add_argument("--impls", nargs="+", default=["triton", "triton+packed", "triton+fused", "triton+packed+fused", "torch", "peft"])
    p.add_argument("--profile", action="store_true", help="also profile one step per colora impl (OUT.profile.txt)")
    p.add_argument("--profile-sources", action="store_true",
                   help="also profile one step per colora impl with shapes and Python stacks (OUT.sources.txt)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a smoke test of the program)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("colora: error: bench trainer needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    for impl in args.impls:
        backend, *flags = impl.split("+")
        if impl != "peft" and (backend not in ("triton", "torch") or not set(flags) <= {"packed", "fused"}):
            p.error(f"--impls {impl}: expected peft, or triton/torch with any of +packed, +fused")
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    model_dir = str(resolve_model(args.model))
    results = []
    for impl in args.impls:
        try:
            r = bench_peft(model_dir, args) if impl == "peft" else bench_colora(model_dir, args, impl)
        except Exception as e:  # report what failed, keep measuring the rest
            r = {"impl": impl, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(r), flush=True)
        results.append(r)
    command = "colora bench trainer " + " ".join(argv if argv is not None else sys.argv[2:])
    tokens = args.jobs * args.seqs * (args.prompt + args.completion)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
            "torch": torch.__version__,
            "jobs": args.jobs, "seqs_per_job": args.seqs, "prompt": args.prompt, "completion": args.completion,
            "rank": args.rank, "tokens": tokens, "micro_batch_tokens": args.micro_batch_tokens,
            "gradient_checkpointing": args.gradient_checkpointing}
    flops, peak = step_flops(ModelShape.from_dir(model_dir), tokens), peak_flops(meta["device"])
    meta |= {"model_flops_per_step": flops, "bf16_dense_peak_flops": peak}
    for r in results:
        if "seconds" in r and peak:
            r["mfu"] = flops / r["seconds"] / peak
    out.with_suffix(".json").write_text(json.dumps({**meta, "results": results}, indent=2))
    peft_s = next((r["seconds"] for r in results if r["impl"].startswith("peft") and "seconds" in r), None)
    lines = [f"# Trainer step: {args.jobs} jobs x {args.seqs} sequences x {args.prompt}+{args.completion} tokens",
             "", "```", command, "```", "",
             f"{meta['device']}, torch {meta['torch']}, model {args.model} ({str(args.dtype).removeprefix('torch.')}), LoRA rank "
             f"{args.rank} on all linear layers, {tokens} tokens per step, median of {args.repeats} steps after a "
             "warm-up step. " + (f"MFU: {flops:.3g} model FLOPs a step (4 x the matmul weights a token; attention's "
                                 "products and the adapters' not counted) over the seconds, over the card's bf16 "
                                 f"dense peak ({peak / 1e12:.1f} TFLOP/s)." if peak else
                                 "MFU: the card's bf16 peak is not known here."),
             "", "| implementation | seconds per step | speed-up over peft | MFU | peak GiB | estimated GiB |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "seconds" in r:
            vs = f"{peft_s / r['seconds']:.2f}x" if peft_s else "-"
            est = f"{r['estimated_gib']:.1f}" if "estimated_gib" in r else "-"
            mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
            lines.append(f"| {r['impl']} | {r['seconds']:.3f} | {vs} | {mfu} | {r['peak_gib']:.1f} | {est} |")
        else:
            lines.append(f"| {r['impl']} | failed: {r['error'][:120]} | - | - | - | - |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
