"""One experiment run: set up, train every job in the configured arm, evaluate, clean up.

    colora run experiments/smoke.toml --out runs/smoke

Set-up validates everything that can be wrong with the input (model directory, tasks, output
directory) before any directory is created or any engine started (colora/run/preflight.py). The run is
then a sequence of named steps: start MPS and resolve the device, open the engine, build the trainer,
assemble the co-runner, evaluate, train in the configured arm, evaluate again, summarise. The run
options (`[runtime]`) are resolved here, once, and passed down. The run directory holds:

    config.json      the resolved config and its hash
    run.log          colora's lines of the run and, in a command's session, everything the process
                     and its children wrote meanwhile (vLLM, transformers, torch; colora/output.py)
    run.lock         held by the run's process for its life: a second process is refused (rundir.py)
    status.json      running (the process's pid and start time) | failed (with the error) | interrupted
                     (by which signal, in which phase, after which step, and how to continue) | complete
                     (with `failed_jobs` and why, where a job failed: the other jobs' results stand)
    metrics.jsonl    one row per job per step (train/<job>/... values), plus events
    timeline.jsonl   every phase span (generate, train, reload, eval) with its group and jobs, and the
                     engine's steps per half second (engine_steps: steps, busy seconds, requests in flight)
    eval.json        held-out accuracy per job before and after training (greedy)
    checkpoints/     every job's state, every runtime.checkpoint_every steps and when training ends
    summary.json     throughput and per-job outcome (colora/record/summary.py); written last, so it marks a
                     complete run
    adapters/<job>/  each job's final adapter in PEFT format

SIGINT, SIGTERM and SIGHUP stop a run in bounded time (colora/stopping.py): the co-runner finishes
the step it is in, a checkpoint of the last completed step is written (unless
runtime.checkpoint_every is 0), the engine and the MPS daemon are stopped, status.json says
"interrupted", and `colora run --resume DIR` continues the run (from the start, when nothing was
saved). A second signal exits at once, killing the engine's processes. A process killed outright
(SIGKILL, the OOM killer) leaves its engine processes and MPS daemon to its watcher
(colora/run/watcher.py), and its status.json saying "running" under a lock nobody holds: killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from colora.config import Config, from_dict
from colora.corun.corunner import CoRunner, Schedule
from colora.corun.handoff import EngineFailure
from colora.corun.trainer_side import JobState
from colora.engine.rollout import EngineCache, engine_process, release_cuda_cache
from colora.models.base import load_tokenizer
from colora.output import say, say_at_once
from colora.record import compilewatch
from colora.record.gpumon import GpuSampler
from colora.record.provenance import code_version
from colora.record.runlog import JsonlWriter, Timeline, read_jsonl, write_json_atomic
from colora.record.summary import RunSummary, job_summaries, trainer_gpu_view, warnings
from colora.record.throughput import busy, gpu_util, throughput
from colora.run.checkpoint import Checkpointer, load_latest, newest_sound, rewind_logs
from colora.run.evaluate import evaluate
from colora.run.heap import frozen_heap
from colora.run.fullrun import build, cacheable, engine_kind, export_for, plan  # LoRA jobs, or a full one
from colora.run.preflight import (
    MPS_ARMS,
    RunError,
    Setup,
    held_scratch,
    prepare,
    resolve_device,
    start_mps,
    torch_dtype,
)
from colora.run.progress import run_output
from colora.run.rundir import check_data, holding, this_process, timeslice_tenant
from colora.run.watcher import watch_this_process
from colora.stopping import Interrupted, StopRequest, handling_signals
from colora.tasks import TaskError, add_task_dirs, task_class, task_dirs

ENGINE_DEATH_GRACE_S = 1.0  # an engine that died this long before a stop request died of its signal


class RunFailed(RuntimeError):
    """A run that failed while running (the engine died, say); the message says how to go on."""


def run(cfg: Config, out: str | Path, *, resume_state: dict | None = None, restart: bool = False,
        log: Callable[[str], None] | None = None, engine_cache: EngineCache | None = None, process_mps=None,
        tenant=None) -> dict:
    """Run one experiment into `out` (or continue it from `resume_state`, a checkpoint's state, or
    with `restart` run it again from the start in `out`, an interrupted run's directory); returns the
    summary as summary.json holds it. Raises RunError on bad input or a directory another process
    holds, RunFailed when the run breaks off, Interrupted on a signal (its message says how to
    continue). The run holds its directory's lock for its whole life (colora/run/rundir.py). log: also
    receives colora's lines of the run, which go to run.log and, in a command's session, to the
    terminal as colora/output.py decides; engine_cache: engines kept across the runs of this process;
    process_mps: the MPS daemon this whole process is a client of (colora/sweeps/orchestrate.py starts
    one per MPS process); tenant: the time-slicing arm's hooks when this run is one of its tenants
    (colora/timeslice/tenant.py): `gate` (a grant around each GPU phase: the engine's start, the trainer's
    build and the warm-up in one, each evaluation, and `step_gate`'s each generation and training step, or
    `corun_gate`'s one around a co-run's whole training), `engine_args` (vLLM's, for its sleep mode),
    `origin` (the timeline's clock, shared by the tenants) and `park(engine, trainer, bank)`, called inside
    the first grant to register the parkers."""
    out = Path(out)
    if cfg.experiment.arm == "timeslice" and tenant is None:
        raise RunError("experiment.arm = 'timeslice' runs as a broker and a process per tenant: use `colora run` or "
                       "`colora sweep` (colora/timeslice/arm.py); a time-sliced run is not resumed, run it again")
    with handling_signals() as stop:
        stop.phase = "checking the input"
        setup = prepare(cfg, out, resume_state is not None or restart, log or say, process_mps)
        out.mkdir(parents=True, exist_ok=True)
        with holding(out, log or say):
            _open_run_dir(setup, resume_state, restart, tenant)
            exp = cfg.experiment
            with run_output(out / "run.log", f"{exp.arm} seed {exp.seed}", [j.name for j in cfg.jobs], exp.steps,
                            log) as shown:
                try:
                    with stop.on_abort(lambda: _mark_aborted(out, stop)):
                        summary = _execute(setup, shown, engine_cache, process_mps, resume_state, stop,
                                           tenant).to_dict()
                except Interrupted as e:
                    status = _interrupted(e, stop, cfg, out)
                    write_json_atomic(out / "status.json", status)
                    shown.log(f"interrupted: {status['reason']}")
                    e.message = (f"interrupted by {status['reason']}; {status['saved']}; "
                                 f"continue with: {status['resume']}")
                    raise
                except BaseException as e:
                    write_json_atomic(out / "status.json", {"state": "failed", "error": f"{type(e).__name__}: {e}",
                                                            "traceback": traceback.format_exc()})
                    raise
                status = _complete_status(summary)
                if status.get("failed_jobs"):
                    shown.log(f"warning: {status['reason']}")
            write_json_atomic(out / "summary.json", summary)
            write_json_atomic(out / "status.json", status)
    return summary


def _phase(gate, name: str):
    """The time-slicing arm's grant around a GPU phase (colora/timeslice/gate.py), or nothing."""
    return gate.phase(name) if gate is not None else contextlib.nullcontext()


def _open_run_dir(setup: Setup, resume_state: dict | None, restart: bool, tenant) -> None:
    """What a run writes before it starts anything, with its directory's lock held: config.json (a
    new run's, with its sft data's hashes; a resume keeps the one it checked, and its data must hash
    the same), its logs rewound to the checkpoint (a resume), and status.json "running" with this
    process's pid and start time, by which a reader tells a live run from a killed one. The process's
    watcher starts here, before the MPS daemon and the engine (colora/run/watcher.py)."""
    cfg, out = setup.cfg, setup.out
    if resume_state is None and not restart:  # task_dirs: named in the message of a resume that cannot find a task
        write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash(), "task_dirs": task_dirs(),
                                                "data": setup.data, **({"timeslice_tenant": tenant.gate.tenant}
                                                                       if tenant is not None else {})})
    else:
        check_data(out, cfg, setup.data)
    watch_this_process()
    if resume_state is not None or restart:
        rewind_logs(out, resume_state or {"jobs": {j.name: {"step": 0} for j in cfg.jobs}})
    rec = this_process()
    write_json_atomic(out / "status.json", {"state": "running", "pid": rec["pid"], "host": rec["host"],
                                            "started": rec["started"]})


def _complete_status(summary: dict) -> dict:
    """status.json of a run that ran to its end: "complete", with the jobs that failed (stopped with a
    reason: a raising reward, a loss that is not finite) and why. The state stays "complete" so that
    reports and sweeps read the run's other jobs; `failed_jobs` says that not every job got through."""
    failed = summary.get("failed_jobs") or []
    if not failed:
        return {"state": "complete"}
    reasons = "; ".join(f"{n}: {summary['jobs'][n].get('reason') or 'stopped'}" for n in failed)
    return {"state": "complete", "failed_jobs": failed,
            "reason": f"{len(failed)} of {len(summary['jobs'])} jobs failed ({reasons})"}


def _interrupted(e: Interrupted, stop: StopRequest, cfg: Config, out: Path) -> dict:
    """status.json of an interrupted run: which signal, in which phase, after which step, what is
    saved (the newest checkpoint that verifies), and the command that continues it."""
    step = getattr(e, "step", None)
    newest = newest_sound(out)
    reason = f"{e.signal} during {stop.phase or 'the set-up'}" + (
        f", after step {step} of {cfg.experiment.steps}" if step is not None else "")
    if newest is not None:
        saved = f"every job's state is saved in {newest}"
    elif step:
        saved = "no checkpoint (runtime.checkpoint_every = 0): the run starts again from its beginning"
    else:
        saved = "nothing was trained yet: the run starts again from its beginning"
    return {"state": "interrupted", "signal": e.signal, "phase": stop.phase, "step": step,
            "checkpoint": str(newest.relative_to(out)) if newest is not None else None, "reason": reason,
            "saved": saved, "resume": f"colora run --resume {out}"}


def _mark_aborted(out: Path, stop: StopRequest) -> None:
    """On a second signal, which exits at once: status.json says so, and how to continue."""
    reason = f"{stop.signal} during {stop.phase}, then a second signal: exited at once"
    write_json_atomic(out / "status.json", {"state": "interrupted", "signal": stop.signal, "phase": stop.phase,
                                            "reason": reason, "resume": f"colora run --resume {out}"})
    say_at_once(f"colora: interrupted by {reason}; continue with: colora run --resume {out}", exiting=True)


def resume(out: str | Path, log: Callable[[str], None] | None = None, engine_cache: EngineCache | None = None,
           process_mps=None, task_folders: tuple[str, ...] = ()) -> dict:
    """`colora run --resume DIR`: continue a run from its newest sound checkpoint; an interrupted
    run without one runs again from its beginning, in DIR. Refused (RunError, before anything starts
    or is written) when another process holds DIR, when config.json was edited since the run began,
    or when the checkpoint is of another config. Import-path tasks are looked for where a new run
    looks for them (installed packages, the current directory) and in `task_folders`, the ones the
    user names now, never in the folders config.json records (`_resumed_config`)."""
    out = Path(out)
    say_ = log or say
    if not (out / "config.json").is_file():
        raise RunError(f"--resume {str(out)!r}: no config.json there; is it a colora run directory?")
    with holding(out, say_):
        status = json.loads((out / "status.json").read_text()) if (out / "status.json").exists() else {}
        if status.get("state") == "complete":
            raise RunError(f"--resume {str(out)!r}: the run is already complete")
        cfg = _resumed_config(out, task_folders)
        found = load_latest(out, say_)
        kw = dict(log=log, engine_cache=engine_cache, process_mps=process_mps)
        if found is None:
            if status.get("state") == "interrupted":
                say_(f"{out} has no checkpoint: running it again from its beginning")
                return run(cfg, out, restart=True, **kw)
            raise RunError(f"--resume {str(out)!r}: no usable checkpoint (runtime.checkpoint_every was 0, or the "
                           "run ended before its first); start the run again in a new directory")
        path, state = found
        if state.get("config_hash") != cfg.hash():
            raise RunError(f"--resume {str(out)!r}: checkpoint {path.name} is of config {state.get('config_hash')}, "
                           f"config.json is {cfg.hash()}; it cannot continue this run")
        say_(f"resuming {out} from {path.name}")
        return run(cfg, out, resume_state=state, **kw)


def _resumed_config(out: Path, task_folders: tuple[str, ...]) -> Config:
    """The config a resume continues: config.json's, which must still hash as it did when the run
    began (its experiment, that is: run options may change), with every import-path task found.

    A run directory may come from someone else, and importing a task's module runs its code: so a
    resume does not look in the folders config.json records (where the config file and the current
    directory were), only where the user points now (the installed packages, the current directory,
    `task_folders`, and the config files this process loaded)."""
    saved = json.loads((out / "config.json").read_text())
    if timeslice_tenant(out, saved):
        raise RunError(f"--resume {str(out)!r}: a tenant of a time-slicing arm's run ({out.parent.parent}), which the "
                       "arm drives (its broker grants the GPU to each phase): it is not resumed; run it again")
    cfg = from_dict(saved["config"])
    if saved.get("hash") != cfg.hash():
        raise RunError(f"--resume {str(out)!r}: the experiment in config.json hashes to {cfg.hash()}, the run began "
                       f"as {saved.get('hash')}: config.json was edited since (or written by a colora whose config "
                       "has other keys). A resume continues the experiment the run began; run an edited one in a "
                       "new directory: colora run CONFIG --out NEW")
    add_task_dirs(*task_folders)
    for i, j in enumerate(cfg.jobs):
        if ":" not in j.task:
            continue
        try:
            task_class(j.task)
        except TaskError as e:
            recorded = [d for d in saved.get("task_dirs", ()) if isinstance(d, str)]
            raise RunError(f"--resume {str(out)!r}: jobs.{i}.task = {j.task!r}: {e}. The run began with the task "
                           f"folders {recorded}, which a resume does not import from (a run directory may come "
                           "from someone else); resume from the folder that holds the module, or install it"
                           ) from None
    return cfg


@dataclass
class _Run:
    """What the steps of one run hand on to each other."""

    setup: Setup
    log: Callable[[str], None]
    metrics: JsonlWriter
    timeline: Timeline
    stop: StopRequest
    device: str = ""
    dtype: str = ""
    mps_note: str = ""
    remote: bool = False  # the engine's client in a process of its own (runtime.engine_process)
    tokenizer: object = None
    tenant: object = None  # the time-slicing arm's hooks (`run`'s docstring), or None
    sized: Config | None = None  # cfg, its memory planned (run/memory.py): the engine's and trainer's

    @property
    def cfg(self) -> Config:
        return self.setup.cfg


def _execute(setup: Setup, shown, engine_cache: EngineCache | None, process_mps,
             resume_state: dict | None, stop: StopRequest, tenant=None) -> RunSummary:
    """The run's steps; `shown` (colora/run/progress.py RunOutput) takes its lines and its record's rows;
    `stop.phase` names the step in progress (status.json of an interrupted run)."""
    out, cfg = setup.out, setup.cfg
    t_start = time.perf_counter()
    r = _Run(setup, shown.log, JsonlWriter(out / "metrics.jsonl", on_row=shown.metric),
             Timeline(JsonlWriter(out / "timeline.jsonl", on_row=shown.span), getattr(tenant, "origin", None)),
             stop, tenant=tenant)
    gate = getattr(tenant, "gate", None)
    corunner = None
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(r.metrics.close)
            stop.phase = "starting MPS and the engine"
            _, r.mps_note = start_mps(cfg, stack, r.log, process_mps, stop)  # before any CUDA context
            r.device, r.dtype = resolve_device(cfg)
            r.remote = engine_process(cfg.runtime.engine_process, cfg.experiment.arm)
            r.tokenizer = load_tokenizer(setup.model_dir)
            with _phase(gate, "start"):  # a tenant of the time-slicing arm sets up inside one grant
                r.sized = plan(cfg, setup.model_dir, r.device, r.dtype, adapter_slots(cfg), r.log)
                engine = _open_engine(r, stack, engine_cache, shared=process_mps is not None)
                stop.phase = "building the trainer"
                bank, trainer, trainer_setup_s = _build_trainer(r)
                stop.phase = "loading the adapters and warming up the engine"
                corunner, ckpt = _assemble(r, stack, engine, bank, trainer, resume_state)
                if tenant is not None:
                    tenant.park(engine, trainer, bank)
            stop.phase = "the evaluation before training"
            with _phase(gate, "eval"):
                before = _evaluate_before(r, corunner, resumed=resume_state is not None)
            stop.phase = "training"
            with _phase(getattr(tenant, "corun_gate", None), "corun"):  # a co-run tenant: its groups overlap inside
                window, gpu = _train(r, corunner, engine, ckpt)
            stop.phase = "the evaluation after training"
            with _phase(gate, "eval"):
                after = _evaluate_after(r, corunner, bank, before)
            stop.phase = "closing the engine"
    except Interrupted as e:
        if corunner is not None:  # the steps every job has completed
            e.step = min(js.step for js in corunner.jobs.values())
        raise
    return _summarise(r, engine, bank, trainer, corunner, window, gpu, before, after,
                      trainer_setup_s=trainer_setup_s, wall_s=time.perf_counter() - t_start)


def memory_hint(e: BaseException, cfg: Config) -> str:
    """What a user can change when `e` is the GPU running out of memory ("" otherwise): the engine and the
    trainer share the GPU, so the two settings that size them."""
    import torch

    if not isinstance(e, torch.OutOfMemoryError):
        return ""
    return (f". The engine holds engine.gpu_memory_utilization = {cfg.engine.gpu_memory_utilization} of the GPU and "
            f"the trainer the rest, its passes up to trainer.micro_batch_tokens = {cfg.trainer.micro_batch_tokens} "
            f"tokens: a run with either lower fits a smaller GPU (e.g. --set trainer.micro_batch_tokens="
            f"{max(16, cfg.trainer.micro_batch_tokens // 2)})")


def adapter_slots(cfg: Config) -> int:
    """The adapters vLLM serves in one step (its `max_loras`, which sizes its LoRA kernels): the config's,
    or one in the dedicated arm, each job alone as on a GPU of its own."""
    return 1 if cfg.experiment.arm == "dedicated" else cfg.engine.max_loras or len(cfg.jobs)


def _open_engine(r: _Run, stack: contextlib.ExitStack, engine_cache: EngineCache | None, shared: bool):
    """The engine for the run: a cached one whose settings match, else a new one (closed with the
    run). A cached engine is shared only by runs of one MPS state: a process's MPS membership is fixed
    when its CUDA context is made (`shared`: the whole process is an MPS client)."""
    cfg, setup = r.sized or r.cfg, r.setup
    max_rank = max(j.lora_rank for j in cfg.jobs)
    max_loras = cfg.engine.max_loras or len(cfg.jobs)  # at least the jobs (config.py checks)
    extra = dict(getattr(r.tenant, "engine_args", None) or {})  # vLLM's, over colora's (a tenant: its sleep mode)
    slots = adapter_slots(cfg)
    if slots != max_loras:  # the dedicated arm: its CPU cache still holds every job's adapter, for eval
        extra["max_loras"] = slots

    def start():
        r.log(f"starting the engine on {r.device} ({r.dtype}) for {len(cfg.jobs)} jobs, {slots} adapter "
              f"slot{'s' * (slots != 1)}" + (", its client in a process of its own" if r.remote else ""))
        Engine = engine_kind(cfg, r.remote)
        return Engine(str(setup.model_dir), cfg.engine, max_loras=max_loras, max_lora_rank=max_rank,
                      dtype=r.dtype, seed=cfg.experiment.seed, device=r.device, adapter_sync=setup.adapter_sync,
                      engine_args=extra)

    if engine_cache is not None and cacheable(cfg) and (cfg.experiment.arm not in MPS_ARMS or shared):
        key = (str(setup.model_dir), repr(cfg.engine), max_loras, max_rank, r.dtype, r.device, r.remote,
               setup.adapter_sync, tuple(sorted(extra.items())))
        engine = engine_cache.get(key, start, exclusive=r.device != "cpu")
        # the next run starts with no adapters of this one; after a stop request no run comes next
        stack.callback(lambda: None if r.stop.requested else engine.drop_all())
    else:
        if r.device != "cpu":
            release_cuda_cache()
        engine = start()
        engine.reused = False
        stack.callback(engine.close)
    if not engine.reused:
        r.timeline.add("engine_start", -engine.start_seconds, 0.0)
    r.log(f"engine {'reused' if engine.reused else 'ready'} (it took {engine.start_seconds:.1f}s to start)")
    return engine


def _build_trainer(r: _Run):
    """(bank, trainer, seconds it took). Counts the trainer's Triton compiles from here on (a hook that
    increments a counter), so the timeline's train spans can name what compiled in a slow step;
    Dynamo's are always counted."""
    compilewatch.install()
    t0 = time.perf_counter()
    bank, trainer = build(r.sized or r.cfg, r.setup.model_dir, r.device, torch_dtype(r.dtype),
                          r.tokenizer.pad_token_id)
    return bank, trainer, time.perf_counter() - t0


def _assemble(r: _Run, stack: contextlib.ExitStack, engine, bank, trainer, resume_state: dict | None):
    """The jobs' states (restored from the checkpoint when resuming), the checkpointer, the co-runner,
    every job's adapter in the engine, and the engine warmed up. Returns (corunner, checkpointer)."""
    cfg, out = r.cfg, r.setup.out
    scratch = stack.enter_context(held_scratch(out, r.setup.adapter_sync))  # for adapters that go by disk
    stack.enter_context(r.stop.on_abort(lambda: shutil.rmtree(scratch, True)))  # a second signal
    joins = cfg.experiment.arm != "dedicated"  # where every job runs alone, a later one simply runs later
    jobs = {j.name: JobState(j, r.setup.tasks[j.name], status="waiting" if j.start_after and joins else "running")
            for j in cfg.jobs}
    ckpt = Checkpointer(out, cfg, bank, jobs, cfg.runtime.checkpoint_every, cfg.runtime.checkpoint_keep, r.log,
                        r.timeline, getattr(r.tenant, "gate", None))
    stack.callback(ckpt.close)  # a write in flight lands before the run's status names its checkpoint
    if resume_state is not None:
        ckpt.restore(resume_state)
    export = export_for(cfg, engine, str(r.setup.model_dir), scratch)
    stack.callback(export.close)
    corunner = CoRunner(Schedule.of(cfg), engine, trainer, bank, export, r.tokenizer, jobs, r.timeline, r.metrics,
                        r.log, on_step=ckpt.maybe_save, stop_request=r.stop, gate=getattr(r.tenant, "step_gate", None))
    # every job's current version, a job that joins later too (its evaluation before training serves it)
    engine.set_adapters([export.export(bank, name) for name in jobs])
    if not engine.warmed:  # once per engine: its compiled kernels stay for every later run
        with r.timeline.span("engine_warmup"):
            secs = engine.warm_up(cfg.experiment.seed)
        r.log(f"engine warmed up in {secs:.1f}s")
    return corunner, ckpt


def _evaluate_before(r: _Run, corunner, resumed: bool) -> dict:
    """Held-out accuracy before training (kept in eval_before.json, so a resumed run does not redo it)."""
    exp, out = r.cfg.experiment, r.setup.out
    if resumed and (out / "eval_before.json").exists():
        return json.loads((out / "eval_before.json").read_text())
    with r.timeline.span("eval", jobs=tuple(corunner.jobs), when="before"):
        before = evaluate(corunner, list(corunner.jobs), exp.eval_size, exp.seed, exp.eval_max_new_tokens)
    write_json_atomic(out / "eval_before.json", before)
    return before


def _train(r: _Run, corunner, engine, ckpt):
    """The configured arm, with the set-up's objects kept out of full GC passes and NVML sampling the
    GPU; the engine's step rate of the run's steps goes into the timeline. A failed engine leaves a
    checkpoint and a RunFailed that says how to continue. A stop request ends the arm after the step
    in progress (deferred: see colora/stopping.py) and leaves a checkpoint of it unless checkpoints
    are off; an engine failure that comes with a stop request, or within ENGINE_DEATH_GRACE_S before
    one, is the interruption. Returns (window, GPU sampler)."""
    steps = getattr(engine, "steps", None)  # the engine's step rate, recorded for this run's steps only
    if steps is not None:
        steps.take()
    try:
        try:
            with r.stop.deferred(), frozen_heap(), GpuSampler(r.timeline) as gpu:
                window = corunner.run()
        except EngineFailure as e:
            if not r.stop.requested and not r.stop.wait(ENGINE_DEATH_GRACE_S):
                path = ckpt.save_now()
                raise RunFailed(f"the vLLM engine failed mid-run ({e}); every job's state is saved in "
                                f"{path}; continue with: colora run --resume {r.setup.out}") from e
            r.log(f"the engine ended with the stop request ({e})")
            raise Interrupted(r.stop.signal) from None
        except (RunFailed, Interrupted):
            raise
        except Exception as e:  # the run's own failure mid-step: each job's last completed step is whole
            try:
                path = ckpt.save_now()
            except Exception as again:  # noqa: BLE001  (the original failure is the one to report)
                raise RunFailed(f"the run failed mid-training ({type(e).__name__}: {e}) and its checkpoint "
                                f"could not be written ({type(again).__name__}: {again})") from e
            raise RunFailed(f"the run failed mid-training ({type(e).__name__}: {e}){memory_hint(e, r.sized or r.cfg)}; every job's "
                            f"last completed step is saved in {path}; continue with: colora run --resume {r.setup.out}") from e
    except Interrupted:
        ckpt.finish()  # the last completed step, unless checkpoints are off or it is saved already
        raise
    if steps is not None:
        origin = r.timeline.origin
        for b in steps.take():
            r.timeline.add("engine_steps", b.pop("start") - origin, b.pop("end") - origin, **b)
    ckpt.finish()
    return window, gpu


def _evaluate_after(r: _Run, corunner, bank, before: dict) -> dict:
    """Held-out accuracy after training of the jobs still in the engine (a stopped job's adapter left
    it), into eval.json; every job's final adapter into adapters/<job>/, but one that never joined."""
    exp, out = r.cfg.experiment, r.setup.out
    live = [n for n, js in corunner.jobs.items() if js.status not in ("stopped", "failed")]
    with r.timeline.span("eval", jobs=tuple(live), when="after"):
        after = evaluate(corunner, live, exp.eval_size, exp.seed, exp.eval_max_new_tokens)
    write_json_atomic(out / "eval.json", {"n": exp.eval_size, "before": before, "after": after})
    for name in (n for n, js in corunner.jobs.items() if js.status != "failed"):
        bank.export_peft(name, out / "adapters" / name, str(r.setup.model_dir))
    return after


def _summarise(r: _Run, engine, bank, trainer, corunner, window: dict, gpu, before: dict, after: dict, *,
               trainer_setup_s: float, wall_s: float) -> RunSummary:
    cfg, exp = r.cfg, r.cfg.experiment
    jobs = job_summaries(corunner.jobs, bank, read_jsonl(r.setup.out / "metrics.jsonl"), before, after)
    for w in warnings(jobs):
        r.log(f"warning: {w}")
    sms, peak = trainer_gpu_view(r.device)
    return RunSummary(
        experiment=exp.name, arm=exp.arm, seed=exp.seed, config_hash=cfg.hash(), code_version=code_version(),
        runtime=dataclasses.asdict(cfg.runtime), model=str(r.setup.model_dir), device=r.device, dtype=r.dtype,
        mps=r.mps_note, engine_start_s=engine.start_seconds, engine_reused=engine.reused,
        engine_process=engine.own_process, adapter_sync=engine.adapter_sync, packed_rows=trainer.packed,
        trainer_setup_s=trainer_setup_s, trainer_sm_count=sms, steps_measured=window["steps"],
        seconds_measured=window["seconds"], steps_per_hour=throughput(window), groups=window.get("groups"),
        busy_fraction=busy(r.timeline.spans, window), gpu_util=gpu_util(gpu, window), wall_s=wall_s,
        jobs=jobs, window=window, warnings=warnings(jobs), trainer_peak_gib=peak)
