"""The co-runner's adapter shipping, its train spans and its warning about a job whose rewards never
vary, with fakes for the engine, the adapter bank and the trainer (no vLLM)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from colora.config import load_config
from colora.corun.corunner import CoRunner, Schedule
from colora.corun.handoff import EngineFailure, Generated
from colora.corun.trainer_side import JobState
from colora.engine.adapters import AdapterDir
from colora.engine.rollout import GenRequest, GenResult
from colora.record.runlog import JsonlWriter, Timeline
from colora.training.export import AdapterExport
from colora.training.trainer import JobStepStats

SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"


class FakeEngine:
    dtype = "bfloat16"
    model_dir = "base"
    def __init__(self, runner_ref: list):
        self.ref = runner_ref
        self.why = ""
        self.loads, self.calls = [], 0

    def set_adapters(self, adapters):
        assert self.ref[0].shipping.lock.locked(), "an adapter was loaded outside `shipping`"
        self.loads += [(a.job, a.version, a) for a in adapters]
        self.calls += 1
        return 0.0

    def dead(self):
        return self.why

    def decode(self, results):
        pass


class FakeBank:
    """Exports record their job and dtype; each job's version is its trainer's (VersionTrainer's) or
    one set by hand."""

    def __init__(self, runner_ref: list):
        self.ref = runner_ref
        self.exports = []
        self.versions: dict[str, int] = {}

    @property
    def jobs(self):
        trainer = getattr(self.ref[0].trainer_side, "trainer", None) if self.ref else None
        known = {**getattr(trainer, "version", {}), **self.versions}
        return {n: SimpleNamespace(version=known.get(n, 0)) for n in self.ref[0].jobs}

    def export_peft(self, name, out_dir, base_model, dtype, fold_scale=False):
        assert self.ref[0].shipping.lock.locked(), "an adapter was exported outside `shipping`"
        assert fold_scale, "the engine's copies carry the LoRA scale in B (vLLM's loads skip a multiply per module)"
        self.exports.append((name, dtype))
        return Path(out_dir)

    def job_state(self, name):  # what a failed step keeps of each job (CoRunner.keep_failed_step)
        return {"job": name}


def _corunner(tmp_path):
    cfg = load_config(SMOKE)
    ref: list = []
    engine, bank = FakeEngine(ref), FakeBank(ref)
    jobs = {j.name: JobState(j, task=None) for j in cfg.jobs}
    c = CoRunner(Schedule.of(cfg), engine, trainer=None, bank=bank,
                 export=AdapterExport("disk", engine.dtype, engine.model_dir, tmp_path), tokenizer=None, jobs=jobs,
                 timeline=Timeline(), metrics=JsonlWriter(tmp_path / "metrics.jsonl"), log=lambda m: None)
    ref.append(c)
    return c, engine, bank


def test_export_and_reload_each_hold_the_shipping_lock(tmp_path):
    import torch

    c, engine, bank = _corunner(tmp_path)
    names = list(c.jobs)
    bank.versions = {n: 1 for n in names}
    c.trainer_side.export_adapters([c.jobs[n] for n in names], group=0, groups=[0])
    assert bank.exports == [(n, torch.bfloat16) for n in names]  # in the engine's dtype
    assert all(c.jobs[n].pending == AdapterDir(n, 1, str(tmp_path / n / "v1")) for n in names)
    c.engine_side.load(list(c.trainer_side.take_pending(names)), group=0)
    assert [(j, v) for j, v, _ in engine.loads] == [(n, 1) for n in names]
    assert engine.calls == 1, "a group's versions go to the engine in one call"
    assert all(c.jobs[n].pending is None for n in names)
    assert [s["phase"] for s in c.timeline.spans] == ["export", "reload"]
    for s in c.timeline.spans:  # each span times every adapter version it moved
        assert set(s["adapter_seconds"]) == {f"{n}@v1" for n in names}
        assert all(secs >= 0 for secs in s["adapter_seconds"].values())


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
    threading.Thread(target=lambda: (c.shipping.lock.acquire(), hung.set()), daemon=True).start()
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

    def step(self, rollouts, sft=None):
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
    return [Generated(0, by_job, 1.0)]


def test_a_train_span_names_what_compiled_in_its_step_and_only_then(tmp_path):
    c, _, _ = _corunner(tmp_path)
    c.trainer_side.trainer = CompilingTrainer()
    for js in c.jobs.values():
        js.task = SimpleNamespace(reward=lambda text, item: float(item.id % 2))
    c.trainer_side.train(_ready(c), "step 1/3")
    c.trainer_side.train(_ready(c), "step 2/3")  # the same shapes: nothing to compile
    train = [s for s in c.timeline.spans if s["phase"] == "train"]
    assert [s.get("compiles") for s in train] == [{"dynamo": 1}, None]
    assert all(js.step == 2 for js in c.jobs.values())


def test_groups_are_balanced_by_the_tokens_of_each_jobs_actual_requests(tmp_path, monkeypatch):
    """Four jobs whose configured maxima are equal but whose drawn response lengths are not: the
    groups balance the tokens the jobs will actually ask for, prompts included."""
    from colora.tasks import get_task

    from colora.config import resolve
    from colora.corun.grouping import request_tokens, split_groups

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
    c = CoRunner(Schedule.of(cfg), FakeEngine([]), trainer=None, bank=None,
                 export=AdapterExport("disk", "bfloat16", "base", tmp_path), tokenizer=Tok(), jobs=jobs,
                 timeline=Timeline(), metrics=JsonlWriter(tmp_path / "metrics.jsonl"), log=lambda m: None)
    seen = []
    monkeypatch.setattr(c, "run_groups", lambda groups: seen.append([list(g) for g in groups]))
    c.run()
    tokens = {n: request_tokens(c.engine_side.requests(n, 0)[1]) for n in jobs}
    assert tokens["b"] + tokens["c"] + tokens["d"] < tokens["a"]  # a alone outweighs the other three
    assert seen == [split_groups(list(jobs), 2, tokens)] and sorted(map(sorted, seen[0])) == [["a"], ["b", "c", "d"]]
    # by configured maxima alone (all equal) the split would have paired them by name instead
    assert sorted(map(sorted, split_groups(list(jobs), 2))) == [["a", "c"], ["b", "d"]]


class LoopEngine:
    """An engine for `run_groups`: each poll completes the oldest submitted batch, every rollout
    tagged with the adapter version loaded for its job, each job's completions of a set length."""

    dtype = "bfloat16"
    model_dir = "base"

    def __init__(self, lengths: dict[str, int]):
        self.lengths, self.loaded, self.queue = lengths, {}, []

    def set_adapters(self, adapters):
        for a in adapters:
            self.loaded[a.job] = a.version
        return 0.0

    def submit(self, key, reqs):
        self.queue.append((key, [GenResult(r, self.loaded.get(r.job, 0), [3] * self.lengths[r.job], [], "", "stop")
                                 for r in reqs]))

    def poll(self):
        time.sleep(0.002)
        return [self.queue.pop(0)] if self.queue else []

    def busy(self):
        return bool(self.queue)

    def abort_all(self):
        keys = [k for k, _ in self.queue]
        self.queue.clear()
        return keys

    def dead(self):
        return ""

    def decode(self, results):
        pass

    def drop(self, job):
        pass


class VersionTrainer:
    """Steps every job it is given and refuses a rollout not from the job's current version."""

    def __init__(self):
        self.version: dict[str, int] = {}

    def step(self, rollouts, sft=None):
        out = {}
        for name, rs in rollouts.items():
            v = self.version.get(name, 0)
            assert {r.version for r in rs} == {v}, f"{name}: stale rollout (versions {sorted({r.version for r in rs})}, current {v})"
            self.version[name] = v + 1
            out[name] = JobStepStats(0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1, len(rs), v + 1)
        return out


class ThreeTokens:
    """A tokenizer for which every prompt is three tokens."""

    def apply_chat_template(self, msgs, **kw):
        return "x"

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[1, 2, 3])


