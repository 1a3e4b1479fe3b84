"""The broker's policy `memory` with fake sizes: tenants co-resident while their peaks fit, parked only when the
next one's would not, least recently used first, a tenant that cannot fit waiting (never admitted to run the
device out of memory under the others), one too big for the device refused. The broker is a process of its
own; the tenants are gates driven from this test's threads, each with a parker that records its calls."""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from colora.timeslice import BrokerGone, BrokerRefused, GpuGate, ParkStats, broker_status, read_log, start_broker

GIB = 1 << 30
WAIT_S = 30.0  # the bound on every wait; none comes near it


class Recorder:
    label = "recorder"

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def park(self) -> ParkStats:
        self.calls.append(("park", self.name))
        return ParkStats(0.0, 1)

    def restore(self) -> ParkStats:
        self.calls.append(("restore", self.name))
        return ParkStats(0.0, 1)


@pytest.fixture
def broker():
    with tempfile.TemporaryDirectory(prefix="tsm-") as d:
        sock, log = Path(d) / "b.sock", Path(d) / "timeslice.jsonl"
        proc = start_broker(sock, "memory", log, memory_bytes=10 * GIB)
        calls: list = []
        gates: list[GpuGate] = []

        def tenant(name: str, peak_gib: float) -> GpuGate:
            g = GpuGate(sock, name, [Recorder(name, calls)], peak_bytes=int(peak_gib * GIB))
            gates.append(g)
            return g

        try:
            with ThreadPoolExecutor(4) as pool:
                yield tenant, pool, calls, sock, log
        finally:
            for g in gates:
                g.close(timeout_s=2.0)
            proc.stop()


def _until(pred, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.01)


def _waiting(sock, name: str) -> bool:
    return name in broker_status(sock)["queue"]


def test_tenants_that_fit_hold_grants_at_once_and_nothing_is_parked(broker):
    tenant, pool, calls, sock, log = broker
    a, b, c = tenant("a", 4), tenant("b", 3), tenant("c", 3)
    a.acquire("generate")
    b.acquire("train")
    c.acquire("generate")
    assert sorted(broker_status(sock)["holders"]) == ["a", "b", "c"]
    for g in (a, b, c):
        assert not g.yield_().pending
    a.acquire("train")  # resident: at once, beside nobody's park
    a.yield_()
    assert calls == []


def test_a_tenant_that_does_not_fit_waits_for_a_holder_then_the_idle_one_is_parked(broker):
    tenant, pool, calls, sock, log = broker
    a, b = tenant("a", 6), tenant("b", 6)
    a.acquire("generate")
    got_b = pool.submit(b.acquire, "generate")
    _until(lambda: _waiting(sock, "b"), "b to wait")
    assert not got_b.done() and calls == []  # a holds its grant: it is never parked under it
    a.yield_()
    got_b.result(WAIT_S)
    assert calls == [("park", "a")]
    got_a = pool.submit(a.acquire, "train")  # parked: it needs its memory back, which b holds
    _until(lambda: _waiting(sock, "a"), "a to wait")
    b.yield_()
    assert got_a.result(WAIT_S).restored
    assert calls == [("park", "a"), ("park", "b"), ("restore", "a")]
    a.yield_()
    rows = [r for r in read_log(log) if r["kind"] == "grant"]
    assert all(r["resident_peak_bytes"] <= 10 * GIB for r in rows)


def test_the_least_recently_used_idle_tenant_is_parked_first_and_only_as_much_as_needed(broker):
    tenant, pool, calls, sock, log = broker
    a, b, c = tenant("a", 4), tenant("b", 4), tenant("c", 4)
    for g in (a, b):
        g.acquire("generate")
        g.yield_()
    c.acquire("generate")  # 4 + 4 + 4 > 10: one of a, b goes, a (used longer ago)
    assert calls == [("park", "a")]
    c.yield_()
    b.acquire("train")  # still resident
    b.yield_()
    assert calls == [("park", "a")]


def test_first_come_first_served_a_waiter_holds_back_the_tenants_behind_it(broker):
    tenant, pool, calls, sock, log = broker
    a, b, c = tenant("a", 6), tenant("b", 6), tenant("c", 2)
    a.acquire("generate")
    got_b = pool.submit(b.acquire, "generate")
    _until(lambda: _waiting(sock, "b"), "b to wait")
    got_c = pool.submit(c.acquire, "generate")  # would fit beside a, but b came first
    _until(lambda: _waiting(sock, "c"), "c to wait")
    time.sleep(0.2)
    assert not got_b.done() and not got_c.done()
    a.yield_()
    got_b.result(WAIT_S)
    got_c.result(WAIT_S)  # 6 + 2 fit once a is parked
    assert calls == [("park", "a")]


def test_a_tenant_whose_peak_exceeds_the_device_is_refused_and_the_others_go_on(broker):
    tenant, pool, calls, sock, log = broker
    a = tenant("a", 6)
    big = tenant("big", 12)
    with pytest.raises((BrokerRefused, BrokerGone), match="exceeds the 10.00 GiB"):
        big.acquire("generate")
    grown = tenant("grown", 2)
    grown.report_peak(11 * GIB)  # measured after its start: beyond the device
    with pytest.raises((BrokerRefused, BrokerGone)):
        grown.acquire("generate")
    a.acquire("generate")
    a.yield_()
    failed = {r["tenant"]: r["reason"] for r in read_log(log) if r["kind"] == "failed"}
    assert set(failed) == {"big", "grown"} and "timeslice.memory_gib" in failed["big"]
    assert calls == []


