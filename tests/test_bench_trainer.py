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
    md = out.with_suffix(".md").read_text()
    assert "fused elementwise" in md and calls  # the kernels did run
    assert "| MFU |" in md and "peak is not known" in md and not any("mfu" in r for r in results)  # a CPU has none


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


def test_mfu_is_four_times_the_matmul_weights_a_token_over_the_cards_bf16_peak():
    """Qwen3-4B's shape: 36 layers of q/k/v/o and gate/up/down projections plus the (tied) LM head, counted
    four times a token; the card's peak found by its name, none for a card not in the table."""
    from colora.models.qwen3_shapes import QWEN3_SHAPES, shape_of

    layer = 2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 3 * 2560 * 9728
    weights = 36 * layer + 151936 * 2560
    assert bench_trainer.step_flops(shape_of(QWEN3_SHAPES["qwen3-4b-shape"]), 1000) == 4 * weights * 1000
    assert bench_trainer.peak_flops("NVIDIA H200") == bench_trainer.peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert bench_trainer.peak_flops("NVIDIA H100 PCIe") == 756.5e12
    assert bench_trainer.peak_flops("cpu") is None and bench_trainer.peak_flops("NVIDIA A100-SXM4-80GB") is None
