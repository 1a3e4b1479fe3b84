"""The config's own checks (colora/config.py `_check`) that a review found missing: names that become
paths, and the budgets vLLM refuses only as it starts. Each message names the key, the value and what is
accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from colora.config import ConfigError, load_config

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"


def _load(*sets: str):
    return load_config(SMOKE, list(sets))


@pytest.mark.parametrize("name", ["count\n", "count\r\n", "a/b", "../up", "", ".hidden", "x" * 65, "sp ace"])
def test_a_job_name_that_is_no_plain_file_name_is_refused(name):
    """`$` let a trailing newline through ("count\\n" names another adapter directory than "count")."""
    with pytest.raises(ConfigError, match=r"jobs\.0\.name \(.*\) must be 1-64 characters"):
        _load(f"jobs.0.name={name!r}".replace("'", '"'))


@pytest.mark.parametrize("name", ["../../elsewhere", "/abs", "a/b", "two words", "", "x\n"])
def test_an_experiment_name_that_is_no_plain_file_name_is_refused(name):
    """experiment.name makes the default run directory runs/<name>/<arm>-seed<seed>."""
    with pytest.raises(ConfigError, match=r"experiment\.name \(.*\) must be 1-64 characters.*runs/<name>/"):
        _load(f"experiment.name={name!r}".replace("'", '"'))


def test_plain_names_pass():
    cfg = _load('experiment.name="reference8_throughput.v2-1"', 'jobs.0.name="gsm8k.easy-1"')
    assert cfg.experiment.name == "reference8_throughput.v2-1" and cfg.jobs[0].name == "gsm8k.easy-1"


def test_the_eval_budget_must_leave_room_for_the_prompt():
    with pytest.raises(ConfigError, match=r"experiment\.eval_max_new_tokens \(600\) must be below "
                                          r"engine\.max_model_len \(512\)"):
        _load("experiment.eval_max_new_tokens=600")
    assert _load("experiment.eval_max_new_tokens=500").experiment.eval_max_new_tokens == 500


@pytest.mark.parametrize("sets, message", [
    (["engine.max_num_seqs=300", "engine.max_num_batched_tokens=256"],
     r"engine\.max_num_batched_tokens \(256\) must be at least engine\.max_num_seqs \(300\), as vLLM requires"),
    (["engine.max_num_batched_tokens=512"],  # vLLM's default max_num_seqs is 1024 on an H200
     r"engine\.max_num_batched_tokens \(512\) must be at least engine\.max_num_seqs, whose vLLM default .* up to "
     r"1024: set engine\.max_num_seqs to at most 512 too"),
    (["engine.max_num_seqs=5000"],  # vLLM's default max_num_batched_tokens is 4096 on the CPU
     r"engine\.max_num_seqs \(5000\) must be at most engine\.max_num_batched_tokens, .* as low as 4096: set "
     r"engine\.max_num_batched_tokens to at least 5000 too"),
])
def test_scheduler_budgets_vllm_would_refuse(sets, message):
    with pytest.raises(ConfigError, match=message):
        _load(*sets)


@pytest.mark.parametrize("sets", [
    [], ["engine.max_num_seqs=256"], ["engine.max_num_batched_tokens=2048"],
    ["engine.max_num_seqs=64", "engine.max_num_batched_tokens=64"],
])
def test_scheduler_budgets_vllm_takes(sets):
    _load(*sets)


THROUGHPUT = SMOKE.parent / "reference8_throughput.toml"


@pytest.mark.parametrize("value", ["gsm,countdown", '["gsm", "countdown"]', " gsm , countdown "])
def test_jobs_override_keeps_the_jobs_named_in_that_order(value):
    cfg = load_config(THROUGHPUT, [f"jobs={value}"])
    assert [j.name for j in cfg.jobs] == ["gsm", "countdown"]
    assert cfg.jobs[1].task == "countdown" and cfg.jobs[1].lora_rank == 16  # the job whole, defaults merged
    reordered = load_config(THROUGHPUT, ["jobs=reverse,gsm", "jobs.0.lora_rank=8"])  # later keys see the new order
    assert [(j.name, j.lora_rank) for j in reordered.jobs] == [("reverse", 8), ("gsm", 16)]


@pytest.mark.parametrize("value, message", [
    ("gsm,nobody", r"no job named 'nobody'; jobs are: gsm, countdown, modular"),
    ("gsm,gsm", r"'gsm' is named more than once"),
    ("[]", r"takes a list of job names"),
    ("3", r"takes a list of job names.*\(got 3\)"),
    ("gsm,,countdown", r"takes a list of job names"),
])
def test_a_bad_jobs_override_names_what_is_wrong(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(THROUGHPUT, [f"jobs={value}"])


@pytest.mark.parametrize("value", ["2.5", "0", "-1"])
def test_a_temperature_vllm_refuses_is_refused_before_anything_starts(value):
    """vLLM's SamplingParams refuses a temperature above 2 in the engine's process, where the refusal
    failed every job's batch of the step, on every resume."""
    with pytest.raises(ConfigError, match=r"jobs\.0\.temperature \(\S+\) must be above 0 and at most 2"):
        _load(f"jobs.0.temperature={value}")


