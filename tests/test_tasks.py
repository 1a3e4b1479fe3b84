"""colora.tasks: registry and options, determinism, held-out split disjointness, the GSM8K loader.

    pytest tests/test_tasks.py tests/test_tasks_verifiers.py tests/test_tasks_properties.py -q
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from colora.tasks import Item, Task, TaskError, format_items, get_task, list_tasks, register_task, split_of

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_sample.jsonl"
SMOKE = Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml"
PROCEDURAL = [name for name in list_tasks() if name != "gsm8k"]


def test_eight_study_tasks_and_more_are_registered():
    names = set(list_tasks())
    assert {"gsm_synth", "gsm8k", "countdown", "modular", "linear_algebra", "counting", "sorting",
            "addition", "reverse"} <= names
    assert list_tasks() == sorted(names)


# --------------------------------------------------------------------------- names and options


def test_unknown_task_names_the_registered_ones():
    with pytest.raises(TaskError, match="unknown task 'nope'.*countdown"):
        get_task("nope")


def test_unknown_option_is_an_error_listing_accepted():
    with pytest.raises(TaskError, match="'numbrs'.*accepted: numbers, max_number"):
        get_task("countdown", numbrs=3)


@pytest.mark.parametrize("name, options, key", [
    ("countdown", {"numbers": 99}, "numbers"),
    ("countdown", {"use_all": "yes"}, "use_all"),
    ("addition", {"digits": True}, "digits"),
    ("addition", {"digits": 0}, "digits"),
    ("modular", {"ops": "/"}, "ops"),
    ("counting", {"kind": "sentences"}, "kind"),
    ("sorting", {"kind": "numbers", "length": 15, "max_value": 9}, "length"),
    ("gsm_synth", {"min_steps": 3, "max_steps": 2}, "min_steps"),
    ("linear_algebra", {"unknowns": 3, "max_coef": 1}, "max_coef"),
    ("reverse", {"eval_fraction": 1.5}, "eval_fraction"),
])
def test_bad_option_value_names_the_key(name, options, key):
    with pytest.raises(TaskError, match=key):
        get_task(name, **options)


def test_gsm8k_needs_a_path():
    with pytest.raises(TaskError, match="needs option 'path'"):
        get_task("gsm8k")


def test_bad_sample_arguments():
    task = get_task("addition")
    with pytest.raises(TaskError, match="split"):
        task.sample(3, 0, "test")
    with pytest.raises(TaskError, match="n"):
        task.sample(-1, 0)
    assert task.sample(0, 0) == []


def test_user_task_from_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_colora_task.py").write_text(textwrap.dedent('''
        import random
        from colora.tasks import Draft, ProceduralTask

        class Double(ProceduralTask):
            """Double a number"""
            name = "double"
            def __init__(self, *, hi: int = 50, eval_fraction: float = 0.2):
                super().__init__(eval_fraction=eval_fraction)
                self.hi = hi
            def draw(self, rng):
                x = rng.randint(0, self.hi)
                return Draft(key=str(x), question=f"What is 2 * {x}?", answer=str(2 * x), meta={})

        class NotATask:
            pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    task = get_task("my_colora_task:Double", hi=1000)
    item = task.sample(1, 3, "eval")[0]
    assert task.reward(f"<answer>{item.answer}</answer>", item) == 1.0
    assert "hi=1000" in task.describe()
    with pytest.raises(TaskError, match="no option 'lo'"):
        get_task("my_colora_task:Double", lo=1)
    with pytest.raises(TaskError, match="not a subclass"):
        get_task("my_colora_task:NotATask")
    with pytest.raises(TaskError, match="no module 'no_such_module_xyz'; looked in the installed packages"):
        get_task("no_such_module_xyz:Thing")


_MODULE_BESIDE = '''
from colora.tasks import Draft, ProceduralTask
from {helper} import KEY  # a module beside it, found the same way


class Echo(ProceduralTask):
    """Repeat a number"""
    name = "echo"
    def draw(self, rng):
        x = rng.randint(0, 500)
        return Draft(key=f"{{KEY}}{{x}}", question=f"Say {{x}}.", answer=str(x), meta={{}})
'''


@pytest.fixture
def task_dirs(monkeypatch):
    """A clean look-up for import-path tasks: no task folders, sys.path as it was after the test."""
    import colora.tasks.registry as reg

    monkeypatch.setattr(reg, "_TASK_DIRS", [])
    monkeypatch.setattr(sys, "path", list(sys.path))
    return reg


def test_an_import_path_task_beside_its_config_file(tmp_path, monkeypatch, task_dirs):
    """`task = "mod:Class"` finds mod.py in the config file's folder (and the modules beside it),
    from any current directory; run in a resume, config.json's task_dirs do the same."""
    from colora.config import load_config
    from colora.run.preflight import load_tasks

    cfg_dir = tmp_path / "experiment"
    cfg_dir.mkdir()
    mod, helper = f"echo_task_{tmp_path.name}", f"echo_key_{tmp_path.name}"
    (cfg_dir / f"{mod}.py").write_text(_MODULE_BESIDE.format(helper=helper))
    (cfg_dir / f"{helper}.py").write_text('KEY = "k"\n')
    toml = SMOKE.read_text().replace('task = "counting"', f'task = "{mod}:Echo"').replace(
        "task_options = { length = 2, vocab = 3 }", "")
    assert f'task = "{mod}:Echo"' in toml and "vocab = 3" not in toml
    (cfg_dir / "exp.toml").write_text(toml)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(cfg_dir / "exp.toml")
    tasks = load_tasks(cfg.jobs)
    assert tasks["count"].sample(1, 0)[0].meta["key"].startswith("k")
    assert str(cfg_dir.resolve()) in task_dirs.task_dirs()


