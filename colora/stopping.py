"""Stopping on a signal: SIGINT, SIGTERM and SIGHUP end a run, a sweep or a benchmark in bounded time.

    with handling_signals() as stop:      # colora run, colora sweep, colora bench arms, a sweep's child
        ...                               # an Interrupted leaves the block once every step has let go

The first signal is a stop request. Where nothing is half done (engine start, warm-up, evaluation,
waiting for a child process) it raises `Interrupted` in the main thread at once. Inside
`stop.deferred()` (the co-runner's training loop) it only records the request: the loop looks at it
in every wait, each of which has a timeout, and raises `Interrupted` at its next safe point, after
the training step in progress and never inside one, so the checkpoint written then holds whole steps.
When the block ends after a stop request, every process started inside it that is still there (the
engine's, the engine client's) is terminated, then killed.

A second signal exits at once (status 128 + the signal's number): every process started inside the
block is killed (and the process group of each one that leads its own), the callbacks registered
with `on_abort` run (a run marks its status.json), and nothing waits but multiprocessing's resource
tracker, for at most SETTLE_WAIT_S, to unlink what the killed processes left.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group, vLLM's engine processes
included, and they shut down on it: an engine that dies after a stop request is the interruption,
not an engine failure (`StopRequest.requested` tells the two apart). colora takes a signal only
from its default disposition: a handler that the program colora runs in installed (a Ray worker's,
say) stays, and so does a SIGHUP the process was started to ignore (`nohup`). An ignored SIGINT (a
background job of a script) is taken all the same: vLLM's processes stop on it whatever colora does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Callable, Iterator

from colora import output

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
REAP_WAIT_S = 10.0  # how long processes left after a stop get to end on SIGTERM before SIGKILL
SETTLE_WAIT_S = 3.0  # how long multiprocessing's resource tracker gets to clean up after them
STOP_TERM_S = 20.0  # how long a stopped child may take to shut its engine down before it is killed
STOP_REPORT_S = 10.0  # then the MPS daemon's stop and the report


class Interrupted(KeyboardInterrupt):
    """A stop request by a signal. `signal` names it; `message` is the line that says how to go on
    (set by whoever knows: the runner, the orchestrator); `exit_code` is 128 + the signal number."""

    def __init__(self, signal_name: str, message: str = ""):
        super().__init__(message or f"interrupted by {signal_name}")
        self.signal = signal_name
        self.message = message or f"interrupted by {signal_name}"
        self.step: int | None = None  # the steps every job had completed (the runner sets it)

    @property
    def exit_code(self) -> int:
        sig = getattr(signal, self.signal, None)
        return 128 + int(sig) if sig is not None else 130

    def __str__(self) -> str:
        return self.message


class StopRequest:
    """The process's stop request: which signal asked (`signal`, "" before one did), where the run
    was (`phase`, set by the runner as it goes), and the callbacks of a second signal."""

    def __init__(self):
        self._event = threading.Event()
        self.signal = ""
        self.phase = ""
        self._deferring = 0
        self._abort: list[Callable[[], None]] = []
        self._before: set[int] = set()  # pids of the children that existed when the handlers were installed
        self._seen: list = []  # psutil.Process of every descendant at the first signal (see `reap`)

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, signal_name: str) -> None:
        if not self._event.is_set():
            self.signal = signal_name
            self._event.set()

    def wait(self, timeout: float) -> bool:
        """True once a stop is requested; waits at most `timeout` seconds (for waits that should end
        on a request)."""
        return self._event.wait(timeout)

    def check(self) -> None:
        """Raise Interrupted if a stop was requested: called at the safe points of deferred code."""
        if self._event.is_set():
            raise Interrupted(self.signal)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within: a first signal only sets the request; the code raises it at its safe points. Left
        with the request set, it raises it."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        self.check()

    @contextlib.contextmanager
    def on_abort(self, fn: Callable[[], None]) -> Iterator[None]:
        """Run `fn` on a second signal while inside the block (it must be quick and must not wait)."""
        self._abort.append(fn)
        try:
            yield
        finally:
            self._abort.remove(fn)

    # -- the handler -----------------------------------------------------------------------------
    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self._event.is_set():
            self._exit_now(signum, name)
        self.request(name)
        self._seen = descendants(self._before)
        output.say_at_once(f"colora: {name}: stopping (a second signal exits at once)")
        if not self._deferring:
            raise Interrupted(name)

    def _exit_now(self, signum: int, name: str) -> None:
        kill_descendants(self._before, signal.SIGKILL, self._seen)
        close_resource_tracker(SETTLE_WAIT_S)
        output.say_at_once(f"colora: second signal ({name}): exiting at once", exiting=True)
        for fn in list(self._abort):  # last: what they print (how to continue) is the last line
            with contextlib.suppress(Exception):
                fn()
        os._exit(128 + signum)

    def reap(self) -> list[int]:
        """SIGTERM to every process started since the handlers were installed that is still there
        (also one that was a descendant at the first signal and has been orphaned since: vLLM's
        workers outlive an engine core that died of a Ctrl-C), SIGKILL to those still there after
        REAP_WAIT_S; then multiprocessing's resource tracker is let finish. Returns the pids that had
        to be killed."""
        import psutil

        left = kill_descendants(self._before, signal.SIGTERM, self._seen)
        _, alive = psutil.wait_procs(left, timeout=REAP_WAIT_S)
        kill_descendants(self._before, signal.SIGKILL, self._seen)
        close_resource_tracker(SETTLE_WAIT_S)
        return [p.pid for p in alive]


def descendants(exclude: set[int]) -> list:
    """psutil.Process of every descendant of this process not in `exclude`, but multiprocessing's
    resource tracker (it ends with this process and cleans up after the others)."""
    import psutil

    exclude = exclude | {_resource_tracker_pid()}
    try:
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in exclude]
    except psutil.Error:
        return []


def kill_descendants(exclude: set[int], sig: int, also: list = ()) -> list:
    """Send `sig` to every descendant of this process not in `exclude` and to those of `also` that
    still run (psutil.Process: a reused pid is not taken for them), and to the process group of each
    that leads a group of its own, which catches its children even once they are orphaned. Returns
    the psutil.Process objects signalled."""
    import psutil

    procs = descendants(exclude)
    pids = {p.pid for p in procs}
    procs += [p for p in also if p.pid not in pids and p.is_running()]
    own = os.getpgrp()
    for p in procs:
        with contextlib.suppress(psutil.Error, OSError):
            pgid = os.getpgid(p.pid)
            if pgid == p.pid and pgid != own:
                os.killpg(pgid, sig)
        with contextlib.suppress(psutil.Error, OSError):
            p.send_signal(sig)
    return procs


def _resource_tracker_pid() -> int | None:
    from multiprocessing import resource_tracker

    return getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None)


def close_resource_tracker(wait_s: float) -> None:
    """Close this process's end of multiprocessing's resource tracker and give it `wait_s` to end.
    It ends once every process that holds its pipe has closed it, unlinking on the way what a
    stopped engine process left (shared memory, semaphores) with a warning for each: those come
    before the line that says how to continue, not after it. multiprocessing has no public call for
    this (its `_stop` waits without a limit); a later use starts a new tracker."""
    from multiprocessing import resource_tracker

    rt = getattr(resource_tracker, "_resource_tracker", None)
    fd, pid = getattr(rt, "_fd", None), getattr(rt, "_pid", None)
    if fd is None or pid is None:
        return
    rt._fd = rt._pid = None
    with contextlib.suppress(OSError):
        os.close(fd)
    t_end = time.monotonic() + wait_s
    while time.monotonic() < t_end:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        time.sleep(0.05)


def takes(sig: int, handler) -> bool:
    """Whether colora takes `sig` from its present `handler`: only from its default disposition (see
    the module docstring), so a host's handler and nohup's ignored SIGHUP stay."""
    return handler in (signal.SIG_DFL, signal.default_int_handler)


_active: StopRequest | None = None


def active() -> StopRequest | None:
    """The stop request of the handlers installed now, if any."""
    return _active


def on_abort(fn: Callable[[], None]):
    """`StopRequest.on_abort` of the handlers installed now (nothing happens without them)."""
    return _active.on_abort(fn) if _active is not None else contextlib.nullcontext()


@contextlib.contextmanager
def handling_signals() -> Iterator[StopRequest]:
    """Install the handlers of STOP_SIGNALS for the block (inside an outer block: that block's
    request; outside the main thread, where Python allows no handlers: a request no signal sets).
    After a stop request the processes started inside are reaped when the block ends."""
    global _active
    if _active is not None:
        yield _active
        return
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    import psutil

    stop._before = {p.pid for p in psutil.Process().children(recursive=True)}
    previous = {}
    for sig in STOP_SIGNALS:
        old = signal.getsignal(sig)
        if takes(sig, old) or (sig == signal.SIGINT and old == signal.SIG_IGN):
            previous[sig] = old
            signal.signal(sig, stop._handle)
    _active = stop
    try:
        yield stop
    finally:
        try:
            if stop.requested:  # the handlers stay meanwhile: a second signal still exits at once
                t0 = time.monotonic()
                killed = stop.reap()
                if killed:
                    output.say(f"colora: killed {len(killed)} process(es) that had not ended "
                               f"{time.monotonic() - t0:.0f}s after SIGTERM: {killed}")
        finally:
            _active = None
            for sig, old in previous.items():
                signal.signal(sig, old)
