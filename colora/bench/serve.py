"""N concurrent RL clients through the official Tinker SDK against `colora serve`, beside the same clients one
at a time and, with --beside, beside a `colora run` of the same jobs: optimizer steps per device-hour of each.

    colora bench serve CONFIG [--clients N] [--steps S] [--out DIR] [--beside RUN_DIR] [--set KEY=VALUE ...]

e.g. the throughput workload's 8 jobs, each a GRPO loop of its shape, beside the overlap_mps arm's run of them:

    colora run experiments/reference8_throughput.toml --set experiment.steps=10 --set engine.logprobs=true \\
        --set runtime.checkpoint_every=0 --out runs/native10
    colora bench serve experiments/reference8_throughput.toml --clients 8 --steps 10 --beside runs/native10 \\
        --out runs/bench/serve

What runs, one after another on this machine:
1. `colora serve` (the co-runner backend: colora/service/corun.py) on CONFIG's model with CONFIG's [engine] and
   [trainer] settings, engine.logprobs on (Tinker's samples carry log-probs, which the clients' importance_sampling
   reads), adapter slots and LoRA rank for the clients, any key; its log DIR/server.log, its record of every
   trainer cycle DIR/server/stats.jsonl. Its start is reported apart (`server_start_s`), outside every figure.
2. concurrent: CONFIG's first N jobs as SDK clients at once, `colora run CONFIG --server URL --jobs ...`
   (colora/service/client_run.py: a process per job), S steps each, into DIR/concurrent/;
3. one at a time: the same jobs, each alone against the same server, into DIR/sequential/<job>/.
Each figure is colora's (colora/record/throughput.py): job-steps / seconds of the window from the moment every
job is past its experiment.warmup_steps to the last step's end; one at a time sums the jobs' windows (a device per
job, as the dedicated arm). Per phase, from the server's stats.jsonl over the phase's window(s): trainer cycles,
models (with forward or optimizer work) per cycle, the share of cycles holding several models, datums per cycle
and the trainer's busy share. --beside takes a `colora run` directory (its summary.json) of the same jobs, e.g.
the overlap_mps arm with engine.logprobs on, as the workload's native run; it is named, with its arm, seed, jobs
and code version, since it ran in another process and perhaps another session.

Writes DIR/report.json and DIR/report.md (a table, printed too); the run directories stay under DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from colora.config import EngineConfig, TrainerConfig, load_config
from colora.record.runlog import read_jsonl, write_report
from colora.record.throughput import combine_windows, short_window, throughput
from colora.run.preflight import resolve_model

KEY = "tml-colora-bench-serve"
PY = [sys.executable, "-P"]  # -P: the checkout's kernels/ and tasks/ folders never shadow installed packages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(cfg, model_dir: Path, out: Path, port: int, clients: int) -> list[str]:
    """`colora serve` with the config's engine and trainer settings, every key given (engine.logprobs on)."""
    engine = {**dataclasses.asdict(cfg.engine), "logprobs": True}
    jobs = cfg.jobs[:clients]
    cmd = [*PY, "-m", "colora.service", "--model", str(model_dir), "--out", str(out), "--any-key",
           "--host", "127.0.0.1", "--port", str(port), "--seed", str(cfg.experiment.seed),
           "--max-loras", str(max(clients, cfg.engine.max_loras)),
           "--max-lora-rank", str(max(j.lora_rank for j in jobs))]
    for flag, values, cls in (("--engine", engine, EngineConfig), ("--trainer", dataclasses.asdict(cfg.trainer),
                                                                   TrainerConfig)):
        for f in dataclasses.fields(cls):
            cmd += [flag, f"{f.name}={json.dumps(values[f.name])}"]
    return cmd


