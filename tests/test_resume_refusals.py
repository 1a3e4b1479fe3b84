"""What `colora run --resume DIR` refuses before it starts or writes anything: a config.json edited
since the run began, a checkpoint of another config, and task modules from the folders a run
directory names (a run directory may come from someone else; importing a module runs its code). No
engine: the run's steps are replaced where a test gets past the checks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from colora.config import load_config
from colora.record.runlog import write_json_atomic
from colora.run import runner
from colora.run.checkpoint import save
from colora.run.preflight import RunError

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "experiments" / "smoke.toml"


class Reached(Exception):
    """The resume got past every check to the run's steps (the engine's start)."""


@pytest.fixture
def no_steps(monkeypatch):
    def steps(*a, **k):
        raise Reached()

    monkeypatch.setattr(runner, "_execute", steps)


def _run_dir(d: Path, tiny_model_dir, task: str = "coin_task:CoinFlip", checkpoint_hash: str | None = None,
             task_dirs: tuple[str, ...] = ()) -> dict:
    """The directory an interrupted run leaves (with a checkpoint of `checkpoint_hash`'s config when
    given); returns config.json."""
    cfg = load_config(SMOKE, [f'experiment.model="{tiny_model_dir}"', f'jobs.*.task="{task}"', "jobs.*.task_options={}",
                              "experiment.eval_size=0"])
    d.mkdir(parents=True)
    saved = {"config": cfg.to_dict(), "hash": cfg.hash(), "task_dirs": list(task_dirs)}
    write_json_atomic(d / "config.json", saved)
    write_json_atomic(d / "status.json", {"state": "interrupted", "signal": "SIGTERM"})
    if checkpoint_hash is not None:
        save(d, 1, {"config_hash": checkpoint_hash, "jobs": {j.name: {"step": 1} for j in cfg.jobs}}, keep=2)
    return saved


def _edit(d: Path, section: str, name: str, value) -> None:
    """config.json with one key changed, as a person editing it leaves it."""
    saved = json.loads((d / "config.json").read_text())
    saved["config"][section][name] = value
    (d / "config.json").write_text(json.dumps(saved))


# -- item 14: an edited config.json ---------------------------------------------------------------
def test_an_edited_config_is_refused_without_a_checkpoint(tmp_path, tiny_model_dir, no_steps):
    """No checkpoint: the edited experiment would run from the start under the old name; refused,
    config.json and status.json left as they were."""
    d = tmp_path / "run"
    _run_dir(d, tiny_model_dir)
    _edit(d, "experiment", "steps", 7)
    before = (d / "config.json").read_text()
    with pytest.raises(RunError, match="config.json was edited since"):
        runner.resume(d, log=lambda s: None)
    assert (d / "config.json").read_text() == before
    assert json.loads((d / "status.json").read_text())["state"] == "interrupted"


def test_an_edited_config_is_refused_before_anything_starts_with_a_checkpoint(tmp_path, tiny_model_dir, no_steps):
    d = tmp_path / "run"
    saved = _run_dir(d, tiny_model_dir)
    save(d, 1, {"config_hash": saved["hash"], "jobs": {j["name"]: {"step": 1} for j in saved["config"]["jobs"]}},
         keep=2)
    _edit(d, "experiment", "seed", 5)
    with pytest.raises(RunError, match="config.json was edited since"):
        runner.resume(d, log=lambda s: None)
    assert json.loads((d / "status.json").read_text())["state"] == "interrupted"


def test_a_checkpoint_of_another_config_is_refused_before_anything_starts(tmp_path, tiny_model_dir, no_steps):
    d = tmp_path / "run"
    _run_dir(d, tiny_model_dir, checkpoint_hash="0123456789abcdef")
    with pytest.raises(RunError, match="checkpoint step-000001 is of config 0123456789abcdef"):
        runner.resume(d, log=lambda s: None)
    assert json.loads((d / "status.json").read_text())["state"] == "interrupted"


def test_a_changed_run_option_is_no_edit_of_the_experiment(tmp_path, tiny_model_dir, no_steps):
    """Run options stay out of the config's hash: a resume with another checkpoint cadence goes on."""
    d = tmp_path / "run"
    _run_dir(d, tiny_model_dir)
    _edit(d, "runtime", "checkpoint_every", 1)
    with pytest.raises(Reached):
        runner.resume(d, log=lambda s: None)


