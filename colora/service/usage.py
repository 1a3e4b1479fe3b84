"""What each tenant has done and holds, counted as it happens, and the server's snapshot built from it.

`Usage` counts per tenant: requests accepted, forward calls, datums and trained tokens, optim steps,
samples, sampled sequences and tokens, and per live model its optim steps and its recent losses (the
sum of `loss:sum` of the forward_backward calls between two optim steps, recorded at the step).
`Service.snapshot` (colora/service/service.py) joins these with what the service holds now (sessions,
models, samplers, queues, disk) into the dict that /api/v1/colora/stats, /metrics and the status page
read:

    {"tenants": {name: {"sessions", "models", "samplers", "requests", "errors", "forward_calls",
                        "forward_datums", "trained_tokens", "optim_steps", "samples", "sampled_sequences",
                        "sampled_tokens", "queue_depth", "pending_bytes", "disk_bytes",
                        "checkpoints", "samples_in_flight", "recorded_sequences", "recorded_bytes",
                        "models_detail": [{"model_id", "session_id", "rank", "optim_steps",
                                           "recent_losses": [[optim_step_index, loss_sum, unix_time], ...]}]}},
     "server": {"uptime_s", "cycles", "cycle_seconds_sum", "last_cycle_seconds", "cycle_models_sum",
                "multi_model_cycles", "live_sessions", "futures_pending", "health", ...},
     "errors": [{"time", "tenant", "route", "status", "category", "reason"}, ...]}

optim_step_index counts a model's optim steps from 0; loss_sum is None for a step with no
forward_backward before it. A tenant's own view holds only its own entry, its own errors, and of the
server only `uptime_s` and `health`.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

RECENT_LOSSES = 100  # per model, in the snapshot


@dataclass
class Counts:
    requests: int = 0
    forward_calls: int = 0
    forward_datums: int = 0
    trained_tokens: int = 0
    optim_steps: int = 0
    samples: int = 0
    sampled_sequences: int = 0
    sampled_tokens: int = 0


@dataclass
class ModelTrack:
    optim_steps: int = 0
    loss_since_step: float | None = None
    recent_losses: collections.deque = field(default_factory=lambda: collections.deque(maxlen=RECENT_LOSSES))


class Usage:
    """Thread-safe counters: the event loop counts requests, the trainer thread cycles, the engine samples."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[str, Counts] = collections.defaultdict(Counts)
        self._models: dict[str, ModelTrack] = {}

    def request(self, tenant: str) -> None:
        with self._lock:
            self._counts[tenant].requests += 1

    def cycle(self, tenant_of, results) -> None:
        """A trainer cycle's (Work, Outcome) pairs; tenant_of(model_id) -> tenant or None (model gone)."""
        now = time.time()
        with self._lock:
            for w, o in results:
                tenant = tenant_of(w.model_id)
                if tenant is None or o.error is not None or w.kind == "barrier":
                    continue
                c, m = self._counts[tenant], self._models.setdefault(w.model_id, ModelTrack())
                if w.kind == "forward":
                    datums, tokens = w.size()
                    c.forward_calls += 1
                    c.forward_datums += datums
                    if not w.payload.forward_only:
                        c.trained_tokens += tokens
                        loss = float(o.result.metrics.get("loss:sum", 0.0))
                        m.loss_since_step = loss + (m.loss_since_step or 0.0)
                else:
                    c.optim_steps += 1
                    m.recent_losses.append([m.optim_steps, m.loss_since_step, round(now, 3)])
                    m.optim_steps += 1
                    m.loss_since_step = None

    def sampled(self, tenant: str, result) -> None:
        """A sample answered: its SampleResult, or None when it failed."""
        with self._lock:
            c = self._counts[tenant]
            c.samples += 1
            if result is not None:
                c.sampled_sequences += len(result.sequences)
                c.sampled_tokens += sum(len(s.tokens) for s in result.sequences)

    def forget_model(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)

    def tenants(self) -> list[str]:
        with self._lock:
            return list(self._counts)

    def counts(self, tenant: str) -> dict:
        with self._lock:
            return dict(vars(self._counts[tenant])) if tenant in self._counts else dict(vars(Counts()))

    def model(self, model_id: str) -> dict:
        with self._lock:
            m = self._models.get(model_id, ModelTrack())
            return {"optim_steps": m.optim_steps, "recent_losses": [list(x) for x in m.recent_losses]}
