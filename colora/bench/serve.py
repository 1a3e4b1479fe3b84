"""N concurrent RL clients through the official Tinker SDK against `colora serve`: optimizer steps per device-hour
under each set of the server's levers, beside the same clients one at a time and, with --beside, beside a
`colora run` of the same jobs.

    colora bench serve CONFIG [--clients N] [--steps S] [--levers ITEMS] [--vary ITEMS ...] [--scale N ...]
        [--kill-engine-at STEP] [--no-sequential] [--beside RUN_DIR] [--set KEY=VALUE ...] [--out DIR]

e.g. the throughput workload's 8 jobs, each lever of colora/service/levers.py on its own against all of them off,
then all on, at 16 and 32 clients with all on, and the engine killed once; beside the overlap_mps arm's run:

    colora run experiments/reference8_throughput.toml --set experiment.steps=10 --set engine.logprobs=true \\
        --set runtime.checkpoint_every=0 --out runs/native10
    colora bench serve experiments/reference8_throughput.toml --clients 8 --steps 10 --levers off \\
        --vary samplers=memory --vary save_in_step=true --vary grouped_requests=true --vary gather=0.5 \\
        --vary samplers=memory,save_in_step=true,grouped_requests=true --scale 16 --scale 32 \\
        --kill-engine-at 5 --beside runs/native10 --out runs/bench/serve

What runs, one after another on this machine (a server started for each set of levers and number of clients,
kept while the next run needs the same):
1. `colora serve` (the co-runner backend: colora/service/corun.py) on CONFIG's model with CONFIG's [engine] and
   [trainer] settings, engine.logprobs on (the clients' importance_sampling reads the samples' log-probs), adapter
   slots for the clients, the jobs' largest LoRA rank, the benchmark's key with limits for its clients (one
   tenant: DIR/keys-<N>.toml), `--lever` ITEMS (`--levers`, then each `--vary`'s
   over them: comma-separated KEY=VALUE, `off` for every lever off); its log DIR/server-<run>.log, its trainer
   cycles DIR/server-<run>/stats.jsonl. Its start is reported apart (`server_start_s`), outside every figure.
2. per row: N clients at once, `colora run CONFIG --server URL --jobs ...` (colora/service/client_run.py: a
   process per job), S steps each, into DIR/<run>/: `first` with the first levers (`--levers`), `varyK` with
   each `--vary`, `killed` (--kill-engine-at K) the last of those again on its server with the engine core
   SIGKILLed when a client reaches step K (the seconds until the server is healthy again, and the steps per
   device-hour it cost against the row before it), then `clientsN` for each `--scale` N with the last levers.
   Where N passes the config's jobs, its jobs are cycled, each copy named `<job>-c<k>` (so with seeds of its
   own: a job's seeds derive from its name) in DIR/config-<N>.toml, run from CONFIG's folder;
3. one at a time (unless --no-sequential): the jobs of the first row, each alone, on its server.
Each figure is colora's (colora/record/throughput.py): job-steps / seconds of the window from the moment every
job is past its experiment.warmup_steps to the last step's end; one at a time sums the jobs' windows (a device per
job, as the dedicated arm). Per row, from the server's stats.jsonl over its window: trainer cycles, models per
cycle, the share holding several models' forward_backward calls and optim_steps, where the trainer thread's time
went; from the clients' metrics, each client's step latency (median, p90) and where a step's time goes
(colora/bench/serve_report.py). --beside takes a `colora run` directory (its summary.json) of the same jobs, e.g.
the overlap_mps arm with engine.logprobs on, named with its arm, seed, jobs and code version.

Writes DIR/report.json and DIR/report.md (the tables, printed too); the run directories stay under DIR.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

from colora.bench.serve_report import cycles, figures, latencies, step_medians, to_markdown
from colora.config import EngineConfig, TrainerConfig, load_config
from colora.record.runlog import read_jsonl, write_report
from colora.record.throughput import combine_windows, short_window, throughput
from colora.run.preflight import resolve_model

KEY = "tml-colora-bench-serve"
PY = [sys.executable, "-P"]  # -P: the checkout's kernels/ and tasks/ folders never shadow installed packages


@dataclasses.dataclass
class Row:
    """One run of clients: its label (and run directory's name), the server's --lever items, its clients."""

    label: str
    levers: list[str]
    clients: int
    kill_at: int = 0  # a client's step at which the engine core is killed (0: never)


def plan(levers: str, vary: list[str], scale: list[int], clients: int, kill_at: int) -> list[Row]:
    """The rows, in the order they run (module docstring)."""
    base = [x for x in levers.split(",") if x.strip()]
    rows = [Row("first", base, clients)]
    for i, v in enumerate(vary, 1):
        rows.append(Row(f"vary{i}", base + [x for x in v.split(",") if x.strip()], clients))
    last = rows[-1].levers
    if kill_at:
        rows.append(Row("killed", last, clients, kill_at))
    return rows + [Row(f"clients{n}", last, n) for n in scale]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keys_file(folder: Path, clients: int) -> Path:
    """The benchmark's key (its clients are one tenant) with limits for `clients` models, sessions, their two
    newest samplers each and every sample of a step in flight (colora/service/config.py's defaults hold 8)."""
    path = folder / f"keys-{clients}.toml"
    path.write_text(f'[keys]\n"{KEY}" = "bench"\n\n[limits]\nmodels = {max(8, clients)}\n'
                    f"sessions = {max(16, clients + 1)}\nsamplers = {max(64, 4 * clients)}\n"
                    f"pending_samples = {max(2048, 128 * clients)}\n")
    return path


def server_command(cfg, model_dir: Path, out: Path, port: int, clients: int, levers: list[str] = (),
                   keys: Path | None = None) -> list[str]:
    """`colora serve` with the config's engine and trainer settings, every key given (engine.logprobs on), adapter
    slots for `clients`, `keys` (a keys_file; None: any key, the default limits), and `levers` as `--lever`
    items."""
    engine = {**dataclasses.asdict(cfg.engine), "logprobs": True}
    cmd = [*PY, "-m", "colora.service", "--model", str(model_dir), "--out", str(out),
           *(["--api-keys", str(keys)] if keys else ["--any-key"]),
           "--host", "127.0.0.1", "--port", str(port), "--seed", str(cfg.experiment.seed),
           "--max-loras", str(max(clients, cfg.engine.max_loras)),
           "--max-lora-rank", str(max(j.lora_rank for j in cfg.jobs))]
    for flag, values, cls in (("--engine", engine, EngineConfig), ("--trainer", dataclasses.asdict(cfg.trainer),
                                                                   TrainerConfig)):
        for f in dataclasses.fields(cls):
            cmd += [flag, f"{f.name}={json.dumps(values[f.name])}"]
    for item in levers:
        cmd += ["--lever", item]
    return cmd


def _toml(v) -> str:
    """A TOML value of a config's (strings, numbers, booleans, lists, tables)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + "}"
    raise ValueError(f"{v!r}: not a TOML value of a config")


def cycled_config(config: Path, n: int, out: Path) -> Path:
    """CONFIG with its jobs cycled to `n`: the file's text, then a [[jobs]] table per copy, job i (from the
    config's count on) a copy of job i mod count named `<job>-c<i // count + 1>`. Written into `out`."""
    text = config.read_text()
    jobs = tomllib.loads(text).get("jobs", [])
    if not jobs:
        raise ValueError(f"{config}: no [[jobs]] to cycle")
    extra = [f"\n# --clients {n}: the jobs above cycled (colora bench serve)"]
    for i in range(len(jobs), n):
        job = dict(jobs[i % len(jobs)], name=f"{jobs[i % len(jobs)]['name']}-c{i // len(jobs) + 1}")
        extra += ["", "[[jobs]]", *(f"{k} = {_toml(v)}" for k, v in job.items())]
    path = out / f"config-{n}.toml"
    path.write_text(text + "\n".join(extra) + "\n")
    return path


class Server:
    """`colora serve` in a process of its own; its start's seconds (until healthz answered)."""

    def __init__(self, cmd: list[str], log: Path, url: str, timeout_s: float):
        self.cmd, self.log, self.url = cmd, log, url
        t0 = time.perf_counter()
        f = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        f.close()
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"colora serve exited ({self.proc.returncode}) before it answered; {log} ends:\n"
                                   + "\n".join(tail))
            if self.healthy():
                self.start_s = time.perf_counter() - t0
                return
            time.sleep(2.0)
        self.stop()
        raise RuntimeError(f"colora serve did not answer within {timeout_s:.0f} s (--server-timeout); see {log}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/api/v1/healthz", timeout=2):
                return True
        except (OSError, urllib.error.HTTPError):
            return False

    def engine_core(self):
        """The engine core's process (vLLM's EngineCore, a descendant of the server's)."""
        import psutil

        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "EngineCore" in p.name():
                    return p
            except psutil.NoSuchProcess:
                continue
        raise RuntimeError("no EngineCore process under the server's")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def client_run(args, config: Path, names: list[str], url: str, out: Path) -> dict:
    """`colora run CONFIG --server URL --jobs ...` of these jobs, S steps each, from CONFIG's folder (where its
    import-path tasks and data are found); its summary."""
    cmd = [*PY, "-m", "colora.cli", "run", str(config), "--server", url, "--api-key", KEY, "--jobs", ",".join(names),
           "--out", str(out), *[x for s in args.set for x in ("--set", s)]]
    if args.steps:
        cmd += ["--set", f"experiment.steps={args.steps}", "--set", "jobs.*.steps=0"]
    print(f"colora bench serve: {len(names)} client(s) at once: {' '.join(names)} -> {out}", flush=True)
    code = subprocess.call(cmd, stdin=subprocess.DEVNULL, cwd=Path(args.config).resolve().parent)
    if not (out / "summary.json").is_file():
        raise RuntimeError(f"the client run into {out} ended ({code}) without a summary; see {out / 'run.log'}")
    return json.loads((out / "summary.json").read_text())


def killer(server: Server, run_dir: Path, at_step: int, record: dict, done: threading.Event) -> threading.Thread:
    """A thread that SIGKILLs the server's engine core once a client of `run_dir` has finished step `at_step`
    (metrics.jsonl), then times how long until the server is healthy again."""

    def reached() -> bool:
        rows = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
        return any(r.get("status") == "ok" and r.get("step", -1) + 1 >= at_step for r in rows)

    def run() -> None:
        while not done.is_set() and not reached():
            done.wait(0.2)
        if done.is_set():
            return
        core = server.engine_core()
        record.update(pid=core.pid, at_step=at_step, time=time.time())
        t0 = time.perf_counter()
        os.kill(core.pid, signal.SIGKILL)
        while server.healthy() and time.perf_counter() - t0 < 60:  # until the server has noticed
            done.wait(0.05)
        while not server.healthy() and not done.is_set():
            done.wait(0.2)
        record["healthy_after_s"] = time.perf_counter() - t0

    t = threading.Thread(target=run, name="colora-bench-kill", daemon=True)
    t.start()
    return t


def engine_start_s(log: Path) -> float | None:
    """The server's own figure for its engine's restart ("the engine restarted in N s")."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if "the engine restarted in " in line:
            return float(line.split("the engine restarted in ")[1].split(" s")[0])
    return None


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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="experiment TOML file (experiments/reference8_throughput.toml is the workload)")
    p.add_argument("--clients", type=int, default=0, help="clients at once: the config's first N jobs, cycled past "
                                                          "its count (default: all its jobs)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per job (default: experiment.steps)")
    p.add_argument("--levers", default="", metavar="ITEMS", help="the first row's `colora serve --lever` items, "
                   "comma-separated (`off`: every lever off; default: the server's defaults)")
    p.add_argument("--vary", action="append", default=[], metavar="ITEMS",
                   help="a row with these lever items over --levers' (repeatable: one row each)")
    p.add_argument("--scale", type=int, action="append", default=[], metavar="N",
                   help="a row of N clients with the last row's levers (repeatable)")
    p.add_argument("--kill-engine-at", type=int, default=0, metavar="STEP",
                   help="a row after the --vary rows: the last of them again, the engine core killed when a client "
                        "reaches STEP")
    p.add_argument("--no-sequential", action="store_true", help="skip the first row's jobs one at a time")
    p.add_argument("--beside", metavar="RUN_DIR", help="a `colora run` directory of the same jobs (e.g. overlap_mps) "
                                                       "whose steps per device-hour go beside")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--out", default="runs/bench/serve", help="the folder of the report and the run directories")
    p.add_argument("--server-timeout", type=float, default=1200.0, metavar="S",
                   help="the longest a server's start may take (default 1200)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set + ([f"experiment.steps={args.steps}", "jobs.*.steps=0"]
                                               if args.steps else []))
    n = args.clients or len(cfg.jobs)
    rows = plan(args.levers, args.vary, args.scale, n, args.kill_engine_at)
    if any(r.clients < 1 for r in rows):
        p.error(f"--clients and --scale must be at least 1 (got {[r.clients for r in rows]})")
    steps, warmup = cfg.experiment.steps, cfg.experiment.warmup_steps
    if args.kill_engine_at and not warmup < args.kill_engine_at < steps:
        p.error(f"--kill-engine-at ({args.kill_engine_at}) must be after the warm-up ({warmup}) and before the last "
                f"step ({steps})")
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()):
        p.error(f"--out {str(out)!r} exists and is not empty: the benchmark's run directories go there")
    out.mkdir(parents=True, exist_ok=True)
    configs = {}
    for r in rows:
        if r.clients not in configs:
            configs[r.clients] = (Path(args.config).resolve() if r.clients <= len(cfg.jobs)
                                  else cycled_config(Path(args.config), r.clients, out))
    names = {c: [j.name for j in load_config(path, args.set).jobs[:c]] for c, path in configs.items()}
    beside = None
    if args.beside:
        try:
            beside = read_beside(args.beside, names[n])
        except ValueError as e:
            p.error(str(e))
    model_dir = resolve_model(cfg.experiment.model)
    result = {"command": "colora bench serve " + " ".join(argv), "environment": _versions(), "config": args.config,
              "config_hash": cfg.hash(), "model": str(model_dir), "clients": n, "jobs": names[n], "steps": steps,
              "warmup_steps": warmup, "servers": [], "rows": [], "sequential": None, "beside": beside}
    server, key = None, None
    try:
        for row in rows:
            want = (tuple(row.levers), max(row.clients, cfg.engine.max_loras))
            if server is None or key != want:
                if server is not None:
                    server.stop()
                port = free_port()
                cmd = server_command(load_config(configs[row.clients], args.set), model_dir, out / f"server-{row.label}",
                                     port, row.clients, row.levers, keys_file(out, row.clients))
                print(f"colora bench serve: starting colora serve ({row.label}: levers {row.levers or 'defaults'}, "
                      f"{row.clients} clients); log {out / f'server-{row.label}.log'}", flush=True)
                server = Server(cmd, out / f"server-{row.label}.log", f"http://127.0.0.1:{port}", args.server_timeout)
                key = want
                result["servers"].append({"row": row.label, "command": cmd[2:], "start_s": server.start_s,
                                          "stats": str(out / f"server-{row.label}" / "stats.jsonl")})
                print(f"colora bench serve: the server answered after {server.start_s:.0f} s", flush=True)
            result["rows"].append(run_row(args, row, server, configs[row.clients], names[row.clients], out,
                                          result["servers"][-1]))
            if row is rows[0] and not args.no_sequential:
                result["sequential"] = run_sequential(args, server, configs[row.clients], names[row.clients], out,
                                                      result["servers"][-1])
    finally:
        if server is not None:
            server.stop()
    result["server_start_s"] = sum(s["start_s"] for s in result["servers"])
    first, alone = result["rows"][0]["steps_per_hour"], (result["sequential"] or {}).get("steps_per_hour")
    result["ratios"] = {"first_vs_one_at_a_time": first / alone if alone else None,
                        "first_vs_beside": first / beside["steps_per_hour"] if beside and beside.get("steps_per_hour")
                        else None,
                        "rows_vs_first": {r["label"]: r["steps_per_hour"] / first if first else None
                                          for r in result["rows"]}}
    md = to_markdown(result)
    write_report(str(out / "report"), result, md)
    failed = [f for r in result["rows"] for f in r["failed_jobs"]] + (result["sequential"] or {}).get("failed_jobs", [])
    return 1 if failed else 0


def run_row(args, row: Row, server: Server, config: Path, names: list[str], out: Path, srv: dict) -> dict:
    """One row's clients at once (and, for the killed row, the kill); its figures."""
    run_dir = out / row.label
    kill: dict = {}
    done = threading.Event()
    t = killer(server, run_dir, row.kill_at, kill, done) if row.kill_at else None
    try:
        summary = client_run(args, config, names, server.url, run_dir)
    finally:
        done.set()
        if t is not None:
            t.join(timeout=5)
    w = [(summary["window"]["start"], summary["window"]["end"])]
    stats = read_jsonl(Path(srv["stats"])) if Path(srv["stats"]).is_file() else []
    fig = {"label": row.label, "levers": ",".join(row.levers), "clients": row.clients, **figures(summary),
           "cycles": cycles(stats, w), "step_medians": step_medians([run_dir], w), "latency": latencies([run_dir], w),
           "short_window": short_window(summary["seconds_measured"], summary["steps_measured"], row.clients)}
    if row.kill_at:
        kill.update(beside=(srv.get("rows") or [None])[-1],  # the row before it on this server
                    engine_start_s=engine_start_s(server.log))
        fig["kill"] = kill
    srv.setdefault("rows", []).append(row.label)
    return fig


def run_sequential(args, server: Server, config: Path, names: list[str], out: Path, srv: dict) -> dict:
    """The first row's jobs one at a time on its server: the dedicated arm's figure (their windows summed)."""
    seq = {name: client_run(args, config, [name], server.url, out / "sequential" / name) for name in names}
    sw = [(s["window"]["start"], s["window"]["end"]) for s in seq.values()]
    total = combine_windows([s["window"] for s in seq.values()])
    stats = read_jsonl(Path(srv["stats"])) if Path(srv["stats"]).is_file() else []
    return {"label": "one at a time", "levers": ",".join(plan_levers(args)), "clients": len(names),
            "steps_per_hour": throughput(total), "steps_measured": total["steps"], "seconds_measured": total["seconds"],
            "cycles": cycles(stats, sw), "failed_jobs": [f for s in seq.values() for f in s.get("failed_jobs", [])],
            "step_medians": step_medians([out / "sequential" / k for k in seq], sw),
            "latency": latencies([out / "sequential" / k for k in seq], sw),
            "short_window": short_window(total["seconds"], total["steps"], len(names)),
            "jobs": {k: figures(s) for k, s in seq.items()}}


def plan_levers(args) -> list[str]:
    return [x for x in args.levers.split(",") if x.strip()]


if __name__ == "__main__":
    sys.exit(main())
