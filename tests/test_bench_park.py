"""`colora bench park`: the trainer's parking timed and checked bit for bit on the CPU (where vLLM has
no sleep mode, which the report says); on a GPU the engine's sleep and the CUDA checkpoint API too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from colora.bench.park import restore_check
from colora.cli import main

SMOKE = str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")


def test_bench_park_on_the_cpu_times_the_trainer_and_says_the_engine_cannot_sleep(tmp_path, tiny_model_dir):
    out = tmp_path / "park"
    assert main(["bench", "park", SMOKE, "--set", f'experiment.model="{tiny_model_dir}"', "--set",
                 "experiment.device=cpu", "--rounds", "3", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    t = res["trainer"]
    assert t["bit_exact"] and t["checks"] == [True] * 3
    assert len(t["park_s"]) == len(t["restore_s"]) == 3 and all(x >= 0 for x in t["park_s"] + t["restore_s"])
    # every tensor has its host buffer: base, adapters, gradients and AdamW's state
    assert t["host_bytes"] >= t["state_bytes"] > 0 and t["allocations"] >= t["tensors"]
    assert "no sleep mode" in res["engine"]["unavailable"]
    md = out.with_suffix(".md").read_text()
    assert md.splitlines()[2] == "```" and "colora bench park" in md and "| trainer: host copies made once | 3 |" in md


def test_bench_park_refuses_zero_rounds(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["bench", "park", SMOKE, "--rounds", "0", "--out", str(tmp_path / "p")])
    assert e.value.code == 2


def test_a_restore_passes_within_the_noise_and_fails_when_an_adapter_is_lost():
    rng = np.random.default_rng(0)
    first = rng.normal(-5, 1, (8, 16))
    rows = [0, 2, 4, 6]  # through adapters; the base model's log-probs for them differ by ~0.14
    base = first[rows] + rng.choice([-0.14, 0.14], (4, 16))
    noisy = first + rng.uniform(-0.01, 0.01, first.shape)  # bf16's batch noise, under the tolerance
    assert restore_check(noisy, first, base, rows, 0.02)["ok"]
    shifted = first.copy()
    shifted[1, 3] += 0.5  # a base row moved beyond the noise
    assert not restore_check(shifted, first, base, rows, 0.02)["ok"]
    lost = noisy.copy()
    lost[2] = base[1]  # a wake that serves one adapter's prompts through the base model
    r = restore_check(lost, first, base, rows, 0.02)
    assert not r["ok"] and r["adapter_rows_vs_base"] < restore_check(noisy, first, base, rows, 0.02)["adapter_rows_vs_base"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_park_on_a_gpu_wakes_every_adapter(tmp_path, tiny_model_dir):
    out = tmp_path / "park"
    assert main(["bench", "park", SMOKE, "--set", f'experiment.model="{tiny_model_dir}"', "--set",
                 "engine.enforce_eager=true", "--set", "engine.gpu_memory_utilization=0.2", "--rounds", "2",
                 "--checkpoint-rounds", "1", "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    e = res["engine"]
    assert res["trainer"]["bit_exact"] and res["trainer"]["pinned"]
    assert len(e["noise_samples"]) == 2 and e["noise"] == max(e["noise_samples"])
    assert e["adapter_effect"] > 10 * e["tolerance"]  # the adapters matter, so a lost one would show
    assert e["sleep"]["ok"] and all(c["max_logprob_gap"] <= e["tolerance"] for c in e["sleep"]["checks"])
    assert max(e["sleep"]["freed_bytes"]) > 0
    assert "refused" in e["cuda_checkpoint"] or e["cuda_checkpoint"]["ok"]
