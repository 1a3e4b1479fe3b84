"""A search over the grouped-LoRA launchers' parameters on the device: `colora bench kernels --only tune`.

    colora bench kernels --only tune --out runs/bench/lora_tune  (H200: a few minutes; --tune-budget)

For each problem (8 jobs x 24k tokens at rank 64, where every projection's forward+backward stays
above 1.3x the bytes bound on the H200: 1.34-1.55x at 6c75111; and k/v at rank 16, within it, as the
control) and each launcher of `SEARCHED`, the LoRA step runs with one candidate configuration for that
launcher (grouped_lora's launch=) while the others keep the device table's, timed by the sum of the GPU's
own kernel durations (`measure.kernel_times`: no host gaps). Then the best of each launcher together, also
replayed as one CUDA graph, against the bytes bound. A candidate that does not compile or run (too much
shared memory, say) is recorded with its error. Past --tune-budget seconds no further candidate or problem
is started (`python -m colora.bench.compile_check --tune` compiles the candidates for sm_90a on a CPU
machine first).

A search, not a change: the device's table (kernels/lora/configs/<GPU>.json) changes when a report shows a
gain. With --quick (the CPU's interpreter) it runs tiny problems and two candidates per launcher, to test the
plumbing; its times mean nothing.
"""

from __future__ import annotations

import time

import torch

from colora.bench.measure import graph_timer, kernel_breakdown, lora_problem, timer
from colora.kernels.lora.policy import TUNABLE, fuse_dy_pays

SEARCHED = ("shrink", "dy_pass", "expand", "sgrad")  # the launchers searched (TUNABLE's stream launches not)

# The candidates of each launcher; the baseline is the device's table (kernels/lora/configs).
# (block_m, block_k, warps, stages[, block_n2: the fused expand's columns]) of the shrink
_SHRINK = [(64, 64, 4, 4), (64, 128, 4, 3), (64, 128, 8, 4), (64, 256, 4, 3), (64, 256, 8, 3),
           (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3, 32), (64, 128, 4, 3, 128),
           (128, 64, 8, 3, 64), (128, 128, 8, 3, 128)]
