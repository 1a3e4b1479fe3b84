"""In-memory futures: one per accepted request, answered from any thread, long-polled from the event loop.

`create` runs on the event loop (it makes the asyncio.Event a poll waits on); `resolve` may run on any
thread (the trainer thread, the engine's) and wakes the loop with `call_soon_threadsafe`. A future
belongs to the tenant whose request made it: another tenant's poll finds nothing. A resolved future
is kept `ttl_s` for repeated polls (the SDK re-polls after a lost answer), then `sweep` drops it.
`failure_answer` is the one place where a failed request's outcome becomes an HTTP answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

from colora.service.scheduler import Outcome


# What retrieve_future answers for a failure that may succeed if sent again (Outcome.retry: a sample that was
# decoding when the engine died). The SDK raises RequestFailedError at a 200 with {error, category}, polls the
# same future again at a 5xx, and at a 410 its sampling client sends the sample again (tinker 0.38.0).
RETRY_STATUS = 410


def failure_answer(outcome: Outcome) -> tuple[int, dict]:
    """(HTTP status, body) of retrieve_future for a failed request."""
    body = {"error": outcome.error, "category": outcome.category}
    return (RETRY_STATUS if outcome.retry else 200), body


@dataclass
class _Entry:
    tenant: str
    event: asyncio.Event
    route: str = ""
    outcome: Outcome | None = None
    resolved_at: float = field(default=0.0)


class FutureStore:
    def __init__(self, loop: asyncio.AbstractEventLoop, ttl_s: float = 3600.0):
        self._loop = loop
        self._ttl = ttl_s
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def create(self, request_id: str, tenant: str, route: str = "") -> None:
        with self._lock:
            self._entries[request_id] = _Entry(tenant, asyncio.Event(), route)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def resolve(self, request_id: str, outcome: Outcome) -> tuple[str, str] | None:
        """Answers the request; returns its (tenant, route), or None when it was unknown or answered."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.outcome is not None:
                return None
            e.outcome, e.resolved_at = outcome, time.monotonic()
        with contextlib.suppress(RuntimeError):  # the loop has closed: the server stopped, nobody polls
            self._loop.call_soon_threadsafe(e.event.set)
        return e.tenant, e.route

    def unresolved(self) -> int:
        with self._lock:
            return sum(e.outcome is None for e in self._entries.values())

    def known(self, request_id: str, tenant: str) -> bool:
        with self._lock:
            e = self._entries.get(request_id)
            return e is not None and e.tenant == tenant

    async def wait(self, request_id: str, tenant: str, timeout: float) -> Outcome | None:
        """The outcome, or None when the request is not done within `timeout` seconds. KeyError when
        the request is unknown to this tenant."""
        with self._lock:
            e = self._entries.get(request_id)
        if e is None or e.tenant != tenant:
            raise KeyError(request_id)
        if e.outcome is None:
            try:
                await asyncio.wait_for(e.event.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        return e.outcome

    def sweep(self, now: float | None = None) -> int:
        """Drops futures resolved more than ttl_s ago; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [k for k, e in self._entries.items() if e.outcome is not None and now - e.resolved_at > self._ttl]
            for k in old:
                del self._entries[k]
        return len(old)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