def test_an_import_path_task_in_the_current_directory(tmp_path, monkeypatch, task_dirs, capsys):
    from colora.cli import main

    mod = f"echo_cwd_{tmp_path.name}"
    (tmp_path / f"{mod}.py").write_text(_MODULE_BESIDE.format(helper="math").replace("import KEY", "import pi as KEY"))
    monkeypatch.chdir(tmp_path)
    assert main(["tasks", "show", f"{mod}:Echo", "--n", "1"]) == 0
    assert "Say " in capsys.readouterr().out


def test_an_import_path_task_not_found_says_where_it_looked(tmp_path, monkeypatch, task_dirs):
    task_dirs.add_task_dirs(tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskError) as e:
        get_task("missing_mod_xyz:Task")
    msg = str(e.value)
    assert "no module 'missing_mod_xyz'" in msg and "installed packages" in msg
    assert str((tmp_path / "configs").resolve()) in msg and str(tmp_path.resolve()) in msg
    (tmp_path / "broken_mod_xyz.py").write_text("import not_installed_dependency_xyz\n")
    with pytest.raises(TaskError, match="importing module 'broken_mod_xyz' from .* failed.*not_installed_dependency"):
        get_task("broken_mod_xyz:Task")
    with pytest.raises(TaskError, match="module:Class"):
        get_task("just_a_module:")


def test_register_task():
    cls = type(get_task("addition"))
    register_task("addition", cls)  # same class again: a no-op
    with pytest.raises(TaskError, match="already registered"):
        register_task("addition", type(get_task("sorting")))
    with pytest.raises(TaskError, match="not a subclass"):
        register_task("thing", dict)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- items


@pytest.mark.parametrize("name", PROCEDURAL)
def test_items_are_well_formed(name):
    task = get_task(name)
    assert isinstance(task, Task) and task.name == name
    line = task.describe()
    assert line.startswith(f"{name}: ") and "\n" not in line
    items = task.sample(30, 0, "train")
    assert len({it.id for it in items}) == 30 and len({it.meta["key"] for it in items}) == 30
    for it in items:
        assert it.id.startswith(f"{name}/train/")
        assert [m["role"] for m in it.messages] == ["user"]
        prompt = it.messages[0]["content"]
        assert "<answer></answer>" in prompt
        assert len(prompt) < 800  # about 200 tokens: prompts feed small models
        assert it.answer.strip() == it.answer and it.answer
        assert Item.from_dict(json.loads(json.dumps(it.to_dict()))) == it
    text = format_items(items[:3])
    assert all(it.id in text and it.answer in text for it in items[:3])


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", PROCEDURAL)
def test_same_seed_same_items_and_prefix(name):
    task = get_task(name)
    a = [it.to_dict() for it in task.sample(20, 7, "eval")]
    b = [it.to_dict() for it in get_task(name).sample(20, 7, "eval")]
    assert a == b
    assert [it.to_dict() for it in task.sample(8, 7, "eval")] == a[:8]
    assert [it.id for it in task.sample(20, 8, "eval")] != [x["id"] for x in a]


