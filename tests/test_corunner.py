"""The co-runner's adapter shipping and its train spans, with fakes for the engine, the adapter bank and
the trainer (no vLLM)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from colora.config import load_config
from colora.corunner import CoRunner, EngineFailure, JobState
from colora.engine import GenRequest, GenResult
from colora.runlog import JsonlWriter, Timeline
from colora.trainer import JobStepStats

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"


class FakeEngine:
    dtype = "bfloat16"

    def __init__(self, runner_ref: list):
        self.ref = runner_ref
        self.why = ""
        self.loads = []

    def set_adapter(self, job, version, path):
        assert self.ref[0]._ship_lock.locked(), "an adapter was loaded outside `shipping`"
        self.loads.append((job, version, path))
        return 0.0

    def dead(self):
        return self.why

    def decode(self, results):
        pass


class FakeBank:
    def __init__(self, runner_ref: list):
        self.ref = runner_ref
        self.exports = []

    def export_peft(self, name, out_dir, base_model, dtype):
        assert self.ref[0]._ship_lock.locked(), "an adapter was exported outside `shipping`"
        self.exports.append((name, dtype))
        return Path(out_dir)


def _corunner(tmp_path):
    cfg = load_config(SMOKE)
    ref: list = []
    engine, bank = FakeEngine(ref), FakeBank(ref)
    jobs = {j.name: JobState(j, task=None) for j in cfg.jobs}
    c = CoRunner(cfg, engine, trainer=None, bank=bank, tokenizer=None, jobs=jobs, timeline=Timeline(),
                 metrics=JsonlWriter(tmp_path / "metrics.jsonl"), adapter_root=tmp_path, base_model="base",
                 log=lambda m: None)
    ref.append(c)
    return c, engine, bank


def test_export_and_reload_each_hold_the_shipping_lock(tmp_path):
    import torch

    c, engine, bank = _corunner(tmp_path)
    names = list(c.jobs)
    c.export_adapters([(c.jobs[n], 1) for n in names], group=0, groups=[0])
    assert bank.exports == [(n, torch.bfloat16) for n in names]  # in the engine's dtype
    assert all(c.jobs[n].pending == (1, tmp_path / n / "v1") for n in names)
    c.load_pending(names, group=0)
    assert [(j, v) for j, v, _ in engine.loads] == [(n, 1) for n in names]
    assert all(c.jobs[n].pending is None for n in names)
    assert [s["phase"] for s in c.timeline.spans] == ["export", "reload"]


def test_shipping_is_one_at_a_time_and_gives_up_when_the_engine_dies(tmp_path):
    c, engine, _ = _corunner(tmp_path)
    inside, release = threading.Event(), threading.Event()
    times = {}

    def holder():
        with c.shipping():
            inside.set()
            release.wait()
            times["released"] = time.perf_counter()

    t = threading.Thread(target=holder)
    t.start()
    inside.wait()
    threading.Timer(0.3, release.set).start()
    with c.shipping():
        times["entered"] = time.perf_counter()
    t.join()
    assert times["entered"] >= times["released"]

    # a holder that never lets go (an engine thread stuck in a dead engine): the waiter gives up
    hung = threading.Event()
    threading.Thread(target=lambda: (c._ship_lock.acquire(), hung.set()), daemon=True).start()
    hung.wait()
    engine.why = "engine process 123 died"
    with pytest.raises(EngineFailure, match="123 died"):
        with c.shipping():
            pass


class CompilingTrainer:
    """A trainer whose steps run a torch.compile'd function: the first step compiles it."""

    def __init__(self):
        import torch

        def scale(x):
            return x * 2 + 1

        self.fn = torch.compile(scale, backend="eager")  # fresh: compiled at its first call
        self.steps = 0

    def step(self, rollouts):
        import torch

        self.fn(torch.ones(4))
        self.steps += 1
        return {name: JobStepStats(0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1, len(rs), self.steps)
                for name, rs in rollouts.items()}


def _ready(c) -> list:
    """One group's finished rollouts for every job, as the engine thread hands them over."""
    by_job = {}
    for name, js in c.jobs.items():
        jc = js.cfg
        items = [SimpleNamespace(id=p) for p in range(jc.prompts_per_step)]
        results = [GenResult(GenRequest(name, (1, 2), 4, 1.0, tag=(p, s)), 0, [3, 4], [-0.5, -0.5], "", "stop")
                   for p in range(jc.prompts_per_step) for s in range(jc.samples_per_prompt)]
        by_job[name] = (items, results)
    return [(0, by_job, 1.0)]


def test_a_train_span_names_what_compiled_in_its_step_and_only_then(tmp_path):
    c, _, _ = _corunner(tmp_path)
    c.trainer = CompilingTrainer()
    for js in c.jobs.values():
        js.task = SimpleNamespace(reward=lambda text, item: float(item.id % 2))
    c.train_task(_ready(c), "step 1/3")
    c.train_task(_ready(c), "step 2/3")  # the same shapes: nothing to compile
    train = [s for s in c.timeline.spans if s["phase"] == "train"]
    assert [s.get("compiles") for s in train] == [{"dynamo": 1}, None]
    assert all(js.step == 2 for js in c.jobs.values())


def test_groups_are_balanced_by_the_tokens_of_each_jobs_actual_requests(tmp_path, monkeypatch):
    """Four jobs whose configured maxima are equal but whose drawn response lengths are not: the
    groups balance the tokens the jobs will actually ask for, prompts included."""
    from colora.config import resolve
    from colora.corunner import request_tokens, split_groups
    from colora.tasks import get_task

    cfg = load_config(SMOKE, ["experiment.arm=overlap", "overlap.groups=2"])
    d = cfg.to_dict()
    lengths = {"a": 200, "b": 60, "c": 50, "d": 40}  # fixed lengths, max_new_tokens 256 for all
    d["jobs"] = [{**d["jobs"][0], "name": n, "max_new_tokens": 256,
                  "response_length": {"dist": "lognormal", "median": m, "sigma": 0.01, "min": 1}}
                 for n, m in lengths.items()]
    cfg = resolve(d)

    class Tok:
        def apply_chat_template(self, msgs, **k):
            return msgs[-1]["content"]

        def __call__(self, text, add_special_tokens=False):
            return SimpleNamespace(input_ids=list(range(len(text.split()))))

    jobs = {j.name: JobState(j, task=get_task(j.task, **dict(j.task_options))) for j in cfg.jobs}
    c = CoRunner(cfg, FakeEngine([]), trainer=None, bank=None, tokenizer=Tok(), jobs=jobs, timeline=Timeline(),
                 metrics=JsonlWriter(tmp_path / "metrics.jsonl"), adapter_root=tmp_path, base_model="base",
                 log=lambda m: None)
    seen = []
    monkeypatch.setattr(c, "run_groups", lambda groups: seen.append([list(g) for g in groups]))
    c.run()
    tokens = {n: request_tokens(c.step_requests(jobs[n], 0)[1]) for n in jobs}
    assert tokens["b"] + tokens["c"] + tokens["d"] < tokens["a"]  # a alone outweighs the other three
    assert seen == [split_groups(list(jobs), 2, tokens)] and sorted(map(sorted, seen[0])) == [["a"], ["b", "c", "d"]]
    # by configured maxima alone (all equal) the split would have paired them by name instead
    assert sorted(map(sorted, split_groups(list(jobs), 2))) == [["a", "c"], ["b", "d"]]
