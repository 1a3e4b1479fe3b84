"""What a person sees of a run and what run.log keeps (colora/output.py).

The session redirects the process's file descriptors, so each case runs in a child Python whose
stdout and stderr are pipes (not a terminal: the progress degrades to plain lines), with the
third-party output a run makes: a library's logging, C-level writes, a child process, a tqdm bar.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from colora.run import closing, progress

SCRIPT = textwrap.dedent('''
    import logging, os, subprocess, sys
    from pathlib import Path
    from tqdm import tqdm
    from colora import output
    from colora.run import progress

    out, mode = Path(sys.argv[1]), sys.argv[2]
    logging.basicConfig(level=logging.INFO)  # a library's handler on stderr, as vLLM's is
    with output.session(verbose=mode == "verbose", stream="stdout"):
        print("third-party before the first run")
        output.say("colora: the command's header")
        if mode == "sweep":
            output.sweep_started(3)
        with progress.run_output(out / "run.log", "shared_sync seed 0", ["a", "b"], 2) as r:
            logging.getLogger("vllm").info("vllm's INFO line")
            os.write(2, b"c10d socket warning, written by C code\\n")
            subprocess.run([sys.executable, "-c", "import sys; print('engine core stdout'); "
                            "print('engine core stderr', file=sys.stderr)"])
            for _ in tqdm(range(3), desc="Loading weights"):
                pass
            r.log("engine ready (it took 1.0s to start)")
            r.span({"phase": "eval", "when": "before"})
            for step in range(2):
                r.span({"phase": "train", "jobs": ["a", "b"]})
                for j in "ab":
                    r.metric({"job": j, "step": step, "reward": 0.25 * (step + 1), "status": "ok"})
                r.log(f"step {step + 1}/2 | a r=0.25 b r=0.25 | gen 1.0s train 0.5s")
            r.log("warning: something colora chose to say")
            if mode == "handover":
                with output.handover():
                    subprocess.run([sys.executable, "-c", "print('a child that draws its own output')"])
            if mode == "fail":
                print("the traceback a library printed", file=sys.stderr)
                raise SystemExit(3)
            if mode == "stop":  # a signal's stop (colora/stopping.py Interrupted is a KeyboardInterrupt)
                raise KeyboardInterrupt
        print("third-party after the run")
        output.say("colora: done")
''')

THIRD_PARTY = ["third-party before the first run", "vllm's INFO line", "c10d socket warning", "engine core stdout",
               "engine core stderr", "Loading weights", "third-party after the run"]


def _run(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), str(tmp_path), mode], capture_output=True, text=True, timeout=120)
    return p, (tmp_path / "run.log").read_text()


def test_quiet_by_default_and_everything_in_run_log(tmp_path):
    p, log = _run(tmp_path, "quiet")
    assert p.returncode == 0, p.stderr
    shown = p.stdout + p.stderr
    for line in THIRD_PARTY:
        assert line not in shown, line
        assert line in log, line
    assert p.stderr == ""
    lines = p.stdout.splitlines()
    assert lines[0] == "colora: the command's header" and lines[-1] == "colora: done"
    assert "engine ready (it took 1.0s to start)" in lines
    assert "warning: something colora chose to say" in lines
    # the progress as plain lines (stdout is a pipe), not the per-step lines the bar replaces; in steps
    # of a job, out of the run's steps (2), not in job-steps (4 for 2 jobs)
    progress = [x for x in lines if x.startswith("steps ")]
    assert [x.split(" | ")[:2] for x in progress] == [["steps 1/2", "a 0.25 b 0.25"], ["steps 2/2", "a 0.50 b 0.50"]]
    assert "elapsed" in progress[0] and "ETA" in progress[0]
    assert not any(x.startswith("step 1/2 |") for x in lines)
    assert "step 1/2 | a r=0.25" in log and "engine ready" in log  # colora's own lines are in the log too


def test_inside_a_sweep_a_run_shows_its_warnings_and_progress_only(tmp_path):
    p, log = _run(tmp_path, "sweep")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "engine ready (it took 1.0s to start)" not in "\n".join(lines) and "engine ready" in log
    assert "  warning: something colora chose to say" in lines
    assert [x.split(" | ")[0] for x in lines if x.strip().startswith("steps ")] == ["  steps 1/2", "  steps 2/2"]


def test_verbose_shows_everything_and_the_log_still_has_it(tmp_path):
    p, log = _run(tmp_path, "verbose")
    assert p.returncode == 0, p.stderr
    for line in THIRD_PARTY:
        assert line in p.stdout + p.stderr, line
        assert line in log, line
    assert "vllm's INFO line" in p.stderr and "engine core stdout" in p.stdout  # each stream where it was written
    assert "step 1/2 | a r=0.25 b r=0.25" in p.stdout


def test_a_child_handed_the_terminal_writes_to_it(tmp_path):
    p, log = _run(tmp_path, "handover")
    assert p.returncode == 0, p.stderr
    assert "a child that draws its own output" in p.stdout and "a child that draws its own output" not in log
    assert "engine core stdout" not in p.stdout  # captured again after the handover


def test_a_failed_run_shows_the_end_of_its_log(tmp_path):
    p, log = _run(tmp_path, "fail")
    assert p.returncode == 3
    after = p.stdout.split("the run failed; the last lines of its log", 1)
    assert len(after) == 2 and str(tmp_path / "run.log") in after[1]
    assert "the traceback a library printed" in after[1]


def test_a_run_stopped_by_a_signal_is_no_failure(tmp_path):
    p, log = _run(tmp_path, "stop")
    assert "KeyboardInterrupt" in p.stderr and "warning: something colora chose to say" in p.stdout
    assert "the run failed" not in p.stdout + p.stderr


def test_without_a_session_run_log_holds_colora_lines_and_the_caller_gets_them(tmp_path, capfd):
    said = []
    with progress.run_output(tmp_path / "run.log", "x", ["a"], 1, log=said.append) as r:
        r.log("engine ready")
        r.metric({"job": "a", "step": 0, "reward": 1.0, "status": "ok"})
    assert said == ["engine ready"]
    assert (tmp_path / "run.log").read_text() == "engine ready\n"
    assert capfd.readouterr() == ("", "")


SUMMARY = {"experiment": "smoke", "arm": "shared_sync", "seed": 0, "steps_per_hour": 1234.4, "steps_measured": 4,
           "seconds_measured": 11.7,
           "jobs": {"add": {"status": "done", "reason": "", "steps": 3, "eval_before": 0.125, "eval_after": 0.5},
                    "mod": {"status": "stopped", "reason": "loss is nan", "steps": 1, "eval_before": 0.25,
                            "eval_after": None}}}
ROWS = [{"job": "add", "step": 0, "reward": 0.1, "status": "ok"}, {"job": "add", "event": "reload", "version": 1},
        {"job": "add", "step": 2, "reward": 0.6, "status": "ok"},  # out of order: the steps say which is last
        {"job": "add", "step": 1, "reward": 0.3, "status": "ok"},
        {"job": "mod", "step": 0, "reward": 0.2, "status": "ok"},
        {"job": "mod", "step": 1, "reward": 9.0, "status": "stopped"}]


def test_closing_table_numbers_are_the_summary_and_metrics(tmp_path):
    rows = closing.closing_rows(SUMMARY, ROWS)
    assert rows == [
        {"job": "add", "status": "done", "reason": "", "steps": 3, "reward_first": 0.1, "reward_last": 0.6,
         "eval_before": 0.125, "eval_after": 0.5},
        {"job": "mod", "status": "stopped", "reason": "loss is nan", "steps": 1, "reward_first": 0.2,
         "reward_last": 0.2, "eval_before": 0.25, "eval_after": None}]
    table, notes = closing.closing_table(SUMMARY, ROWS)
    console = Console(width=80, record=True, file=open(tmp_path / "t.txt", "w"))
    console.print(table)
    text = console.export_text()
    assert all(len(x) <= 80 for x in text.splitlines())  # no wrapped cell in an 80-column log
    add = next(x for x in text.splitlines() if " add " in x)
    assert "0.10 -> 0.60" in add and "0.12 -> 0.50" in add and " 3 " in add
    total = next(x for x in text.splitlines() if "all jobs" in x)
    assert "1234" in total and " 4 " in total
    assert "mod stopped: loss is nan" in notes
    assert any("too short for the figure to mean much" in x for x in notes)  # 11.7 s, 2 steps per job


@pytest.mark.vllm
@pytest.mark.slow
def test_colora_run_is_short_quiet_and_keeps_the_full_log(tmp_path, tiny_model_dir):
    """The command as a person runs it, stdout a pipe: a few dozen lines of colora's own, vLLM's
    logs only in run.log, and a closing table that says what summary.json says."""
    out = tmp_path / "run"
    sets = [f"experiment.model={json.dumps(str(tiny_model_dir))}", "experiment.steps=2", "experiment.eval_size=4",
            "jobs.*.prompts_per_step=2", "jobs.*.samples_per_prompt=2", "jobs.*.max_new_tokens=8"]
    argv = [sys.executable, "-m", "colora.cli", "run", str(Path(__file__).parents[1] / "experiments" / "smoke.toml"),
            "--out", str(out)] + [x for s in sets for x in ("--set", s)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    shown = (p.stdout + p.stderr).splitlines()
    log = (out / "run.log").read_text()
    assert len(shown) <= 40, "\n".join(shown)
    assert "INFO" in log and "vllm" in log.lower()  # vLLM's own logging, captured
    assert not any("INFO" in x or "WARNING" in x for x in shown), "\n".join(shown)
    summary = json.loads((out / "summary.json").read_text())
    for name, j in summary["jobs"].items():
        row = next(x for x in shown if f" {name} " in x and "->" in x)
        assert f"{j['eval_before']:.2f} -> {j['eval_after']:.2f}" in row and f" {j['steps']} " in row
    assert any("all jobs" in x and f"{summary['steps_per_hour']:.0f}" in x for x in shown)


ELSEWHERE = textwrap.dedent('''
    import sys
    from colora import output

    with output.session(verbose=sys.argv[1] == "verbose", stream="stdout"):
        output.sweep_started(2)
        for step in range(1, 9):
            output.run_line("ded", f"step {step}/8 | a r=0.{step}0 | gen 0.1s train 0.2s")
            if step == 3:
                output.run_line("ded", "warning: a job warned")
                output.run_line("ded", "engine ready (it took 1.0s to start)")
        output.run_ended("ded")
        output.run_line("mps", "groups 0,1 2/2 | b r=0.50 | gen 0.1s train 0.2s")
''')


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_a_run_in_another_process_shows_its_progress_and_warnings(tmp_path, mode):
    """The lines of a co-runner's log relayed to a parallel sweep's terminal (output.run_line): its
    steps every quarter of the run and at its end, its warnings, nothing else; every line with --verbose."""
    script = tmp_path / "elsewhere.py"
    script.write_text(ELSEWHERE)
    p = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    if mode == "verbose":
        assert "[ded] engine ready (it took 1.0s to start)" in lines and "[ded] step 2/8 | a r=0.20 | gen 0.1s train 0.2s" in lines
        assert len(lines) == 11
        return
    assert lines == [f"  [ded] step {n}/8 | a r=0.{n}0" for n in (1, 3)] + ["  [ded] warning: a job warned"] + \
        [f"  [ded] step {n}/8 | a r=0.{n}0" for n in (5, 7, 8)] + ["  [mps] step 2/2 | b r=0.50"]


def test_a_lingering_resource_tracker_does_not_hold_the_session_open(tmp_path):
    """multiprocessing's resource tracker (started by the first spawned child, vLLM's engine core
    say) lives until the process exits; the session's pipes must not wait for it when it closes.
    In a fresh process, so that no tracker is running before the session opens."""
    script = tmp_path / "tracker.py"
    script.write_text(textwrap.dedent('''
        import multiprocessing as mp
        from colora import output

        def child():
            print("a spawned child's line")

        if __name__ == "__main__":
            with output.session(verbose=False, stream="stdout") as s:
                p = mp.get_context("spawn").Process(target=child)
                p.start()
                p.join()
                capture = s._capture
            print("pipes still held:", sum(t.is_alive() for t in capture.threads))
    '''))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "pipes still held: 0" in p.stdout, p.stdout + p.stderr


def test_a_drain_returns_only_after_what_came_with_its_mark_is_in_the_log():
    """The mark that `Session.drain` writes often arrives in one read with the output before it (the
    failed run's last traceback line): the drain is done only once that output is in the log."""
    import threading
    import types

    from colora import output

    log = []

    class Done(threading.Event):
        def set(self):
            assert b"".join(log) == b"the traceback a library printed\n", "drained before the output was routed"
            super().set()

    session = types.SimpleNamespace(_lock=threading.Lock(), _sink=types.SimpleNamespace(write=log.append),
                                    verbose=False, _drained={2: Done()})
    output.Session._route(session, 2, b"the traceback a library printed\n" + output._MARK)
    assert session._drained[2].is_set() and b"".join(log) == b"the traceback a library printed\n"


def test_the_bar_counts_steps_of_a_job_not_job_steps(tmp_path, monkeypatch):
    """A run of 2 jobs and `steps = 4` showed 8/8. The bar shows the run's steps, as the
    config gives them; a stopped job's steps count as far as they got."""
    import types

    from colora import output

    updates = []
    bar = types.SimpleNamespace(add_task=lambda label, total, info: updates.append(("add", total)) or 1,
                                update=lambda task, completed, total, info: updates.append((completed, total)),
                                remove_task=lambda task: None, refresh=lambda: None)
    session = types.SimpleNamespace(progress=bar, verbose=False, in_sweep=False, open_log=lambda f: None,
                                    write_log=lambda f, data: f.write(data), say=lambda *a, **k: None,
                                    logs_into=lambda f: False)
    monkeypatch.setattr(output, "current", lambda: session)
    with progress.run_output(tmp_path / "run.log", "shared_sync seed 0", ["a", "b"], 4) as r:
        r.span({"phase": "eval", "when": "before"})
        for step in range(4):
            r.span({"phase": "train", "jobs": ["a", "b"]})
            for j in "ab":
                r.metric({"job": j, "step": step, "reward": 0.5, "status": "ok"})
    assert updates[0] == ("add", 4) and {total for _, total in updates} == {4}
    assert list(dict.fromkeys(completed for completed, _ in updates[1:])) == [0, 1, 2, 3, 4]
    updates.clear()
    with progress.run_output(tmp_path / "run2.log", "shared_sync seed 0", ["a", "b"], 4) as r:
        r.span({"phase": "eval", "when": "before"})
        r.span({"phase": "train", "jobs": ["a", "b"]})
        r.metric({"job": "a", "step": 0, "reward": 0.5, "status": "ok"})
        r.metric({"job": "b", "status": "stopped"})  # b stopped before its first step: a's 4 are the run
        for step in range(1, 3):
            r.span({"phase": "train", "jobs": ["a"]})
            r.metric({"job": "a", "step": step, "reward": 0.5, "status": "ok"})
    assert updates[-1] == (3, 4)


def test_steps_without_reward_signal_are_not_said_to_have_taught_nothing():
    """`make smoke` warned that job count "learned nothing" from 9 steps in a row without reward
    variance while its held-out accuracy rose 0.00 -> 0.56 over the 24 steps."""
    from colora.record.summary import JobSummary, warnings

    [w] = warnings({"count": JobSummary("done", "", 24, 24, 0.4, 0.0, 0.56, 15, 9)})
    assert w.startswith("job count: every group's rewards were equal for 9 steps in a row (15 of its 24 steps")
    assert "learned nothing" not in w and "no gradient in those steps, only in the other 9" in w


def test_a_sweeps_line_of_a_run_says_when_its_rate_means_little():
    """A sweep's per-run lines gave steps/h from 1-3 s windows without the report's warning."""
    from colora.record.throughput import rate_line

    short = {"steps_per_hour": 4321.0, "seconds_measured": 2.5, "steps_measured": 2, "jobs": {"a": {}, "b": {}}}
    assert rate_line(short) == ("4321 steps/h (measured over 2.5 s and 1 step per job: too short for the figure "
                                "to mean much (under 30 s or 5 steps per job))")
    long = {**short, "seconds_measured": 600.0, "steps_measured": 40}
    assert rate_line(long) == "4321 steps/h"
