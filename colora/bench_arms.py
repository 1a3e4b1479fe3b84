"""Benchmark every arm of one workload on one GPU, each beside the dedicated baseline of its seed.

    colora bench arms experiments/reference8_throughput.toml --seeds 1 2 3 --out reports/arms

Child processes, one engine each (vLLM's start is 80-160 s on the H200): one runs the arms without
MPS (dedicated, shared_sync, overlap) and one started with MPS runs the MPS arms (mps, overlap_mps),
since whether a process is an MPS client, and with what share of the SMs, is fixed when it makes its
CUDA context (a tuning sweep over the MPS percentages gets one MPS process per setting). Runs of a
process share its engine (`engine.max_loras` must cover the largest job count).
`--jobs 2 4 16` also runs the headline arm with that many jobs (the config's jobs repeated with new
names); their baseline is the dedicated throughput of the seed's base workload, since a dedicated
job runs alone whatever the number of jobs (stated in the report). `--vary KEY=V1,V2` runs the
headline arm once per value (the tuning sweep); `--vary env:NAME=V1,V2` does so with one of colora's
switches that are environment variables (VARY_ENV), set for that run alone; `--vary K1=V1+K2=V2`
runs it once with several settings together.

Writes OUT.json (every run's summary and the ratios) and OUT.md (tables that open with the command),
and the run directories under --runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import python_m
from .compilewatch import describe
from .config import Config, load_config, replace

NON_MPS = ("dedicated", "shared_sync", "overlap")
MPS = ("mps", "overlap_mps")


def scaled_jobs(cfg: Config, n: int) -> list[str]:
    """Overrides that make the workload `n` jobs: the config's jobs cycled, renamed `<name>-<k>`."""
    base = cfg.to_dict()["jobs"]
    jobs = []
    for k in range(n):
        j = dict(base[k % len(base)])
        j["name"] = j["name"] if k < len(base) else f"{j['name']}-{k // len(base)}"
        jobs.append(j)
    return jobs


def with_jobs(cfg: Config, n: int) -> Config:
    from .config import resolve

    d = cfg.to_dict()
    d["jobs"] = scaled_jobs(cfg, n)
    return resolve(d)


def plan(cfg: Config, args) -> list[dict]:
    """Every run of the benchmark: (arm, seed, jobs, overrides, label).

    The main arms of every seed come first, then the job-count runs, then the tuning sweep: each batch
    (without and with MPS) runs in this order, so a deadline cuts the extras before a seed's headline.
    """
    runs = []
    for seed in args.seeds:
        for arm in args.arms:
            ded = [f"experiment.steps={args.dedicated_steps}"] if arm == "dedicated" and args.dedicated_steps else []
            runs.append({"arm": arm, "seed": seed, "jobs": len(cfg.jobs), "set": ded, "label": "main"})
    for seed in args.seeds:
        for n in args.jobs:
            if n != len(cfg.jobs):
                for arm in args.scale_arms or [args.headline]:
                    runs.append({"arm": arm, "seed": seed, "jobs": n, "set": [], "label": f"jobs{n}"})
    for spec in args.vary:
        for sets, env, label in vary_runs(spec):
            runs.append({"arm": args.headline, "seed": args.seeds[0], "jobs": len(cfg.jobs), "set": sets,
                         "label": label, **({"env": env} if env else {})})
    return runs


# The environment switches `--vary env:NAME=...` may set per run: read when a run starts, and part
# of the engine cache's key where they shape the engine (COLORA_VLLM_SAMPLER is not: it is left out).
# VLLM_TUNED_CONFIG_FOLDER is vLLM's (its LoRA kernels' tuned block sizes, `colora bench vllm-lora`).
VARY_ENV = ("COLORA_RELOAD_FIRST", "COLORA_ENGINE_PROCESS", "COLORA_PACKED_ROWS", "COLORA_ELEMENTWISE_KERNELS",
            "COLORA_BASE_IN_LORA", "VLLM_TUNED_CONFIG_FOLDER")