def _loop_runner(tmp_path, overrides: list[str], lengths: dict[str, int], engine_cls=None, trainer_cls=None) -> CoRunner:
    """A co-runner over the smoke config's first job copied as the jobs of `lengths` (natural EOS,
    completions of those lengths), with LoopEngine, VersionTrainer (or the given subclasses) and a
    three-token tokenizer."""
    from colora.config import resolve

    d = load_config(SMOKE).to_dict()
    d["jobs"] = [{**d["jobs"][0], "name": n, "response_length": {"dist": "natural"}} for n in lengths]
    cfg = resolve(d, overrides)  # after the jobs: overlap.groups must fit their number
    task = SimpleNamespace(
        sample=lambda n, seed, split: [SimpleNamespace(id=i, messages=({"role": "user", "content": "x"},)) for i in range(n)],
        reward=lambda text, item: float(item.id % 2))
    ref: list = []
    c = CoRunner(Schedule.of(cfg), (engine_cls or LoopEngine)(lengths), (trainer_cls or VersionTrainer)(), FakeBank(ref),
                 AdapterExport("disk", "bfloat16", "base", tmp_path), ThreeTokens(),
                 {j.name: JobState(j, task) for j in cfg.jobs}, Timeline(), JsonlWriter(tmp_path / "metrics.jsonl"),
                 log=lambda m: None)
    ref.append(c)
    return c


