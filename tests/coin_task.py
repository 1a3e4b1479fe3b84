"""A task with a learnable-looking signal for random-weight models, used as a user-registered task
("coin_task:CoinFlip") in the end-to-end tests: reward 1 when the completion's length in characters
is even. A random model gets it about half the time, so groups have non-zero advantages."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

from colora.tasks.base import Draft, ProceduralTask


class CoinFlip(ProceduralTask):
    """Reward even-length completions (a test signal, not a skill)"""

    name = "coin_flip"

    def __init__(self, *, eval_fraction: float = 0.2) -> None:
        super().__init__(eval_fraction=eval_fraction)

    def draw(self, rng: random.Random) -> Draft:
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        return Draft(key=f"{a},{b}", question=f"Say something about {a} and {b}.", answer="even", meta={})

    def reward(self, completion, item) -> float:
        return 1.0 if len(completion) % 2 == 0 else 0.0


class Raising(CoinFlip):
    """A customer's broken reward function: raises from its second step's rollouts on."""

    name = "raising"

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls = 0

    def reward(self, completion, item) -> float:
        self.calls += 1
        if self.calls > 6:
            raise ZeroDivisionError("customer code divided by zero")
        return super().reward(completion, item)


class Interrupting(CoinFlip):
    """CoinFlip (the same items and rewards: the same name) that signals the colora run it is in,
    once per process, where the environment variable COIN_TASK_SIGNAL = "SIGNAL:TARGET:PHASE:STEP[:COUNT]" says:
    TARGET "self" (this process, as `kill` does), "group" (its process group, as a terminal's Ctrl-C
    does) or "parent" (the process that started this one: a benchmark's, whose runs are children); PHASE "generate" (when the step's prompts are drawn, on a task thread of the engine thread's, just
    before its rollouts are queued) or "train" (at the step's first reward, on the trainer's thread, inside the
    training step); COUNT signals, 0.2 s apart (2: the second one that exits at once). Without the
    variable (the uninterrupted reference, a resume) it is CoinFlip."""

    fired = False  # once per process, whichever job gets there first

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        spec = os.environ.get("COIN_TASK_SIGNAL", "")
        self._spec = spec.split(":") if spec else None
        self._seeds: list[int] = []  # the train steps' prompt seeds in order: the index is the step

    def sample(self, n, seed, split="train"):
        items = super().sample(n, seed, split)
        # only the run's own draws count, made on a job's task thread (colora/corun/rollouts.py call_task);
        # the pre-flight check draws the first steps' prompts on the main thread, before the run begins
        if split == "train" and threading.current_thread().name.startswith("colora-task-"):
            if seed not in self._seeds:  # the overlap arms draw step 0 twice (once to weigh the groups)
                self._seeds.append(seed)
            self._maybe("generate")
        return items

    def reward(self, completion, item) -> float:
        self._maybe("train")
        return super().reward(completion, item)

    def _maybe(self, phase: str) -> None:
        if self._spec is None or Interrupting.fired:
            return
        name, target, at, step, *count = self._spec
        if at != phase or len(self._seeds) - 1 != int(step):
            return
        Interrupting.fired = True
        sig = getattr(signal, name)
        for k in range(int(count[0]) if count else 1):
            if k:
                time.sleep(0.2)
            if target == "group":
                os.killpg(os.getpgrp(), sig)
            elif target == "parent":
                os.kill(os.getppid(), sig)
            else:
                os.kill(os.getpid(), sig)
