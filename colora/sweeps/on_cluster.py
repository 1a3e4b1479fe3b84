"""A plan's runs in parallel on a Ray cluster, one GPU each: `colora sweep --gpus N` and `colora
bench arms --gpus N` (colora/sweeps/orchestrate.py's `run_plan` hands its plan here).

    colora sweep CONFIG --seeds 1 2 3 --arms dedicated overlap_mps --gpus 4 --out runs/sweep
    colora bench arms experiments/reference8_throughput.toml --seeds 1 --gpus 8 --address auto

Every run not complete yet is one co-runner's run (driver.run_shares: a Ray actor holding one GPU,
a fresh process for each run with its own engine and, for the MPS arms, its own MPS daemon), N at
once, taken in plan order. A dedicated run of several jobs is cut into min(N, jobs) parts
(placement.place_jobs), each a dedicated run of its jobs on a GPU of its own, side by side, and
merged into one run directory when the last ends (dedicated.py: the same layout and the same
throughput as a one-GPU dedicated run); a part that fails fails its run. A run that fails in its
co-runner (or whose co-runner dies) is recorded failed with the reason and the others go on.

The rest is run_plan's, as on one GPU: the layout (ROOT/<arm>/<run>/ and its log beside it),
sweep.json, complete runs skipped and unfinished ones moved aside and run again, `--deadline`
(a run starts only if the finished runs say it ends in time; at the deadline the runs still going
are stopped), and the report. ROOT/ray.log keeps what Ray printed in this process. The terminal
gets each run's start and end with its GPU, its progress and warnings (output.run_line: a bar per
run on a terminal, a line every quarter of it elsewhere) and the sweep's bar; each run's own lines
are in its log beside its directory, and what its processes printed (vLLM's logs) in its run.log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from colora import output
from colora.cluster import driver
from colora.cluster.dedicated import gather_logs, merge_parts, part_dir, part_log
from colora.cluster.placement import Outcome, job_cost, place_jobs, share_config
from colora.config import Config
from colora.output import duration as _dur
from colora.record.throughput import rate_line
from colora.run.rundir import move_aside, run_state
from colora.stopping import STOP_REPORT_S, STOP_TERM_S
from colora.sweeps.plan import Record, estimate


@dataclass
class _Run:
    """One planned run on the cluster: its co-runners' shares (several for a dedicated run cut into
    parts) and how each ended."""

    planned: object  # rundirs.PlannedRun
    cfg: Config
    tag: str  # "[i/N] label", as the one-GPU sweep names it
    shares: list[driver.Share] = field(default_factory=list)
    outcomes: dict[int, Outcome] = field(default_factory=dict)  # by share index
    state: str = "waiting"  # waiting | running | refused | ended
    why: str = ""  # why it was refused
    t0: float = 0.0  # when it was admitted (progress.clock)
    gpus: list[str] = field(default_factory=list)  # host:GPU of each share that started

    def part(self, share_index: int) -> int:
        return [s.index for s in self.shares].index(share_index)


def plan_shares(runs: list[_Run], root: Path, gpus: int) -> list[driver.Share]:
    """Every run's shares, in plan order, indexed in that order."""
    shares: list[driver.Share] = []
    for r in runs:
        d, cfg = root / r.planned.rel, r.cfg
        if cfg.experiment.arm == "dedicated" and len(cfg.jobs) > 1 and gpus > 1:
            placed = place_jobs({j.name: job_cost(j) for j in cfg.jobs}, min(gpus, len(cfg.jobs)))
            r.shares = [driver.Share(len(shares) + k, f"{r.planned.label} part {k}",
                                     share_config(cfg, names).to_dict(), part_dir(d, k), False, part_log(d, k),
                                     d / "parts" / f"{k}.corunner.json", names)
                        for k, names in enumerate(placed)]
        else:
            r.shares = [driver.Share(len(shares), r.planned.label, cfg.to_dict(), d, False,
                                     d.with_name(d.name + ".log"), None, [j.name for j in cfg.jobs])]
        shares += r.shares
    return shares


