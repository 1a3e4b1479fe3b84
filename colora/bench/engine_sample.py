"""A sampling profile of vLLM's engine processes while batches decode, by py-spy: where the engine
core's host thread spends a step, without the per-request profiler ranges that vLLM's torch profiler
adds (`colora bench engine --sample`; --profile is the torch profiler's view).

py-spy (the `profile` extra; on the GPU host a wheel, docs/gpu-host.md) samples the stacks of the
engine core and its children (`--subprocesses`: vLLM's worker, a process of its own on the CPU build)
`rate` times a second from outside, without `--idle`: a thread's samples are the times it ran or held
the GIL, so samples over (rate x seconds) is the share of the wall time it was busy. Per thread:

- busy: that share of the recording, and busy ms a step (its samples' time over the engine steps taken
  in the recording). The recording is a few batches in a row and the ~0.2 s before the first: a thread
  that spins while it waits (vLLM's worker on its shared-memory queue, in the CPU build's process of
  its own) counts that time as busy;
- self: samples whose innermost frame is the function, in ms a step (the function's own time);
- inclusive: samples with the function anywhere on the stack, in ms a step (each sample counted once
  per function however deep it recurses);
- areas: self time in ms a step by where the function lives (AREAS: waiting on the GPU, vLLM's
  scheduler and KV cache, its LoRA bookkeeping, its model runner, the rest of vLLM, torch and the rest).

A function is `name (file)`, the line dropped. The threads are named by their process's command line
(vLLM sets its processes' titles: `VLLM::EngineCore`, `VLLM::Worker`) and the thread's name.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from itertools import zip_longest
from pathlib import Path

import psutil

PROCESS = re.compile(r'^process \d+:"(.*)"$')
THREAD = re.compile(r"^thread \(\d+\): (.*)$")
FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


class SampleError(RuntimeError):
    """py-spy is missing or could not sample (no permission to trace another process, say)."""


def find_py_spy(given: str | None = None) -> str:
    """The py-spy executable: `given`, else the one beside this Python (the `profile` extra), else on PATH."""
    if given:
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise SampleError(f"--py-spy {given}: no such executable")
        return given
    beside = Path(sys.executable).parent / "py-spy"
    found = str(beside) if beside.is_file() else shutil.which("py-spy")
    if not found:
        raise SampleError("py-spy is not installed: pip install 'colora[profile]' (on the GPU host: the wheel, "
                          "docs/gpu-host.md), or give its path with --py-spy")
    return found


def engine_core(procs) -> int:
    """The pid of vLLM's engine core among an engine's child processes (psutil.Process; the
    resource tracker multiprocessing starts beside it may be among them): the one vLLM titles
    `VLLM::EngineCore`, else the one with children of its own."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                return p.pid
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.children():
                return p.pid
    raise SampleError(f"no engine core among the engine's processes {[p.pid for p in procs]}")


class Recorder:
    """py-spy recording process `pid` and its children into `out` (py-spy's raw, collapsed stacks)
    from its construction, which returns once py-spy samples (its first line said so, and `settle_s`
    more for it to find the children), until `stop`; `seconds`: how long it recorded."""

    def __init__(self, py_spy: str, pid: int, out: Path, rate: int, settle_s: float = 0.2):
        self.out = out
        self.proc = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--subprocesses", "--threads",
                                      "--nonblocking", "--rate", str(rate), "--format", "raw", "--output", str(out)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = self.proc.stdout.readline()  # "py-spy> Sampling process 250 times a second. ..."
        if "Sampling process" not in first:
            rest = first + (self.proc.communicate(timeout=60)[0] if self.proc.poll() is not None else "")
            self.proc.kill()
            raise SampleError(f"py-spy did not start sampling process {pid}: {rest.strip()[-600:]}")
        self.started = time.perf_counter()
        self.seconds = 0.0
        time.sleep(settle_s)

    def stop(self) -> str:
        """End the recording (py-spy writes its file on SIGINT); its raw text."""
        self.seconds = time.perf_counter() - self.started
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            said, _ = self.proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            said, _ = self.proc.communicate()
        if not self.out.is_file():
            raise SampleError(f"py-spy wrote no profile (exit {self.proc.returncode}): {said.strip()[-600:]}")
        return self.out.read_text()


