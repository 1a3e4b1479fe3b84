"""The broker with fake tenants: real processes (spawned) that acquire, work (sleep) and yield in a
loop, stamping their own clocks. Shown: grants never overlap, by the broker's record and by the
tenants' stamps; FIFO; lazy, eager and never park as they say; a tenant killed while holding the grant
(or while parking) frees it and is marked failed while the others finish; a stop ends everything in
bounded time. No assertion is on a duration: waits are bounded, and time only orders events."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from colora.timeslice import BrokerGone, GpuGate, ParkStats, broker_status, read_log, start_broker, summarize

CTX = mp.get_context("spawn")
WAIT_S = 30.0  # the bound on every wait; none comes near it
EPS = 1e-6  # the record rounds times to microseconds


class _FakeParker:
    """Sleeps for a park or restore; with `hang`, a park sets the event and never ends."""

    label = "fake"

    def __init__(self, seconds: float, hang=None):
        self.seconds, self.hang = seconds, hang

    def park(self) -> ParkStats:
        if self.hang is not None:
            self.hang.set()
            time.sleep(3600)
        time.sleep(self.seconds)
        return ParkStats(self.seconds, 1000)

    def restore(self) -> ParkStats:
        time.sleep(self.seconds)
        return ParkStats(self.seconds, 1000)


def fake_tenant(sock: str, name: str, out: str, rounds: int, work_s: float = 0.005, *, park_s: float = 0.002,
                after=None, signal_after: int | None = None, done=None, held=None, hold=None, hang=None,
                stay=None) -> None:
    """A tenant's loop: ACQUIRE (phases alternate generate / train), sleep `work_s`, YIELD, `rounds`
    times; each round's stamps (shared clock) go to `out` as a JSON line. `after`: an event waited for
    before registering; `done` is set after `signal_after` rounds; `held` is set once the first grant
    is held, and the grant is then kept until `hold` is set; `stay`: an event waited for before leaving.
    Exits 3 if the broker goes away."""
    if after is not None:
        after.wait(WAIT_S)
    try:
        gate = GpuGate(sock, name, [_FakeParker(park_s, hang)])
        with open(out, "a") as f:
            for i in range(rounds):
                phase = ("generate", "train")[i % 2]
                requested = gate.now()
                grant = gate.acquire(phase)
                start = gate.now()
                if held is not None and i == 0:
                    held.set()
                    hold.wait(3600)
                time.sleep(work_s)
                end = gate.now()
                y = gate.yield_()
                f.write(json.dumps({"tenant": name, "round": i, "phase": phase, "requested": requested,
                                    "start": start, "end": end, "restored": grant.restored,
                                    "pending": y.pending, "deferred": y.deferred}) + "\n")
                f.flush()
                if done is not None and i + 1 == signal_after:
                    done.set()
        if stay is not None:
            stay.wait(3600)
    except BrokerGone:
        sys.exit(3)
    gate.close()


@pytest.fixture
def run_dir():
    # a short path: a Unix socket's holds 107 bytes, pytest's tmp_path can be longer
    with tempfile.TemporaryDirectory(prefix="ts-") as d:
        yield Path(d)


def _start(target_kwargs: dict) -> mp.Process:
    p = CTX.Process(target=fake_tenant, kwargs=target_kwargs, daemon=True)
    p.start()
    return p


def _join(procs: list[mp.Process]) -> list[int | None]:
    deadline = time.monotonic() + WAIT_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes


def _until(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.01)


def _stamps(run_dir: Path) -> list[dict]:
    rows = []
    for f in sorted(run_dir.glob("*.stamps")):
        rows += [json.loads(x) for x in f.read_text().splitlines()]
    return rows


def _grants(rows: list[dict]) -> list[dict]:
    return sorted((r for r in rows if r["kind"] == "grant"), key=lambda r: r["granted"])


def _assert_exclusive_and_fifo(rows: list[dict], stamps: list[dict]) -> None:
    """Grants disjoint in the record and in the tenants' stamps, each stamp inside its grant, and
    grants in the order of their requests."""
    grants = _grants(rows)
    for a, b in zip(grants, grants[1:]):
        assert a["released"] <= b["granted"], (a, b)
        assert a["requested"] <= b["requested"], ("not FIFO", a, b)
    spans = sorted((s["start"], s["end"]) for s in stamps)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    for tenant in {s["tenant"] for s in stamps}:
        mine = [g for g in grants if g["tenant"] == tenant]
        for s in (s for s in stamps if s["tenant"] == tenant):
            g = mine[s["round"]]
            assert g["granted"] - EPS <= s["start"] <= s["end"] <= g["released"] + EPS
            assert g["requested"] - EPS >= s["requested"] and g["phase"] == s["phase"]


def _left_before(rows: list[dict], tenant: str, t: float) -> bool:
    return any(r["kind"] in ("leave", "failed") and r["tenant"] == tenant and r["at"] <= t for r in rows)


@pytest.mark.parametrize("policy", ["lazy", "eager", "never"])
def test_policies_with_a_solo_tenant_then_two(run_dir, policy):
    """Tenant a runs 3 rounds alone, then b joins: a has the GPU to itself, then the two contend."""
    sock, log = str(run_dir / "ts.sock"), run_dir / "timeslice.jsonl"
    with start_broker(sock, policy, log) as broker:
        solo = CTX.Event()
        procs = [_start(dict(sock=sock, name="a", out=str(run_dir / "a.stamps"), rounds=8, done=solo,
                             signal_after=3)),
                 _start(dict(sock=sock, name="b", out=str(run_dir / "b.stamps"), rounds=6, after=solo))]
        assert _join(procs) == [0, 0]
        assert broker.stop() == 0
    rows, stamps = read_log(log), _stamps(run_dir)
    _assert_exclusive_and_fifo(rows, stamps)
    grants = _grants(rows)
    assert [g["tenant"] for g in grants[:3]] == ["a", "a", "a"]
    assert len(grants) == 14 and summarize(rows)["grants_per_tenant"] == {"a": 8, "b": 6}
    parks = [r for r in rows if r["kind"] == "park"]
    # a tenant that leaves (BYE after its last round) while the broker parks it is not parked
    assert [r for r in rows if r["kind"] in ("park", "restore") and not r["ok"] and r["error"] != "left"] == []
    pairs = list(zip(grants, grants[1:]))
    if policy == "never":
        assert parks == [] and not any(r["kind"] == "restore" for r in rows)
        assert all(s["deferred"] for s in stamps) and not any(g["parked"] or g["restored"] for g in grants)
    elif policy == "lazy":
        assert all(p["waiting"] >= 1 for p in parks)  # parked only while someone waits
        assert all(s["deferred"] == (s["pending"] == 0) for s in stamps)
        for prev, cur in pairs:
            if prev["tenant"] == cur["tenant"]:
                assert cur["parked"] == [] and not cur["restored"]  # no switch when nobody else came
            elif not _left_before(rows, prev["tenant"], cur["granted"]):
                assert prev["tenant"] in cur["parked"]
        assert any(p["tenant"] == c["tenant"] for p, c in pairs) and any(p["tenant"] != c["tenant"] for p, c in pairs)
    else:  # eager: the yielder is parked at every yield, even alone
        assert not any(s["deferred"] for s in stamps)
        assert any(p["waiting"] == 0 for p in parks)
        for prev, cur in pairs:
            if not _left_before(rows, prev["tenant"], cur["granted"]):
                assert prev["tenant"] in cur["parked"]
        firsts = {g["tenant"]: g for g in reversed(grants)}
        assert all(g["restored"] == (g is not firsts[g["tenant"]]) for g in grants)


def test_grants_follow_the_order_of_requests(run_dir):
    """a holds the grant while b, c, d ask in that order (each seen queued before the next starts)."""
    sock, log = str(run_dir / "ts.sock"), run_dir / "timeslice.jsonl"
    with start_broker(sock, "lazy", log) as broker:
        held, hold = CTX.Event(), CTX.Event()
        procs = [_start(dict(sock=sock, name="a", out=str(run_dir / "a.stamps"), rounds=1, held=held, hold=hold))]
        assert held.wait(WAIT_S)
        for name in "dbc":
            procs.append(_start(dict(sock=sock, name=name, out=str(run_dir / f"{name}.stamps"), rounds=1)))
            _until(lambda: broker_status(sock)["queue"][-1:] == [name], f"{name} queued")
        assert broker_status(sock)["queue"] == ["d", "b", "c"]
        hold.set()
        assert _join(procs) == [0, 0, 0, 0]
        broker.stop()
    rows = read_log(log)
    assert [g["tenant"] for g in _grants(rows)] == ["a", "d", "b", "c"]
    _assert_exclusive_and_fifo(rows, _stamps(run_dir))


def test_a_tenant_killed_while_holding_frees_the_grant(run_dir):
    sock, log = str(run_dir / "ts.sock"), run_dir / "timeslice.jsonl"
    with start_broker(sock, "lazy", log) as broker:
        held, hold = CTX.Event(), CTX.Event()
        victim = _start(dict(sock=sock, name="a", out=str(run_dir / "a.stamps"), rounds=5, held=held, hold=hold))
        assert held.wait(WAIT_S)
        others = [_start(dict(sock=sock, name=n, out=str(run_dir / f"{n}.stamps"), rounds=4)) for n in "bc"]
        _until(lambda: sorted(broker_status(sock)["queue"]) == ["b", "c"], "b and c queued")
        os.kill(victim.pid, signal.SIGKILL)
        assert _join(others) == [0, 0]
        status = broker_status(sock)
        broker.stop()
    assert _join([victim]) == [-signal.SIGKILL]
    assert status["tenants"]["a"]["failed"] and not status["tenants"]["b"]["failed"]
    rows = read_log(log)
    grants = _grants(rows)
    assert grants[0]["tenant"] == "a" and grants[0]["failed"]
    s = summarize(rows)
    assert s["failed"] == ["a"] and s["grants_per_tenant"] == {"a": 1, "b": 4, "c": 4}
    _assert_exclusive_and_fifo(rows, _stamps(run_dir))


def test_a_tenant_killed_while_parking_is_failed_and_the_queue_goes_on(run_dir):
    sock, log = str(run_dir / "ts.sock"), run_dir / "timeslice.jsonl"
    with start_broker(sock, "lazy", log) as broker:
        a_done, parking, stay = CTX.Event(), CTX.Event(), CTX.Event()
        # a takes one grant and stays registered; b's request makes the broker park a, which hangs
        victim = _start(dict(sock=sock, name="a", out=str(run_dir / "a.stamps"), rounds=1, hang=parking,
                             done=a_done, signal_after=1, stay=stay))
        assert a_done.wait(WAIT_S)
        b = _start(dict(sock=sock, name="b", out=str(run_dir / "b.stamps"), rounds=3))
        assert parking.wait(WAIT_S)
        os.kill(victim.pid, signal.SIGKILL)
        assert _join([b]) == [0]
        broker.stop()
    rows = read_log(log)
    park = [r for r in rows if r["kind"] == "park"]
    assert len(park) == 1 and park[0]["tenant"] == "a" and not park[0]["ok"]
    assert summarize(rows)["failed"] == ["a"]
    assert [g["tenant"] for g in _grants(rows)] == ["a", "b", "b", "b"]


def test_a_stop_ends_the_broker_and_its_tenants(run_dir):
    """SIGTERM to a broker whose tenants loop without end: it exits cleanly, each tenant reads EOF
    (BrokerGone, exit 3), all within the bound; the record closes with the grant held at the stop."""
    sock, log = str(run_dir / "ts.sock"), run_dir / "timeslice.jsonl"
    broker = start_broker(sock, "lazy", log)
    procs = [_start(dict(sock=sock, name=n, out=str(run_dir / f"{n}.stamps"), rounds=10**9)) for n in "abc"]
    _until(lambda: {s["tenant"] for s in _stamps(run_dir)} == {"a", "b", "c"}, "a round of each tenant")
    assert broker.stop(timeout_s=WAIT_S) == 0
    assert _join(procs) == [3, 3, 3]
    rows = read_log(log)
    assert rows[-1]["kind"] == "stop" and rows[-1]["failed"] == []
    assert all(g["released"] is not None for g in _grants(rows))
    assert not os.path.exists(sock)
    _assert_exclusive_and_fifo(rows, _stamps(run_dir))


def test_the_broker_ends_with_its_parent(run_dir):
    """A broker whose starter dies (SIGKILL, no stop) ends by itself."""
    code = ("import sys, time; from colora.timeslice import start_broker; b = start_broker(sys.argv[1]); "
            "print(b.pid, flush=True); time.sleep(3600)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(run_dir / "ts.sock")], stdout=subprocess.PIPE, text=True)
    broker_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait(WAIT_S)

    def gone() -> bool:
        try:
            with open(f"/proc/{broker_pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        return state == "Z"  # exited, not reaped yet by whoever adopted it

    _until(gone, "the orphaned broker to end")
