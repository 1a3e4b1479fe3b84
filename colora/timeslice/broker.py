"""The time-slicing broker: one process grants the GPU to one tenant at a time, first come first served.

    proc = start_broker("/tmp/run/timeslice.sock", policy="lazy", log_path="run/timeslice.jsonl")
    ...tenants connect through colora.timeslice.gate.GpuGate...
    proc.stop()                       # or SIGTERM to proc.pid; both end in bounded time

(process.py starts it as a process of its own; here is the broker itself.)

The seeds' design (llm-d's TimeSlice Orchestrator, OpenRL's node-local time-slicer): each tenant
wraps every GPU phase in ACQUIRE / YIELD (protocol.py gives the messages). The broker

- grants in FIFO order of the ACQUIREs it received, one grant at a time;
- parks before it grants (the handshake): the tenants the policy names are sent PARK and the broker
  waits for their DONE, then the grantee, if parked, is sent RESTORE and its DONE awaited, then GRANT;
- policy `lazy` (llm-d, the default): at a grant every other resident tenant is parked, so a tenant
  is parked only when another one waits; a YIELD with nobody waiting defers the park, and the same
  tenant's next grant needs no switch. `eager` (OpenRL's daemon): every YIELD parks the yielder
  before the next grant, its own included. `never`: a mutex; nothing is parked. Resident means
  holding unparked GPU state: having held a grant since the last park, or registered with
  resident_bytes > 0 (GPU work runs inside grants, so a tenant that has held none has nothing to park);
- policy `memory` (colora's: co-residence, as tenants under MPS share the GPU): grants are not exclusive.
  A tenant whose state is on the GPU is granted at once, beside any others; one that is not (its first
  grant, or parked) is admitted when its peak bytes (`peak_bytes` at REGISTER, updated by PEAK once it has
  measured them) fit `memory_bytes` beside the resident tenants' peaks. Where they do not, the broker parks
  resident tenants that hold no grant, least recently granted first, until they do; where even that
  cannot make room (the others hold grants) it waits, and so do the tenants queued behind it (first
  come, first served). A tenant whose peak alone exceeds `memory_bytes` is refused (ERROR, then failed):
  admitting it could only run the device out of memory under the others. Nothing is parked at a YIELD;
- reads EOF of a tenant's connection without BYE as its death: its grant is freed, it leaves the
  queue, it is marked failed, and the queue goes on (a process-shared lock held by a dead process
  would stay held: that is why this is a socket);
- fails a tenant that holds one grant longer than `hold_timeout_s` (stuck in its phase): it is told why
  (ERROR), its connection is closed and the grant goes on to the next in the queue, so one stuck tenant
  does not stall every other. What it still runs on the GPU is its own process's to end;
- records every grant, park, restore and failure in `timeslice.jsonl` (record.py summarises it).

A grant row carries the switch that preceded it: the tenants parked since the last grant, their
park seconds and the grantee's restore seconds, each measured by the broker from command to DONE.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import socket
import time

from colora.record.runlog import JsonlWriter
from colora.timeslice.protocol import ProtocolError, check_policy, check_sock_path, decode, encode

GIB = 1 << 30

# timeslice.hold_timeout_s's default: above any phase a healthy tenant holds (its engine's start and warm-up take
# minutes; not measured at 8B); a co-run tenant under `memory` holds one grant for its whole training
HOLD_TIMEOUT_S = 1800.0


@dataclasses.dataclass(eq=False)
class _Tenant:
    name: str
    pids: list[int]
    resident_bytes: int
    writer: asyncio.StreamWriter
    peak_bytes: int = 0  # `memory`: the device memory it takes while resident
    last_used: float = 0.0  # when it last held a grant: `memory` parks the least recently used first
    resident: bool = False  # has state on the GPU that is not parked: held a grant, or registered with bytes
    parked: bool = False  # its state is parked: restored before its next grant
    park_due: bool = False  # eager: it yielded and is parked before the next grant
    alive: bool = True
    left: bool = False  # said BYE: gone, not failed
    failed: str | None = None
    done: asyncio.Future | None = None  # the DONE awaited for the PARK or RESTORE in flight


@dataclasses.dataclass(eq=False)
class _Request:
    tenant: _Tenant
    phase: str
    requested: float


@dataclasses.dataclass
class _Switch:
    """What ran since the last grant; the next grant's row carries it."""

    parked: list[str] = dataclasses.field(default_factory=list)
    park_s: float = 0.0
    restore_s: float = 0.0
    restored: str | None = None  # the tenant restored


