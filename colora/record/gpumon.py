"""GPU busy fraction from NVML: a thread samples `utilization.gpu` (the share of the last sample
period in which a kernel ran) on the run's timeline clock. Optional: without NVML it records nothing."""

from __future__ import annotations

import threading


class GpuSampler:
    def __init__(self, timeline, period_s: float = 0.05, device_index: int = 0):
        self.timeline = timeline
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []  # (timeline seconds, percent busy)
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception:  # no NVML (CPU machines): sample nothing
            self._nvml = None

    def __enter__(self) -> "GpuSampler":
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._loop, name="colora-gpumon", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # a daemon thread: an NVML call that hangs stays behind

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                u = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
            except Exception:
                return
            self.samples.append((self.timeline.now(), int(u)))

    def mean_between(self, start: float, end: float) -> float | None:
        vals = [u for t, u in self.samples if start <= t <= end]
        return sum(vals) / len(vals) / 100.0 if vals else None
