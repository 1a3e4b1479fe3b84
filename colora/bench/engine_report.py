"""The report of `colora bench engine`: OUT.md (the tables), OUT.png (the figure) from the result
that OUT.json holds, so that OUT.md, OUT.json, OUT.png, OUT.profile.txt and OUT.sample.txt form one report folder.

- the timed step times and a line through each (active adapters, seeds) combination's batches:
  ms per step = fixed + per request x batch;
- with profiles (colora/bench/engine_profile.py): per (active adapters, batch) the profiled step,
  the GPU kernel time by family and the step thread's host time by family; then the same line per
  family and adapter count, which tells the fixed cost that grows with the active adapters (a
  family's fixed ms against K) from the cost per request (its slope);
- the figure: the timed step times against the batch per adapter count, the kernel families and
  the host families stacked per (adapters, batch).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from colora.bench.engine_profile import HOST_FAMILIES, KERNEL_FAMILIES
from colora.bench import engine_sample

FAMILY_ORDER = [f for f, _ in KERNEL_FAMILIES] + ["other"]


def line_fit(xs: list[float], ys: list[float]) -> dict:
    """ys = fixed + slope x xs, least squares: {"fixed_ms", "per_request_us"} for ys in ms and xs in
    requests; the mean and no slope with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return {"fixed_ms": float(np.mean(ys)), "per_request_us": None}
    slope, icept = np.polyfit(np.asarray(xs, dtype=float), np.asarray(ys, dtype=float), 1)
    return {"fixed_ms": float(icept), "per_request_us": float(1e3 * slope)}


def _k(k: int) -> str:
    return str(k) if k else "none"


