"""The gate and the protocol, against a broker running in a thread of this process: misuse is refused
by name on both sides, the parkers run in order, a PARK sent to the holder is refused by the gate,
NullGate keeps the interface, and `Broker.request_stop` ends the broker and frees waiting tenants."""

from __future__ import annotations

import asyncio
import json
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from colora.timeslice import (
    Broker,
    BrokerGone,
    BrokerRefused,
    GpuGate,
    NullGate,
    ParkStats,
    read_log,
    start_broker,
    summarize,
)
from colora.timeslice.process import wait_listening
from colora.timeslice.protocol import decode, encode

WAIT_S = 30.0


@pytest.fixture
def sock_dir():
    with tempfile.TemporaryDirectory(prefix="ts-") as d:
        yield Path(d)


class _InThread:
    """A Broker serving in a thread of this process."""

    def __init__(self, d: Path, policy: str, **kw):
        self.sock, self.log = str(d / "ts.sock"), d / "timeslice.jsonl"
        self.broker = Broker(self.sock, policy, self.log, **kw)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.broker.serve()), daemon=True)
        self.thread.start()
        wait_listening(self.sock, WAIT_S, alive=self.thread.is_alive)

    def stop(self) -> None:
        self.broker.request_stop()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


@pytest.fixture
def lazy(sock_dir):
    b = _InThread(sock_dir, "lazy")
    yield b
    b.stop()


class _Recorder:
    def __init__(self, name: str, calls: list):
        self.label, self.calls = name, calls

    def park(self) -> ParkStats:
        self.calls.append(("park", self.label))
        return ParkStats(0.0, 10)

    def restore(self) -> ParkStats:
        self.calls.append(("restore", self.label))
        return ParkStats(0.0, 10)


def _raw(sock: str) -> tuple[socket.socket, object]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(WAIT_S)
    s.connect(sock)
    return s, s.makefile("rb")


def _ask(s, f, msg: dict) -> dict:
    s.sendall(encode(msg))
    return decode(f.readline())


def test_the_broker_refuses_messages_out_of_protocol(lazy):
    s, f = _raw(lazy.sock)
    assert _ask(s, f, {"op": "REGISTER", "tenant": "a"})["op"] == "REGISTERED"
    assert _ask(s, f, {"op": "YIELD"}) == {"op": "ERROR", "error": "tenant 'a' sent YIELD but the grant is held by None"}
    assert _ask(s, f, {"op": "ACQUIRE", "phase": "train"})["op"] == "GRANT"
    assert "while it holds the grant" in _ask(s, f, {"op": "ACQUIRE", "phase": "train"})["error"]
    assert "no PARK or RESTORE in flight" in _ask(s, f, {"op": "DONE", "ok": True})["error"]
    assert "unknown op 'FLY'" in _ask(s, f, {"op": "FLY"})["error"]
    assert "on the connection of 'a'" in _ask(s, f, {"op": "YIELD", "tenant": "b"})["error"]
    with pytest.raises(BrokerRefused, match="registered already"):
        GpuGate(lazy.sock, "a")
    s.sendall(b"not json\n")  # a line that is no message ends the connection and fails the tenant
    assert decode(f.readline())["op"] == "ERROR" and f.readline() == b""
    s.close()
    b = GpuGate(lazy.sock, "b")  # the grant a held is free again
    with b.phase("train") as g:
        assert g.parked == () and not g.restored
    assert b.status()["tenants"]["a"]["failed"].startswith("protocol error")
    b.close()


def test_the_gate_refuses_misuse_before_it_reaches_the_broker(lazy):
    gate = GpuGate(lazy.sock, "a")
    with pytest.raises(RuntimeError, match="does not hold the grant"):
        gate.yield_()
    with pytest.raises(RuntimeError, match="only while it holds the grant"):
        gate.add_parker(_Recorder("p", []))
    gate.acquire("generate")
    with pytest.raises(RuntimeError, match="holds the grant already"):
        gate.acquire("train")
    gate.yield_()
    gate.close()
    with pytest.raises(BrokerGone, match="closed"):
        gate.acquire("train")