def parse(text: str) -> list[tuple[str, list[str], int]]:
    """py-spy's raw lines as (thread label, frames outermost first, samples). The label is the
    innermost process's command line and the thread's name."""
    out = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        process, thread, frames = "?", "?", []
        for part in stack.split(";"):
            if m := PROCESS.match(part):
                process = m.group(1)
            elif m := THREAD.match(part):
                thread = m.group(1)
            else:
                m = FRAME.match(part)
                frames.append(f"{m.group(1)} ({m.group(2)})" if m else part)
        out.append((f"{process.split()[0] if process.strip() else '?'} / {thread}", frames, int(count)))
    return out


# Where a function's self time goes, by its source (first match): the areas of the sampling figure.
AREAS = (("waiting on the GPU", lambda name, file: "synchronize" in name),
         ("scheduler and KV cache", lambda name, file: file.startswith("vllm/v1/core/")),
         ("LoRA bookkeeping", lambda name, file: file.startswith("vllm/lora/")),
         ("model runner", lambda name, file: file.startswith(("vllm/v1/worker/", "vllm/model_executor/"))),
         ("engine loop and output", lambda name, file: file.startswith("vllm/")))
OTHER = "torch and the rest"
UNLISTED = "outside the top functions"  # an older summary's remainder (see `areas`)


def area(function: str) -> str:
    """The area of a function `name (file)` (AREAS; OTHER where none matches)."""
    m = FRAME.match(function)
    name, file = (m.group(1), m.group(2)) if m else (function, "")
    return next((a for a, hit in AREAS if hit(name, file)), OTHER)


def areas(thread: dict) -> dict[str, float]:
    """A summarized thread's busy ms a step by area of its self time. A summary made before areas
    were kept has only its top functions by self time: what those leave of busy_ms is UNLISTED."""
    if "areas" in thread:
        return thread["areas"]
    out = Counter()
    for f, ms in thread["self"]:
        out[area(f)] += ms
    out[UNLISTED] = max(0.0, thread["busy_ms"] - sum(out.values()))
    return dict(out)


def summarize(text: str, seconds: float, rate: int, steps: int, batch_seconds: float | None = None,
              top: int = 15) -> dict:
    """Per thread: busy share of the recording's `seconds`, busy ms a step over the `steps` the
    engine took in it and the `top` functions by self and by inclusive ms a step (see the module's
    docstring), threads busiest first. ms_per_step: `batch_seconds` (the batches' own wall time,
    default the recording's) over the steps."""
    per = {}
    for label, frames, n in parse(text):
        t = per.setdefault(label, {"samples": 0, "self": Counter(), "inclusive": Counter(), "areas": Counter()})
        t["samples"] += n
        if frames:
            t["self"][frames[-1]] += n
        t["areas"][area(frames[-1]) if frames else OTHER] += n
        for f in set(frames):
            t["inclusive"][f] += n
    ms = 1e3 / rate / max(steps, 1)  # one sample, in ms a step
    threads = []
    for label, t in sorted(per.items(), key=lambda kv: -kv[1]["samples"]):
        busy = t["samples"] / (rate * seconds) if seconds > 0 else None
        threads.append({"thread": label, "samples": t["samples"], "busy": busy,
                        "busy_ms": t["samples"] * ms,
                        "self": [[f, n * ms] for f, n in t["self"].most_common(top)],
                        "inclusive": [[f, n * ms] for f, n in t["inclusive"].most_common(top)],
                        "areas": {a: n * ms for a, n in t["areas"].most_common()}})
    wall = seconds if batch_seconds is None else batch_seconds
    return {"seconds": seconds, "rate": rate, "steps": steps, "ms_per_step": 1e3 * wall / max(steps, 1),
            "threads": threads}


def to_text(summary: dict, title: str, threads: int = 3) -> str:
    """The busiest `threads` threads of a summary: self and inclusive ms a step per function."""
    out = [title, f"{summary['steps']} engine steps at {summary['ms_per_step']:.2f} ms a step, recorded over "
                  f"{summary['seconds']:.2f} s at {summary['rate']} samples a second"]
    for t in summary["threads"][:threads]:
        busy = "-" if t["busy"] is None else f"{100 * t['busy']:.0f}%"
        out += ["", f"  {t['thread']}: busy {busy} of the recording, {t['busy_ms']:.2f} ms a step",
                "    self ms a step       inclusive ms a step"]
        for (fs, s), (fi, i) in zip_longest(t["self"], t["inclusive"], fillvalue=("", None)):
            left = f"{s:7.3f} {fs[:60]:60s}" if s is not None else " " * 68
            right = f"{i:7.3f} {fi[:70]}" if i is not None else ""
            out.append(f"    {left}  {right}".rstrip())
    return "\n".join(out) + "\n"
