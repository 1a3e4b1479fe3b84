"""The tenant's side of the broker: a gate around every GPU phase.

    gate = GpuGate(sock_path, "tenant-0", parkers=[engine_parker])   # connects and registers
    with gate.phase("generate"):          # ACQUIRE ... GRANT; YIELD when the block ends
        ...load the adapter, generate...
    gate.add_parker(trainer_parker)       # while holding: parkers made inside a grant join later
    gate.close()                          # BYE: leaves cleanly (a process that dies is marked failed)

The tenant's main thread calls `acquire` / `yield_` (or `phase`). A wait for the grant looks at the run's
stop request every WAIT_S (a signal while the tenant trains only records it: colora/stopping.py) and
raises `Interrupted` on one; its ACQUIRE stays with the broker, and `close` gives back a grant that came
meanwhile. A listener thread reads the connection: replies go to the main thread, and PARK / RESTORE are served there and then by the parkers
(PARK in the order given, RESTORE in reverse) and answered DONE with the seconds and the device bytes.
The broker sends neither to the holder of the grant; the listener checks it and answers a broken
promise with a failed DONE, which fails this tenant rather than parking state a phase is using.

`NullGate` has the same interface and does nothing: every arm but `timeslice` runs through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import socket
import threading
import time
from typing import Iterator, Protocol, Sequence

from colora import stopping
from colora.timeslice.protocol import ProtocolError, check_sock_path, decode, encode

WAIT_S = 0.5  # the longest a wait for the broker's answer goes without looking at the stop request


@dataclasses.dataclass(frozen=True)
class ParkStats:
    """What one park or restore did: wall seconds, the bytes freed where the state lives (park) or
    taken there again (restore), and the bytes copied to or from host buffers."""

    seconds: float
    bytes: int
    copied_bytes: int = 0


class Parker(Protocol):
    label: str

    def park(self) -> ParkStats: ...

    def restore(self) -> ParkStats: ...


@dataclasses.dataclass(frozen=True)
class Grant:
    waited_s: float  # from ACQUIRE received to GRANT sent, on the broker's clock
    restored: bool  # this tenant was restored before the grant
    parked: tuple[str, ...]  # the tenants parked in the switch before it
    granted: float  # on the shared clock (seconds since the broker's origin)


@dataclasses.dataclass(frozen=True)
class Yielded:
    pending: int  # tenants waiting when the grant was given back
    deferred: bool  # the broker does not park this tenant now


class BrokerGone(RuntimeError):
    """The broker's connection ended (the broker stopped or died, or failed this tenant)."""


class BrokerRefused(RuntimeError):
    """The broker answered ERROR: a message out of protocol (say, YIELD without the grant)."""


class _GateBase:
    tenant: str
    origin: float

    def __init__(self) -> None:
        self._held = False
        self._state = threading.Lock()

    @property
    def holds(self) -> bool:
        """Whether this tenant holds the grant now."""
        return self._held

    def now(self) -> float:
        """Seconds since the broker's origin, on the host's one monotonic clock."""
        return time.monotonic() - self.origin

    def _check_acquire(self) -> None:
        if self._held:
            raise RuntimeError(f"tenant {self.tenant!r} holds the grant already: yield_ before acquiring again")

    def _check_yield(self) -> None:
        if not self._held:
            raise RuntimeError(f"tenant {self.tenant!r} does not hold the grant: nothing to yield")

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Grant]:
        """Hold the grant for the block. The grant is yielded when the block ends, also on error."""
        grant = self.acquire(name)
        try:
            yield grant
        except BaseException:
            with contextlib.suppress(BrokerGone):
                self.yield_()
            raise
        self.yield_()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullGate(_GateBase):
    """The gate of every other arm: grants at once, parks nothing, checks the same misuse."""

    def __init__(self, tenant: str = "solo"):
        super().__init__()
        self.tenant = tenant
        self.origin = time.monotonic()
        self.events: list[dict] = []

    def add_parker(self, parker: Parker) -> None:
        pass

    def acquire(self, phase: str) -> Grant:
        self._check_acquire()
        self._held = True
        return Grant(0.0, False, (), self.now())

    def yield_(self) -> Yielded:
        self._check_yield()
        self._held = False
        return Yielded(0, True)

    def report_peak(self, nbytes: int) -> None:
        pass

    def close(self) -> None:
        pass


_EOF = object()