def test_park_runs_the_parkers_in_order_and_restore_in_reverse(sock_dir):
    b = _InThread(sock_dir, "eager")
    try:
        calls: list = []
        gate = GpuGate(b.sock, "a", [_Recorder("engine", calls)])
        with gate.phase("generate"):
            gate.add_parker(_Recorder("trainer", calls))
        with gate.phase("train") as grant:
            assert grant.restored and grant.parked == ("a",)
        # (the yield at the end of "train" parks again, maybe before these lines: look at what came first)
        assert calls[:4] == [("park", "engine"), ("park", "trainer"), ("restore", "trainer"), ("restore", "engine")]
        assert [e["op"] for e in gate.events[:2]] == ["park", "restore"] and gate.events[0]["bytes"] == 20
        gate.close()
    finally:
        b.stop()
    rows = read_log(b.log)
    assert [r["kind"] for r in rows if r["kind"] in ("park", "restore")][:2] == ["park", "restore"]
    assert summarize(rows)["parks_per_tenant"]["a"] >= 1


def test_the_gate_refuses_a_park_while_it_holds_the_grant(sock_dir):
    """A broker that breaks its promise (PARK to the holder) gets a failed DONE, nothing parked."""
    path = str(sock_dir / "fake.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    done: list = []

    def fake_broker() -> None:
        conn, _ = server.accept()
        f = conn.makefile("rb")
        assert decode(f.readline())["op"] == "REGISTER"
        conn.sendall(encode({"op": "REGISTERED", "origin": 0.0, "policy": "lazy"}))
        assert decode(f.readline())["op"] == "ACQUIRE"
        conn.sendall(encode({"op": "GRANT", "waited_s": 0.0, "restored": False, "parked": [], "granted": 1.0}))
        conn.sendall(encode({"op": "PARK"}))
        done.append(decode(f.readline()))
        conn.close()

    t = threading.Thread(target=fake_broker, daemon=True)
    t.start()
    calls: list = []
    gate = GpuGate(path, "a", [_Recorder("trainer", calls)])
    gate.acquire("train")
    t.join(WAIT_S)
    assert done[0]["op"] == "DONE" and not done[0]["ok"] and "while it holds the grant" in done[0]["error"]
    assert calls == []
    gate.close(timeout_s=1.0)
    server.close()


def test_null_gate_has_the_interface_and_does_nothing():
    gate = NullGate("solo")
    with gate.phase("generate") as g:
        assert gate.holds and g.waited_s == 0.0 and not g.restored
        gate.add_parker(_Recorder("x", []))
    assert not gate.holds
    with pytest.raises(RuntimeError, match="does not hold the grant"):
        gate.yield_()
    gate.acquire("train")
    with pytest.raises(RuntimeError, match="holds the grant already"):
        gate.acquire("train")
    assert gate.yield_().deferred
    gate.close()


def test_request_stop_ends_the_broker_and_frees_waiting_tenants(sock_dir):
    b = _InThread(sock_dir, "lazy")
    holder = GpuGate(b.sock, "a")
    holder.acquire("train")
    outcome: list = []

    def waiter() -> None:
        gate = GpuGate(b.sock, "b")
        try:
            gate.acquire("train")
            outcome.append("granted")
        except BrokerGone as e:
            outcome.append(str(e))

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    deadline = time.monotonic() + WAIT_S
    while holder.status()["queue"] != ["b"]:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.01)
    b.stop()  # from this thread, while b waits in the queue and a holds the grant
    t.join(WAIT_S)
    assert outcome == ["tenant 'b': the broker closed the connection"]
    with pytest.raises(BrokerGone):
        holder.yield_()
    rows = read_log(b.log)
    assert rows[-1]["kind"] == "stop" and [r["stopped"] for r in rows if r["kind"] == "grant"] == [True]


def test_bad_settings_are_refused_by_name(sock_dir):
    with pytest.raises(ValueError, match="'fifo' is not one of lazy, eager, never"):
        start_broker(sock_dir / "ts.sock", "fifo")
    with pytest.raises(ValueError, match="a Unix socket's path holds at most 107"):
        Broker(sock_dir / ("x" * 120), "lazy")
    with pytest.raises(ValueError, match="switch_timeout_s"):
        Broker(sock_dir / "ts.sock", "lazy", switch_timeout_s=0)
    with pytest.raises(ValueError, match=r"hold_timeout_s \(0\) must be positive"):
        Broker(sock_dir / "ts.sock", "lazy", hold_timeout_s=0)


