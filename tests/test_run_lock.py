"""One process per run directory (colora/run/rundir.py): a run holds its directory's lock for its
life, a second process (a resume of a run still going, a sweep on the same root) is refused with the
holder's pid, the kernel frees the lock when the holder dies however it dies, and readers tell a
live run from a killed one by it. No engine: the run's steps are replaced where a test gets that far."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colora.config import load_config
from colora.record.runlog import write_json_atomic
from colora.run import rundir, runner
from colora.run.preflight import RunError

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"


class Reached(Exception):
    """The run got past every check to its steps (the engine's start)."""


def _no_steps(*a, **k):
    raise Reached()


def _interrupted_run(d: Path, tiny_model_dir) -> None:
    """What an interrupted run before its first checkpoint leaves (config.json, status.json)."""
    cfg = load_config(SMOKE, [f'experiment.model="{tiny_model_dir}"', 'jobs.*.task="coin_task:CoinFlip"',
                              "jobs.*.task_options={}", "experiment.eval_size=0"])
    d.mkdir(parents=True)
    write_json_atomic(d / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
    write_json_atomic(d / "status.json", {"state": "interrupted", "signal": "SIGTERM"})


def _holder(d: Path) -> subprocess.Popen:
    """Another process that holds `d` as a run does, and says so on its first line."""
    code = ("import sys, time\nfrom colora.run.rundir import holding\n"
            f"with holding({str(d)!r}):\n    print('held', flush=True)\n    time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_process_is_refused_the_directory_a_live_run_holds(tmp_path, tiny_model_dir, monkeypatch):
    """While another process holds the run: a resume, a sweep's check and moving it aside are
    refused, naming the holder's pid; readers say it runs. Killed by SIGKILL, its lock is free: the
    run reads as killed, and the resume goes on to its steps."""
    monkeypatch.setattr(runner, "_execute", _no_steps)
    d = tmp_path / "run"
    _interrupted_run(d, tiny_model_dir)
    other = _holder(d)
    try:
        with pytest.raises(RunError, match=rf"in use by another colora process \(pid {other.pid} "):
            runner.resume(d, log=lambda s: None)
        assert json.loads((d / "status.json").read_text())["state"] == "interrupted"  # untouched
        with pytest.raises(RunError, match=f"pid {other.pid}"):
            rundir.move_aside(d)
        assert rundir.run_state(d) == "running" and rundir.holder(d)["pid"] == other.pid
        assert rundir.describe(d).startswith(f"still running (pid {other.pid}")
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    assert rundir.holder(d) is None and rundir.run_state(d) == "incomplete"
    with pytest.raises(Reached):
        runner.resume(d, log=lambda s: None)
    status = json.loads((d / "status.json").read_text())
    assert status["state"] == "failed" and "Reached" in status["error"]  # the resume ran (into the fake steps)
    assert not (d / rundir.LOCK).exists()  # released and removed when the run ended


def test_a_sweep_refuses_a_root_whose_run_another_process_writes(tmp_path, tiny_model_dir):
    from colora.config import ConfigError
    from colora.sweeps.plan import check_existing
    from colora.sweeps.sweep import plan_runs

    cfg = load_config(SMOKE)
    plan = plan_runs(["shared_sync"], [1])
    d = tmp_path / plan[0].rel
    _interrupted_run(d, tiny_model_dir)
    other = _holder(d)
    try:
        with pytest.raises(ConfigError, match=f"pid {other.pid}"):
            check_existing(tmp_path, cfg, plan)
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    assert check_existing(tmp_path, cfg, plan) == {plan[0].rel: "incomplete"}


def test_a_killed_run_reads_as_killed_and_resumable(tmp_path, tiny_model_dir):
    """status.json says "running" with the pid of a process that is gone (kill -9): the run reads
    as killed, resumable from its checkpoint, not as a run in progress."""
    from colora.run.checkpoint import save

    d = tmp_path / "run"
    _interrupted_run(d, tiny_model_dir)
    cfg_hash = json.loads((d / "config.json").read_text())["hash"]
    save(d, 1, {"config_hash": cfg_hash, "jobs": {"count": {"step": 1}}}, keep=2)
    other = _holder(d)
    write_json_atomic(d / "status.json", {"state": "running", "pid": other.pid})
    try:
        assert not rundir.resumable(d, cfg_hash)  # it runs: not to be resumed by a second process
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    assert rundir.resumable(d, cfg_hash)
    assert rundir.describe(d).startswith(f"killed while running (its process, pid {other.pid}, is gone)")


def test_a_forked_child_does_not_keep_the_run_directory(tmp_path):
    """A child forked while the run holds its directory (a library's worker) holds none of it: once
    the run lets go, the directory is free though the child lives on."""
    d = tmp_path / "run"
    d.mkdir()
    with rundir.holding(d):
        pid = os.fork()
        if pid == 0:  # the child: live on past the parent's release
            time.sleep(30)
            os._exit(0)
    try:
        assert rundir.holder(d) is None
        with rundir.holding(d):  # and this process can take it again
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_nested_holds_of_one_process_share_the_lock(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    with rundir.holding(d):
        with rundir.holding(d):
            assert rundir.holder(d)["pid"] == os.getpid()
        assert (d / rundir.LOCK).exists()  # the outer block still holds it
    assert rundir.holder(d) is None and not (d / rundir.LOCK).exists()