def vary_runs(spec: str) -> list[tuple[list[str], dict[str, str], str]]:
    """The headline runs of one `--vary` spec, as (config overrides, environment switches, label).

    KEY=V1,V2,...: one run per value. KEY=V+KEY2=V2+...: one run with every setting at once (each
    with one value), e.g. `env:COLORA_PACKED_ROWS=1+trainer.micro_batch_tokens=65536`: settings that
    only pay together. A KEY of env:NAME sets the environment switch NAME (one of VARY_ENV)."""
    parts = re.split(r"\+(?=[A-Za-z_][\w.:]*=)", spec)
    pairs = []
    for part in parts:
        key, sep, values = part.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--vary {spec}: {part!r} is not KEY=VALUE")
        if key.startswith("env:") and key[len("env:"):] not in VARY_ENV:
            raise ValueError(f"--vary {spec}: {key[len('env:'):]} is not one of the switches a run can vary: "
                             f"{', '.join(VARY_ENV)}")
        pairs.append((key, values.split(",")))
    if len(pairs) > 1 and any(len(vs) > 1 for _, vs in pairs):
        raise ValueError(f"--vary {spec}: settings joined by + take one value each")
    combos = [[(k, v)] for k, vs in pairs for v in vs] if len(pairs) == 1 else [[(k, vs[0]) for k, vs in pairs]]
    out = []
    for combo in combos:
        sets = [f"{k}={v}" for k, v in combo if not k.startswith("env:")]
        env = {k[len("env:"):]: v for k, v in combo if k.startswith("env:")}
        out.append((sets, env, "vary:" + "+".join(f"{k}={v}" for k, v in combo)))
    return out