def test_sampling_never_touches_the_global_rng():
    import random

    random.seed(123)
    before = random.getstate()
    get_task("countdown").sample(10, 1)
    assert random.getstate() == before


# --------------------------------------------------------------------------- split disjointness


@pytest.mark.parametrize("name", PROCEDURAL)
def test_train_and_eval_are_disjoint(name):
    task = get_task(name)
    train = task.sample(300, 1, "train") + task.sample(300, 2, "train")
    evals = task.sample(64, 1, "eval") + task.sample(64, 2, "eval")
    train_keys, eval_keys = {it.meta["key"] for it in train}, {it.meta["key"] for it in evals}
    assert len(eval_keys) >= 64 and train_keys.isdisjoint(eval_keys)
    assert {it.id for it in train}.isdisjoint({it.id for it in evals})
    for split, items in (("train", train), ("eval", evals)):
        assert all(split_of(name, it.meta["key"], task.eval_fraction) == split for it in items)


def test_split_does_not_depend_on_difficulty():
    """An eval problem of the easy setting is never a training problem of a harder one."""
    easy = get_task("addition", digits=1, terms=2, eval_fraction=0.5)
    hard = get_task("addition", digits=2, terms=2, eval_fraction=0.5)
    easy_eval = {it.meta["key"] for it in easy.sample(30, 0, "eval")}
    hard_train = {it.meta["key"] for it in hard.sample(4000, 0, "train")}
    assert hard_train & {f"{a}+{b}" for a in range(10) for b in range(10)}  # the spaces do overlap
    assert easy_eval.isdisjoint(hard_train)


def test_tiny_item_space_is_a_clear_error():
    task = get_task("addition", digits=1, terms=2)
    with pytest.raises(TaskError, match="too small"):
        task.sample(64, 0, "eval")


def test_an_exhausted_item_space_is_refused_once_draws_stop_finding_new_items(monkeypatch):
    """An eval_size of 100,000 over modular's 4-problem eval split was refused only after 2000 +
    200 n = 20,002,000 draws (137 s); once every problem is found, a few thousand more draws decide it."""
    task = get_task("modular", terms=1, max_operand=2, max_modulus=2)
    draws = 0
    draw = task.draw

    def counted(rng):
        nonlocal draws
        draws += 1
        assert draws < 100_000, "still drawing long after the split was exhausted"
        return draw(rng)

    monkeypatch.setattr(task, "draw", counted)
    with pytest.raises(TaskError, match=r"found only \d+ distinct eval items of the 100000 asked after \d+ draws "
                                        r"\(the last \d+ found none new\).*too small"):
        task.sample(100_000, 0, "eval")
    assert draws < 10_000


def test_a_sparse_split_of_a_large_space_is_still_found_whole():
    """The stopping rule waits for slow finds: a 1% eval split still gives 300 distinct items (sample(299)
    their prefix), and 1,900 of a split of ~2,000, where most draws near the end are repeats."""
    task = get_task("addition", digits=3, terms=2, eval_fraction=0.01)
    items = task.sample(300, 5, "eval")
    assert len({it.meta["key"] for it in items}) == 300 and task.sample(299, 5, "eval") == items[:299]
    small = get_task("addition", digits=2, terms=2, eval_fraction=0.2)  # ~2,000 eval problems of 10,000
    assert len(small.sample(1900, 0, "eval")) == 1900


# --------------------------------------------------------------------------- GSM8K loader


