"""Checkpoints: every job's adapter, AdamW state, adapter version and data cursor, written atomically.

A checkpoint is taken on the trainer's thread between two training steps, when every job's state is
whole. Rollouts in flight at that moment are not saved: they are a function of (run seed, job, step,
adapter version) through per-request seeds, so a resumed run samples them again. Layout:

    checkpoints/step-000004/state.pt        torch.save of {jobs: {name: state}, ...}
    checkpoints/step-000004/manifest.json   sha256 and size of state.pt, the save counter, each job's step

A checkpoint is named by the steps every job has completed (the smallest job's), and where a
checkpoint of that name exists already (the dedicated arm runs its jobs one after another; a stopped
job stays at its step) by that and the save counter: `step-000000.3`. Their order is the save
counter's (`seq` in the manifest), never their names'. One is due when any job has done `every`
steps since the last one. A new checkpoint is built under a temporary name and renamed into place
after both files are fsynced, and only then are the oldest beyond `keep` removed: a crash at any
moment leaves the previous checkpoints whole and no folder that looks like a checkpoint but is not.
A damaged one (truncated, edited) fails its manifest check on load and the previous checkpoint is
used. A checkpoint is read with `torch.load(weights_only=True)`: tensors and plain values only, so a
run directory from someone else cannot run code through it.

The periodic checkpoints of a run are written in the background: the trainer's thread copies every
job's state to the CPU (the snapshot) and goes on training while a writer thread serialises, fsyncs
and hashes it (written on the trainer's thread, a checkpoint of 8 jobs of the throughput workload
held both groups for about 4 s on the H200, reports/ray_one_gpu). One write is in flight at most;
the next checkpoint, an on-demand one and the end of training wait for it (at most WRITE_TIMEOUT_S),
and a write that failed raises there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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
WRITE_TIMEOUT_S = 600.0  # the longest a wait for a background write lasts (a hung file system, say)
_NAME = re.compile(r"step-(\d+)(?:\.(\d+))?")


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seq(path: Path) -> int:
    """A checkpoint's save counter from its manifest; 0 where it has none (or none that reads)."""
    try:
        return int(json.loads((path / MANIFEST).read_text()).get("seq", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def checkpoints(root: Path) -> list[Path]:
    """The checkpoints under root/checkpoints, oldest first: by their save counter, then (for those
    without one) by the numbers in their names, compared as numbers."""
    found = []
    for p in (root / "checkpoints").glob("step-*"):
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir():
            found.append(((_seq(p), int(m[1]), int(m[2] or 0)), p))
    return [p for _, p in sorted(found)]


def save(root: Path, tag: int, state: dict, keep: int) -> Path:
    """Write a checkpoint of `state`, whose jobs have all done `tag` steps, under root/checkpoints
    atomically, under a name no checkpoint has; then keep the newest `keep` and remove what a killed
    write left (a hidden temporary folder). Returns its folder."""
    ckpts = root / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    seq = 1 + max((_seq(p) for p in checkpoints(root)), default=0)
    final = ckpts / f"step-{tag:06d}"
    while final.exists():
        final = ckpts / f"step-{tag:06d}.{seq}"
        seq += final.exists()
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=ckpts))
    try:
        with open(tmp / STATE, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        jobs = state["jobs"]
        manifest = {"file": STATE, "sha256": sha256_file(tmp / STATE), "bytes": (tmp / STATE).stat().st_size,
                    "tag": tag, "seq": seq, "steps": {n: s["step"] for n, s in jobs.items()},
                    "statuses": {n: s.get("status") for n, s in jobs.items()}}
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)  # a free name: nothing is replaced, so nothing is lost if this is the last act
        _fsync_dir(ckpts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoints(root)[:-keep]:
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


def newest_sound(root: Path) -> Path | None:
    """The newest checkpoint under root whose manifest verifies, or None."""
    for path in reversed(checkpoints(root)):
        try:
            verify(path)
            return path
        except CheckpointError:
            continue
    return None


def load_latest(root: Path, log: Callable[[str], None] = print) -> tuple[Path, dict] | None:
    """The newest checkpoint that verifies and loads, skipping damaged ones (each reported). Loaded
    with weights_only: a state.pt that holds anything but tensors and plain values is refused."""
    for path in reversed(checkpoints(root)):
        try:
            verify(path)
            state = torch.load(path / STATE, map_location="cpu", weights_only=True)
            return path, state
        except Exception as e:  # a damaged checkpoint: fall back to the previous one
            log(f"checkpoint {path.name} is unusable ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                "trying the previous one")
    return None


def _as_marks(steps: dict, statuses: dict) -> dict:
    """Each job's (step, status), as a Checkpointer compares them."""
    return {n: (steps[n], statuses.get(n)) for n in steps}


class Checkpointer:
    """Takes checkpoints for a run (when any job has done `every` steps since the last one, when
    training ends, and on demand; `every` 0: only on demand), keeps the newest `keep`, and restores
    one into a fresh bank and job states. The periodic ones are written in the background (module
    docstring); `save_now` and `finish` return with the checkpoint on disk."""

    def __init__(self, out: Path, cfg, bank, jobs: dict, every: int, keep: int, log: Callable[[str], None] = print,
                 timeline=None, gate=None):
        """timeline: a runlog.Timeline that gets a "checkpoint" span per snapshot (what holds the
        trainer's thread) and a "checkpoint_write" span per background write. gate: the time-slicing
        arm's (colora/timeslice/gate.py), inside whose grant every snapshot reads the trainer's state."""
        self.out, self.cfg, self.bank, self.jobs, self.log = out, cfg, bank, jobs, log
        self.every, self.keep, self.timeline, self.gate = every, keep, timeline, gate
        # each job's (step, status) in the newest checkpoint (taken or being written); none yet: step 0
        self._saved: dict = {n: (0, None) for n in jobs}
        self._written: dict = dict(self._saved)  # ... in the newest checkpoint on disk
        self._saved_path: Path | None = None
        self._writer: threading.Thread | None = None
        self._overdue = False  # the write in flight outlived a wait (WRITE_TIMEOUT_S)
        # the last write's (tag, path or error, seconds, marks), until logged
        self._result: tuple[int, Path | BaseException, float, dict] | None = None

    def state(self) -> dict:
        return {"config_hash": self.cfg.hash(),
                "jobs": {n: {"bank": self.bank.job_state(n), "step": js.step, "status": js.status,
                             "reason": js.reason} for n, js in self.jobs.items()}}

    def _snapshot(self) -> dict:
        """`state()`, copied to the CPU; in the time-slicing arm inside a grant, where another tenant's
        grant cannot PARK this trainer (emptying the tensors copied): the grant held now (a training step's),
        else one taken for it."""
        if self.gate is None or self.gate.holds:
            return self.state()
        with self.gate.phase("checkpoint"):
            return self.state()

    def _step(self) -> int:
        """The steps every job has completed: a checkpoint's tag."""
        return min((js.step for js in self.jobs.values()), default=0)

    def _marks(self) -> dict:
        return {n: (js.step, js.status) for n, js in self.jobs.items()}

    def _due(self) -> bool:
        return any(js.step - self._saved.get(n, (0, None))[0] >= self.every for n, js in self.jobs.items())

    def _span(self, phase: str):
        return self.timeline.span(phase) if self.timeline is not None else contextlib.nullcontext()

    def save_now(self) -> Path:
        """The checkpoint of every job's state now, on disk when it returns."""
        self.wait()
        marks = self._marks()
        with self._span("checkpoint"):
            path = save(self.out, self._step(), self._snapshot(), self.keep)
        self._saved = self._written = marks
        self._saved_path = path
        self.log(f"checkpoint {path.name} written")
        return path

    def maybe_save(self) -> None:
        """Called on the trainer's thread after every training step: when a checkpoint is due (a job
        has done `every` steps since the last one), the snapshot here and its write in the background."""
        if self._writer is not None and not self._writer.is_alive():
            self.wait()  # the last write ended: say so (or raise what stopped it) from this thread
        if self.every <= 0 or not self._due():
            return
        self.wait()
        tag, marks = self._step(), self._marks()
        with self._span("checkpoint"):
            state = self._snapshot()  # copies on the CPU: the next steps do not change them
        self._saved = marks
        self._writer = threading.Thread(target=self._write, args=(tag, state, marks), name="colora-checkpoint",
                                        daemon=True)  # a write hung in the file system must not hold the exit
        self._writer.start()

    def _write(self, tag: int, state: dict, marks: dict) -> None:
        t0 = time.perf_counter()
        try:
            with self._span("checkpoint_write"):
                path = save(self.out, tag, state, self.keep)
            self._result = (tag, path, time.perf_counter() - t0, marks)
        except BaseException as e:  # raised on the trainer's thread by the next wait()
            self._result = (tag, e, time.perf_counter() - t0, marks)

    def wait(self) -> None:
        """Returns when no checkpoint is being written, having logged the last one; raises
        CheckpointError if it failed, or is still not written after WRITE_TIMEOUT_S (the checkpoints
        before it are as they were). A write that outlived one wait stays the one in flight: every later
        wait raises at once while it lives, so no second write begins beside it in checkpoints/ (its
        sweep of torn folders would remove the first one's)."""
        writer = self._writer
        if writer is None:
            return
        writer.join(0.0 if self._overdue else WRITE_TIMEOUT_S)
        if writer.is_alive():
            self._saved, self._overdue = self._written, True
            raise CheckpointError(f"a checkpoint in {self.out / 'checkpoints'} is still being written after "
                                  f"{WRITE_TIMEOUT_S:.0f}s (a hung or very slow file system?); the checkpoints "
                                  "before it are as they were, and no other is written while it lasts")
        self._writer, self._overdue = None, False
        (tag, result, secs, marks), self._result = self._result, None
        if isinstance(result, BaseException):
            self._saved = self._written  # due again as if this one had never been taken
            raise CheckpointError(f"checkpoint step-{tag:06d} in {self.out / 'checkpoints'} could not be "
                                  f"written: {result}") from result
        self._written, self._saved_path = marks, result
        self.log(f"checkpoint {result.name} written (in {secs:.1f}s, in the background)")

    def close(self) -> None:
        """At the end of a run, also a failed one: the write in flight finishes first, and a failure of
        it is logged (not raised: the run may be ending with an error of its own)."""
        try:
            self.wait()
        except CheckpointError as e:
            self.log(str(e))

    def finish(self) -> Path | None:
        """When training has ended: the final state, unless checkpoints are off or a sound checkpoint
        holds it already (every job at the same step and status: the newest one this run wrote, or,
        after a resume, the one it restored; a run killed during its last evaluation then resumes to
        evaluate only)."""
        self.wait()
        if self.every <= 0:
            return None
        if self._marks() == self._written:
            if self._saved_path is not None and self._saved_path.exists():
                return None
            newest = newest_sound(self.out)
            if newest is not None and _as_marks(*_manifest_marks(newest)) == self._marks():
                return None
        return self.save_now()

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
        self._saved = self._written = self._marks()


def _manifest_marks(path: Path) -> tuple[dict, dict]:
    man = json.loads((path / MANIFEST).read_text())
    return man.get("steps", {}), man.get("statuses", {})


def rewind_logs(out: Path, state: dict) -> None:
    """Before a resume: keep the logs as they were (copied aside, nothing is lost) and start
    metrics.jsonl again from the rows the checkpoint covers, so each (job, step) appears once.
    metrics.jsonl is replaced in one rename, after its copy is in place: killed at any moment, it holds
    either every row it held or the rewound ones, and the next resume rewinds it again."""
    steps = {n: s["step"] for n, s in state["jobs"].items()}
    n = 0
    while (out / f"metrics.jsonl.pre-resume-{n}").exists():
        n += 1
    rows = read_jsonl(out / "metrics.jsonl")
    if (out / "metrics.jsonl").exists():
        _copy_atomic(out / "metrics.jsonl", out / f"metrics.jsonl.pre-resume-{n}")
    tmp = out / ".metrics.jsonl.rewind"
    with open(tmp, "w") as f:
        for r in rows:
            job, step = r.get("job"), r.get("step")
            if job in steps and step is not None and step >= steps[job]:
                continue  # done after the checkpoint: the resumed run does it again
            if job in steps and r.get("event") == "reload" and r.get("version", 0) > steps[job]:
                continue
            f.write(json.dumps(r, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / "metrics.jsonl")
    if (out / "timeline.jsonl").exists():  # the resumed run's timeline starts afresh
        os.replace(out / "timeline.jsonl", out / f"timeline.jsonl.pre-resume-{n}")


def _copy_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
