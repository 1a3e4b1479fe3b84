"""`colora bench park`: the trainer's parking timed and checked bit for bit on the CPU (where vLLM has
no sleep mode, which the report says); the engine's checks on a stand-in engine whose noise and lost
adapters are chosen; on a GPU the engine's sleep and the CUDA checkpoint API too."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from colora.bench import park
from colora.bench.park import LOGPROB_TOL, engine_cases, restore_check, to_markdown
from colora.cli import main
from colora.config import load_config

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
    kept = restore_check(noisy, first, base, rows, 0.02)
    assert kept["ok"] and kept["logprobs_ok"] and kept["adapters_kept"]
    assert kept["adapter_rows_vs_base"] == pytest.approx(0.14, abs=0.01)
    shifted = first.copy()
    shifted[1, 3] += 0.5  # a base row moved beyond the noise; the adapters are all there
    r = restore_check(shifted, first, base, rows, 0.02)
    assert not r["ok"] and not r["logprobs_ok"] and r["adapters_kept"]
    lost = noisy.copy()
    lost[rows] = base  # a wake that serves every adapter's prompts through the base model
    r = restore_check(lost, first, base, rows, 0.02)
    assert not r["ok"] and not r["adapters_kept"] and r["adapter_rows_vs_base"] == 0.0


class _Tokenizer:
    all_special_ids = [0]

    def __len__(self) -> int:
        return 500


class _Engine:
    """A stand-in for RolloutEngine: each prompt's log-probs a fixed function of its tokens, an adapter
    moving every one by 0.14 (up or down by position), and each decode adding noise of at most 5e-3, as
    bf16's batches do. `adapters_lost` serves the adapters' prompts through the base model."""

    start_seconds = 0.0

    def __init__(self, *args, seed: int, **kwargs):
        self.rng = np.random.default_rng(seed)
        self.tokenizer, self.llm, self._procs = _Tokenizer(), None, [SimpleNamespace(pid=1)]
        self.adapters, self.adapters_lost = set(), False

    def set_adapter(self, name: str, slot: int, path: str) -> None:
        self.adapters.add(name)

    def generate(self, reqs):
        out = []
        for r in reqs:
            lp = -1.0 - np.array(r.prompt_ids[1:]) % 7 / 7  # [prompt - 1]
            if r.job is not None and not self.adapters_lost:
                assert r.job in self.adapters
                lp = lp + np.where(np.arange(lp.size) % 2, 0.14, -0.14)
            lp = lp + self.rng.uniform(-5e-3, 5e-3, lp.size)
            out.append(SimpleNamespace(prompt_logprobs=[None, *lp.tolist()]))
        return out

    def close(self) -> None:
        pass


class _Parker:
    """Parks nothing; the `lose_at`-th restore (1-based) loses the engine's adapters."""

    def __init__(self, engine: _Engine, lose_at: int | None):
        self.engine, self.lose_at, self.restores = engine, lose_at, 0
        self.pids, self.without_cuda = [p.pid for p in engine._procs], []

    def park(self):
        return SimpleNamespace(seconds=0.0, bytes=0)

    def restore(self):
        self.restores += 1
        if self.restores == self.lose_at:
            self.engine.adapters_lost = True
        return SimpleNamespace(seconds=0.0, bytes=0)


def _engine_cases(monkeypatch, tmp_path, rounds: int, ck_rounds: int, lose_at: int | None) -> dict:
    """engine_cases on the stand-in engine; the sleep parker loses the adapters at its `lose_at`-th wake."""
    cfg = load_config(SMOKE)
    engines = []

    def engine(*args, **kwargs):
        engines.append(_Engine(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(park, "_adapters", lambda cfg, *a: {j.name: tmp_path / j.name for j in cfg.jobs})
    monkeypatch.setattr(park, "RolloutEngine", engine)
    monkeypatch.setattr(park, "EngineParker", lambda llm, level: _Parker(engines[-1], lose_at))
    monkeypatch.setattr(park, "CudaCheckpointParker", lambda pids: _Parker(engines[-1], None))
    return engine_cases(cfg, tmp_path, "cpu", "float32", rounds, ck_rounds, tmp_path)


def test_the_engine_noise_is_sampled_once_per_round_and_every_wake_keeps_the_adapters(monkeypatch, tmp_path):
    e = _engine_cases(monkeypatch, tmp_path, rounds=4, ck_rounds=2, lose_at=None)
    assert len(e["noise_samples"]) == 4 and e["noise"] == max(e["noise_samples"]) > 0
    assert e["tolerance"] == e["noise"] + LOGPROB_TOL and e["adapter_effect"] == pytest.approx(0.14, abs=0.01)
    assert e["sleep"]["ok"] and len(e["sleep"]["checks"]) == 4
    assert e["cuda_checkpoint"]["ok"] and len(e["cuda_checkpoint"]["checks"]) == 2
    for c in e["sleep"]["checks"] + e["cuda_checkpoint"]["checks"]:
        assert c["logprobs_ok"] and c["adapters_kept"]
        assert abs(c["adapter_rows_vs_base"] - e["adapter_effect"]) <= e["tolerance"]
    # as many control decodes as the ways' most rounds
    assert len(_engine_cases(monkeypatch, tmp_path, rounds=1, ck_rounds=3, lose_at=None)["noise_samples"]) == 3


def test_a_wake_that_drops_the_adapters_fails_its_check(monkeypatch, tmp_path):
    e = _engine_cases(monkeypatch, tmp_path, rounds=3, ck_rounds=1, lose_at=2)
    first, lost, later = e["sleep"]["checks"]
    assert first["ok"] and not e["sleep"]["ok"]
    for c in (lost, later):
        assert not c["ok"] and not c["adapters_kept"] and c["adapter_rows_vs_base"] < 0.01 < e["adapter_effect"]
    res = {"command": "colora bench park smoke.toml", "model": "tiny", "dtype": "float32", "jobs": ["a", "b"],
           "environment": {"device": "cpu", "torch": "t", "vllm": "v", "date": "d"},
           "trainer": {"park_s": [0.0], "restore_s": [0.0], "freed_bytes": [0], "checks": [True], "park_median_s": 0.0,
                       "restore_median_s": 0.0, "bit_exact": True, "tensors": 1, "state_bytes": 0, "host_bytes": 0,
                       "pinned": False, "allocations": 1}, "engine": e}
    md = to_markdown(res)
    assert "| engine: vLLM sleep level 1, wake weights then KV | 3 |" in md and "FAILED" in md and "adapters lost" in md
    assert "of 3 decodes with no park between" in md


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
    assert all(c["adapters_kept"] for c in e["sleep"]["checks"])
    assert max(e["sleep"]["freed_bytes"]) > 0
    assert "refused" in e["cuda_checkpoint"] or e["cuda_checkpoint"]["ok"]
