"""NVIDIA MPS, owned by colora for the length of one run.

colora starts its own control daemon, with its own pipe and log directories (so it neither joins nor
disturbs another daemon on the machine), before any CUDA context exists; each process's share comes
from `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, read by CUDA when the process creates its context. The
daemon is stopped when the run ends, also on error. Stop the engine and the trainer's CUDA work first:
quitting the daemon under a live client hung the process on the H200, so `quit` has a timeout.

    with MpsDaemon(root) as mps:
        mps.set_share(engine_percentage)   # before the engine process is spawned
        ...start the engine...
        mps.set_share(trainer_percentage)  # before this process's first CUDA call
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"


class MpsUnavailable(RuntimeError):
    pass


def mps_available() -> tuple[bool, str]:
    """(available, why not). Checks without creating a CUDA context."""
    if shutil.which(CONTROL) is None:
        return False, f"{CONTROL} is not on PATH"
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return False, "no NVIDIA device node in /dev"
    return True, ""


class MpsDaemon:
    @classmethod
    def attached(cls) -> "MpsDaemon":
        """The daemon a parent process started for us (its pipe directory is in our environment):
        this process only sets its share; the parent, which is no CUDA client, stops it after we
        exit. (A process that is itself a client cannot quit the daemon cleanly while it lives:
        `quit` waits for the clients, and a CUDA context lasts as long as its process.)"""
        pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
        if not pipe:
            raise MpsUnavailable("no CUDA_MPS_PIPE_DIRECTORY in the environment to attach to")
        d = cls(Path(pipe).parent)
        d.owner = False
        return d

    def __init__(self, root: str | Path | None = None, quit_timeout: float = 20.0):
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="colora-mps-"))
        self.pipe_dir = self.root / "pipe"
        self.log_dir = self.root / "log"
        self.quit_timeout = quit_timeout
        self.started = False
        self.owner = True  # False: attached to a daemon another process owns
        self._saved_env: dict[str, str | None] = {}

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        return env

    def start(self) -> None:
        ok, why = mps_available()
        if not ok:
            raise MpsUnavailable(why)
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([CONTROL, "-d"], env=self._env(), capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise MpsUnavailable(f"{CONTROL} -d exited {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
        self.started = True
        # Every CUDA context created from now on, in this process or its children, joins this daemon.
        for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
            self._saved_env.setdefault(k, os.environ.get(k))
        os.environ["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        os.environ["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)

    def set_share(self, percentage: int) -> None:
        """The SM share of the next CUDA context created in this process or a child spawned now."""
        if not 1 <= percentage <= 100:
            raise ValueError(f"MPS percentage ({percentage}) must be from 1 to 100")
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage)

    def stop(self) -> str:
        """Send `quit` (with a timeout), restore the environment. Returns what happened."""
        if not self.owner:
            return "left to its owner"
        if not self.started:
            return "not started"
        self.started = False
        outcome = "quit"
        try:
            subprocess.run([CONTROL], input="quit\n", env=self._env(), capture_output=True, text=True,
                           timeout=self.quit_timeout)
        except subprocess.TimeoutExpired:
            outcome = f"quit timed out after {self.quit_timeout}s"
        finally:
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return outcome

    def __enter__(self) -> "MpsDaemon":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
