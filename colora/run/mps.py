"""NVIDIA MPS, owned by colora for the length of one run.

colora starts its own control daemon, with its own pipe and log directories (so it neither joins nor
disturbs another daemon on the machine), before any CUDA context exists; each process's share comes
from `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, read by CUDA when the process creates its context. The
daemon is stopped when the run ends, also on error. Stop the engine and the trainer's CUDA work first:
quitting the daemon under a live client hung the process on the H200, so `quit` has a timeout.

    with MpsDaemon(root) as mps:
        mps.claim(trainer_percentage)      # this process's context, first thing: its share is fixed now
        mps.set_share(engine_percentage)   # for the engine process spawned next
        ...start the engine...

A process's share is fixed when CUDA first initialises in it (the driver joins the daemon then), and
the engine's client initialises CUDA in the trainer's process while it starts the engine: setting the
trainer's share after the engine had started had no effect (the H200 showed all 132 SMs to a trainer
configured for 25%). So `claim` makes the context before anything else can.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil
import torch

from colora import environment

CONTROL = "nvidia-cuda-mps-control"


class MpsUnavailable(RuntimeError):
    pass


class MpsShareError(RuntimeError):
    """This process's CUDA context cannot have the share asked for (it exists already)."""


# The share this process's CUDA context was made with by `MpsDaemon.claim`, and the SMs it then saw.
_claimed: dict[str, int] = {}


def _cuda_initialized() -> bool:
    return torch.cuda.is_initialized()


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _make_context() -> int:
    """Make this process's CUDA context now; the SMs it may use (fewer than the device's under MPS
    with a thread percentage below 100)."""
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    return torch.cuda.get_device_properties(0).multi_processor_count


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
        pipe = environment.mps_pipe_directory()
        if not pipe:
            raise MpsUnavailable("no CUDA_MPS_PIPE_DIRECTORY in the environment to attach to")
        d = cls(Path(pipe).parent)
        d.owner = False
        return d

    def __init__(self, root: str | Path | None = None, quit_timeout: float = 20.0, start_timeout: float = 30.0):
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="colora-mps-"))
        self.pipe_dir = self.root / "pipe"
        self.log_dir = self.root / "log"
        self.quit_timeout = quit_timeout
        self.start_timeout = start_timeout
        self.started = False
        self.owner = True  # False: attached to a daemon another process owns
        self._saved_env: dict[str, str | None] = {}

    def _env(self) -> dict[str, str]:
        return environment.mps_daemon_env(self.pipe_dir, self.log_dir)

    def start(self) -> None:
        ok, why = mps_available()
        if not ok:
            raise MpsUnavailable(why)
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            r = subprocess.run([CONTROL, "-d"], env=self._env(), capture_output=True, text=True,
                               timeout=self.start_timeout)
        except subprocess.TimeoutExpired:
            # `-d` forks the daemon before it returns: one that hangs may have left a daemon behind on
            # our pipe directory, which nothing would stop after this
            raise MpsUnavailable(f"{CONTROL} -d did not return within {self.start_timeout:.0f}s; "
                                 f"the daemon it may have started: {self._stop_stray()}") from None
        if r.returncode != 0:
            raise MpsUnavailable(f"{CONTROL} -d exited {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
        self.started = True
        # Every CUDA context created from now on, in this process or its children, joins this daemon.
        self._saved_env = environment.join_mps(self.pipe_dir, self.log_dir)

    def _stop_stray(self) -> str:
        """Stop a daemon on our pipe directory that a failed start left: `quit`, then SIGTERM and SIGKILL
        to every other process whose environment names our pipe directory (made for this daemon alone,
        and not yet in this process's environment). Says what it did."""
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run([CONTROL], input="quit\n", env=self._env(), capture_output=True, text=True,
                           timeout=min(5.0, self.quit_timeout))
        ours = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.pid != os.getpid() and p.environ().get("CUDA_MPS_PIPE_DIRECTORY") == str(self.pipe_dir):
                    ours.append(p)
        if not ours:
            return "none left running"
        for p in ours:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(ours, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        return f"stopped (pid {', '.join(str(p.pid) for p in ours)})"

    def set_share(self, percentage: int) -> None:
        """The SM share of the next CUDA context created in this process or a child spawned now."""
        if not 1 <= percentage <= 100:
            raise ValueError(f"MPS percentage ({percentage}) must be from 1 to 100")
        environment.set_mps_share(percentage)

    def claim(self, percentage: int) -> int | None:
        """Make this process's CUDA context now, with `percentage` of the SMs; returns the SMs it
        sees (None without CUDA). Once per process: a later claim of the same share returns the same,
        a different share raises MpsShareError (it needs a process of its own), as does a context that
        exists already and was not made here (its share is whatever the environment said then)."""
        if _claimed:
            if _claimed["percentage"] != percentage:
                raise MpsShareError(
                    f"this process's CUDA context has {_claimed['percentage']}% of the SMs and a process's MPS "
                    f"share is fixed once its context exists: {percentage}% needs a new process "
                    "(colora bench arms runs each share in its own)")
            return _claimed["sms"]
        if _cuda_initialized():
            raise MpsShareError(
                "this process initialised CUDA before colora set its MPS share, so the trainer's share "
                f"({percentage}%) cannot apply; start the MPS run in a fresh process")
        self.set_share(percentage)  # before CUDA's first initialisation here, which reads it
        if not _cuda_available():
            return None
        _claimed.update(percentage=percentage, sms=_make_context())
        return _claimed["sms"]

    def stop(self) -> str:
        """Send `quit`, restore the environment. Returns what happened. The daemon quits once its
        clients are gone: where this process is one (it made its CUDA context through `claim`, as a
        run's process does), `quit` is sent without waiting for it (waiting would only end at the
        timeout); otherwise it waits up to `quit_timeout` seconds."""
        if not self.owner:
            return "left to its owner"
        if not self.started:
            return "not started"
        if _claimed:
            self.quit_nowait()
            environment.restore(self._saved_env)
            return "quit sent (it exits once this process, its last client, does)"
        self.started = False
        outcome = "quit"
        try:
            subprocess.run([CONTROL], input="quit\n", env=self._env(), capture_output=True, text=True,
                           timeout=self.quit_timeout)
        except subprocess.TimeoutExpired:
            outcome = f"quit timed out after {self.quit_timeout}s"
        finally:
            environment.restore(self._saved_env)
        return outcome

    def quit_nowait(self) -> None:
        """Send `quit` and return at once (a second signal: this process, a client, exits next and the
        daemon then quits). Leaves the environment as it is."""
        if self.owner and self.started:
            self.started = False
            proc = subprocess.Popen([CONTROL], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=self._env(), text=True)
            proc.stdin.write("quit\n")
            proc.stdin.close()

    def __enter__(self) -> "MpsDaemon":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
