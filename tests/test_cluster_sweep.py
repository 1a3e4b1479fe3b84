"""`colora sweep --gpus N` and `colora bench arms --gpus N` (colora/sweeps/on_cluster.py, dedicated.py):
the record, a dedicated run's parts merged into a one-GPU run's directory, failures, resume, the
deadline. A fake `run_shares` stands in for the Ray cluster here (it writes what a run writes); the
real one runs a sweep on a local cluster with 2 logical GPUs in tests/test_ray.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from colora.bench import arms as bench_arms
from colora.cluster import driver
from colora.cluster.placement import Outcome
from colora.config import from_dict, load_config
from colora.record.runlog import read_jsonl, write_json_atomic
from colora.record.summary import JobSummary, RunSummary
from colora.record.throughput import combine_windows, measure_window, steps_per_job, throughput
from colora.sweeps import orchestrate, sweep

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"


@pytest.fixture(autouse=True)
def _no_ray_needed(monkeypatch):
    """The fake cluster stands in for Ray, so the commands' check that the `ray` extra is installed is
    passed over: these tests run where Ray is not installed."""
    for mod in (sweep, bench_arms):
        monkeypatch.setattr(mod, "require_ray", lambda why: None)
STEP_S = {"count": 1.5, "mod": 2.0}  # a job's step (generate 1 s, then train) in the fake runs


def fake_run(cfg, out: Path, log: Path, error: str | None) -> dict | None:
    """The files colora.run.runner.run leaves: every job's steps of STEP_S seconds after an engine start of
    2 s; one job at a time in the dedicated arm, all together otherwise. `error`: fails instead."""
    out.mkdir(parents=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"fake run of {', '.join(j.name for j in cfg.jobs)}\n")
    write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
    if error:
        write_json_atomic(out / "status.json", {"state": "failed", "error": error})
        return None
    names, warm, t = [j.name for j in cfg.jobs], cfg.experiment.warmup_steps, 0.0
    spans = [{"phase": "engine_start", "group": -1, "jobs": [], "start": -2.0, "end": 0.0}]
    rows, ends = [], {n: [] for n in names}
    windows = []
    for batch in ([[n] for n in names] if cfg.experiment.arm == "dedicated" else [names]):
        t0, dt = t, max(STEP_S[n] for n in batch)
        for step in range(cfg.experiment.steps):
            spans += [{"phase": "generate", "group": 0, "jobs": batch, "start": t, "end": t + 1.0, "queued": t},
                      {"phase": "train", "group": 0, "jobs": batch, "start": t + 1.0, "end": t + dt}]
            t += dt
            for n in batch:
                ends[n].append(t)
                rows.append({"job": n, "step": step, "status": "ok", "reward": 0.1 * step})
        windows.append(measure_window({n: ends[n] for n in batch}, t0, warm))
    window = combine_windows(windows) if cfg.experiment.arm == "dedicated" else windows[0]
    with open(out / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(out / "timeline.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in spans)
    for n in names:
        (out / "adapters" / n).mkdir(parents=True)
        (out / "adapters" / n / "adapter_model.safetensors").write_bytes(n.encode())
    write_json_atomic(out / "eval_before.json", {n: {"accuracy": 0.25} for n in names})
    write_json_atomic(out / "eval.json", {"n": 4, "before": {n: {"accuracy": 0.25} for n in names},
                                          "after": {n: {"accuracy": 0.5} for n in names}})
    (out / "run.log").write_text(f"run.log of {', '.join(names)}\n")
    summary = RunSummary(
        experiment=cfg.experiment.name, arm=cfg.experiment.arm, seed=cfg.experiment.seed, config_hash=cfg.hash(),
        code_version={"commit": "c"}, runtime={}, model="m", device="cpu", dtype="float32", mps="-",
        engine_start_s=2.0, engine_reused=False, engine_process=False, adapter_sync="disk", packed_rows=True,
        trainer_setup_s=1.0, trainer_sm_count=None, steps_measured=window["steps"], seconds_measured=window["seconds"],
        steps_per_hour=throughput(window), groups=None, busy_fraction=1.0, gpu_util=None, wall_s=t + 2.0,
        jobs={n: JobSummary("done", "", cfg.experiment.steps, cfg.experiment.steps, 0.1, 0.25, 0.5) for n in names},
        window=window).to_dict()
    write_json_atomic(out / "summary.json", summary)
    write_json_atomic(out / "status.json", {"state": "complete"})
    return summary


class FakeCluster:
    """`driver.run_shares` without Ray: each share in turn, through the caller's hooks. Shares whose
    (arm, seed, first job) is in `fail` fail with `RuntimeError: boom`; `deadline_after`: after that
    many shares started, DeadlineReached as the real one raises at its stop time."""

    def __init__(self, fail=(), deadline_after: int | None = None):
        self.fail, self.deadline_after = set(fail), deadline_after
        self.started: list[str] = []
        self.gpus: list[int] = []

    def __call__(self, shares, gpus, address, log, *, hooks, stop_at=None, **kw):
        self.gpus.append(gpus)
        for s in shares:
            why = hooks.admit(s)
            if why:
                hooks.ended(Outcome(s.index, str(s.out), s.jobs, error=f"not started: {why}"))
                continue
            if self.deadline_after is not None and len(self.started) >= self.deadline_after:
                raise driver.DeadlineReached("1 run(s) still going at the deadline")
            info = {"host": "node", "pid": 100 + s.index, "gpu_ids": [str(len(self.started) % gpus)], "token": "t"}
            self.started.append(s.label)
            if s.info is not None:
                write_json_atomic(s.info, info)
            hooks.started(s, info)
            cfg = from_dict(s.cfg)
            error = "RuntimeError: boom" if (cfg.experiment.arm, cfg.experiment.seed, s.jobs[0]) in self.fail else None
            summary = fake_run(cfg, s.out, s.log, error)
            hooks.line(s, "warning: something the run said")
            hooks.ended(Outcome(s.index, str(s.out), s.jobs, summary, error, {}, 1000.0 + s.index,
                                1010.0 + 2 * s.index, info))


def _argv(out: Path, *extra: str) -> list[str]:
    return [str(SMOKE), "--seeds", "1", "--arms", "dedicated", "shared_sync", "--out", str(out), "--gpus", "2",
            "--set", "experiment.steps=3", "--set", "experiment.warmup_steps=1", *extra]


def test_a_dedicated_run_in_parts_becomes_a_one_gpu_runs_directory(tmp_path, monkeypatch, tiny_model_dir):
    from colora.studies.report_data import find_run_dirs, load_run

    fake = FakeCluster(fail={("shared_sync", 1, "count")})
    monkeypatch.setattr(driver, "run_shares", fake)
    out = tmp_path / "sw"
    argv = _argv(out, "--set", f'experiment.model="{tiny_model_dir}"')
    assert sweep.main(argv) == 1  # a run failed; the others went on
    # one co-runner a job of the dedicated run (side by side), then the shared run
    assert fake.started == ["dedicated seed 1 r0 part 0", "dedicated seed 1 r0 part 1", "shared_sync seed 1 r0"]
    rec = {r["dir"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert rec["shared_sync/seed1-r0"]["state"] == "failed"
    assert rec["shared_sync/seed1-r0"]["error"] == "RuntimeError: boom"
    ded = out / "dedicated" / "seed1-r0"
    assert rec["dedicated/seed1-r0"]["state"] == "complete" and rec["dedicated/seed1-r0"]["gpus"] == ["node:0", "node:1"]
    # what a one-GPU dedicated run leaves, and its parts' leftovers (no summary: not runs of their own)
    assert sorted(p.name for p in ded.iterdir()) == ["adapters", "config.json", "eval.json", "eval_before.json",
                                                     "metrics.jsonl", "parts", "run.log", "status.json",
                                                     "summary.json", "timeline.jsonl"]
    assert sorted(p.name for p in (ded / "parts").iterdir()) == ["0", "0.corunner.json", "1", "1.corunner.json"]
    assert sorted(p.name for p in (ded / "parts" / "0").iterdir()) == ["config.json", "status.json"]
    assert (ded / "adapters" / "mod" / "adapter_model.safetensors").read_bytes() == b"mod"
    cfg = load_config(SMOKE, ["experiment.steps=3", "experiment.warmup_steps=1", f'experiment.model="{tiny_model_dir}"',
                              "experiment.arm=dedicated", "experiment.seed=1"])
    assert json.loads((ded / "config.json").read_text())["hash"] == cfg.hash()
    s = json.loads((ded / "summary.json").read_text())
    # the one-GPU quantity: steps 2-3 of each job over their windows' seconds, summed
    assert s["steps_measured"] == 4 and s["seconds_measured"] == pytest.approx(2 * 1.5 + 2 * 2.0)
    assert s["steps_per_hour"] == pytest.approx(4 / 7.0 * 3600) and steps_per_job(s["window"]) == {"count": 2, "mod": 2}
    assert list(s["jobs"]) == ["count", "mod"] and s["engine_start_s"] == 2.0
    assert [p["gpu_ids"] for p in s["parts"]] == [["0"], ["1"]] and s["wall_s"] == pytest.approx(1012.0 - 1000.0)
    # the parts laid end to end: mod's engine start begins where count's last step ended (4.5 s)
    spans = read_jsonl(ded / "timeline.jsonl")
    starts = [sp for sp in spans if sp["phase"] == "engine_start"]
    assert [(sp["start"], sp["end"]) for sp in starts] == [(-2.0, 0.0), (4.5, 6.5)]
    assert [w["start"] for w in s["window"]["windows"]] == [1.5, 8.5]
    assert [r["job"] for r in read_jsonl(ded / "metrics.jsonl")] == ["count"] * 3 + ["mod"] * 3
    assert set(json.loads((ded / "eval.json").read_text())["after"]) == {"count", "mod"}
    assert "== part 1: mod on node GPU 1 ==" in (ded / "run.log").read_text()
    log = (out / "dedicated" / "seed1-r0.log").read_text()
    assert "== part 0: count ==\nfake run of count" in log and "== part 1: mod ==\nfake run of mod" in log
    assert not (ded / "parts" / "0.log").exists()
    # the report finds the one run and reads it as a dedicated run of both jobs
    assert find_run_dirs([out]) == [ded.resolve()]
    run = load_run(ded)
    assert run.arm == "dedicated" and set(run.curves) == {"count", "mod"} and run.eval_after == {"count": 0.5, "mod": 0.5}

    # again: the complete run is skipped, the failed one moved aside and run again
    again = FakeCluster()
    monkeypatch.setattr(driver, "run_shares", again)
    assert sweep.main(argv) == 0
    assert again.started == ["shared_sync seed 1 r0"] and again.gpus == [1]  # one share: one GPU asked for
    assert (out / "shared_sync" / "seed1-r0.incomplete-1" / "config.json").is_file()
    rec = {r["dir"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert {d: r["state"] for d, r in rec.items()} == {"dedicated/seed1-r0": "complete",
                                                       "shared_sync/seed1-r0": "complete"}
    third = FakeCluster()
    monkeypatch.setattr(driver, "run_shares", third)
    assert sweep.main(argv) == 0 and third.gpus == []  # nothing to run: no cluster


def test_a_failed_part_fails_its_run(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.setattr(driver, "run_shares", FakeCluster(fail={("dedicated", 1, "count")}))
    out = tmp_path / "sw"
    lines = []
    cfg = load_config(SMOKE, ["experiment.steps=2", f'experiment.model="{tiny_model_dir}"'])
    states = orchestrate.run_plan(cfg, sweep.plan_runs(["dedicated"], [1]), out, progress=lines.append, gpus=2)
    assert states == {"dedicated/seed1-r0": "failed"}
    rec = json.loads((out / "sweep.json").read_text())["runs"][0]
    assert rec["error"] == "part 0: RuntimeError: boom"
    assert "[1/1] dedicated seed 1 r0 part 0: FAILED: RuntimeError: boom" in lines  # at once, the other goes on
    assert any(x.startswith("[1/1] dedicated seed 1 r0: FAILED after") for x in lines)
    ded = out / "dedicated" / "seed1-r0"
    assert not (ded / "summary.json").exists() and (ded / "parts" / "1" / "summary.json").is_file()  # kept as it was
    assert "fake run of mod" in (out / "dedicated" / "seed1-r0.log").read_text()


def test_the_deadline_on_the_cluster(tmp_path, monkeypatch, tiny_model_dir):
    """A run that the deadline would cut is not started (skipped); at the stop time the runs still
    going are failed and those not reached skipped, as on one GPU."""
    cfg = load_config(SMOKE, ["experiment.steps=2", f'experiment.model="{tiny_model_dir}"'])
    plan = sweep.plan_runs(["dedicated", "shared_sync"], [1, 2])
    fake = FakeCluster(deadline_after=1)
    monkeypatch.setattr(driver, "run_shares", fake)
    states = orchestrate.run_plan(cfg, plan, tmp_path / "a", progress=lambda s: None, gpus=2, deadline_s=3600)
    assert fake.started == ["dedicated seed 1 r0 part 0"]
    assert states == {"dedicated/seed1-r0": "failed", "shared_sync/seed1-r0": "skipped",
                      "dedicated/seed2-r0": "skipped", "shared_sync/seed2-r0": "skipped"}
    rec = {r["dir"]: r for r in json.loads((tmp_path / "a" / "sweep.json").read_text())["runs"]}
    assert rec["dedicated/seed1-r0"]["error"] == "stopped at the deadline"
    assert "fake run of count" in (tmp_path / "a" / "dedicated" / "seed1-r0.log").read_text()  # its parts' logs

    ticks = iter(range(0, 10_000, 100))  # every look at the clock: 100 s later
    fake = FakeCluster()
    monkeypatch.setattr(driver, "run_shares", fake)
    lines = []
    states = orchestrate.run_plan(cfg, plan, tmp_path / "b", progress=lines.append, gpus=2, deadline_s=250,
                                  clock=lambda: float(next(ticks)))
    assert fake.started == ["dedicated seed 1 r0 part 0", "dedicated seed 1 r0 part 1"]
    assert states["dedicated/seed1-r0"] == "complete" and states["shared_sync/seed2-r0"] == "skipped"
    assert any("not started, the deadline" in x or "not started, it needs about" in x for x in lines)


def test_gpus_flags_are_checked_before_anything_runs(tmp_path, monkeypatch, capsys):
    from colora.cluster import require_ray

    for mod in (sweep, bench_arms):  # the commands' own check for Ray, which the fixture passes over
        monkeypatch.setattr(mod, "require_ray", require_ray)
    monkeypatch.setattr(driver, "run_shares", lambda *a, **k: pytest.fail("nothing may run"))
    assert sweep.main(_argv(tmp_path / "a", "--gpus", "0")) == 2
    assert "--gpus (0) must be at least 1" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert sweep.main(_argv(tmp_path / "b")) == 2
    assert "--gpus 2 needs Ray, which is not installed: pip install 'colora[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    from colora.cli import main

    assert main(["bench", "arms", str(SMOKE), "--gpus", "2", "--runs", str(tmp_path / "c")]) == 2
    assert "needs Ray, which is not installed" in capsys.readouterr().err


def test_bench_arms_hands_its_gpus_to_the_plan(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench_arms, "run_plan", lambda cfg, runs, root, **kw: seen.update(kw) or {})
    monkeypatch.setattr(bench_arms, "draw_timeline", lambda *a: None)
    argv = [str(SMOKE), "--seeds", "1", "--arms", "dedicated", "--runs", str(tmp_path / "r"), "--out",
            str(tmp_path / "rep"), "--gpus", "2", "--address", "auto"]
    monkeypatch.setitem(sys.modules, "ray", object())  # require_ray only imports it
    assert bench_arms.main(argv) == 0
    assert seen["gpus"] == 2 and seen["address"] == "auto" and seen["children"] is True
