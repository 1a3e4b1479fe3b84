"""A full-parameter model's engine comes back when it dies (colora/service/full.py's FullSampling over
colora/service/engine_loop.py), over a fake engine: its samples in flight fail retryably, a new engine of the
same factory loads the newest saved weights before any sample runs, the sampler of that save goes on; a save
while the engine restarts is loaded into the new one; failed starts back off and degrade, and a start that
succeeds recovers with the newest weights.

The fake's sample log-probs are the version of the weights it holds: what served a sample is in its answer."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from colora.engine.process import EngineProcessError
from colora.service.backend import BackendError, SampleCall, SampleResult
from colora.service.full import FullSampler, FullSampling

WAIT_S = 30.0  # a bound on a hang, not a speed


class FakeFull:
    """What the engine loop calls of a FullEngine. A batch finishes after `max_tokens` polls; its log-probs
    are the version of the weights loaded (0: the model directory's). A load while a request is in flight
    fails the test (FullEngine refuses it). `kill()` is its core's SIGKILL: every later call raises."""

    def __init__(self, number: int, fail_load: bool = False):
        self.number, self.fail_load = number, fail_load
        self.version = 0
        self.batches: dict = {}
        self.log: list = []  # ("load", version) and ("submit", first prompt token) in the order they came
        self.died = ""
        self.closed = False

    def kill(self) -> None:
        self.died = f"engine process {1000 + self.number} (VLLM::EngineCore) died"

    def _alive(self) -> None:
        if self.died:
            raise EngineProcessError(f"the engine's process ended ({self.died})")

    def submit(self, key, requests) -> None:
        self._alive()
        assert all(r.snapshot is None for r in requests), "a full model's request names no LoRA"
        self.log.append(("submit", requests[0].prompt_ids[0]))
        self.batches[key] = [requests, requests[0].max_tokens, self.version]

    def poll(self):
        self._alive()
        done = []
        for key, batch in list(self.batches.items()):
            batch[1] -= 1
            if batch[1] <= 0:
                del self.batches[key]
                done.append((key, [SimpleNamespace(request=r, completion_ids=[7], logprobs=[-float(batch[2])],
                                                   stop_reason="length", prompt_logprobs=None) for r in batch[0]]))
        return done

    def busy(self) -> bool:
        return bool(self.batches)

    def dead(self) -> str:
        return self.died

    def set_adapters(self, updates) -> None:
        self._alive()
        assert not self.batches, "a load while a sample is in flight"
        if self.fail_load:
            raise RuntimeError("vLLM's worker did not load the weights: the shared segment holds version -1")
        self.version = updates[-1].version
        self.log.append(("load", self.version))

    def close(self) -> None:
        self.closed = True


class World:
    """The engines the factory started; `fail` starts fail next; a start after the first waits for `gate`
    when one is set up (the test looks while the new engine starts)."""

    def __init__(self):
        self.engines: list[FakeFull] = []
        self.fail = 0
        self.fail_load = False
        self.gate: threading.Event | None = None
        self.starting = threading.Event()

    def factory(self) -> FakeFull:
        if self.engines:
            self.starting.set()
            if self.gate is not None:
                assert self.gate.wait(WAIT_S)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("vLLM could not allocate its KV cache")
        self.engines.append(FakeFull(len(self.engines), self.fail_load))
        return self.engines[-1]


class Answers:
    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def done(self, name):
        return lambda value: self.q.put((name, value))

    def get(self):
        return self.q.get(timeout=WAIT_S)


def until(cond, what: str) -> None:
    ev = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if cond():
            return
        ev.wait(0.01)
    pytest.fail(f"never: {what}")


def call(first: int, max_tokens: int = 1) -> SampleCall:
    return SampleCall(None, np.array([first, 2, 3]), 1, max_tokens)


def export(version: int):
    """A save's export: the WeightsUpdate of `version` (the fake reads only its version)."""
    return lambda: SimpleNamespace(job="m", version=version)


@pytest.fixture
def world():
    return World()


@pytest.fixture
def make(world):
    made = []

    def build(**kw) -> FullSampling:
        lines: list[str] = []
        s = FullSampling("m", world.factory, lines.append, **kw)
        s.lines = lines
        made.append(s)
        return s

    yield build
    for s in made:
        s.close("the test ended")


def sample(s: FullSampling, ref: FullSampler, first: int, max_tokens: int = 1):
    answers = Answers()
    s.sample(ref, call(first, max_tokens), answers.done(first))
    return answers


def test_a_dead_engine_fails_its_samples_retryably_and_the_new_one_loads_the_newest_save_first(make, world):
    s = make()
    ref = s.save(export(3))
    assert ref == FullSampler("m", 1)
    got = sample(s, ref, 10).get()[1]
    assert isinstance(got, SampleResult) and float(got.sequences[0].logprobs[0]) == -3.0
    world.gate = threading.Event()
    in_flight = sample(s, ref, 11, max_tokens=10**9)
    until(lambda: s.health()["engine_requests_in_flight"] == 1, "the sample decodes")
    first = world.engines[0]
    first.kill()
    err = in_flight.get()[1]
    assert isinstance(err, BackendError) and err.category == "server" and err.retryable and "died" in err.message
    assert world.starting.wait(WAIT_S)
    h = s.health()
    assert h["status"] == "restarting" and h["model_id"] == "m" and "VLLM::EngineCore" in h["last_engine_error"]
    waits = sample(s, ref, 12)  # the same sampler ref: it waits for the new engine
    until(lambda: s.health()["samples_waiting"] == 1, "the sample waits")
    world.gate.set()
    got = waits.get()[1]
    assert isinstance(got, SampleResult) and float(got.sequences[0].logprobs[0]) == -3.0
    assert world.engines[1].log == [("load", 3), ("submit", 12)]  # the newest weights before any sample
    assert first.closed and s.health()["status"] == "ok" and s.health()["engine_restarts"] == 1
    assert len(s.lines) == 2 and "died" in s.lines[0] and "restarted" in s.lines[1], s.lines


def test_a_save_while_the_engine_restarts_is_loaded_into_the_new_one(make, world):
    """The save does not wait for the restart; a sample of the older save that waited is refused (its weights
    were replaced), one of the new save runs on the new weights in the new engine, loaded once."""
    s = make()
    old = s.save(export(1))
    world.gate = threading.Event()
    world.engines[0].kill()
    assert world.starting.wait(WAIT_S)
    stale = sample(s, old, 20)
    until(lambda: s.health()["samples_waiting"] == 1, "the sample waits")
    new = s.save(export(2))
    err = stale.get()[1]
    assert isinstance(err, BackendError) and err.category == "user" and "replaced" in err.message
    after = sample(s, new, 21)
    world.gate.set()
    got = after.get()[1]
    assert isinstance(got, SampleResult) and float(got.sequences[0].logprobs[0]) == -2.0
    assert world.engines[1].log == [("load", 2), ("submit", 21)]
    assert s.save(export(3)) == FullSampler("m", 3)  # the restart's load let the next save go on
    assert float(sample(s, FullSampler("m", 3), 22).get()[1].sequences[0].logprobs[0]) == -3.0


def test_a_load_behind_samples_in_flight_reaches_the_new_engine_before_the_samples_after_it(make, world):
    s = make()
    ref = s.save(export(1))
    before = sample(s, ref, 30, max_tokens=10**9)
    until(lambda: s.health()["engine_requests_in_flight"] == 1, "the sample decodes")
    ref2 = s.save(export(2))  # its load waits for the sample in flight
    after = sample(s, ref2, 31)
    world.engines[0].kill()
    assert before.get()[1].retryable
    got = after.get()[1]
    assert isinstance(got, SampleResult) and float(got.sequences[0].logprobs[0]) == -2.0
    assert world.engines[0].log == [("load", 1), ("submit", 30)]
    assert world.engines[1].log == [("load", 2), ("submit", 31)]


def test_failed_starts_back_off_degrade_and_a_start_that_succeeds_loads_the_newest_save(make, world):
    s = make(backoff_s=0.01, degraded_after=2)
    ref = s.save(export(1))
    world.fail, world.gate = 3, threading.Event()
    world.engines[0].kill()
    assert world.starting.wait(WAIT_S)
    waits = sample(s, ref, 40)
    until(lambda: s.health()["samples_waiting"] == 1, "the sample waits")
    world.gate.set()
    err = waits.get()[1]  # failed when the model's engine degraded, at the second failed start
    assert err.category == "server" and not err.retryable and "2 starts failed" in err.message
    until(lambda: s.health()["engine_restarts"] == 1, "a start succeeds")
    assert s.health()["status"] == "ok"
    got = sample(s, ref, 41).get()[1]
    assert isinstance(got, SampleResult) and float(got.sequences[0].logprobs[0]) == -1.0
    fails = [x for x in s.lines if "starting a new engine failed" in x]
    assert len(fails) == 3 and "degraded" in fails[1], s.lines


def test_a_degraded_engine_answers_samples_at_once_and_a_save_does_not_wait(make, world):
    s = make(backoff_s=30.0, degraded_after=1)
    ref = s.save(export(1))
    world.fail = 1
    world.engines[0].kill()
    until(lambda: s.health()["status"] == "degraded", "degraded")
    err = sample(s, ref, 50).get()[1]
    assert err.category == "server" and not err.retryable and "the engine is down" in err.message
    ref2 = s.save(export(2))
    assert s.save(export(3)) == FullSampler("m", 3) and ref2.save == 2  # no engine to wait for


def test_weights_that_do_not_load_into_a_live_engine_replace_it(make, world):
    """A load that fails leaves the engine's weights of no version: it is not used again; the new one loads
    them, and failing there too its starts fail (and back off) until the model's engine degrades."""
    s = make(backoff_s=0.01, degraded_after=2)
    world.engines[0].fail_load = True
    world.fail_load = True
    s.save(export(1))
    until(lambda: s.health()["status"] == "degraded", "degraded")
    assert world.engines[0].closed and "did not load the weights" in s.health()["last_engine_error"]
    world.fail_load = False
    until(lambda: s.health()["status"] == "ok", "a start loads them")
    assert world.engines[-1].log == [("load", 1)]


def test_close_answers_what_waits_and_closes_the_engines(make, world):
    s = make()
    ref = s.save(export(1))
    world.gate = threading.Event()
    world.engines[0].kill()
    assert world.starting.wait(WAIT_S)
    waits = sample(s, ref, 60)
    until(lambda: s.health()["samples_waiting"] == 1, "the sample waits")
    threading.Timer(0.2, world.gate.set).start()
    s.close("the model was deleted")
    err = waits.get()[1]
    assert isinstance(err, BackendError) and "engine stopped: the model was deleted" in err.message
    assert len(world.engines) == 2 and all(e.closed for e in world.engines)
