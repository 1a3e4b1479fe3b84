"""The driver: places an experiment's jobs on co-runners, one GPU each, and gathers one run directory.

    colora run CONFIG --gpus N [--address ADDR]      run_cluster
    colora run --resume DIR [--gpus N] [--address]   resume_cluster
    run_parallel([(config, out), ...], gpus)         independent runs at once, one GPU each
    run_shares(shares, gpus, hooks=...)              the same, heard run by run (a sweep: plan.py)

Layout of a run over N co-runners:

    cluster.json        the whole config and its hash, and which jobs each co-runner runs
    status.json         running | failed (the error, each co-runner's state) | interrupted | complete
    summary.json        merged (placement.py): every job's outcome, throughput over summed GPU-seconds
    eval.json           every job's eval, merged
    gpus/<i>/           co-runner i's run directory (colora.run.runner: metrics, timeline, adapters, ...)
    gpus/<i>.log        its log;  gpus/<i>.json: where it ran (host, pid, the GPU Ray gave it)

The run directory must be reachable at the same path from every node (one host, or a shared
filesystem); so must the driver's working directory and Python path, which the co-runners take on.

Without `--address` the driver starts a Ray instance on this machine and stops it at the end; with
no CUDA here its GPUs are logical (Ray resources) and every co-runner runs on the CPU. `--address
local` does the same and takes the Ray path with one GPU too; `auto` or HOST:PORT joins a cluster.

Failures: a co-runner that dies (killed, out of memory, a GPU error) or whose run fails has its
jobs marked failed with the reason, and the others go on. Ctrl-C, SIGTERM or SIGHUP cancels every
run (each stops at its next log line and cleans up: engine closed, MPS daemon stopped), kills the
co-runners still there after `STOP_GRACE_S` (at once on a second signal), stops whatever they had
started (reaper.py), and marks the run interrupted; `colora run --resume DIR` continues it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from colora.cluster import require_ray
from colora.cluster.actor import CoRunnerActor
from colora.cluster.placement import Outcome, job_cost, merge_eval, merge_summaries, place_jobs, share_config
from colora.cluster.reaper import reap
from colora.config import Config, ConfigError, from_dict
from colora.record.runlog import read_jsonl, write_json_atomic
from colora.run.checkpoint import newest_sound
from colora.run.preflight import RunError, check_sizes, load_tasks, resolve_model
from colora.run.rundir import move_aside, run_state
from colora.run.runner import RunFailed
from colora.stopping import Interrupted, takes

STOP_GRACE_S = 60.0  # a cancelled run's clean-up: the engine's shutdown, MPS's quit (20 s timeout)
PLACEMENT_TIMEOUT_S = 300.0  # how long to wait for the cluster to free the GPUs asked for, and a co-runner to start
OBJECT_STORE_BYTES = 512 * 2**20  # only configs and summaries pass through Ray (Ray's default: 30% of RAM)


@dataclass
class Share:
    """One co-runner's run: `cfg` (a Config's dict) into `out`, or its continuation (`resume`)."""

    index: int
    label: str
    cfg: dict
    out: Path
    resume: bool
    log: Path  # its log, beside the run directory
    info: Path | None  # where it ran, beside the run directory (None: not written; a sweep records it)
    jobs: list[str]


@dataclass
class Hooks:
    """What the caller of `run_shares` hears as the shares go (a sweep's record and progress)."""

    admit: Callable[[Share], str | None] | None = None  # before a share starts: why not to start it, or None
    started: Callable[[Share, dict], None] | None = None  # its co-runner is up (where: info); says so instead of `log`
    ended: Callable[[Outcome], None] | None = None  # its run ended (complete, failed, not started); says so
    line: Callable[[Share, str], None] | None = None  # each line of its log (default: to `log`, labelled)


class DeadlineReached(Exception):
    """`run_shares`' `stop_at` came while runs were still going: they were stopped as on Ctrl-C."""


class Cluster:
    """A Ray connection and a placement group of one bundle per GPU (STRICT_PACK when one node has
    them all, else PACK), as verl's RayResourcePool makes them; released on exit."""

    def __init__(self, gpus: int, address: str | None, log: Callable[[str], None], *, logical: bool):
        self.want, self.address, self.log, self.logical = gpus, address, log, logical
        self.ray = require_ray(f"--gpus {gpus}" if address is None else f"--address {address}")

    def __enter__(self) -> "Cluster":
        ray = self.ray
        from ray.util.placement_group import placement_group

        self.started = not ray.is_initialized()
        if self.started:
            # the co-runners' own logs reach the driver through their log files (run_shares relays
            # them), what their processes print goes to each run's run.log (actor.py), and Ray's own
            # lines stay in Ray's session logs (/tmp/ray/session_latest/logs)
            kw = dict(include_dashboard=False, log_to_driver=False)
            if self.address in (None, "local"):
                kw["object_store_memory"] = OBJECT_STORE_BYTES
                if self.logical:
                    kw["num_gpus"] = self.want
                    self.log(f"no CUDA here: {self.want} logical GPUs (Ray resources); each co-runner runs on the CPU")
            ray.init(address=self.address, **kw)
        res = ray.cluster_resources()
        have = int(res.get("GPU", 0))
        if have < self.want:
            self.close()

            raise RunError(f"--gpus {self.want}: the Ray cluster has {have} GPU(s)")
        per_node = max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["Alive"]), default=0)
        self.cpus = int(res.get("CPU", 0) // have)  # each co-runner's share of the CPUs (its OMP threads)
        bundle = {"GPU": 1, **({"CPU": self.cpus} if self.cpus else {})}
        strategy = "STRICT_PACK" if per_node >= self.want else "PACK"
        self.pg = placement_group([dict(bundle) for _ in range(self.want)], strategy=strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            self.close()

            raise RunError(f"--gpus {self.want}: Ray could not reserve {self.want} bundles of {bundle} "
                           f"({strategy}) within {PLACEMENT_TIMEOUT_S:.0f}s; free now: {ray.available_resources()}")
        self.log(f"placement group: {self.want} x {bundle}, {strategy}")
        return self

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        pg = getattr(self, "pg", None)
        if pg is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            self.pg = None
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()

    def __exit__(self, *exc) -> None:
        self.close()

    def actor(self, bundle: int, share: Share):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


        return self.ray.remote(CoRunnerActor).options(num_gpus=1, num_cpus=self.cpus, max_restarts=0, max_task_retries=0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
                           ).remote(share.index, share.label, list(sys.path), os.getcwd())


def _reason(e: BaseException) -> str:
    """One line for why a co-runner's run ended in `e` (a Ray error wrapping the run's own)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and not type(e).__name__.startswith("Actor"):
        e = cause
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:600]}"


def _steps_done(out: Path) -> dict[str, int]:
    """Each job's finished optimizer steps, from a run directory's metrics."""
    steps: dict[str, int] = {}
    for r in read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else ():
        if r.get("status") == "ok" and "job" in r:
            steps[r["job"]] = max(steps.get(r["job"], 0), r["step"] + 1)
    return steps


@contextlib.contextmanager
def _signals_interrupt():
    """SIGTERM and SIGHUP raise Interrupted (a KeyboardInterrupt) here, as Ctrl-C does, where colora
    takes them (colora/stopping.py `takes`: a host's handler and nohup's SIGHUP stay); in the main
    thread only (Python's rule)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signal.Signals(signum).name)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old = signal.getsignal(sig)
        if takes(sig, old):
            previous[sig] = old
            signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_shares(shares: list[Share], gpus: int, address: str | None, log: Callable[[str], None] = print, *,
               logical: bool | None = None, grace_s: float = STOP_GRACE_S, hooks: Hooks | None = None,
               stop_at: float | None = None) -> list[Outcome]:
    """Run every share on a co-runner of its own, at most `gpus` at once (a bundle takes the next
    share when its run ends); returns their outcomes in the order given. `hooks` hear each share's
    start and end; at `stop_at` (time.monotonic()) the runs still going are stopped and
    DeadlineReached raised."""
    logical = _no_cuda() if logical is None else logical
    hooks = hooks or Hooks()
    outcomes: dict[int, Outcome] = {}

    def done(o: Outcome) -> None:
        outcomes[o.index] = o
        if hooks.ended is not None:
            hooks.ended(o)
    with Cluster(gpus, address, log, logical=logical) as cl, _signals_interrupt():
        ray = cl.ray
        todo, free = deque(shares), list(range(gpus))
        running: dict = {}  # run ref -> (share, actor, bundle, start, info)
        offsets: dict[int, int] = {}  # share -> how much of its log has been relayed

        def relay(share: Share) -> None:  # the co-runner's new log lines, prefixed with its label
            text = b""
            with contextlib.suppress(OSError), open(share.log, "rb") as f:
                f.seek(offsets.get(share.index, 0))
                text = f.read()
            end = text.rfind(b"\n") + 1  # whole lines only; a partial one waits for its end
            offsets[share.index] = offsets.get(share.index, 0) + end
            for line in text[:end].decode(errors="replace").splitlines():
                if hooks.line is not None:
                    hooks.line(share, line)
                else:
                    log(f"[{share.label}] {line}")

        def finish(ref) -> None:
            share, actor, bundle, t0, info = running.pop(ref)
            relay(share)
            summary, error = None, None
            try:
                summary = ray.get(ref)
            except Exception as e:  # the run failed, or its co-runner died
                error = _reason(e)
                if hooks.ended is None:  # else the hook tells
                    log(f"{share.label}: FAILED: {error}")
            _end(ray, actor, info)
            t1 = time.time()
            if share.info is not None:
                write_json_atomic(share.info, {**info, "jobs": share.jobs, "dir": str(share.out), "started": t0,
                                               "ended": t1, "error": error})
            free.append(bundle)
            done(Outcome(share.index, str(share.out), share.jobs, summary, error,
                         _steps_done(share.out) if summary is None else {}, t0, t1, info))

        def launch() -> None:  # every free bundle takes a share; the actors start side by side
            batch = []
            while todo and free:
                share = todo.popleft()
                why = hooks.admit(share) if hooks.admit is not None else None
                if why:
                    done(Outcome(share.index, str(share.out), share.jobs, error=f"not started: {why}"))
                    continue
                bundle = free.pop(0)
                actor = cl.actor(bundle, share)
                batch.append((share, bundle, actor, actor.describe.remote(), time.time()))
            for share, bundle, actor, ref, t0 in batch:
                try:
                    info = ray.get(ref, timeout=PLACEMENT_TIMEOUT_S)  # its bundle is reserved: it starts
                except Exception as e:  # the actor did not start
                    _end(ray, actor, {})
                    free.append(bundle)
                    done(Outcome(share.index, str(share.out), share.jobs, error=f"co-runner did not start: {_reason(e)}",
                                 started=t0, ended=time.time()))
                    continue
                if share.info is not None:
                    write_json_atomic(share.info, {**info, "jobs": share.jobs, "dir": str(share.out)})
                if hooks.started is not None:
                    hooks.started(share, info)
                else:
                    log(f"{share.label}: {', '.join(share.jobs)} on {info['host']} GPU {info['gpu_ids'][0]} "
                        f"(pid {info['pid']}; log {share.log})")
                offsets[share.index] = share.log.stat().st_size if share.log.exists() else 0  # a resume appends
                ref = actor.run.remote(share.cfg, str(share.out), share.resume, str(share.log))
                running[ref] = (share, actor, bundle, t0, info)

        try:
            while todo or running:
                if stop_at is not None and time.monotonic() >= stop_at:
                    raise DeadlineReached(f"{len(running)} run(s) still going at the deadline")
                launch()
                ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0) if running else ([], [])
                for ref in ready:
                    finish(ref)
                for share, *_ in running.values():
                    relay(share)
        except BaseException as e:
            log(f"stopping {len(running)} co-runner(s): {type(e).__name__}{': ' + str(e) if str(e) else ''}")
            _stop(ray, running, grace_s, log)
            raise
    return [outcomes[s.index] for s in shares]


def _end(ray, actor, info: dict) -> None:
    """Kill a co-runner whose run ended (its process is fresh for each run) and what it left."""
    with contextlib.suppress(Exception):
        ray.kill(actor)
    if info.get("token"):
        reap(info["token"])


def _stop(ray, running: dict, grace_s: float, log: Callable[[str], None]) -> None:
    """Cancel every run, give them `grace_s` to clean up (a second Ctrl-C cuts it short), then
    kill the co-runners and stop what they had started."""
    for ref in running:
        with contextlib.suppress(Exception):
            ray.cancel(ref)
    deadline = time.monotonic() + grace_s
    refs = list(running)
    try:
        while refs and time.monotonic() < deadline:
            done, refs = ray.wait(refs, num_returns=len(refs), timeout=min(1.0, max(0.0, deadline - time.monotonic())))
    except KeyboardInterrupt:
        log("interrupted again: killing the co-runners now")
    if refs:
        log(f"{len(refs)} co-runner(s) still running after {grace_s:.0f}s: killed")
    for _, actor, _, _, info in running.values():
        _end(ray, actor, info)


def _no_cuda() -> bool:
    return not torch.cuda.is_available()


# -- a run over N co-runners --------------------------------------------------------------------------
def _shares(cfg: Config, out: Path, placement: list[list[str]], which: list[int], resume: set[int]) -> list[Share]:
    return [Share(i, f"gpu {i}", share_config(cfg, placement[i]).to_dict(), out / "gpus" / str(i), i in resume,
                  out / "gpus" / f"{i}.log", out / "gpus" / f"{i}.json", placement[i]) for i in which]


def _check_inputs(cfg: Config, log: Callable[[str], None]) -> None:
    """What would fail every co-runner alike, before any starts or the run directory is made: the
    tasks and the sizes of their splits, the model (a builtin is built here once, not by every
    co-runner at the same time)."""
    check_sizes(cfg, load_tasks(cfg.jobs))
    resolve_model(cfg.experiment.model, log)


def run_cluster(cfg: Config, out: str | Path, gpus: int, address: str | None = None,
                log: Callable[[str], None] = print, **kw) -> dict:
    """Run `cfg` with its jobs spread over `gpus` co-runners into `out`; returns the merged summary."""
    require_ray(f"--gpus {gpus}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunError(f"--out {str(out)!r} already holds files; choose another directory or --resume it")
    try:
        placement = place_jobs({j.name: job_cost(j) for j in cfg.jobs}, gpus)
    except ValueError as e:
        raise RunError(str(e)) from None
    for i, names in enumerate(placement):  # a co-runner runs its jobs alone: a job joins only its own jobs
        try:
            share_config(cfg, names)
        except ConfigError as e:
            raise RunError(f"--gpus {gpus}: co-runner {i} runs jobs {names} alone, as a run of their own: {e}"
                           ) from None
    _check_inputs(cfg, log)
    write_json_atomic(out / "cluster.json", {"config": cfg.to_dict(), "hash": cfg.hash(), "gpus": gpus,
                                             "placement": placement})
    return _execute(cfg, out, _shares(cfg, out, placement, list(range(gpus)), set()), [], gpus, address, log, **kw)


def is_cluster_run(out: str | Path) -> bool:
    return (Path(out) / "cluster.json").is_file()


def resume_cluster(out: str | Path, gpus: int | None = None, address: str | None = None,
                   log: Callable[[str], None] = print, **kw) -> dict:
    """Continue a run of `run_cluster`: complete co-runners are kept, the others go on from their
    newest sound checkpoint (from the start where none verifies, the old directory kept aside), at most
    `gpus` at once (default: the run's own number); returns the merged summary."""
    out = Path(out)
    meta = json.loads((out / "cluster.json").read_text())
    status = json.loads((out / "status.json").read_text()) if (out / "status.json").exists() else {}
    if status.get("state") == "complete":
        raise RunError(f"--resume {str(out)!r}: the run is already complete")
    cfg, placement = from_dict(meta["config"]), meta["placement"]
    done, todo, resume = [], [], set()
    for i, names in enumerate(placement):
        d = out / "gpus" / str(i)
        if run_state(d) == "complete":
            info = json.loads((out / "gpus" / f"{i}.json").read_text()) if (out / "gpus" / f"{i}.json").exists() else {}
            done.append(Outcome(i, str(d), names, json.loads((d / "summary.json").read_text()),
                                started=info.pop("started", 0.0), ended=info.pop("ended", 0.0),
                                info={k: v for k, v in info.items() if k not in ("jobs", "dir", "error")}))
            continue
        if newest_sound(d) is not None:  # one that verifies: a resume of damaged ones alone fails every time
            resume.add(i)
        elif d.exists():
            log(f"gpu {i}: no sound checkpoint; its run starts again (the old one kept as {move_aside(d).name})")
        todo.append(i)
    if gpus is not None and gpus < 1:
        raise RunError(f"--gpus ({gpus}) must be at least 1")
    n = min(gpus or meta["gpus"], len(todo))  # 0 when every co-runner had completed: only the merge is left
    log(f"resuming {out}: co-runner(s) {', '.join(map(str, todo))} on {n} GPU(s); "
        f"{len(done)} complete already")
    return _execute(cfg, out, _shares(cfg, out, placement, todo, resume), done, n, address, log, **kw)


def _execute(cfg: Config, out: Path, shares: list[Share], done: list[Outcome], gpus: int, address: str | None,
             log: Callable[[str], None], **kw) -> dict:
    write_json_atomic(out / "status.json", {"state": "running"})
    try:
        ran = run_shares(shares, gpus, address, log, **kw) if shares else []
        outcomes = sorted(done + ran, key=lambda o: o.index)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP: every co-runner was stopped
        sig, resume = getattr(e, "signal", "SIGINT"), f"colora run --resume {out}"
        write_json_atomic(out / "status.json", {"state": "interrupted", "signal": sig, "resume": resume})
        raise Interrupted(sig, f"interrupted by {sig}; every co-runner stopped; continue with: {resume}") from None
    except BaseException as e:
        write_json_atomic(out / "status.json", {"state": "failed", "error": f"{type(e).__name__}: {e}"})
        raise
    for o in outcomes:
        o.dir = str(Path(o.dir).relative_to(out))
    summary = merge_summaries(cfg, outcomes)
    evals = [json.loads((out / o.dir / "eval.json").read_text()) for o in outcomes
             if o.summary is not None and (out / o.dir / "eval.json").exists()]
    write_json_atomic(out / "eval.json", merge_eval(evals))
    write_json_atomic(out / "summary.json", summary)
    failed = {str(o.index): o.error for o in outcomes if o.summary is None}
    write_json_atomic(out / "status.json", {"state": "failed", "error": f"co-runner(s) failed: {failed}",
                                            "corunners": {str(o.index): o.state for o in outcomes}}
                      if failed else {"state": "complete"})
    return summary


def run_parallel(items: list[tuple[Config, str | Path]], gpus: int, address: str | None = None,
                 log: Callable[[str], None] = print, **kw) -> list[Outcome]:
    """Independent runs, each on a co-runner of its own, `gpus` at once (a sweep's runs); each
    run's log is `<out>.log` and where it ran `<out>.corunner.json`, beside it. Returns one Outcome
    per run in the order given: its summary, or why it failed."""
    shares = []
    for k, (cfg, out) in enumerate(items):
        out = Path(out)
        shares.append(Share(k, f"run {k}", cfg.to_dict(), out, False, out.with_name(out.name + ".log"),
                            out.with_name(out.name + ".corunner.json"), [j.name for j in cfg.jobs]))
    return run_shares(shares, min(gpus, len(shares)), address, log, **kw)


# -- the command line (colora.cli hands `colora run` here when it asks for Ray) -------------------------
def main_run(cfg: Config | None, out: Path, gpus: int | None, address: str | None, *,
             print_jobs: Callable[[dict], None]) -> int:
    """`colora run CONFIG --gpus N [--address A]` (cfg: the config the command line loaded and checked)
    and `colora run --resume DIR` of such a run (cfg None)."""
    log = lambda s: print(s, flush=True)  # noqa: E731
    require_ray(f"--gpus {gpus}" if (gpus or 1) > 1 else f"--address {address}" if address else "--resume")
    if cfg is None:
        if not is_cluster_run(out):
            raise RunError(f"--resume {str(out)!r} with --gpus/--address: not a run made with --gpus "
                           "(no cluster.json); resume it without them")
        summary = resume_cluster(out, gpus, address, log)
    else:
        log(f"colora: {cfg.experiment.name} ({cfg.experiment.arm}, seed {cfg.experiment.seed}, {len(cfg.jobs)} jobs "
            f"on {gpus or 1} co-runner(s), config {cfg.hash()}) -> {out}")
        summary = run_cluster(cfg, out, gpus or 1, address, log)
    rate = summary["steps_per_hour"]
    log(f"done: {rate:.0f} steps per device-hour ({summary['aggregate_steps_per_hour']:.0f} over the "
        f"{summary['gpus']} co-runners at once) over {summary['steps_measured']} measured steps; results in {out}"
        if math.isfinite(rate) else f"done: no co-runner completed; results in {out}")
    print_jobs(summary)
    if summary["failed_corunners"]:
        raise RunFailed(f"co-runner(s) {', '.join(map(str, summary['failed_corunners']))} failed (their jobs are "
                        f"marked failed in {out / 'summary.json'}); continue them with: colora run --resume {out}")
    return 0
