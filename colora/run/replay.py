"""Run a training step that failed in a run again, by itself.

    colora replay-step RUN_DIR/failed_steps/step6-group0
    colora replay-step RUN_DIR/failed_steps/step6-group0 --sdpa math --set trainer.fuse_elementwise=off

When a training step fails (a loss, gradient or weight not finite, a diverged adapter) the run keeps
what it ran on under RUN_DIR/failed_steps/ (`keep_failed_step`): the step's rollouts and each job's
adapter and AdamW state (a full-parameter job's weights and AdamW state). This builds the run's trainer
from its config.json (with --set overrides; colora/run/fullrun.py `build`, for either kind of job), loads
that state and trains once on the rollouts, then prints each job's loss, gradient norm and failure. A
failure that comes back every time, under every attention backend, is the data's or an adapter's; one
that comes and goes with --sdpa or a trainer setting is that code path's. Exit status: 1 when some job
fails again, 0 when none does, 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from colora.config import from_dict, replace
from colora.models.base import load_tokenizer
from colora.run.fullrun import build
from colora.run.preflight import RunError, resolve_device, resolve_model, torch_dtype
from colora.training.failed_step import ReplayError, load_failed_step

SDPA = ("math", "efficient", "flash", "cudnn")


def replay(d: Path, overrides: list[str], sdpa: str | None, log=print) -> dict:
    """Train once on the kept rollouts; returns job -> JobStepStats."""
    raw, rollouts, state = load_failed_step(d)
    cfg = replace(from_dict(raw), overrides)
    device, dtype = resolve_device(cfg)
    model_dir = resolve_model(cfg.experiment.model, log)
    bank, trainer = build(cfg, model_dir, device, torch_dtype(dtype), load_tokenizer(model_dir).pad_token_id)
    for job, rs in rollouts.items():
        if job not in bank.jobs:
            raise ReplayError(f"job {job!r} of the kept rollouts is not in the run's config")
        bank.load_job_state(job, state["jobs"][job])
        if bank.jobs[job].version != rs[0].version:
            log(f"{job}: its kept adapter is version {bank.jobs[job].version}, one update past the step's "
                f"{rs[0].version} (the failed step updated it); replaying on the kept one")
            bank.jobs[job].version = rs[0].version  # the trainer takes only rollouts of the current version
    log(f"failed in the run: {state.get('failures')}")
    ctx = contextlib.nullcontext()
    if sdpa:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ctx = sdpa_kernel({"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                           "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[sdpa])
    with ctx:
        return trainer.step(rollouts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colora replay-step", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="RUN_DIR/failed_steps/STEP, kept by a run whose training step failed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a key of the run's config")
    p.add_argument("--sdpa", choices=SDPA, help="PyTorch attention backend for the step (default: PyTorch's choice)")
    args = p.parse_args(argv)

    try:
        stats = replay(Path(args.dir), args.set, args.sdpa)
    except (ReplayError, RunError, ValueError, KeyError) as e:
        print(f"colora replay-step: error: {e}", file=sys.stderr)
        return 2
    for job, st in stats.items():
        print(f"  {job}: loss {st.loss:.6g} grad_norm {st.grad_norm:.6g} entropy {st.entropy:.6g}"
              f"{'  FAILED: ' + st.failure if st.failure else ''}")
    failed = [j for j, st in stats.items() if st.failure]
    print(f"replay: {len(failed)} of {len(stats)} jobs failed again" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
