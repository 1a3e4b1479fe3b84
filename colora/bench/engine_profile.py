"""One vLLM torch-profiler trace of the engine core's decode steps, summarised per step: where the
GPU's time goes (kernels by family and by name), where the host's goes (the thread that runs the
steps, by kind of event), and how much of the step the GPU idles waiting for the host.

The trace is the Chrome-trace JSON (gzipped or not) that vLLM's worker writes, in the engine-core
process, at the end of a profiling session (`profiler_config.profiler = "torch"`). vLLM marks each
worker step's `execute_model` with a range named `execute_context_<requests>(<tokens>)_generation_
<requests>(<tokens>)`. The window runs from the start of the first decode-only range
(`execute_context_0(0)`) to the start of the last (of the first `steps` + 1 where `steps` is
given): n such ranges make n - 1 whole steps, each with its scheduling, its sampling call and its
output around `execute_model` (the profiled batch prefills before the profiler's delay ends, so no
prefill step lies inside). Times are per step, the window's totals divided by its steps; an event
belongs to the window when it starts inside it.

- kernels: GPU events (kernels, copies, memsets) summed by name and by family (KERNEL_FAMILIES:
  first pattern that matches the name);
- gpu_busy_ms: the union of the GPU events' intervals clipped to the window; gpu_idle_share =
  1 - busy / window, the share of the step the GPU has nothing to run. None without GPU events
  (the CPU build);
- host, on the step thread (the one that runs `execute_model`): every event's self time (its
  duration less its direct children's), by family (HOST_FAMILIES), plus `untraced`, the rest of
  the step: Python outside any operator or range (with stack tracing off). The families and
  `untraced` add up to the step. `execute_ms`: the time inside `execute_model` ranges; the rest is
  the engine core's loop around it;
- ranges: vLLM's annotated ranges on the step thread (its `schedule: ...` and `gpu_model_runner:
  ...` scopes, recorded with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1), inclusive time;
- host_top: host events of every thread by self time.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function"})
# (family, pattern on the kernel's name, case-insensitive), first match wins: LoRA before GEMMs (its
# Triton kernels are GEMMs too), attention, the runner's input kernels and sampling before the
# generic families. A name none matches is "other".
KERNEL_FAMILIES = (
    ("LoRA", r"lora|punica|sgmv|bgmv"),
    ("attention", r"flash|attn|attention|fmha|paged|reshape_and_cache|concat_and_cache"),
    ("step inputs", r"prepare|slot_mapping|block_table|seq_lens|idx_mapping|post_update|combine_sampled|bincount"),
    ("sampling", r"gumbel|topk|top_k|top_p|min_p|temperature|penalt|softmax|logprob|argmax|sampl|exponential"
                 r"|multinomial|radix|sort"),
    ("GEMM", r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|splitk"),
    ("compiled fusions", r"^triton_(poi|red|per)_"),  # torch.compile's (Inductor's) fused elementwise kernels
    ("norm", r"norm"),
    ("activation", r"silu|gelu|act_and_mul|swiglu"),
    ("rotary", r"rotary|rope"),
    ("copies", r"memcpy|memset|copy|index|gather|scatter|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|reduce"),
)
HOST_FAMILIES = ("waiting on the GPU", "CUDA launches and runtime", "operators", "Python in ranges", "untraced")
SYNC = re.compile(r"synchronize", re.I)  # cudaStreamSynchronize, cudaEventSynchronize, cuStreamSynchronize...


def kernel_family(name: str) -> str:
    for family, pattern in KERNEL_FAMILIES:
        if re.search(pattern, name, re.I):
            return family
    return "other"


def host_family(event: dict) -> str:
    cat = event.get("cat")
    if cat in ("cuda_runtime", "cuda_driver"):
        return "waiting on the GPU" if SYNC.search(event["name"]) else "CUDA launches and runtime"
    return "operators" if cat == "cpu_op" else "Python in ranges"


def load_trace(path: str | Path) -> list[dict]:
    """The complete events ("ph": "X", with ts and dur in microseconds) of a Chrome trace."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def decode_ranges(events: list[dict]) -> list[dict]:
    """The worker's decode-only step ranges, in time order."""
    return sorted((e for e in events if e.get("cat") == "user_annotation" and (m := STEP.match(e.get("name", "")))
                   and m.group(1) == "0" and int(m.group(3)) > 0), key=lambda e: e["ts"])