def test_groups_move_jobs_on_measured_tokens_and_every_rollout_stays_on_policy(tmp_path):
    """Four jobs that look alike before they run (natural EOS, one max_new_tokens), so the first split
    pairs them by name, a with c: the two that turn out to write long answers. After the warm-up the
    run swaps c and d, each right after its own group's step, and no rollout is ever stale. (A job
    that ends its steps before the others makes the run plan again: where one group is a step ahead,
    the last steps may move a job once more, so the swap is read from the steps before any job ended.)"""
    from colora.record.runlog import read_jsonl

    c = _loop_runner(tmp_path, ["experiment.arm=overlap", "overlap.groups=2", "experiment.steps=6",
                                "experiment.warmup_steps=1"], {"a": 200, "b": 40, "c": 180, "d": 40})
    window = c.run()
    c.metrics.close()
    assert "a" in window["groups"][0] and "c" in window["groups"][1] and "c" not in window["groups"][0]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    [event] = [r for r in rows if r.get("event") == "regroup"]
    assert event["planned_moves"] == ["c", "d"] and event["loads"][0] > 4 * event["loads"][1]
    steps = {n: [r for r in rows if r.get("job") == n and r.get("status") == "ok"] for n in "abcd"}
    assert all(len(v) == 6 for v in steps.values())  # every job did every step
    for n, first, last in (("c", 0, 1), ("d", 1, 0)):
        seen = [r["group"] for r in steps[n][:5]]  # every job's steps before the first job ended
        assert seen[0] == first and seen[-1] == last and seen.count(first) + seen.count(last) == 5
        assert seen == [first] * seen.count(first) + [last] * seen.count(last)  # moved once
    assert all(r["rollout_versions"] == [r["step"]] for v in steps.values() for r in v)  # on-policy


def test_four_groups_of_eight_jobs_run_every_step_on_policy(tmp_path):
    """`overlap.groups=4` on 8 alike jobs, the sweep the H200 benchmark has next: four groups of two,
    each job in one group, every job does every step, and every rollout is from its job's current
    adapter version (the trainer refuses any other)."""
    from colora.record.runlog import read_jsonl

    c = _loop_runner(tmp_path, ["experiment.arm=overlap", "overlap.groups=4", "experiment.steps=5",
                                "experiment.warmup_steps=1"], {n: 40 for n in "abcdefgh"})
    window = c.run()
    c.metrics.close()
    assert len(window["groups"]) == 4 and all(len(g) == 2 for g in window["groups"])
    assert sorted(n for g in window["groups"] for n in g) == list("abcdefgh")
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("status") == "ok"]
    assert sorted((r["job"], r["step"]) for r in rows) == [(n, k) for n in "abcdefgh" for k in range(5)]
    assert all(r["rollout_versions"] == [r["step"]] for r in rows)  # on-policy
    assert {r["group"] for r in rows} == {0, 1, 2, 3}


def test_plan_regroup_moves_fewest_jobs_and_only_for_a_real_gain():
    from colora.corun.grouping import plan_regroup

    cost = {"a": 10.0, "b": 1.0, "c": 9.0, "d": 1.0}
    assert plan_regroup([["a", "c"], ["b", "d"]], cost) == {"a": 0, "d": 0, "b": 1, "c": 1}  # 19 / 2 -> 11 / 10
    assert plan_regroup([["a", "d"], ["c", "b"]], cost) is None  # already the best split
    six = {"a": 9.0, "b": 8.0, "c": 5.0, "d": 4.0, "e": 1.0, "f": 1.0}
    for groups in ([["c", "d", "e", "f"], ["a", "b"]], [["a", "b"], ["c", "d", "e", "f"]]):  # 11 / 17 -> 14 / 14
        plan = plan_regroup(groups, six)
        assert sorted(sorted(j for j in plan if plan[j] == g) for g in (0, 1)) == [["a", "d", "e"], ["b", "c", "f"]]
        moved = [j for g, names in enumerate(groups) for j in names if plan[j] != g]
        assert len(moved) == 3  # of 6: the new groups keep the indices that keep most jobs in place
    near = {"a": 10.0, "b": 9.5, "c": 1.0, "d": 0.4}  # [a,c]=11 [b,d]=9.9 -> best [a,d] [b,c] 10.5: 4.5% only
    assert plan_regroup([["a", "c"], ["b", "d"]], near) is None
    assert plan_regroup([["a", "c"], ["b", "d"]], near, min_gain=0.04) == {"a": 0, "d": 0, "b": 1, "c": 1}


GUARD = 10.0  # seconds: a handshake that waits this long is broken, and the test fails naming it


class HandshakeEngine(LoopEngine):
    """LoopEngine whose first adapter load holds (the load of group 0's adapters after its first
    step) until the trainer has shown what it does meanwhile: it either starts its next step
    (HandshakeTrainer sets `go`) or blocks on the co-runner's event for that load (the watched events
    of `_watch_loaded` set `go`). The load then holds until `ack`, so that a step which started
    during it sees it still in progress. No sleeps: the order is forced by events."""

    def __init__(self, lengths: dict[str, int]):
        super().__init__(lengths)
        self.first_load = True
        self.loading = False
        self.load_started, self.go, self.ack = threading.Event(), threading.Event(), threading.Event()
        self.submitted = {0: threading.Event(), 1: threading.Event()}  # group -> its rollouts are queued
        self.timeouts: list[str] = []

    def wait(self, event: threading.Event, what: str) -> None:
        if not event.wait(GUARD):
            self.timeouts.append(what)

    def submit(self, key, reqs):
        super().submit(key, reqs)
        self.submitted[key].set()

    def set_adapters(self, adapters):
        first, self.first_load = self.first_load, False
        if first:
            self.loading = True
            self.load_started.set()
            self.wait(self.go, "go: the trainer neither stepped nor waited for the load")
            self.wait(self.ack, "ack")
            self.loading = False
        return super().set_adapters(adapters)


