"""One run's output: its run.log, its progress (a live bar, or plain lines where there is no terminal)
and the lines of it that the terminal shows (colora/output.py's session decides where they go).

    with run_output(out / "run.log", "shared_sync seed 0", jobs, steps, log) as shown: ...

Called from Python without a session (`colora.run.runner.run` in a test, say), run.log holds colora's own
lines and the caller's `log` receives them.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from rich.progress import TaskID

from colora import output

PLAIN_LINES = 10  # plain progress lines per run (and one at the end), where no live bar is drawn
TAIL_ON_FAILURE = 15  # lines of run.log shown when a run fails at default verbosity
# colora's own lines that the terminal does not show at default verbosity: the per-step line
# (output.STEP_LINE: the bar shows it), and chatty notes that run.log keeps.
_CHATTY = re.compile(r"^(checkpoint \S+ written|regrouping )")


class RunOutput:
    """One run's log file, its progress and the lines of it the terminal shows. `log` is colora's
    line sink for the run; `metric` and `span` receive every row of metrics.jsonl and
    timeline.jsonl as it is written (colora/record/runlog.py JsonlWriter's `on_row`), from any thread."""

    def __init__(self, path: Path, label: str, jobs: list[str], steps: int, log: Callable[[str], None] | None):
        self.path = Path(path)
        self.file = open(self.path, "ab", buffering=0)
        self.session = output.current()
        self.caller_log = log
        self.label = label
        self.steps = steps
        self.job_step = {j: 0 for j in jobs}
        self.first_reward: dict[str, float] = {}
        self.last_reward: dict[str, float] = {}
        self.last_loss: dict[str, float] = {}  # an sft job's (it has no reward)
        self.stopped: set[str] = set()
        self._pending_jobs: set[str] = set()
        self._lock = threading.Lock()
        self.t0 = time.monotonic()
        self.t_train: float | None = None  # when training began (after the first evaluation)
        self.done_at_train = 0
        self.phase = "starting"
        self._plain_next = 0  # the job-steps count at which the next plain line is due
        self._task: TaskID | None = None
        s = self.session
        if s is not None:
            s.open_log(self.file)
            if s.progress is not None:
                self._task = s.progress.add_task(label, total=self.steps, info=self.phase)

    # the counts
    @property
    def done(self) -> int:
        return sum(self.job_step.values())

    @property
    def total(self) -> int:
        """Job-steps of the run: every running job's steps, a stopped job's as far as it got."""
        return sum(n if j in self.stopped else self.steps for j, n in self.job_step.items())

    def steps_shown(self) -> int:
        """The run's progress in steps of a job, out of `steps` (experiment.steps), as the bar and the
        plain lines show it: the share of its job-steps done, so a run of 2 jobs and 4 steps is at 4/4
        when both did 4, and exactly at k where the jobs step together."""
        total = self.total
        return self.steps if self.done >= total else self.steps * self.done // max(1, total)

    def eta(self) -> str:
        if self.done >= self.total:
            return "training done"
        if self.t_train is None or self.done <= self.done_at_train:
            return "ETA after the first step"
        rate = (self.done - self.done_at_train) / max(1e-9, time.monotonic() - self.t_train)
        return f"ETA {output.duration((self.total - self.done) / rate)}"

    def rewards(self) -> str:
        """Each job's latest step's mean reward, an sft job's loss ("-" before its first step)."""
        def one(j: str) -> str:
            if j in self.stopped:
                return "stopped"
            if j in self.last_loss:
                return f"loss {self.last_loss[j]:.2f}"
            return format(self.last_reward[j], ".2f") if j in self.last_reward else "-"

        return " ".join(f"{j} {one(j)}" for j in self.job_step)

    # colora's lines
    def log(self, line: str) -> None:
        data = (line + "\n").encode("utf-8", "replace")
        s = self.session
        if s is not None:
            s.write_log(self.file, data)
        else:
            self.file.write(data)
        if self.caller_log is not None:
            self.caller_log(line)
        if s is None:
            return
        if s.verbose:
            s.say(line)
        elif output.WARNING.match(line) or not (output.STEP_LINE.match(line) or _CHATTY.match(line) or s.in_sweep):
            s.say(("  " if s.in_sweep else "") + line, style="yellow" if output.WARNING.match(line) else None)

    # the rows of the run's record
    def metric(self, row: dict) -> None:
        with self._lock:
            job = row.get("job")
            if job not in self.job_step:
                return
            if row.get("status") == "stopped":
                self.stopped.add(job)
            elif row.get("status") == "ok" and "reward" in row and "event" not in row:
                self.job_step[job] = int(row["step"]) + 1
                self.first_reward.setdefault(job, float(row["reward"]))
                self.last_reward[job] = float(row["reward"])
            elif row.get("status") == "ok" and row.get("kind") == "sft" and "event" not in row:
                self.job_step[job] = int(row["step"]) + 1
                self.last_loss[job] = float(row["loss"])
            self._pending_jobs.discard(job)
            if self.t_train is None:  # a resumed run evaluates nothing first: the rate starts here
                self.phase, self.t_train, self.done_at_train = "training", time.monotonic(), self.done
            if not self._pending_jobs and "event" not in row:
                self._show()

    def span(self, row: dict) -> None:
        with self._lock:
            phase, when = row.get("phase"), row.get("when")
            if phase == "train":
                self._pending_jobs = set(row.get("jobs") or ())
            elif phase in ("engine_start", "engine_warmup"):
                self.phase = "warming up" if phase == "engine_start" else "evaluating before training"
            elif phase == "eval" and when == "before":
                self.phase, self.t_train, self.done_at_train = "training", time.monotonic(), self.done
            elif phase == "eval" and when == "after":
                self.phase = "finishing"
            else:
                return
            if self._task is not None:
                self._update_bar()

    def _update_bar(self) -> None:
        info = self.phase if self.phase != "training" else f"{self.rewards()}  {self.eta()}"
        self.session.progress.update(self._task, completed=self.steps_shown(), total=self.steps, info=info)

    def _show(self) -> None:
        """After each training step of a group: the bar, or a plain line every tenth of the run."""
        s = self.session
        if s is None:
            return
        if self._task is not None:
            self._update_bar()
            return
        if self.done < self._plain_next and self.done < self.total:
            return
        self._plain_next = self.done + max(1, math.ceil(self.total / (output.PLAIN_LINES_IN_SWEEP if s.in_sweep
                                                                      else PLAIN_LINES)))
        s.say(f"{'  ' if s.in_sweep else ''}steps {self.steps_shown()}/{self.steps} | {self.rewards()} | "
              f"{output.duration(time.monotonic() - self.t0)} elapsed, {self.eta()}")

    def close(self, failed: bool) -> None:
        s = self.session
        if s is not None and s.progress is not None and self._task is not None:
            s.progress.remove_task(self._task)
            s.progress.refresh()  # else the next line printed redraws the bar's last frame
        if failed and s is not None and not s.verbose:
            s.drain()
            s.say(f"the run failed; the last lines of its log ({self.path}):", style="red")
            for line in tail(self.path, TAIL_ON_FAILURE):
                s.say("  " + line)
        if s is None or not s.logs_into(self.file):  # the session keeps its last log for what follows
            self.file.close()


def tail(path: Path, n: int) -> list[str]:
    """The last `n` non-empty lines of a text file (a progress bar's carriage returns split lines)."""
    try:
        text = Path(path).read_bytes()[-(200 * n + 4096):].decode("utf-8", "replace")
    except OSError:
        return []
    return [x for x in re.split(r"[\r\n]+", text) if x.strip()][-n:]


@contextlib.contextmanager
def run_output(path: Path, label: str, jobs: list[str], steps: int,
               log: Callable[[str], None] | None = None) -> Iterator[RunOutput]:
    """One run's output (RunOutput) while the block runs; on an exception (but a stop by a signal)
    the terminal gets the log's last lines."""
    out = RunOutput(path, label, jobs, steps, log)
    try:
        yield out
    except KeyboardInterrupt:  # a stop (colora/stopping.py): the run's own lines say how to go on
        out.close(failed=False)
        raise
    except BaseException:
        out.close(failed=True)
        raise
    out.close(failed=False)
