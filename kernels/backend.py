"""Which implementation a kernels entry point runs: triton on CUDA, the torch reference elsewhere; and Triton's
CPU interpreter, which only an environment variable turns on (this module is the one that reads or sets it)."""

from __future__ import annotations

import importlib
import os

import torch

BACKENDS = ("auto", "torch", "triton")


def interpreting() -> bool:
    """Whether Triton runs its kernels on its CPU interpreter: TRITON_INTERPRET=1, which Triton reads when a
    function is decorated with @triton.jit (Triton offers no other way to ask for it)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """Whether colora's Triton kernels can run on tensors of `device`: on CUDA, or anywhere under the
    interpreter."""
    return device.type == "cuda" or interpreting()


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' is triton on CUDA and torch elsewhere; 'triton' off CUDA needs TRITON_INTERPRET=1
    (Triton's interpreter, which the CPU tests use)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and not triton_runs_on(device):
        raise ValueError(f"backend 'triton' on {device} needs CUDA or TRITON_INTERPRET=1 (the interpreter)")
    return backend


# The modules that define or import @triton.jit functions, each after those it imports them from.
_JIT_MODULES = ("lora.common", "lora.reduce", "lora.stream", "lora.sgrad", "lora.shrink", "lora.op", "lora",
                "logsoftmax_kernels", "logsoftmax", "rmsnorm_kernels", "rmsnorm", "rotary_kernels", "rotary",
                "swiglu_kernels", "swiglu")


def interpreted_kernels():
    """The colora.kernels package, running on Triton's interpreter when there is no CUDA device.

    Triton picks compiled or interpreted when a function is decorated with @triton.jit, at import,
    and triton.language's own helpers (tl.max, tl.sum, ...) are jit functions too. So on the CPU
    TRITON_INTERPRET=1 must be set before triton is first imported (tests/conftest.py does). If
    triton was imported earlier in this process, its helpers and our kernels are re-imported here.
    For tests and the kernel benchmark's --quick only."""
    pkg = importlib.import_module(__package__)
    if torch.cuda.is_available():
        return pkg
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.standard.max, InterpretedFunction):
        importlib.reload(tl.standard)
        importlib.reload(tl)
    if not isinstance(importlib.import_module(f"{__package__}.lora.shrink").lora_shrink_kernel, InterpretedFunction):
        for name in _JIT_MODULES:
            importlib.reload(importlib.import_module(f"{__package__}.{name}"))
        pkg = importlib.reload(pkg)
    return pkg