def union_length(intervals: list[tuple[float, float]]) -> float:
    """The total length covered by [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """(event, self time in us) for host events: an event's duration less its direct children's
    (events on the same pid and tid that start inside it), clipped at zero."""
    out: list[tuple[dict, float]] = []
    threads: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        threads[(e.get("pid"), e.get("tid"))].append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, its self time so far]
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= e["ts"]:
                out.append(tuple(stack.pop()))
            if stack:
                parent = stack[-1]
                parent[1] -= min(e["dur"], parent[0]["ts"] + parent[0]["dur"] - e["ts"])
            stack.append([e, float(e["dur"])])
        out.extend(tuple(s) for s in reversed(stack))
    return [(e, max(own, 0.0)) for e, own in out]


def _by_name(pairs, n: int, top: int) -> list[dict]:
    """[(name, us)] summed by name -> the `top` largest as per-step rows."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, us in pairs:
        acc[name][0] += us
        acc[name][1] += 1
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": k, "ms_per_step": 1e-3 * v[0] / n, "calls_per_step": v[1] / n} for k, v in rows]


def summarize(events: list[dict], steps: int | None = None, top: int = 15) -> dict:
    """The window's per-step figures over at most `steps` steps (module docstring); {"steps": 0}
    without two decode ranges."""
    ranges = decode_ranges(events)[:None if steps is None else steps + 1]
    if len(ranges) < 2:
        return {"steps": 0}
    t0, t1, n = ranges[0]["ts"], ranges[-1]["ts"], len(ranges) - 1
    inside = [e for e in events if t0 <= e["ts"] < t1]
    per_step = 1e-3 / n  # us in the window -> ms per step
    gpu = [e for e in inside if e.get("cat") in GPU_CATS]
    families: dict[str, float] = defaultdict(float)
    for e in gpu:
        families[kernel_family(e["name"])] += e["dur"] * per_step
    busy = union_length([(e["ts"], min(e["ts"] + e["dur"], t1)) for e in gpu])
    host = [e for e in inside if e.get("cat") in HOST_CATS]
    selfs = self_times(host)
    thread = (ranges[0].get("pid"), ranges[0].get("tid"))
    host_families = dict.fromkeys(HOST_FAMILIES, 0.0)
    for e, own in selfs:
        if (e.get("pid"), e.get("tid")) == thread:
            host_families[host_family(e)] += own * per_step
    step_ms = (t1 - t0) * per_step
    host_families["untraced"] = max(0.0, step_ms - sum(host_families.values()))
    on_thread = [e for e in host if (e.get("pid"), e.get("tid")) == thread and e.get("cat") == "user_annotation"]
    return {
        "steps": n, "step_ms": step_ms,
        "gpu_busy_ms": busy * per_step if gpu else None,
        "gpu_idle_share": 1.0 - busy / (t1 - t0) if gpu else None,
        "gpu_kernel_ms": sum(families.values()) if gpu else None,
        "kernel_families": dict(sorted(families.items(), key=lambda kv: -kv[1])),
        "kernels": _by_name(((e["name"], e["dur"]) for e in gpu), n, top),
        "execute_ms": sum(e["dur"] for e in on_thread if STEP.match(e["name"])) * per_step,
        "host_families": host_families,
        "ranges": _by_name(((e["name"], e["dur"]) for e in on_thread if not STEP.match(e["name"])), n, top),
        "host_top": _by_name(((e["name"], own) for e, own in selfs), n, top),
    }


def to_text(summary: dict, title: str) -> str:
    """The summary as fixed-width tables under a title line."""
    if not summary["steps"]:
        return f"{title}\nfewer than two decode steps in the trace\n"
    s = summary
    lines = [title, f"{s['steps']} decode steps, {s['step_ms']:.3f} ms a step (profiled), {s['execute_ms']:.3f} ms "
             "of it in execute_model; GPU "
             + ("events: none (no GPU)" if s["gpu_busy_ms"] is None else
                f"busy {s['gpu_busy_ms']:.3f} ms, idle {100 * s['gpu_idle_share']:.1f}% of the step, kernels "
                f"{s['gpu_kernel_ms']:.3f} ms"), ""]
    lines += ["GPU kernel families, ms a step: " + ", ".join(f"{k} {v:.4f}" for k, v in s["kernel_families"].items()),
              "host, the step thread, ms a step: " + ", ".join(f"{k} {v:.4f}" for k, v in s["host_families"].items()),
              ""]
    for key, head in (("kernels", "GPU kernels by total time"), ("ranges", "vLLM's ranges on the step thread, "
                      "inclusive"), ("host_top", "host events of every thread by self time")):
        lines += [f"{head}:", f"{'ms/step':>9} {'calls/step':>10}  name"]
        lines += [f"{r['ms_per_step']:9.4f} {r['calls_per_step']:10.2f}  {r['name'][:140]}" for r in s[key]]
        lines += ["" if s[key] else "(none)", ""]
    return "\n".join(lines)
