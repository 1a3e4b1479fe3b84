"""The trainer's side of the adapter hand-off: each new adapter version as the engine takes it.

`AdapterExport.export(bank, job)` writes the job's current adapter in the engine's dtype with the LoRA
scale folded into B (`AdapterBank.flat_adapter`) and returns what the engine's client loads
(colora/engine/adapters.py): with in-memory sync an `AdapterTensors` naming the job's shared-memory
segment, which it rewrites in place per version; with disk sync, and for a version that a full
/dev/shm cannot hold, an `AdapterDir`, a PEFT directory under `disk_root/<job>/v<version>`. It runs on
the trainer's thread (its device copy belongs with the trainer's work) and touches nothing of vLLM's,
so it may run while the engine's thread uses the engine.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from colora.engine.adapters import HEADER, SHM, AdapterDir, AdapterTensors, ShmFull


class AdapterExport:
    """mode: "memory" or "disk" (`runtime.adapter_sync` resolved, colora/engine/adapters.py); dtype: the
    engine's; base_model: the base model's directory, named in each adapter's PEFT config."""

    def __init__(self, mode: str, dtype: str, base_model: str, disk_root: Path):
        if mode not in ("memory", "disk"):
            raise ValueError(f"adapter export mode {mode!r}: expected 'memory' or 'disk'")
        self.mode = mode
        self.dtype = getattr(torch, dtype)
        self.base_model = str(base_model)
        self.disk_root = Path(disk_root)
        self.note = ""  # why a version went by disk where memory was asked for
        self._shared: SharedAdapters | None = None  # made at the first in-memory export

    def export(self, bank, job: str) -> AdapterTensors | AdapterDir:
        version = bank.jobs[job].version
        if self.mode == "memory":
            if self._shared is None:
                self._shared = SharedAdapters()
            try:
                return self._shared.write(bank, job, self.dtype, self.base_model)
            except ShmFull as e:
                self.note = f"version {version} of {job} went by disk: {e}"
        out = bank.export_peft(job, self.disk_root / job / f"v{version}", self.base_model, self.dtype, fold_scale=True)
        return AdapterDir(job, version, str(out))

    def release(self, job: str) -> None:
        """The job is gone from the engine: its segment goes."""
        if self._shared is not None:
            self._shared.release(job)

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.close()


class SharedAdapters:
    """The trainer's side: one shared-memory segment per job, in a directory of its own in /dev/shm,
    rewritten in place for each version of the job. The engine's client unlinks a segment's file once
    vLLM's worker has mapped it (colora/engine/adapters.py: `unlink_segment`); one lock guards the table.

    A version's bytes stay in the segment until the job's next write: the worker copies them out when
    it loads the version, and a job's next version is trained on rollouts of the loaded one. The
    header holds the version the segment holds (-1 while a write is under way), which the worker
    checks before and after its copy, so a load never builds an adapter from another version's
    bytes or from a half-written one."""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="colora-adapter-sync-", dir=SHM))
        # Held open for the folder's life: another colora's start keeps a folder that a live process holds
        # (colora/run/preflight.py), also while no job has a segment in it (a service all of whose tenants left).
        self._hold = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        self._segments: dict[str, tuple[Path, torch.Tensor]] = {}  # job -> (its file, its bytes)
        self._made = 0
        self._lock = threading.Lock()

    def _segment(self, job: str, size: int) -> tuple[Path, torch.Tensor]:
        with self._lock:
            seg = self._segments.get(job)
            if seg is not None and seg[1].numel() == size:
                return seg
            if seg is not None:  # the job came back with another shape (a cached engine's next run)
                seg[0].unlink(missing_ok=True)
            self._made += 1
            path = self.dir / f"{self._made}-{job.replace('/', '_')}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                # Reserve the pages now: a write into tmpfs that has run out kills the writer (SIGBUS).
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                path.unlink(missing_ok=True)
                if e.errno != errno.ENOSPC:
                    raise
                raise ShmFull(f"{SHM} has {shutil.disk_usage(SHM).free / 2**20:.0f} MiB free, job {job}'s "
                              f"adapter needs {size / 2**20:.0f} MiB") from None
            finally:
                os.close(fd)
            seg = self._segments[job] = (path, torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8))
            return seg

    def write(self, bank, job: str, dtype: torch.dtype, base_model: str) -> AdapterTensors:
        """Write `job`'s current adapter (in `dtype`, its scale folded into B) into its segment."""
        names, shapes, flat = bank.flat_adapter(job, dtype, fold_scale=True)
        nbytes = flat.numel() * flat.element_size()
        path, seg = self._segment(job, HEADER + nbytes)
        held = seg[:HEADER].view(torch.int64)
        version = bank.jobs[job].version
        held[0] = -1
        seg[HEADER:].view(dtype).copy_(flat)  # from the GPU where the bank is there: synchronous
        held[0] = version
        return AdapterTensors(job, version, str(path), nbytes, str(dtype).removeprefix("torch."), tuple(names),
                              tuple(shapes), bank.peft_config(job, base_model, fold_scale=True))

    def release(self, job: str) -> None:
        with self._lock:
            seg = self._segments.pop(job, None)
        if seg is not None:
            seg[0].unlink(missing_ok=True)

    def close(self) -> None:
        for job in list(self._segments):
            self.release(job)
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None
        shutil.rmtree(self.dir, ignore_errors=True)
