"""Checkpoints: every job's adapter, AdamW state, adapter version and data cursor, written atomically.

A checkpoint is taken on the trainer's thread between two training steps, when every job's state is
whole. Rollouts in flight at that moment are not saved: they are a function of (run seed, job, step,
adapter version) through per-request seeds, so a resumed run samples them again. Layout:

    checkpoints/step-000004/state.pt        torch.save of {jobs: {name: state}, ...}
    checkpoints/step-000004/manifest.json   sha256 and size of state.pt, written after it

The folder is built under a temporary name and renamed into place after both files are fsynced, so
a crash mid-write leaves no folder that looks like a checkpoint; a damaged one (truncated, edited)
fails its manifest check on load and the previous checkpoint is used.

The periodic checkpoints of a run are written in the background: the trainer's thread copies every
job's state to the CPU (the snapshot) and goes on training while a writer thread serialises, fsyncs
and hashes it (written on the trainer's thread, a checkpoint of 8 jobs of the throughput workload
held both groups for about 4 s on the H200, reports/ray_one_gpu). One write is in flight at most;
the next checkpoint, an on-demand one and the end of training wait for it, and a write that failed
raises there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from colora.record.runlog import read_jsonl, sha256_file

STATE = "state.pt"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, tag: int, state: dict, keep: int) -> Path:
    """Write checkpoint `tag` under root/checkpoints atomically; keep the newest `keep` and remove
    what a killed write left (a hidden temporary folder)."""
    ckpts = root / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    final = ckpts / f"step-{tag:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=ckpts))
    try:
        with open(tmp / STATE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        manifest = {"file": STATE, "sha256": sha256_file(tmp / STATE), "bytes": (tmp / STATE).stat().st_size,
                    "tag": tag, "steps": {n: s["step"] for n, s in state["jobs"].items()}}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # a checkpoint of this tag from before a resume: replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(ckpts.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for torn in ckpts.glob(".step-*"):  # a write a killed process left half done (one write at a time)
        shutil.rmtree(torn, ignore_errors=True)
    return final


def verify(path: Path) -> dict:
    """The manifest of a sound checkpoint; raises CheckpointError naming what is wrong."""
    man_p, st_p = path / MANIFEST, path / STATE
    if not man_p.is_file() or not st_p.is_file():
        raise CheckpointError(f"{path}: incomplete (missing {MANIFEST if not man_p.is_file() else STATE})")
    try:
        man = json.loads(man_p.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{man_p}: not valid JSON ({e})") from None
    size = st_p.stat().st_size
    if size != man.get("bytes"):
        raise CheckpointError(f"{st_p}: {size} bytes, the manifest says {man.get('bytes')} (truncated?)")
    if sha256_file(st_p) != man.get("sha256"):
        raise CheckpointError(f"{st_p}: sha256 does not match the manifest (damaged)")
    return man


def load_latest(root: Path, log: Callable[[str], None] = print) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies and loads, skipping damaged ones (each reported)."""
    for path in sorted((root / "checkpoints").glob("step-*"), reverse=True):
        try:
            verify(path)
            state = torch.load(path / STATE, map_location="cpu", weights_only=False)
            return path, state
        except Exception as e:  # a damaged checkpoint: fall back to the previous one
            log(f"checkpoint {path.name} is unusable ({e}); trying the previous one")
    return None


