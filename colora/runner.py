"""One experiment run: set up, train every job in the configured arm, evaluate, clean up.

    colora run experiments/smoke.toml --out runs/smoke

Set-up validates everything that can be wrong with the input (model directory, tasks, output
directory) before any directory is created or any engine started. The run directory then holds:

    config.json      the resolved config and its hash
    status.json      running | failed (with the error) | complete
    metrics.jsonl    one row per job per step (train/<job>/... values), plus events
    timeline.jsonl   every phase span (generate, train, reload, eval) with its group and jobs, and the
                     engine's steps per half second (engine_steps: steps, busy seconds, requests in flight)
    eval.json        held-out accuracy per job before and after training (greedy)
    summary.json     throughput and per-job outcome; written last, so it marks a complete run
    adapters/<job>/  each job's final adapter in PEFT format
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .config import Config, JobConfig
from .runlog import JsonlWriter, Timeline, busy_fraction, read_jsonl, write_json_atomic

MPS_ARMS = ("mps", "overlap_mps")
BUILTIN_MODELS = ("tiny", "qwen3-0.6b-shape", "smollm2")


class RunError(RuntimeError):
    """Bad input: a run that cannot start; the message says what is wrong and what to do."""


class RunFailed(RuntimeError):
    """A run that failed while running (the engine died, say); the message says how to go on."""


def colora_home() -> Path:
    return Path(os.environ.get("COLORA_HOME", Path.home() / ".cache" / "colora"))


def resolve_model(spec: str, log: Callable[[str], None] = print) -> Path:
    """A model directory for `experiment.model`: a path, or builtin:NAME built once into the cache."""
    from .models import ModelDirError, build_qwen3_shape, build_tiny, check_model_dir

    if not spec.startswith("builtin:"):
        try:
            return check_model_dir(spec)
        except ModelDirError as e:
            raise RunError(f"experiment.model: {e}") from None
    name = spec.removeprefix("builtin:")
    if name not in BUILTIN_MODELS:
        raise RunError(f"experiment.model = {spec!r}: unknown builtin; accepted: "
                       + ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS))
    out = colora_home() / "models" / name
    if (out / "config.json").exists():
        return out
    log(f"building {spec} into {out} (once)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out.parent))
    try:
        if name == "tiny":
            build_tiny(tmp)
        elif name == "qwen3-0.6b-shape":
            build_qwen3_shape(tmp)
        else:
            from .smollm2 import build_smollm2

            shutil.rmtree(tmp)
            build_smollm2(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tasks(jobs: tuple[JobConfig, ...]) -> dict:
    from colora.tasks import get_task

    tasks = {}
    for i, j in enumerate(jobs):
        try:
            tasks[j.name] = get_task(j.task, **j.task_options)
        except Exception as e:
            raise RunError(f"jobs.{i}.task = {j.task!r} (job {j.name!r}): {e}") from None
    return tasks


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse a directory that holds a run (unless resuming) and one we cannot write or that is full,
    before anything is started."""
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {str(out)!r} exists and is not a directory")
    if out.exists() and not resume and any(out.iterdir()):
        raise RunError(f"--out {str(out)!r} already holds files; choose another directory or --resume it")
    probe_dir = out if out.exists() else next((p for p in out.parents if p.exists()), Path("/"))
    if not os.access(probe_dir, os.W_OK):
        raise RunError(f"--out {str(out)!r}: {str(probe_dir)!r} is not writable")
    try:
        fd, probe = tempfile.mkstemp(prefix=".colora-probe-", dir=probe_dir)
        with os.fdopen(fd, "w") as f:
            f.write("x" * 65536)
            f.flush()
            os.fsync(f.fileno())
        os.unlink(probe)
    except OSError as e:
        raise RunError(f"--out {str(out)!r}: cannot write there ({e.strerror or e})") from None
    free = shutil.disk_usage(probe_dir).free
    if free < 64 * 2**20:
        raise RunError(f"--out {str(out)!r}: only {free / 2**20:.0f} MiB free there; colora needs at least 64 MiB")


