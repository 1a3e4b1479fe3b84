"""Checkpoints: every job's adapter, AdamW state, adapter version and data cursor, written atomically.

A checkpoint is taken on the trainer's thread between two training steps, when every job's state is
whole. Rollouts in flight at that moment are not saved: they are a function of (run seed, job, step,
adapter version) through per-request seeds, so a resumed run samples them again. Layout:

    checkpoints/step-000004/state.pt        torch.save of {jobs: {name: state}, ...}
    checkpoints/step-000004/manifest.json   sha256 and size of state.pt, written after it

The folder is built under a temporary name and renamed into place after both files are fsynced, so
a crash mid-write leaves no folder that looks like a checkpoint; a damaged one (truncated, edited)
fails its manifest check on load and the previous checkpoint is used.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .runlog import sha256_file

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
    """Write checkpoint `tag` under root/checkpoints atomically; keep the newest `keep`."""
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
    fresh bank and job states."""

    def __init__(self, out: Path, cfg, bank, jobs: dict, every: int, keep: int, log: Callable[[str], None] = print,
                 timeline=None):
        """timeline: a runlog.Timeline that gets a "checkpoint" span per checkpoint written."""
        self.out, self.cfg, self.bank, self.jobs, self.log = out, cfg, bank, jobs, log
        self.every, self.keep, self.timeline = every, keep, timeline
        self.last = min((js.step for js in jobs.values()), default=0)

    def state(self) -> dict:
        return {"config_hash": self.cfg.hash(),
                "jobs": {n: {"bank": self.bank.job_state(n), "step": js.step, "status": js.status,
                             "reason": js.reason} for n, js in self.jobs.items()}}

    def save_now(self) -> Path:
        tag = min(js.step for js in self.jobs.values())
        with self.timeline.span("checkpoint") if self.timeline is not None else contextlib.nullcontext():
            path = save(self.out, tag, self.state(), self.keep)
        self.last = tag
        self.log(f"checkpoint {path.name} written")
        return path

    def maybe_save(self) -> None:
        """Called on the trainer's thread after every training step."""
        if self.every <= 0:
            return
        live = [js.step for js in self.jobs.values() if js.status != "stopped"]
        if live and min(live) >= self.last + self.every:
            self.save_now()

    def finish(self) -> Path | None:
        """When training has ended: the final state, unless checkpoints are off or the newest one
        holds it already (a run killed during its last evaluation then resumes to evaluate only)."""
        if self.every <= 0:
            return None
        tag = min(js.step for js in self.jobs.values())
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
        self.last = min(js.step for js in self.jobs.values())


def rewind_logs(out: Path, state: dict) -> None:
    """Before a resume: keep the logs as they were (renamed, nothing is lost) and start metrics.jsonl
    again from the rows the checkpoint covers, so each (job, step) appears once."""
    from .runlog import read_jsonl

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
