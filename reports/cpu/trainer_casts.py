"""Operator calls of one bf16 trainer step with the adapters' compute copies made once per step
against the per-micro-batch autograd cast (the previous behaviour), in one process.

    TRITON_INTERPRET=1 .venv/bin/python reports/cpu/trainer_casts.py 2>/dev/null | grep micro-batches   (trainer_casts.txt)

The tiny offline Qwen3 (`colora model tiny`, 2 layers), two jobs (one adapts every projection, so
q|k|v and gate|up are packed), bf16, the Triton kernels through the interpreter, micro-batches of 96
tokens (several a step). torch's profiler counts the operator calls of each step; the figures that
do not depend on the interpreter are the casts (`aten::_to_copy`) and the autograd cast nodes
(`ToCopyBackward0`). Operator counts, not times: a CPU run says how many host operations went, the
H200 says what they cost.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from test_trainer import JOB_B, fixed_rollouts, make_trainer

    from colora.models import build_tiny

    model_dir = Path(tempfile.mkdtemp()) / "tiny"
    build_tiny(model_dir, seed=0)
    full = dataclasses.replace(JOB_B, name="c", lora_rank=4)
    for copies in (False, True):
        trainer, bank, _ = make_trainer(model_dir, [JOB_B, full], micro_batch_tokens=96, dtype="bfloat16")
        trainer.cfg = dataclasses.replace(trainer.cfg, logprob_backend="triton")
        bank.lora_backend, bank.pack_projections = "triton", True
        orig = bank.stacked

        def stacked(path, dtype, orig=orig, copies=copies):
            if copies:
                return orig(path, dtype)
            st = orig(path, torch.float32)  # the fp32 leaves, no copies: cast per micro-batch as before
            return None if st is None else (st[0].to(dtype), st[1].to(dtype), st[2], None)

        bank.stacked = stacked
        trainer.step({j.name: fixed_rollouts(j, 0, 500) for j in (JOB_B, full)})  # warm-up
        ro = {j.name: fixed_rollouts(j, 1, 500) for j in (JOB_B, full)}  # version 1: the adapters' now
        n_mb = len(trainer._micro_batches(trainer._sequences(ro), ("b", "c")))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            trainer.step(ro)
        calls = collections.Counter()
        for e in prof.events():
            calls[e.name] += 1
        casts = calls["aten::_to_copy"]
        nodes = calls["autograd::engine::evaluate_function: ToCopyBackward0"]
        label = "copies once per step (now)" if copies else "autograd cast per micro-batch (before)"
        modules = sum(1 for _ in bank.modules)
        print(f"{label}: {n_mb} micro-batches x {modules} adapted modules; aten::_to_copy {casts}, "
              f"ToCopyBackward0 nodes {nodes}, operator calls in all {sum(calls.values())}")


if __name__ == "__main__":
    main()