class HandshakeTrainer(VersionTrainer):
    """Its first step (group 0) waits until group 1's first rollouts are queued in the engine, so
    that they come back before group 0's adapters load; its second step (group 1) records whether
    group 0's load was still in progress when it ran."""

    def __init__(self):
        super().__init__()
        self.engine: HandshakeEngine | None = None
        self.calls = 0
        self.during_load: bool | None = None

    def step(self, rollouts, sft=None):
        e, n = self.engine, self.calls
        self.calls += 1
        if n == 0:
            e.wait(e.submitted[1], "group 1's rollouts were never queued")
        elif n == 1:
            e.go.set()
            e.wait(e.load_started, "group 0's adapters never started loading")
            self.during_load = e.loading
            e.ack.set()
        return super().step(rollouts)


def _watch_loaded(c: CoRunner, on_block) -> None:
    """Call on_block() when the trainer starts waiting on one of the co-runner's per-group events
    "this group's adapters are loaded and its rollouts queued" that is not yet set (CoRunner._loaded,
    where reload-first waits)."""

    class Watched(threading.Event):
        def wait(self, timeout=None):
            if not self.is_set():
                on_block()
            return super().wait(timeout)

    class Loaded(dict):
        def __setitem__(self, group, event):
            super().__setitem__(group, Watched())

    assert isinstance(c._loaded, dict) and not c._loaded
    c._loaded = Loaded()


def test_reload_first_keeps_the_trainer_off_while_adapters_load(tmp_path):
    """No training step starts while a group's adapters are loading (on the H200 loads took twice as
    long during training and paused the other group's decoding); every job still does every step
    on-policy. Group 0's first load holds until the trainer has either started that step or blocked
    waiting for the load (events, no timing), so a trainer that does not wait is caught."""
    from colora.record.runlog import read_jsonl

    c = _loop_runner(tmp_path, ["experiment.arm=overlap", "overlap.groups=2", "experiment.steps=5",
                                "experiment.warmup_steps=1"], {n: 40 for n in "abcd"}, HandshakeEngine, HandshakeTrainer)
    c.trainer_side.trainer.engine = c.engine
    _watch_loaded(c, lambda: (c.engine.go.set(), c.engine.ack.set()))
    c.run()
    c.metrics.close()
    assert c.engine.timeouts == []
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("status") == "ok"]
    assert sorted((r["job"], r["step"]) for r in rows) == [(n, k) for n in "abcd" for k in range(5)]
    assert all(r["rollout_versions"] == [r["step"]] for r in rows)  # on-policy
    spans = c.timeline.spans
    loads = [s for s in spans if s["phase"] == "reload"]
    trains = [s for s in spans if s["phase"] == "train"]
    overlapping = [(t, r) for t in trains for r in loads if t["start"] < r["end"] and r["start"] < t["end"]]
    assert len(loads) >= 8 and len(trains) >= 8
    assert c.trainer_side.trainer.during_load is False and not overlapping


def test_the_engine_thread_takes_records_and_every_wait_ends(tmp_path):
    """The engine thread takes Drop and Stop records and ends on Stop; the trainer's wait for the
    engine thread's next record gives up with a Failed once that thread is gone without one."""
    import queue

    from colora.corun.handoff import Drop, Failed, Stop

    c = _loop_runner(tmp_path, ["experiment.arm=shared_sync"], {"a": 4})
    dropped = []
    c.engine.drop = dropped.append
    submit_q, done_q = queue.Queue(), queue.Queue()
    t = threading.Thread(target=c.engine_side.loop, args=(submit_q, done_q))
    t.start()
    submit_q.put(Drop("a"))
    submit_q.put(Stop())
    t.join(timeout=10)
    assert not t.is_alive() and dropped == ["a"] and done_q.empty()
    got = c._next(done_q, t)
    assert isinstance(got, Failed) and "ended without a word" in str(got.error)


class DroppingEngine(LoopEngine):
    """LoopEngine that takes adapters out as vLLM does: a dropped job's requests are refused."""

    def __init__(self, lengths: dict[str, int]):
        super().__init__(lengths)
        self.dropped: list[tuple[str, str]] = []  # (job, thread that dropped it)

    def drop(self, job):
        self.loaded.pop(job, None)
        self.dropped.append((job, threading.current_thread().name))

    def submit(self, key, reqs):
        gone = sorted({r.job for r in reqs} & {j for j, _ in self.dropped})
        if gone:
            raise KeyError(f"job(s) {gone} have no adapter loaded in the engine")
        super().submit(key, reqs)


class FailingTrainer(VersionTrainer):
    """Job b's loss is not finite at its second step; the other jobs train on."""

    def step(self, rollouts, sft=None):
        out = super().step(rollouts)
        if "b" in out and out["b"].version == 2:
            out["b"] = JobStepStats(float("nan"), 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1, 1, 1, failure="loss is not finite")
        return out