def test_a_wait_for_the_grant_ends_on_the_runs_stop_request(lazy, monkeypatch):
    """b waits for the grant a holds (a tenant stuck in its phase, say) when its run is asked to stop
    (a signal, deferred while it trains: the stop request of the handlers the run installed): its acquire
    raises Interrupted instead of waiting on; once b has left, the broker's queue no longer holds it."""
    from colora import stopping
    from colora.stopping import Interrupted, StopRequest

    holder = GpuGate(lazy.sock, "a")
    holder.acquire("train")
    stop = StopRequest()
    monkeypatch.setattr(stopping, "_active", stop)  # as `handling_signals` in the tenant's run sets it
    waiting = GpuGate(lazy.sock, "b")
    outcome: list = []

    def waiter() -> None:
        try:
            waiting.acquire("train")
            outcome.append("granted")
        except Interrupted as e:
            outcome.append(e.signal)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    deadline = time.monotonic() + WAIT_S
    while holder.status()["queue"] != ["b"]:
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.01)
    stop.request("SIGTERM")
    t.join(WAIT_S)
    assert not t.is_alive() and outcome == ["SIGTERM"]
    with pytest.raises(Interrupted):  # a stop requested: no new wait begins
        waiting.acquire("checkpoint")
    waiting.close()
    assert holder.status()["queue"] == [] and holder.status()["tenants"]["b"]["failed"] is None
    holder.yield_()
    holder.close()


def test_a_tenant_that_holds_the_grant_past_the_limit_is_failed_and_the_grant_freed(sock_dir):
    """a takes the grant and never gives it back (stuck in its phase); past hold_timeout_s the broker fails
    it, says why, and grants b; a hears why at its next call."""
    b = _InThread(sock_dir, "lazy", hold_timeout_s=0.2)
    try:
        stuck = GpuGate(b.sock, "a")
        stuck.acquire("generate")
        other = GpuGate(b.sock, "b")
        with other.phase("train"):  # granted only once a is failed
            tenants = other.status()["tenants"]
            assert tenants["a"]["failed"].startswith("held the grant past timeslice.hold_timeout_s (0.2 s)")
            assert not tenants["a"]["alive"]
        with pytest.raises((BrokerRefused, BrokerGone), match=r"held the grant past timeslice.hold_timeout_s"):
            stuck.yield_()
        other.close()
        stuck.close(timeout_s=1.0)
    finally:
        b.stop()
    grants = [r for r in read_log(b.log) if r["kind"] == "grant"]
    assert [(g["tenant"], g["failed"]) for g in grants] == [("a", True), ("b", False)]


def test_the_broker_process_takes_its_hold_limit(sock_dir):
    """start_broker's hold_timeout_s reaches the broker process (the arm passes timeslice.hold_timeout_s)."""
    with start_broker(sock_dir / "ts.sock", "never", sock_dir / "ts.jsonl", hold_timeout_s=0.2) as proc:
        stuck = GpuGate(proc.sock_path, "a")
        stuck.acquire("train")
        other = GpuGate(proc.sock_path, "b")
        with other.phase("train"):
            assert "timeslice.hold_timeout_s (0.2 s)" in other.status()["tenants"]["a"]["failed"]
        other.close()
        stuck.close(timeout_s=1.0)
    with pytest.raises(ValueError, match=r"hold_timeout_s \(-1\) must be positive"):
        start_broker(sock_dir / "ts2.sock", "never", hold_timeout_s=-1)


def test_a_second_broker_on_a_live_socket_is_refused(lazy):
    with pytest.raises(RuntimeError, match="a broker already listens"):
        start_broker(lazy.sock, "lazy")


def test_the_record_is_json_lines(lazy):
    gate = GpuGate(lazy.sock, "a", pids=[1, 2], resident_bytes=5)
    with gate.phase("train"):
        pass
    gate.close()
    lines = Path(lazy.log).read_text().splitlines()
    kinds = [json.loads(x)["kind"] for x in lines]
    assert kinds == ["start", "register", "grant", "leave"]
    assert json.loads(lines[1])["pids"] == [1, 2] and json.loads(lines[1])["resident_bytes"] == 5
