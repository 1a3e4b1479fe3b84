"""Nothing of a co-runner outlives it: its engine processes and MPS daemon are stopped when it dies.

    python -m colora.cluster.reaper PID TOKEN      (started by each co-runner actor, in a session of its own)

A co-runner that ends normally or is stopped by the driver closes its engine and MPS daemon itself
(colora.run.runner). One that is killed (SIGKILL, the kernel's OOM killer, Ray's `ray.kill`) cannot: its
vLLM engine core lives on holding the GPU's memory (vLLM's engine core does not watch its parent),
and MPS's control daemon detaches itself from every process group. So each co-runner tags its
environment with a token before it starts anything (`TOKEN_ENV`), every process it starts inherits
the tag, and this watcher, started beside it, waits for it to die and then sends `quit` to every
tagged MPS control daemon and SIGKILL to every other tagged process. The driver calls `reap` too
after it killed the actors (a watcher on another node does the same there).

The tag is read from /proc/PID/environ, which holds a process's environment as it was at exec: the
co-runner sets it before any child is started, and vLLM's engine core is spawned (exec'd), never
forked, inside a Ray actor.
"""

from __future__ import annotations

import os
import subprocess
import sys

from colora import python_m
from colora.environment import COCORUNNER_TAG as TOKEN_ENV
from colora.environment import with_mps_dirs

MPS_CONTROL = "nvidia-cuda-mps-control"


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


def reap(token: str, timeout: float = 10.0) -> list[int]:
    """Stop every process tagged with `token`: MPS control daemons by `quit` (through their own pipe
    directory, within `timeout`), all others, and any daemon that did not quit, by SIGKILL. Returns
    the pids it found."""
    import psutil

    procs = tagged(token)
    for p in procs:
        try:
            if p.name() != MPS_CONTROL:
                continue
            subprocess.run([MPS_CONTROL], input="quit\n", text=True, capture_output=True, timeout=timeout,
                           env=with_mps_dirs(p.environ()))
        except (psutil.Error, OSError, subprocess.SubprocessError):
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in procs]


def start_watcher(token: str) -> None:
    """Start the watcher of this process. It detaches (a session of its own, and not this process's
    child: Ray kills a worker's children and process group when the worker exits), so it outlives
    this process whatever kills it."""
    subprocess.run([*python_m("colora.cluster.reaper"), str(os.getpid()), token], start_new_session=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)


def main(argv: list[str] | None = None) -> int:
    import psutil

    pid, token = (argv if argv is not None else sys.argv[1:])[:2]
    if os.fork():  # the caller waits for this parent only; the child watches on, re-parented
        os._exit(0)
    try:
        psutil.Process(int(pid)).wait()
    except psutil.NoSuchProcess:
        pass
    reap(token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