# the same of the fused dy pass (policy.fuse_dy_pays)
_DY_PASS = [(256, 32, 4, 3), (256, 32, 8, 4), (256, 64, 4, 3), (256, 64, 8, 2), (256, 128, 8, 2),
            (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (512, 32, 8, 3), (512, 64, 8, 2),
            (256, 64, 8, 3, 32), (256, 64, 8, 3, 128)]
# (block_t, block_n, warps, stages, chunk or None for policy.sgrad_chunk's) of the expand
_EXPAND = [(32, 128, 4, 3, None), (64, 64, 4, 3, None), (64, 256, 8, 3, None), (128, 128, 8, 3, None),
           (64, 128, 8, 3, None), (64, 128, 4, 2, None), (64, 128, 4, 4, None), (64, 128, 4, 3, 2048),
           (64, 128, 4, 3, 8192)]
# the same of the sgrad
_SGRAD = [(32, 128, 4, 3, None), (64, 64, 4, 3, None), (64, 256, 8, 3, None), (128, 128, 8, 3, None),
          (64, 128, 8, 4, None), (128, 64, 4, 3, None), (64, 128, 4, 4, None), (64, 128, 4, 3, 2048),
          (64, 128, 4, 3, 8192)]


def candidates(kernel: str, quick: bool) -> list[dict]:
    """The configurations tried for `kernel` (one of SEARCHED), as parameters of policy.TUNABLE[kernel]."""
    if quick:  # small blocks the interpreter runs in seconds
        grids = {"shrink": [(64, 32, 4, 2), (128, 16, 4, 2)], "dy_pass": [(64, 16, 4, 2), (128, 32, 4, 2)],
                 "expand": [(32, 16, 4, 2, 256), (64, 32, 4, 2, None)],
                 "sgrad": [(32, 16, 4, 2, 256), (64, 32, 4, 2, None)]}
    else:
        grids = {"shrink": _SHRINK, "dy_pass": _DY_PASS, "expand": _EXPAND, "sgrad": _SGRAD}
    return [{k: v for k, v in zip(TUNABLE[kernel], cfg) if v is not None} for cfg in grids[kernel]]


def problems(quick: bool) -> list[tuple[str, int, int, int, int, int]]:
    """(name, d_in, d_out, rank, jobs, tokens per job)."""
    if quick:
        return [("tiny r16", 64, 48, 16, 4, 48)]
    return [("k/v r64", 1024, 1024, 64, 8, 24576), ("q r64", 1024, 2048, 64, 8, 24576),
            ("gate/up r64", 1024, 3072, 64, 8, 24576), ("o r64", 2048, 1024, 64, 8, 24576),
            ("down r64", 3072, 1024, 64, 8, 24576), ("k/v r16", 1024, 1024, 16, 8, 24576)]


def _step_us(step, device: torch.device) -> float:
    """Microseconds of one call of `step`: the sum of its kernels' GPU durations on CUDA; on the CPU
    the benchmark's wall-time median (the interpreter: plumbing only)."""
    if device.type == "cuda":
        return sum(kernel_breakdown(step, device).values())
    return timer(step, device, quick=True) * 1e6


def _trial(step, device, launch: dict) -> tuple[float | None, str | None]:
    """(us, None) of step(launch), or (None, the error) where that launch cannot compile or run."""
    try:
        return _step_us(lambda: step(launch), device), None
    except Exception as e:  # a configuration that cannot compile or run: recorded, the search goes on
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def tune_lora(K, cal: dict, device: torch.device, quick: bool, budget_s: float = 480.0) -> list[dict]:
    rows, t_start = [], time.time()
    for name, d_in, d_out, rank, J, tpj in problems(quick):
        if time.time() - t_start > budget_s:
            print(f"tune: past the {budget_s:.0f} s budget, {name} and later problems not searched", flush=True)
            break
        meta, x, A, B, dy = lora_problem(K, J, tpj, rank, d_in, d_out, device, seed=J * 7 + rank)

        def step(launch):
            y = K.grouped_lora(x, A, B, meta=meta, backend="triton", launch=launch)
            torch.autograd.grad(y, (x, A, B), dy)

        bound_s = 2 * J * tpj * (3 * d_in + 2 * d_out) / (cal["copy_GBps"] * 1e9)
        default_us, err = _trial(step, device, {})
        if err is not None:
            raise RuntimeError(f"tune {name}: the launchers' own configuration failed: {err}")
        trials, best = [], {}
        # the fused dy pass runs where fuse_dy_pays; the plain shrink takes dh there otherwise
        for kernel in (k for k in SEARCHED if k != "dy_pass" or fuse_dy_pays(meta, d_in, d_out, x.dtype)):
            for cfg in candidates(kernel, quick):
                if time.time() - t_start > budget_s:
                    break
                us, err = _trial(step, device, {kernel: cfg})
                trials.append({"kernel": kernel, "config": cfg, "us": us, "error": err})
                if us is not None and us < best.get(kernel, {}).get("us", default_us):
                    best[kernel] = {"config": cfg, "us": us}
        combined = {k: v["config"] for k, v in best.items()}
        combined_us, combined_err = _trial(step, device, combined)
        graph = {}
        for label, launch in (("default", {}), ("combined", combined)):
            t = graph_timer(lambda: step(launch), device, quick)
            graph[label] = None if t is None else t * 1e3
        row = {"problem": name, "d_in": d_in, "d_out": d_out, "rank": rank, "jobs": J, "tokens_per_job": tpj,
               "default_us": default_us, "trials": trials, "best": best, "combined_us": combined_us,
               "combined_error": combined_err, "default_graph_ms": graph["default"],
               "combined_graph_ms": graph["combined"], "bound_ms": bound_s * 1e3}
        rows.append(row)
        print(f"tune {name}: kernels {default_us:.0f} us own -> {combined_us if combined_us is None else round(combined_us)}"
              f" us with {combined}" + ("" if graph["default"] is None else
                                       f"; graph {graph['default']:.3f} -> {graph['combined'] or float('nan'):.3f} ms, "
                                       f"bound {bound_s * 1e3:.3f} ms"), flush=True)
        x = A = B = dy = None  # frees the tensors before the next problem's (the closures hold them)
    return rows


def to_markdown(rows: list[dict]) -> list[str]:
    """The tuning section of the benchmark's Markdown."""
    if not rows:
        return []

    def fmt(v, nd=0):
        return "-" if v is None else f"{v:.{nd}f}"

    out = ["", "## Launch parameters searched (colora/bench/tune.py)", "",
           "Kernels us: the LoRA forward+backward's summed GPU kernel durations with one launcher's candidate "
           "(the others their own choice); own: every launcher its own choice. Graph ms: the step replayed as "
           "a CUDA graph; x bound: graph time over the bytes bound.", "",
           "| problem | own kernels us | launcher | best config | best kernels us | gain | failed candidates |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        for kernel in sorted({t["kernel"] for t in r["trials"]}):
            failed = sum(1 for t in r["trials"] if t["kernel"] == kernel and t["error"])
            b = r["best"].get(kernel)
            config, us, gain = ("own", None, "-") if b is None else (b["config"], b["us"], f"{r['default_us'] / b['us']:.3f}x")
            out.append(f"| {r['problem']} | {fmt(r['default_us'])} | {kernel} | {config} | {fmt(us)} | {gain} | {failed} |")
    out += ["", "| problem | own kernels us | best together us | own graph ms | together graph ms | bound ms "
            "| x bound own | x bound together |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        xb = [None if g is None else g / r["bound_ms"] for g in (r["default_graph_ms"], r["combined_graph_ms"])]
        out.append(f"| {r['problem']} | {fmt(r['default_us'])} | {fmt(r['combined_us'])} | "
                   f"{fmt(r['default_graph_ms'], 3)} | {fmt(r['combined_graph_ms'], 3)} | {fmt(r['bound_ms'], 3)} | "
                   f"{fmt(xb[0], 2)} | {fmt(xb[1], 2)} |")
    return out