class GpuGate(_GateBase):
    """A tenant's connection to the broker (see the module docstring). `events` lists the parks and
    restores this tenant served: op, at (shared clock), seconds, bytes, and each parker's part."""

    def __init__(self, sock_path: str | os.PathLike, tenant: str, parkers: Sequence[Parker] = (), *,
                 pids: Sequence[int] | None = None, resident_bytes: int = 0, connect_timeout_s: float = 30.0,
                 stop_request: stopping.StopRequest | None = None, peak_bytes: int | None = None):
        """stop_request: what a wait for the grant looks at; None: the stop request of the signal
        handlers installed when it waits (the tenant's run's: colora/stopping.py `active`). peak_bytes: the
        device memory this tenant takes while resident, which the broker's policy "memory" admits it by
        (None: resident_bytes); `report_peak` replaces it once measured."""
        super().__init__()
        self.tenant = tenant
        self.stop_request = stop_request
        self.sock_path = check_sock_path(sock_path)
        self._parkers = list(parkers)
        self.events: list[dict] = []
        self._replies: queue.Queue = queue.Queue()
        self._wlock = threading.Lock()
        self._call_lock = threading.Lock()
        self._gone_reason = "the broker closed the connection"
        self._closed = False
        self._sock = _connect(self.sock_path, connect_timeout_s)
        self._rfile = self._sock.makefile("rb")
        self._send({"op": "REGISTER", "tenant": tenant, "pids": list(pids) if pids is not None else [os.getpid()],
                    "resident_bytes": int(resident_bytes),
                    "peak_bytes": int(resident_bytes if peak_bytes is None else peak_bytes)})
        self._sock.settimeout(connect_timeout_s)  # a broker that never answers REGISTER is an error
        try:
            first = self._rfile.readline()
        except TimeoutError:
            self._sock.close()
            raise BrokerGone(f"no answer to REGISTER of {tenant!r} on {self.sock_path} "
                             f"within {connect_timeout_s} s") from None
        self._sock.settimeout(None)
        if not first:
            self._sock.close()
            raise BrokerGone(f"the broker on {self.sock_path} closed the connection at REGISTER of {tenant!r}")
        reply = decode(first)
        if reply["op"] != "REGISTERED":
            self._sock.close()
            raise BrokerRefused(f"REGISTER of {tenant!r}: {reply.get('error', reply)}")
        self.origin = float(reply["origin"])
        self.policy = reply["policy"]
        self._listener = threading.Thread(target=self._listen, name=f"gate-{tenant}", daemon=True)
        self._listener.start()

    def add_parker(self, parker: Parker) -> None:
        """Add a parker; only while holding the grant, so no park runs while the list changes."""
        with self._state:
            if not self._held:
                raise RuntimeError(f"tenant {self.tenant!r} adds a parker only while it holds the grant")
            self._parkers.append(parker)

    def acquire(self, phase: str) -> Grant:
        """Wait for the grant (FIFO behind the tenants asking before). Raises BrokerGone if the
        broker stops meanwhile, Interrupted on a stop request (none is begun after one)."""
        self._check_acquire()
        self._stop_check()
        r = self._call({"op": "ACQUIRE", "tenant": self.tenant, "phase": phase}, "GRANT", stoppable=True)
        return Grant(float(r["waited_s"]), bool(r["restored"]), tuple(r["parked"]), float(r["granted"]))

    def yield_(self) -> Yielded:
        """Give the grant back; returns at once (a park, if the policy wants one, runs in the listener)."""
        self._check_yield()
        with self._state:
            self._held = False  # before YIELD leaves: a PARK may follow it at once
        r = self._call({"op": "YIELD", "tenant": self.tenant}, "YIELDED")
        return Yielded(int(r["pending"]), bool(r["deferred"]))

    def report_peak(self, nbytes: int) -> None:
        """Tell the broker the device memory this tenant measured it takes while resident (policy "memory"
        admits it by that). No answer; a peak that can never fit is answered ERROR at the next call."""
        try:
            self._send({"op": "PEAK", "bytes": int(nbytes)})
        except OSError as e:
            raise BrokerGone(f"tenant {self.tenant!r}: {self._why_gone()} ({e})") from None

    def status(self) -> dict:
        """The broker's view: holder, queue, tenants."""
        return self._call({"op": "STATUS"}, "STATUS")

    def close(self, timeout_s: float = 10.0) -> None:
        """Leave cleanly: BYE, then wait for the broker to close the connection (so nothing it sent
        before reading BYE meets a closed socket), at most timeout_s. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._send({"op": "BYE"})
        self._listener.join(timeout_s)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the listener's read if the broker did not close
        self._listener.join(timeout_s)
        self._rfile.close()
        self._sock.close()

    # ---- internals

    def _send(self, msg: dict) -> None:
        with self._wlock:
            self._sock.sendall(encode(msg))

    def _stop_check(self) -> None:
        stop = self.stop_request or stopping.active()
        if stop is not None:
            stop.check()

    def _call(self, msg: dict, expect: str, stoppable: bool = False) -> dict:
        with self._call_lock:
            if self._closed:
                raise BrokerGone(f"tenant {self.tenant!r}'s gate is closed")
            try:
                self._send(msg)
            except OSError as e:
                raise BrokerGone(f"tenant {self.tenant!r}: {self._why_gone()} ({e})") from None
            while True:  # the broker answers every message but ACQUIRE at once
                try:
                    reply = self._replies.get(timeout=WAIT_S if stoppable else None)
                    break
                except queue.Empty:
                    self._stop_check()
            if reply is _EOF:
                self._replies.put(_EOF)  # every later call sees it too
                raise BrokerGone(f"tenant {self.tenant!r}: {self._gone_reason}")
            if reply["op"] == "ERROR":
                raise BrokerRefused(reply["error"])
            if reply["op"] != expect:
                raise ProtocolError(f"tenant {self.tenant!r} expected {expect} and got {reply}")
            return reply

    def _why_gone(self) -> str:
        """Why the connection is gone: the ERROR the broker sent before it closed it (it fails a tenant
        that holds the grant too long so), else how it ended. Read once the listener has read the end."""
        self._listener.join(WAIT_S)
        with contextlib.suppress(queue.Empty):
            while (r := self._replies.get_nowait()) is not _EOF:
                if r["op"] == "ERROR":
                    self._gone_reason = r["error"]
        self._replies.put(_EOF)
        return self._gone_reason

    def _listen(self) -> None:
        try:
            for line in self._rfile:
                msg = decode(line)
                if msg["op"] in ("PARK", "RESTORE"):
                    if not self._serve(msg["op"]):
                        break
                else:
                    if msg["op"] == "GRANT":  # held from here: the check in _serve sees it at once
                        with self._state:
                            self._held = True
                    self._replies.put(msg)
        except (OSError, ValueError) as e:
            if not self._closed:
                self._gone_reason = f"the connection broke: {e!r}"
        finally:
            self._replies.put(_EOF)

    def _serve(self, op: str) -> bool:
        """Run the parkers for PARK or RESTORE and answer DONE; False when it failed (the broker then
        fails this tenant and closes the connection)."""
        with self._state:
            held, parkers = self._held, list(self._parkers)
        at, t0, parts = self.now(), time.perf_counter(), []
        try:
            if held:
                raise AssertionError(f"tenant {self.tenant!r} got {op} while it holds the grant")
            if self._closed:  # sent before the broker read BYE: the tenant is leaving, park nothing
                raise RuntimeError(f"tenant {self.tenant!r} is leaving")
            for p in parkers if op == "PARK" else reversed(parkers):
                s = p.park() if op == "PARK" else p.restore()
                parts.append({"label": p.label, "seconds": s.seconds, "bytes": s.bytes,
                              "copied_bytes": s.copied_bytes})
            reply = {"op": "DONE", "ok": True, "seconds": time.perf_counter() - t0,
                     "bytes": sum(p["bytes"] for p in parts)}
        except Exception as e:  # a parker's failure fails this tenant, not the broker
            self._gone_reason = f"{op} failed here: {type(e).__name__}: {e}"
            reply = {"op": "DONE", "ok": False, "error": f"{type(e).__name__}: {e}"}
        self.events.append({"op": op.lower(), "at": at, "seconds": time.perf_counter() - t0,
                            "bytes": reply.get("bytes", 0), "ok": reply["ok"], "parkers": parts})
        try:
            self._send(reply)
        except OSError:
            return False
        return reply["ok"]


def _connect(path: str, timeout_s: float) -> socket.socket:
    """Connect, retrying while the broker starts (no socket yet, or nobody listening yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except (FileNotFoundError, ConnectionRefusedError) as e:
            s.close()
            if time.monotonic() > deadline:
                raise BrokerGone(f"no broker listens on {path} (waited {timeout_s} s): {e}") from None
            time.sleep(0.02)
