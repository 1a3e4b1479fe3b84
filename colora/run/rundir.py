"""One run directory's state: complete, running in a live process, unfinished and resumable, or
moved aside; and its lock, which keeps a second process out while one writes it.

A run directory is complete when its status.json says so and it has summary.json (written last). It
is running while a process holds its lock: `run.lock`, locked with flock(2) for the run's life and
released by the kernel when that process ends, however it ends (so a status.json that still says
"running" after a kill -9 reads as killed, not running). Anything else that exists is unfinished:
resumed from its checkpoint when it was interrupted or killed (`resumable`), else moved aside, never
deleted.

The lock file holds its holder's pid, host, start time and command line, for the message that refuses
a second process; it is removed when the run ends (a killed run leaves it, unlocked). A process that
forks closes its copies of the locks in the child, which holds none: a forked child that outlived
the run would otherwise keep the directory locked.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from colora.run.checkpoint import newest_sound
from colora.run.preflight import RunError

LOCK = "run.lock"
LOCK_WAIT_S = 1.0  # an acquire retries this long: a reader's probe holds the lock for microseconds
_NO_FLOCK = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}  # a file system without flock

_held: dict[str, list] = {}  # resolved run directory -> [lock fd, depth]: the locks this process holds


def _forget_in_child() -> None:
    """In a forked child: close the inherited lock descriptors (closing one copy never unlocks; only
    the last close of the file does), so that only the run's own process holds its directory."""
    for fd, _ in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def this_process() -> dict:
    """What status.json and the lock file say of the process that writes a run: pid, host, its start
    time (so that a pid used again by another process is not taken for it) and command line."""
    import psutil

    return {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time(),
            "command": shlex.join(sys.argv)}


def _alive(rec: dict) -> bool:
    """Whether the process a record names (this_process) still runs: same host, pid and start time."""
    import psutil

    if rec.get("host") != socket.gethostname() or not isinstance(rec.get("pid"), int):
        return False
    try:
        return abs(psutil.Process(rec["pid"]).create_time() - float(rec.get("started", 0.0))) < 1.0
    except (psutil.Error, TypeError, ValueError):
        return False


def _read(lock: Path) -> dict:
    try:
        rec = json.loads(lock.read_text())
        return rec if isinstance(rec, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def in_use(path: Path, rec: dict) -> str:
    """The message that refuses a second process the run directory `path`, which `rec` holds."""
    when = ""
    if isinstance(rec.get("started"), (int, float)):
        when = f", started {datetime.datetime.fromtimestamp(rec['started']).isoformat(' ', 'seconds')}"
    who = f"pid {rec.get('pid', '?')} on {rec.get('host', '?')}{when}" + (
        f": {rec['command']}" if rec.get("command") else "")
    return (f"{path} is in use by another colora process ({who}); two processes must not write one run "
            f"directory. Wait for it to end, or stop it (kill {rec.get('pid', 'PID')}: it saves a checkpoint and "
            f"says how to continue), then: colora run --resume {path}")


def holder(path: Path) -> dict | None:
    """The live process that holds run directory `path` (its lock file's record), or None when none
    does: the lock is free, or missing. Where the file system has no flock, the record's pid and
    start time decide."""
    key = str(Path(path).resolve())
    if key in _held:
        return this_process()
    lock = Path(path) / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by the close below
        except BlockingIOError:
            return _read(lock) or {"pid": None}
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
            rec = _read(lock)
            return rec if _alive(rec) else None
        return None
    finally:
        os.close(fd)


def _acquire(path: Path, log: Callable[[str], None]) -> int:
    lock = path / LOCK
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            raise RunError(in_use(path, _read(lock))) from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            rec = _read(lock)
            if _alive(rec) and rec.get("pid") != os.getpid():
                os.close(fd)
                raise RunError(in_use(path, rec)) from None
            log(f"warning: {path}'s file system has no flock ({e.strerror}): only the pid in {lock} keeps a "
                "second process out of it")
        if not _same_file(fd, lock):  # its last holder removed it between our open and our lock
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(this_process()).encode(), 0)
        return fd


