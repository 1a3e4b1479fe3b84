"""colora: many customers' LoRA GRPO jobs on one GPU (see README.md and DESIGN.md)."""

from __future__ import annotations

import sys


def python_m(module: str) -> list[str]:
    """The command that runs `python -m module` with this interpreter, started as this process was:
    with -P (safe path) when this process has it, so a child never imports another `colora` from its
    working directory (the GPU host maps the repository onto colora through PYTHONPATH)."""
    return [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m", module]
