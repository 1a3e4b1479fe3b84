"""How fast the engine decodes, and when: its steps counted per time bucket, and the part of each
step spent waiting for vLLM's engine core (colora/record/phases.py reads both from the timeline)."""

from __future__ import annotations

import time


class StepRate:
    """Engine steps counted in buckets of `bucket` seconds (time.perf_counter): per bucket the steps
    that ended in it, their summed duration, the part of it spent waiting for the engine core's
    output (`wait`) and the requests in flight summed over them (each step of continuous batching
    advances every running sequence by a token). Bounded memory: one entry per bucket, whatever the
    number of steps. `take()` hands the buckets over and starts afresh.

    A step here is one `llm_engine.step()` of vLLM's client in our process: it takes one engine-core
    step's outputs (waiting for them if the core has not produced them yet) and turns them into
    request outputs in Python. The core decodes in a process of its own and does not wait for the
    client, so a step that spends its time waiting is bound by the core (the GPU), and one that
    does not is bound by the client (this process's Python, which the trainer's thread shares)."""

    def __init__(self, bucket: float = 0.5):
        self.bucket = bucket
        self._b: dict[int, list] = {}  # bucket index -> [steps, busy seconds, in-flight sum, wait seconds]

    def record(self, start: float, end: float, inflight: int, wait: float = 0.0) -> None:
        b = self._b.setdefault(int(end // self.bucket), [0, 0.0, 0, 0.0])
        b[0] += 1
        b[1] += end - start
        b[2] += inflight
        b[3] += wait

    def take(self) -> list[dict]:
        """[{start, end, steps, busy, wait, inflight}] in time order (perf_counter seconds); then empty."""
        b, self._b = self._b, {}
        return [{"start": i * self.bucket, "end": (i + 1) * self.bucket, "steps": n, "busy": round(busy, 6),
                 "wait": round(wait, 6), "inflight": inflight} for i, (n, busy, inflight, wait) in sorted(b.items())]


def time_waits(engine_core) -> list[float]:
    """Wrap the client's `get_output` (where a step waits for the engine core's next outputs) to add
    each call's seconds to the returned one-element list. Any engine client works: the wrapper takes
    and hands on whatever the method does."""
    waited = [0.0]
    inner = engine_core.get_output

    def get_output(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            waited[0] += time.perf_counter() - t0

    engine_core.get_output = get_output
    return waited
