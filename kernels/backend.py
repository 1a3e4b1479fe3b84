"""Which implementation a kernels entry point runs: triton on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' is triton on CUDA and torch elsewhere; 'triton' off CUDA needs TRITON_INTERPRET=1
    (Triton's interpreter, which the CPU tests use)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend 'triton' on {device} needs CUDA or TRITON_INTERPRET=1 (the interpreter)")
    return backend
