"""Whole runs (colora/run/runner.py) of two sft jobs on the tiny model's trainer, with an engine that
serves no generation (an sft job asks none of it): one job's learning rate is one that
trainer.max_adapter_weight refuses. The run completes with that job stopped; and a run that fails right
after an optimizer step resumes without applying that step's update a second time."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from colora.config import load_config, resolve
from colora.record.runlog import JsonlWriter
from colora.run import fullrun, runner

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"


class NoGenEngine:
    """What a run asks of its engine when its jobs generate nothing: adapters are taken and counted,
    a group's (empty) batch is back at the next poll."""

    dtype = "float32"
    adapter_sync = "disk"
    own_process = False
    warmed = True
    start_seconds = 0.0

    def __init__(self, model_dir, cfg, **kw):
        self.queue, self.loaded = [], {}

    def set_adapters(self, adapters):
        self.loaded.update((a.job, a.version) for a in adapters)
        return 0.0

    def submit(self, key, reqs):
        assert not reqs, "an sft job asks the engine for nothing"
        self.queue.append((key, []))

    def poll(self):
        return [self.queue.pop(0)] if self.queue else []

    def busy(self):
        return bool(self.queue)

    def abort_all(self):
        self.queue.clear()

    def dead(self):
        return ""

    def decode(self, results):
        pass

    def drop(self, job):
        self.loaded.pop(job, None)

    def drop_all(self):
        self.loaded.clear()

    def close(self):
        pass


@pytest.fixture
def chats(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"word {i}"},
                                                     {"role": "assistant", "content": "yes"}]}) + "\n"
                            for i in range(12)))
    return path


def _cfg(tiny_model_dir, chats):
    raw = load_config(SMOKE, [f'experiment.model="{tiny_model_dir}"']).to_dict()
    sft = {**raw["jobs"][0], "kind": "sft", "task": "", "task_options": {}, "data": str(chats), "prompts_per_step": 2,
           "learning_rate": 1e-3}
    raw["jobs"] = [{**sft, "name": "good"}, {**sft, "name": "bad", "learning_rate": 1.0}]
    return resolve(raw, ["experiment.steps=3", "experiment.warmup_steps=0", "experiment.eval_size=0",
                         "trainer.max_adapter_weight=0.5", "runtime.engine_process=off", "runtime.adapter_sync=disk",
                         "runtime.checkpoint_every=1"])


def _adapter(out: Path, job: str) -> dict:
    return load_file(str(out / "adapters" / job / "adapter_model.safetensors"))


def test_a_refused_update_stops_its_job_and_a_failure_after_an_update_resumes_without_it_twice(
        tmp_path, tiny_model_dir, chats, monkeypatch):
    monkeypatch.setattr(fullrun, "RolloutEngine", NoGenEngine)  # what the runner starts for LoRA jobs
    cfg = _cfg(tiny_model_dir, chats)

    whole = runner.run(cfg, tmp_path / "whole", log=lambda s: None)
    good, bad = whole["jobs"]["good"], whole["jobs"]["bad"]
    assert good["status"] == "done" and good["steps"] == good["version"] == 3
    assert bad["status"] == "stopped" and "trainer.max_adapter_weight" in bad["reason"] and bad["steps"] == 0
    status = json.loads((tmp_path / "whole" / "status.json").read_text())
    assert status["state"] == "complete" and status["failed_jobs"] == ["bad"]

    # the same run, its disk full as the second step's train span is written: after the optimizer stepped
    real = JsonlWriter.write
    trains = []

    def full(self, row):
        if row.get("phase") == "train":
            trains.append(row)
            if len(trains) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        real(self, row)

    monkeypatch.setattr(JsonlWriter, "write", full)
    out = tmp_path / "failed"
    with pytest.raises(runner.RunFailed, match="No space left"):
        runner.run(cfg, out, log=lambda s: None)
    monkeypatch.setattr(JsonlWriter, "write", real)
    resumed = runner.resume(out, log=lambda s: None)
    assert resumed["jobs"]["good"]["steps"] == resumed["jobs"]["good"]["version"] == 3
    assert resumed["jobs"]["bad"]["status"] == "stopped"
    mine, want = _adapter(out, "good"), _adapter(tmp_path / "whole", "good")
    for k in want:  # the update of the step that failed was applied once, as in the run that did not fail
        torch.testing.assert_close(mine[k], want[k], atol=1e-6, rtol=1e-5)


def test_a_job_that_never_joins_fails_the_run_and_exports_no_adapter(tmp_path, tiny_model_dir, chats, monkeypatch,
                                                                      capsys):
    """late joins once some job has done 1 step; bad, the only job that starts, stops at its first. The run
    ends with late failed (never joined), no adapters/late of an adapter it never trained, and the exit
    status of a run whose jobs failed."""
    from colora.cli import end_of_run

    monkeypatch.setattr(fullrun, "RolloutEngine", NoGenEngine)  # what the runner starts for LoRA jobs
    d = _cfg(tiny_model_dir, chats).to_dict()
    d["jobs"] = [d["jobs"][1], {**d["jobs"][0], "name": "late", "start_after": 1}]
    out = tmp_path / "run"
    summary = runner.run(resolve(d), out, log=lambda s: None)
    late = summary["jobs"]["late"]
    assert late["status"] == "failed" and late["reason"].startswith("never joined: start_after = 1") and late["steps"] == 0
    assert summary["failed_jobs"] == ["bad", "late"]
    assert (out / "adapters" / "bad").is_dir() and not (out / "adapters" / "late").exists()
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "complete" and status["failed_jobs"] == ["bad", "late"] and "never joined" in status["reason"]
    assert end_of_run(summary, out) == 1 and "late: never joined" in capsys.readouterr().err