def _ms(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{round(x, digits) + 0.0:.{digits}f}"  # + 0.0: no "-0.000"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def family_fits(profiles: list[dict]) -> list[dict]:
    """Per family (kernel families, then host families, then the profiled step) and adapter count, a
    line through the profiled batches: [{"family", "kind", "adapters", "fixed_ms", "per_request_us"}]."""
    done = [p for p in profiles if p["summary"]["steps"]]
    counts = sorted({p["adapters"] for p in done})
    kernels = [f for f in FAMILY_ORDER if any(p["summary"]["kernel_families"].get(f) for p in done)]
    series = [("kernels", f, lambda s, f=f: s["kernel_families"].get(f, 0.0)) for f in kernels]
    series += [("host", f, lambda s, f=f: s["host_families"][f]) for f in HOST_FAMILIES]
    series += [("step", "profiled step", lambda s: s["step_ms"])]
    out = []
    for kind, family, get in series:
        for k in counts:
            ps = [p for p in done if p["adapters"] == k]
            out.append({"family": family, "kind": kind, "adapters": k,
                        **line_fit([p["batch"] for p in ps], [get(p["summary"]) for p in ps])})
    return out


def to_markdown(result: dict, figure: str | None) -> str:
    env = result["environment"]
    out = ["# Engine decoding: step time against batch size and active adapters", "", "```", result["command"], "```",
           "", f"{env['device']}; vLLM {env['vllm']}, torch {env['torch']}; {env['date']}. Model `{result['model']}` "
           f"({result['dtype']}), {len(result['jobs'])} adapters loaded in {result['max_loras']} slots (ranks "
           f"{sorted(set(result['ranks']))}); every request decodes exactly {result['tokens']} tokens after a "
           f"{result['prompt']}-token prompt, a batch spread round-robin over its active adapters. Engine start "
           f"{result['engine_start_s']:.0f} s (not in any figure). Arm {result['arm']}: MPS {result['mps']}.", "",
           "## Step time", ""]
    out += _table(["active adapters", "per-request seeds", "batch", "steps", "ms per step (median)", "tokens/s",
                   "waiting"],
                  [[_k(r["adapters"]), "yes" if r["seeded"] else "no", str(r["batch"]), str(r["steps"]),
                    f"{r['ms_per_step']:.2f}", f"{r['tokens_per_s']:.0f}", f"{r['waiting']:.2f}"]
                   for r in result["rows"]])
    out += ["", "A straight line through each combination's step times (ms per step = fixed + per request x batch):",
            ""]
    out += _table(["active adapters", "per-request seeds", "fixed ms", "per request, us"],
                  [[_k(f["adapters"]), "yes" if f["seeded"] else "no", f"{f['fixed_ms']:.2f}",
                    _ms(f["per_request_us"], 1)] for f in result["fits"]])
    if figure:
        out += ["", f"![step time, kernel and host families]({figure})"]
    if result.get("profiles"):
        out += _profile_sections(result)
    if result.get("samples"):
        out += _sample_sections(result)
    return "\n".join(out) + "\n"


def _sample_sections(result: dict) -> list[str]:
    """Per sampled case, the busiest thread (vLLM's engine core's step loop where it leads) and
    the functions that take its step, by self time."""
    samples = result["samples"]
    out = ["", "## Sampling profile", "",
           "The batch of each case again, with and without per-request seeds, repeated for a few seconds while py-spy "
           "sampled vLLM's engine core and its children (no profiler ranges; colora/bench/engine_sample.py). Per case "
           "the busiest thread: its busy share of the recording, its busy ms a step, and the three functions with the "
           "most self time, ms a step. "
           f"Every case's busiest threads, self and inclusive: `{Path(samples[0]['file']).name}`.", ""]
    rows = []
    for e in samples:
        s = e["summary"]
        t = s["threads"][0] if s["threads"] else None
        top = "; ".join(f"{f.split(' (')[0]} {ms:.2f}" for f, ms in (t["self"][:3] if t else []))
        rows.append([_k(e["adapters"]), str(e["batch"]), "yes" if e["seeded"] else "no", f"{s['ms_per_step']:.2f}",
                     t["thread"] if t else "-", "-" if not t or t["busy"] is None else f"{100 * t['busy']:.0f}%",
                     f"{t['busy_ms']:.2f}" if t else "-", top or "-"])
    out += _table(["active adapters", "batch", "per-request seeds", "ms a step", "busiest thread", "busy",
                   "busy ms a step", "most self time, ms a step"], rows)
    by, names = _sample_areas(samples)
    out += ["", "The busiest thread's busy time by where its functions live (self time, ms a step; "
                "colora/bench/engine_sample.py's AREAS):", ""]
    out += _table(["active adapters", "batch", "per-request seeds"] + names,
                  [[_k(e["adapters"]), str(e["batch"]), "yes" if e["seeded"] else "no"]
                   + [f"{b.get(a, 0.0):.2f}" for a in names] for e, b in zip(samples, by)])
    return out


def _sample_areas(samples: list[dict]) -> tuple[list[dict[str, float]], list[str]]:
    """Per sampled case its busiest thread's busy ms a step by area (engine_sample.areas), and the
    areas that any case has, in AREAS order."""
    by = [engine_sample.areas(e["summary"]["threads"][0]) if e["summary"]["threads"] else {} for e in samples]
    names = [a for a, _ in engine_sample.AREAS] + [engine_sample.OTHER, engine_sample.UNLISTED]
    return by, [a for a in names if any(b.get(a) for b in by)]


def _profile_sections(result: dict) -> list[str]:
    profiles = result["profiles"]
    done = [p for p in profiles if p["summary"]["steps"]]
    out = ["", "## Profile", "",
           f"One more seeded batch per case under vLLM's torch profiler in the engine-core process, "
           f"{result['profile_steps']} decode steps recorded after {result['profile_delay']} steps (the prefill "
           "before them); figures per step, the profiler's overhead included, so the profiled step is longer than the "
           "timed one. The step thread is the one that runs `execute_model`; `untraced` is its Python outside any "
           f"operator or range (scheduling, output). Every case's top kernels, vLLM's ranges and host events, then "
           f"vLLM's own table: `{Path(profiles[0]['file']).name}`.", ""]
    out += _table(["active adapters", "batch", "steps", "ms a step", "in execute_model", "GPU busy ms", "GPU idle",
                   "kernels ms"],
                  [[_k(p["adapters"]), str(p["batch"]), str(s["steps"]), _ms(s.get("step_ms")),
                    _ms(s.get("execute_ms")), _ms(s.get("gpu_busy_ms")),
                    "-" if s.get("gpu_idle_share") is None else f"{100 * s['gpu_idle_share']:.0f}%",
                    _ms(s.get("gpu_kernel_ms"))] for p in profiles for s in [p["summary"]]])
    kernels = [f for f in FAMILY_ORDER if any(p["summary"]["kernel_families"].get(f) for p in done)]
    out += ["", "### GPU kernel time by family, ms a step", ""]
    if kernels:
        out += _table(["active adapters", "batch"] + kernels,
                      [[_k(p["adapters"]), str(p["batch"])] + [_ms(p["summary"]["kernel_families"].get(f, 0.0))
                                                               for f in kernels] for p in done])
    else:
        out += ["No GPU events in the traces (no GPU: the CPU build)."]
    out += ["", "### Host time on the step thread, ms a step", ""]
    out += _table(["active adapters", "batch"] + list(HOST_FAMILIES),
                  [[_k(p["adapters"]), str(p["batch"])] + [_ms(p["summary"]["host_families"][f]) for f in HOST_FAMILIES]
                   for p in done])
    fits = family_fits(profiles)
    counts = sorted({f["adapters"] for f in fits})
    out += ["", "### A line per family through the profiled batches: fixed ms, us per request", "",
            "A fixed cost that grows with the active adapters is a family whose fixed ms grows along the row; the cost "
            "per request is its slope.", ""]
    rows = {}
    for f in fits:
        rows.setdefault((f["kind"], f["family"]), {})[f["adapters"]] = f
    out += _table(["kind", "family"] + [f"{_k(k)} active" for k in counts],
                  [[kind, fam] + [f"{_ms(by[k]['fixed_ms'])} + {_ms(by[k]['per_request_us'], 2)}" if k in by else "-"
                                  for k in counts] for (kind, fam), by in rows.items()])
    return out


def write_figure(result: dict, path: Path) -> None:
    """The timed (seeded) step time against the batch per adapter count with its line; with
    profiles, the kernel families and the host families stacked per (adapters, batch); with
    samples, the engine core's busy ms a step by area (engine_sample.AREAS) per sampled case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [p for p in result.get("profiles", []) if p["summary"]["steps"]]
    samples = [e for e in result.get("samples", []) if e["summary"]["threads"]]
    widths = [6.0] + [5.5, 5.5] * bool(done) + [max(5.5, 0.8 * len(samples))] * bool(samples)
    fig, axes = plt.subplots(1, len(widths), figsize=(sum(widths), 5), layout="constrained", squeeze=False,
                             width_ratios=widths)
    axes = list(axes[0])
    ax = axes.pop(0)
    for f in result["fits"]:
        if not f["seeded"]:
            continue
        rows = sorted((r for r in result["rows"] if r["adapters"] == f["adapters"] and r["seeded"]),
                      key=lambda r: r["batch"])
        xs = [r["batch"] for r in rows]
        line = ax.plot(xs, [r["ms_per_step"] for r in rows], "o", label=f"{_k(f['adapters'])} active")[0]
        if f["per_request_us"] is not None:
            ax.plot(xs, [f["fixed_ms"] + 1e-3 * f["per_request_us"] * x for x in xs], "-", color=line.get_color(),
                    lw=1)
    ax.set(title="timed step (seeded), median; lines: fixed + per request", xlabel="requests in the batch",
           ylabel="ms per engine step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    cmap = plt.get_cmap("tab20")
    if done:
        kernels = [f for f in FAMILY_ORDER if any(p["summary"]["kernel_families"].get(f) for p in done)]
        for ax, title, families, key in ((axes.pop(0), "GPU kernel time by family (profiled)", kernels,
                                          "kernel_families"),
                                         (axes.pop(0), "host time on the step thread (profiled)", list(HOST_FAMILIES),
                                          "host_families")):
            _stack(ax, [[p["summary"][key].get(fam, 0.0) for p in done] for fam in families], families,
                   [p["summary"]["step_ms"] for p in done], "profiled step",
                   [f"{_k(p['adapters'])}\n{p['batch']}" for p in done], cmap)
            if not families:
                ax.text(0.5, 0.5, "no GPU events (no GPU)", ha="center", va="center", transform=ax.transAxes)
            ax.set(title=title, xlabel="active adapters / batch")
    if samples:
        ax = axes.pop(0)
        by, names = _sample_areas(samples)
        _stack(ax, [[b.get(a, 0.0) for b in by] for a in names], names, [e["summary"]["ms_per_step"] for e in samples],
               "step while sampled", [f"{_k(e['adapters'])}/{e['batch']}\n{'seeded' if e['seeded'] else 'unseeded'}"
                                      for e in samples], cmap)
        ax.set(title="busiest thread's busy time by area (py-spy)", xlabel="active adapters / batch")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _stack(ax, heights: list[list[float]], labels: list[str], total: list[float], total_label: str,
           ticks: list[str], cmap) -> None:
    """Stacked bars, one series per label, and each bar's total as a mark."""
    bottom = [0.0] * len(ticks)
    for i, (ys, label) in enumerate(zip(heights, labels)):
        ax.bar(range(len(ticks)), ys, 0.7, bottom=bottom, color=cmap((2 * i) % 20 + (2 * i) // 20), label=label)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.plot(range(len(ticks)), total, "k_", ms=18, mew=2, label=total_label)
    ax.set_xticks(range(len(ticks)), ticks, fontsize=7)
    ax.set(ylabel="ms per step")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
