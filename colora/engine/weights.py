"""A full-parameter tenant's weights into its own vLLM engine, in memory, after every optimizer step.

A full-parameter job (`finetune = "full"`) has its own weights, trainer and engine. After each step the
trainer's side writes every weight of the new version, in the engine's dtype and under the Hugging Face
names the model's checkpoint uses, back to back into one shared-memory segment (`WeightsSegment`,
rewritten in place per version, its header holding the version as an adapter segment's does); the
engine sends vLLM's worker the segment's name, the names and the shapes (`LLM.collective_rpc`, a few KB),
and colora's worker extension (colora/engine/worker.py, `colora_load_weights`) hands views of the
mapped segment to vLLM's in-place reload. No file is written or read.

`FullEngine` is the engine of one such job: a `RolloutEngine` without LoRA, whose requests for the job
are served by the model itself and tagged with the version of the weights it holds, so that the
trainer's on-policy check holds as for a LoRA job. A new version is loaded only while no request is in
flight, and vLLM's prefix cache is emptied with it (its blocks are keyed by the tokens and a LoRA's
name, never by the base weights: a cached prompt would otherwise be served KV of the old weights).

The bytes are copied twice (into the segment from the trainer's device, and by vLLM's loader into each
parameter); on a GPU that is two transfers over the host of 2 bytes a parameter (CUDA IPC would skip
them: not built, it cannot be exercised without a GPU).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from colora.config import EngineConfig
from colora.engine.adapters import EXTENSION, HEADER, SHM
from colora.engine.rollout import RolloutEngine
from colora.engine.sampling import GenRequest


@dataclass(frozen=True)
class WeightsUpdate:
    """One version of a full-parameter job's weights in a shared-memory segment: what vLLM's worker
    needs to load it (`spec`)."""

    job: str
    version: int
    path: str  # the segment's file
    nbytes: int  # of the tensors, after HEADER
    dtype: str  # torch dtype name
    names: tuple[str, ...]  # the model's parameter names, as its checkpoint has them
    shapes: tuple[tuple[int, ...], ...]

    def spec(self) -> dict:
        """Plain values only: vLLM's collective_rpc carries its arguments as msgpack."""
        return {"job": self.job, "version": self.version, "path": self.path, "nbytes": self.nbytes,
                "dtype": self.dtype, "names": list(self.names), "shapes": [list(s) for s in self.shapes]}


class WeightsSegment:
    """The trainer's side: one segment for the job in a folder of its own in /dev/shm, held open for the
    folder's life and named as colora/training/export.py's (`colora-adapter-sync-*`: a killed run's folder is
    removed by the next colora's start, colora/run/preflight.py), rewritten in place for each version. The
    engine reads a version only after the write returned and before the trainer's next step, which trains
    on rollouts of that version: a write never meets a read."""

    def __init__(self, job: str):
        self.job = job
        self.dir = Path(tempfile.mkdtemp(prefix="colora-adapter-sync-weights-", dir=SHM))
        self._hold: int | None = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        self.path = self.dir / job.replace("/", "_")
        self._bytes: torch.Tensor | None = None

    def write(self, version: int, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> WeightsUpdate:
        """Write `named` (name, tensor) in `dtype` as `version`; returns what the engine loads."""
        shapes = [tuple(t.shape) for _, t in named]
        nbytes = sum(t.numel() for _, t in named) * torch.empty((), dtype=dtype).element_size()
        if self._bytes is None or self._bytes.numel() != HEADER + nbytes:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, HEADER + nbytes)  # a write into a full tmpfs would kill this process
            finally:
                os.close(fd)
            self._bytes = torch.from_file(str(self.path), shared=True, size=HEADER + nbytes, dtype=torch.uint8)
        held = self._bytes[:HEADER].view(torch.int64)
        held[0] = -1
        flat = self._bytes[HEADER:].view(dtype)
        at = 0
        with torch.no_grad():
            for _, t in named:
                n = t.numel()
                flat[at:at + n].view(t.shape).copy_(t)  # from the trainer's device, synchronous
                at += n
        held[0] = version
        return WeightsUpdate(self.job, version, str(self.path), nbytes, str(dtype).removeprefix("torch."),
                             tuple(n for n, _ in named), tuple(shapes))

    def close(self) -> None:
        self._bytes = None
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None
        shutil.rmtree(self.dir, ignore_errors=True)