def run_on_cluster(base: Config, planned: list, root: Path, record: Record, progress, index: dict[str, int],
                   deadline: float | None, gpus: int, address: str | None) -> None:
    """Run every planned run that is not complete on the cluster (module docstring); `record`,
    `progress` (orchestrate._Progress) and `deadline` (on `progress.clock`) are run_plan's."""

    say, clock = progress.say, progress.clock
    runs: list[_Run] = []
    for p in planned:
        tag = f"[{index[p.rel]}/{progress.total}] {p.label}"
        if run_state(root / p.rel) == "complete":
            say(f"{tag}: complete, skipped")
        else:
            runs.append(_Run(p, p.config(base), tag))
    if not runs:
        return
    for cfg in {r.cfg.hash(): r.cfg for r in runs}.values():
        driver._check_inputs(cfg, say)  # a bad task or model fails every run alike: before any starts
    shares = plan_shares(runs, root, gpus)
    owner = {s.index: r for r in runs for s in r.shares}
    last_end = [clock()]

    def admit(share: driver.Share) -> str | None:
        r = owner[share.index]
        if r.state == "refused":
            return r.why
        if r.state == "running":
            return None  # a later part of a run that started
        p, d = r.planned, root / r.planned.rel
        need = estimate(p, len(r.cfg.jobs), root, 1)
        if deadline is not None and (clock() >= deadline or (need is not None and clock() + need > deadline)):
            say(f"{r.tag}: not started, it needs about {_dur(need or 0.0)} and the deadline comes in "
                f"{_dur(max(0.0, deadline - clock()))}")
            record.set(p, state="skipped", error="the deadline would cut it")
            r.state, r.why = "refused", "the deadline would cut it"
            return r.why
        if d.exists():
            say(f"{r.tag}: unfinished run moved aside to {move_aside(d).name}; running it again")
        log = d.with_name(d.name + ".log")
        record.set(p, state="running", log=str(log.relative_to(root)), config_hash=r.cfg.hash())
        r.state, r.t0 = "running", clock()
        return None

    def started(share: driver.Share, info: dict) -> None:
        r = owner[share.index]
        r.gpus.append(f"{info['host']}:{info['gpu_ids'][0]}")
        part = f" part {r.part(share.index)} ({', '.join(share.jobs)})" if len(r.shares) > 1 else ""
        say(f"{r.tag}{part}: running on {info['host']} GPU {info['gpu_ids'][0]} (elapsed "
            f"{_dur(clock() - progress.t0)}, {progress.eta()})")
        record.set(r.planned, gpus=list(r.gpus))

    def ended(o: Outcome) -> None:
        r = owner[o.index]
        output.run_ended(next(s.label for s in r.shares if s.index == o.index))
        r.outcomes[o.index] = o
        if r.state == "refused" or len(r.outcomes) < len(r.shares):
            if o.error and r.state != "refused":
                say(f"{r.tag} part {r.part(o.index)}: FAILED: {o.error}")
            return
        finish(r)

    def finish(r: _Run) -> None:
        r.state = "ended"
        outs = [r.outcomes[s.index] for s in r.shares]
        d = root / r.planned.rel
        secs = clock() - r.t0
        if len(r.shares) > 1:
            gather_logs(d, [s.jobs for s in r.shares])
        failed = [o for o in outs if o.summary is None]
        if failed:
            error = "; ".join((f"part {outs.index(o)}: " if len(outs) > 1 else "") + str(o.error) for o in failed)
            record.set(r.planned, state="failed", seconds=secs, error=error)
            say(f"{r.tag}: FAILED after {_dur(secs)}: {error} (log: {d.with_name(d.name + '.log')})")
        else:
            summary = merge_parts(r.cfg, d, outs) if len(outs) > 1 else outs[0].summary
            sph = summary.get("steps_per_hour")
            record.set(r.planned, state="complete", seconds=secs, steps_per_hour=sph, error=None)
            say(f"{r.tag}: done in {_dur(secs)}, {rate_line(summary)}")
        now = clock()
        progress.finished(now - last_end[0])  # wall time between finishes: the ETA of runs side by side
        last_end[0] = now

    output.log_into(root / "ray.log")
    hooks = driver.Hooks(admit=admit, started=started, ended=ended,
                         line=lambda share, line: output.run_line(share.label, line))
    stop_at = None if deadline is None else deadline - STOP_TERM_S - STOP_REPORT_S
    try:
        driver.run_shares(shares, min(gpus, len(shares)), address, say, hooks=hooks, stop_at=stop_at,
                          **({"grace_s": STOP_TERM_S} if deadline is not None else {}))
    except driver.DeadlineReached:
        for r in runs:
            if r.state == "running":
                say(f"{r.tag}: stopped at the deadline")
                record.set(r.planned, state="failed", error="stopped at the deadline")
            elif r.state == "waiting":
                say(f"{r.tag}: not started, the deadline has come")
                record.set(r.planned, state="skipped", error="the deadline came first")
    finally:
        for r in runs:  # cut short (the deadline, Ctrl-C): a run in parts keeps its parts' logs as one
            if r.state == "running" and len(r.shares) > 1:
                gather_logs(root / r.planned.rel, [s.jobs for s in r.shares])
