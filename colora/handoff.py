"""What the trainer (main thread) and the co-runner's engine thread hand each other.

Two queues: `Generate`, `Drop` and `Stop` go to the engine thread, `Generated` and `Failed` come
back. A stop is a record of its own, never a closed queue or a sentinel object.
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine import GenResult


class EngineFailure(RuntimeError):
    """The engine (or its thread) failed; the trainer's state is whole and can be checkpointed."""


@dataclass(frozen=True)
class Generate:
    """To the engine thread: load the group's new adapters and queue one step of its rollouts."""

    group: int


@dataclass(frozen=True)
class Drop:
    """To the engine thread: take a stopped job's adapter out of the engine."""

    job: str


@dataclass(frozen=True)
class Stop:
    """To the engine thread: end the loop."""


@dataclass
class Generated:
    """From the engine thread: a group's finished rollouts, {job: (items, results)}, and how long the
    group generated."""

    group: int
    jobs: dict[str, tuple[list, list[GenResult]]]
    seconds: float


@dataclass(frozen=True)
class Failed:
    """From the engine thread (or its watchdog): the engine failed; the trainer raises `error`."""

    error: EngineFailure
