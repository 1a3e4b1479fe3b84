"""What a training step that failed ran on, kept in its run directory and read back.

`keep_failed_step` writes RUN_DIR/failed_steps/step<k>-group<g>/: the step's rollouts and each job's
adapter and AdamW state; `load_failed_step` reads them back for `colora replay-step`
(colora/run/replay.py), which runs the step again by itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from colora.training.trainer import Rollout


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
