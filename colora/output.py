"""What a person sees while colora runs, and what each run directory keeps of it.

    colora run CONFIG [--verbose] | colora sweep ... [--verbose] | colora bench arms ... [--verbose]

Each of these commands opens one `session` for its process, and so does each co-runner's run on
Ray (colora/cluster/actor.py). While it is open, the process's file
descriptors 1 and 2 are pipes that colora reads, so everything written there goes to the run.log of
the run in progress: vLLM's, transformers', torch's and Triton's logs and warnings, third-party
progress bars ("Loading weights", GGUF conversion), the C++ runtime's messages (c10d), and the
output of every child process started meanwhile (vLLM's engine core writes to the descriptors it
inherits). What arrives before a process's first run goes to that run's log, what arrives between
or after runs to the log of the run before. With `--verbose` all of it is shown on the terminal as
well; without, the terminal gets colora's own lines only: milestones, warnings, a progress bar per
run (step, reward per job, elapsed, ETA) and per sweep (runs done, ETA), drawn live by rich on a
terminal and as plain lines anywhere else (CI logs, files, the device tool), and the closing table.

Called from Python without a session (`colora.run.runner.run` in a test, say), nothing is captured:
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
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.text import Text

_MARK = b"\x00colora-drained\x00"  # written into the pipes by `Session.drain`, never routed
PENDING_MAX = 4 << 20  # bytes of output kept while no run log is open yet (the newest are kept)
PLAIN_LINES_IN_SWEEP = 4  # the same for each run of a sweep, whose own lines say when each run starts and ends

# the lines shown even inside a sweep (where a run's milestones are left to its log)
WARNING = re.compile(r"^(warning|job \S+ stopped|kept what|checkpoint \S+ is unusable)", re.IGNORECASE)
# a training step's line ("step 3/24 | a r=0.50 b r=0.25 | gen 0.1s train 0.2s"): step, steps, rewards
STEP_LINE = re.compile(r"^(?:step|groups [\d,]+) (\d+)/(\d+) \| (.*?)(?: \| |$)")


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
        # multiprocessing's resource tracker lives as long as this process: started while 1 and 2
        # are the pipes, it would hold them open and `close` would wait out its whole `wait_s`.
        resource_tracker.ensure_running()
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
        self._elsewhere: dict[str, TaskID | int] = {}  # a run in another process: its bar, or its next plain line's step
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
        marked = _MARK in data
        if marked:
            data = data.replace(_MARK, b"")
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
        if marked and fd in self._drained:  # only now: what came with the mark is routed
            self._drained[fd].set()

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

    def logs_into(self, f) -> bool:
        """Whether captured output goes to `f` now."""
        return self._sink is f

    def write_log(self, f, data: bytes) -> None:
        """A line of colora's own into a run log, between the captured chunks."""
        with self._lock:
            f.write(data)

    def say(self, line: str, style: str | None = None) -> None:
        self.console.print(Text(line, style=style or ""))

    def step_elsewhere(self, label: str, step: int, steps: int, info: str) -> None:
        """A training step of a run in another process: its own bar, or a plain line every quarter of it."""
        if self.progress is not None:
            task = self._elsewhere.get(label)
            if task is None:
                task = self._elsewhere[label] = self.progress.add_task(label, total=steps, info=info)
            self.progress.update(task, completed=step, total=steps, info=info)
        elif step >= self._elsewhere.get(label, 0) or step == steps:
            self._elsewhere[label] = step + max(1, math.ceil(steps / PLAIN_LINES_IN_SWEEP))
            self.say(f"  [{label}] step {step}/{steps} | {info}")

    def ended_elsewhere(self, label: str) -> None:
        task = self._elsewhere.pop(label, None)
        if self.progress is not None and task is not None:
            self.progress.remove_task(task)

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


def current() -> Session | None:
    """This process's open session, if any."""
    return _current


def console() -> Console:
    """The session's console, else one on stdout."""
    return _current.console if _current is not None else Console(file=sys.stdout, soft_wrap=True, highlight=False)


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
    """A plan of `todo` runs starts in this process (colora/sweeps/orchestrate.py): the sweep's bar."""
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
    as a run inside a sweep shows its own (its progress, its warnings; every line with --verbose);
    nothing without a session (the run's log has it)."""
    s = _current
    if s is None:
        return
    step = STEP_LINE.match(line)
    if s.verbose:
        s.say(f"[{label}] {line}")
    elif step:
        s.step_elsewhere(label, int(step[1]), int(step[2]), step[3])
    elif WARNING.match(line):
        s.say(f"  [{label}] {line}", style="yellow")


def run_ended(label: str) -> None:
    """The run in another process that `run_line` showed as `label` has ended: its bar goes."""
    if _current is not None:
        _current.ended_elsewhere(label)
