"""Counts of the JIT compiles in this process, so that a timeline can say why a step was slow.

A compile inside a measured step is a stall (on the H200 some training steps took 4-6 s against a
median of 0.4-0.5 s). Two compilers can run in a training step:

- Triton compiles a `@triton.jit` kernel (colora's grouped-LoRA and log-softmax kernels in
  kernels/) once per specialisation: its constexprs, pointer arguments on 16-byte alignment,
  integer arguments on == 1 and % 16. Counted per kernel name through
  `triton.knobs.runtime.jit_post_compile_hook`, which Triton calls after every compile (`install`).
  A specialisation found in Triton's on-disk cache counts too: it is new to this process, though
  it loads in milliseconds rather than seconds. Inductor builds its generated kernels with
  `triton.compile` directly and calls this hook only under TORCHINDUCTOR_RUN_JIT_POST_COMPILE_HOOK=1;
  by default they are counted as part of the Dynamo compile that made them. A Triton without
  `triton.knobs` (older releases) has no such hook: Triton compiles are then not counted at all.
- Dynamo (torch.compile; colora/training/fusion.py) compiles one graph for each new frame and each
  recompile after a guard failed (a new dtype, a shape it had specialised on). Counted from
  `torch._dynamo.utils.counters["stats"]["unique_graphs"]`, which Dynamo raises by one as its
  backend hands back each compiled graph; it needs no install. (The same counter in output_graph.py
  from torch 2.0 through 2.13; tests/test_compilewatch.py checks the behaviour, on 2.13 so far.)
  `counters["frames"]["ok"]` was not taken: it also counts frames that produced no graph.
  A recompile also says why: Dynamo appends each failed guard's reason to
  `torch._dynamo.utils.guard_failures` (per code object), and `since` returns the new ones
  (`recompiles`), so a mid-run recompile names the guard (a dtype, a size it specialised on).

Counts are process-wide, whichever thread compiled. In colora's process that is the trainer: vLLM's
engine core, with its own kernels, runs in a process of its own.

    before = compilewatch.snapshot()
    ...  # a training step
    compilewatch.since(before)  # {"triton": 3, "dynamo": 1, "kernels": {"lora_shrink_kernel": 2, ...}}
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter
from dataclasses import dataclass

_lock = threading.Lock()
_kernels: Counter[str] = Counter()  # Triton compiles per kernel name, since `install`
_installed = False


MAX_REASONS = 4  # recompile reasons kept per interval (each cut to REASON_CHARS)
REASON_CHARS = 240


@dataclass(frozen=True)
class Snapshot:
    triton: int
    dynamo: int
    kernels: tuple[tuple[str, int], ...]  # (kernel name, Triton compiles), sorted by name
    guard_failures: tuple[tuple[object, int], ...] = ()  # (code object, failed guards recorded so far)


def install() -> bool:
    """Start counting Triton compiles (once per process; later calls do nothing). Returns whether
    Triton compiles are counted. Cheap and safe to call anywhere: the hook increments a counter and
    hands on to any hook installed before it."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from triton import knobs
            from triton.runtime import jit as triton_jit
        except ImportError:  # no Triton, or one without knobs: Triton compiles go uncounted
            return False
        _guard_serialization(triton_jit)
        previous = knobs.runtime.jit_post_compile_hook

        def on_compile(**kwargs):
            # Triton-internal API whose keyword arguments changed across releases: take only `fn`
            # and pass everything on unchanged (as vLLM's vllm/utils/jit_monitor.py does).
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or getattr(fn, "__name__", None) or "?"
            with _lock:
                _kernels[name] += 1
            if previous is not None:
                return previous(**kwargs)
            return None

        knobs.runtime.jit_post_compile_hook = on_compile
        _installed = True
        return True


def _guard_serialization(triton_jit) -> None:
    """With any hook set, Triton serialises each compile's specialisation to JSON before calling it,
    and a constexpr JSON cannot hold raises there, failing the kernel launch that compiled. Without a
    hook that never runs, so counting must not add the failure: a failed serialisation becomes None
    (vLLM's jit_monitor guards the same function for the same reason)."""
    orig = getattr(triton_jit, "serialize_specialization_data", None)
    if orig is None or getattr(orig, "_colora_guarded", False) or getattr(orig, "_vllm_guarded", False):
        return

    @functools.wraps(orig)
    def guarded(*args, **kwargs):
        try:
            return orig(*args, **kwargs)
        except (TypeError, ValueError):
            return None

    guarded._colora_guarded = True
    triton_jit.serialize_specialization_data = guarded


def _dynamo_graphs() -> int:
    # Not imported here: a process that never imported Dynamo has compiled nothing with it.
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def _guard_failures() -> dict:
    utils = sys.modules.get("torch._dynamo.utils")
    return getattr(utils, "guard_failures", None) or {}


def snapshot() -> Snapshot:
    with _lock:
        kernels = tuple(sorted(_kernels.items()))
    guards = tuple((code, len(reasons)) for code, reasons in list(_guard_failures().items()))
    return Snapshot(sum(n for _, n in kernels), _dynamo_graphs(), kernels, guards)


def _new_reasons(before: Snapshot) -> list[str]:
    """The failed-guard reasons Dynamo recorded since `before`: "function: reason", at most
    MAX_REASONS, each cut to REASON_CHARS."""
    old = dict(before.guard_failures)
    out = []
    for code, reasons in list(_guard_failures().items()):
        name = getattr(code, "co_name", str(code))
        for r in list(reasons)[old.get(code, 0):]:
            out.append(f"{name}: {r}"[:REASON_CHARS])
    return out[:MAX_REASONS]


def since(before: Snapshot, after: Snapshot | None = None) -> dict:
    """What compiled between two snapshots (`after`: now), zero entries left out: {} when nothing
    did, else some of {"triton": n, "dynamo": n, "kernels": {name: n}}."""
    after = snapshot() if after is None else after
    old = dict(before.kernels)
    kernels = {k: n - old.get(k, 0) for k, n in after.kernels if n > old.get(k, 0)}
    # max(0, ...): someone may clear Dynamo's counters (PyTorch's own tests do) between snapshots
    out = {"triton": after.triton - before.triton, "dynamo": max(0, after.dynamo - before.dynamo), "kernels": kernels,
           "recompiles": _new_reasons(before)}
    return {k: v for k, v in out.items() if v}


def describe(compiles: dict) -> str:
    """One line for a report: "Triton: lora_shrink_kernel x2, lora_reduce_kernel x1; Dynamo: 1 graph"
    (kernels by count, then name; "" when nothing compiled), and the first recompile's reason."""
    parts = []
    kernels = compiles.get("kernels") or {}
    if kernels:
        ranked = sorted(kernels.items(), key=lambda kv: (-kv[1], kv[0]))
        parts.append("Triton: " + ", ".join(f"{k} x{n}" for k, n in ranked))
    if compiles.get("dynamo"):
        n = compiles["dynamo"]
        parts.append(f"Dynamo: {n} graph{'s' if n != 1 else ''}")
    if compiles.get("recompiles"):
        parts.append(f"recompiled as {compiles['recompiles'][0]}")
    return "; ".join(parts)
