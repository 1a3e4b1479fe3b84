"""Nothing of a co-runner outlives it: its engine processes and MPS daemon are stopped when it dies.

A co-runner that ends normally or is stopped by the driver closes its engine and MPS daemon itself
(colora.run.runner). One that is killed (SIGKILL, the kernel's OOM killer, Ray's `ray.kill`) is
cleaned up after as any run's process is, by the watcher of colora/run/watcher.py: each co-runner
actor tags its environment with a token before it starts anything and starts its watcher
(`start_watcher`), which reaps every process tagged with the token when the actor dies. The driver
calls `reap` too after it killed the actors (a watcher on another node does the same there). The run
inside the actor finds the watcher running and starts no second one.
"""

from __future__ import annotations

from colora.run.watcher import MPS_CONTROL, TOKEN_ENV, reap, start_watcher, tagged

__all__ = ["MPS_CONTROL", "TOKEN_ENV", "reap", "start_watcher", "tagged"]