def _r(x: float) -> float:
    return round(x, 6)


class Broker:
    """The broker's state and its asyncio server. Runs in one event loop (`serve`); `request_stop`
    may be called from any thread or a signal handler."""

    def __init__(self, sock_path: str | os.PathLike, policy: str = "lazy", log_path: str | os.PathLike | None = None,
                 *, switch_timeout_s: float = 600.0, hold_timeout_s: float = HOLD_TIMEOUT_S,
                 memory_bytes: int = 0):
        self.sock_path = check_sock_path(sock_path)
        self.policy = check_policy(policy)
        if (policy == "memory") != (memory_bytes > 0):
            raise ValueError(f"memory_bytes ({memory_bytes}) is the device memory the tenants share under policy "
                             f"\"memory\" (there it must be above 0), and 0 under any other ({policy!r})")
        self.memory_bytes = int(memory_bytes)
        if not switch_timeout_s > 0:
            raise ValueError(f"switch_timeout_s ({switch_timeout_s}) must be positive")
        if not hold_timeout_s > 0:
            raise ValueError(f"hold_timeout_s ({hold_timeout_s}) must be positive (seconds; timeslice.hold_timeout_s)")
        self.switch_timeout_s = switch_timeout_s
        self.hold_timeout_s = hold_timeout_s
        self._timers: dict[_Tenant, asyncio.TimerHandle] = {}  # fail a holder past hold_timeout_s
        self.origin = time.monotonic()
        self.rows: list[dict] = []  # the record, also kept here
        self._log = JsonlWriter(log_path) if log_path is not None else None
        self._tenants: dict[str, _Tenant] = {}
        self._queue: collections.deque[_Request] = collections.deque()
        self._grants: dict[_Tenant, dict] = {}  # each holder's open grant row (one at most but under `memory`)
        self._switch = _Switch()
        self._stopping = False
        self._stop_requested = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._conns: set[asyncio.Task] = set()

    def now(self) -> float:
        """Seconds on the shared clock since the broker's origin."""
        return time.monotonic() - self.origin

    # ---- serving and stopping

    async def serve(self) -> None:
        """Listen on the socket until a stop is requested, then close every connection (tenants read
        EOF), record the open grant as released, and remove the socket."""
        self._loop = asyncio.get_running_loop()
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        _claim_path(self.sock_path)
        server = await asyncio.start_unix_server(self._connection, path=self.sock_path)
        self._record(kind="start", policy=self.policy, origin=self.origin, pid=os.getpid(), at=_r(self.now()))
        scheduler = asyncio.create_task(self._schedule())
        try:
            if not self._stop_requested:
                await self._stop.wait()
        finally:
            await self._shutdown(server, scheduler)

    def request_stop(self) -> None:
        """Ask `serve` to end: safe from any thread and from a signal handler."""
        self._stop_requested = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)

    async def _shutdown(self, server: asyncio.AbstractServer, scheduler: asyncio.Task) -> None:
        self._stopping = True
        server.close()
        scheduler.cancel()
        for t in list(self._grants):
            self._release(t, stopped=True)
        for t in self._tenants.values():
            if t.done is not None and not t.done.done():
                t.done.set_result({"ok": False, "error": "broker stopped"})
            t.writer.close()
        for task in list(self._conns):
            task.cancel()
        # bounded: a connection task ends at its next await once cancelled
        await asyncio.wait([scheduler, *self._conns], timeout=5.0)
        self._record(kind="stop", at=_r(self.now()),
                     failed=sorted(t.name for t in self._tenants.values() if t.failed))
        if self._log is not None:
            self._log.close()
        try:
            os.unlink(self.sock_path)
        except FileNotFoundError:
            pass

    # ---- connections and messages

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(asyncio.current_task())
        tenant: _Tenant | None = None
        reason = "connection closed without BYE"
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                msg = decode(line)
                if tenant is None:
                    if msg["op"] == "STATUS":
                        writer.write(encode(self._status()))
                        continue
                    if msg["op"] != "REGISTER":
                        raise ProtocolError(f"a connection opens with REGISTER or STATUS, not {msg['op']}")
                    tenant = self._register(msg, writer)
                    continue
                if not self._on_message(tenant, msg):
                    break
        except ProtocolError as e:
            reason = f"protocol error: {e}"
            if not writer.is_closing():
                writer.write(encode({"op": "ERROR", "error": str(e)}))
        except (ConnectionError, ValueError) as e:  # ValueError: a line over the reader's limit
            reason = f"connection lost: {e!r}"
        except asyncio.CancelledError:
            pass  # the broker stops
        finally:
            self._conns.discard(asyncio.current_task())
            if tenant is not None:
                self._gone(tenant, reason)
            writer.close()

    def _register(self, msg: dict, writer: asyncio.StreamWriter) -> _Tenant:
        name = msg.get("tenant")
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"REGISTER needs a non-empty string 'tenant', got {name!r}")
        old = self._tenants.get(name)
        if old is not None and old.alive:
            raise ProtocolError(f"tenant {name!r} is registered already, on a live connection")
        pids = [int(p) for p in msg.get("pids", [])]
        resident = int(msg.get("resident_bytes", 0))
        peak = int(msg.get("peak_bytes", resident))
        t = _Tenant(name, pids, resident, writer, resident=resident > 0, peak_bytes=peak)
        self._tenants[name] = t
        self._send(t, {"op": "REGISTERED", "origin": self.origin, "policy": self.policy})
        self._record(kind="register", tenant=name, pids=pids, resident_bytes=resident, peak_bytes=peak,
                     at=_r(self.now()))
        self._check_peak(t)
        return t

    def _check_peak(self, t: _Tenant) -> None:
        """`memory`: a tenant whose peak alone exceeds the device memory is refused (it is failed)."""
        if self.policy == "memory" and t.peak_bytes > self.memory_bytes:
            why = (f"its peak of {t.peak_bytes / GIB:.2f} GiB exceeds the {self.memory_bytes / GIB:.2f} GiB the "
                   "tenants share (timeslice.memory_gib): it could only run out of memory beside the others")
            self._send(t, {"op": "ERROR", "error": f"tenant {t.name!r}: {why}"})
            self._fail(t, why)

    def _on_message(self, t: _Tenant, msg: dict) -> bool:
        """Handle one message of a registered tenant; False once it said BYE or is failed."""
        if not t.alive:
            return False
        op, error = msg["op"], None
        if msg.get("tenant", t.name) != t.name:
            error = f"a message for tenant {msg['tenant']!r} on the connection of {t.name!r}"
        elif op == "ACQUIRE":
            if t in self._grants:
                error = f"tenant {t.name!r} sent ACQUIRE while it holds the grant"
            elif any(r.tenant is t for r in self._queue):
                error = f"tenant {t.name!r} sent ACQUIRE while it waits already"
            else:
                self._queue.append(_Request(t, str(msg.get("phase", "")), self.now()))
                self._wake.set()
        elif op == "YIELD":
            if t not in self._grants:
                holders = [h.name for h in self._grants] or None
                error = f"tenant {t.name!r} sent YIELD but the grant is held by {holders!r}"
            else:
                pending = len(self._queue)
                self._release(t)
                t.park_due = self.policy == "eager"
                deferred = {"eager": False, "lazy": pending == 0, "never": True, "memory": True}[self.policy]
                self._send(t, {"op": "YIELDED", "pending": pending, "deferred": deferred})
                self._wake.set()
        elif op == "DONE":
            if t.done is None or t.done.done():
                error = f"tenant {t.name!r} sent DONE with no PARK or RESTORE in flight"
            else:
                t.done.set_result(msg)
        elif op == "PEAK":
            t.peak_bytes = int(msg.get("bytes", t.peak_bytes))
            self._record(kind="peak", tenant=t.name, peak_bytes=t.peak_bytes, at=_r(self.now()))
            self._check_peak(t)
            self._wake.set()
        elif op == "STATUS":
            self._send(t, self._status())
        elif op == "BYE":
            t.left = True
            self._gone(t, "left")
            self._record(kind="leave", tenant=t.name, at=_r(self.now()))
            return False
        else:
            error = f"unknown op {op!r}"
        if error is not None:
            self._send(t, {"op": "ERROR", "error": error})
        return True

    def _status(self) -> dict:
        holders = [h.name for h in self._grants]
        return {"op": "STATUS", "holder": holders[0] if holders else None, "holders": holders,
                "queue": [r.tenant.name for r in self._queue],
                "tenants": {t.name: {"alive": t.alive, "resident": t.resident, "parked": t.parked,
                                     "failed": t.failed} for t in self._tenants.values()}}

    def _send(self, t: _Tenant, msg: dict) -> None:
        if not t.writer.is_closing():
            t.writer.write(encode(msg))

    def _gone(self, t: _Tenant, reason: str) -> None:
        """The tenant is gone (BYE sets `left` first; else EOF, a protocol error or a failed command):
        free what it held and wake the queue. A tenant gone without BYE is marked failed. Runs once."""
        if not t.alive:
            return
        t.alive = False
        if self._stopping:
            return
        if not t.left:
            t.failed = reason
            self._record(kind="failed", tenant=t.name, at=_r(self.now()), reason=reason)
        if t in self._grants:
            self._release(t, failed=not t.left)
        self._queue = collections.deque(r for r in self._queue if r.tenant is not t)
        if t.done is not None and not t.done.done():
            t.done.set_result({"ok": False, "error": reason})
        if self._switch.restored == t.name:  # its restore bought nothing for the next grant
            self._switch.restored, self._switch.restore_s = None, 0.0
        self._wake.set()

    def _fail(self, t: _Tenant, reason: str) -> None:
        self._gone(t, reason)
        t.writer.close()

    # ---- grants and switches

    def _release(self, t: _Tenant, **extra) -> None:
        timer = self._timers.pop(t, None)
        if timer is not None:
            timer.cancel()
        row = self._grants.pop(t)
        t.last_used = self.now()
        row.update(released=_r(t.last_used), **extra)
        self._record(**row)

    async def _schedule(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while await self._step():
                pass

    def _victims(self, head: _Tenant | None) -> list[_Tenant]:
        """The tenants the policy parks before the next grant (to `head`, if any waits)."""
        live = [t for t in self._tenants.values() if t.alive and t.resident]
        if self.policy == "eager":
            return [t for t in live if t.park_due]
        if self.policy == "lazy" and head is not None:
            return [t for t in live if t is not head]
        return []

    async def _step(self) -> bool:
        """One move towards the next grant: a park, a restore or the grant. False when none is due."""
        if self.policy == "memory":
            return await self._step_memory()
        if self._grants or self._stopping:
            return False
        head = self._queue[0].tenant if self._queue else None
        victims = self._victims(head)
        if victims:
            # one at a time, then look again: the queue may change while a park runs
            await self._command(victims[0], "PARK")
            return True
        if head is None:
            return False
        if head.parked:
            await self._command(head, "RESTORE")
            return True
        self._grant_to(self._queue.popleft())
        return True

    def _grant_to(self, req: _Request) -> None:
        """GRANT to the request's tenant, its row carrying the switch since the last grant."""
        head, now = req.tenant, self.now()
        sw, self._switch = self._switch, _Switch()
        restored = sw.restored == head.name
        head.resident = True
        row = self._grants[head] = {
            "kind": "grant", "tenant": head.name, "phase": req.phase, "requested": _r(req.requested),
            "granted": _r(now), "released": None, "waited_s": _r(now - req.requested), "parked": sw.parked,
            "park_s": _r(sw.park_s), "restore_s": _r(sw.restore_s), "restored": restored, "failed": False,
            **({"resident_peak_bytes": self._resident_peaks()} if self.policy == "memory" else {})}
        self._send(head, {"op": "GRANT", "waited_s": now - req.requested, "restored": restored,
                          "parked": sw.parked, "granted": now})
        self._timers[head] = self._loop.call_later(self.hold_timeout_s, self._overheld, head, row)

    def _resident_peaks(self) -> int:
        return sum(t.peak_bytes for t in self._tenants.values() if t.alive and t.resident)

    async def _step_memory(self) -> bool:
        """`memory` (module docstring): in queue order, grant a resident tenant at once; admit one that is not
        where its peak fits, parking idle resident tenants (least recently used first) to make room; where
        nothing can make room, the rest of the queue waits."""
        if self._stopping:
            return False
        for req in list(self._queue):
            t = req.tenant
            if t.resident:
                self._queue.remove(req)
                self._grant_to(req)
                return True
            free = self.memory_bytes - self._resident_peaks()
            if t.peak_bytes <= free:
                if t.parked:
                    await self._command(t, "RESTORE")
                else:
                    self._queue.remove(req)
                    self._grant_to(req)
                return True
            idle = sorted((x for x in self._tenants.values() if x.alive and x.resident and x not in self._grants),
                          key=lambda x: x.last_used)
            if t.peak_bytes <= free + sum(x.peak_bytes for x in idle):
                await self._command(idle[0], "PARK")
                return True
            return False  # first come, first served: the tenants behind it wait too
        return False

    def _overheld(self, t: _Tenant, grant: dict) -> None:
        """The holder of `grant` still holds it past hold_timeout_s: it is failed, told why, and the grant
        goes on."""
        if self._grants.get(t) is not grant or self._stopping:
            return
        why = (f"held the grant past timeslice.hold_timeout_s ({self.hold_timeout_s:g} s) in its phase "
               f"{grant['phase']!r}; the broker failed it and granted the next tenant")
        self._send(t, {"op": "ERROR", "error": f"tenant {t.name!r} {why}"})
        self._fail(t, why)

    async def _command(self, t: _Tenant, op: str) -> None:
        """Send PARK or RESTORE and wait for the tenant's DONE; a failure or a silence past
        switch_timeout_s fails the tenant (its connection is closed)."""
        fut = self._loop.create_future()
        t.done = fut
        start, waiting = self.now(), len(self._queue)
        self._send(t, {"op": op})
        try:
            reply = await asyncio.wait_for(fut, self.switch_timeout_s)
        except asyncio.TimeoutError:
            reply = {"ok": False, "error": f"no DONE to {op} within {self.switch_timeout_s} s"}
        finally:
            t.done = None
        end = self.now()
        ok = bool(reply.get("ok", True)) and t.alive
        self._record(kind=op.lower(), tenant=t.name, start=_r(start), end=_r(end), wall_s=_r(end - start),
                     seconds=reply.get("seconds"), bytes=reply.get("bytes"), waiting=waiting, ok=ok,
                     **({"error": reply["error"]} if "error" in reply else {}))
        if not ok:
            if t.alive:
                self._fail(t, f"{op} failed: {reply.get('error')}")
            return
        if op == "PARK":
            t.resident, t.parked, t.park_due = False, True, False
            self._switch.parked.append(t.name)
            self._switch.park_s += end - start
        else:
            t.resident, t.parked = True, False
            self._switch.restored = t.name
            self._switch.restore_s += end - start

    def _record(self, **row) -> None:
        self.rows.append(row)
        if self._log is not None:
            self._log.write(row)


def can_connect(path: str) -> bool:
    """Whether something accepts connections on the socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:
            return False
        return True


def _claim_path(path: str) -> None:
    """Remove a stale socket file; refuse a path another broker listens on."""
    if os.path.exists(path):
        if can_connect(path):
            raise RuntimeError(f"a broker already listens on {path}")
        os.unlink(path)