class FullEngine(RolloutEngine):
    """The engine of one full-parameter job `job` (module docstring): vLLM without LoRA, with colora's
    worker extension. Requests name the job (or None, for the warm-up); results carry the version of
    the weights that produced them. Its client runs in the trainer's process."""

    def __init__(self, model_dir: str, cfg: EngineConfig, *, job: str, dtype: str, seed: int, device: str,
                 engine_args: dict[str, Any] | None = None):
        args = {"enable_lora": False, "worker_extension_cls": EXTENSION, **(engine_args or {})}
        if args["worker_extension_cls"] != EXTENSION:
            raise ValueError(f"a full-parameter engine loads its weights through {EXTENSION}, not "
                             f"{args['worker_extension_cls']}")
        # adapter_sync "disk": no adapter is loaded, so the LoRA path's own checks have nothing to check
        super().__init__(model_dir, cfg, max_loras=1, max_lora_rank=1, dtype=dtype, seed=seed, device=device,
                         adapter_sync="disk", engine_args=args)
        self.adapter_sync, self.adapter_sync_note = "weights", "full-parameter weights through shared memory"
        self.job = job
        self._version = 0  # the weights the engine holds: the model directory's are the job's version 0
        self._owner: dict[Any, tuple[int, list[str | None]]] = {}  # batch -> (version, each result's job)
        self.loads: list[float] = []  # seconds of each weight load

    def version(self, job: str) -> int:
        if job != self.job:
            raise KeyError(f"job {job!r} has no weights in the engine of {self.job!r}")
        return self._version

    def set_adapters(self, adapters: list) -> float:
        """Load the job's newest weights version (`WeightsUpdate`s, the last one wins), then empty vLLM's
        prefix cache. Refused while a request is in flight. Returns the seconds it took."""
        t0 = time.perf_counter()
        for a in adapters:
            if not isinstance(a, WeightsUpdate) or a.job != self.job:
                raise ValueError(f"the engine of full-parameter job {self.job!r} loads its WeightsUpdates only, "
                                 f"not {type(a).__name__} of {getattr(a, 'job', None)!r}")
        if not adapters:
            return 0.0
        if self.busy():
            raise ValueError(f"job {self.job!r}: requests are in flight; loading new weights would change "
                             "the policy under them")
        update = adapters[-1]
        errors = self._core("load_weights", self.llm.collective_rpc, "colora_load_weights", None,
                            (update.spec(),))
        why = next((e for e in errors if e), "")
        if why:
            raise RuntimeError(f"vLLM's worker did not load the weights: {why}")
        if not self._core("reset_prefix_cache", self.llm.llm_engine.reset_prefix_cache):
            raise RuntimeError(f"job {self.job!r}: vLLM kept its prefix cache after a weight load (a block in use)")
        self._version = update.version
        self.loads.append(time.perf_counter() - t0)
        return self.loads[-1]

    def submit(self, key: Any, requests: list[GenRequest]) -> None:
        """As RolloutEngine's, for requests of this job (served by the model) or of None (the warm-up)."""
        jobs = []
        for r in requests:
            if r.snapshot is not None or r.job not in (None, self.job):
                raise KeyError(f"the engine of full-parameter job {self.job!r} serves that job only, not "
                               f"{r.snapshot or r.job!r}")
            jobs += [r.job] * r.n
        super().submit(key, [dataclasses.replace(r, job=None) for r in requests])
        self._owner[key] = (self._version, jobs)

    def poll(self):
        done = super().poll()
        for key, results in done:
            version, jobs = self._owner.pop(key, (self._version, [None] * len(results)))
            for res, job in zip(results, jobs):
                if job is not None:
                    res.request, res.version = dataclasses.replace(res.request, job=job), version
        return done

    def drop(self, job: str) -> None:
        """The job stopped: its requests in flight are aborted (each comes back as an "abort" result)."""
        if job == self.job:
            self._abort(lambda r: True)

    def abort_all(self) -> list:
        keys = super().abort_all()
        self._owner.clear()
        return keys
