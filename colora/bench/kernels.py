"""Benchmark of colora's kernels against their baselines, measured in the same run.

    colora bench kernels --out runs/bench/kernels        (H200: about 3 minutes)
    colora bench kernels --out /tmp/kbench --quick       (tiny shapes; runs on the CPU interpreter)

First the two ceilings of this device: copy bandwidth (a large device-to-device copy, bytes read
plus written) and the bf16 matmul rate (8192^3 through cuBLAS). Then:
- grouped LoRA forward+backward (y, dx, dA, dB) at Qwen3-0.6B projection shapes, J in {1, 8, 32}
  jobs, ranks 8/16/64, 2k or 24k tokens per job (at most 200k in all), against the per-job loop of
  the torch reference run eagerly; time, TFLOP/s and the share of the measured matmul rate, and the
  bytes bound: the compulsory traffic (x read twice, dy once, y and dx written once) over the copy
  bandwidth, with time / bound ("x bound"), also for the step replayed as a CUDA graph (the kernels
  without the host's launch gaps);
- the LoRA path accumulating into the base projection's output (add_to), and the base product
  inside the LoRA op (base=W), against a separate add, beside the base projection alone;
- the selective log-softmax (V = 151936, d = 1024) forward+backward against the chunked torch
  reference and the naive full-logits path, with peak memory;
- the weight gradients' segment reduction alone, and with --only tune the launch search (tune.py).
Writes OUT.json (every figure) and OUT.md (tables, opening with the command). Times are medians of
triton.testing.do_bench (CUDA events, L2 flushed between runs); on the CPU, of perf_counter.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from colora.bench.measure import graph_timer, kernel_breakdown, lora_problem, peak_bytes, timer
from colora.bench.tune import to_markdown as tune_markdown
from colora.bench.tune import tune_lora
from colora.kernels.backend import interpreted_kernels
from colora.kernels.lora.common import block_r as rank_block
from colora.kernels.lora.policy import fuse_dy_pays, fuse_expand_pays, reduce_shape, rows_config, shrink_config
from colora.kernels.lora.reduce import launch_reduce
from colora.kernels.util import cdiv

QWEN3_SHAPES = {"q": (1024, 2048), "k/v": (1024, 1024), "o": (2048, 1024), "gate/up": (1024, 3072),
                "down": (3072, 1024)}


def calibrate(device: torch.device, quick: bool) -> dict:
    n = (1 << 16) if quick else (1 << 29)  # 1 GiB of bf16 per buffer on the GPU
    a = torch.randn(n, device=device).to(torch.bfloat16)
    b = torch.empty_like(a)
    t_copy = timer(lambda: b.copy_(a), device, quick)
    m = 256 if quick else 8192
    x = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    t_mm = timer(lambda: x @ y, device, quick)
    return {"copy_GBps": 2 * n * 2 / t_copy / 1e9, "bf16_matmul_TFLOPs": 2 * m**3 / t_mm / 1e12,
            "copy_bytes": 2 * n * 2, "matmul_n": m}


def dense_lora_products(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, dy: torch.Tensor):
    """One adapter's LoRA forward + backward on all rows of x, as six cuBLAS GEMMs (torch.mm), scale 1:
    y = x A^T B^T and its dx, dA, dB for the incoming dy. The benchmark's ceiling for the grouped kernels:
    the same products on the same rows and bytes (dy read twice), without grouping."""
    h = x @ A.t()
    dh = dy @ B
    return h @ B.t(), dh @ A, dh.t() @ x, dy.t() @ h


def bench_lora(K, cal: dict, device: torch.device, quick: bool) -> list[dict]:
    rows = []
    shapes = {"tiny": (64, 48)} if quick else QWEN3_SHAPES
    grid = [(1, 2048), (1, 24576), (8, 2048), (8, 24576), (32, 2048)]
    if quick:
        grid = [(1, 64), (4, 48)]
    e = 2  # bytes per bf16 element
    for name, (d_in, d_out) in shapes.items():
        for rank in ((8, 16) if quick else (8, 16, 64)):
            for J, tpj in grid:
                meta, x, A, B, dy = lora_problem(K, J, tpj, rank, d_in, d_out, device, seed=J * 7 + rank)
                T = J * tpj

                def step(backend, fuse_dy=None, fuse_expand=None):
                    y = K.grouped_lora(x, A, B, meta=meta, backend=backend, fuse_dy=fuse_dy, fuse_expand=fuse_expand)
                    torch.autograd.grad(y, (x, A, B), dy)

                t_tri = timer(lambda: step("triton"), device, quick)
                t_loop = timer(lambda: step("torch"), device, quick)
                fused = fuse_dy_pays(meta, d_in, d_out, x.dtype)  # the default: one pass over dy
                t_other = timer(lambda: step("triton", not fused), device, quick)
                t_graph = graph_timer(lambda: step("triton"), device, quick)
                # where the time of the target's rows goes, kernel by kernel
                kernels = kernel_breakdown(lambda: step("triton"), device) if (J, tpj) == (8, 24576) else None
                # and the same step with the expands in their own launches (fuse_expand=False), for the A/B
                expand_fused = fuse_expand_pays(meta, 1, d_in, d_out)
                t_sep = None
                if kernels is not None and fuse_expand_pays(meta, 1, 1, 1):  # (fusable at this rank)
                    t_sep = graph_timer(lambda: step("triton", fuse_expand=not expand_fused), device, quick)
                    kernels_sep = kernel_breakdown(lambda: step("triton", fuse_expand=not expand_fused), device)
                t_dense = None
                if kernels is not None:  # cuBLAS on the same products as one adapter: the library's ceiling
                    xd, Ad, Bd = x.detach(), A.detach()[:rank], B.detach()[:, :rank]
                    t_dense = graph_timer(lambda: dense_lora_products(xd, Ad, Bd, dy), device, quick)
                flops = 6 * T * rank * (d_in + d_out)  # 2 fwd + 4 bwd GEMMs of T x r x d
                bound = e * T * (3 * d_in + 2 * d_out)  # x twice, dx, y, dy once; weights are small
                bound_s = bound / (cal["copy_GBps"] * 1e9)
                rows.append({
                    "shape": name, "d_in": d_in, "d_out": d_out, "rank": rank, "jobs": J, "tokens_per_job": tpj,
                    "tokens": T, "triton_ms": t_tri * 1e3, "loop_ms": t_loop * 1e3, "speedup": t_loop / t_tri,
                    "fused_dy": fused, "other_fuse_ms": t_other * 1e3,
                    "TFLOPs": flops / t_tri / 1e12, "peak_share": flops / t_tri / 1e12 / cal["bf16_matmul_TFLOPs"],
                    "bound_GBps": bound / t_tri / 1e9, "x_bound": t_tri / bound_s,
                    "graph_ms": None if t_graph is None else t_graph * 1e3,
                    "graph_GBps": None if t_graph is None else bound / t_graph / 1e9,
                    "x_bound_graph": None if t_graph is None else t_graph / bound_s,
                    "kernels_us": kernels,
                    "x_bound_kernels": None if not kernels else sum(kernels.values()) / 1e6 / bound_s,
                    "fused_expand": expand_fused,
                    "graph_ms_expand_other": None if t_sep is None else t_sep * 1e3,
                    "kernels_us_expand_other": None if t_sep is None else sum(kernels_sep.values()),
                    "cublas_graph_ms": None if t_dense is None else t_dense * 1e3,
                    "x_bound_cublas": None if t_dense is None else t_dense / bound_s,
                })
                print(f"lora {name:8s} r{rank:<3d} J{J:<3d} {tpj:>6d} tok/job: triton {t_tri * 1e3:8.3f} ms "
                      f"(fuse_dy={fused}; other {t_other * 1e3:8.3f} ms), loop {t_loop * 1e3:8.3f} ms "
                      f"({t_loop / t_tri:5.1f}x), {t_tri / bound_s:4.2f}x bound"
                      + ("" if t_graph is None else f"; graph {t_graph * 1e3:8.3f} ms, {t_graph / bound_s:4.2f}x bound")
                      + ("" if t_sep is None else f"; expands {'separate' if expand_fused else 'fused'}: graph "
                                                  f"{t_sep * 1e3:8.3f} ms, {t_sep / bound_s:4.2f}x bound"),
                      flush=True)
                x = A = B = dy = None  # frees the tensors before the next shape's (the closures hold them)
    return rows


def bench_add_to(K, cal: dict, device: torch.device, quick: bool) -> list[dict]:
    """Base projection + LoRA, forward+backward: separate add, accumulating into the base output
    (add_to), and the base product inside the LoRA op (base=W: its dx in the same cuBLAS call as an
    addmm, the trainer's default)."""
    rows = []
    shapes = {"tiny": (64, 48)} if quick else {k: QWEN3_SHAPES[k] for k in ("q", "gate/up", "down")}
    J, tpj, rank = (4, 48, 16) if quick else (8, 24576, 16)
    for name, (d_in, d_out) in shapes.items():
        meta, x, A, B, dy = lora_problem(K, J, tpj, rank, d_in, d_out, device, seed=3)
        W = (torch.randn(d_out, d_in, device=device) / d_in**0.5).to(torch.bfloat16)

        def base():
            y = x @ W.t()
            torch.autograd.grad(y, (x,), dy)

        def separate():
            y = x @ W.t() + K.grouped_lora(x, A, B, meta=meta, backend="triton")
            torch.autograd.grad(y, (x, A, B), dy)

        def add_to():
            y = K.grouped_lora(x, A, B, meta=meta, backend="triton", add_to=x @ W.t())
            torch.autograd.grad(y, (x, A, B), dy)

        def base_in_op():
            y = K.grouped_lora(x, A, B, meta=meta, backend="triton", base=W)
            torch.autograd.grad(y, (x, A, B), dy)

        t = {k: timer(f, device, quick) * 1e3 for k, f in (("base_ms", base), ("separate_ms", separate),
                                                            ("add_to_ms", add_to), ("base_in_op_ms", base_in_op))}
        rows.append({"shape": name, "d_in": d_in, "d_out": d_out, "rank": rank, "jobs": J, "tokens": J * tpj, **t,
                     **{f"lora_overhead_{k}": t[f"{k}_ms"] / t["base_ms"] - 1 for k in ("separate", "add_to", "base_in_op")}})
        print(f"base+lora {name:8s}: base {t['base_ms']:.3f} ms, separate {t['separate_ms']:.3f} ms, "
              f"add_to {t['add_to_ms']:.3f} ms, base in op {t['base_in_op_ms']:.3f} ms", flush=True)
        x = A = B = dy = W = None  # frees the tensors before the next shape's (the closures hold them)
    return rows


def _reduce_cases(quick: bool) -> list[tuple[str, int, int, str]]:
    """(name, N, rank of the call, chunking) for each reduce a layer's backward launches in the trainer
    step of the issue (packed q/k/v and gate/up, rank 16): the fused dy pass's dB per slice (one
    partial per 64-row tile) and each projection's dA (sgrad's chunks)."""
    if quick:
        return [("dB tiny", 48, 16, "tiles"), ("dA tiny packed", 40, 32, "sgrad")]
    return [("dB q", 2048, 16, "tiles"), ("dB k/v/o/down", 1024, 16, "tiles"), ("dB gate/up", 3072, 16, "tiles"),
            ("dA q|k|v", 1024, 48, "sgrad"), ("dA o", 2048, 16, "sgrad"), ("dA gate|up", 1024, 32, "sgrad"),
            ("dA down", 3072, 16, "sgrad")]


def bench_reduce(K, cal: dict, device: torch.device, quick: bool) -> list[dict]:
    """The segment reduction alone (fp32 partials -> a job's rows of dA or dB^T), its launch now
    (`reduce_shape`) against the previous one (128 or 64 columns a program, one partial per step),
    at the trainer step's micro-batch: 8 jobs x 4096 tokens."""
    J, tpj = (4, 40) if quick else (8, 4096)
    rows = []
    for name, N, rank, chunking in _reduce_cases(quick):
        meta = K.LoRABatchMeta.build([tpj * j for j in range(J + 1)], [rank * j for j in range(J + 1)],
                                     [2.0] * J, device)
        block_r = rank_block(rank)
        if chunking == "tiles":  # the dy pass's partials (64-row tiles at this batch): column blocks of its BLOCK_K
            chunks = meta.tiles(16 if quick else 64)
            pb = shrink_config(meta, torch.bfloat16, N, 0, dy_pass=True)["block_k"]
        else:  # the sgrad's chunks and BLOCK_N
            cfg = rows_config("sgrad", meta, N, torch.bfloat16)
            pb, chunks = cfg["block_n"], meta.tiles(cfg["chunk"])
        part = torch.randn(cdiv(N, pb), max(chunks.n, 1), block_r, pb, device=device)
        out = torch.empty(meta.total_rank, N, device=device, dtype=torch.bfloat16)
        before = reduce_shape(J, N, block_r, 0, pb)  # no partials: one a step, all rank rows
        now = reduce_shape(J, N, block_r, chunks.n, pb)
        t = {}
        for key, shape in (("before", before), ("now", now)):
            t[key] = timer(lambda: launch_reduce(part, out, meta, chunks, block_r, True, shape=shape), device, quick)
        nbytes = part.numel() * 4 + out.numel() * 2
        rows.append({"case": name, "N": N, "rank": rank, "block_r": block_r, "jobs": J, "tokens_per_job": tpj,
                     "partials_per_job": chunks.n // J, "shape_before": list(before), "shape_now": list(now),
                     "before_us": t["before"] * 1e6, "now_us": t["now"] * 1e6, "speedup": t["before"] / t["now"],
                     "now_GBps": nbytes / t["now"] / 1e9})
        print(f"reduce {name:14s} N {N:5d} r {rank:3d}: {chunks.n // J:3d} partials/job, before {t['before'] * 1e6:7.1f} us, "
              f"now {t['now'] * 1e6:7.1f} us ({t['before'] / t['now']:.2f}x)", flush=True)
        part = out = None  # frees the tensors before the next case's (the closures hold them)
    return rows


def bench_logsoftmax(K, cal: dict, device: torch.device, quick: bool) -> list[dict]:
    rows = []
    d, V = (64, 1000) if quick else (1024, 151936)
    for T in ((64,) if quick else (8192, 65536)):
        g = torch.Generator(device=device).manual_seed(T)
        h = torch.randn(T, d, device=device, generator=g).to(torch.bfloat16).requires_grad_()
        W = (torch.randn(V, d, device=device, generator=g) * 3 / d**0.5).to(torch.bfloat16)
        tgt = torch.randint(0, V, (T,), device=device, generator=g)
        temp = torch.rand(T, device=device, generator=g) + 0.5
        gout = torch.randn(T, device=device, generator=g)

        def fused(backend):
            lp = K.selective_log_softmax(h, W, tgt, temperature=temp, chunk_size=256 if quick else 4096,
                                         backend=backend)
            torch.autograd.grad(lp, (h,), gout)

        def naive():
            z = torch.log_softmax((h @ W.t()).float() / temp[:, None], -1)
            torch.autograd.grad(z.gather(1, tgt[:, None]).squeeze(1), (h,), gout)

        row = {"T": T, "V": V, "d": d}
        for key, fn in (("triton", lambda: fused("triton")), ("torch_chunked", lambda: fused("torch")),
                        ("naive", naive)):
            try:
                row[f"{key}_peak_GB"] = (peak_bytes(fn, device) or 0) / 1e9
                row[f"{key}_ms"] = timer(fn, device, quick) * 1e3
            except torch.cuda.OutOfMemoryError:
                row[f"{key}_ms"], row[f"{key}_peak_GB"] = None, "OOM"
                torch.cuda.empty_cache()
        flops = 4 * T * V * d  # logits and d hidden: the two matmuls any exact method needs
        row["TFLOPs"] = flops / (row["triton_ms"] / 1e3) / 1e12
        row["peak_share"] = row["TFLOPs"] / cal["bf16_matmul_TFLOPs"]
        print(f"logsoftmax T={T}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in row.items()), flush=True)
        rows.append(row)
        h = W = None  # frees the tensors before the next shape's (the closures hold them)
    return rows


def _fmt(v, nd=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _targets(rows: list[dict]) -> list[str]:
    """The issue's two kernel targets, read off the table (8 jobs)."""
    out = ["", "Targets (8 jobs): at 2k tokens per job at least 2x the loop (event timing: launches count); at "
           "24k tokens per job within 1.3x of the bytes bound (the CUDA graph's time where there is one: the "
           "kernels' traffic, not the host's launch gaps).", ""]
    for tpj, keys, fmt in ((2048, ("speedup",), "{:.1f}x faster"), (24576, ("x_bound_graph", "x_bound"), "{:.2f}x bound")):
        sel = [r for r in rows if r["jobs"] == 8 and r["tokens_per_job"] == tpj]
        if sel:
            key = next(k for k in keys if all(r.get(k) is not None for r in sel))
            vals = ", ".join(f"{r['shape']} r{r['rank']}: " + fmt.format(r[key]) for r in sel)
            out.append(f"- {tpj} tokens/job ({key}): {vals}")
    return out


def to_markdown(result: dict) -> str:
    cal, env = result["calibration"], result["environment"]
    out = [f"`{result['command']}`", "",
           f"{env['device']}; torch {env['torch']}, triton {env['triton']}; {env['date']}. "
           f"Measured ceilings: copy {cal['copy_GBps']:.0f} GB/s, bf16 matmul {cal['bf16_matmul_TFLOPs']:.0f} TFLOP/s.",
           "", "## Grouped LoRA, forward + backward (bf16)", "",
           "x bound: time over (compulsory bytes / copy bandwidth); compulsory bytes = 2 x T x (3 d_in + 2 d_out). "
           "loop: the torch reference (per-job loop) run eagerly.", "",
           "fused dy: dh and dB from one pass over dy (the default where policy.fuse_dy_pays); 'other' is the same "
           "step with the other choice.", "",
           "graph: the same triton step replayed as one CUDA graph (triton.testing.do_bench_cudagraph), the "
           "kernels' time without the host's launch gaps; '-' on the CPU.", "",
           "| shape | d_in->d_out | rank | jobs | tok/job | triton ms | fused dy | other ms | loop ms | speedup "
           "| TFLOP/s | % peak | GB/s (bound bytes) | x bound | graph ms | graph GB/s | x bound (graph) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["lora"]:
        out.append(f"| {r['shape']} | {r['d_in']}->{r['d_out']} | {r['rank']} | {r['jobs']} | {r['tokens_per_job']} | "
                   f"{_fmt(r['triton_ms'], 3)} | {'yes' if r['fused_dy'] else 'no'} | {_fmt(r['other_fuse_ms'], 3)} | "
                   f"{_fmt(r['loop_ms'], 3)} | {_fmt(r['speedup'], 1)} | {_fmt(r['TFLOPs'], 1)} | "
                   f"{_fmt(100 * r['peak_share'], 1)} | {_fmt(r['bound_GBps'], 0)} | {_fmt(r['x_bound'])} | "
                   f"{_fmt(r.get('graph_ms'), 3)} | {_fmt(r.get('graph_GBps'), 0)} | {_fmt(r.get('x_bound_graph'))} |")
    out += _targets(result["lora"])
    broken = [r for r in result["lora"] if r.get("kernels_us")]
    if broken:
        out += ["", "### Kernel by kernel at 8 jobs x 24k tokens", "",
                "The GPU's own durations (torch.profiler, CUPTI), microseconds per step: no host gaps and no "
                "bubbles between kernels, so their sum over the bound is the kernels' own 'x bound'. "
                "Expands: fused where policy.fuse_expand_pays (one slice, BLOCK_R <= 64, and d_in <= d_out "
                "at BLOCK_R <= 32: y written by the launch that computes h, dx by the dy pass), else in their "
                "own launches. Other: the same step with the other choice, "
                "its kernels' sum and graph time; '-' above rank 64, where they do not fuse. cuBLAS: the same "
                "six products on the same rows as one adapter (bench.dense_lora_products: no grouping, dy read "
                "twice), graph time and its x bound: what the card's own GEMMs reach on this work.", "",
                "| shape | rank | kernels us | x bound (kernels) | graph us | expands | other: kernels us "
                "| graph us | cuBLAS graph us | cuBLAS x bound | kernels, largest first (us) |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        us = lambda ms: None if ms is None else ms * 1e3  # noqa: E731
        for r in broken:
            ks = ", ".join(f"{name[:40]} {t:.0f}" for name, t in r["kernels_us"].items())
            out.append(f"| {r['shape']} | {r['rank']} | {sum(r['kernels_us'].values()):.0f} | "
                       f"{_fmt(r['x_bound_kernels'])} | {_fmt(us(r['graph_ms']), 0)} "
                       f"| {'fused' if r.get('fused_expand') else 'separate'} "
                       f"| {_fmt(r.get('kernels_us_expand_other'), 0)} "
                       f"| {_fmt(us(r.get('graph_ms_expand_other')), 0)} | {_fmt(us(r.get('cublas_graph_ms')), 0)} "
                       f"| {_fmt(r.get('x_bound_cublas'))} | {ks} |")
    out += ["", "## Base projection + LoRA, forward + backward (bf16, rank 16)", "",
            "separate: y = x W^T + grouped_lora(x); add_to: the LoRA expand accumulates into x W^T in place; "
            "base in op: grouped_lora(x, base=W) computes x W^T itself and adds dy W into the LoRA's dx in "
            "one addmm (the trainer's default). Overhead: over the base projection alone.", "",
            "| shape | jobs x tokens | base ms | separate ms | add_to ms | base in op ms | overhead separate "
            "| overhead add_to | overhead base in op |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in result["add_to"]:
        out.append(f"| {r['shape']} | {r['jobs']} x {r['tokens'] // r['jobs']} | {_fmt(r['base_ms'], 3)} | "
                   f"{_fmt(r['separate_ms'], 3)} | {_fmt(r['add_to_ms'], 3)} | {_fmt(r.get('base_in_op_ms'), 3)} | "
                   + " | ".join("-" if r.get(k) is None else f"{100 * r[k]:.0f}%"
                                for k in ("lora_overhead_separate", "lora_overhead_add_to", "lora_overhead_base_in_op"))
                   + " |")
    out += ["", "## Selective log-softmax, forward + backward (bf16)", "",
            "TFLOP/s counts the two matmuls (logits, d hidden) an exact method needs: 4 T V d.", "",
            "| T | V | triton ms | torch chunked ms | naive ms | triton peak GB | chunked peak GB | naive peak GB "
            "| TFLOP/s | % peak |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["logsoftmax"]:
        out.append(f"| {r['T']} | {r['V']} | {_fmt(r['triton_ms'], 3)} | {_fmt(r['torch_chunked_ms'], 3)} | "
                   f"{_fmt(r['naive_ms'], 3)} | {_fmt(r['triton_peak_GB'])} | {_fmt(r['torch_chunked_peak_GB'])} | "
                   f"{_fmt(r['naive_peak_GB'])} | {_fmt(r['TFLOPs'], 1)} | {_fmt(100 * r['peak_share'], 1)} |")
    if result.get("reduce"):
        out += ["", "## Segment reduction of the weight gradients (fp32 partials -> dA, dB^T in bf16)", "",
                "One reduce alone at the trainer step's micro-batch (8 jobs x 4096 tokens; tiny with --quick). before: "
                "one partial a step over whole column blocks and all rank rows (`reduce_shape`'s launch below 8 "
                "partials a job, where the H200 measured it faster); now: `reduce_shape`'s (columns x partials per "
                "step x rank rows a program). GB/s: partials read + output written, over the time now.", "",
                "| reduce | N | rank | jobs x tok/job | partials/job | before us | now us | speedup | now shape | GB/s now |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in result["reduce"]:
            out.append(f"| {r['case']} | {r['N']} | {r['rank']} | {r['jobs']} x {r['tokens_per_job']} | "
                       f"{r['partials_per_job']} | {_fmt(r['before_us'], 1)} | {_fmt(r['now_us'], 1)} | "
                       f"{_fmt(r['speedup'])} | {' x '.join(map(str, r['shape_now']))} | {_fmt(r['now_GBps'], 0)} |")

    out += tune_markdown(result.get("tune", []))
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="colora bench kernels", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench/kernels", help="writes OUT.json and OUT.md")
    p.add_argument("--quick", action="store_true", help="tiny shapes (also on the CPU, through the interpreter)")
    p.add_argument("--only", choices=["lora", "add_to", "logsoftmax", "reduce", "tune"], action="append",
                   help="run only these parts (repeatable); 'tune' (colora/bench/tune.py) runs only when named")
    p.add_argument("--tune-budget", type=float, default=480.0, metavar="S",
                   help="seconds after which the search starts no new problem (default 480)")
    args = p.parse_args(argv)

    K = interpreted_kernels()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        print("colora bench kernels: no CUDA device; only --quick runs on the CPU", file=sys.stderr)
        return 2
    import triton


    parts = set(args.only or ["lora", "add_to", "logsoftmax", "reduce"])
    t0 = time.time()
    cal = calibrate(device, args.quick)
    print(f"copy {cal['copy_GBps']:.0f} GB/s, bf16 matmul {cal['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    result = {
        "command": "colora bench kernels " + " ".join(argv),
        "environment": {"device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                                   else platform.processor() or "cpu"),
                        "torch": torch.__version__, "triton": triton.__version__,
                        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version()},
        "calibration": cal,
        "lora": bench_lora(K, cal, device, args.quick) if "lora" in parts else [],
        "add_to": bench_add_to(K, cal, device, args.quick) if "add_to" in parts else [],
        "logsoftmax": bench_logsoftmax(K, cal, device, args.quick) if "logsoftmax" in parts else [],
        "reduce": bench_reduce(K, cal, device, args.quick) if "reduce" in parts else [],
        "tune": tune_lora(K, cal, device, args.quick, args.tune_budget) if "tune" in parts else [],
    }
    result["wall_s"] = time.time() - t0
    js, md = Path(args.out + ".json"), Path(args.out + ".md")
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(result, indent=1))
    md.write_text(to_markdown(result))
    print(f"wrote {js} and {md} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
