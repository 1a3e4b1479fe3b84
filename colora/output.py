"""What a person sees while colora runs, and what each run directory keeps of it.

    colora run CONFIG [--verbose] | colora sweep ... [--verbose] | colora bench arms ... [--verbose]

Each of these commands opens one `session` for its process. While it is open, the process's file
descriptors 1 and 2 are pipes that colora reads, so everything written there goes to the run.log of
the run in progress: vLLM's, transformers', torch's and Triton's logs and warnings, third-party
progress bars ("Loading weights", GGUF conversion), the C++ runtime's messages (c10d), and the
output of every child process started meanwhile (vLLM's engine core writes to the descriptors it
inherits). What arrives before a process's first run goes to that run's log, what arrives between
or after runs to the log of the run before. With `--verbose` all of it is shown on the terminal as
well; without, the terminal gets colora's own lines only: milestones, warnings, a progress bar per
run (step, reward per job, elapsed, ETA) and per sweep (runs done, ETA), drawn live by rich on a
terminal and as plain lines anywhere else (CI logs, files, the device tool), and the closing table.

Called from Python without a session (`colora.runner.run` in a test, say), nothing is captured:
run.log holds colora's own lines and the caller's `log` receives them.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

_MARK = b"\x00colora-drained\x00"  # written into the pipes by `Session.drain`, never routed
PENDING_MAX = 4 << 20  # bytes of output kept while no run log is open yet (the newest are kept)
PLAIN_LINES = 10  # plain progress lines per run (and one at the end), where no live bar is drawn
PLAIN_LINES_IN_SWEEP = 4  # the same for each run of a sweep, whose own lines say when each run starts and ends
TAIL_ON_FAILURE = 15  # lines of run.log shown when a run fails at default verbosity

# colora's own lines that the terminal does not show at default verbosity: the per-step line (the
# bar shows it), and chatty notes that run.log keeps.
_HIDDEN = re.compile(r"^((step|groups [\d,]+) \d+/\d+ \||checkpoint \S+ written|regrouping )")
# the lines shown even inside a sweep (where a run's milestones are left to its log)
_WARNING = re.compile(r"^(warning|job \S+ stopped|kept what|checkpoint \S+ is unusable)", re.IGNORECASE)


def duration(s: float) -> str:
    """Seconds as a person reads them: 42s, 3m07s, 1h05m."""
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# -- capturing the process's output -------------------------------------------------------------
class _Capture:
    """File descriptors 1 and 2 pointed at two pipes, a thread per pipe handing what arrives to
    `route(fd, data)`. `release`/`resume` point them back at the terminal and at the pipes again
    (a child process started in between inherits the terminal)."""

    def __init__(self, route: Callable[[int, bytes], None]):
        _flush_python_streams()
        self.saved = {fd: os.dup(fd) for fd in (1, 2)}  # the terminal (or whatever 1 and 2 were)
        self.writers: dict[int, int] = {}
        self.threads = []
        for fd in (1, 2):
            r, w = os.pipe()
            self.writers[fd] = w
            t = threading.Thread(target=self._pump, args=(r, fd, route), name=f"colora-capture-{fd}", daemon=True)
            t.start()
            self.threads.append(t)
        self.resume()

    @staticmethod
    def _pump(r: int, fd: int, route: Callable[[int, bytes], None]) -> None:
        with contextlib.suppress(OSError):
            while data := os.read(r, 1 << 16):  # empty: every writer (children too) has closed it
                route(fd, data)
        os.close(r)

    def resume(self) -> None:
        _flush_python_streams()
        for fd, w in self.writers.items():
            os.dup2(w, fd)

    def release(self) -> None:
        _flush_python_streams()
        for fd, saved in self.saved.items():
            os.dup2(saved, fd)

    def close(self, wait_s: float = 2.0) -> None:
        """The descriptors back as they were; the pipes drain until no child holds them."""
        self.release()
        for w in self.writers.values():
            os.close(w)
        deadline = time.monotonic() + wait_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _flush_python_streams() -> None:
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()


def _terminal_file(stream, fd: int, saved: int):
    """Where colora's console writes: the descriptor `fd` was before the capture when `stream`
    writes to it, else `stream` itself (something else, pytest's capsys say, already holds it)."""
    try:
        backed = stream.fileno() == fd
    except (AttributeError, OSError, ValueError):
        backed = False
    if not backed:
        return stream
    return os.fdopen(saved, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


# -- the session --------------------------------------------------------------------------------
class Session:
    """This process's terminal while a command runs (see the module docstring)."""

    def __init__(self, verbose: bool, stream: str):
        self.verbose = verbose
        self._lock = threading.Lock()
        self._sink = None  # the run log that captured output goes to
        self._pending: list[bytes] = []  # captured before any run log opened
        self._pending_bytes = 0
        self._capture = _Capture(self._route)
        fd = 1 if stream == "stdout" else 2
        self.file = _terminal_file(sys.stdout if fd == 1 else sys.stderr, fd, self._capture.saved[fd])
        self.console = Console(file=self.file, highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal and not verbose
        self.progress = None
        if self.live:
            # no redirect of sys.stdout/sys.stderr: third-party prints belong in run.log
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24),
                                     TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                     TextColumn("{task.fields[info]}"), console=self.console, transient=True,
                                     refresh_per_second=4, redirect_stdout=False, redirect_stderr=False)
            self.progress.start()
        self.in_sweep = False
        self._sweep_task: TaskID | None = None
        self._drained: dict[int, threading.Event] = {}

    def drain(self, timeout_s: float = 2.0) -> None:
        """Wait until everything this process has written to 1 and 2 so far has been routed."""
        _flush_python_streams()
        self._drained = {fd: threading.Event() for fd in (1, 2)}
        for w in self._capture.writers.values():
            os.write(w, _MARK)
        deadline = time.monotonic() + timeout_s
        for ev in self._drained.values():
            ev.wait(max(0.0, deadline - time.monotonic()))

    def _route(self, fd: int, data: bytes) -> None:
        if _MARK in data:
            data = data.replace(_MARK, b"")
            if fd in self._drained:
                self._drained[fd].set()
        with self._lock:
            if self._sink is not None:
                self._sink.write(data)
            else:
                self._pending.append(data)
                self._pending_bytes += len(data)
                while self._pending_bytes > PENDING_MAX and len(self._pending) > 1:
                    self._pending_bytes -= len(self._pending.pop(0))
        if self.verbose:
            with contextlib.suppress(OSError):
                os.write(self._capture.saved[fd], data)

    def open_log(self, f) -> None:
        """Captured output goes to `f` (a binary file) from now on; what came before any log, too.
        The previous run's log, kept open for what arrived after its run, is closed."""
        with self._lock:
            for chunk in self._pending:
                f.write(chunk)
            self._pending.clear()
            self._pending_bytes = 0
            previous, self._sink = self._sink, f
        if previous is not None and previous is not f:
            previous.close()

    def write_log(self, f, data: bytes) -> None:
        """A line of colora's own into a run log, between the captured chunks."""
        with self._lock:
            f.write(data)

    def say(self, line: str, style: str | None = None) -> None:
        self.console.print(Text(line, style=style or ""))

    @contextlib.contextmanager
    def handover(self) -> Iterator[None]:
        """The terminal given to a child process that draws its own: no live bar meanwhile, and
        descriptors 1 and 2 back on the terminal, so the child inherits them."""
        if self.progress is not None:
            self.progress.stop()
        self._capture.release()
        try:
            yield
        finally:
            self._capture.resume()
            if self.progress is not None:
                self.progress.start()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self._capture.close()
        with self._lock:
            leftover, self._pending = b"".join(self._pending), []
            sink, self._sink = self._sink, None
        if sink is not None:
            with contextlib.suppress(ValueError, OSError):
                sink.write(leftover)
                sink.close()
        elif leftover and not self.verbose:  # no run ever opened a log: it is all there is to show
            with contextlib.suppress(OSError):
                os.write(self._capture.saved[2], leftover)
        for saved in self._capture.saved.values():
            with contextlib.suppress(OSError):
                os.close(saved)


_current: Session | None = None


@contextlib.contextmanager
def session(verbose: bool = False, stream: str = "stdout") -> Iterator[Session]:
    """The terminal of this process for one command; `stream`: where colora's own lines go
    ("stdout" for `colora run`, "stderr" for the sweep's, as the commands have always printed)."""
    global _current
    if _current is not None:  # a command run inside another (a test calling main twice, say)
        yield _current
        return
    _current = Session(verbose, stream)
    try:
        yield _current
    finally:
        s, _current = _current, None
        s.close()


def say(line: str) -> None:
    """One of colora's own lines: on the session's console, else on stderr."""
    if _current is not None:
        _current.say(line)
    else:
        print(line, file=sys.stderr, flush=True)


def say_at_once(line: str, exiting: bool = False) -> None:
    """One of colora's lines from a signal handler (colora/stopping.py), which may have interrupted
    this process's own printing: into the run log with one os.write, and onto the console by a
    thread that waits for the console's lock (at most a second; rich prints it above a live bar).
    `exiting`: the process ends at once afterwards (os._exit), so a line the thread could not print
    in that second is written to the terminal directly."""
    data = (line + "\n").encode("utf-8", "replace")
    s = _current
    if s is None:
        with contextlib.suppress(OSError):
            os.write(2, data)
        return
    sink = s._sink
    if sink is not None:
        with contextlib.suppress(OSError, ValueError):
            os.write(sink.fileno(), data)
    t = threading.Thread(target=s.say, args=(line,), name="colora-say", daemon=True)
    t.start()
    t.join(1.0)
    if t.is_alive() and exiting:
        with contextlib.suppress(OSError, ValueError):
            os.write(s.file.fileno(), b"\n" + data)


@contextlib.contextmanager
def handover() -> Iterator[None]:
    """See `Session.handover`; nothing to do without a session."""
    if _current is None:
        yield
    else:
        with _current.handover():
            yield


# -- the sweep's bar ----------------------------------------------------------------------------
def sweep_started(todo: int) -> None:
    """A plan of `todo` runs starts in this process (colora/orchestrate.py): the sweep's bar."""
    s = _current
    if s is None:
        return
    s.in_sweep = True
    if s.progress is not None and todo:
        s._sweep_task = s.progress.add_task("sweep", total=todo, info="runs done; ETA after the first run")


def sweep_progress(done: int, eta: str) -> None:
    s = _current
    if s is not None and s.progress is not None and s._sweep_task is not None:
        left = next(t.total for t in s.progress.tasks if t.id == s._sweep_task) - done
        s.progress.update(s._sweep_task, completed=done, info="runs done" + (f"; {eta}" if left else ""))


def log_into(path: Path) -> None:
    """From now on what this process writes to 1 and 2 (a library's lines: Ray's) goes to `path`,
    appended, until a run opens its log; nothing to do without a session."""
    if _current is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _current.open_log(open(path, "ab", buffering=0))


def run_line(label: str, line: str) -> None:
    """A line of a run that goes on in another process (a co-runner's, relayed from its log): shown
    as a run inside a sweep shows its own, warnings only unless --verbose; nothing without a session
    (the run's log has it)."""
    s = _current
    if s is None:
        return
    if s.verbose:
        s.say(f"[{label}] {line}")
    elif _WARNING.match(line):
        s.say(f"  [{label}] {line}", style="yellow")


# -- one run ------------------------------------------------------------------------------------
class RunOutput:
    """One run's log file, its progress and the lines of it the terminal shows. `log` is colora's
    line sink for the run; `metric` and `span` receive every row of metrics.jsonl and
    timeline.jsonl as it is written (colora/runlog.py JsonlWriter's `on_row`), from any thread."""

    def __init__(self, path: Path, label: str, jobs: list[str], steps: int, log: Callable[[str], None] | None):
        self.path = Path(path)
        self.file = open(self.path, "ab", buffering=0)
        self.session = _current
        self.caller_log = log
        self.label = label
        self.steps = steps
        self.job_step = {j: 0 for j in jobs}
        self.first_reward: dict[str, float] = {}
        self.last_reward: dict[str, float] = {}
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
                self._task = s.progress.add_task(label, total=self.total, info=self.phase)

    # the counts
    @property
    def done(self) -> int:
        return sum(self.job_step.values())

    @property
    def total(self) -> int:
        """Job-steps of the run: every running job's steps, a stopped job's as far as it got."""
        return sum(n if j in self.stopped else self.steps for j, n in self.job_step.items())

    def eta(self) -> str:
        if self.done >= self.total:
            return "training done"
        if self.t_train is None or self.done <= self.done_at_train:
            return "ETA after the first step"
        rate = (self.done - self.done_at_train) / max(1e-9, time.monotonic() - self.t_train)
        return f"ETA {duration((self.total - self.done) / rate)}"

    def rewards(self) -> str:
        """Each job's latest step's mean reward ("-" before its first step)."""
        def one(j: str) -> str:
            if j in self.stopped:
                return "stopped"
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
        elif _WARNING.match(line) or not (_HIDDEN.match(line) or s.in_sweep):
            s.say(("  " if s.in_sweep else "") + line, style="yellow" if _WARNING.match(line) else None)

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
        self.session.progress.update(self._task, completed=self.done, total=self.total, info=info)

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
        self._plain_next = self.done + max(1, math.ceil(self.total / (PLAIN_LINES_IN_SWEEP if s.in_sweep
                                                                      else PLAIN_LINES)))
        s.say(f"{'  ' if s.in_sweep else ''}steps {self.done}/{self.total} | {self.rewards()} | "
              f"{duration(time.monotonic() - self.t0)} elapsed, {self.eta()}")

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
        if s is None or s._sink is not self.file:  # the session keeps its last log for what follows
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


# -- the closing table --------------------------------------------------------------------------
def closing_rows(summary: dict, rows: list[dict]) -> list[dict]:
    """Per job: status, steps, first and last step's mean reward (metrics.jsonl's ok rows), eval
    accuracy before and after (summary.json)."""
    out = []
    for name, j in summary["jobs"].items():
        rs = sorted((r["step"], r["reward"]) for r in rows
                    if r.get("job") == name and r.get("status") == "ok" and "reward" in r and "event" not in r)
        out.append({"job": name, "status": j["status"], "reason": j.get("reason") or "", "steps": j["steps"],
                    "reward_first": rs[0][1] if rs else None, "reward_last": rs[-1][1] if rs else None,
                    "eval_before": j.get("eval_before"), "eval_after": j.get("eval_after")})
    return out


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None and b is None else f"{_num(a)} -> {_num(b)}"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def closing_table(summary: dict, rows: list[dict]) -> tuple[Table, list[str]]:
    """The table a run ends with (see `closing_rows`), its last row the run's steps per device-hour,
    and the lines under it: what the columns hold, why a job stopped, whether the window was too
    short for the steps per hour to mean much."""
    from rich import box

    from .throughput import short_window

    t = Table(title=f"{summary['experiment']}: {summary['arm']}, seed {summary['seed']}", title_justify="left",
              box=box.SIMPLE_HEAD, show_edge=False)
    for col in ("job", "status", "steps", "reward", "eval", "steps/h"):
        t.add_column(col, justify="left" if col in ("job", "status") else "right", no_wrap=True)
    cr = closing_rows(summary, rows)
    for r in cr:
        t.add_row(r["job"], r["status"], str(r["steps"]), _pair(r["reward_first"], r["reward_last"]),
                  _pair(r["eval_before"], r["eval_after"]), "")
    sph = summary.get("steps_per_hour")
    t.add_row("all jobs", "", str(sum(r["steps"] for r in cr)), "", "",
              f"{sph:.0f}" if isinstance(sph, (int, float)) and math.isfinite(sph) else "-", end_section=True)
    lines = ["reward: the mean reward of the first -> last step; eval: held-out accuracy before -> after training; "
             f"steps/h: optimizer steps per device-hour summed over jobs, over the {summary.get('steps_measured')} "
             f"job-steps measured in {summary.get('seconds_measured') or 0:.1f} s after the warm-up"]
    lines += [f"{r['job']} stopped: {r['reason']}" for r in cr if r["reason"]]
    note = short_window(summary.get("seconds_measured") or 0.0, summary.get("steps_measured") or 0, len(cr))
    if note:
        lines.append(f"steps/h {note}")
    return t, lines


def print_closing(summary: dict, run_dir: Path) -> None:
    """The closing table of a finished run, from its summary and metrics, on the console."""
    from .runlog import read_jsonl

    table, lines = closing_table(summary, read_jsonl(Path(run_dir) / "metrics.jsonl"))
    console = _current.console if _current is not None else Console(file=sys.stdout, soft_wrap=True, highlight=False)
    console.print(table)
    for line in lines:
        console.print(Text(line))
