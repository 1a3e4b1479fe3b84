"""Run a training step that failed in a run again, by itself.

    colora replay-step RUN_DIR/failed_steps/step6-group0
    colora replay-step RUN_DIR/failed_steps/step6-group0 --sdpa math --set trainer.fuse_elementwise=off

When a training step fails (a loss, gradient or weight not finite, a diverged adapter) the run keeps
what it ran on under RUN_DIR/failed_steps/ (`keep_failed_step`): the step's rollouts and
each job's adapter and AdamW state. This builds the trainer from the run's config.json (with --set
overrides), loads those adapters and trains once on the rollouts, then prints each job's loss,
gradient norm and failure. A failure that comes back every time, under every attention backend, is
the data's or an adapter's; one that comes and goes with --sdpa or a trainer setting is that code
path's. Exit status: 1 when some job fails again, 0 when none does, 2 for bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from .config import from_dict, replace
from .models import load_tokenizer
from .resources import RunError, resolve_device, resolve_model, torch_dtype
from .trainer import Rollout, build_trainer

SDPA = ("math", "efficient", "flash", "cudnn")


class ReplayError(ValueError):
    """The failed-step directory or its run cannot be replayed; the message names what is wrong."""


def keep_failed_step(run_dir: Path, step: int, group: int, rollouts: dict, stats: dict, bank) -> Path:
    """Keep what a training step that failed (a loss, gradient or weight not finite, a diverged
    adapter) ran on, before its jobs are stopped: every rollout of the shared batch, and each
    job's adapter and AdamW state. A job that failed on its loss or gradient was not updated, so
    its state is the one the step saw; a job that was updated is one update further (copying every
    adapter before every step to keep the exact one would cost each step a device sync). A NaN in a
    shared batch can come from the data, from one job's adapter, or from the arithmetic of that
    batch's shapes; `colora replay-step DIR` runs the step again by itself to tell which."""
    import dataclasses


    d = run_dir / "failed_steps" / f"step{step}-group{group}"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "rollouts.jsonl", "w") as f:
        for r in (r for rs in rollouts.values() for r in rs):
            f.write(json.dumps({k: v for k, v in dataclasses.asdict(r).items() if k != "text"}) + "\n")
    failures = {n: st.failure for n, st in stats.items() if st.failure}
    torch.save({"jobs": {n: bank.job_state(n) for n in rollouts}, "failures": failures}, d / "state.pt")
    return d


def load_failed_step(d: Path) -> tuple[dict, dict, dict]:
    """(the run's config as a dict, job -> rollouts, the kept state) of a failed-step directory."""
    run_dir = d.parent.parent
    for f in (d / "rollouts.jsonl", d / "state.pt", run_dir / "config.json"):
        if not f.is_file():
            raise ReplayError(f"{str(f)!r} is missing: give a directory RUN_DIR/failed_steps/STEP that a run kept")
    rollouts: dict[str, list] = {}
    for i, line in enumerate((d / "rollouts.jsonl").read_text().splitlines()):
        try:
            r = Rollout(**json.loads(line))
        except (TypeError, json.JSONDecodeError) as e:
            raise ReplayError(f"{d / 'rollouts.jsonl'}: line {i + 1} is not a rollout ({e})") from None
        rollouts.setdefault(r.job, []).append(r)
    state = torch.load(d / "state.pt", map_location="cpu", weights_only=True)
    missing = sorted(set(rollouts) - set(state.get("jobs", {})))
    if missing:
        raise ReplayError(f"{d / 'state.pt'} has no adapter for job(s) {missing}")
    return json.loads((run_dir / "config.json").read_text())["config"], rollouts, state


def replay(d: Path, overrides: list[str], sdpa: str | None, log=print) -> dict:
    """Train once on the kept rollouts; returns job -> JobStepStats."""
    raw, rollouts, state = load_failed_step(d)
    cfg = replace(from_dict(raw), overrides)
    device, dtype = resolve_device(cfg)
    model_dir = resolve_model(cfg.experiment.model, log)
    bank, trainer = build_trainer(cfg, model_dir, device, torch_dtype(dtype), load_tokenizer(model_dir).pad_token_id)
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