def test_the_largest_temperature_vllm_takes_passes():
    assert _load("jobs.0.temperature=2.0").jobs[0].temperature == 2.0


# -- a job that joins later must be able to join ------------------------------------------------------
@pytest.mark.parametrize("sets, message", [
    # at 24 steps the jobs that start at once do at most 24, so 24 is never reached
    (["experiment.steps=24", "jobs.1.start_after=24"], r"jobs\.1\.start_after \(24\) must be below 24, the most steps"),
    (["jobs.1.start_after=5", "jobs.0.steps=5"], r"jobs\.1\.start_after \(5\) must be below 5, the most steps"),
    # no job starts at once: none ever reaches any step
    (["jobs.*.start_after=1"], r"jobs\.0\.start_after \(1\) must be below 0, the most steps"),
])
def test_a_start_after_no_job_reaches_is_refused(sets, message):
    with pytest.raises(ConfigError, match=message):
        _load(*sets)


def test_a_start_after_that_a_job_joining_before_reaches_passes():
    """count starts with 5 steps; mod joins at 4 and does 24, so a third job may join at 20."""
    from colora.config import resolve

    d = _load("experiment.steps=24", "jobs.0.steps=5", "jobs.1.start_after=4").to_dict()
    d["jobs"].append({**d["jobs"][0], "name": "late", "steps": 0, "start_after": 20})
    assert resolve(d).jobs[2].start_after == 20
    d["jobs"][2]["start_after"] = 24
    with pytest.raises(ConfigError, match=r"jobs\.2\.start_after \(24\) must be below 24"):
        resolve(d)


def test_start_after_is_not_checked_where_every_job_runs_alone():
    assert _load("experiment.arm=dedicated", "jobs.1.start_after=30").jobs[1].start_after == 30


def test_in_the_time_slicing_arm_a_job_joins_only_its_tenants_jobs():
    """Each tenant runs its own jobs: one alone in its tenant (tenant_jobs = 1) never joins anything."""
    with pytest.raises(ConfigError, match=r"jobs\.1\.start_after \(3\) must be below 0, the most steps .*tenant"):
        _load("experiment.arm=timeslice", "jobs.1.start_after=3")
    assert _load("experiment.arm=timeslice", "timeslice.tenant_jobs=2", "jobs.1.start_after=3").jobs[1].start_after == 3


def test_a_time_sliced_run_that_parks_nothing_needs_its_memory_set():
    """With park = never every tenant stays resident: planning each against the whole card would oversubscribe it."""
    from colora.timeslice.arm import tenant_config

    cfg = _load("experiment.arm=timeslice", "timeslice.park=never", "engine.gpu_memory_utilization=0")
    with pytest.raises(ConfigError, match=r"timeslice.park = \"never\".*set engine.gpu_memory_utilization and "
                                          r"trainer.micro_batch_tokens"):
        tenant_config(cfg, [cfg.jobs[0].name], 2)
    got = tenant_config(_load("experiment.arm=timeslice", "timeslice.park=never", "engine.gpu_memory_utilization=0.3"),
                        [cfg.jobs[0].name], 2)
    assert got.engine.gpu_memory_utilization == pytest.approx(0.15)
    lazy = tenant_config(_load("experiment.arm=timeslice", "timeslice.park=lazy", "engine.gpu_memory_utilization=0"),
                         [cfg.jobs[0].name], 2)
    assert lazy.engine.gpu_memory_utilization == 0  # planned per tenant, against the card its grant frees
