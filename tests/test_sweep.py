"""colora sweep: the plan, resuming (skip finished, move aside and redo unfinished), refusals, progress.

A fake run function stands in for the runner (no vLLM); the real sweep runs in test_report's
end-to-end test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colora.config import load_config
from colora.record.runlog import write_json_atomic
from colora.run import rundir
from colora.studies.prereg import lock
from colora.sweeps import orchestrate, sweep

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"


class FakeRunner:
    """Writes what a run writes; raises for the (arm, seed) pairs in `fail` after starting."""

    def __init__(self, fail=(), summary=None):
        self.fail = set(fail)
        self.summary = summary or {}  # more of what each run's summary says (failed jobs, say)
        self.calls: list[tuple[str, int]] = []
        self.caches = set()

    def __call__(self, cfg, out, cache, log):
        key = (cfg.experiment.arm, cfg.experiment.seed)
        self.calls.append(key)
        self.caches.add(id(cache))
        out.mkdir(parents=True)
        write_json_atomic(out / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
        write_json_atomic(out / "status.json", {"state": "running"})
        log(f"fake run {key}")
        if key in self.fail:
            write_json_atomic(out / "status.json", {"state": "failed", "error": "boom"})
            raise RuntimeError("boom")
        summary = {"arm": key[0], "seed": key[1], "steps_per_hour": 100.0 * (1 + key[1]), **self.summary}
        write_json_atomic(out / "summary.json", summary)
        write_json_atomic(out / "status.json", {"state": "complete"})
        return summary


def test_plan_order_and_aa_repeats():
    plan = sweep.plan_runs(["dedicated", "overlap_mps", "shared_sync"], [1, 2], 1, aa_seeds=[1])
    assert [p.rel for p in plan] == [
        "dedicated/seed1-r0", "shared_sync/seed1-r0", "overlap_mps/seed1-r0",  # MPS arms last in a seed
        "dedicated/seed1-r1",  # the A/A
        "dedicated/seed2-r0", "shared_sync/seed2-r0", "overlap_mps/seed2-r0"]
    assert len(sweep.plan_runs(["dedicated", "mps"], [1, 2, 3], 2)) == 12


@pytest.mark.parametrize("args, match", [
    ((["dedicated"], [1, 1]), "repeats a value"),
    (([], [1]), "at least one"),
    ((["dedicated"], [1], 0), "--repeats"),
    ((["shared_sync"], [1], 1, [1]), "dedicated arm"),
    ((["dedicated"], [1], 1, [2]), "--aa-seeds"),
])
def test_plan_errors(args, match):
    with pytest.raises(Exception, match=match):
        sweep.plan_runs(*args)


def test_resume_skips_complete_and_redoes_unfinished(tmp_path):
    out = tmp_path / "sw"
    argv = [str(SMOKE), "--seeds", "1", "2", "--arms", "dedicated", "shared_sync", "--out", str(out)]
    first = FakeRunner(fail={("shared_sync", 2)})
    assert sweep.main(argv, run_fn=first) == 1  # one failed run: exit 1, the others done
    assert len(first.calls) == 4 and len(first.caches) == 1  # one engine cache for every run
    rec = {r["dir"]: r for r in json.loads((out / "sweep.json").read_text())["runs"]}
    assert rec["shared_sync/seed2-r0"]["state"] == "failed" and "boom" in rec["shared_sync/seed2-r0"]["error"]
    assert rec["dedicated/seed1-r0"]["state"] == "complete"
    assert "fake run ('dedicated', 1)" in (out / "dedicated" / "seed1-r0.log").read_text()

    # a run killed mid-way leaves a directory with no summary: it is redone as well
    killed = out / "dedicated" / "seed2-r0"
    (killed / "summary.json").unlink()
    write_json_atomic(killed / "status.json", {"state": "running"})

    second = FakeRunner()
    assert sweep.main(argv, run_fn=second) == 0
    assert sorted(second.calls) == [("dedicated", 2), ("shared_sync", 2)]
    assert (out / "shared_sync" / "seed2-r0.incomplete-1" / "config.json").is_file()  # moved aside, kept
    assert (out / "dedicated" / "seed2-r0.incomplete-1" / "config.json").is_file()
    assert rundir.run_state(out / "shared_sync" / "seed2-r0") == "complete"
    data = json.loads((out / "sweep.json").read_text())
    assert all(r["state"] == "complete" for r in data["runs"]) and len(data["invocations"]) == 2

    third = FakeRunner()
    assert sweep.main(argv, run_fn=third) == 0 and third.calls == []


def test_progress_lines(tmp_path):
    lines = []
    cfg = load_config(SMOKE)
    plan = sweep.plan_runs(["dedicated", "shared_sync"], [3], 1)
    ticks = iter(range(0, 1000, 10))
    orchestrate.run_plan(cfg, plan, tmp_path / "sw", run_fn=FakeRunner(), progress=lines.append,
                         clock=lambda: float(next(ticks)))
    assert "[1/2] dedicated seed 3 r0: running (elapsed" in lines[1] and "ETA after the first run" in lines[1]
    assert lines[2].startswith("[1/2] dedicated seed 3 r0: done in") and "400 steps/h" in lines[2]
    assert "[2/2] shared_sync seed 3 r0: running" in lines[3] and "ETA" in lines[3]
    assert lines[-1].startswith("sweep: 2/2 complete")


def test_a_runs_line_says_how_many_of_its_jobs_failed(tmp_path):
    """A timeslice run whose tenant died completes with the other tenant's steps only: its line must
    not read as a clean figure."""
    lines = []
    jobs = {"count": {"status": "failed"}, "mod": {"status": "complete"}}
    fake = FakeRunner(summary={"jobs": jobs, "failed_jobs": ["count"], "seconds_measured": 600.0,
                               "steps_measured": 40})
    orchestrate.run_plan(load_config(SMOKE), sweep.plan_runs(["dedicated"], [3], 1), tmp_path / "sw", run_fn=fake,
                         progress=lines.append, clock=lambda: 0.0)
    done = next(x for x in lines if ": done in" in x)
    assert done.endswith(", 400 steps/h (1 of 2 jobs failed)")


def test_refuses_a_complete_run_of_another_config(tmp_path, capsys):
    out = tmp_path / "sw"
    base = [str(SMOKE), "--seeds", "1", "--arms", "dedicated", "--out", str(out)]
    assert sweep.main(base, run_fn=FakeRunner()) == 0
    fake = FakeRunner()
    assert sweep.main(base + ["--set", "experiment.steps=3", "--set", "jobs.count.lora_rank=4"], run_fn=fake) == 2
    err = capsys.readouterr().err
    assert "another config" in err and "jobs.count.lora_rank" in err and fake.calls == []


def test_prereg_refuses_a_changed_config_and_runs_nothing(tmp_path, capsys):
    pr, _, _ = lock(SMOKE, tmp_path / "p.md")
    fake = FakeRunner()
    argv = [str(SMOKE), "--prereg", str(pr), "--out", str(tmp_path / "sw"), "--set", "jobs.mod.grad_clip=1.0"]
    assert sweep.main(argv, run_fn=fake) == 2
    err = capsys.readouterr().err
    assert "refusing to sweep" in err and "jobs.mod.grad_clip: locked 0.5, here 1.0" in err
    assert fake.calls == [] and not (tmp_path / "sw").exists()

    # the matching config runs the pre-registration's arms, seeds and A/A
    assert sweep.main(argv[:-2], run_fn=fake) == 0
    assert fake.calls == [("dedicated", 1), ("shared_sync", 1), ("dedicated", 1), ("dedicated", 2),
                          ("shared_sync", 2), ("dedicated", 3), ("shared_sync", 3)]
    assert json.loads((tmp_path / "sw" / "sweep.json").read_text())["prereg"] == str(pr)


def test_cli_input_errors(tmp_path, capsys):
    out = str(tmp_path / "sw")
    assert sweep.main([str(SMOKE), "--out", out], run_fn=FakeRunner()) == 2
    assert "give --seeds" in capsys.readouterr().err
    assert sweep.main([str(SMOKE), "--seeds", "1", "--set", "experiment.seed=3", "--out", out]) == 2
    assert "use --arms and --seeds" in capsys.readouterr().err
    assert sweep.main([str(SMOKE), "--seeds", "1", "--set", "experiment.stepz=3", "--out", out]) == 2
    assert "stepz" in capsys.readouterr().err
    assert not Path(out).exists()


def test_dry_run_lists_states(tmp_path, capsys):
    out = tmp_path / "sw"
    assert sweep.main([str(SMOKE), "--seeds", "1", "--out", str(out)], run_fn=FakeRunner()) == 0
    capsys.readouterr()
    assert sweep.main([str(SMOKE), "--seeds", "1", "2", "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "dedicated seed 1 r0" in text and ": complete" in text and "seed 2 r0" in text and ": missing" in text


def test_mps_arm_on_a_gpu_goes_to_a_child(tmp_path):
    cfg = load_config(SMOKE, ["experiment.steps=3"])
    plan = sweep.plan_runs(["dedicated", "overlap_mps"], [1], 1)
    child_calls = []

    def child(base, group, root, index, total, seconds, verbose):
        for p in group.runs:
            run_cfg = p.config(base)
            child_calls.append([f"experiment.steps={run_cfg.experiment.steps}", *p.overrides()])
            FakeRunner()(run_cfg, root / p.rel, None, lambda s: None)
        return 0

    fake = FakeRunner()
    orchestrate.run_plan(cfg, plan, tmp_path / "sw", run_fn=fake, child_fn=child,
                         use_child=lambda g, base: g.mps_shares is not None, progress=lambda s: None)
    assert fake.calls == [("dedicated", 1)]
    assert child_calls == [["experiment.steps=3", "experiment.arm=overlap_mps", "experiment.seed=1"]]


def test_child_processes_keep_safe_path():
    """A sweep's MPS child (and bench arms' children) is started as its parent was: under -P it must
    not import a `colora` from its working directory (on the GPU host that folder lacks colora.tasks)."""
    import subprocess
    import sys

    code = "import colora, json; print(json.dumps(colora.python_m('colora.cli')))"
    for flags, want in (([], False), (["-P"], True)):
        out = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, check=True)
        cmd = json.loads(out.stdout)
        assert cmd[0] == sys.executable and cmd[-2:] == ["-m", "colora.cli"]
        assert ("-P" in cmd) == want, (flags, cmd)
