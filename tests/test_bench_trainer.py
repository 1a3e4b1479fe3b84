"""`colora bench trainer` as a program: its implementations' flags are checked, and a CPU smoke run
(tiny model, Triton's interpreter) measures every implementation it is given without failing."""

from __future__ import annotations

import json
import re

import pytest

from colora.bench import trainer as bench_trainer


def test_an_unknown_implementation_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench_trainer.main(["--device", "cpu", "--impls", "triton+nrom"])
    assert e.value.code == 2 and "--impls triton+nrom" in capsys.readouterr().err


def test_cpu_smoke_run_of_the_fused_trainer_with_the_elementwise_kernels(tiny_model_dir, tmp_path, monkeypatch):
    import colora.kernels.rmsnorm as rk

    calls = []
    real = rk._RMSNorm.apply
    monkeypatch.setattr(rk._RMSNorm, "apply", lambda *a: calls.append(1) or real(*a))
    out = tmp_path / "trainer_step"
    argv = ["--device", "cpu", "--model", str(tiny_model_dir), "--jobs", "2", "--seqs", "2", "--prompt", "5",
            "--completion", "6", "--repeats", "1", "--micro-batch-tokens", "24", "--out", str(out),
            "--impls", "triton+packed+fused", "torch"]
    assert bench_trainer.main(argv) == 0
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert [r["impl"] for r in results] == ["colora (triton, packed q/k/v and gate/up, fused elementwise)",
                                            "colora (torch)"]
    assert all(r.get("seconds", 0) > 0 for r in results), results
    assert "fused elementwise" in out.with_suffix(".md").read_text() and calls  # the kernels did run


def test_cpu_profiles_name_the_ops_and_the_code_that_ran_them(tiny_model_dir, tmp_path):
    out = tmp_path / "trainer_step"
    argv = ["--device", "cpu", "--model", str(tiny_model_dir), "--jobs", "2", "--seqs", "2", "--prompt", "5",
            "--completion", "6", "--repeats", "1", "--micro-batch-tokens", "24", "--out", str(out),
            "--impls", "torch", "--profile", "--profile-sources"]
    assert bench_trainer.main(argv) == 0
    result = json.loads(out.with_suffix(".json").read_text())["results"][0]
    assert result["profile"]["host_ops"] > 0
    sources = (tmp_path / "trainer_step.sources.txt").read_text()
    assert "by caller" in sources and "by input shapes" in sources
    by_caller = sources.split("by caller")[1].split("by input shapes")[0]
    assert "trainer.py" in by_caller and "aten::mm" in by_caller  # a stack into colora's trainer, an op under it
    # the two decoder layers' ops share rows: module instances are not told apart
    assert "nn.Module: Qwen3DecoderLayer" in by_caller
    assert re.search(r"nn\.Module: \w+_\d+", by_caller) is None