def test_a_stopped_jobs_adapter_leaves_the_engine_and_gets_no_more_requests(tmp_path):
    """Job b fails at its second step in a two-group overlap run: it is stopped with its reason, the
    engine thread (which owns the engine) takes its adapter out, no later request of it is queued,
    and the other jobs do every step."""
    from colora.record.runlog import read_jsonl

    c = _loop_runner(tmp_path, ["experiment.arm=overlap", "overlap.groups=2", "experiment.steps=4",
                                "experiment.warmup_steps=1"], {n: 40 for n in "abcd"}, DroppingEngine, FailingTrainer)
    c.run()
    assert c.engine.dropped == [("b", "colora-engine")]
    assert "b" not in c.engine.loaded and c.engine.loaded  # the others' adapters stay
    assert c.jobs["b"].status == "stopped" and c.jobs["b"].reason == "loss is not finite" and c.jobs["b"].step == 1
    assert all(c.jobs[n].status == "done" and c.jobs[n].step == 4 for n in "acd")
    # outside a run (no engine thread) the co-runner drops the adapter itself
    c.trainer_side.stop(c.jobs["a"], "stopped by hand")
    assert c.engine.dropped[-1] == ("a", threading.current_thread().name) and "a" not in c.engine.loaded
    c.metrics.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if r.get("job") == "b" and r.get("status") == "ok"] == [0]
    assert [r["reason"] for r in rows if r.get("event") == "stopped"] == ["loss is not finite", "stopped by hand"]


# -- a job that learns nothing -----------------------------------------------------------------------
def test_a_job_whose_rewards_never_vary_is_warned_about_in_the_output_and_the_summary(tmp_path):
    """The fake task's reward depends on the prompt only: every group's rewards are equal."""
    from colora.record.runlog import read_jsonl
    from colora.record.summary import NO_SIGNAL_STEPS, job_summaries, warnings

    said = []
    c = _loop_runner(tmp_path, [f"experiment.steps={NO_SIGNAL_STEPS + 1}"], {"a": 20})
    c.trainer_side.log = said.append
    c.run()
    c.metrics.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["flat_groups"] for r in rows if r.get("status") == "ok"] == [1.0] * (NO_SIGNAL_STEPS + 1)
    assert sum("warning: job a: every group's rewards were equal for 5 steps in a row" in s for s in said) == 1
    bank = type("Bank", (), {"jobs": {"a": type("J", (), {"version": 6})()}})()
    jobs = job_summaries(c.jobs, bank, rows, {}, {})
    assert jobs["a"].no_signal_steps == jobs["a"].no_signal_streak == NO_SIGNAL_STEPS + 1
    [w] = warnings(jobs)
    assert "job a" in w and "learned nothing" in w and "every one of its 6 steps" in w


def test_no_signal_counts_steps_and_the_longest_run():
    import torch

    from colora.record.summary import JobSummary, no_signal, warnings
    from colora.training.grpo import flat_groups

    assert no_signal([True, False, True, True, True, False]) == (4, 3)
    assert no_signal([]) == (0, 0)
    assert flat_groups(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5], [0.0, 0.0]])) == 0.75

    def job(steps, flat, streak):
        return JobSummary("done", "", steps, steps, 0.5, None, None, flat, streak)

    assert warnings({"a": job(10, 4, 3), "b": job(0, 0, 0)}) == []  # some signal; no steps at all
    [w] = warnings({"c": job(10, 6, 5)})
    assert "5 steps in a row (6 of its 10 steps" in w


# -- jobs that join and leave ------------------------------------------------------------------------
def test_a_job_joins_at_step_2_and_one_leaves_at_step_3_every_rollout_on_policy(tmp_path):
    """Four jobs in two groups: c joins once some job has done 2 steps (its first adapter reaches the
    engine before its first rollouts), b leaves after its own 3 steps; every other job does the
    experiment's 6. Each job's rollouts are of its current version at every step."""
    from colora.record.runlog import read_jsonl

    c = _loop_runner(tmp_path, ["experiment.arm=overlap", "overlap.groups=2", "experiment.steps=6",
                                "experiment.warmup_steps=1", "jobs.c.start_after=2", "jobs.b.steps=3"],
                     {n: 40 for n in "abcd"})
    c.jobs["c"].status = "waiting"  # as the runner makes a job with start_after
    loads = []
    real = c.engine.set_adapters
    c.engine.set_adapters = lambda adapters: loads.extend((a.job, a.version) for a in adapters) or real(adapters)
    c.run()
    c.metrics.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    ok = {n: [r for r in rows if r.get("job") == n and r.get("status") == "ok"] for n in "abcd"}
    assert [len(ok[n]) for n in "abcd"] == [6, 3, 6, 6]
    assert c.jobs["b"].status == c.jobs["c"].status == "done"
    assert all(r["rollout_versions"] == [r["step"]] for v in ok.values() for r in v)  # on-policy throughout
    [joined] = [r for r in rows if r.get("event") == "joined"]
    assert joined["job"] == "c" and joined["step"] == 0 and joined["group"] in (0, 1)
    before = rows[:rows.index(joined)]
    assert max(r["step"] for r in before if r.get("status") == "ok") == 1  # some job had done 2 steps
    assert not any(r.get("job") == "c" for r in before)  # nothing of c before it joined
    assert ("c", 0) in loads  # its first version went to the engine, before its first rollouts (on-policy above)