def start_server(cmd: list[str], log: Path, url: str, timeout_s: float) -> tuple[subprocess.Popen, float]:
    """The server's process and the seconds until it answered healthz (its engine started)."""
    t0 = time.perf_counter()
    f = open(log, "ab")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    f.close()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"colora serve exited ({proc.returncode}) before it answered; {log} ends:\n"
                               + "\n".join(tail))
        try:
            with urllib.request.urlopen(url + "/api/v1/healthz", timeout=2):
                return proc, time.perf_counter() - t0
        except OSError:
            time.sleep(2.0)
    stop_server(proc)
    raise RuntimeError(f"colora serve did not answer within {timeout_s:.0f} s (--server-timeout); see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def client_run(args, names: list[str], url: str, out: Path) -> dict:
    """`colora run CONFIG --server URL --jobs ...` of these jobs, S steps each; its summary."""
    cmd = [*PY, "-m", "colora.cli", "run", args.config, "--server", url, "--api-key", KEY, "--jobs", ",".join(names),
           "--out", str(out), *[x for s in args.set for x in ("--set", s)]]
    if args.steps:
        cmd += ["--set", f"experiment.steps={args.steps}", "--set", "jobs.*.steps=0"]
    print(f"colora bench serve: {len(names)} client(s) at once: {' '.join(names)} -> {out}", flush=True)
    code = subprocess.call(cmd, stdin=subprocess.DEVNULL)
    if not (out / "summary.json").is_file():
        raise RuntimeError(f"the client run into {out} ended ({code}) without a summary; see {out / 'run.log'}")
    return json.loads((out / "summary.json").read_text())


def cycles(rows: list[dict], windows: list[tuple[float, float]]) -> dict:
    """The server's trainer cycles that ended inside the windows (time.time() spans): how many, and of those
    with training work (forward or optimizer) the models per cycle (mean, max), the share holding several, the
    forward datums and optim_steps per cycle (means); the share of the windows' seconds the trainer was in any
    cycle (saves and loads too)."""
    inside = [r for r in rows if any(a < r["time"] <= b for a, b in windows)]
    seconds = sum(b - a for a, b in windows)
    work = [r for r in inside if r["forward"] or r["optim"]]
    if not work:
        return {"cycles": len(inside), "training_cycles": 0}
    models = [len({f[0] for f in r["forward"]} | {o[0] for o in r["optim"]}) for r in work]
    return {"cycles": len(inside), "training_cycles": len(work), "models_mean": statistics.fmean(models),
            "models_max": max(models), "multi_model_share": sum(m > 1 for m in models) / len(models),
            "datums_mean": statistics.fmean(sum(f[2] for f in r["forward"]) for r in work),
            "optim_steps_mean": statistics.fmean(len(r["optim"]) for r in work),
            "cycle_s_median": statistics.median(r["seconds"] for r in work),
            "trainer_busy": sum(r["seconds"] for r in inside) / seconds if seconds > 0 else None}


def phase_medians(run_dirs: list[Path], windows: list[tuple[float, float]]) -> dict:
    """Median seconds a step spent sampling, in forward_backward + optim_step, and saving its sampler, over the
    steps of these runs that ended inside the windows."""
    ok = [r for d in run_dirs for r in read_jsonl(d / "metrics.jsonl")
          if r.get("status") == "ok" and "end" in r and any(a < r["end"] <= b for a, b in windows)]
    return {k: statistics.median(r[k] for r in ok if k in r) for k in ("t_generate", "t_train", "t_save")
            if any(k in r for r in ok)}


def figures(summary: dict) -> dict:
    w = summary["window"]
    return {"steps_per_hour": summary["steps_per_hour"], "steps_measured": summary["steps_measured"],
            "seconds_measured": summary["seconds_measured"], "window": [w.get("start"), w.get("end")],
            "failed_jobs": summary.get("failed_jobs", [])}


def read_beside(path: str, names: list[str]) -> dict:
    """A `colora run` directory's figure and what it was: arm, seed, jobs, steps, code version."""
    try:
        s = json.loads((Path(path) / "summary.json").read_text())
        cfg = json.loads((Path(path) / "config.json").read_text())["config"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--beside {path!r}: not a finished `colora run` directory ({type(e).__name__}: {e})") from None
    jobs = list(s.get("jobs", {}))
    return {"run": str(path), "arm": s.get("arm"), "seed": s.get("seed"), "jobs": jobs, "same_jobs": jobs == names,
            "steps": cfg["experiment"]["steps"], "engine_logprobs": cfg["engine"].get("logprobs"),
            "checkpoint_every": (cfg.get("runtime") or {}).get("checkpoint_every"),
            "steps_per_hour": s.get("steps_per_hour"), "steps_measured": s.get("steps_measured"),
            "seconds_measured": s.get("seconds_measured"), "code_version": s.get("code_version")}


def _versions() -> dict:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or "cpu"),
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    for name in ("vllm", "tinker", "fastapi", "uvicorn"):
        try:
            out[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            out[name] = "not installed"
    return out


def _n(x, fmt: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def to_markdown(r: dict) -> str:
    base = r["sequential"]["steps_per_hour"]
    rows = [("concurrent", f"{r['clients']} SDK clients at once, colora serve", r["clients"], r["concurrent"]),
            ("sequential", "the same clients one at a time, colora serve", r["clients"], r["sequential"])]
    if r.get("beside"):
        b = r["beside"]
        rows.append(("beside", f"`colora run`, {b['arm']} arm, seed {b['seed']} ({b['run']})", len(b["jobs"]), b))
    out = [f"```\n{r['command']}\n```", "",
           f"{r['environment']['device']}; {r['clients']} jobs of {r['config']}, {r['steps']} steps each, the first "
           f"{r['warmup_steps']} outside the window; server start {r['server_start_s']:.0f} s (outside every figure).",
           "", "| how the jobs run | jobs | steps per device-hour | x one at a time | job-steps measured | seconds "
               "| models per training cycle (mean / max) | cycles with several models | trainer busy |",
           "|---|---|---|---|---|---|---|---|---|"]
    for key, label, n, f in rows:
        c = r.get(key, {}).get("cycles") or {}
        sph = f.get("steps_per_hour")
        out.append(f"| {label} | {n} | **{_n(sph)}** | {_n(sph / base if sph and base else None, '.2f')} | "
                   f"{_n(f.get('steps_measured'), 'd')} | {_n(f.get('seconds_measured'), '.1f')} | "
                   f"{_n(c.get('models_mean'), '.2f')} / {_n(c.get('models_max'), 'd')} | "
                   f"{_n(c.get('multi_model_share'), '.0%')} | {_n(c.get('trainer_busy'), '.0%')} |")
    out += ["", "| phase | median seconds a step: sampling | forward_backward + optim_step | sampler save |",
            "|---|---|---|---|"]
    for key in ("concurrent", "sequential"):
        m = r[key].get("step_medians") or {}
        out.append(f"| {key} | {_n(m.get('t_generate'), '.2f')} | {_n(m.get('t_train'), '.2f')} | "
                   f"{_n(m.get('t_save'), '.2f')} |")
    notes = [f"{k}: {n}" for k in ("concurrent", "sequential") if (n := r[k].get("short_window"))]
    if r.get("beside") and not r["beside"]["same_jobs"]:
        notes.append(f"beside: its jobs ({', '.join(r['beside']['jobs'])}) are not the clients' jobs")
    return "\n".join(out + ([""] + notes if notes else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="colora bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="experiment TOML file (experiments/reference8_throughput.toml is the workload)")
    p.add_argument("--clients", type=int, default=0, help="the config's first N jobs, each an SDK client (default: all)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per job (default: experiment.steps)")
    p.add_argument("--beside", metavar="RUN_DIR", help="a `colora run` directory of the same jobs (e.g. overlap_mps) "
                                                       "whose steps per device-hour go beside")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--out", default="runs/bench/serve", help="the folder of the report and the run directories")
    p.add_argument("--server-timeout", type=float, default=1200.0, metavar="S",
                   help="the longest the server's start may take (default 1200)")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set + ([f"experiment.steps={args.steps}", "jobs.*.steps=0"]
                                               if args.steps else []))
    n = args.clients or len(cfg.jobs)
    if not 1 <= n <= len(cfg.jobs):
        p.error(f"--clients ({n}) must be from 1 to the config's {len(cfg.jobs)} jobs")
    names = [j.name for j in cfg.jobs[:n]]
    steps, warmup = cfg.experiment.steps, cfg.experiment.warmup_steps
    beside = None
    if args.beside:
        try:
            beside = read_beside(args.beside, names)
        except ValueError as e:
            p.error(str(e))
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        p.error(f"--out {str(out)!r} exists and is not empty: the benchmark's run directories go there")
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(cfg.experiment.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(cfg, model_dir, out / "server", port, n)
    print(f"colora bench serve: starting colora serve on {model_dir} ({url}); log {out / 'server.log'}", flush=True)
    proc, start_s = start_server(cmd, out / "server.log", url, args.server_timeout)
    print(f"colora bench serve: the server answered after {start_s:.0f} s", flush=True)
    try:
        conc = client_run(args, names, url, out / "concurrent")
        seq = {name: client_run(args, [name], url, out / "sequential" / name) for name in names}
    finally:
        stop_server(proc)
    stats = read_jsonl(out / "server" / "stats.jsonl") if (out / "server" / "stats.jsonl").exists() else []
    cw = [(conc["window"]["start"], conc["window"]["end"])]
    sw = [(s["window"]["start"], s["window"]["end"]) for s in seq.values()]
    total = combine_windows([s["window"] for s in seq.values()])
    result = {
        "command": "colora bench serve " + " ".join(argv), "environment": _versions(), "config": args.config,
        "config_hash": cfg.hash(), "model": str(model_dir), "clients": n, "jobs": names, "steps": steps,
        "warmup_steps": warmup, "server": {"command": cmd[2:], "start_s": start_s}, "server_start_s": start_s,
        "concurrent": {**figures(conc), "cycles": cycles(stats, cw), "step_medians": phase_medians([out / "concurrent"], cw),
                       "short_window": short_window(conc["seconds_measured"], conc["steps_measured"], n)},
        "sequential": {"steps_per_hour": throughput(total), "steps_measured": total["steps"],
                       "seconds_measured": total["seconds"], "cycles": cycles(stats, sw),
                       "failed_jobs": [f for s in seq.values() for f in s.get("failed_jobs", [])],
                       "step_medians": phase_medians([out / "sequential" / k for k in seq], sw),
                       "short_window": short_window(total["seconds"], total["steps"], n),
                       "jobs": {k: figures(s) for k, s in seq.items()}},
        "beside": beside,
    }
    base = result["sequential"]["steps_per_hour"]
    result["ratios"] = {"concurrent_vs_one_at_a_time": conc["steps_per_hour"] / base if base else None,
                        "concurrent_vs_beside": conc["steps_per_hour"] / beside["steps_per_hour"]
                        if beside and beside.get("steps_per_hour") else None}
    write_report(str(out / "report"), result, to_markdown(result))
    failed = result["concurrent"]["failed_jobs"] + result["sequential"]["failed_jobs"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
