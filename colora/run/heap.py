"""Python's cyclic garbage collector kept off the objects a run sets up once.

A process holding the trainer tracks ~390k objects (torch, transformers, the model's modules; vLLM's
client too in a run); a full collection walks all of them: 249 ms on a 2-core CPU machine for the tiny
model's trainer, 0.001 ms with them frozen (`gc.freeze`; measured at 57830b6).
The trainer's steps make enough objects that the collector runs a full pass every few steps: on the
H200 one step in five of the 8-job trainer benchmark took 0.22-0.25 s longer than the others, at the
same step in two processes (measured at b1c6366). With the freeze, two 5-step processes on the
H200 had no such step (1.397-1.432 s, measured at 086fdec); a run without it in the same call,
which would pin the cause, has not been made.

`frozen_heap()` collects once, freezes every object alive, and unfreezes on exit, so that objects of
the run in reference cycles are collected when it ends (a sweep runs several in one process).
Objects made inside are collected as before.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap():
    """Collect, then freeze every live object until the block ends (see the module's docstring)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