def test_a_measured_peak_replaces_the_estimate_in_admission(broker):
    tenant, pool, calls, sock, log = broker
    a, b = tenant("a", 3), tenant("b", 3)
    a.acquire("start")
    a.report_peak(8 * GIB)  # its start measured more than it asked for
    a.yield_()
    b.acquire("start")  # 8 + 3 > 10: a (idle) is parked
    assert calls == [("park", "a")]
    b.yield_()


def test_the_duty_counts_overlapping_grants_once():
    from colora.timeslice import summarize

    g = {"kind": "grant", "parked": [], "restored": False, "park_s": 0.0, "restore_s": 0.0}
    rows = [{"kind": "start", "policy": "memory"},
            {**g, "tenant": "a", "requested": 0.0, "granted": 0.0, "released": 4.0},
            {**g, "tenant": "b", "requested": 1.0, "granted": 1.0, "released": 3.0},  # inside a's
            {**g, "tenant": "b", "requested": 6.0, "granted": 6.0, "released": 8.0}]
    s = summarize(rows)
    assert s["held_s"] == 8.0 and s["window_s"] == 8.0 and s["duty"] == 6.0 / 8.0


MIXED = {"experiment": {"arm": "timeslice", "steps": 3, "model": "builtin:qwen3-0.6b-shape"},
         "engine": {"max_model_len": 2048}, "trainer": {"micro_batch_tokens": 8192},
         "timeslice": {"park": "memory", "tenant_jobs": 8}, "overlap": {"groups": 2},
         "job_defaults": {"task": "addition", "prompts_per_step": 8, "samples_per_prompt": 8, "max_new_tokens": 256},
         "jobs": [*({"name": f"l{i}"} for i in range(8)), {"name": "f0", "finetune": "full"},
                  {"name": "f1", "finetune": "full"}, {"name": "solo"}]}


def test_under_memory_a_lora_group_is_a_co_run_and_full_jobs_are_tenants_of_their_own():
    from colora.config import resolve
    from colora.timeslice.arm import tenant_configs, tenants_of

    cfg = resolve(MIXED, ["timeslice.memory_gib=40"])
    parts = tenants_of(cfg)
    assert parts == [[f"l{i}" for i in range(8)], ["solo"], ["f0"], ["f1"]]
    configs, peaks, budget = tenant_configs(cfg, parts, "cpu", None, "float32")
    assert [(c.experiment.arm, c.overlap.groups if c.experiment.arm == "overlap" else None) for c in configs] == \
        [("overlap", 2), ("shared_sync", None), ("dedicated", None), ("dedicated", None)]
    assert budget == 40 * GIB and peaks == [10 * GIB] * 4  # on the CPU: the budget split, nothing planned
    with pytest.raises(Exception, match="timeslice.memory_gib \\(0\\) must be set"):
        tenant_configs(resolve(MIXED), parts, "cpu", None, "float32")
    with pytest.raises(Exception, match="trainer.micro_batch_tokens \\(0\\) must be set"):
        tenant_configs(resolve(MIXED, ["trainer.micro_batch_tokens=0", "timeslice.memory_gib=40"]), parts, "cpu",
                       None, "float32")


def test_on_an_h200_eight_lora_jobs_and_two_full_qwen3_0_6b_tenants_fit_at_once():
    """The arithmetic the arm admits by, for experiments/full_beside_lora.toml (Qwen3-0.6B's shape in bf16) on an
    H200's 140.4 GiB: each full tenant takes its engine's share and, beyond a LoRA tenant's trainer, 16 bytes a
    parameter of gradient, moments and masters; the 8-job co-run and two full tenants fit together, so none is
    parked. The file's baseline commands resolve."""
    from colora.config import load_config
    from colora.models.base import QWEN3_06B_SHAPE
    from colora.models.shape import ModelShape
    from colora.timeslice.admission import tenant_plan
    from colora.timeslice.arm import tenant_config, tenants_of
    from colora.training.full import state_bytes

    path = Path(__file__).resolve().parents[1] / "experiments" / "full_beside_lora.toml"
    cfg = load_config(path)
    shape = ModelShape.from_config({**QWEN3_06B_SHAPE, "dtype": "bfloat16"})
    h200 = 143771 * (1 << 20)
    parts = tenants_of(cfg)
    assert [len(p) for p in parts] == [8, 1, 1]
    plans = [tenant_plan(tenant_config(cfg, p, len(parts)), shape, h200, 2) for p in parts]
    corun, fa, fb = plans
    assert fa == fb and fa.peak_bytes > state_bytes(shape.parameters(), 2) + fa.share * h200
    assert corun.share > fa.share  # KV for 8 jobs' 2 groups of 256 sequences against one job's 64
    assert sum(p.peak_bytes for p in plans) < h200
    assert 9 * GIB < state_bytes(shape.parameters(), 2) < 12 * GIB  # ~0.6 B parameters x 18 bytes
    commands = path.read_text().replace("\\\n#", " ").splitlines()  # continued lines joined
    runs = [c for c in commands if c.startswith("# colora run") and "--set" in c]
    assert len(runs) == 3
    for c in runs:
        load_config(path, [a for a in c.split() if "=" in a])
