"""What a run builds for its jobs: LoRA jobs' shared engine and trainer, or a full-parameter job's own.

The runner (colora/run/runner.py) asks here for its memory plan, its engine, its trainer and its export, so
that one code path runs both kinds (colora/tenancy.py says where a full-parameter job may run: alone in its
run). A full-parameter run has:
- an engine of its own without LoRA (colora/engine/weights.py `FullEngine`), its client in the run's
  process, never kept for another run (its weights are the job's);
- the job's trainer over all its weights (colora/training/full.py) and the hand-off of each version's
  weights to the engine through shared memory (`FullExport`);
- on a GPU, run/memory.py's plan with the trainer's full state (`full.state_bytes`: the weights' gradient,
  two AdamW moments and fp32 masters, beyond the weights the plan counts) taken off the free memory it
  plans with. On the CPU the plan is run/memory.py's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from colora.config import Config
from colora.engine.process import RemoteEngine
from colora.engine.rollout import RolloutEngine
from colora.engine.weights import FullEngine
from colora.models.shape import ModelShape
from colora.run import memory
from colora.run.preflight import RunError
from colora.tenancy import is_full
from colora.training.export import AdapterExport
from colora.training.full import FullExport, build_full_trainer, state_bytes
from colora.training.trainer import build_trainer

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def plan(cfg: Config, model_dir: str | Path, device: str, dtype: str, slots: int,
         log: Callable[[str], None]) -> Config:
    """`cfg` with its memory planned (run/memory.py `planned`); for a full-parameter job on a GPU, with its
    trainer's state beyond its weights taken off the free memory (module docstring)."""
    if not is_full(cfg) or device != "cuda":
        return memory.planned(cfg, model_dir, device, dtype, slots, log)
    size = DTYPE_BYTES[dtype]
    try:
        shape = ModelShape.from_dir(model_dir)
    except (OSError, ValueError) as e:
        raise RunError(f"memory: {e}; set engine.gpu_memory_utilization and trainer.micro_batch_tokens") from None
    extra = state_bytes(shape.parameters(), size) - shape.weight_bytes(size)
    dev = memory.device_memory(device)
    seen = dataclasses.replace(dev, free=dev.free - extra)
    p = memory.plan(cfg, shape, seen, slots, size)
    log(f"{memory.describe(p, cfg)}; the full-parameter trainer's gradient, AdamW state and masters take "
        f"{extra / memory.GIB:.1f} GiB more (off the free memory above)")
    return dataclasses.replace(
        cfg, engine=dataclasses.replace(cfg.engine, gpu_memory_utilization=p.gpu_memory_utilization),
        trainer=dataclasses.replace(cfg.trainer, micro_batch_tokens=p.fit.micro_batch_tokens,
                                    gradient_checkpointing=p.fit.gradient_checkpointing,
                                    logprob_chunk=p.fit.logprob_chunk))


def cacheable(cfg: Config) -> bool:
    """Whether the run's engine may be kept for the next run (not a full-parameter job's: its weights move)."""
    return not is_full(cfg)


def engine_kind(cfg: Config, remote: bool) -> Callable:
    """What the runner calls, with RolloutEngine's arguments, to start the run's engine."""
    if not is_full(cfg):
        return RemoteEngine if remote else RolloutEngine
    job = cfg.jobs[0].name

    def start(model_dir: str, engine, *, max_loras: int, max_lora_rank: int, dtype: str, seed: int, device: str,
              adapter_sync: str, engine_args: dict | None = None) -> FullEngine:
        return FullEngine(model_dir, engine, job=job, dtype=dtype, seed=seed, device=device, engine_args=engine_args)

    return start


def build(cfg: Config, model_dir: Path, device: str, dtype, pad_id: int):
    """(bank, trainer) of the run's jobs (colora/training/trainer.py `build_trainer`, or full.py's)."""
    return (build_full_trainer if is_full(cfg) else build_trainer)(cfg, model_dir, device, dtype, pad_id)


def export_for(cfg: Config, engine, model_dir: str, scratch: Path):
    """The trainer's side of the hand-off: each job's new adapter (training/export.py), or the weights."""
    if is_full(cfg):
        return FullExport(engine.dtype)
    return AdapterExport(engine.adapter_sync, engine.dtype, model_dir, scratch)
