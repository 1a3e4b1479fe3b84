"""Running the broker as a process of its own, and asking it how it stands.

    proc = start_broker(sock_path, policy="lazy", log_path=run_dir / "timeslice.jsonl")
    ...
    proc.stop()          # SIGTERM: the broker closes every connection and ends; SIGKILL after a timeout

`python -m colora.timeslice SOCK --policy lazy --log timeslice.jsonl [--hold-timeout-s S]` is the same broker
from a shell.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from colora.timeslice.broker import HOLD_TIMEOUT_S, Broker, can_connect
from colora.timeslice.protocol import check_policy, check_sock_path, decode, encode


def broker_status(sock_path: str | os.PathLike, timeout_s: float = 5.0) -> dict:
    """The broker's view (holder, queue, tenants), asked on a connection of its own, unregistered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(check_sock_path(sock_path))
        s.sendall(encode({"op": "STATUS"}))
        with s.makefile("rb") as f:
            return decode(f.readline())


def run_broker(sock_path: str | os.PathLike, policy: str = "lazy", log_path: str | os.PathLike | None = None,
               *, switch_timeout_s: float = 600.0, hold_timeout_s: float = HOLD_TIMEOUT_S,
               parent_pid: int | None = None, memory_bytes: int = 0) -> None:
    """Serve until SIGTERM or SIGINT (handled when called from the main thread), or until the process
    `parent_pid` is gone, if given; the stop is `Broker.serve`'s, in bounded time."""
    broker = Broker(sock_path, policy, log_path, switch_timeout_s=switch_timeout_s, hold_timeout_s=hold_timeout_s,
                    memory_bytes=memory_bytes)

    async def watch_parent() -> None:
        while os.getppid() == parent_pid:  # a dead parent's child is re-parented
            await asyncio.sleep(0.5)
        broker.request_stop()

    async def main() -> None:
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, broker.request_stop)
        watcher = asyncio.create_task(watch_parent()) if parent_pid is not None else None
        try:
            await broker.serve()
        finally:
            if watcher is not None:
                watcher.cancel()

    asyncio.run(main())


def wait_listening(sock_path: str, timeout_s: float, alive=lambda: True) -> None:
    """Return once the socket accepts a connection; raise TimeoutError after timeout_s, or RuntimeError
    once `alive()` says the broker is gone."""
    deadline = time.monotonic() + timeout_s
    while not can_connect(sock_path):
        if not alive():
            raise RuntimeError(f"the broker ended before it listened on {sock_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no broker listened on {sock_path} within {timeout_s} s")
        time.sleep(0.02)


class BrokerProcess:
    """A broker running as a child process (`python -m colora.timeslice`)."""

    def __init__(self, process: subprocess.Popen, sock_path: str):
        self.process = process
        self.sock_path = sock_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not ended within timeout_s; the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        return self.process.returncode

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_broker(sock_path: str | os.PathLike, policy: str = "lazy", log_path: str | os.PathLike | None = None,
                 *, timeout_s: float = 30.0, switch_timeout_s: float = 600.0,
                 hold_timeout_s: float = HOLD_TIMEOUT_S, memory_bytes: int = 0) -> BrokerProcess:
    """Start the broker as a child process and return once it listens. The child ends by itself when
    this process ends (it watches its parent), so a crashed runner leaves no broker behind. hold_timeout_s:
    the longest a tenant may hold one grant before the broker fails it (timeslice.hold_timeout_s);
    memory_bytes: the device memory the tenants share under policy "memory" (0 under the others)."""
    path = check_sock_path(sock_path)
    check_policy(policy)
    if not hold_timeout_s > 0:
        raise ValueError(f"hold_timeout_s ({hold_timeout_s}) must be positive (seconds; timeslice.hold_timeout_s)")
    if (policy == "memory") != (memory_bytes > 0):
        raise ValueError(f"memory_bytes ({memory_bytes}) must be above 0 under policy \"memory\", 0 under {policy!r}")
    if can_connect(path):
        raise RuntimeError(f"a broker already listens on {path}")
    # -P where this process has it: the child imports the installed colora, not a folder in its cwd
    cmd = [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m", "colora.timeslice", path,
           "--policy", policy, "--switch-timeout-s", str(switch_timeout_s), "--hold-timeout-s", str(hold_timeout_s),
           "--parent", str(os.getpid()), "--memory-bytes", str(int(memory_bytes))]
    if log_path is not None:
        cmd += ["--log", os.fspath(log_path)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        wait_listening(path, timeout_s, alive=lambda: proc.poll() is None)
    except BaseException:
        BrokerProcess(proc, path).stop(timeout_s=2.0)
        raise
    return BrokerProcess(proc, path)


def main(argv: list[str] | None = None) -> None:
    """`python -m colora.timeslice SOCK [--policy lazy] [--log timeslice.jsonl]`"""
    ap = argparse.ArgumentParser(prog="python -m colora.timeslice", description=main.__doc__)
    ap.add_argument("sock")
    ap.add_argument("--policy", default="lazy")
    ap.add_argument("--log", type=Path, default=None)
    ap.add_argument("--switch-timeout-s", type=float, default=600.0)
    ap.add_argument("--hold-timeout-s", type=float, default=HOLD_TIMEOUT_S)
    ap.add_argument("--parent", type=int, default=None, help="stop once this process is gone")
    ap.add_argument("--memory-bytes", type=int, default=0, help="policy memory: the device memory the tenants share")
    a = ap.parse_args(argv)
    run_broker(a.sock, a.policy, a.log, switch_timeout_s=a.switch_timeout_s, hold_timeout_s=a.hold_timeout_s,
               parent_pid=a.parent, memory_bytes=a.memory_bytes)