# -- a job's task code that fails, hangs or breaks the reward contract stops that job alone -----------
class _Task:
    """The loop runner's task with hooks: sample and reward may raise, hang or return bad rewards."""

    def __init__(self, sample=None, reward=None, prompt="x"):
        self._sample, self._reward, self.prompt = sample, reward, prompt

    def sample(self, n, seed, split):
        if self._sample is not None:
            self._sample()
        return [SimpleNamespace(id=i, messages=({"role": "user", "content": self.prompt},)) for i in range(n)]

    def reward(self, text, item):
        return float(item.id % 2) if self._reward is None else self._reward(item)


def _hang(*a):
    threading.Event().wait()  # never returns


@pytest.mark.parametrize("bad", ["sample raises", "sample exits", "reward hangs", "reward 2.0", "reward nan",
                                 "reward exits"])
def test_a_jobs_failing_task_code_stops_that_job_and_the_others_go_on(tmp_path, bad):
    """What a job's task does wrong is that job's failure, named, found before the
    engine or within runtime.task_timeout_s; the other job does every step."""
    from colora.record.runlog import read_jsonl

    hooks = {"sample raises": dict(sample=lambda: 1 / 0), "sample exits": dict(sample=lambda: exit(3)),
             "reward hangs": dict(reward=_hang), "reward 2.0": dict(reward=lambda it: 2.0),
             "reward nan": dict(reward=lambda it: float("nan")), "reward exits": dict(reward=lambda it: exit(4))}[bad]
    c = _loop_runner(tmp_path, ["experiment.arm=shared_sync", "experiment.steps=3", "runtime.task_timeout_s=0.5"],
                     {"a": 8, "b": 8})
    c.jobs["b"].task = _Task(**hooks)
    c.engine_side.specs["b"] = (c.jobs["b"].cfg, c.jobs["b"].task)
    c.run()
    c.metrics.close()
    assert c.jobs["a"].status == "done" and c.jobs["a"].step == 3
    assert c.jobs["b"].status == "stopped" and c.jobs["b"].step == 0
    want = {"sample raises": "sample.*raised ZeroDivisionError", "sample exits": "sample.*raised SystemExit: 3",
            "reward hangs": r"reward did not return within runtime.task_timeout_s \(0.5 s\)",
            "reward 2.0": r"reward 2.0 for item 0 is not a number in \[0, 1\]",
            "reward nan": r"reward nan for item 0 is not a number in \[0, 1\]",
            "reward exits": "reward raised SystemExit: 4"}[bad]
    import re

    assert re.search(want, c.jobs["b"].reason), c.jobs["b"].reason
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["reason"] for r in rows if r.get("event") == "stopped"] == [c.jobs["b"].reason]


@pytest.mark.parametrize("prompt,needle", [("", "the prompt of item 0 is empty"),
                                           (" ".join(["w"] * 4000), "does not fit engine.max_model_len")])
def test_a_prompt_the_engine_cannot_take_stops_its_job_before_the_engine_sees_it(tmp_path, prompt, needle):
    """An empty prompt or one too long for the engine was 'the vLLM engine failed' for
    every job, at the same step on every resume."""

    class Words(ThreeTokens):
        def apply_chat_template(self, msgs, **kw):
            return msgs[-1]["content"]

        def __call__(self, text, add_special_tokens=False):
            return SimpleNamespace(input_ids=list(range(len(text.split()))))

    c = _loop_runner(tmp_path, ["experiment.arm=shared_sync", "experiment.steps=2"], {"a": 8, "b": 8})
    c.prompts.tok = Words()
    c.engine.max_model_len = 1024
    c.jobs["b"].task = _Task(prompt=prompt)
    c.engine_side.specs["b"] = (c.jobs["b"].cfg, c.jobs["b"].task)
    submitted = []
    real = c.engine.submit
    c.engine.submit = lambda key, reqs: submitted.extend(r.job for r in reqs) or real(key, reqs)
    c.run()
    assert c.jobs["b"].status == "stopped" and needle in c.jobs["b"].reason
    assert "b" not in submitted and c.jobs["a"].step == 2


def test_evaluation_holds_each_jobs_rewards_to_the_contract_and_scores_the_others(tmp_path):
    """In evaluation too, a reward of 2.0, a NaN or a raising reward is that job's error
    (never an accuracy of 2.00, "nan" or a silent 0), and a hung sample is cut at the limit."""
    from colora.run.evaluate import evaluate

    c = _loop_runner(tmp_path, ["experiment.arm=shared_sync", "runtime.task_timeout_s=0.5"],
                     {"ok": 4, "two": 4, "nan": 4, "raise": 4, "hang": 4})

    class Greedy(LoopEngine):
        def version(self, job):
            return 0

        def generate(self, reqs):
            return [GenResult(r, 0, [3], [], "y", "stop") for r in reqs]

    c.engine = Greedy({})
    for name, hooks in {"two": dict(reward=lambda it: 2.0), "nan": dict(reward=lambda it: float("nan")),
                        "raise": dict(reward=lambda it: {}["k"]), "hang": dict(sample=_hang)}.items():
        c.jobs[name].task = _Task(**hooks)
    c.jobs["ok"].task = _Task(reward=lambda it: 1.0)
    out = evaluate(c, list(c.jobs), 4, run_seed=0)
    assert out["ok"]["accuracy"] == 1.0 and len(out["ok"]["items"]) == 4 and "error" not in out["ok"]
    for name, needle in {"two": "reward 2.0", "nan": "reward nan", "raise": "raised KeyError",
                         "hang": "did not return within"}.items():
        assert out[name]["accuracy"] is None and needle in out[name]["error"], out[name]


