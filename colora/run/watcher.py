"""Nothing a run's process started outlives it: a watcher stops its engine processes and MPS daemon
when the process dies, however it dies.

    python -m colora.run.watcher PID TOKEN      (started by `watch_this_process`, in a session of its own)

A run that ends, fails or is stopped by a signal closes its engine and MPS daemon itself
(colora/run/runner.py, colora/stopping.py). One that is killed (SIGKILL, the kernel's OOM killer, Ray's
`ray.kill`) cannot: vLLM's engine core and its workers do not watch their parent and live on holding
memory (7.2-7.5 GB on the CPU, their share of a GPU), and MPS's control daemon detaches itself from
every process group. So a watcher started beside the process (in a session of its own, not its
child) waits for it to die and then sends `quit` to the MPS control daemons it started (through each
daemon's own pipe directory) and SIGKILL to every other process it started:

- the processes whose environment carries the process's token (`TOKEN_ENV`), which it sets before it
  starts anything and every process it starts inherits: the MPS daemon, which leaves the process
  tree at once. The token is read from /proc/PID/environ, the environment as it was at exec;
- every descendant the watcher saw while the process lived (it looks every POLL_S, remembering each
  by pid and start time, so a pid used again is not taken for it), and their descendants at the
  end: vLLM's engine core and workers rename themselves (setproctitle), which overwrites what
  /proc/PID/environ shows, and their start takes seconds, so the watcher has seen them.

Nothing else is touched. A process has one watcher and one token for its life: the runs of a sweep
in one process share it, as they share a cached engine. A colora process started by another (a
sweep's child, a co-runner) takes a token of its own: its parent's watcher kills it, and its own
watcher then what it started. multiprocessing's resource tracker, which unlinks the shared memory a
dead process left, gets TRACKER_GRACE_S to do so before it is killed too.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid

from colora import python_m
from colora.environment import COCORUNNER_TAG as TOKEN_ENV
from colora.environment import tag_processes, with_mps_dirs

MPS_CONTROL = "nvidia-cuda-mps-control"
TRACKER_GRACE_S = 5.0  # for multiprocessing's resource tracker to unlink what the killed processes left
POLL_S = 1.0  # how often the watcher looks at the watched process's descendants (an engine starts in seconds)

_watched: dict = {}  # {"pid", "token"}: this process's watcher, once started (a forked child has none)


def tagged(token: str) -> list:
    """The live processes (psutil.Process) whose environment carries TOKEN_ENV=token, this one aside."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get(TOKEN_ENV) == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def _is_mps_control(p) -> bool:
    """An MPS control daemon: by its name, or where the kernel's short name (15 characters) hides
    it, by its command line."""
    try:
        return p.name() == MPS_CONTROL or os.path.basename((p.cmdline() or [""])[0]) == MPS_CONTROL
    except Exception:  # noqa: BLE001  (gone, or unreadable)
        return False


def _is_tracker(p) -> bool:
    try:
        return any("resource_tracker" in part for part in p.cmdline())
    except Exception:  # noqa: BLE001  (gone, or unreadable: not one to spare)
        return False


def reap(token: str, timeout: float = 10.0, seen: tuple = ()) -> list[int]:
    """Stop every process tagged with `token`, and those of `seen` (psutil.Process) still running with
    everything they started: MPS control daemons by `quit` (through their own pipe directory, within
    `timeout`), then every other one by SIGKILL; a resource tracker gets TRACKER_GRACE_S to end by
    itself first, and whatever is left after that is killed. Returns the pids it found."""
    import psutil

    procs = {p.pid: p for p in tagged(token)}
    for p in seen:
        try:
            if p.is_running():  # the same process: is_running compares the start time too
                for q in [p, *p.children(recursive=True)]:
                    procs.setdefault(q.pid, q)
        except psutil.Error:
            continue
    procs = [p for p in procs.values() if p.pid != os.getpid()]
    daemons, trackers, others = [], [], []
    for p in procs:
        (daemons if _is_mps_control(p) else trackers if _is_tracker(p) else others).append(p)
    for p in daemons:
        try:
            subprocess.run([MPS_CONTROL], input="quit\n", text=True, capture_output=True, timeout=timeout,
                           env=with_mps_dirs(p.environ()))
        except (psutil.Error, OSError, subprocess.SubprocessError):
            pass
    _kill(others)
    psutil.wait_procs(others, timeout=timeout)
    _, left = psutil.wait_procs(trackers + daemons, timeout=TRACKER_GRACE_S)
    _kill(left)
    psutil.wait_procs(left, timeout=timeout)
    return [p.pid for p in procs]


def _kill(procs: list) -> None:
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def start_watcher(token: str) -> None:
    """Start the watcher of this process, which then reaps `token` when this process dies. It
    detaches (a session of its own, and not this process's child: Ray kills a worker's children and
    process group when the worker exits, and colora/stopping.py the children a stopped run left), so
    it outlives this process whatever kills it."""
    subprocess.run([*python_m("colora.run.watcher"), str(os.getpid()), token], start_new_session=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    _watched.update(pid=os.getpid(), token=token)


def watch_this_process() -> str:
    """Tag this process's environment and start its watcher, unless it has one; returns its token.
    Call it before the process starts anything that must not outlive it (the MPS daemon, the engine).
    The tag is set again on every call, in case something took it out of the environment."""
    if _watched.get("pid") != os.getpid():
        token = f"colora-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        tag_processes(token)  # before the watcher: it must not carry the token of a parent
        start_watcher(token)
    tag_processes(_watched["token"])
    return _watched["token"]


def main(argv: list[str] | None = None) -> int:
    import psutil

    pid, token = (argv if argv is not None else sys.argv[1:])[:2]
    if os.fork():  # the caller waits for this parent only; the child watches on, re-parented
        os._exit(0)
    seen: dict[tuple, object] = {}  # (pid, start time) -> psutil.Process: every descendant seen
    try:
        watched = psutil.Process(int(pid))
        while True:
            for c in watched.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    seen.setdefault((c.pid, c.create_time()), c)
            try:
                watched.wait(POLL_S)
                break
            except psutil.TimeoutExpired:
                continue
    except psutil.NoSuchProcess:
        pass
    reap(token, seen=tuple(seen.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
