"""What the co-runner's two threads share: the records they hand each other and the one-transfer lock.

The trainer's thread (colora/corun/trainer_side.py) and the engine's thread (colora/corun/engine_side.py) exchange
records through two queues: `Generate`, `Drop` and `Stop` go to the engine thread, `Generated` and
`Failed` come back. A `Generate` carries everything the engine thread needs for a group's step (each
running job's step and its new adapter version), so the engine thread never reads the trainer's job
state. A stop is a record of its own, never a closed queue or a sentinel object. `Shipping` lets one
adapter transfer run at a time: the trainer's export of one group and the engine's load of another.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Callable

from colora.engine.adapters import Adapter
from colora.engine.rollout import GenResult
from colora.stopping import StopRequest


class EngineFailure(RuntimeError):
    """The engine (or its thread) failed; the trainer's state is whole and can be checkpointed."""


@dataclass(frozen=True)
class Generate:
    """To the engine thread: take the adapters of `drops` out (stopped jobs' that wait for a grant: the
    time-slicing arm's), load `adapters` (the group's new versions), then queue one step of rollouts
    for each (job, step) of `jobs` (the group's running jobs), then set `loaded`."""

    group: int
    jobs: tuple[tuple[str, int], ...]
    adapters: tuple[Adapter, ...]
    queued_at: float  # timeline seconds when the trainer handed the group over
    loaded: threading.Event
    drops: tuple[str, ...] = ()


@dataclass(frozen=True)
class Drop:
    """To the engine thread: take a stopped job's adapter out of the engine (at once: in the time-slicing
    arm a stopped job's adapter waits for the next grant instead, in a `Generate`)."""

    job: str


@dataclass(frozen=True)
class Stop:
    """To the engine thread: end the loop."""


@dataclass
class Generated:
    """From the engine thread: a group's finished rollouts, {job: (items, results)}, how long the group
    generated, and the jobs whose requests could not be made (their task's sampling failed, or a prompt
    the engine cannot take): the trainer stops those."""

    group: int
    jobs: dict[str, tuple[list, list[GenResult]]]
    seconds: float
    failed: dict[str, str] = field(default_factory=dict)  # job -> why its step could not be asked of the engine


@dataclass(frozen=True)
class Failed:
    """From the engine thread (or its watchdog): the engine failed; the trainer raises `error`."""

    error: EngineFailure


class Shipping:
    """One adapter transfer at a time: the trainer's export of one group and the engine's load of
    another. On the H200 under MPS, run at once, each took 1-3 s instead of 0.1-0.3 s (measured at
    39baa4c). A wait gives up if the engine dies meanwhile (`dead()` says why; the thread holding the
    lock may never let go) or a stop is requested."""

    def __init__(self, dead: Callable[[], str], stop_request: StopRequest):
        self.lock = threading.Lock()
        self.dead = dead
        self.stop_request = stop_request

    @contextlib.contextmanager
    def __call__(self):
        while not self.lock.acquire(timeout=0.5):
            why = self.dead()
            if why:
                raise EngineFailure(why)
            self.stop_request.check()
        try:
            yield
        finally:
            self.lock.release()
