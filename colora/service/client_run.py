"""A config's jobs as clients of a Tinker server, beside whatever other clients it serves.

    colora run CONFIG --server http://HOST:PORT [--api-key tml-...] [--jobs a,b] [--out DIR]

Each job runs in a process of its own (colora/service/client.py `job_process`): N loops over the official SDK,
as N users' own loops would be, none waiting on another's interpreter lock. This process checks the input
(the config, what the API can express of each job, the server, the key, the model it serves), starts the jobs,
and keeps a run directory as `colora run` does:

    config.json     the resolved config, its hash, the server and the jobs that ran
    run.log         colora's lines and whatever the jobs' processes wrote
    status.json     running | complete (with `failed_jobs`) | failed | interrupted
    metrics.jsonl   a row per job per step (reward, loss, gradient norm, log-prob gap, timings; `end`: the
                    time.time() at which the step's next sampler was ready), plus events
    eval.json       held-out accuracy (grpo) or loss (sft) per job before and after training
    summary.json    steps per device-hour over the clients' measured window, each job's outcome and its final
                    state on the server (`tinker://<model>/weights/final`); written last

Every job opens its adapter and evaluates, then they start together (a job with start_after joins once some
job has done that many steps); once every job has trained they evaluate again, on a server no longer busy with
their training. The measured window is colora's (colora/record/throughput.py): from the moment every job is
past its warm-up steps to the last step's end, over the server's device. A job that fails (its task raises, the
server refuses a request) stops with its reason and the others go on. Such a run does not resume: a job's
optimizer state lives in its session on the server, which ends with the job's process (its final state is
saved, and `tinker.ServiceClient().create_training_client_from_state_with_optimizer(path)` continues it).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import queue
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from colora.config import Config
from colora.corun.trainer_side import JobState
from colora.output import say
from colora.record.provenance import code_version
from colora.record.runlog import JsonlWriter, read_jsonl, write_json_atomic
from colora.record.summary import JobSummary, job_summaries, never_joined, warnings
from colora.record.throughput import measure_window, throughput
from colora.run.preflight import (
    RunError,
    check_out_dir,
    check_prompt_lengths,
    check_sizes,
    load_sft_data,
    load_tasks,
    resolve_model,
)
from colora.run.progress import run_output
from colora.run.rundir import holding
from colora.service.client import job_process, refusal
from colora.stopping import Interrupted, StopRequest, handling_signals
from colora.tasks import task_dirs

POLL_S = 0.5  # the longest the run waits for a job's message before it looks at the job processes
STOP_WAIT_S = 60.0  # after a stop request, how long the jobs get to finish their step and close their sessions
PROBE_TIMEOUT_S = 15.0


def api_key(given: str | None) -> str:
    """--api-key, else TINKER_API_KEY (the SDK's own variable); a key the SDK itself would refuse is an error."""
    key = given or os.environ.get("TINKER_API_KEY", "")
    if not key:
        raise RunError("--server needs an API key: --api-key tml-..., or TINKER_API_KEY in the environment")
    if not key.startswith("tml-"):
        raise RunError(f"--api-key ({key[:8]}...) must start with 'tml-', as the Tinker SDK's keys do")
    return key


def probe(url: str, key: str) -> dict:
    """The server's first served model ({model_name, max_context_length, ...}) by the route the SDK's
    RestClient uses, with the key: a RunError of one line where nothing answers, the key is refused or the
    answer is not the Tinker API's. (The SDK itself retries a dead address for minutes.)"""
    if not url.startswith(("http://", "https://")):
        raise RunError(f"--server ({url!r}) must be an http:// or https:// URL")
    req = urllib.request.Request(url.rstrip("/") + "/api/v1/get_server_capabilities", headers={"X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode("utf-8", "replace").strip()
        if e.code in (401, 403):
            raise RunError(f"--api-key: the server at {url} refuses key {key[:8]}... ({e.code}: {detail})") from None
        raise RunError(f"--server {url}: GET /api/v1/get_server_capabilities answered {e.code} ({detail}); is it a "
                       "Tinker server?") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise RunError(f"--server {url}: no Tinker server answers there ({why}); start one with "
                       "`colora serve --model DIR --out DIR --any-key`") from None
    models = body.get("supported_models") if isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict) or "model_name" not in models[0]:
        raise RunError(f"--server {url}: get_server_capabilities names no model ({str(body)[:200]}); is it a "
                       "Tinker server?")
    return models[0]


@dataclasses.dataclass
class _Job:
    status: str = "running"
    reason: str = ""
    steps: int = 0
    ends: list[float] = dataclasses.field(default_factory=list)
    before: dict | None = None  # the evaluation before training ({} without eval), once reported
    after: dict = dataclasses.field(default_factory=dict)
    trained: bool = False
    ended: bool = False
    weights: str | None = None


def check(cfg: Config, out: Path, url: str, key: str, only: list[str] | None) -> dict:
    """Every check before anything starts: the jobs (`only`, else all) and what the API can express of them,
    their tasks and data, the output directory, the model, the server and the key. Returns what the jobs'
    processes need."""
    names = [j.name for j in cfg.jobs]
    for n in only or ():
        if n not in names:
            raise RunError(f"--jobs: {n!r} is not a job of the config (its jobs: {', '.join(names)})")
    chosen = tuple(j for j in cfg.jobs if not only or j.name in only)
    if why := refusal(cfg.jobs, chosen):
        raise RunError(why)
    try:
        import tinker  # noqa: F401
    except ImportError as e:
        raise RunError(f"--server runs the jobs through the official Tinker SDK, which is not installed ({e}): "
                       "pip install 'tinker==0.38.0' (colora's `serve` extra)") from None
    sub = dataclasses.replace(cfg, jobs=chosen)  # for the checks only: a part of a config need not be one
    tasks = load_tasks(sub.jobs)
    check_sizes(sub, tasks)
    check_out_dir(out, False)
    model_dir = resolve_model(cfg.experiment.model, say)
    served = probe(url, key)
    if os.path.realpath(served["model_name"]) != os.path.realpath(model_dir):
        raise RunError(f"experiment.model ({cfg.experiment.model!r}, here {model_dir}) is not the model the server at "
                       f"{url} serves ({served['model_name']!r}); run the config against a server of its model")
    check_prompt_lengths(sub, model_dir, tasks)
    sft = {n: str(d.path) for n, d in load_sft_data(sub, model_dir).items()}
    return {"jobs": [j.name for j in chosen], "model_dir": str(model_dir), "base_model": served["model_name"],
            "max_context": int(served.get("max_context_length") or cfg.engine.max_model_len), "sft": sft}


def run_on_server(cfg: Config, out: str | Path, url: str, key: str | None = None, only: list[str] | None = None,
                  log: Callable[[str], None] | None = None) -> dict:
    """Run the config's jobs (`only`, else all) as clients of the server at `url` into `out`; returns the
    summary as summary.json holds it. RunError on bad input (before anything is written), Interrupted on a
    signal (after every job's process has stopped)."""
    out = Path(out)
    with handling_signals() as request:
        key = api_key(key)
        info = check(cfg, out, url, key, only)
        out.mkdir(parents=True, exist_ok=True)
        with holding(out, log or say):
            write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash(), "task_dirs": task_dirs(),
                                                    "server": url, "jobs_run": info["jobs"]})
            write_json_atomic(out / "status.json", {"state": "running", "pid": os.getpid()})
            steps = cfg.experiment.steps
            with run_output(out / "run.log", f"clients of {url}", info["jobs"], steps, log) as shown:
                shown.log(f"{len(info['jobs'])} jobs as clients of {url} (model {info['base_model']})")
                try:
                    summary = _run(cfg, out, url, key, info, shown, request)
                except Interrupted as e:
                    e.message = (f"interrupted by {e.signal}; a run against a server does not resume (its jobs' "
                                 f"sessions ended): run it again into a new directory")
                    write_json_atomic(out / "status.json", {"state": "interrupted", "signal": e.signal,
                                                            "reason": e.message})
                    raise
                except BaseException as e:
                    write_json_atomic(out / "status.json", {"state": "failed", "error": f"{type(e).__name__}: {e}"})
                    raise
            write_json_atomic(out / "summary.json", summary)
            failed = summary["failed_jobs"]
            write_json_atomic(out / "status.json", {"state": "complete", **({"failed_jobs": failed} if failed else {})})
    return summary


