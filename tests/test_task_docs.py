"""docs/tasks.md runs as written: its files (the code fences that name one: ```python mytasks.py) are
written into a folder, its Python session runs there, its `colora tasks show` commands succeed, and its
config passes every check a run makes before its engine starts (with the tiny model)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"
FENCE = re.compile(r"^```(\w+)(?: (\S+))?\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, str | None, str]]:
    """(language, file name or None, text) of every fenced block, in order."""
    return [(m[1], m[2], m[3]) for m in FENCE.finditer(DOC.read_text())]


@pytest.fixture
def doc_dir(tmp_path, monkeypatch):
    """A folder holding the doc's files, as the current directory, with a clean task look-up."""
    import colora.tasks.registry as reg

    for _, name, text in _blocks():
        if name:
            (tmp_path / name).write_text(text)
    monkeypatch.setattr(reg, "_TASK_DIRS", [])
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "mytasks", raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("mytasks", None)  # another test's folder holds another mytasks.py


def test_the_doc_names_its_files():
    names = [name for _, name, _ in _blocks() if name]
    assert names == ["mytasks.py", "capitals.jsonl", "mine.toml"]


def test_the_python_session_runs(doc_dir, capsys):
    [session] = [text for lang, name, text in _blocks() if lang == "python" and not name]
    exec(compile(session, str(DOC), "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    said = re.search(r"# (What is \d+ \* \d+\?)", session)[1]  # the comment says what it prints
    assert printed == [said, "Put your final answer in <answer></answer> tags."]


def test_the_tasks_show_commands_succeed(doc_dir, capsys):
    from colora.cli import main

    [sh] = [text for lang, _, text in _blocks() if lang == "sh"]
    shows = [shlex.split(line)[1:] for line in sh.splitlines() if line.startswith("colora tasks show")]
    assert len(shows) == 2
    for argv in shows:
        assert main(argv) == 0, argv
    out = capsys.readouterr().out
    assert "multiply/train/" in out and "capitals/eval/" in out


def test_the_config_passes_the_checks_a_run_makes(doc_dir, tiny_model_dir, capsys):
    """What `colora run mine.toml` checks before its engine starts, with the tiny model in place of the
    builtin (built here once per test session)."""
    from colora.config import load_config
    from colora.run.preflight import check_engine, check_model_len, check_prompt_lengths, check_sizes, load_tasks

    cfg = load_config(doc_dir / "mine.toml", [f'experiment.model="{tiny_model_dir}"'])
    assert [j.task for j in cfg.jobs] == ["mytasks:Multiply", "mytasks:Capitals"]
    tasks = load_tasks(cfg.jobs)
    check_sizes(cfg, tasks)
    check_engine(cfg)
    check_model_len(cfg, tiny_model_dir)
    check_prompt_lengths(cfg, tiny_model_dir, tasks)
    [sh] = [text for lang, _, text in _blocks() if lang == "sh"]
    assert "colora run mine.toml" in sh and "colora run mine.toml" in (doc_dir / "mine.toml").read_text()


def test_a_bad_option_of_the_docs_task_names_it(doc_dir):
    from colora.tasks import TaskError, get_task

    with pytest.raises(TaskError, match=r"max_factor \(1\) must be an integer in \[2, 1000000\]"):
        get_task("mytasks:Multiply", max_factor=1)
    (doc_dir / "broken.jsonl").write_text('{"country": "France"}\n')
    with pytest.raises(TaskError, match=r"option path \('broken.jsonl'\).*KeyError"):
        get_task("mytasks:Capitals", path="broken.jsonl")
