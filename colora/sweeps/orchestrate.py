"""Many runs of one config: arms x seeds x variations, each in a run directory under one root.
`colora sweep` and `colora bench arms` plan their runs and hand them to `run_plan`.

Layout: ROOT/<arm>/seed<seed>-<tag>/ is a run directory (colora/run/runner.py; its run.log is the full
log), colora's own lines of it are also beside it as seed<seed>-<tag>.log; ROOT/sweep.json lists
every run with its state. The terminal shows the runs done with an ETA and each run's progress
(colora/output.py).

Processes: consecutive planned runs of one kind share a process and its engines (vLLM's start is
the dominant cost of a short run): "plain" runs (no MPS), or MPS runs of one pair of MPS shares.
Whether a process is an MPS client, and with what share of the SMs, is fixed when it makes its CUDA
context, and a client cannot quit its daemon while it lives. So a group of MPS runs on a GPU runs in
a child process, for which this process (no client of that daemon) starts the daemon and which it
starts with its trainer's share; with `children=True` every group runs in a child of its own (the
arms benchmark: each batch a clean process). Other groups run in this process, one `EngineCache` for
all of them.

Resuming: a run whose status.json says complete and which has summary.json is skipped; an
interrupted or killed run of the same config with a sound checkpoint continues from it
(`colora run --resume`); any other existing run directory (failed, or with no checkpoint) is renamed
`<dir>.incomplete-<n>` (never deleted) and run again. A complete run made with another config is
refused before anything runs, and so is a ROOT that holds a sweep of another config: runs of several
configs never mix.

Deadline: with `deadline_s`, a run starts only if the finished runs say it ends in time (`estimate`);
a child still running when the time is nearly up is stopped (SIGTERM to it, then SIGKILL to its
process group) so that its shutdown and the report fit. A run not started is recorded as "skipped" and
runs later when the plan is run again.

Signals (colora/stopping.py): SIGINT, SIGTERM or SIGHUP stop the plan. The run in progress stops as
`colora run` does and is recorded as "interrupted" in sweep.json; a child process is sent SIGTERM
(it stops its run the same way) and its process group SIGKILL after STOP_TERM_S; running the same
command again continues where the plan stopped. A second signal exits at once.

With `gpus` above 1 (or a Ray `address`) the runs go to a Ray cluster instead, `gpus` at once, one
GPU and one fresh process each (colora/sweeps/on_cluster.py); the layout, the record, resuming and the
deadline are as above, but for a run a signal stopped on the cluster: its co-runner is cancelled,
and the plan runs it again from its beginning (its directory moved aside).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from colora import output, python_m
from colora.config import Config, from_dict
from colora.engine.rollout import EngineCache, engine_process, release_cuda_cache
from colora.environment import child_env
from colora.output import duration as _dur
from colora.record.throughput import rate_line
from colora.run import runner
from colora.run.mps import MpsDaemon, MpsUnavailable
from colora.run.preflight import MPS_ARMS, RunError
from colora.run.rundir import move_aside, resumable, run_state
from colora.stopping import STOP_REPORT_S, STOP_TERM_S, Interrupted, handling_signals, on_abort
from colora.studies.prereg import lock_hash
from colora.sweeps.on_cluster import run_on_cluster
from colora.sweeps.plan import PlannedRun, Record, check_existing, estimate
from colora.tasks import add_task_dirs, task_dirs
from colora.timeslice.arm import run_timeslice, tenants_of

RunFn = Callable[[Config, Path, EngineCache, Callable[[str], None]], dict]
ResumeFn = Callable[[Path, EngineCache, Callable[[str], None]], dict]


# -- processes ------------------------------------------------------------------------------------
@dataclass
class ProcessGroup:
    """Consecutive planned runs that share one process."""

    runs: list[PlannedRun]
    mps_shares: tuple[int, int] | None  # (engine, trainer) percentages of MPS runs; None: no MPS

    @property
    def kind(self) -> str:
        return "plain" if self.mps_shares is None else "mps"

    def env(self) -> dict[str, str]:
        """The environment of the group's child process: an MPS group's starts with its trainer's share
        (CUDA fixes a process's share when it first initialises there)."""
        return child_env(self.mps_shares[1] if self.mps_shares else None)


def mps_shares(cfg: Config) -> tuple[int, int] | None:
    if cfg.experiment.arm not in MPS_ARMS:
        return None
    return cfg.overlap.mps_engine_percentage, cfg.overlap.mps_trainer_percentage


def process_groups(base: Config, planned: list[PlannedRun]) -> list[ProcessGroup]:
    """The plan cut into groups of consecutive runs of one kind (see the module docstring)."""
    groups: list[ProcessGroup] = []
    for p in planned:
        shares = mps_shares(p.config(base))
        if groups and groups[-1].mps_shares == shares:
            groups[-1].runs.append(p)
        else:
            groups.append(ProcessGroup([p], shares))
    return groups


def on_gpu(group: ProcessGroup, base: Config) -> bool:
    """An MPS group on a GPU needs a child process; on the CPU there is no MPS to set up."""
    if group.mps_shares is None or base.experiment.device == "cpu":
        return False

    return torch.cuda.is_available()


# -- running --------------------------------------------------------------------------------------
def run_in_process(cfg: Config, out: Path, cache: EngineCache, log: Callable[[str], None], process_mps=None) -> dict:
    if cfg.experiment.arm == "timeslice":  # its tenants are processes of their own (colora/timeslice/arm.py)
        cache.close()  # the arm's tenants have the GPU to themselves: no engine of an earlier run beside them
        release_cuda_cache()
        return run_timeslice(cfg, out, log)
    return runner.run(cfg, out, log=log, engine_cache=cache, process_mps=process_mps)


def resume_in_process(out: Path, cache: EngineCache, log: Callable[[str], None], process_mps=None) -> dict:
    return runner.resume(out, log=log, engine_cache=cache, process_mps=process_mps)


@dataclass
class _Progress:
    """Counts and prints the plan's progress: one line per run, with an ETA from the runs done."""

    total: int
    todo: int
    say: Callable[[str], None]
    clock: Callable[[], float]
    t0: float = 0.0
    done_s: float = 0.0
    n_done: int = 0

    def eta(self) -> str:
        return (f"ETA {_dur(self.done_s / self.n_done * (self.todo - self.n_done))}" if self.n_done
                else "ETA after the first run")

    def finished(self, secs: float) -> None:
        """One more run ended (complete or failed) after `secs`; the sweep's bar follows."""
        self.n_done, self.done_s = self.n_done + 1, self.done_s + secs
        output.sweep_progress(self.n_done, self.eta())


def run_group(base: Config, runs: list[PlannedRun], root: Path, record: Record, cache: EngineCache, run_fn: RunFn,
              progress: _Progress, index: dict[str, int], deadline: float | None,
              resume_fn: ResumeFn = resume_in_process) -> None:
    """Run every run of `runs` that is not complete, in this process: skip complete ones, resume
    interrupted ones from their checkpoint, move other unfinished ones aside, start none the deadline
    (on `progress.clock`) would cut. Runs that raise are recorded as failed and the others go on; a
    RunError (bad input, the same for every run) stops the plan, and so does an interruption (the run
    recorded as interrupted)."""
    clock, say = progress.clock, progress.say
    engines: set = set()  # (client kind, engine settings) of the engines this process has started
    for p in runs:
        tag, d, cfg = f"[{index[p.rel]}/{progress.total}] {p.label}", root / p.rel, p.config(base)
        if run_state(d) == "complete":
            say(f"{tag}: complete, skipped")
            continue
        # --vary engine.* starts another engine, and so does another slot count (the dedicated arm's one)
        engine = (engine_process(cfg.runtime.engine_process, p.arm), cfg.engine, runner.adapter_slots(cfg))
        # a timeslice run's tenants each start an engine of their own, one after another
        starts = len(tenants_of(cfg)) if p.arm == "timeslice" else int(engine not in engines)
        need = estimate(p, len(cfg.jobs), root, starts)
        if deadline is not None and (clock() >= deadline or (need is not None and clock() + need > deadline)):
            say(f"{tag}: not started, it needs about {_dur(need or 0.0)} and the deadline comes in "
                f"{_dur(max(0.0, deadline - clock()))}")
            record.set(p, state="skipped", error="the deadline would cut it")
            continue
        engines.add(engine)
        resuming = d.exists() and resumable(d, cfg.hash())
        if d.exists() and not resuming:
            say(f"{tag}: unfinished run moved aside to {move_aside(d).name}; running it again")
        say(f"{tag}: {'resuming from its checkpoint' if resuming else 'running'} "
            f"(elapsed {_dur(clock() - progress.t0)}, {progress.eta()})")
        log_path = d.with_name(d.name + ".log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        record.set(p, state="running", log=str(log_path.relative_to(root)), config_hash=cfg.hash())
        t = clock()
        aborted = lambda p=p: record.set(p, state="interrupted", error="a second signal: exited at once")  # noqa: E731
        try:
            with open(log_path, "a") as logf, on_abort(aborted):
                def log(s: str, _f=logf) -> None:  # the terminal's share: colora/output.py
                    _f.write(s + "\n")
                    _f.flush()

                summary = resume_fn(d, cache, log) if resuming else run_fn(cfg, d, cache, log)
        except RunError as e:
            record.set(p, state="failed", error=f"RunError: {e}")
            raise
        except Interrupted as e:
            record.set(p, state="interrupted", seconds=clock() - t, error=str(e))
            say(f"{tag}: {e}")
            raise
        except Exception as e:
            secs = clock() - t
            record.set(p, state="failed", seconds=secs, error=f"{type(e).__name__}: {e}")
            say(f"{tag}: FAILED after {_dur(secs)}: {type(e).__name__}: {e} (log: {d / 'run.log'})")
            progress.finished(secs)
            continue
        secs = clock() - t
        progress.finished(secs)
        sph = summary.get("steps_per_hour")
        record.set(p, state="complete", seconds=secs, steps_per_hour=sph, error=None)
        say(f"{tag}: done in {_dur(secs)}, {rate_line(summary)}")


def run_child_group(base: Config, group: ProcessGroup, root: Path, index: dict[str, int], total: int,
                    seconds: float | None, verbose: bool) -> int | str:
    """Run a group in a child process (with the MPS daemon started here for an MPS group); its exit
    code, or "deadline" when it had to be stopped. `seconds`: the time left to the whole plan."""
    daemon = None
    if group.mps_shares is not None:
        # This process is no client of the daemon (its own CUDA context, if any, was made without it),
        # so it can quit it cleanly once the child, the only client, has exited.

        daemon = MpsDaemon()
        try:
            daemon.start()
        except MpsUnavailable as e:
            output.say(f"MPS unavailable here ({e}); the child decides what to do")
            daemon = None
    budget = None if seconds is None else seconds - STOP_TERM_S - STOP_REPORT_S

    spec = {"config": base.to_dict(), "root": str(root), "runs": [asdict(p) for p in group.runs],
            "index": index, "total": total, "seconds": budget, "verbose": verbose, "task_dirs": task_dirs()}
    output.say(f"== {group.kind} process: {len(group.runs)} runs")
    child = subprocess.Popen([*python_m("colora.sweeps.orchestrate"), json.dumps(spec)], env=group.env(),
                             start_new_session=True)
    try:
        return wait_or_stop(child, None if seconds is None else time.monotonic() + seconds)
    except BaseException:  # interrupted here: the child (a session of its own) does not go by itself
        if child.poll() is None:
            _stop(child)
        raise
    finally:
        if daemon is not None:
            output.say(f"MPS daemon: {daemon.stop()}")


def wait_or_stop(child: subprocess.Popen, deadline: float | None) -> int | str:
    """The child's exit code, or "deadline" when it had to be stopped: SIGTERM to its process group
    early enough that the shutdown (at most STOP_TERM_S, then SIGKILL) and the report still end by
    `deadline` (time.monotonic()), which is the whole plan's limit."""
    if deadline is None:
        return child.wait()
    stop_at = deadline - STOP_TERM_S - STOP_REPORT_S
    try:
        return child.wait(timeout=max(0.0, stop_at - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    _stop(child)
    return "deadline"


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM to the child, which then stops its run and its engine (colora/stopping.py); after it
    ended, or after STOP_TERM_S, SIGKILL to its process group (what is left of its engine's
    processes)."""
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=STOP_TERM_S)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=STOP_TERM_S)


def run_plan(base: Config, planned: list[PlannedRun], root: str | Path, *, record: dict | None = None,
             run_fn: RunFn = run_in_process, resume_fn: ResumeFn = resume_in_process, children: bool = False,
             use_child: Callable[[ProcessGroup, Config], bool] = on_gpu, child_fn=run_child_group,
             deadline_s: float | None = None, progress: Callable[[str], None] | None = None,
             verbose: bool = False, clock: Callable[[], float] = time.monotonic, gpus: int = 1,
             address: str | None = None) -> dict[str, str]:
    """Run every planned run that is not complete yet; returns {rel dir: state} (complete, failed,
    interrupted, skipped, or missing for a run whose child process ended before it). record: what
    sweep.json says about this invocation (config_path, overrides, command, prereg). children: every
    group in a child process; else only those `use_child` picks. gpus, address: the runs on a Ray
    cluster, `gpus` at once (see the module docstring). Raises Interrupted on a signal, once the run
    in progress is recorded as interrupted. `run_fn`, `resume_fn`, `child_fn`, `use_child` and
    `clock` are injectable for tests."""
    root = Path(root)
    say = progress or output.say
    for p in planned:
        p.config(base)  # every config error before any run
    states = check_existing(root, base, planned)
    root.mkdir(parents=True, exist_ok=True)
    rec = Record(root, {**(record or {}), "lock_hash": lock_hash(base), "config": base.to_dict()})
    for p in planned:
        rec.set(p, state="pending" if states[p.rel] != "complete" else "complete", config_hash=p.config(base).hash())
    todo = sum(1 for p in planned if states[p.rel] != "complete")
    say(f"sweep: {len(planned)} runs into {root} ({len(planned) - todo} complete already, {todo} to run)")
    prog = _Progress(len(planned), todo, say, clock, t0=clock())
    output.sweep_started(todo)
    deadline = None if deadline_s is None else prog.t0 + deadline_s
    index = {p.rel: i for i, p in enumerate(planned, 1)}
    cache = EngineCache()
    with handling_signals():
        try:
            if gpus > 1 or address is not None:
                run_on_cluster(base, planned, root, rec, prog, index, deadline, gpus, address)
            else:
                _run_groups(base, planned, states, root, rec, cache, run_fn, resume_fn, children, use_child,
                            child_fn, prog, index, deadline, verbose)
        except Interrupted as e:
            rec.reload()
            cut = [p for p in planned if rec.runs.get(p.rel, {}).get("state") == "running"]
            for p in cut:  # a run whose process was stopped before it could say so
                rec.set(p, state="interrupted", error=f"interrupted by {e.signal}")
            cut = [p.rel for p in planned if rec.runs.get(p.rel, {}).get("state") == "interrupted"]
            e.message = (f"sweep interrupted by {e.signal}" + (f" in {', '.join(cut)}" if cut else "")
                         + "; continue with: " + ((record or {}).get("command") or "the same command again"))
            raise
        finally:
            cache.close()
    rec.reload()
    for p in planned:
        done = run_state(root / p.rel) == "complete"
        states[p.rel] = "complete" if done else rec.runs.get(p.rel, {}).get("state", "missing")
    failed = [r for r, s in states.items() if s in ("failed", "interrupted")]
    skipped = [r for r, s in states.items() if s == "skipped"]
    say(f"sweep: {len(planned) - len(failed) - len(skipped)}/{len(planned)} complete in {_dur(clock() - prog.t0)}"
        + (f"; failed or interrupted: {', '.join(failed)}" if failed else "")
        + (f"; not started before the deadline: {', '.join(skipped)}" if skipped else ""))
    return states


def _run_groups(base: Config, planned: list[PlannedRun], states: dict[str, str], root: Path, rec: Record,
                cache: EngineCache, run_fn: RunFn, resume_fn: ResumeFn, children: bool, use_child, child_fn,
                prog: _Progress, index: dict[str, int], deadline: float | None, verbose: bool) -> None:
    """The plan's process groups in order: each in a child process or in this one (see run_plan;
    `states`: each run's state when the plan began)."""
    clock, say = prog.clock, prog.say
    for group in process_groups(base, planned):
        if children or use_child(group, base):
            if all(run_state(root / p.rel) == "complete" for p in group.runs):
                for p in group.runs:
                    say(f"[{index[p.rel]}/{len(planned)}] {p.label}: complete, skipped")
                continue
            left = None if deadline is None else deadline - clock()
            if left is not None and left <= STOP_TERM_S + STOP_REPORT_S:
                for p in group.runs:
                    if run_state(root / p.rel) != "complete":
                        say(f"[{index[p.rel]}/{len(planned)}] {p.label}: not started, the deadline has come")
                        rec.set(p, state="skipped", error="the deadline came first")
                continue
            cache.close()  # the child's runs get the GPU to themselves
            release_cuda_cache()
            with output.handover():  # the child draws its own progress on the terminal
                rc = child_fn(base, group, root, index, len(planned), left, verbose)
            rec.reload()
            for p in group.runs:  # a run the child left open: it ended inside it or before it
                if rec.runs.get(p.rel, {}).get("state") in ("running", "pending"):
                    rec.set(p, state="failed", error=f"its process ended ({rc})")
            for p in group.runs:
                if states[p.rel] != "complete" and rec.runs.get(p.rel, {}).get("state") in ("complete", "failed"):
                    prog.finished(float(rec.runs[p.rel].get("seconds") or 0.0))
            if rc == 2:
                raise RunError(f"a {group.kind} process refused its runs (bad input); see its output above")
        else:
            run_group(base, group.runs, root, rec, cache, run_fn, prog, index, deadline, resume_fn)


def main(argv: list[str] | None = None) -> int:
    """A child process: run one group (its JSON spec is the only argument) with one engine cache and,
    for an MPS group, the daemon its parent started."""
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    add_task_dirs(*spec["task_dirs"])  # the parent's: its config file's folder, its current directory
    base, root = from_dict(spec["config"]), Path(spec["root"])
    runs = [PlannedRun(**{**r, "set": tuple(r["set"])}) for r in spec["runs"]]
    daemon = None
    if mps_shares(runs[0].config(base)) is not None:
        try:
            daemon = MpsDaemon.attached()  # started by the parent, before this process existed
        except MpsUnavailable as e:
            if base.overlap.mps_required:
                print(f"colora: error: the MPS arms need MPS, which is unavailable here ({e}); set "
                      "overlap.mps_required=false to run them without MPS, labelled so", file=sys.stderr)
                return 2
            print(f"warning: MPS unavailable ({e}); the MPS arms run without it, labelled so", flush=True)

    def run_fn(cfg, out, cache, log):
        return run_in_process(cfg, out, cache, log, process_mps=daemon)

    def resume_fn(out, cache, log):
        return resume_in_process(out, cache, log, process_mps=daemon)

    prog = _Progress(spec["total"], len(runs), output.say, time.monotonic, t0=time.monotonic())
    deadline = None if spec["seconds"] is None else prog.t0 + spec["seconds"]
    cache = EngineCache()
    with handling_signals():
        try:
            with output.session(spec["verbose"], "stdout"):
                output.sweep_started(len(runs))
                try:
                    run_group(base, runs, root, Record(root), cache, run_fn, prog, spec["index"], deadline, resume_fn)
                finally:
                    cache.close()
                    if daemon is not None:
                        output.say(f"MPS daemon: {daemon.stop()}")
        except RunError as e:
            print(f"colora: error: {e}", file=sys.stderr)
            return 2
        except Interrupted as e:  # the run is recorded as interrupted; the parent says how to continue
            print(f"colora: {e}", file=sys.stderr, flush=True)
            return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