def _run(cfg: Config, out: Path, url: str, key: str, info: dict, shown, request: StopRequest) -> dict:
    """Start the jobs' processes, take their messages, let them train and evaluate when it is time; on a stop
    request (a signal, deferred: `request`) each job finishes its step and closes its session."""
    t_start = time.time()
    names = info["jobs"]
    ctx = mp.get_context("spawn")  # a fresh interpreter per job: nothing of this process's threads or locks
    to_parent = ctx.Queue()
    go = {n: ctx.Event() for n in names}
    finish, stop = ctx.Event(), ctx.Event()
    base = {"config": cfg.to_dict(), "url": url, "api_key": key, "base_model": info["base_model"],
            "max_context": info["max_context"], "model_dir": info["model_dir"], "task_dirs": task_dirs()}
    procs = {n: ctx.Process(target=job_process, name=f"colora-client-{n}", daemon=True,
                            args=({**base, "job": n, "sft_path": info["sft"].get(n)}, to_parent, go[n], finish, stop))
             for n in names}
    jobs = {n: _Job() for n in names}
    metrics = JsonlWriter(out / "metrics.jsonl", on_row=shown.metric)
    t0 = None  # when the jobs started training (time.time(), the clock of every step's `end`)
    try:
        for p in procs.values():
            p.start()
        with request.deferred():  # it raises Interrupted as it ends, once the jobs have wound down
            while not all(j.ended for j in jobs.values()):
                if request.requested:
                    stop.set()
                    _wind_down(procs, jobs, to_parent)
                    break
                try:
                    name, kind, payload = to_parent.get(timeout=POLL_S)
                except queue.Empty:
                    _reap(procs, jobs, metrics, shown)
                else:
                    _take(jobs[name], name, kind, payload, metrics, shown)
                if t0 is None and all(j.before is not None or j.trained for j in jobs.values()):
                    t0 = time.time()
                    shown.log("every job evaluated: training starts")
                if t0 is not None:
                    _release(cfg, names, jobs, go, finish, metrics, shown)
            if not request.requested:
                _never_joined(cfg, names, jobs, go, metrics, shown)
    finally:
        metrics.close()
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        to_parent.close()
        # The queue's and events' semaphores are unlinked here, where the last references go: after a stop
        # request the signal handling reaps multiprocessing's resource tracker, which would unlink them
        # first, and their finalizers would then fail at exit.
        del procs, go, finish, stop, to_parent
    return _summary(cfg, out, url, info, jobs, t0 if t0 is not None else t_start, time.time() - t_start)


