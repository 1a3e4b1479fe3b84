"""Bad input through the command line: one clear line naming the problem, exit status 2, and no run
directory that looks complete (none at all, here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from colora.cli import main

SMOKE = str(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")
GSM8K = Path(__file__).resolve().parent / "fixtures" / "gsm8k_sample.jsonl"  # 10 train items, 2 eval


def _fails(capsys, argv, *needles):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("colora: error:"), err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("override, needles", [
    ("experiment.stepz=3", ["unknown key", "experiment.stepz", "steps"]),
    ("jobs.0.samples_per_prompt=1", ["jobs.0.samples_per_prompt", "(1)", "at least 2"]),
    ("experiment.arm=fast", ["experiment.arm", "'fast'", "overlap_mps"]),
    ("jobs.count.lora_rank=-4", ["jobs.0.lora_rank", "(-4)"]),
    ("jobs.nobody.lora_rank=4", ["no job named 'nobody'", "count, mod"]),
    ("jobs.0.task=no_such_task", ["jobs.0.task", "no_such_task", "registered"]),
    # only lognormal lengths read min: the smoke config's natural lengths leave it at 8 over 2 tokens
    ('jobs.0.response_length.dist="lognormal"', ["jobs.0.response_length.min", "(8)", "max_new_tokens (2)"]),
    ('experiment.model="/nonexistent/model"', ["experiment.model", "/nonexistent/model", "does not exist"]),
    ("experiment.model=builtin:huge", ["builtin:huge", "builtin:tiny"]),
    # checked before the engine starts: data sizes against the splits, groups and adapter slots against
    # the jobs, task options
    (["jobs.0.task=gsm8k", f'jobs.0.task_options={{path="{GSM8K}"}}', "experiment.eval_size=3"],
     ["experiment.eval_size (3)", "eval split of job 'count'", "2 items", "at most 2"]),
    (["jobs.0.task=gsm8k", f'jobs.0.task_options={{path="{GSM8K}"}}', "experiment.eval_size=0",
      "jobs.0.prompts_per_step=11"],
     ["jobs.0.prompts_per_step (11)", "train split", "10 items"]),
    ("jobs.1.task_options={terms=1, max_operand=2, max_modulus=2}",  # a procedural task's tiny eval split
     ["experiment.eval_size (32)", "job 'mod'", "too small"]),
    ("jobs.1.task_options={max_modulus=1}", ["jobs.1.task", "modular", "max_modulus (1)"]),
    (["experiment.arm=overlap", "overlap.groups=5"], ["overlap.groups (5)", "number of jobs (2)", "overlap"]),
    ("engine.max_loras=1", ["engine.max_loras (1)", "number of jobs (2)"]),
    # vLLM's own limits, refused here rather than inside vLLM as it starts
    ("jobs.0.lora_rank=100000", ["jobs.0.lora_rank (100000)", "job 'count'", "largest LoRA rank vLLM serves (512)"]),
    ("engine.max_lora_rank=1024", ["engine.max_lora_rank (1024)", "512"]),
    (["engine.max_num_seqs=300", "engine.max_num_batched_tokens=256"],
     ["engine.max_num_batched_tokens (256)", "engine.max_num_seqs (300)"]),
    ("experiment.eval_max_new_tokens=512", ["experiment.eval_max_new_tokens (512)", "engine.max_model_len (512)"]),
    # names that become paths
    ('experiment.name="../../elsewhere"', ["experiment.name ('../../elsewhere')", "1-64 characters"]),
    ('jobs.0.name="count\\n"', ["jobs.0.name ('count\\n')", "1-64 characters"]),  # TOML's \n: a newline
])
def test_bad_config_is_refused_before_anything_runs(capsys, tmp_path, override, needles):
    out = tmp_path / "run"
    sets = [a for o in ([override] if isinstance(override, str) else override) for a in ("--set", o)]
    _fails(capsys, ["run", SMOKE, *sets, "--out", str(out)], *needles)
    assert not out.exists()


def test_model_dir_without_weights(capsys, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    out = tmp_path / "run"
    _fails(capsys, ["run", SMOKE, "--set", f'experiment.model="{model}"', "--out", str(out)], "no weights")
    assert not out.exists()


def test_missing_config_file(capsys, tmp_path):
    _fails(capsys, ["run", str(tmp_path / "nope.toml")], "nope.toml", "does not exist")


def test_out_dir_that_holds_a_run(capsys, tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    _fails(capsys, ["run", SMOKE, "--set", f'experiment.model="{tiny_model_dir}"', "--out", str(out)],
           "already holds files")
    assert (out / "summary.json").read_text() == "{}"  # nothing of the user's is touched


def test_unwritable_out_dir(capsys, tiny_model_dir):
    _fails(capsys, ["run", SMOKE, "--set", f'experiment.model="{tiny_model_dir}"', "--out", "/proc/colora-run"],
           "/proc/colora-run")


def test_replay_step_of_a_directory_that_no_run_kept(capsys, tmp_path):
    assert main(["replay-step", str(tmp_path)]) == 2
    assert "rollouts.jsonl' is missing" in capsys.readouterr().err


def test_bad_toml(capsys, tmp_path):
    p = tmp_path / "x.toml"
    p.write_text("[experiment\nsteps = 3")
    _fails(capsys, ["run", str(p)], "not valid TOML")


def test_tasks_show(capsys):
    assert main(["tasks", "show", "countdown", "--n", "2", "--split", "eval"]) == 0
    out = capsys.readouterr().out
    assert out.count("countdown/eval/") == 2


def test_bench_help_is_each_benchmarks_own(capsys):
    """`colora bench arms --help` printed the generic bench help."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "arms", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: colora bench arms") and "--seeds" in out and "run seeds (default 1 2 3)" in out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "colora bench WHAT --help" in capsys.readouterr().out