def resolve_device(cfg: Config) -> tuple[str, str]:
    import torch

    device = cfg.experiment.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("experiment.device = 'cuda' but no CUDA device is available")
    dtype = cfg.experiment.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


@dataclass
class Setup:
    cfg: Config
    out: Path
    model_dir: Path
    tasks: dict


def prepare(cfg: Config, out: Path, resume: bool = False, log: Callable[[str], None] = print) -> Setup:
    """Every input check that needs no engine. Creates nothing on failure."""
    from .corunner import reload_first_from_env
    from .engine import engine_process_from_env, sampler_from_env, tuned_lora_configs

    try:
        tuned_lora_configs()
        sampler_from_env()
        engine_process_from_env(cfg.experiment.arm)
        reload_first_from_env()
    except ValueError as e:
        raise RunError(str(e)) from None
    tasks = load_tasks(cfg.jobs)
    check_out_dir(out, resume)
    model_dir = resolve_model(cfg.experiment.model, log)
    return Setup(cfg, out, model_dir, tasks)


def adapter_scratch(out: Path) -> Path:
    """Where per-step adapters go between trainer and engine: tmpfs when there is one (no disk
    round trip), else inside the run directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="colora-adapters-", dir=shm))
    p = out / ".adapters"
    p.mkdir(parents=True, exist_ok=True)
    return p


class EngineCache:
    """Engines kept alive across runs of one process (sweeps, benchmarks): vLLM's start costs
    20-160 s, and rollouts do not depend on the engine's own seed (every request carries one), so
    runs whose engine settings match share one engine. MPS arms never take a cached engine: whether a
    process is an MPS client is fixed when its CUDA context is made."""

    def __init__(self):
        self._engines: dict[tuple, object] = {}

    def get(self, key: tuple, factory: Callable[[], object], *, exclusive: bool = False):
        """The engine for `key`, started by `factory` if there is none. exclusive: before starting
        one, close every other engine and free this process's cached GPU memory. On a GPU each engine
        reserves its `gpu_memory_utilization` of the whole device and vLLM refuses to start when that
        much is not free: on the H200 an overlap run's engine (its client in a process of its own, so
        another key) failed to start beside the cached engine of the run before it and the previous
        trainer's cached blocks (13 of 140 GiB free; reports/h200/eleventh)."""
        eng = self._engines.get(key)
        if eng is not None:
            eng.reused = True
            return eng
        if exclusive:
            self.close()
            release_cuda_cache()
        eng = self._engines[key] = factory()
        eng.reused = False
        return eng

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()