# -- item 9: task modules from the run directory's folders ----------------------------------------
def test_a_resume_imports_no_task_from_the_folders_config_json_names(tmp_path, tiny_model_dir, no_steps, monkeypatch):
    """config.json names a folder holding the task's module, whose import would run its code: the
    resume refuses, naming the folder and what to do, and nothing is imported. Run from that folder,
    as the user chooses, it goes on."""
    import colora.tasks.registry as reg

    monkeypatch.setattr(reg, "_TASK_DIRS", [])
    monkeypatch.setattr(sys, "path", list(sys.path))
    mod = f"planted_{tmp_path.name}"
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "imported"
    (planted / f"{mod}.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                       "from coin_task import CoinFlip as Planted\n")
    d = tmp_path / "run"
    _run_dir(d, tiny_model_dir, task=f"{mod}:Planted", task_dirs=(str(planted),))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunError, match=r"not import from.*resume from the folder that holds the module") as e:
        runner.resume(d, log=lambda s: None)
    assert str(planted) in str(e.value)
    assert not marker.exists(), "the resume imported a module from a folder the run directory named"
    monkeypatch.chdir(planted)  # the user's own choice: the current directory is looked in
    with pytest.raises(Reached):
        runner.resume(d, log=lambda s: None)
    assert marker.exists()


# -- an sft job's data changed since the run began ------------------------------------------------
def test_a_resume_whose_sft_data_changed_is_refused_naming_the_job_the_file_and_both_hashes(tmp_path, tiny_model_dir,
                                                                                          no_steps):
    """The run records its sft data's sha256 as it begins; a resume (here: the same run, interrupted)
    that would read other conversations from that file is refused before anything starts."""
    from colora.config import resolve
    from colora.record.runlog import sha256_file

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"w{i}"},
                                                     {"role": "assistant", "content": "yes"}]}) + "\n"
                            for i in range(6)))
    raw = load_config(SMOKE, [f'experiment.model="{tiny_model_dir}"', "experiment.eval_size=0"]).to_dict()
    raw["jobs"][1] = {**raw["jobs"][1], "kind": "sft", "task": "", "task_options": {}, "data": str(data),
                      "prompts_per_step": 2}
    raw["jobs"][0] = {**raw["jobs"][0], "task": "coin_task:CoinFlip", "task_options": {}}
    cfg = resolve(raw)
    d = tmp_path / "run"
    with pytest.raises(Reached):
        runner.run(cfg, d, log=lambda s: None)
    first = sha256_file(data)
    assert json.loads((d / "config.json").read_text())["data"] == {"mod": {"file": str(data), "sha256": first}}
    write_json_atomic(d / "status.json", {"state": "interrupted", "signal": "SIGTERM"})
    with pytest.raises(Reached):  # the same data: it goes on
        runner.resume(d, log=lambda s: None)
    write_json_atomic(d / "status.json", {"state": "interrupted", "signal": "SIGTERM"})
    with open(data, "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "new"}, {"role": "assistant", "content": "no"}]})
                + "\n")
    with pytest.raises(RunError) as e:
        runner.resume(d, log=lambda s: None)
    for needle in ("jobs.1.data", "'mod'", str(data), first, sha256_file(data)):
        assert needle in str(e.value), (needle, str(e.value))
    assert json.loads((d / "status.json").read_text())["state"] == "interrupted"


# -- a tenant of the time-slicing arm -------------------------------------------------------------
@pytest.mark.parametrize("marked", [True, False])
def test_a_tenant_of_the_time_slicing_arm_is_not_resumed(tmp_path, tiny_model_dir, no_steps, marked):
    """Its run is driven by the arm (the broker, the grants, the parkers): resumed alone it would run
    outside any grant. Refused, naming the arm's directory; so is a tenant directory that its
    config.json does not mark (the arm's layout: DIR/tenants/<k> beside <k>.spec.json)."""
    d = tmp_path / "ts" / "tenants" / "0"
    saved = _run_dir(d, tiny_model_dir)
    if marked:
        (d / "config.json").write_text(json.dumps({**saved, "timeslice_tenant": "tenant-0"}))
    else:
        (d.parent / "0.spec.json").write_text("{}")
    with pytest.raises(RunError, match=r"time-slicing arm's run .*/ts.*not resumed"):
        runner.resume(d, log=lambda s: None)
