"""Which implementation a kernels entry point runs: triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

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
