"""One experiment run: set up, train every job in the configured arm, evaluate, clean up.

    colora run experiments/smoke.toml --out runs/smoke

Set-up validates everything that can be wrong with the input (model directory, tasks, output
directory) before any directory is created or any engine started. The run directory then holds:

    config.json      the resolved config and its hash
    status.json      running | failed (with the error) | complete
    metrics.jsonl    one row per job per step (train/<job>/... values), plus events
    timeline.jsonl   every phase span (generate, train, reload, eval) with its group and jobs
    eval.json        held-out accuracy per job before and after training (greedy)
    summary.json     throughput and per-job outcome; written last, so it marks a complete run
    adapters/<job>/  each job's final adapter in PEFT format
"""

from __future__ import annotations

import contextlib
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
    """A run that cannot start or go on; the message says what is wrong and what to do."""


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

    def get(self, key: tuple, factory: Callable[[], object]):
        eng = self._engines.get(key)
        if eng is None:
            eng = self._engines[key] = factory()
            eng.reused = False
        else:
            eng.reused = True
        return eng

    def close(self) -> None:
        for eng in self._engines.values():
            eng.close()
        self._engines.clear()


def run(cfg: Config, out: str | Path, *, resume: bool = False, log: Callable[[str], None] = print,
        engine_cache: EngineCache | None = None) -> dict:
    """Run one experiment into `out`; returns the summary. Raises RunError on bad input."""
    out = Path(out)
    setup = prepare(cfg, out, resume, log)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
    write_json_atomic(out / "status.json", {"state": "running"})
    try:
        summary = _run(setup, log, engine_cache)
    except BaseException as e:
        write_json_atomic(out / "status.json", {"state": "failed", "error": f"{type(e).__name__}: {e}",
                                                "traceback": traceback.format_exc()})
        raise
    write_json_atomic(out / "summary.json", summary)
    write_json_atomic(out / "status.json", {"state": "complete"})
    return summary


def _run(setup: Setup, log: Callable[[str], None], engine_cache: EngineCache | None = None) -> dict:
    from .corunner import CoRunner, JobState, throughput
    from .engine import RolloutEngine
    from .evaluate import evaluate
    from .lora import AdapterBank, inject_lora
    from .mps import MpsDaemon, MpsUnavailable
    from .models import load_base_model, load_tokenizer
    from .trainer import MultiJobTrainer

    cfg, out = setup.cfg, setup.out
    exp = cfg.experiment
    t_start = time.perf_counter()
    metrics = JsonlWriter(out / "metrics.jsonl")
    timeline = Timeline(JsonlWriter(out / "timeline.jsonl"))
    mps_note = "not used by this arm"
    with contextlib.ExitStack() as stack:
        stack.callback(metrics.close)
        if exp.arm in MPS_ARMS and exp.device != "cpu":
            mps = MpsDaemon(out / ".mps")
            try:
                mps.start()
                stack.callback(lambda: log(f"MPS daemon: {mps.stop()}"))  # after the engine closes
                mps.set_share(cfg.overlap.mps_engine_percentage)
                mps_note = (f"on: engine {cfg.overlap.mps_engine_percentage}%, "
                            f"trainer {cfg.overlap.mps_trainer_percentage}%")
            except MpsUnavailable as e:
                if cfg.overlap.mps_required:
                    raise RunError(f"arm {exp.arm!r} needs MPS, which is unavailable here ({e}); set "
                                   "overlap.mps_required=false to run it without MPS, labelled so") from None
                mps, mps_note = None, f"UNAVAILABLE ({e}): arm ran without MPS"
                log(f"warning: {mps_note}")
        else:
            mps = None
        device, dtype = resolve_device(cfg)
        if mps is None and exp.arm in MPS_ARMS and device == "cpu":
            mps_note = "UNAVAILABLE (CPU run): arm ran without MPS"

        tok = load_tokenizer(setup.model_dir)
        max_rank = max(j.lora_rank for j in cfg.jobs)
        log(f"starting the engine on {device} ({dtype}) for {len(cfg.jobs)} jobs")
        def start_engine():
            return RolloutEngine(str(setup.model_dir), cfg.engine, max_loras=len(cfg.jobs), max_lora_rank=max_rank,
                                 dtype=dtype, seed=exp.seed, device=device)

        if engine_cache is not None and mps is None and exp.arm not in MPS_ARMS:
            key = (str(setup.model_dir), repr(cfg.engine), len(cfg.jobs), max_rank, dtype, device)
            engine = engine_cache.get(key, start_engine)
            stack.callback(engine.drop_all)  # the next run starts with no adapters of this one
        else:
            engine = start_engine()
            engine.reused = False
            stack.callback(engine.close)
        if not engine.reused:
            timeline.add("engine_start", -engine.start_seconds, 0.0)
        log(f"engine {'reused' if engine.reused else 'ready'} ({engine.start_seconds:.1f}s to start)")
        if mps is not None:
            mps.set_share(cfg.overlap.mps_trainer_percentage)

        import torch

        t0 = time.perf_counter()
        tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        model = load_base_model(setup.model_dir, tdtype, device)
        bank = AdapterBank(device, cfg.trainer.lora_backend)
        inject_lora(model, bank)
        for j in cfg.jobs:
            bank.add_job(j.name, j.lora_rank, j.lora_alpha, j.target_modules, exp.seed, j.learning_rate,
                         j.weight_decay, j.adam_betas, j.adam_eps)
        trainer = MultiJobTrainer(model, bank, cfg.trainer, {j.name: j for j in cfg.jobs}, tok.pad_token_id)
        trainer_setup_s = time.perf_counter() - t0

        scratch = adapter_scratch(out)
        stack.callback(shutil.rmtree, scratch, True)
        jobs = {j.name: JobState(j, setup.tasks[j.name]) for j in cfg.jobs}
        corunner = CoRunner(cfg, engine, trainer, bank, tok, jobs, timeline, metrics, scratch,
                            str(setup.model_dir), log)
        for name in jobs:
            engine.set_adapter(name, 0, str(bank.export_peft(name, scratch / name / "v0", str(setup.model_dir))))

        with timeline.span("eval", jobs=tuple(jobs), when="before"):
            before = evaluate(corunner, list(jobs), exp.eval_size, exp.seed, exp.eval_max_new_tokens)
        window = corunner.run()
        with timeline.span("eval", jobs=tuple(jobs), when="after"):
            after = evaluate(corunner, list(jobs), exp.eval_size, exp.seed, exp.eval_max_new_tokens)
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
        "model": str(setup.model_dir), "device": device, "dtype": dtype, "mps": mps_note,
        "engine_start_s": engine.start_seconds, "engine_reused": engine.reused, "trainer_setup_s": trainer_setup_s,
        "steps_measured": window["steps"], "seconds_measured": window["seconds"],
        "steps_per_hour": throughput(window), "groups": window.get("groups"),
        "busy_fraction": _busy(spans, window), "wall_s": time.perf_counter() - t_start,
        "jobs": job_summary, "window": window,
    }


def _busy(spans: list[dict], window: dict) -> float | None:
    if "windows" in window:  # dedicated: time-weighted over each job's own window
        tot = sum(w["seconds"] for w in window["windows"])
        if tot <= 0:
            return None
        return sum(busy_fraction(spans, w["start"], w["end"]) * w["seconds"] for w in window["windows"]) / tot
    return busy_fraction(spans, window["start"], window["end"]) if window["seconds"] > 0 else None