def test_gsm8k_reads_its_own_format():
    task = get_task("gsm8k", path=str(FIXTURE))
    n_train, n_eval = task.size("train"), task.size("eval")
    assert n_train + n_eval == 12 and n_train > 0 and n_eval > 0
    train, evals = task.sample(n_train, 0, "train"), task.sample(n_eval, 0, "eval")
    assert {it.meta["key"] for it in train}.isdisjoint({it.meta["key"] for it in evals})
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    by_question = {r["question"]: r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in rows}
    for it in train + evals:
        question = it.messages[0]["content"].split("\n")[0]
        assert it.answer == by_question[question]
        assert task.reward(f"So the answer is <answer>{it.answer}</answer>", it) == 1.0
    assert task.sample(3, 5, "train") == task.sample(3, 5, "train")
    with pytest.raises(TaskError, match="holds"):
        task.sample(n_train + 1, 0, "train")


def test_gsm8k_thousands_separator_in_reference():
    task = get_task("gsm8k", path=str(FIXTURE), eval_fraction=0.5)
    items = task.sample(task.size("train"), 0, "train") + task.sample(task.size("eval"), 0, "eval")
    paper = next(it for it in items if it.messages[0]["content"].startswith("A school orders 40 boxes"))
    assert paper.answer == "1200"
    assert task.reward("40 * 30 = 1,200 packs. #### 1,200", paper) == 1.0


def test_gsm8k_eval_file_is_the_eval_split(tmp_path):
    rows = FIXTURE.read_text().splitlines()
    eval_file = tmp_path / "test.jsonl"
    eval_file.write_text("\n".join(rows[:2]) + "\n")
    task = get_task("gsm8k", path=str(FIXTURE), eval_path=str(eval_file))
    assert task.size("eval") == 2 and task.size("train") == 10 and task.dropped_overlap == 2
    assert {it.meta["line"] for it in task.sample(2, 0, "eval")} == {1, 2}


@pytest.mark.parametrize("content, message", [
    ('{"question": "q", "answer": "a\\n#### 3"}\nnot json\n', r":2: not valid JSON"),
    ('{"question": "q", "answer": "a\\n#### 3"}\n\n{"question": "r"}\n', r":3: expected an object"),
    ('{"question": "q", "answer": "no final line"}\n', r":1: answer has no '#### <number>'"),
    ('{"question": "q", "answer": "a\\n#### three"}\n', r":1: final answer 'three'"),
    ("\n\n", "holds no rows"),
])
def test_gsm8k_malformed_file_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TaskError, match=message) as err:
        get_task("gsm8k", path=str(path))
    assert "bad.jsonl" in str(err.value)


def test_gsm8k_missing_file(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        get_task("gsm8k", path=str(tmp_path / "missing.jsonl"))


def test_parse_options_for_the_cli():
    from colora.tasks import parse_options

    opts = parse_options(["numbers=3", "use_all=false", "eval_fraction=0.5", "path=data/train.jsonl"])
    assert opts == {"numbers": 3, "use_all": False, "eval_fraction": 0.5, "path": "data/train.jsonl"}
    assert get_task("countdown", **parse_options(["numbers=4"])).numbers == 4
    with pytest.raises(TaskError, match="key=value"):
        parse_options(["numbers"])
    with pytest.raises(TaskError, match="twice"):
        parse_options(["a=1", "a=2"])


def test_items_hash_by_id():
    items = get_task("reverse").sample(5, 0)
    assert len(set(items) | set(get_task("reverse").sample(5, 0))) == 5


def test_sorting_never_shows_a_sorted_list():
    for kind in ("numbers", "words"):
        task = get_task("sorting", kind=kind, length=3)
        for it in task.sample(200, 0):
            prompt = it.messages[0]["content"].split("\n")[0]
            assert task.reward(prompt, it) == 0.0


def test_describe_task_without_building_it():
    from colora.tasks import describe_task

    assert describe_task("gsm8k").startswith("gsm8k: ") and "path=<required>" in describe_task("gsm8k")
    for name in PROCEDURAL:  # the same line as the built task's, for default options
        assert describe_task(name) == get_task(name).describe()