def release_cuda_cache() -> None:
    """Give the GPU memory this process's allocator caches (a finished run's trainer: tens of GiB)
    back to the device, so an engine started next finds it free. A no-op where CUDA is not in use."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run(cfg: Config, out: str | Path, *, resume_state: dict | None = None, log: Callable[[str], None] = print,
        engine_cache: EngineCache | None = None, process_mps=None) -> dict:
    """Run one experiment into `out` (or continue it from `resume_state`, a checkpoint's state);
    returns the summary. Raises RunError on bad input, RunFailed when the run breaks off."""
    from .checkpoint import rewind_logs

    out = Path(out)
    setup = prepare(cfg, out, resume_state is not None, log)
    out.mkdir(parents=True, exist_ok=True)
    if resume_state is None:
        write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
    else:
        rewind_logs(out, resume_state)
    write_json_atomic(out / "status.json", {"state": "running"})
    try:
        summary = _run(setup, log, engine_cache, process_mps, resume_state)
    except BaseException as e:
        write_json_atomic(out / "status.json", {"state": "failed", "error": f"{type(e).__name__}: {e}",
                                                "traceback": traceback.format_exc()})
        raise
    write_json_atomic(out / "summary.json", summary)
    write_json_atomic(out / "status.json", {"state": "complete"})
    return summary


def start_mps(cfg: Config, stack: contextlib.ExitStack, log: Callable[[str], None], process_mps):
    """MPS for this run: the process-wide daemon if there is one, else our own for an MPS arm
    (stopped by `stack` after the engine), else none. Returns (daemon or None, note for the summary)."""
    from .mps import MpsDaemon, MpsUnavailable

    ov, arm = cfg.overlap, cfg.experiment.arm
    if arm not in MPS_ARMS:
        return None, "not used by this arm"
    note = f"on: engine {ov.mps_engine_percentage}%, trainer {ov.mps_trainer_percentage}%"
    if process_mps is not None:
        note = _claim_shares(process_mps, ov, note)
        return process_mps, note + " (process-wide daemon)"
    if cfg.experiment.device == "cpu":
        return None, "UNAVAILABLE (CPU run): arm ran without MPS"
    mps = MpsDaemon()
    try:
        mps.start()
    except MpsUnavailable as e:
        if ov.mps_required:
            raise RunError(f"arm {arm!r} needs MPS, which is unavailable here ({e}); set "
                           "overlap.mps_required=false to run it without MPS, labelled so") from None
        log(f"warning: MPS unavailable ({e}): arm {arm} runs without MPS")
        return None, f"UNAVAILABLE ({e}): arm ran without MPS"
    stack.callback(lambda: log(f"MPS daemon: {mps.stop()}"))  # registered first: runs after the engine closes
    return mps, _claim_shares(mps, ov, note)


def _claim_shares(mps, ov, note: str) -> str:
    """This process's CUDA context with the trainer's share, before the engine's client can make it
    (with whatever share the environment said then), and the engine's share for the engine process
    spawned next. The note gains the SMs the trainer's context sees."""
    from .mps import MpsShareError

    try:
        sms = mps.claim(ov.mps_trainer_percentage)
    except MpsShareError as e:
        raise RunError(str(e)) from None
    mps.set_share(ov.mps_engine_percentage)
    return note + (f" (trainer sees {sms} SMs)" if sms else "")


def resume(out: str | Path, log: Callable[[str], None] = print) -> dict:
    """`colora run --resume DIR`: continue a run from its newest sound checkpoint."""
    from .checkpoint import load_latest
    from .config import from_dict

    out = Path(out)
    if not (out / "config.json").is_file():
        raise RunError(f"--resume {str(out)!r}: no config.json there; is it a colora run directory?")
    import json

    status = json.loads((out / "status.json").read_text()) if (out / "status.json").exists() else {}
    if status.get("state") == "complete":
        raise RunError(f"--resume {str(out)!r}: the run is already complete")
    cfg = from_dict(json.loads((out / "config.json").read_text())["config"])
    found = load_latest(out, log)
    if found is None:
        raise RunError(f"--resume {str(out)!r}: no usable checkpoint (set checkpoint.every to take them); "
                       "start the run again in a new directory")
    path, state = found
    log(f"resuming {out} from {path.name}")
    return run(cfg, out, resume_state=state, log=log)


def torch_dtype(name: str):
    """The torch dtype of a resolved `experiment.dtype` ("float32", "bfloat16", "float16")."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _run(setup: Setup, log: Callable[[str], None], engine_cache: EngineCache | None = None,
         process_mps=None, resume_state: dict | None = None) -> dict:
    from .checkpoint import Checkpointer
    from .corunner import CoRunner, EngineFailure, JobState, throughput
    from .engine import RolloutEngine, engine_process_from_env, tuned_lora_configs
    from .evaluate import evaluate
    from .fusion import should_fuse
    from .gpumon import GpuSampler
    from .models import load_tokenizer
    from .provenance import code_version
    from .trainer import build_trainer

    cfg, out = setup.cfg, setup.out
    exp = cfg.experiment
    t_start = time.perf_counter()
    metrics = JsonlWriter(out / "metrics.jsonl")
    timeline = Timeline(JsonlWriter(out / "timeline.jsonl"))
    with contextlib.ExitStack() as stack:
        stack.callback(metrics.close)
        mps, mps_note = start_mps(cfg, stack, log, process_mps)
        device, dtype = resolve_device(cfg)

        tok = load_tokenizer(setup.model_dir)
        max_rank = max(j.lora_rank for j in cfg.jobs)
        max_loras = cfg.engine.max_loras or len(cfg.jobs)
        if max_loras < len(cfg.jobs):
            raise RunError(f"engine.max_loras ({max_loras}) must be at least the number of jobs ({len(cfg.jobs)})")
        remote = engine_process_from_env(exp.arm)  # COLORA_ENGINE_PROCESS, see there and engine_process.py

        def start_engine():
            log(f"starting the engine on {device} ({dtype}) for {len(cfg.jobs)} jobs"
                + (", its client in a process of its own" if remote else ""))
            if remote:
                from .engine_process import RemoteEngine as Engine
            else:
                Engine = RolloutEngine
            return Engine(str(setup.model_dir), cfg.engine, max_loras=max_loras, max_lora_rank=max_rank,
                          dtype=dtype, seed=exp.seed, device=device)

        # A cached engine is shared only by runs of one MPS state: a process's MPS membership is
        # fixed when its CUDA context is made (process_mps: the whole process is an MPS client).
        if engine_cache is not None and (exp.arm not in MPS_ARMS or process_mps is not None):
            key = (str(setup.model_dir), repr(cfg.engine), max_loras, max_rank, dtype, device, remote,
                   tuned_lora_configs())
            engine = engine_cache.get(key, start_engine, exclusive=device != "cpu")
            stack.callback(engine.drop_all)  # the next run starts with no adapters of this one
        else:
            if device != "cpu":
                release_cuda_cache()
            engine = start_engine()
            engine.reused = False
            stack.callback(engine.close)
        if not engine.reused:
            timeline.add("engine_start", -engine.start_seconds, 0.0)
        log(f"engine {'reused' if engine.reused else 'ready'} (it took {engine.start_seconds:.1f}s to start; "
            f"sampler: {engine.sampler})")

        import torch

        from . import compilewatch
        from .heap import frozen_heap

        # Counts the trainer's Triton compiles from here on (a hook that increments a counter), so
        # the timeline's train spans can name what compiled in a slow step; Dynamo's are always counted.
        compilewatch.install()
        t0 = time.perf_counter()
        tdtype = torch_dtype(dtype)
        bank, trainer = build_trainer(cfg, setup.model_dir, device, tdtype, tok.pad_token_id)
        trainer_setup_s = time.perf_counter() - t0

        scratch = adapter_scratch(out)
        stack.callback(shutil.rmtree, scratch, True)
        jobs = {j.name: JobState(j, setup.tasks[j.name]) for j in cfg.jobs}
        ckpt = Checkpointer(out, cfg, bank, jobs, log)
        if resume_state is not None:
            ckpt.restore(resume_state)
        corunner = CoRunner(cfg, engine, trainer, bank, tok, jobs, timeline, metrics, scratch,
                            str(setup.model_dir), log, on_step=ckpt.maybe_save)
        for name in jobs:
            v = bank.jobs[name].version
            engine.set_adapter(name, v, str(bank.export_peft(name, scratch / name / f"v{v}", str(setup.model_dir), tdtype,
                                                             fold_scale=True)))

        if not engine.warmed:  # once per engine: its compiled kernels stay for every later run
            with timeline.span("engine_warmup"):
                secs = engine.warm_up(exp.seed)
            log(f"engine warmed up in {secs:.1f}s")

        if resume_state is not None and (out / "eval_before.json").exists():
            before = json.loads((out / "eval_before.json").read_text())
        else:
            with timeline.span("eval", jobs=tuple(jobs), when="before"):
                before = evaluate(corunner, list(jobs), exp.eval_size, exp.seed, exp.eval_max_new_tokens)
            write_json_atomic(out / "eval_before.json", before)
        steps = getattr(engine, "steps", None)  # the engine's step rate, recorded for this run's steps only
        if steps is not None:
            steps.take()
        try:
            with frozen_heap(), GpuSampler(timeline) as gpu:  # no full GC passes over the set-up's objects
                window = corunner.run()
            if steps is not None:
                for b in steps.take():
                    timeline.add("engine_steps", b.pop("start") - timeline.origin, b.pop("end") - timeline.origin, **b)
        except EngineFailure as e:
            path = ckpt.save_now()
            raise RunFailed(f"the vLLM engine failed mid-run ({e}); every job's state is saved in "
                            f"{path}; continue with: colora run --resume {out}") from e
        live = [n for n, js in jobs.items() if js.status != "stopped"]  # a stopped job's adapter left the engine
        with timeline.span("eval", jobs=tuple(live), when="after"):
            after = evaluate(corunner, live, exp.eval_size, exp.seed, exp.eval_max_new_tokens)
        write_json_atomic(out / "eval.json", {"n": exp.eval_size, "before": before, "after": after})
        for name in jobs:
            bank.export_peft(name, out / "adapters" / name, str(setup.model_dir))

    rows = read_jsonl(out / "metrics.jsonl")
    spans = timeline.spans
    job_summary = {}
    for name, js in jobs.items():
        rs = [r["reward"] for r in rows if r.get("job") == name and r.get("status") == "ok"]
        job_summary[name] = {
            "status": js.status, "reason": js.reason, "steps": js.step, "version": bank.jobs[name].version,
            "mean_reward": sum(rs) / len(rs) if rs else None,
            "eval_before": before.get(name, {}).get("accuracy"), "eval_after": after.get(name, {}).get("accuracy"),
        }
    return {
        "experiment": exp.name, "arm": exp.arm, "seed": exp.seed, "config_hash": cfg.hash(),
        "code_version": code_version(),
        "model": str(setup.model_dir), "device": device, "dtype": dtype, "mps": mps_note,
        "engine_start_s": engine.start_seconds, "engine_reused": engine.reused, "engine_sampler": engine.sampler,
        "engine_process": engine.own_process,
        "reload_first": corunner.reload_first,
        "packed_rows": trainer.packed,
        "elementwise_kernels": should_fuse(cfg.trainer.fuse_elementwise, device),
        "vllm_lora_configs": tuned_lora_configs(),
        "trainer_setup_s": trainer_setup_s,
        # the trainer's view of the GPU: under MPS with a thread percentage below 100 fewer SMs show
        "trainer_sm_count": torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else None,
        "steps_measured": window["steps"], "seconds_measured": window["seconds"],
        "steps_per_hour": throughput(window), "groups": window.get("groups"),
        "busy_fraction": _busy(spans, window), "gpu_util": _gpu_util(gpu, window), "wall_s": time.perf_counter() - t_start,
        "jobs": job_summary, "window": window,
    }


def _gpu_util(gpu, window: dict) -> float | None:
    """NVML's mean busy share over the measured window(s), time-weighted; None without NVML."""
    ws = window.get("windows", [window])
    vals = [(gpu.mean_between(w["start"], w["end"]), w["seconds"]) for w in ws if w["seconds"] > 0]
    vals = [(v, s) for v, s in vals if v is not None]
    tot = sum(s for _, s in vals)
    return sum(v * s for v, s in vals) / tot if tot else None


def _busy(spans: list[dict], window: dict) -> float | None:
    if "windows" in window:  # dedicated: time-weighted over each job's own window
        tot = sum(w["seconds"] for w in window["windows"])
        if tot <= 0:
            return None
        return sum(busy_fraction(spans, w["start"], w["end"]) * w["seconds"] for w in window["windows"]) / tot
    return busy_fraction(spans, window["start"], window["end"]) if window["seconds"] > 0 else None