def test_a_gated_co_runner_holds_a_grant_around_each_generation_and_each_step(tmp_path):
    """The time-slicing arm's gate: one grant for a group's adapter load and generation, one for its
    training step and export; never two at once (NullGate refuses a second acquire), never a step
    outside one."""
    from colora.timeslice.gate import NullGate

    class Recording(NullGate):
        def __init__(self):
            super().__init__("t")
            self.log = []

        def acquire(self, phase):
            self.log.append(phase)
            return super().acquire(phase)

        def yield_(self):
            self.log.append("yield")
            return super().yield_()

    class Checked(VersionTrainer):
        def step(self, rollouts, sft=None):
            assert gate._held, "a training step outside its grant"
            return super().step(rollouts)

    gate = Recording()
    c = _loop_runner(tmp_path, ["experiment.arm=shared_sync", "experiment.steps=3"], {"a": 8, "b": 8},
                     trainer_cls=Checked)
    c.gate = c.trainer_side.gate = gate
    # the checkpoint's snapshot reads the trainer's state: inside the step's grant, before a PARK can empty it
    c.trainer_side.on_step = lambda: gate.log.append("checkpoint" if gate._held else "checkpoint outside a grant")
    c.run()
    assert gate.log == ["generate", "yield", "train", "checkpoint", "yield"] * 3 + ["reload", "yield"]
    assert not gate._held
    assert all(js.step == 3 for js in c.jobs.values())


def test_an_adapter_that_cannot_be_exported_stops_its_job_and_the_others_go_on(tmp_path):
    """A full disk (or /dev/shm) while a step's adapters are exported was an error of
    the whole run, with no checkpoint; now that job stops with the reason and the others train on."""
    import errno
    import os

    c = _loop_runner(tmp_path, ["experiment.arm=shared_sync", "experiment.steps=3"], {"a": 8, "b": 8})
    bank = c.trainer_side.bank
    real = bank.export_peft

    def full(name, *a, **k):
        if name == "b":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(name, *a, **k)

    bank.export_peft = full
    c.run()
    assert c.jobs["a"].status == "done" and c.jobs["a"].step == 3
    assert c.jobs["b"].status == "stopped" and "could not be exported (OSError" in c.jobs["b"].reason


# -- a step of sft jobs alone in which one job's update is refused ------------------------------------
class _Chats:
    """An sft job's data as the engine thread asks it (colora/training/sft_data.py SftData.batch)."""

    def batch(self, step, n):
        from colora.training.sft_data import Conversation

        return [Conversation(i + 1, (1, 2, 3, 4), (False, False, True, True)) for i in range(n)]


class SftVersionTrainer(VersionTrainer):
    """Steps rollouts as VersionTrainer does and sft jobs too; job b's update is refused at its second
    step (as trainer.max_adapter_weight refuses a diverged one: its version stays)."""

    def step(self, rollouts, sft=None):
        out = super().step(rollouts)
        for name, datums in (sft or {}).items():
            v = self.version.get(name, 0)
            if name == "b" and v == 1:
                out[name] = JobStepStats(0.5, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 4, len(datums), v,
                                         failure="adapter diverged: max |weight| 1 > trainer.max_adapter_weight (0.5)")
                continue
            self.version[name] = v + 1
            out[name] = JobStepStats(0.5, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 4, len(datums), v + 1)
        return out


def _sft_runner(tmp_path, overrides: list[str]) -> CoRunner:
    """The loop runner with jobs a and b made sft jobs on `_Chats`, trained by SftVersionTrainer."""
    from colora.config import resolve

    d = load_config(SMOKE).to_dict()
    d["jobs"] = [{**d["jobs"][0], "name": n, "kind": "sft", "task": "", "task_options": {}, "data": "chats.jsonl"}
                 for n in "ab"]
    cfg = resolve(d, overrides)
    ref: list = []
    jobs = {j.name: JobState(j, _Chats()) for j in cfg.jobs}
    c = CoRunner(Schedule.of(cfg), LoopEngine({n: 0 for n in "ab"}), SftVersionTrainer(), FakeBank(ref),
                 AdapterExport("disk", "bfloat16", "base", tmp_path), ThreeTokens(), jobs, Timeline(),
                 JsonlWriter(tmp_path / "metrics.jsonl"), log=lambda m: None)
    ref.append(c)
    return c