@contextlib.contextmanager
def run_env(env: dict[str, str]):
    """The run's environment switches set for the block, the previous values back after it."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def batches(config: str, overrides: list[str], runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """The child processes, in order: one for the runs without MPS, then one per distinct pair of MPS
    thread percentages (engine, trainer). CUDA reads a process's percentage once, when it makes its
    context, so runs that vary it (`--vary overlap.mps_trainer_percentage=...`) cannot share a
    process (nor, for the engine's, an engine). In each process the runs whose engine client is
    in-process come first (`_client_apart`)."""
    out: list[tuple[str, list[dict]]] = [("plain", [r for r in runs if r["arm"] in NON_MPS])]
    by_share: dict[tuple[int, int], list[dict]] = {}
    for r in runs:
        if r["arm"] in MPS:
            ov = load_config(config, [*overrides, *r["set"]]).overlap
            by_share.setdefault((ov.mps_engine_percentage, ov.mps_trainer_percentage), []).append(r)
    out += [("mps", rs) for rs in by_share.values()]
    return [(kind, sorted(rs, key=_client_apart)) for kind, rs in out if rs]


def _client_apart(r: dict) -> bool:
    """Whether a run's engine client runs in a process of its own (its engine's cache key). A
    process keeps one engine on a GPU (runner.EngineCache), so a batch runs the in-process runs
    first and then the others, each kind's runs in plan order, and starts at most two engines
    however many seeds it holds. (A sweep run that brings the client in, `--vary
    env:COLORA_ENGINE_PROCESS=0`, so runs before the headline arm's main runs.)"""
    from .engine import engine_process_from_env

    with run_env(r.get("env", {})):
        return engine_process_from_env(r["arm"])


def child_env(kind: str, batch: list[dict], config: str, overrides: list[str]) -> dict[str, str]:
    """The environment of a batch's process. An MPS batch's process starts with its trainer's share
    (`batches` gives each share pair a process of its own): CUDA fixes a process's share when it
    first initialises there, so nothing the process does before the runner claims its context can
    give it another."""
    env = dict(os.environ)
    if kind == "mps":
        ov = load_config(config, [*overrides, *batch[0]["set"]]).overlap
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(ov.mps_trainer_percentage)
    return env


def run_dir(root: Path, r: dict) -> Path:
    tag = r["label"].replace(":", "-").replace("=", "-").replace("/", "-")
    return root / r["arm"] / f"seed{r['seed']}-{tag}"


def run_seconds(r: dict, root: Path, starts_engine: bool) -> float | None:
    """About how long run `r` will take, from the finished runs under `root` (their summaries'
    wall time): the median of the same arm's runs at the same job count, else of every run at that
    job count, plus the longest engine start seen if `r` starts an engine; None before any run of
    its job count has finished."""
    walls, same, starts = [], [], []
    for f in root.glob("*/*/summary.json"):
        s = json.loads(f.read_text())
        start = 0.0 if s.get("engine_reused") else s.get("engine_start_s", 0.0)
        starts.append(start)
        if len(s.get("jobs", ())) == r["jobs"]:
            walls.append(s["wall_s"] - start)
            if s.get("arm") == r["arm"]:
                same.append(s["wall_s"] - start)
    if not walls:
        return None
    return statistics.median(same or walls) + (max(starts) if starts_engine else 0.0)


def run_batch(config: str, overrides: list[str], runs: list[dict], root: Path, mps_process: bool,
              stop_by: float | None = None) -> None:
    """Run `runs` in this process with one shared engine (and, for the MPS batch, one daemon).
    stop_by: the time (time.time()) by which the benchmark's deadline stops this process; a run
    that would not end by then (`run_seconds`) is not started, so a deadline cuts no run half way
    and the device is handed back sooner: the next call with the same --runs runs it."""
    from .mps import MpsDaemon, MpsUnavailable
    from .runner import EngineCache, RunError, run

    base = load_config(config, overrides)
    cache = EngineCache()
    daemon = None
    try:
        if mps_process:
            try:
                daemon = MpsDaemon.attached()  # started by the parent, before this process existed
            except MpsUnavailable as e:
                if base.overlap.mps_required:
                    raise RunError(f"the MPS arms need MPS, which is unavailable here ({e}); set "
                                   "overlap.mps_required=false to run them without MPS, labelled so") from None
                print(f"warning: MPS unavailable ({e}); the MPS arms run without it, labelled so", flush=True)
                daemon = None
        engines: set[bool] = set()  # the client kinds whose engine this process has started
        for i, r in enumerate(runs):
            out = run_dir(root, r)
            if (out / "summary.json").exists():
                print(f"[{i + 1}/{len(runs)}] {out} done already", flush=True)
                continue
            apart = _client_apart(r)
            need = run_seconds(r, root, apart not in engines)
            if stop_by is not None and need is not None and time.time() + need > stop_by:
                print(f"[{i + 1}/{len(runs)}] {r['arm']} seed {r['seed']} jobs {r['jobs']} {r['label']}: not "
                      f"started, it needs about {need:.0f} s and the deadline comes in "
                      f"{stop_by - time.time():.0f} s", flush=True)
                continue
            engines.add(apart)
            if out.exists():  # an unfinished run (deadline, crash): keep it aside, run it again
                n = 0
                while out.with_name(f"{out.name}.incomplete-{n}").exists():
                    n += 1
                out.rename(out.with_name(f"{out.name}.incomplete-{n}"))
            cfg = with_jobs(base, r["jobs"]) if r["jobs"] != len(base.jobs) else base
            cfg = replace(cfg, [f"experiment.arm={r['arm']}", f"experiment.seed={r['seed']}", *r["set"]])
            print(f"[{i + 1}/{len(runs)}] {r['arm']} seed {r['seed']} jobs {r['jobs']} {r['label']}", flush=True)
            t0 = time.perf_counter()
            with run_env(r.get("env", {})):
                s = run(cfg, out, engine_cache=cache, process_mps=daemon, log=lambda m: print("   ", m, flush=True))
            print(f"    {s['steps_per_hour']:.0f} steps/h ({time.perf_counter() - t0:.0f}s)", flush=True)
    finally:
        cache.close()
        if daemon is not None:
            print(f"MPS daemon: {daemon.stop()}", flush=True)


PHASES = ("generate", "handoff", "train", "export", "reload")


def phase_stats(spans: list[dict], window: dict) -> dict:
    """Median and largest duration of each phase whose span starts inside the measured window(s).
    `handoff`: from the trainer handing a group to the engine thread to that thread taking it up."""
    ws = window.get("windows") or [window]
    inside = [s for s in spans if any(w["start"] <= s["start"] < w["end"] for w in ws if w.get("seconds"))]
    out: dict = {}
    for ph in PHASES:
        if ph == "handoff":
            d = [s["start"] - s["queued"] for s in inside if s["phase"] == "generate" and "queued" in s]
        else:
            d = [s["end"] - s["start"] for s in inside if s["phase"] == ph]
        if d:
            out[ph] = {"n": len(d), "median": statistics.median(d), "max": max(d)}
    rate = engine_rate(inside)
    if rate:
        out["engine"] = rate
    chain = group_chain(inside)
    if chain:
        out["chain"] = chain
    if "train" in out:
        # a training step far beyond the others (a compile, a stall): it counts in the throughput
        med = out["train"]["median"]
        slow = [s for s in inside if s["phase"] == "train" and s["end"] - s["start"] > max(3 * med, med + 1.0)]
        out["train_outliers"] = [round(s["end"] - s["start"], 3) for s in slow]
        if any(s.get("compiles") for s in slow):  # what compiled in each (timelines since compilewatch)
            out["train_outlier_compiles"] = [s.get("compiles", {}) for s in slow]
    return out


def _trained_groups(span: dict) -> list[int]:
    """The groups a train span trained: one step may train several ready groups at once, and its
    span then has group -1 and lists them."""
    return span.get("groups") or ([span["group"]] if span.get("group", -1) >= 0 else [])


def group_chain(spans: list[dict]) -> dict:
    """A group's cycle, the mean time between its successive training steps, beside the means of the
    phases it chains in series (generate, then train, then export of the new adapters; the group's
    next generation waits for that export) and of its wait between generating and training (while the
    trainer trains another group). Where the cycle is about their sum, the chain is what
    bounds the throughput and the phase that grew against the dedicated arm is the one to cut. Over
    the groups that trained at least twice in `spans`; {} for fewer than two groups (one group has no
    offset phases to compare)."""
    trains = sorted((s for s in spans if s["phase"] == "train"), key=lambda s: s["end"])
    ends: dict[int, list[float]] = {}
    for s in trains:
        for g in _trained_groups(s):
            ends.setdefault(g, []).append(s["end"])
    cycles = [b - a for e in ends.values() for a, b in zip(e, e[1:])]
    if len(ends) < 2 or not cycles:
        return {}
    out = {"groups": len(ends), "cycle": statistics.fmean(cycles)}
    for ph in ("generate", "train", "export"):
        d = [s["end"] - s["start"] for s in spans if s["phase"] == ph]
        out[ph] = statistics.fmean(d) if d else 0.0
    # wait: from a group's generation ending to its training starting (the trainer busy with another
    # group's step); one value per group a training step trains
    gen_ends: dict[int, list[float]] = {}
    for s in spans:
        if s["phase"] == "generate" and s.get("group", -1) >= 0:
            gen_ends.setdefault(s["group"], []).append(s["end"])
    waits = []
    for s in trains:
        for g in _trained_groups(s):
            before = [e for e in gen_ends.get(g, []) if e <= s["start"] + 1e-9]
            if before:
                waits.append(s["start"] - max(before))
    out["wait"] = statistics.fmean(waits) if waits else 0.0
    # how the two sides were kept busy over the spans' extent: the share of it in which no group
    # generated (the engine had no work: every group was training or waiting for the trainer) and
    # the share in which the trainer trained
    t0 = min(s["start"] for s in spans)
    t1 = max(s["end"] for s in spans)
    if t1 > t0:
        gen = _covered([(s["start"], s["end"]) for s in spans if s["phase"] == "generate"], t0, t1)
        out["engine_idle"] = 1.0 - gen / (t1 - t0)
        out["trainer_busy"] = _covered([(s["start"], s["end"]) for s in trains], t0, t1) / (t1 - t0)
    return out


def _covered(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] inside at least one of the intervals."""
    total, end = 0.0, t0
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, t1)
        if b > a:
            total += b - a
            end = b
    return total


def engine_rate(spans: list[dict]) -> dict:
    """The engine's steps per second of stepping while some group trains and while none does:
    medians over the timeline's half-second `engine_steps` buckets that had requests in flight (a
    bucket counts as training when a train span covers half of it or more), with the mean requests in
    flight per step. Per second of the bucket's busy time, not of its length: a bucket in which a
    group's generation ended is mostly idle, and per second of its length would read as slow
    decoding (the H200's dedicated arm read 76 against 257 steps/s so, with nothing else on the GPU).
    Under MPS the trainer's kernels share the GPU with the engine's; this says what that costs the
    decoding. With `waiting` (timelines that record each step's wait for the engine core): the
    median share of step time spent waiting for the core, high where the GPU bounds the decoding,
    low where the client's Python in this process does (see engine.StepRate). {} when the timeline
    has no engine steps."""
    trains = [(s["start"], s["end"]) for s in spans if s["phase"] == "train"]
    split: dict[str, list[tuple[float, float, float | None, int]]] = {"training": [], "not_training": []}
    for b in spans:
        if b["phase"] != "engine_steps" or not b["steps"]:
            continue
        length = b["end"] - b["start"]
        covered = sum(max(0.0, min(e, b["end"]) - max(s, b["start"])) for s, e in trains)
        key = "training" if covered >= length / 2 else "not_training"
        busy = b.get("busy") or length
        wait = b["wait"] / busy if "wait" in b and busy > 0 else None
        split[key].append((b["steps"] / busy, b["inflight"] / b["steps"], wait, b["steps"]))
    out = {}
    for k, v in split.items():
        if not v:
            continue
        out[k] = {"n": len(v), "steps_per_s": statistics.median(x for x, _, _, _ in v),
                  "inflight": statistics.fmean(y for _, y, _, _ in v)}
        # ms per step = fixed + per request x requests in flight, least squares over the buckets of
        # three steps or more (a bucket of one or two steps is mostly a step that straddles it or
        # loads an adapter: in the H200's runs they moved the fixed part from 5.9 to 13.5 ms)
        fit = [(y, 1e3 / x) for x, y, _, n in v if n >= 3]
        if len(fit) >= 3 and len({round(y, 6) for y, _ in fit}) >= 2:
            slope, icept = statistics.linear_regression(*zip(*fit))
            out[k]["fixed_ms"], out[k]["per_request_us"] = icept, 1e3 * slope
        waits = [w for _, _, w, _ in v if w is not None]
        if waits:
            out[k]["waiting"] = statistics.median(waits)
    return out


def collect(runs: list[dict], root: Path) -> list[dict]:
    from .runlog import read_jsonl

    rows = []
    for r in runs:
        d = run_dir(root, r)
        s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else None
        tl = d / "timeline.jsonl"
        phases = phase_stats(read_jsonl(tl), s["window"]) if s and s.get("window") and tl.exists() else {}
        rows.append({**r, "summary": s, "phases": phases})
    base = {r["seed"]: r["summary"]["steps_per_hour"] for r in rows
            if r["arm"] == "dedicated" and r["label"] == "main" and r["summary"]}
    for r in rows:
        s = r["summary"]
        r["steps_per_hour"] = s["steps_per_hour"] if s else None
        r["ratio"] = (s["steps_per_hour"] / base[r["seed"]]) if s and r["seed"] in base else None
    return rows


def write_report(rows: list[dict], out: Path, command: str, cfg: Config) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in r.items() if k != "summary"} |
            {"summary": {k: v for k, v in (r["summary"] or {}).items() if k != "window"}} for r in rows]
    (out.with_suffix(".json")).write_text(json.dumps({"command": command, "config_hash": cfg.hash(), "runs": slim},
                                                     indent=2, default=str))
    seeds = sorted({r["seed"] for r in rows})
    arms = [a for a in NON_MPS + MPS if any(r["arm"] == a and r["label"] == "main" for r in rows)]
    ded_steps = sorted({x.split("=", 1)[1] for r in rows if r["arm"] == "dedicated" for x in r["set"]
                        if x.startswith("experiment.steps=")})
    ded_note = "".join(f"; dedicated runs: {n} steps per job (a steady per-job loop; set apart to fit the device "
                       "time)" for n in ded_steps)
    lines = [f"# Arms benchmark: {cfg.experiment.name}", "", "```", command, "```", "",
             f"Config hash `{cfg.hash()}`; model `{cfg.experiment.model}`; {len(cfg.jobs)} jobs; "
             f"{cfg.experiment.steps} steps of which {cfg.experiment.warmup_steps} warm-up (not measured){ded_note}.", "",
             "Steps per device-hour (ratio to the same seed's dedicated baseline):", "",
             "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ratio |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for a in arms:
        cells, ratios = [], []
        for s in seeds:
            r = next((r for r in rows if r["arm"] == a and r["seed"] == s and r["label"] == "main"), None)
            if r is None or r["steps_per_hour"] is None:
                cells.append("-")
                continue
            cells.append(f"{r['steps_per_hour']:.0f} ({r['ratio']:.3f}x)" if r["ratio"] else f"{r['steps_per_hour']:.0f}")
            if r["ratio"]:
                ratios.append(r["ratio"])
        mean = f"{sum(ratios) / len(ratios):.3f}x" if ratios else "-"
        lines.append(f"| {a} | " + " | ".join(cells) + f" | {mean} |")
    extra = [r for r in rows if r["label"] != "main"]
    if extra:
        lines += ["", "Job-count scaling and tuning (baseline: the seed's dedicated run of the base workload):", "",
                  "| run | arm | jobs | seed | steps/h | ratio | busy | GPU util |", "|---|---|---|---|---|---|---|---|"]
        for r in extra:
            s = r["summary"] or {}
            lines.append(f"| {r['label']} | {r['arm']} | {r['jobs']} | {r['seed']} | "
                         f"{_fmt(r['steps_per_hour'], 0)} | {_fmt(r['ratio'], 3)} | "
                         f"{_fmt(s.get('busy_fraction'))} | {_fmt(s.get('gpu_util'))} |")
    lines += ["", "Per run: phase times and engine start (reported apart from throughput):", "",
              "| arm | seed | label | engine start s | sampler | measured steps | measured s | busy | GPU util | MPS |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["summary"] or {}
        lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | {_fmt(s.get('engine_start_s'), 0)}"
                     f"{' (reused)' if s.get('engine_reused') else ''} | {s.get('engine_sampler', '-')}"
                     f"{', client in its own process' if s.get('engine_process') else ''}"
                     f"{', reload first' if s.get('reload_first') else ''}"
                     f"{', packed rows' if s.get('packed_rows') else ''}"
                     f"{', elementwise kernels' if s.get('elementwise_kernels') else ''}"
                     f"{', base in the LoRA op' if s.get('base_in_lora') else ''}"
                     f"{', tuned LoRA kernels' if s.get('vllm_lora_configs') else ''} | "
                     f"{s.get('steps_measured', '-')} | "
                     f"{_fmt(s.get('seconds_measured'), 1)} | {_fmt(s.get('busy_fraction'))} | "
                     f"{_fmt(s.get('gpu_util'))} | {s.get('mps', '-')} |")
    timed = [r for r in rows if r.get("phases")]
    if timed:
        lines += ["", "Phase durations in the measured window, seconds: median / largest (handoff: from the trainer "
                  "handing a group over to the engine thread taking it up; generate includes loading the group's "
                  "adapters, which reload also shows):", "",
                  "| arm | seed | label | " + " | ".join(PHASES) + " |", "|---|---|---|" + "---|" * len(PHASES)]
        for r in timed:
            ph = r["phases"]
            cells = [f"{ph[k]['median']:.2f} / {ph[k]['max']:.2f}" if k in ph else "-" for k in PHASES]
            lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | " + " | ".join(cells) + " |")
        chained = [r for r in timed if r["phases"].get("chain")]
        if chained:
            lines += ["", "Each group's chain (means, seconds): the cycle between a group's successive training steps, "
                      "beside the phases it runs in series; a cycle near their sum says the chain bounds the "
                      "throughput. Engine idle: the share of the measured window in which no group generated "
                      "(each was training or waiting for the trainer); trainer busy: the share in which it trained:",
                      "",
                      "| arm | seed | label | groups | cycle | generate | wait for the trainer | train | export "
                      "| their sum | engine idle | trainer busy |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in chained:
                c = r["phases"]["chain"]
                wait = c.get("wait", 0.0)  # reports rebuilt from older summaries have none
                lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | {c['groups']} | {c['cycle']:.2f} | "
                             f"{c['generate']:.2f} | {wait:.2f} | {c['train']:.2f} | {c['export']:.2f} | "
                             f"{c['generate'] + wait + c['train'] + c['export']:.2f} | {_share(c.get('engine_idle'))} | "
                             f"{_share(c.get('trainer_busy'))} |")
        rated = [r for r in timed if r["phases"].get("engine")]
        if rated:
            lines += ["", "The engine's decoding while a group trains and while none does (engine steps per second "
                      "of stepping, medians over half-second buckets with requests in flight; requests in flight "
                      "per engine step, mean; waiting: the median share of a step the engine's client spent waiting "
                      "for the engine core's output, high where the GPU bounds the decoding, low where the client's "
                      "Python in the trainer's process does):", "",
                      "| arm | seed | label | steps/s, training | steps/s, not training | in flight, training "
                      "| in flight, not training | waiting, training | waiting, not training |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in rated:
                e = r["phases"]["engine"]
                cells = [f"{e[k]['steps_per_s']:.0f} (n={e[k]['n']})" if k in e else "-" for k in ("training", "not_training")]
                cells += [f"{e[k]['inflight']:.0f}" if k in e else "-" for k in ("training", "not_training")]
                cells += [f"{e[k]['waiting']:.2f}" if "waiting" in e.get(k, {}) else "-" for k in ("training", "not_training")]
                lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | " + " | ".join(cells) + " |")
            lines += ["", "The engine's step time against the requests in flight (least squares over the same buckets: "
                      "ms per step = fixed + per request x in flight; a per-request cost the decode's memory traffic "
                      "cannot explain points at the engine's host work):", "",
                      "| arm | seed | label | training: fixed ms | training: per request us | not training: fixed ms "
                      "| not training: per request us |", "|---|---|---|---|---|---|---|"]
            for r in rated:
                e = r["phases"]["engine"]
                cells = [f"{e[k][f]:{fmt}}" if f in e.get(k, {}) else "-" for k in ("training", "not_training")
                         for f, fmt in (("fixed_ms", ".2f"), ("per_request_us", ".1f"))]
                lines.append(f"| {r['arm']} | {r['seed']} | {r['label']} | " + " | ".join(cells) + " |")
        for r in timed:
            if r["phases"].get("train_outliers"):
                slow = r["phases"]["train_outliers"]
                why = [describe(c) for c in r["phases"].get("train_outlier_compiles", [{}] * len(slow))]
                lines.append(f"\nWarning: {r['arm']} seed {r['seed']} ({r['label']}): training steps of "
                             + ", ".join(f"{d:.2f} s" + (f" ({w})" if w else "") for d, w in zip(slow, why))
                             + f" in the measured window against a median of {r['phases']['train']['median']:.2f} s "
                             "(a compile or a stall); its steps per hour include them.")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def draw_timelines(rows: list[dict], root: Path, path: Path, window_s: float = 60.0) -> None:
    """One panel per arm (first seed's main run): generate / train / reload spans, one lane per group,
    over the first `window_s` seconds of the measured window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .runlog import read_jsonl

    picks = []
    for arm in NON_MPS + MPS:
        r = next((r for r in rows if r["arm"] == arm and r["label"] == "main" and r["summary"]), None)
        if r is not None:
            picks.append(r)
    if not picks:
        return
    colors = {"generate": "tab:blue", "train": "tab:orange", "export": "tab:gray", "reload": "tab:green"}
    fig, axes = plt.subplots(len(picks), 1, figsize=(11, 1.6 * len(picks) + 0.6), squeeze=False)
    for ax, r in zip(axes[:, 0], picks):
        spans = read_jsonl(run_dir(root, r) / "timeline.jsonl")
        w = r["summary"]["window"]
        t0 = (w.get("windows") or [w])[0]["start"]
        for s in spans:
            if s["phase"] not in colors or s["end"] < t0 or s["start"] > t0 + window_s:
                continue
            lane = 0 if r["arm"] == "dedicated" else max(s.get("group", 0), 0)
            if s["phase"] in ("train", "export") and s.get("groups") and len(s["groups"]) > 1:
                lane = min(s["groups"])
            ax.barh(lane + (0.2 if s["phase"] in ("train", "export") else 0), s["end"] - s["start"], left=s["start"] - t0,
                    height=0.35, color=colors[s["phase"]])
        ax.set_xlim(0, window_s)
        ax.set_ylabel(r["arm"], rotation=0, ha="right", va="center")
        ax.set_yticks([])
        ax.set_title(f"{r['arm']}: {r['steps_per_hour']:.0f} steps/h"
                     + (f", {r['ratio']:.2f}x dedicated" if r.get("ratio") else ""), fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds into the measured window (lanes: groups; blue generate, orange train, "
                           "grey export, green reload)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _share(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _fmt(v, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


STOP_TERM_S = 20.0  # how long a stopped batch may take to shut its engine down before it is killed
STOP_REPORT_S = 10.0  # then the MPS daemon's stop and the report


def wait_or_stop(child: subprocess.Popen, deadline: float | None) -> int | str:
    """The child's exit code, or "deadline" when it had to be stopped: SIGTERM to its process group
    early enough that the shutdown (at most STOP_TERM_S, then SIGKILL) and the report still end by
    `deadline` (time.monotonic()), which is the whole benchmark's limit (`--deadline`)."""
    if deadline is None:
        return child.wait()
    stop_at = deadline - STOP_TERM_S - STOP_REPORT_S
    try:
        return child.wait(timeout=max(0.0, stop_at - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    # Out of time: stop the batch (and its engine) cleanly; the caller reports what finished.
    os.killpg(child.pid, signal.SIGTERM)
    try:
        child.wait(timeout=STOP_TERM_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    return "deadline"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colora bench arms", description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--arms", nargs="+", default=list(NON_MPS + MPS), choices=list(NON_MPS + MPS))
    p.add_argument("--jobs", type=int, nargs="*", default=[], help="also run the headline arm with these job counts")
    p.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                   help="tuning sweep of the headline arm: a config key, or env:NAME for a switch of VARY_ENV; "
                        "K1=V1+K2=V2: one run with several settings together")
    p.add_argument("--headline", default="overlap_mps", choices=list(NON_MPS + MPS))
    p.add_argument("--scale-arms", nargs="*", default=[], choices=list(NON_MPS + MPS),
                   help="arms run at each --jobs count (default: the headline arm)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--dedicated-steps", type=int, default=0, metavar="N",
                   help="steps per job of the dedicated baseline (default: the config's); the report says so")
    p.add_argument("--out", default="reports/arms", help="report path without suffix")
    p.add_argument("--runs", default="runs/bench", help="where the run directories go")
    p.add_argument("--deadline", type=float, default=0,
                   help="seconds for the whole benchmark, its shutdown and report included (a run that the "
                        "finished runs' times say would not end in time is not started); 0: none")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the report from the run directories already under --runs")
    p.add_argument("--child", choices=["mps", "plain"], help=argparse.SUPPRESS)
    p.add_argument("--only", help=argparse.SUPPRESS)  # JSON list of runs for a child process
    p.add_argument("--stop-by", type=float, help=argparse.SUPPRESS)  # a child's time.time() limit
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    root = Path(args.runs)
    if args.child:
        run_batch(args.config, args.set, json.loads(args.only), root, args.child == "mps", args.stop_by)
        return 0
    try:
        runs = plan(cfg, args)
    except ValueError as e:
        p.error(str(e))
    command = "colora bench arms " + " ".join(argv if argv is not None else sys.argv[2:])
    failed = False
    deadline = time.monotonic() + args.deadline if args.deadline else None
    for kind, batch in [] if args.report_only else batches(args.config, args.set, runs):
        daemon = None
        if kind == "mps":
            # This process never makes a CUDA context, so it can start the daemon for the child and
            # quit it cleanly once the child (the only client) has exited.
            from .mps import MpsDaemon, MpsUnavailable

            daemon = MpsDaemon()
            try:
                daemon.start()
            except MpsUnavailable as e:
                print(f"MPS unavailable here ({e}); the child decides what to do", flush=True)
                daemon = None
        # Each batch in its own process: one engine per process, and a clean MPS state.
        cmd = [*python_m("colora.bench_arms"), args.config, "--child", kind, "--runs", str(root),
               "--only", json.dumps(batch)] + [f"--set={s}" for s in args.set]
        if deadline is not None:  # the child's runs must end when wait_or_stop would stop it
            cmd.append(f"--stop-by={time.time() + deadline - time.monotonic() - STOP_TERM_S - STOP_REPORT_S}")
        print(f"== {kind} batch: {len(batch)} runs", flush=True)
        child = subprocess.Popen(cmd, env=child_env(kind, batch, args.config, args.set), start_new_session=True)
        rc = wait_or_stop(child, deadline)
        if daemon is not None:
            print(f"MPS daemon: {daemon.stop()}", flush=True)
        if rc != 0:
            print(f"colora: the {kind} batch ended with {rc}; reporting what finished", file=sys.stderr)
            failed = True
        write_report(collect(runs, root), Path(args.out), command, cfg)
    rows = collect(runs, root)
    write_report(rows, Path(args.out), command, cfg)
    draw_timelines(rows, root, Path(args.out).with_name(Path(args.out).name + "_timeline.png"))
    print(Path(args.out).with_suffix(".md").read_text())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