def _take(j: _Job, name: str, kind: str, payload, metrics: JsonlWriter, shown) -> None:
    if kind == "row":
        metrics.write(payload)
        if payload.get("status") == "ok":
            j.steps = payload["step"] + 1
    elif kind == "line":
        shown.log(payload)
    elif kind == "eval":
        when, result = payload
        if when == "before":
            j.before = result
        else:
            j.after = result
    elif kind == "trained":
        j.status, j.reason, j.steps, j.ends = payload["status"], payload["reason"], payload["steps"], payload["ends"]
        j.trained = True
        if j.status == "stopped":
            shown.log(f"job {name} stopped: {j.reason}")
    elif kind == "end":
        j.ended = True
        j.weights = (payload or {}).get("weights")


def _reap(procs: dict, jobs: dict[str, _Job], metrics: JsonlWriter, shown) -> None:
    """A job whose process ended without its last word (killed, out of memory) ends as stopped, with why."""
    for n, p in procs.items():
        j = jobs[n]
        if p.is_alive() or j.ended or p.exitcode is None:
            continue
        if not j.trained:
            j.status, j.reason, j.trained = "stopped", f"its client process ended (exit code {p.exitcode})", True
            metrics.write({"job": n, "step": j.steps, "event": "stopped", "status": "stopped", "reason": j.reason})
            shown.log(f"job {n} stopped: {j.reason}")
        j.ended = True


