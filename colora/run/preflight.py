"""What a run needs before its engine starts: the model directory, the device and dtype, the tasks
(built with their options, each split large enough for what the run draws from it), an output
directory it may write, and MPS for the arms that use it.

Every check here needs no engine and creates nothing on failure: bad input is a `RunError` whose
message names the key or flag, the value and what to do. (What the config alone decides, such as
overlap.groups against the number of jobs, is checked when it loads: colora/config.py.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from colora.config import Config, JobConfig
from colora.engine.adapters import AdapterSyncUnsupported, resolve
from colora.environment import colora_home
from colora.models.base import ModelDirError, build_qwen3_shape, build_tiny, check_model_dir
from colora.models.smollm2 import build_smollm2
from colora.run import mps
from colora.run.mps import MpsDaemon, MpsShareError, MpsUnavailable
from colora.seeding import derive_seed
from colora.tasks import TaskError, get_task

MPS_ARMS = ("mps", "overlap_mps")
# builtin:NAME -> its folder in colora's model cache. The folder names the builder's revision, so a
# changed builder builds afresh instead of serving a cache the old one made.
BUILTIN_MODELS = {"tiny": "tiny-r2", "qwen3-0.6b-shape": "qwen3-0.6b-shape", "smollm2": "smollm2"}


class RunError(RuntimeError):
    """Bad input: a run that cannot start; the message says what is wrong and what to do."""


def resolve_model(spec: str, log: Callable[[str], None] = print) -> Path:
    """A model directory for `experiment.model`: a path, or builtin:NAME built once into the cache."""
    if not spec.startswith("builtin:"):
        try:
            return check_model_dir(spec)
        except ModelDirError as e:
            raise RunError(f"experiment.model: {e}") from None
    name = spec.removeprefix("builtin:")
    if name not in BUILTIN_MODELS:
        raise RunError(f"experiment.model = {spec!r}: unknown builtin; accepted: "
                       + ", ".join(f"builtin:{n}" for n in BUILTIN_MODELS))
    out = colora_home() / "models" / BUILTIN_MODELS[name]
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
            shutil.rmtree(tmp)
            build_smollm2(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_device(cfg: Config) -> tuple[str, str]:
    """(device, dtype) for `experiment.device` and `experiment.dtype`, "auto" resolved."""
    device = cfg.experiment.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RunError("experiment.device = 'cuda' but no CUDA device is available")
    dtype = cfg.experiment.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def torch_dtype(name: str):
    """The torch dtype of a resolved `experiment.dtype` ("float32", "bfloat16", "float16")."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tasks(jobs: tuple[JobConfig, ...]) -> dict:
    tasks = {}
    for i, j in enumerate(jobs):
        try:
            tasks[j.name] = get_task(j.task, **j.task_options)
        except Exception as e:
            raise RunError(f"jobs.{i}.task = {j.task!r} (job {j.name!r}): {e}") from None
    return tasks


def check_sizes(cfg: Config, tasks: dict) -> None:
    """Each job's splits hold what the run draws: experiment.eval_size items of the eval split, and
    jobs.N.prompts_per_step distinct items of the train split per step. A task that knows its sizes
    (`size(split)`, e.g. gsm8k from a file) is compared with them; any other draws the run's first
    sample of each split, with the run's seeds."""
    seed = cfg.experiment.seed
    for i, j in enumerate(cfg.jobs):
        task = tasks[j.name]
        wants = (("eval", cfg.experiment.eval_size, "experiment.eval_size", derive_seed(seed, j.name, "eval")),
                 ("train", j.prompts_per_step, f"jobs.{i}.prompts_per_step", derive_seed(seed, j.name, 0, "prompts")))
        for split, n, key, sseed in wants:
            if n <= 0:
                continue
            size = getattr(task, "size", None)
            if callable(size):
                if n > size(split):
                    raise RunError(f"{key} ({n}) is larger than the {split} split of job {j.name!r} (task {j.task!r}: "
                                   f"{size(split)} items); use at most {size(split)}")
                continue
            try:
                task.sample(n, sseed, split)
            except TaskError as e:
                raise RunError(f"{key} ({n}) for job {j.name!r}: {e}") from None


def check_mps(cfg: Config, process_mps) -> None:
    """An MPS arm that requires MPS (overlap.mps_required) is refused here when this machine has no
    MPS to start (no control program or no NVIDIA device), unless the process has a daemon already
    or the run is on the CPU (which runs the arm without MPS, labelled so)."""
    if cfg.experiment.arm not in MPS_ARMS or process_mps is not None or cfg.experiment.device == "cpu":
        return
    ok, why = mps.mps_available()  # through the module: tests fake MPS by patching it
    if not ok and cfg.overlap.mps_required:
        raise RunError(f"arm {cfg.experiment.arm!r} needs MPS, which is unavailable here ({why}); set "
                       "overlap.mps_required=false to run it without MPS, labelled so")


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


@dataclass
class Setup:
    """A run's checked inputs."""

    cfg: Config
    out: Path
    model_dir: Path
    tasks: dict
    adapter_sync: str = "disk"  # runtime.adapter_sync resolved: "memory" or "disk"


def prepare(cfg: Config, out: Path, resume: bool = False, log: Callable[[str], None] = print,
            process_mps=None) -> Setup:
    """Every input check that needs no engine. Creates nothing on failure (a builtin model is built
    into colora's cache once the other checks pass)."""
    tasks = load_tasks(cfg.jobs)
    check_sizes(cfg, tasks)
    check_out_dir(out, resume)
    check_mps(cfg, process_mps)
    sync = resolve_adapter_sync(cfg, log)
    model_dir = resolve_model(cfg.experiment.model, log)
    return Setup(cfg, out, model_dir, tasks, sync)


def resolve_adapter_sync(cfg: Config, log: Callable[[str], None]) -> str:
    """runtime.adapter_sync resolved (colora/engine/adapters.py): "memory" where it cannot work is a
    RunError; "auto" says why it goes by disk where it does."""
    try:
        mode, why = resolve(cfg.runtime.adapter_sync)
    except AdapterSyncUnsupported as e:
        raise RunError(str(e)) from None
    if mode == "disk" and cfg.runtime.adapter_sync == "auto":
        log(f"adapters go to the engine by disk: {why}")
    return mode


def adapter_scratch(out: Path) -> Path:
    """Where per-step adapters go between trainer and engine: tmpfs when there is one (no disk
    round trip), else inside the run directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="colora-adapters-", dir=shm))
    p = out / ".adapters"
    p.mkdir(parents=True, exist_ok=True)
    return p


def start_mps(cfg: Config, stack: contextlib.ExitStack, log: Callable[[str], None], process_mps, stop=None):
    """MPS for this run: the process-wide daemon if there is one, else our own for an MPS arm
    (stopped by `stack` after the engine; told to quit without waiting on a second signal of `stop`,
    a stopping.StopRequest), else none. Returns (daemon or None, note for the summary)."""
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
    if stop is not None:
        stack.enter_context(stop.on_abort(mps.quit_nowait))
    return mps, _claim_shares(mps, ov, note)


def _claim_shares(mps, ov, note: str) -> str:
    """This process's CUDA context with the trainer's share, before the engine's client can make it
    (with whatever share the environment said then), and the engine's share for the engine process
    spawned next. The note gains the SMs the trainer's context sees."""
    try:
        sms = mps.claim(ov.mps_trainer_percentage)
    except MpsShareError as e:
        raise RunError(str(e)) from None
    mps.set_share(ov.mps_engine_percentage)
    return note + (f" (trainer sees {sms} SMs)" if sms else "")
