"""One co-runner: a Ray actor that holds one GPU and runs one ordinary colora run on it.

The driver makes it with `num_gpus=1` in a bundle of its placement group; the actor sets
CUDA_VISIBLE_DEVICES to the GPU Ray assigned it (`ray.get_gpu_ids()`, named by its UUID: see
`gpu_uuid`), so the run's trainer, its vLLM engine (a process this one spawns) and its MPS daemon all
see that one device as device 0.
One actor makes one run and is then killed: a process's MPS share is fixed when its CUDA context is
made, so every run starts in a fresh process.

The driver stops a run with `ray.cancel` on its task: Ray marks the task cancelled and the run
raises `Stopped` at its next log line (after a step, after the engine started), unwinding as any
failed run does (engine closed, MPS daemon stopped, status.json failed). A run that does not reach
a log line in time is killed, and its watcher (reaper.py) stops what it had started.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from colora import output
from colora.cluster.reaper import start_watcher
from colora.config import from_dict
from colora.environment import prepare_vllm, tag_processes, use_gpu
from colora.run import runner


def gpu_uuid(index: str) -> str | None:
    """The UUID of the GPU of this index (nvidia-smi's; None without one). The co-runner names its
    GPU by UUID: an MPS control daemon started with CUDA_VISIBLE_DEVICES=3 shows its clients that GPU
    as device 0, so a client that also says 3 finds no device; a UUID means the same GPU to both
    (NVIDIA's MPS guide, CUDA_VISIBLE_DEVICES)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                       text=True, timeout=30)
    rows = dict(tuple(x.strip() for x in line.split(",", 1)) for line in r.stdout.splitlines() if "," in line)
    return rows.get(index)


class Stopped(RuntimeError):
    """The driver cancelled this co-runner's run (Ctrl-C, SIGTERM, an error elsewhere)."""


class CoRunnerActor:
    def __init__(self, index: int, label: str, sys_path: list[str], cwd: str):
        """index, label: which co-runner this is (for its log lines); sys_path, cwd: the driver's,
        so that a task given as `pkg.module:Class` and relative paths resolve as they do there."""
        import ray


        self.index, self.label = index, label
        self.token = uuid.uuid4().hex
        tag_processes(self.token)  # before any child: reaper.py finds them by it
        # the engine core must be spawned (exec'd), never forked, for the tag to be read back
        prepare_vllm("cuda")
        gpus = [str(g) for g in ray.get_gpu_ids()]
        if len(gpus) != 1:
            raise RuntimeError(f"co-runner {label} was given GPUs {gpus}; it needs exactly one")
        visible = use_gpu(gpu_uuid(gpus[0]) or gpus[0])
        sys.path.extend(p for p in sys_path if p and p not in sys.path and os.path.isdir(p))
        if os.path.isdir(cwd):
            os.chdir(cwd)
        start_watcher(self.token)
        self.started = time.time()
        self._thread: int | None = None
        self._stopping = False
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "gpu_ids": gpus,
                     "cuda_visible_devices": visible,
                     "node_id": ray.get_runtime_context().get_node_id(), "token": self.token}

    def describe(self) -> dict:
        """Where this co-runner runs: host, pid, the GPU Ray assigned, its watcher's token."""
        return self.info

    def run(self, cfg: dict, out: str, resume: bool, log_path: str) -> dict:
        """One colora run into `out` (`resume`: from its newest checkpoint); returns its summary.
        Inside an output session, as in `colora run`: what this process and the engine processes it
        starts write to 1 and 2 (vLLM's logs) goes to the run's run.log, not to Ray's worker logs."""
        self._thread = threading.get_ident()
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as f, output.session(stream="stderr"):
            log = self._logger(f)
            log(f"co-runner {self.label} on {self.info['host']} (pid {os.getpid()}, GPU {self.info['gpu_ids'][0]})")
            if resume:
                return runner.resume(out, log=log)
            return runner.run(from_dict(cfg), out, log=log)

    def _logger(self, f):
        import ray

        ctx = ray.get_runtime_context()

        def log(line: str) -> None:
            f.write(line + "\n")
            f.flush()
            # the run's own thread only: raising elsewhere would stop a helper thread, not the run
            if threading.get_ident() == self._thread and not self._stopping and ctx.is_canceled():
                self._stopping = True  # once: the run's clean-up logs too
                raise Stopped(f"co-runner {self.label} stopped by the driver")

        return log
