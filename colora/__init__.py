"""colora: many customers' LoRA GRPO jobs on one GPU (see README.md and docs/architecture.md)."""

from __future__ import annotations

import sys


def python_m(module: str) -> list[str]:
    """The command that runs `python -m module` with this interpreter, started as this process was:
    with -P (safe path) when this process has it, so a child imports the installed colora (on the GPU
    host an editable install of the checkout, scripts/h200.sh) and never the `colora` folder of its
    working directory, which alone lacks colora.kernels and colora.tasks."""
    return [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m", module]
