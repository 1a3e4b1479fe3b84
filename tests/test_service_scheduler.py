"""The trainer thread's scheduling (colora/service/scheduler.py), against a backend that records its calls."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest

from colora.service.backend import (
    AdamParams,
    Backend,
    BackendError,
    Capabilities,
    Datum,
    ForwardCall,
    ForwardResult,
)
from colora.service.scheduler import (
    Backlog,
    Scheduler,
    SeqError,
    barrier_work,
    failed_work,
    forward_work,
    optim_work,
)


class Recorder(Backend):
    """Records every call in `log`; a model in `fail` gets a BackendError for its calls; `boom` raises."""

    def __init__(self):
        self.log, self.fail, self.boom = [], set(), False

    def capabilities(self):
        return Capabilities("m", 64, 16, 8)

    def create_model(self, model_id, spec):
        self.log.append(("create", model_id))

    def delete_model(self, model_id):
        self.log.append(("delete", model_id))

    def train_cycle(self, forward, optim):
        if self.boom:
            raise RuntimeError("boom")
        self.log.append(("cycle", [(c.model_id, c.seq_id) for c in forward], [(c.model_id, c.seq_id) for c in optim]))
        fr = [BackendError("bad input", "user") if c.model_id in self.fail else
              ForwardResult([{"logprobs": np.zeros(2, np.float32)}], {"loss:sum": float(c.seq_id)}) for c in forward]
        return fr, [{"grad_norm": 1.0} for _ in optim]

    def save_state(self, model_id, directory, optimizer=True): ...
    def load_state(self, model_id, directory, optimizer): ...
    def save_for_sampler(self, model_id, directory): ...
    def load_sampler(self, directory): ...
    def release_sampler(self, ref): ...
    def sample(self, call, done): ...
    def close(self): ...


def fwd(rid: str, model: str, seq: int) -> object:
    d = Datum(np.array([1, 2]), {"target_tokens": np.array([2, 3]), "weights": np.ones(2, np.float32)})
    return forward_work(rid, ForwardCall(model, seq, (d,), "cross_entropy", {}))


@pytest.fixture
def sched(tmp_path):
    answers = {}
    s = Scheduler(Recorder(), lambda rid, o: answers.__setitem__(rid, o), tmp_path / "stats.jsonl")
    s.answers = answers
    s.add_model("A")
    s.add_model("B")
    return s


def cycles(s):
    return [e for e in s.backend.log if e[0] == "cycle"]


def test_out_of_order_requests_run_in_seq_order_once_the_first_arrives(sched):
    sched.submit("A", fwd("r3", "A", 3))
    sched.submit("A", fwd("r2", "A", 2))
    assert not sched.run_cycle() and cycles(sched) == []  # seq 1 is missing: nothing is ready
    sched.submit("A", fwd("r1", "A", 1))
    assert sched.run_cycle()
    assert cycles(sched) == [("cycle", [("A", 1), ("A", 2), ("A", 3)], [])]
    assert {k: v.result.metrics["loss:sum"] for k, v in sched.answers.items()} == {"r1": 1, "r2": 2, "r3": 3}


def test_a_barrier_ends_a_models_share_of_the_cycle(sched):
    for w in (fwd("r1", "A", 1), optim_work("r2", "A", 2, AdamParams()), fwd("r3", "A", 3),
              optim_work("r4", "A", 4, AdamParams())):
        sched.submit("A", w)
    sched.run_cycle()
    sched.run_cycle()
    assert cycles(sched) == [("cycle", [("A", 1)], [("A", 2)]), ("cycle", [("A", 3)], [("A", 4)])]
    assert sched.answers["r2"].result == {"type": "optim_step", "metrics": {"grad_norm": 1.0}}


def test_a_save_runs_after_the_forward_calls_before_it_and_before_the_ones_after(sched):
    sched.submit("A", fwd("r1", "A", 1))
    sched.submit("A", barrier_work("r2", "A", 2, "save", lambda b: b.log.append(("save",)) or {"path": "p"}))
    sched.submit("A", fwd("r3", "A", 3))
    sched.run_cycle()
    sched.run_cycle()
    assert sched.backend.log == [("cycle", [("A", 1)], []), ("save",), ("cycle", [("A", 3)], [])]
    assert sched.answers["r2"].result == {"path": "p"}


def test_a_repeated_seq_id_gets_the_first_request_back_and_runs_once(sched):
    assert sched.submit("A", fwd("r1", "A", 1)) == ("r1", True)
    assert sched.submit("A", fwd("r1-again", "A", 1)) == ("r1", False)
    sched.run_cycle()
    assert sched.submit("A", fwd("r1-late", "A", 1)) == ("r1", False)  # also after it ran
    sched.run_cycle()
    assert cycles(sched) == [("cycle", [("A", 1)], [])] and set(sched.answers) == {"r1"}


def test_a_failed_request_takes_its_seq_id_and_the_model_goes_on(sched):
    sched.submit("A", fwd("r2", "A", 2))
    sched.submit("A", failed_work("r1", "A", 1, "loss_fn 'dro' is not supported"))
    sched.run_cycle()
    assert sched.answers["r1"].error == "loss_fn 'dro' is not supported" and sched.answers["r1"].category == "user"
    assert sched.answers["r2"].error is None
    assert cycles(sched) == [("cycle", [("A", 2)], [])]


def test_two_models_share_one_cycle_and_one_optimizer_pass(sched):
    for m in ("A", "B"):
        sched.submit(m, fwd(f"{m}1", m, 1))
        sched.submit(m, optim_work(f"{m}2", m, 2, AdamParams()))
    sched.run_cycle()
    assert cycles(sched) == [("cycle", [("A", 1), ("B", 1)], [("A", 2), ("B", 2)])]
    st = sched.stats()
    assert st["cycles"] == 1 and st["multi_model_cycles"] == 1 and st["max_models_per_cycle"] == 2
    assert st["max_optim_steps_per_pass"] == 2 and st["multi_model_optim_passes"] == 1
    row = json.loads((sched._stats_path).read_text())
    assert row["models"] == ["A", "B"] and row["forward"] == [["A", 1, 1, False], ["B", 1, 1, False]]
    assert row["optim"] == [["A", 2], ["B", 2]]


def test_one_models_error_leaves_the_others_answers(sched):
    sched.backend.fail.add("A")
    sched.submit("A", fwd("A1", "A", 1))
    sched.submit("B", fwd("B1", "B", 1))
    sched.run_cycle()
    assert sched.answers["A1"].error == "bad input" and sched.answers["A1"].category == "user"
    assert sched.answers["B1"].result.metrics == {"loss:sum": 1.0}


def test_a_crashing_backend_fails_the_cycle_as_a_server_error_and_the_next_cycle_runs(sched):
    sched.backend.boom = True
    sched.submit("A", fwd("A1", "A", 1))
    sched.run_cycle()
    assert sched.answers["A1"].category == "server" and "boom" in sched.answers["A1"].error
    sched.backend.boom = False
    sched.submit("A", fwd("A2", "A", 2))
    sched.run_cycle()
    assert sched.answers["A2"].error is None


def test_a_seq_id_whose_turn_passed_is_refused_and_unknown_models_raise(sched):
    sched.submit("A", fwd("r1", "A", 1))
    sched.submit("A", fwd("r2", "A", 2))
    sched.run_cycle()
    s = Scheduler(Recorder(), lambda *a: None)
    s.add_model("A", next_seq=5)
    with pytest.raises(SeqError, match="seq_id 3"):
        s.submit("A", fwd("r3", "A", 3))
    with pytest.raises(KeyError):
        s.submit("C", fwd("c1", "C", 1))


def test_removing_a_model_answers_what_it_still_waited_for(sched):
    sched.submit("A", fwd("r2", "A", 2))
    sched.remove_model("A", "model A was deleted: its session expired")
    assert sched.answers["r2"].error == "model A was deleted: its session expired"
    assert not sched.has_model("A")


def test_control_operations_run_first_on_the_trainer_thread(sched):
    threads = []
    sched.submit("A", fwd("r1", "A", 1))
    sched.control("c1", lambda b: threads.append(threading.current_thread().name) or b.create_model("C", None))
    sched.start()
    try:
        for _ in range(200):
            if {"c1", "r1"} <= set(sched.answers):
                break
            threading.Event().wait(0.01)
    finally:
        sched.stop()
    assert threads == ["colora-trainer"]
    assert sched.backend.log[0] == ("create", "C") and sched.backend.log[1][0] == "cycle"


def big(rid: str, model: str, seq: int, datums: int) -> object:
    d = Datum(np.array([1, 2]), {"target_tokens": np.array([2, 3]), "weights": np.ones(2, np.float32)})
    return forward_work(rid, ForwardCall(model, seq, (d,) * datums, "cross_entropy", {}))


def test_a_small_models_step_waits_about_one_cycle_beside_a_heavy_backlog(tmp_path):
    """A heavy tenant pipelines 20 requests of 600 datums; a small one sends one step. Counted in cycles
    and in the heavy tenant's requests run first: the small step is answered in the first cycle, beside
    one share of the backlog (1024 datums: one request a cycle), and the backlog runs on after it."""
    answers, order = {}, []

    def done(rid, o):
        answers[rid] = o
        order.append(rid)

    s = Scheduler(Recorder(), done, tmp_path / "stats.jsonl", cycle_datums=1024, cycle_tokens=1 << 20)
    s.add_model("heavy")
    s.add_model("small")
    for i in range(1, 21):
        s.submit("heavy", big(f"h{i}", "heavy", i, 600))
    s.submit("small", fwd("s1", "small", 1))
    s.submit("small", optim_work("s2", "small", 2, AdamParams()))
    s.run_cycle()
    assert {"s1", "s2"} <= set(answers)
    assert [r for r in order if r.startswith("h")] == ["h1"]  # one share of the backlog went first
    cycles_run = 1
    while s.run_cycle():
        cycles_run += 1
    assert cycles_run == 20 and all(f"h{i}" in answers for i in range(1, 21))
    assert all(len([f for f in c[1] if f[0] == "heavy"]) == 1 for c in cycles(s))  # a share each cycle


def test_a_share_always_holds_the_first_request_and_a_barrier_ends_it(tmp_path):
    s = Scheduler(Recorder(), lambda *a: None, cycle_datums=2, cycle_tokens=1 << 20)
    s.add_model("A")
    s.submit("A", big("r1", "A", 1, 5))  # alone over the share: it runs, alone
    s.submit("A", big("r2", "A", 2, 1))
    s.submit("A", optim_work("r3", "A", 3, AdamParams()))
    s.run_cycle()
    s.run_cycle()
    assert cycles(s) == [("cycle", [("A", 1)], []), ("cycle", [("A", 2)], [("A", 3)])]


def test_submit_refuses_a_far_seq_id_a_full_queue_and_an_owners_bytes_without_taking_a_slot(sched):
    s = Scheduler(Recorder(), lambda *a: None)
    s.add_model("A", owner="alice")
    s.add_model("B", owner="alice")
    with pytest.raises(Backlog) as e:
        s.submit("A", fwd("far", "A", 1 + 9), window=8)
    assert e.value.limit == "seq_window" and e.value.value == 8 and "9 ahead" in e.value.message
    s.submit("A", fwd("a2", "A", 2), window=8, max_pending=2)
    s.submit("A", fwd("a3", "A", 3), window=8, max_pending=2)
    with pytest.raises(Backlog) as e:
        s.submit("A", fwd("a4", "A", 4), window=8, max_pending=2)
    assert (e.value.limit, e.value.count) == ("pending_requests", 2)
    s.submit("B", dataclasses.replace(fwd("b2", "B", 2), nbytes=700), max_owner_bytes=1000)
    with pytest.raises(Backlog) as e:  # alice's two models share her bytes
        s.submit("B", dataclasses.replace(fwd("b3", "B", 3), nbytes=400), max_owner_bytes=1000)
    assert (e.value.limit, e.value.count) == ("pending_bytes", 700)
    assert s.pending("alice") == (3, 700)
    s.submit("A", fwd("a1", "A", 1))
    s.submit("B", fwd("b1", "B", 1))
    s.run_cycle()
    assert s.pending("alice") == (0, 0)
    assert s.submit("A", fwd("a4", "A", 4), window=8, max_pending=2) == ("a4", True)  # the refused one, again


def test_a_failed_stats_write_answers_every_future_and_is_logged_once_per_burst(tmp_path, caplog):
    stats = tmp_path / "stats-dir"
    stats.mkdir()  # appending to a directory fails, as a full disk does
    answers = {}
    s = Scheduler(Recorder(), lambda rid, o: answers.__setitem__(rid, o), stats)
    s.add_model("A")
    with caplog.at_level("INFO", logger="colora.service"):
        for i in range(1, 4):
            s.submit("A", fwd(f"r{i}", "A", i))
            s.run_cycle()
        assert set(answers) == {"r1", "r2", "r3"} and all(o.error is None for o in answers.values())
        failures = [r for r in caplog.records if "stats-dir" in r.getMessage() and r.levelname == "ERROR"]
        assert len(failures) == 1, [r.getMessage() for r in caplog.records]
        stats.rmdir()
        s.submit("A", fwd("r4", "A", 4))
        s.run_cycle()
    assert "r4" in answers and any("written again (3 rows were dropped)" in r.getMessage() for r in caplog.records)
    assert json.loads(stats.read_text())["forward"] == [["A", 4, 1, False]]


# -- the levers: a save in its step's cycle, cycles that gather models about to train ---------------------
def _step(s, model: str, first: int, rid: str) -> None:
    """A client's step as the SDK sends it: forward_backward, optim_step and the sampler's save at once."""
    s.submit(model, fwd(f"{rid}f", model, first))
    s.submit(model, optim_work(f"{rid}o", model, first + 1, AdamParams()))
    s.submit(model, barrier_work(f"{rid}s", model, first + 2, "snapshot", lambda b: {"saved": model}))


@pytest.mark.parametrize("save_in_step", [False, True])
def test_a_save_after_an_optim_step_rides_in_its_cycle_with_the_lever(tmp_path, save_in_step):
    """Off, the save waits for the next cycle (where another model's training would come first); on, it runs
    in the step's cycle, after the step, and nothing after it joins."""
    answers = {}
    s = Scheduler(Recorder(), lambda rid, o: answers.__setitem__(rid, o), tmp_path / "stats.jsonl",
                  save_in_step=save_in_step)
    s.add_model("A")
    _step(s, "A", 1, "a")
    s.submit("A", fwd("a2", "A", 4))
    s.run_cycle()
    rows = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert rows[0]["optim"] == [["A", 2]]
    assert rows[0]["barriers"] == ([["A", 3, "snapshot"]] if save_in_step else [])
    assert ("as" in answers) == save_in_step and "a2" not in answers
    s.run_cycle()
    assert answers["as"].result == {"saved": "A"} and ("a2" in answers) == save_in_step


def _threaded(tmp_path, train_s: float, start: bool = True, **levers):
    """A scheduler on its own thread (once started) over a backend whose cycle takes `train_s`; its answers, and
    an event per answer."""

    class Slow(Recorder):
        def train_cycle(self, forward, optim):
            threading.Event().wait(train_s)
            return super().train_cycle(forward, optim)

    answers, arrived = {}, threading.Condition()

    def done(rid, o):
        with arrived:
            answers[rid] = o
            arrived.notify_all()

    s = Scheduler(Slow(), done, tmp_path / "stats.jsonl", **levers)
    s.answers = answers

    def wait(rid):
        with arrived:
            assert arrived.wait_for(lambda: rid in answers, timeout=WAIT_S), f"never answered: {rid}"

    s.wait = wait
    if start:
        s.start()
    return s


WAIT_S = 60.0  # a bound on a hang, not a speed


def test_with_gather_a_cycle_waits_for_a_model_whose_samples_decode_and_both_train_in_it(tmp_path):
    """A's step is ready while B's samples decode: the cycle holds (bounded by gather x the last training
    cycle, here 120 x 0.25 s, far more than the test takes) until B's step comes, and both train in one pass
    of the backend and one optimizer pass. Off, A's step is answered before B's comes."""
    for gather in (0.0, 120.0):
        s = _threaded(tmp_path / str(gather), 0.25, gather=gather, gather_groups=1, save_in_step=True)
        (tmp_path / str(gather)).mkdir(exist_ok=True)
        try:
            for m in ("A", "B"):
                s.add_model(m)
            _step(s, "A", 1, "a0")  # a first cycle: the last training cycle's seconds
            s.wait("a0s")
            s.sampling("B", 1)  # B's samples decode
            _step(s, "A", 4, "a1")
            if gather:
                threading.Event().wait(0.3)  # A's step waits meanwhile: nothing of it is answered
                assert "a1f" not in s.answers
            else:
                s.wait("a1s")  # A's step trains alone while B's samples decode
            s.sampling("B", -1)
            _step(s, "B", 1, "b1")
            s.wait("a1s")
            s.wait("b1s")
        finally:
            s.stop()
        cycles_ = [e for e in s.backend.log if e[0] == "cycle"]
        shared = [c for c in cycles_ if {m for m, _ in c[1]} == {"A", "B"}]
        if gather:
            assert shared == [("cycle", [("A", 4), ("B", 1)], [("A", 5), ("B", 2)])] or \
                shared == [("cycle", [("B", 1), ("A", 4)], [("B", 2), ("A", 5)])], cycles_
            assert s.stats()["held_cycles"] >= 1
        else:
            assert shared == [] and s.stats()["held_cycles"] == 0, cycles_


def test_gather_does_not_wait_for_models_that_are_not_about_to_train_or_beyond_its_share(tmp_path):
    """Nobody else sampling: A's cycle runs at once. Four models, two groups, C and D sampling: A's step waits
    for B's (two of four make a group's share), and the two run without C and D."""
    s = _threaded(tmp_path, 0.05, gather=1e4, gather_groups=2, save_in_step=True)
    try:
        for m in "ABCD":
            s.add_model(m)
        _step(s, "A", 1, "a0")
        s.wait("a0s")
        _step(s, "A", 4, "a1")  # B, C, D idle: nothing to wait for
        s.wait("a1s")
        s.sampling("C", 1)
        s.sampling("D", 1)
        _step(s, "A", 7, "a2")
        _step(s, "B", 1, "b2")
        s.wait("a2s")
        s.wait("b2s")
    finally:
        s.stop()
    # A waited for B (one more made a group's share, two of four) and not for C and D: far below the bound
    assert s.stats()["held_seconds"] < 30
    assert ("cycle", [("A", 7), ("B", 1)], [("A", 8), ("B", 2)]) in s.backend.log or \
        ("cycle", [("B", 1), ("A", 7)], [("B", 2), ("A", 8)]) in s.backend.log, s.backend.log


def _optim_cycles(s) -> list[set[str]]:
    """The models of each cycle that ran optim_steps."""
    return [{m for m, _ in c[2]} for c in cycles(s) if c[2]]


def test_with_gather_an_optim_step_rides_beside_its_forward_backward_only_beside_its_partners_steps(tmp_path):
    """A sent its forward_backward and optim_step, B only its forward_backward: the two forward_backward calls
    train in one cycle and A's step waits out of it for B's, then both step in one optimizer pass. When every
    model of the cycle has its step there, the steps ride in it."""
    s = Scheduler(Recorder(), lambda *a: None, gather=1.0, gather_groups=1)
    for m in "AB":
        s.add_model(m)
    s.submit("A", fwd("a1", "A", 1))
    s.submit("A", optim_work("a2", "A", 2, AdamParams()))
    s.submit("B", fwd("b1", "B", 1))
    s.run_cycle()
    s.submit("B", optim_work("b2", "B", 2, AdamParams()))
    s.run_cycle()
    for m in "AB":
        s.submit(m, fwd(f"{m}3", m, 3))
        s.submit(m, optim_work(f"{m}4", m, 4, AdamParams()))
    s.run_cycle()
    assert [(sorted(f), sorted(o)) for _, f, o in cycles(s)] == [
        ([("A", 1), ("B", 1)], []), ([], [("A", 2), ("B", 2)]), ([("A", 3), ("B", 3)], [("A", 4), ("B", 4)])]


@pytest.mark.parametrize("sent", ["with_forward_backward", "once_it_is_answered"])
def test_with_gather_the_optim_steps_of_models_that_trained_together_share_a_cycle(tmp_path, sent):
    """A's forward_backward waits for B's (B's samples decode) and they train in one cycle. A's optim_step, sent
    with its forward_backward (the SDK's way) or once it is answered (a client that waits), then waits for B's,
    which B sends only once its forward_backward is answered: the two steps run in one cycle, A's save after its
    step (save_in_step), and that cycle's `held` counts the wait."""
    s = _threaded(tmp_path, 0.05, gather=1e4, gather_groups=1, save_in_step=True)
    try:
        for m in "AB":
            s.add_model(m)
        s.sampling("B", 1)
        if sent == "with_forward_backward":
            _step(s, "A", 1, "a")
        else:
            s.submit("A", fwd("af", "A", 1))
        s.sampling("B", -1)
        s.submit("B", fwd("bf", "B", 1))
        s.wait("af")
        s.wait("bf")
        if sent == "once_it_is_answered":
            s.submit("A", optim_work("ao", "A", 2, AdamParams()))
            s.submit("A", barrier_work("as", "A", 3, "snapshot", lambda b: {"saved": "A"}))
        threading.Event().wait(0.3)  # A's step waits meanwhile: nothing of it is answered
        assert "ao" not in s.answers and "as" not in s.answers
        s.submit("B", optim_work("bo", "B", 2, AdamParams()))
        for rid in ("ao", "as", "bo"):
            s.wait(rid)
    finally:
        s.stop()
    assert [{m for m, _ in c[1]} for c in cycles(s)] == [{"A", "B"}, set()], cycles(s)
    assert _optim_cycles(s) == [{"A", "B"}] and s.answers["as"].result == {"saved": "A"}
    rows = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert rows[-1]["optim"] in ([["A", 2], ["B", 2]], [["B", 2], ["A", 2]]) and rows[-1]["held"] > 0


def _trained_together(tmp_path, gather: float, fail: tuple[str, ...] = ()):
    """A and B's forward_backward calls trained in one cycle (run here, before the trainer thread starts); those
    of the models in `fail` failed."""
    s = _threaded(tmp_path, 0.05, start=False, gather=gather, gather_groups=1)
    s.backend.fail.update(fail)
    for m in "AB":
        s.add_model(m)
        s.submit(m, fwd(f"{m}f", m, 1))
    s.run_cycle()
    assert cycles(s) == [("cycle", [("A", 1), ("B", 1)], [])] or cycles(s) == [("cycle", [("B", 1), ("A", 1)], [])]
    s.start()
    return s


def test_with_gather_a_lone_models_optim_step_is_not_held(tmp_path):
    """A trains alone (B is idle, not about to train): its step, sent once its forward_backward is answered, runs
    at once, however large the bound (a hold would last past WAIT_S)."""
    s = _threaded(tmp_path, 0.05, gather=1e4, gather_groups=1)
    try:
        for m in "AB":
            s.add_model(m)
        s.submit("A", fwd("af", "A", 1))
        s.wait("af")
        s.submit("A", optim_work("ao", "A", 2, AdamParams()))
        s.wait("ao")
    finally:
        s.stop()
    assert _optim_cycles(s) == [{"A"}] and s.stats()["held_cycles"] == 0


@pytest.mark.parametrize("partner", ["deleted", "trains_again", "failed"])
def test_with_gather_an_optim_step_does_not_wait_for_a_partner_that_will_not_step(tmp_path, partner):
    """After A and B trained together, A's step does not wait (however large the bound) for B once B is deleted
    (while A's step waits), sends another forward_backward first (a step over several), or failed its
    forward_backward."""
    s = _trained_together(tmp_path, 1e4, fail=("B",) if partner == "failed" else ())
    try:
        if partner == "trains_again":
            s.submit("B", fwd("bf2", "B", 2))
        s.submit("A", optim_work("ao", "A", 2, AdamParams()))
        if partner == "deleted":
            threading.Event().wait(0.3)  # A's step waits for B's meanwhile
            assert "ao" not in s.answers
            s.remove_model("B", "model B was deleted")
        s.wait("ao")
    finally:
        s.stop()
    assert {"A"} in _optim_cycles(s)


def test_with_gather_a_partner_that_stops_sending_holds_an_optim_step_only_for_the_bound(tmp_path):
    """A and B trained together; B never sends its step. A's waits the bound (2 x the 0.05 s cycle), then runs
    alone, its cycle's `held` counting the wait; B's step, when it comes at last, is not held for A's."""
    s = _trained_together(tmp_path, 2.0)
    try:
        s.submit("A", optim_work("ao", "A", 2, AdamParams()))
        s.wait("ao")
        s.submit("B", optim_work("bo", "B", 2, AdamParams()))
        s.wait("bo")
    finally:
        s.stop()
    assert _optim_cycles(s) == [{"A"}, {"B"}]
    rows = [json.loads(x) for x in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert [r["held"] > 0 for r in rows if r["optim"]] == [True, False], rows


def test_a_models_save_does_not_hold_the_answer_of_another_models_step_in_its_cycle(tmp_path):
    """A save (here one that waits) runs after the cycle's training pass: B's forward_backward and optim_step
    are answered before it ends, and A's save when it does."""
    answered, cond = {}, threading.Condition()

    def done(rid, o):
        with cond:
            answered[rid] = o
            cond.notify_all()

    s = Scheduler(Recorder(), done)
    s.add_model("A")
    s.add_model("B")
    go = threading.Event()
    s.submit("A", barrier_work("as", "A", 1, "snapshot", lambda b: go.wait(WAIT_S) and {"saved": "A"}))
    s.submit("B", fwd("bf", "B", 1))
    s.submit("B", optim_work("bo", "B", 2, AdamParams()))
    t = threading.Thread(target=s.run_cycle)
    t.start()
    with cond:
        assert cond.wait_for(lambda: {"bf", "bo"} <= set(answered), timeout=WAIT_S)
        assert "as" not in answered
    go.set()
    t.join(WAIT_S)
    assert answered["as"].result == {"saved": "A"}


def test_a_cycle_that_keeps_raising_backs_off_instead_of_spinning_and_stop_still_ends_it(tmp_path):
    """A bug that raises before a cycle takes its work leaves the work queued: the trainer thread waits, longer
    after each failure in a row (FAILED_WAIT_S), rather than retrying it thousands of times a second."""
    s = Scheduler(Recorder(), lambda rid, o: None, tmp_path / "stats.jsonl")
    s.add_model("A")
    calls = []

    def broken(*a, **k):
        calls.append(time.monotonic())
        raise RuntimeError("a bug in the cycle")

    s.run_cycle = broken
    s.submit("A", fwd("a1", "A", 1))
    s.start()
    time.sleep(1.0)
    seen = len(calls)
    s.stop()
    assert 2 <= seen <= 8, seen  # 0.05 + 0.1 + 0.2 + 0.4 s of waits fit in the second: about five tries
    assert not s._thread.is_alive()
