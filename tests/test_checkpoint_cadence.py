"""Checkpoints (colora/run/checkpoint.py): when one is due, what it is named, that the previous one
stays until the new one is in place, that a resumed run's interruption saves what it did, that a
checkpoint cannot run code, and the rewind of the logs before a resume. A fake adapter bank: no
model, no engine."""

from __future__ import annotations

import json
import os
import pickle
import threading
from pathlib import Path

import pytest
import torch

from colora.config import load_config
from colora.run import checkpoint
from colora.run.checkpoint import Checkpointer, CheckpointError, checkpoints, load_latest, rewind_logs, save

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"


class _Job:
    def __init__(self, step=0, status="running"):
        self.step, self.status, self.reason = step, status, ""


class _Bank:
    """What a Checkpointer asks of the adapter bank: each job's state, as plain tensors and values."""

    def __init__(self, jobs):
        self.jobs = jobs
        self.loaded = {}

    def job_state(self, name):
        return {"A": {"w": torch.full((2,), float(self.jobs[name].step))}, "version": self.jobs[name].step,
                "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99)}]}}

    def load_job_state(self, name, state):
        self.loaded[name] = state


def _checkpointer(tmp_path, jobs, every, keep=10, said=None):
    return Checkpointer(tmp_path, load_config(SMOKE), _Bank(jobs), jobs, every, keep,
                        log=(said.append if said is not None else lambda s: None))


def _steps(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())["steps"]


def _train(ck, jobs, name, n):
    """`n` steps of one job, the checkpoint hook after each, as the co-runner calls it."""
    for _ in range(n):
        jobs[name].step += 1
        ck.maybe_save()
    ck.wait()


# -- when a checkpoint is due, and its name -----------------------------------------------------------
def test_the_dedicated_arm_checkpoints_each_job_as_it_runs(tmp_path):
    """Jobs one after another, as the dedicated arm runs them: the first jobs get their periodic
    checkpoints while they run (the smallest step over all jobs is still 0), each under a name of
    its own, in the order they were written."""
    jobs = {"a": _Job(), "b": _Job(), "c": _Job()}
    ck = _checkpointer(tmp_path, jobs, every=2)
    _train(ck, jobs, "a", 4)
    jobs["a"].status = "done"
    _train(ck, jobs, "b", 3)
    written = checkpoints(tmp_path)
    assert [_steps(p) for p in written] == [{"a": 2, "b": 0, "c": 0}, {"a": 4, "b": 0, "c": 0},
                                            {"a": 4, "b": 2, "c": 0}]
    assert len({p.name for p in written}) == 3
    assert load_latest(tmp_path, log=lambda s: None)[1]["jobs"]["b"]["step"] == 2


def test_a_stopped_job_does_not_make_every_step_a_checkpoint(tmp_path, monkeypatch):
    """A job stopped at step 1 stays at step 1: the others still checkpoint every 3 of their steps,
    not after each one, and no checkpoint replaces another."""
    jobs = {"a": _Job(1, "stopped"), "b": _Job(1)}
    ck = _checkpointer(tmp_path, jobs, every=3)
    ck.save_now()
    calls = []
    real = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    _train(ck, jobs, "b", 6)
    assert len(calls) == 2, calls  # at b's steps 4 and 7
    assert [_steps(p)["b"] for p in checkpoints(tmp_path)] == [1, 4, 7]


def test_names_order_as_numbers_and_by_the_save_counter(tmp_path):
    """step-1000000 is newer than step-999999 (as strings it sorts first), with the save counter or,
    in checkpoints written before it existed, by the number in the name."""
    for tag in (999999, 1000000):
        save(tmp_path, tag, {"jobs": {"a": {"step": tag, "status": "running"}}}, keep=5)
    assert load_latest(tmp_path, log=lambda s: None)[0].name == "step-1000000"
    for p in checkpoints(tmp_path):  # as an older colora wrote them: no save counter
        man = json.loads((p / "manifest.json").read_text())
        del man["seq"]
        (p / "manifest.json").write_text(json.dumps(man))
    assert [p.name for p in checkpoints(tmp_path)] == ["step-999999", "step-1000000"]
    assert load_latest(tmp_path, log=lambda s: None)[0].name == "step-1000000"


def test_a_kill_while_a_checkpoint_lands_leaves_the_previous_one(tmp_path, monkeypatch):
    """The process dies just as the new checkpoint would take its place (here: the rename raises):
    the checkpoint before it is whole and loads, also when the new one has the same step (the
    dedicated arm's smallest step, a stopped job's)."""
    jobs = {"a": _Job(2), "b": _Job(0)}
    ck = _checkpointer(tmp_path, jobs, every=1)
    first = ck.save_now()

    class Killed(BaseException):
        pass

    def killed(*a, **k):
        raise Killed()

    jobs["a"].step = 3
    monkeypatch.setattr(os, "replace", killed)
    monkeypatch.setattr(os, "rename", killed)
    with pytest.raises(Killed):
        ck.save_now()
    monkeypatch.undo()
    path, state = load_latest(tmp_path, log=lambda s: None)
    assert path == first and state["jobs"]["a"]["step"] == 2


# -- resume and the end of training ---------------------------------------------------------------
def test_after_a_resume_an_interruption_saves_the_steps_done_since(tmp_path):
    """A dedicated run of three jobs resumed from a checkpoint with jobs b and c at step 0: b does
    one step (no periodic checkpoint due; the smallest step is still 0), then the run is stopped.
    finish() writes that step, and the newest checkpoint has it: the run's status then names a
    checkpoint that holds what it says."""
    jobs = {"a": _Job(4, "done"), "b": _Job(0), "c": _Job(0)}
    _checkpointer(tmp_path, jobs, every=5).save_now()
    _, state = load_latest(tmp_path, log=lambda s: None)
    jobs2 = {"a": _Job(), "b": _Job(), "c": _Job()}
    ck = _checkpointer(tmp_path, jobs2, every=5)
    ck.restore(state)
    assert ck.finish() is None  # nothing done since the checkpoint it restored: nothing to write
    jobs2["b"].step = 1
    ck.maybe_save()
    path = ck.finish()
    assert path is not None and _steps(path) == {"a": 4, "b": 1, "c": 0}
    assert load_latest(tmp_path, log=lambda s: None)[0] == path


def test_a_hung_write_ends_the_wait_after_its_timeout(tmp_path, monkeypatch):
    """A write that never returns (a hung file system): the wait for it raises after
    WRITE_TIMEOUT_S instead of holding the run for ever."""
    jobs = {"a": _Job()}
    ck = _checkpointer(tmp_path, jobs, every=1)
    gate = threading.Event()
    monkeypatch.setattr(checkpoint, "save", lambda *a, **k: gate.wait(60))
    monkeypatch.setattr(checkpoint, "WRITE_TIMEOUT_S", 0.2)
    jobs["a"].step = 1
    ck.maybe_save()
    raised = []

    def waiting():
        try:
            ck.wait()
        except CheckpointError as e:
            raised.append(e)

    t = threading.Thread(target=waiting, daemon=True)
    try:
        t.start()
        t.join(30)
        assert not t.is_alive(), "the wait for a hung checkpoint write did not end"
        assert raised and "still being written" in str(raised[0])
    finally:
        gate.set()


def test_no_second_write_begins_beside_a_hung_one(tmp_path, monkeypatch):
    """After the wait for a hung write gave up, the run's failure path asks for a checkpoint: it is
    refused at once while the hung write lives (a second writer in the same checkpoints/ would sweep the
    first one's temporary folder as torn), and the checkpoints go on once that write has ended."""
    jobs = {"a": _Job()}
    said = []
    ck = _checkpointer(tmp_path, jobs, every=1, said=said)
    hung, calls = threading.Event(), []
    real = checkpoint.save

    def save(*a, **k):
        calls.append(a[1])
        if len(calls) == 1:
            hung.wait(60)
        return real(*a, **k)

    monkeypatch.setattr(checkpoint, "save", save)
    monkeypatch.setattr(checkpoint, "WRITE_TIMEOUT_S", 0.2)
    jobs["a"].step = 1
    ck.maybe_save()
    try:
        with pytest.raises(CheckpointError, match="still being written"):
            ck.wait()
        jobs["a"].step = 2
        with pytest.raises(CheckpointError, match="still being written"):
            ck.save_now()
        with pytest.raises(CheckpointError, match="still being written"):
            ck.finish()
        assert calls == [1], "a second write began beside the hung one"
    finally:
        hung.set()
    for t in threading.enumerate():
        if t.name == "colora-checkpoint":
            t.join(30)
    path = ck.save_now()  # the hung write has ended (and is logged): checkpoints go on
    assert calls == [1, 2] and [_steps(p)["a"] for p in checkpoints(tmp_path)] == [1, 2] and path.name == "step-000002"


# -- the time-slicing arm: a snapshot reads the trainer's state inside a grant --------------------------
def test_a_snapshot_taken_outside_a_grant_takes_one_and_one_inside_uses_it(tmp_path):
    """In the time-slicing arm another tenant's grant may PARK this one's trainer, emptying its tensors:
    the end of training's and a failure's checkpoints (outside any grant) take one around the snapshot;
    the periodic one, taken inside the training step's grant, uses that one."""
    from colora.timeslice.gate import NullGate

    class Gate(NullGate):
        def __init__(self):
            super().__init__("t")
            self.log = []

        def acquire(self, phase):
            self.log.append(phase)
            return super().acquire(phase)

        def yield_(self):
            self.log.append("yield")
            return super().yield_()

    gate = Gate()
    jobs = {"a": _Job()}
    ck = Checkpointer(tmp_path, load_config(SMOKE), _Bank(jobs), jobs, 1, 10, log=lambda s: None, gate=gate)
    real = ck.bank.job_state
    ck.bank.job_state = lambda name: (gate.log.append("snapshot" if gate.holds else "snapshot outside a grant"),
                                      real(name))[1]
    jobs["a"].step = 1
    ck.save_now()
    gate.acquire("train")
    jobs["a"].step = 2
    ck.maybe_save()
    gate.yield_()
    jobs["a"].step = 3
    assert ck.finish() is not None
    assert gate.log == ["checkpoint", "snapshot", "yield", "train", "snapshot", "yield", "checkpoint", "snapshot",
                        "yield"]
    assert [_steps(p)["a"] for p in checkpoints(tmp_path)] == [1, 2, 3]


# -- what a checkpoint may hold -------------------------------------------------------------------
class _Payload:
    """What a checkpoint from someone else might hold: unpickling it creates a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    """A state.pt with a pickled call in it, with a manifest that matches: it is not loaded
    (weights_only), nothing runs, and it is reported as unusable."""
    marker = tmp_path / "ran"
    run = tmp_path / "run"
    path = save(run, 1, {"jobs": {"a": {"step": 1, "status": "running"}}}, keep=2)
    with open(path / "state.pt", "wb") as f:
        torch.save({"jobs": {"a": {"step": 1}}, "x": _Payload(marker)}, f, pickle_module=pickle)
    man = json.loads((path / "manifest.json").read_text())
    man.update(bytes=(path / "state.pt").stat().st_size, sha256=checkpoint.sha256_file(path / "state.pt"))
    (path / "manifest.json").write_text(json.dumps(man))
    said = []
    assert load_latest(run, log=said.append) is None
    assert not marker.exists(), "loading the checkpoint ran code"
    assert "unusable" in said[0]


# -- the logs before a resume ---------------------------------------------------------------------
def test_a_rewind_killed_midway_then_run_again_keeps_every_row(tmp_path, monkeypatch):
    """rewind_logs dies after its first rename (as a kill would leave it); the next resume's rewind
    still starts metrics.jsonl from the rows the checkpoint covers."""
    rows = [{"job": "a", "step": s, "status": "ok"} for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "timeline.jsonl").write_text(json.dumps({"phase": "train"}) + "\n")
    real, calls = os.replace, []

    class Killed(BaseException):
        pass

    def dies_second(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise Killed()
        return real(a, b)

    monkeypatch.setattr(os, "replace", dies_second)
    with pytest.raises(Killed):
        rewind_logs(tmp_path, {"jobs": {"a": {"step": 2}}})
    monkeypatch.undo()
    rewind_logs(tmp_path, {"jobs": {"a": {"step": 2}}})
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 1]


def test_an_interrupted_status_names_the_newest_checkpoint_that_verifies(tmp_path):
    from colora.run.runner import _interrupted
    from colora.stopping import Interrupted, StopRequest

    cfg = load_config(SMOKE)
    older = save(tmp_path, 1, {"jobs": {"a": {"step": 1, "status": "running"}}}, keep=5)
    newest = save(tmp_path, 2, {"jobs": {"a": {"step": 2, "status": "running"}}}, keep=5)
    (newest / "state.pt").write_bytes(b"torn")
    status = _interrupted(Interrupted("SIGTERM"), StopRequest(), cfg, tmp_path)
    assert status["checkpoint"] == str(older.relative_to(tmp_path)), status