def test_a_refused_update_in_a_step_of_sft_jobs_alone_stops_that_job_and_the_other_trains_on(tmp_path):
    """Two sft jobs and no grpo job: b's update is refused at its second step. b stops with the reason,
    a does every step, and a's step counter and its adapter's version agree throughout."""
    from colora.record.runlog import read_jsonl

    c = _sft_runner(tmp_path, ["experiment.arm=shared_sync", "experiment.steps=3", "experiment.warmup_steps=0"])
    c.run()
    c.metrics.close()
    assert c.jobs["a"].status == "done" and c.jobs["a"].step == 3 == c.trainer_side.trainer.version["a"]
    assert c.jobs["b"].status == "stopped" and c.jobs["b"].step == 1 == c.trainer_side.trainer.version["b"]
    assert "trainer.max_adapter_weight" in c.jobs["b"].reason
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if r.get("job") == "a" and r.get("status") == "ok"] == [0, 1, 2]
    assert [r["version"] for r in rows if r.get("job") == "a" and r.get("status") == "ok"] == [1, 2, 3]
    assert not (tmp_path / "failed_steps").exists()  # no rollouts to keep for a replay of the step


def test_a_failure_after_the_update_leaves_every_applied_jobs_step_counted(tmp_path):
    """Anything that raises once the optimizer has stepped (here: the train span's row, on a full disk)
    finds each updated job's step counted: a checkpoint taken then holds weights and steps that agree,
    so a resume does not apply the update again."""
    import errno

    c = _sft_runner(tmp_path, ["experiment.arm=shared_sync", "experiment.steps=3", "experiment.warmup_steps=0"])

    class FullDisk(JsonlWriter):
        def write(self, row):
            if row.get("phase") == "train":
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write(row)

    c.timeline.writer = FullDisk(tmp_path / "timeline.jsonl")
    with pytest.raises(OSError, match="No space left"):
        c.run()
    trainer = c.trainer_side.trainer
    assert trainer.version == {"a": 1, "b": 1}
    assert {n: js.step for n, js in c.jobs.items()} == {"a": 1, "b": 1}


# -- a job whose start_after is never reached -------------------------------------------------------
class FirstStepFails(VersionTrainer):
    """Job a's first update is refused: it stops having done no step."""

    def step(self, rollouts, sft=None):
        out = super().step(rollouts)
        if "a" in out:
            out["a"] = JobStepStats(float("nan"), 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1, 1, 0, failure="loss is not finite")
        return out


def test_a_job_still_waiting_when_the_run_ends_failed_and_says_it_never_joined(tmp_path):
    """b joins once some job has done 2 steps; a, the only job that starts, stops at its first. b ends as
    failed with why (never joined), not as a job still waiting in a run that went well."""
    from colora.record.runlog import read_jsonl

    c = _loop_runner(tmp_path, ["experiment.arm=shared_sync", "experiment.steps=3", "experiment.warmup_steps=0",
                                "jobs.b.start_after=2"], {"a": 8, "b": 8}, trainer_cls=FirstStepFails)
    c.jobs["b"].status = "waiting"  # as the runner makes a job with start_after
    c.run()
    c.metrics.close()
    assert c.jobs["a"].status == "stopped"
    b = c.jobs["b"]
    assert b.status == "failed" and b.step == 0
    assert b.reason.startswith("never joined: start_after = 2 was not reached") and "at most 0 steps" in b.reason
    [row] = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if r.get("job") == "b"]
    assert row["status"] == "failed" and row["reason"] == b.reason


def test_a_gated_co_runners_drop_runs_inside_a_grant_before_the_next_generation(tmp_path):
    """Time-slicing arm: b's reward raises, so b stops while its step is scored, outside any grant (another
    tenant may hold the GPU, this engine may be parked). Its adapter leaves the engine with the next
    generation's grant, before that generation's requests; and a job stopped in the last step leaves it
    within the final reload's grant."""
    from colora.timeslice.gate import NullGate

    gate = NullGate("t")

    class Watching(DroppingEngine):
        def __init__(self, lengths):
            super().__init__(lengths)
            self.events = []

        def drop(self, job):
            self.events.append(("drop", job, gate.holds))
            super().drop(job)

        def submit(self, key, reqs):
            self.events.append(("submit", tuple(sorted({r.job for r in reqs})), gate.holds))
            super().submit(key, reqs)

    class LastStepFails(VersionTrainer):
        def step(self, rollouts, sft=None):
            out = super().step(rollouts)
            if "a" in out and out["a"].version == 3:
                out["a"] = JobStepStats(float("nan"), 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1, 1, 2, failure="loss is not finite")
            return out

    c = _loop_runner(tmp_path, ["experiment.arm=shared_sync", "experiment.steps=3"], {"a": 8, "b": 8, "c": 8},
                     engine_cls=Watching, trainer_cls=LastStepFails)
    c.gate = c.trainer_side.gate = gate
    c.jobs["b"].task = _Task(reward=lambda it: 1 / 0)
    c.run()
    assert c.jobs["b"].status == "stopped" and c.jobs["a"].status == "stopped" and c.jobs["c"].step == 3
    assert c.engine.events == [("submit", ("a", "b", "c"), True), ("drop", "b", True), ("submit", ("a", "c"), True),
                               ("submit", ("a", "c"), True), ("drop", "a", True)]
