"""The broker's wire format: one JSON object a line over a Unix socket, as OpenRL's time-slicer speaks.

A tenant's connection carries both directions. The tenant asks and the broker answers:

| tenant sends | broker answers |
| --- | --- |
| `REGISTER{tenant, pids, resident_bytes, peak_bytes?}` (first line) | `REGISTERED{origin, policy}` |
| `ACQUIRE{tenant, phase}` | `GRANT{waited_s, restored, parked, granted}` once the grant is this tenant's |
| `YIELD{tenant}` | `YIELDED{pending, deferred}` at once |
| `PEAK{bytes}` (policy memory: the peak it measured, replacing `peak_bytes`) | nothing (ERROR if it cannot fit) |
| `STATUS{}` (also as a connection's first line, unregistered) | `STATUS{holder, holders, queue, tenants}` |
| `BYE{}` | nothing: the tenant leaves cleanly (EOF without BYE is a death) |

and the broker commands, on the same connection (llm-d's app channel turned the same way round):

| broker sends | tenant answers |
| --- | --- |
| `PARK{}` (never while the tenant holds the grant) | `DONE{ok, seconds, bytes, error?}` |
| `RESTORE{}` (before a GRANT, while the tenant waits) | `DONE{ok, seconds, bytes, error?}` |

A message the broker refuses is answered `ERROR{error}`; `tenant`, where a message names one, must
be the connection's own. Times are seconds on `time.monotonic()`, one clock for every process of a
host; `origin` is the broker's zero, so a tenant's `time.monotonic() - origin` lies on the broker's
timeline.
"""

from __future__ import annotations

import json
import os

POLICIES = ("lazy", "eager", "never", "memory")
# sockaddr_un's sun_path is 108 bytes on Linux, one of them the terminating zero.
MAX_SOCK_PATH_BYTES = 107


class ProtocolError(ValueError):
    """A line that is not one JSON object with a string `op`."""


def encode(msg: dict) -> bytes:
    """One message as one line."""
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> dict:
    """One line as a message; raises ProtocolError naming the line when it is not one."""
    try:
        msg = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"not a JSON line: {line[:200]!r} ({e})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError(f"a message is a JSON object with a string 'op', got {line[:200]!r}")
    return msg


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"timeslice policy {policy!r} is not one of {', '.join(POLICIES)}")
    return policy


def check_sock_path(path: str | os.PathLike) -> str:
    """The socket's path as a string; raises ValueError when a Unix socket cannot have it."""
    s = os.fspath(path)
    n = len(os.fsencode(s))
    if n > MAX_SOCK_PATH_BYTES:
        raise ValueError(f"socket path {s!r} is {n} bytes; a Unix socket's path holds at most "
                         f"{MAX_SOCK_PATH_BYTES} (put the run directory higher, or the socket in /tmp)")
    return s
