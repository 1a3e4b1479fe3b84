"""In-memory futures: one per accepted request, answered from any thread, long-polled from the event loop.

`create` runs on the event loop (it makes the asyncio.Event a poll waits on); `resolve` may run on any
thread (the trainer thread, the engine's) and wakes the loop with `call_soon_threadsafe`. A future
belongs to the tenant whose request made it: another tenant's poll finds nothing. A resolved future
is kept `ttl_s` for repeated polls (the SDK re-polls after a lost answer), then `sweep` drops it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from colora.service.scheduler import Outcome


@dataclass
class _Entry:
    tenant: str
    event: asyncio.Event
    outcome: Outcome | None = None
    resolved_at: float = field(default=0.0)


class FutureStore:
    def __init__(self, loop: asyncio.AbstractEventLoop, ttl_s: float = 3600.0):
        self._loop = loop
        self._ttl = ttl_s
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def create(self, request_id: str, tenant: str) -> None:
        with self._lock:
            self._entries[request_id] = _Entry(tenant, asyncio.Event())

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.outcome is not None:
                return
            e.outcome, e.resolved_at = outcome, time.monotonic()
        self._loop.call_soon_threadsafe(e.event.set)

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
