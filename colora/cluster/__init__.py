"""colora on a Ray cluster: one co-runner per GPU, an experiment's jobs spread across them.

    colora run CONFIG --gpus 4                      a new local cluster, one co-runner per GPU
    colora run CONFIG --gpus 8 --address auto       the cluster this node belongs to (`ray start`)
    colora run CONFIG --gpus 1 --address local      the Ray path on one GPU (against the plain one)
    colora run --resume DIR [--gpus N]              each co-runner from its last checkpoint

Each co-runner is a Ray actor that holds one GPU of a placement group (one bundle per GPU) and runs
its share of the jobs as one ordinary colora run, with its own engine, trainer and MPS daemon
(`colora.run.runner.run`). The driver (`driver.py`) places the jobs (`placement.py`), gathers one run
directory and stops every actor, engine and MPS daemon on error, Ctrl-C or SIGTERM (`reaper.py`).
Ray is optional (`pip install colora[ray]`): it is imported only here, and only when a command asks
for more than one GPU or for a cluster; everything else runs without it.
"""

from __future__ import annotations

from colora.run.preflight import RunError


def require_ray(why: str):
    """The `ray` module; a RunError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise RunError(f"{why} needs Ray, which is not installed: pip install 'colora[ray]' (the ray extra; "
                       "on the GPU host: scripts/ray-kit.sh)") from None
    return ray
