"""What the kernel benchmark (kernels.py) and the launch search (tune.py) share: the timers, the profiler's
kernel-by-kernel sums, peak memory, and the grouped-LoRA problem they time."""

from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile


def timer(fn, device: torch.device, quick: bool) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=20 if quick else 60,
                                       return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graph_timer(fn, device: torch.device, quick: bool) -> float | None:
    """Median seconds per call of `fn` replayed as one CUDA graph: the kernels' time without the host's
    launch gaps (do_bench's events also time the GPU waiting for the host, a ~1 ms floor per LoRA
    forward+backward on the H200, above the bytes bound of 8 jobs x 24k tokens). None on the CPU, or
    where the call cannot be captured.

    do_bench_cudagraph calls `fn` on a stream of its own; the tile tables that `fn`'s first eager call uploaded
    (LoRABatchMeta: without blocking, on the stream then current) may not have landed yet, and a kernel on the
    other stream would read whatever those bytes held: wait for them first (compute-sanitizer caught a tile's job
    index read 4.5 GB past the segment table that way, on the H200 at 6c75111)."""
    if device.type != "cuda":
        return None
    import triton.testing

    torch.cuda.synchronize(device)
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20 if quick else 60, return_mode="median") / 1e3
    except Exception as e:  # a capture error: the row keeps its event timing only
        print(f"  (no CUDA graph timing: {type(e).__name__}: {e})", flush=True)
        return None


def kernel_times(events, calls: int) -> dict[str, float]:
    """Microseconds per call of each kernel (and memset/memcpy) the profiled `calls` launched, by
    name, largest first: the GPU's own durations, without the host's gaps or the bubbles between
    kernels. `events`: torch.profiler's events (annotation ranges are left out)."""
    out: dict[str, float] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        out[e.name] = out.get(e.name, 0.0) + us / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def kernel_breakdown(fn, device: torch.device, calls: int = 5) -> dict[str, float] | None:
    """`kernel_times` of `calls` calls of `fn` after one warm-up call; None on the CPU."""
    if device.type != "cuda":
        return None

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return kernel_times(prof.events(), calls)


def peak_bytes(fn, device: torch.device) -> int | None:
    """Peak memory allocated during one call, above what was allocated before it."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def lora_problem(K, J, tokens_per_job, rank, d_in, d_out, device, seed):
    """(meta, x, A, B, dy) in bf16: J jobs of tokens_per_job rows each at one rank, scale 2, seeded."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16
    seg = [tokens_per_job * j for j in range(J + 1)]
    rs = [rank * j for j in range(J + 1)]
    meta = K.LoRABatchMeta.build(seg, rs, [2.0] * J, device)
    T, R = seg[-1], rs[-1]
    x = torch.randn(T, d_in, device=device, generator=g).to(dt).requires_grad_()
    A = (torch.randn(R, d_in, device=device, generator=g) / d_in**0.5).to(dt).requires_grad_()
    B = (torch.randn(d_out, R, device=device, generator=g) / rank**0.5).to(dt).requires_grad_()
    dy = torch.randn(T, d_out, device=device, generator=g).to(dt)
    return meta, x, A, B, dy