def _release(cfg: Config, names: list[str], jobs: dict[str, _Job], go: dict, finish, metrics: JsonlWriter,
             shown) -> None:
    """Let the jobs train: those without start_after at once, the others once some job has done that many
    steps; once every job that was let go has trained, let them all evaluate (and the ones still waiting end)."""
    done = max((j.steps for j in jobs.values()), default=0)
    for n in names:
        wait = cfg.job(n).start_after
        if not go[n].is_set() and (wait == 0 or done >= wait) and not jobs[n].trained:
            go[n].set()
            if wait:
                metrics.write({"job": n, "step": 0, "event": "joined"})
                shown.log(f"job {n} joins the run (start_after = {wait})")
    if not finish.is_set() and all(jobs[n].trained for n in names if go[n].is_set()):
        finish.set()


def _never_joined(cfg: Config, names: list[str], jobs: dict[str, _Job], go: dict, metrics: JsonlWriter,
                  shown) -> None:
    """A job still waiting when the others ended failed: it never trained, and no weights of it are reported."""
    done = max((j.steps for j in jobs.values()), default=0)
    for n in names:
        if go[n].is_set():
            continue
        j = jobs[n]
        j.status, j.reason, j.weights = "failed", never_joined(cfg.job(n).start_after, done), None
        metrics.write({"job": n, "step": 0, "event": "stopped", "status": "failed", "reason": j.reason})
        shown.log(f"job {n} failed: {j.reason}")


def _wind_down(procs: dict, jobs: dict[str, _Job], to_parent) -> None:
    """After a stop request: each job ends its step in flight and its session; what is left is terminated."""
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline and any(p.is_alive() for p in procs.values()):
        try:
            name, kind, payload = to_parent.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if kind == "end":
            jobs[name].ended = True


def _summary(cfg: Config, out: Path, url: str, info: dict, jobs: dict[str, _Job], t0: float, wall_s: float) -> dict:
    names = info["jobs"]
    window = measure_window({n: jobs[n].ends for n in names}, t0, cfg.experiment.warmup_steps)
    before = {n: jobs[n].before or {} for n in names}
    after = {n: jobs[n].after for n in names}
    if cfg.experiment.eval_size:
        write_json_atomic(out / "eval.json", {"n": cfg.experiment.eval_size, "before": before, "after": after})
    states = {n: JobState(cfg.job(n), None, step=jobs[n].steps, status=jobs[n].status, reason=jobs[n].reason)
              for n in names}
    # the adapters live on the server: a job's version is its optimizer steps
    versions = SimpleNamespace(jobs={n: SimpleNamespace(version=jobs[n].steps) for n in names})
    summaries: dict[str, JobSummary] = job_summaries(states, versions, read_jsonl(out / "metrics.jsonl"),
                                                     {n: v for n, v in before.items() if v},
                                                     {n: v for n, v in after.items() if v})
    failed = [n for n, s in summaries.items() if s.status in ("stopped", "failed")]
    return {"experiment": cfg.experiment.name, "arm": "server", "server": url, "seed": cfg.experiment.seed,
            "config_hash": cfg.hash(), "code_version": code_version(), "model": info["model_dir"],
            "base_model": info["base_model"], "clients": "a process per job, each its own SDK session",
            "steps_measured": window["steps"], "seconds_measured": window["seconds"],
            "steps_per_hour": throughput(window), "wall_s": wall_s,
            "jobs": {n: {**dataclasses.asdict(s), "final_state": jobs[n].weights} for n, s in summaries.items()},
            "window": window, "warnings": warnings(summaries), "failed_jobs": failed}