@contextlib.contextmanager
def holding(path: str | Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold run directory `path`'s lock for the block (nested blocks of one process share it); a
    RunError naming the holder when another live process has it. `path` must exist."""
    path = Path(path)
    key = str(path.resolve())
    if key in _held:
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    fd = _acquire(path, log)
    _held[key] = [fd, 1]
    try:
        yield
    finally:
        _held.pop(key, None)
        try:
            if _same_file(fd, path / LOCK):  # removed while still locked: a waiter then looks again
                os.unlink(path / LOCK)
        finally:
            os.close(fd)


def _status(path: Path) -> dict:
    try:
        st = json.loads((path / "status.json").read_text())
        return st if isinstance(st, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}


def run_state(path: Path) -> str:
    """missing | complete | running (a live process holds it) | incomplete (killed, failed or
    interrupted: anything else that exists)."""
    if not path.exists():
        return "missing"
    if _status(path).get("state") == "complete" and (path / "summary.json").is_file():
        return "complete"
    return "running" if holder(path) is not None else "incomplete"


def describe(path: Path) -> str:
    """What became of a run directory that is not complete, in a few words and how to go on."""
    if (rec := holder(path)) is not None:
        return f"still running (pid {rec.get('pid', '?')} on {rec.get('host', '?')})"
    st = _status(path)
    state = st.get("state")
    if state == "running":
        return (f"killed while running (its process, pid {st.get('pid', '?')}, is gone); colora run --resume "
                f"{path} continues it")
    if state == "interrupted":
        return f"interrupted ({st.get('reason', st.get('signal', '?'))}); colora run --resume {path} continues it"
    if state == "failed":
        return f"failed ({st.get('error', '?')})"
    return f"state {state!r}" if state else "no status.json"


def resumable(path: Path, config_hash: str) -> bool:
    """Whether an unfinished run can continue where it stopped: interrupted by a signal, or killed
    (its status still says running but no live process holds it), of the config `config_hash`, with
    a checkpoint that verifies."""
    state = _status(path).get("state")
    if state not in ("interrupted", "running") or run_config_hash(path)[0] != config_hash:
        return False
    return holder(path) is None and newest_sound(path) is not None


def run_config_hash(path: Path) -> tuple[str | None, dict | None]:
    try:
        d = json.loads((path / "config.json").read_text())
        return d.get("hash"), d.get("config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None, None


def move_aside(path: Path) -> Path:
    """Rename an unfinished run directory to `<name>.incomplete-<n>` (first free n); a RunError
    when a live process still writes it."""
    if (rec := holder(path)) is not None:
        raise RunError(in_use(path, rec))
    n = 1
    while (dest := path.with_name(f"{path.name}.incomplete-{n}")).exists():
        n += 1
    path.rename(dest)
    return dest


def timeslice_tenant(path: Path, saved: dict) -> bool:
    """Whether the run directory `path` (config.json as `saved`) is a tenant's of the time-slicing arm: its
    config.json says so, or it lies where the arm puts its tenants, DIR/tenants/<k> beside <k>.spec.json
    (colora/timeslice/arm.py). Such a run is driven by the arm (the broker's grants, the parkers): never
    resumed alone."""
    return bool(saved.get("timeslice_tenant")) or (
        path.parent.name == "tenants" and (path.parent / f"{path.name}.spec.json").is_file())


def check_data(out: Path, cfg, data: dict) -> None:
    """A resume of the run in `out` reads each sft job's data again, where this process finds it (`Setup.data`):
    refused (RunError naming the job, the file and both hashes) when it is not the file the run began with, by
    its sha256 (config.json's `data`; a run that recorded none is not checked)."""
    began = json.loads((out / "config.json").read_text()).get("data") or {}
    for i, j in enumerate(cfg.jobs):
        was, now = began.get(j.name), data.get(j.name)
        if was and now and was.get("sha256") != now["sha256"]:
            raise RunError(f"--resume {str(out)!r}: jobs.{i}.data (job {j.name!r}) is {now['file']} with sha256 "
                           f"{now['sha256']}; the run began on {was.get('file')} with sha256 {was.get('sha256')}: "
                           "the job would train on other conversations. Put the file back as it was, or run "
                           "the experiment again in a new directory")