class Checkpointer:
    """Takes checkpoints for a run (every `every` steps of its slowest running job, when training
    ends, and on demand; `every` 0: only on demand), keeps the newest `keep`, and restores one into a
    fresh bank and job states. The periodic ones are written in the background (module docstring);
    `save_now` and `finish` return with the checkpoint on disk."""

    def __init__(self, out: Path, cfg, bank, jobs: dict, every: int, keep: int, log: Callable[[str], None] = print,
                 timeline=None):
        """timeline: a runlog.Timeline that gets a "checkpoint" span per snapshot (what holds the
        trainer's thread) and a "checkpoint_write" span per background write."""
        self.out, self.cfg, self.bank, self.jobs, self.log = out, cfg, bank, jobs, log
        self.every, self.keep, self.timeline = every, keep, timeline
        self.last = self._step()
        self._writer: threading.Thread | None = None
        self._result: tuple[int, Path | BaseException, float] | None = None  # the last write's, until logged

    def state(self) -> dict:
        return {"config_hash": self.cfg.hash(),
                "jobs": {n: {"bank": self.bank.job_state(n), "step": js.step, "status": js.status,
                             "reason": js.reason} for n, js in self.jobs.items()}}

    def _step(self) -> int:
        """The steps every job has completed: a checkpoint's tag."""
        return min((js.step for js in self.jobs.values()), default=0)

    def _span(self, phase: str):
        return self.timeline.span(phase) if self.timeline is not None else contextlib.nullcontext()

    def save_now(self) -> Path:
        """The checkpoint of every job's state now, on disk when it returns."""
        self.wait()
        tag = self._step()
        with self._span("checkpoint"):
            path = save(self.out, tag, self.state(), self.keep)
        self.last = tag
        self.log(f"checkpoint {path.name} written")
        return path

    def maybe_save(self) -> None:
        """Called on the trainer's thread after every training step: when a checkpoint is due, the
        snapshot here and its write in the background."""
        if self._writer is not None and not self._writer.is_alive():
            self.wait()  # the last write ended: say so (or raise what stopped it) from this thread
        if self.every <= 0:
            return
        live = [js.step for js in self.jobs.values() if js.status != "stopped"]
        if not live or min(live) < self.last + self.every:
            return
        self.wait()
        tag = self._step()
        with self._span("checkpoint"):
            state = self.state()  # copies on the CPU: the next steps do not change them
        self.last = tag
        self._writer = threading.Thread(target=self._write, args=(tag, state), name="colora-checkpoint")
        self._writer.start()

    def _write(self, tag: int, state: dict) -> None:
        t0 = time.perf_counter()
        try:
            with self._span("checkpoint_write"):
                path = save(self.out, tag, state, self.keep)
            self._result = (tag, path, time.perf_counter() - t0)
        except BaseException as e:  # raised on the trainer's thread by the next wait()
            self._result = (tag, e, time.perf_counter() - t0)

    def wait(self) -> None:
        """Returns when no checkpoint is being written, having logged the last one; raises
        CheckpointError if it failed (the checkpoints before it are as they were)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        writer.join()
        (tag, result, secs), self._result = self._result, None
        if isinstance(result, BaseException):
            raise CheckpointError(f"checkpoint step-{tag:06d} in {self.out / 'checkpoints'} could not be "
                                  f"written: {result}") from result
        self.log(f"checkpoint {result.name} written (in {secs:.1f}s, in the background)")

    def close(self) -> None:
        """At the end of a run, also a failed one: the write in flight finishes first, and a failure of
        it is logged (not raised: the run may be ending with an error of its own)."""
        try:
            self.wait()
        except CheckpointError as e:
            self.log(str(e))

    def finish(self) -> Path | None:
        """When training has ended: the final state, unless checkpoints are off or the newest one
        holds it already (a run killed during its last evaluation then resumes to evaluate only)."""
        self.wait()
        if self.every <= 0:
            return None
        tag = self._step()
        latest = self.out / "checkpoints" / f"step-{tag:06d}"
        return None if tag == self.last and latest.exists() else self.save_now()

    def restore(self, state: dict) -> None:
        if state.get("config_hash") != self.cfg.hash():
            raise CheckpointError(f"checkpoint is of config {state.get('config_hash')}, the run's is {self.cfg.hash()}")
        missing = set(self.jobs) - set(state["jobs"])
        if missing:
            raise CheckpointError(f"checkpoint has no state for job(s) {sorted(missing)}")
        for name, js in self.jobs.items():
            st = state["jobs"][name]
            self.bank.load_job_state(name, st["bank"])
            js.step, js.status, js.reason = st["step"], st["status"], st["reason"]
        self.last = self._step()


def rewind_logs(out: Path, state: dict) -> None:
    """Before a resume: keep the logs as they were (renamed, nothing is lost) and start metrics.jsonl
    again from the rows the checkpoint covers, so each (job, step) appears once."""
    steps = {n: s["step"] for n, s in state["jobs"].items()}
    n = 0
    while (out / f"metrics.jsonl.pre-resume-{n}").exists():
        n += 1
    for name in ("metrics.jsonl", "timeline.jsonl"):
        if (out / name).exists():
            os.replace(out / name, out / f"{name}.pre-resume-{n}")
    rows = read_jsonl(out / f"metrics.jsonl.pre-resume-{n}")
    with open(out / "metrics.jsonl", "w") as f:
        for r in rows:
            job, step = r.get("job"), r.get("step")
            if job in steps and step is not None and step >= steps[job]:
                continue  # done after the checkpoint: the resumed run does it again
            if job in steps and r.get("event") == "reload" and r.get("version", 0) > steps[job]:
                continue
            f.write(json.dumps(r, sort_keys=True) + "\n")
