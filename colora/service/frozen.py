"""Samplers' adapters in shared memory: each `save_for_sampler` of `colora serve`'s co-runner backend frozen
into a segment of its own that nothing writes again, which vLLM's worker maps and builds the adapter from
(colora/engine/adapters.py, the native run's in-memory path; colora/engine/rollout.py `register_snapshots`).

A segment is one file in a folder of the backend's own in /dev/shm (`colora-adapter-sync-*`, so a killed
server's folder is removed by the next colora's start, colora/run/preflight.py): the same layout as a
job's segment in a native run (HEADER bytes holding the version, then the tensors back to back in the
engine's dtype with the LoRA scale folded into B), written once, on the trainer's thread, by one copy from
the trainer's device. Unlike a job's segment it is never rewritten: a sampler never points at something
that can change. The file lives as long as its sampler (an engine started after the old one died
registers the sampler again from it) and goes when the sampler is released (`free`), after the engine has
let it go; the folder goes at `close`. Its pages are the host memory a sampler costs: about 20 MB for
Qwen3-0.6B at rank 16 on every projection in bf16.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

from colora.engine.adapters import HEADER, SHM, AdapterTensors, ShmFull


class FrozenAdapters:
    """The folder of a backend's frozen samplers; one lock guards its table (`freeze` runs on the trainer's
    thread, `free` on the engine's)."""

    def __init__(self, base_model: str, dtype: torch.dtype):
        self.base_model, self.dtype = str(base_model), dtype
        self.dir = Path(tempfile.mkdtemp(prefix="colora-adapter-sync-", dir=SHM))
        # held open for the folder's life: another colora's start keeps a folder that a live process holds
        self._hold: int | None = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        self._files: dict[str, Path] = {}  # sampler key -> its segment
        self._lock = threading.Lock()

    def freeze(self, bank, model_id: str, key: str) -> AdapterTensors:
        """Model `model_id`'s adapter now, into the new segment of sampler `key`. ShmFull where /dev/shm
        cannot hold it (nothing is left of it then)."""
        names, shapes, flat = bank.flat_adapter(model_id, self.dtype, fold_scale=True)  # flat: [elements]
        nbytes = flat.numel() * flat.element_size()
        path = self.dir / key
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # the pages reserved first: a write into a tmpfs that has run out kills the writer (SIGBUS)
            os.posix_fallocate(fd, 0, HEADER + nbytes)
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            if e.errno != errno.ENOSPC:
                raise
            raise ShmFull(f"{SHM} has {shutil.disk_usage(SHM).free / 2**20:.0f} MiB free, sampler {key} needs "
                          f"{nbytes / 2**20:.0f} MiB") from None
        os.close(fd)
        seg = torch.from_file(str(path), shared=True, size=HEADER + nbytes, dtype=torch.uint8)
        version = bank.jobs[model_id].version
        seg[:HEADER].view(torch.int64)[0] = -1
        seg[HEADER:].view(self.dtype).copy_(flat)  # from the GPU where the bank is there: synchronous
        seg[:HEADER].view(torch.int64)[0] = version
        del seg  # the file keeps the bytes; nothing of this process maps it any more
        with self._lock:
            self._files[key] = path
        return AdapterTensors(key, version, str(path), nbytes, str(self.dtype).removeprefix("torch."), tuple(names),
                              tuple(shapes), bank.peft_config(model_id, self.base_model, fold_scale=True))

    def free(self, key: str) -> None:
        """Sampler `key`'s segment goes (its engine has let it go); an unknown key does nothing."""
        with self._lock:
            path = self._files.pop(key, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def held(self) -> int:
        with self._lock:
            return len(self._files)

    def close(self) -> None:
        with self._lock:
            self._files.clear()
        if self._hold is not None:
            os.close(self._hold)
            self._hold = None
        shutil.rmtree(self.dir, ignore_errors=True)