def test_every_option_says_what_it_does():
    """`--n`, `--seed`, `--dtype` and the positional arguments had no help text."""
    import argparse

    from colora.cli import build_parser

    def parsers(p: argparse.ArgumentParser, name: str):
        yield name, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    if sp.add_help:  # the passthrough commands' own modules parse their arguments
                        yield from parsers(sp, f"{name} {sub}")

    bare = [(name, a.dest) for name, p in parsers(build_parser(), "colora") for a in p._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert bare == []


def test_help_describes_every_subcommand_in_a_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ("run", "model", "tasks", "bench", "sweep", "report", "prereg", "replay-step"):
        at = next(i for i, x in enumerate(lines) if x.split() and x.split()[0] == name)
        words = lines[at].split()[1:] or lines[at + 1].split()  # a long name puts its description below
        assert len(words) >= 3, (name, lines[at:at + 2])


_FAKE_RUN = '''
import sys
from pathlib import Path
import colora.run.closing, colora.run.runner
from colora.cli import main

summary = {"wall_s": 1.0, "engine_start_s": 0.0, "jobs": {
    "count": {"status": "done", "reason": ""},
    "mod": {"status": sys.argv[2], "reason": "reward of task 'modular' raised ZeroDivisionError: division by zero"}}}
if sys.argv[3] == "named":
    summary["failed_jobs"] = ["mod"]
colora.run.runner.run = lambda cfg, out: summary  # the run itself is not what is tested here
colora.run.closing.print_closing = lambda summary, out: None
sys.exit(main(["run", sys.argv[1], "--out", sys.argv[4]]))
'''


@pytest.mark.parametrize("status, named, code", [("stopped", "named", 1), ("stopped", "", 1), ("failed", "", 1),
                                                 ("done", "", 0)])
def test_a_run_with_a_failed_job_exits_1_and_says_which_last(tmp_path, status, named, code):
    """A run whose job failed (a raising reward, a NaN) exited 0. Read from summary.json's
    `failed_jobs` and from each job's status, so either says it."""
    import subprocess
    import sys

    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", _FAKE_RUN, SMOKE, status, named, str(out)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == code, p.stderr
    if code:
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("colora: error: 1 of 2 jobs failed (mod: reward of task 'modular' raised "
                               "ZeroDivisionError: division by zero)"), last
        assert f"{out / 'summary.json'} (jobs.NAME.reason)" in last and str(out / "run.log") in last
    else:
        assert "error" not in p.stderr


def test_failed_jobs_reads_either_record():
    from colora.cli import failed_jobs

    jobs = {"a": {"status": "done", "reason": ""}, "b": {"status": "stopped", "reason": "loss is nan"}}
    assert failed_jobs({"jobs": jobs}) == {"b": "loss is nan"}
    assert failed_jobs({"jobs": jobs, "failed_jobs": ["b"]}) == {"b": "loss is nan"}
    assert failed_jobs({"jobs": {"a": jobs["a"]}, "failed_jobs": {"c": "co-runner 1 died"}}) == {"c": "co-runner 1 died"}
    assert failed_jobs({"jobs": {"a": jobs["a"]}}) == {}
