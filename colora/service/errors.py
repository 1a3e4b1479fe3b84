"""The service's refusals and failures: the error a client is answered, and the operator's record of them.

`ApiError` is an HTTP error answer; its body is `{error, category}` (plus fields naming a limit, where
one refused). `scrub` takes every server filesystem path out of a message a client will read: a
checkpoint's folder becomes its `tinker://` path, any other path its last component. `Journal` keeps
the last refused or failed requests (for `Service.snapshot`), counts them per tenant, and writes one
operator log line for each, at most `burst` lines per tenant a minute: the rest are counted and
summed up in one line when the minute ends, so a tenant that sends a bad request in a loop cannot
fill the server's disk with its log.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
import time
from pathlib import Path

from colora.service.store import KINDS, TEMP

log = logging.getLogger("colora.service")


class ApiError(Exception):
    """An HTTP error answer: the body is {error, category} and `fields` (an empty error body reads as a
    proxy fault). `fields` name what refused: e.g. {"limit": "models", "value": 8, "count": 8}."""

    def __init__(self, status: int, message: str, category: str = "user", **fields):
        super().__init__(message)
        self.status, self.message, self.category, self.fields = status, message, category, fields

    def body(self) -> dict:
        return {"error": self.message, "category": self.category, **self.fields}


def limit_error(status: int, tenant: str, limit: str, value: int, count: int, what: str, advice: str) -> ApiError:
    """A refusal by one of the keys file's limits (429: wait and retry; 403: a quota, free something first)."""
    return ApiError(status, f"tenant {tenant!r} is at its limit of {what}: limits.{limit} = {value}, it has "
                            f"{count}; {advice}", limit=limit, value=value, count=count)


# an absolute path of two or more components where a word may start (not inside tinker:// or a URL)
_PATH = re.compile(r"""(?:^|(?<=[\s'"(=\[]))/[^\s'"(),/]+/[^\s'"(),]*""")


def scrub(message: str, out: Path, keep: tuple[str, ...] = ()) -> str:
    """`message` with no server path in it: a checkpoint's folder (or a file in it) under `out` becomes its
    tinker:// path, any other absolute path its last component. The strings in `keep` (the served model's
    name, which clients pass as base_model) stay as they are."""
    roots = [r.rstrip("/") + "/" for r in {str(out), str(Path(out).resolve())}]

    def one(m: re.Match) -> str:
        path = m[0].rstrip(".:;")
        tail = m[0][len(path):]
        if path in keep:
            return m[0]
        for root in roots:
            if path.startswith(root):
                parts = path[len(root):].split("/")
                if len(parts) >= 5 and parts[0] == "tenants" and parts[3] in KINDS:
                    temp = TEMP.fullmatch(parts[4])  # a checkpoint being written is named by its name
                    name = temp[2] if temp else parts[4]
                    return f"tinker://{parts[2]}/{parts[3]}/{name}{tail}"
        return (path.rstrip("/").rsplit("/", 1)[-1] or "<path>") + tail

    return _PATH.sub(one, message) if "/" in message else message


class Journal:
    """The last `keep` refused or failed requests and each tenant's count of them; the operator's lines."""

    def __init__(self, keep: int = 100, burst: int = 20, window_s: float = 60.0):
        self._recent: collections.deque = collections.deque(maxlen=keep)
        self._counts: collections.Counter = collections.Counter()
        self._burst, self._window = burst, window_s
        self._lines: dict[str, list] = {}  # tenant -> [window start, lines written, lines held back]
        self._lock = threading.Lock()

    def record(self, tenant: str, route: str, status: int, category: str, reason: str) -> None:
        now = time.time()
        with self._lock:
            self._recent.append({"time": round(now, 3), "tenant": tenant, "route": route, "status": status,
                                 "category": category, "reason": reason})
            self._counts[tenant] += 1
            w = self._lines.setdefault(tenant, [now, 0, 0])
            held = 0
            if now - w[0] >= self._window:
                held, w[:] = w[2], [now, 0, 0]
            w[1] += 1
            write = w[1] <= self._burst
            if not write:
                w[2] += 1
        if held:
            log.info("tenant %s: %d more refused or failed requests were not logged", tenant, held)
        if write:
            log.info("%s %s of tenant %s (%d %s): %s", "refused" if status >= 400 and category != "server" else "failed", route, tenant, status,
                     category, reason)

    def count(self, tenant: str) -> int:
        with self._lock:
            return self._counts[tenant]

    def recent(self, tenant: str | None = None) -> list[dict]:
        """Oldest first; only `tenant`'s when given."""
        with self._lock:
            return [dict(e) for e in self._recent if tenant is None or e["tenant"] == tenant]
