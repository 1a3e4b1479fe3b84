"""The runs of a plan (colora/sweeps/orchestrate.py) and its record, ROOT/sweep.json.

sweep.json lists every run the root holds, from every invocation, with its state (colora/run/rundir.py:
complete, resumable, or moved aside). A run directory that a live process holds (another sweep on
the same root, a resume of that run) refuses the plan before anything runs.
"""

from __future__ import annotations

import datetime
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from colora.config import Config, ConfigError, diff, from_dict, replace, resolve
from colora.record.runlog import write_json_atomic
from colora.run.rundir import holder, in_use, run_config_hash, run_state
from colora.studies.prereg import lock_hash


# -- the runs of a plan ----------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedRun:
    arm: str
    seed: int
    tag: str = "r0"  # what tells the run apart from others of its (arm, seed): a repeat, a variation
    repeat: int = 0
    jobs: int = 0  # the number of jobs (the config's jobs cycled under new names); 0: the config's
    set: tuple[str, ...] = ()  # the run's own overrides, applied after the base config's

    @property
    def rel(self) -> str:
        return f"{self.arm}/seed{self.seed}-{self.tag.replace(':', '-').replace('=', '-').replace('/', '-')}"

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed} {self.tag}" + (f" ({self.jobs} jobs)" if self.jobs else "")

    def overrides(self) -> list[str]:
        return [f"experiment.arm={self.arm}", f"experiment.seed={self.seed}", *self.set]

    def config(self, base: Config) -> Config:
        if self.jobs and self.jobs != len(base.jobs):
            base = with_jobs(base, self.jobs)
        return replace(base, self.overrides())


def scaled_jobs(cfg: Config, n: int) -> list[dict]:
    """The workload as `n` jobs: the config's jobs cycled, renamed `<name>-<k>`."""
    base = cfg.to_dict()["jobs"]
    jobs = []
    for k in range(n):
        j = dict(base[k % len(base)])
        j["name"] = j["name"] if k < len(base) else f"{j['name']}-{k // len(base)}"
        jobs.append(j)
    return jobs


def with_jobs(cfg: Config, n: int) -> Config:
    d = cfg.to_dict()
    d["jobs"] = scaled_jobs(cfg, n)
    return resolve(d)


def _describe_diff(a: dict, b: Config) -> str:
    try:
        d = diff(from_dict(a), b)
    except ConfigError:
        return "(the old config no longer resolves)"
    return "; ".join(f"{k}: {x!r} there, {y!r} here" for k, x, y in d[:6]) + (" ..." if len(d) > 6 else "")


def check_existing(root: Path, base: Config, planned: list[PlannedRun]) -> dict[str, str]:
    """State of each planned run; refuses (ConfigError) complete runs or a sweep.json of another
    config, and a run that a live process still writes (colora/run/rundir.py)."""
    sj = root / "sweep.json"
    if sj.is_file():
        try:
            old = json.loads(sj.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{sj} is not valid JSON ({e}); move it away or use another --out") from None
        if old.get("lock_hash") not in (None, lock_hash(base)):
            raise ConfigError(f"{str(root)!r} holds a sweep of another config ({old.get('lock_hash')}, this one "
                              f"{lock_hash(base)}: {_describe_diff(old.get('config', {}), base)}); use another --out")
    states = {}
    for p in planned:
        d = root / p.rel
        st = run_state(d)
        if st == "running" and (rec := holder(d)) is not None:  # another sweep on this root, or a resume of it
            raise ConfigError(in_use(d, rec))
        if st == "complete":
            want = p.config(base)
            h, cfgd = run_config_hash(d)
            if h != want.hash():
                raise ConfigError(f"{d} is a complete run of another config ({h}, this plan's is {want.hash()}: "
                                  f"{_describe_diff(cfgd or {}, want)}); use another --out")
        states[p.rel] = st
    return states


def estimate(p: PlannedRun, jobs: int, root: Path, engine_starts: int) -> float | None:
    """About how long run `p` (of `jobs` jobs) will take, from the finished runs under `root` (their
    summaries' wall time): the median of the same arm's runs at the same job count, else of every run
    at that job count, plus the longest engine start seen once per engine `p` starts (0 for a cached
    engine; a timeslice run starts one per tenant, one after another); None before any run of its job
    count has finished."""
    walls, same, starts = [], [], []
    for f in root.glob("*/*/summary.json"):
        s = json.loads(f.read_text())
        start = 0.0 if s.get("engine_reused") else s.get("engine_start_s", 0.0)
        starts.append(start)
        if len(s.get("jobs", ())) == jobs:
            walls.append(s["wall_s"] - start)
            if s.get("arm") == p.arm:
                same.append(s["wall_s"] - start)
    if not walls:
        return None
    return statistics.median(same or walls) + engine_starts * max(starts)


class Record:
    """ROOT/sweep.json: every run the root holds (also from earlier invocations) and its state. A
    child process updates the same file; `reload` reads what it wrote."""

    def __init__(self, root: Path, data: dict | None = None):
        self.path = root / "sweep.json"
        self.runs: dict[str, dict] = {}
        self.data: dict = {}
        self.reload()
        if data is not None:  # a new invocation
            started = datetime.datetime.now(datetime.timezone.utc).isoformat()
            calls = self.data.get("invocations", []) + [{"command": data.get("command", ""), "started": started}]
            self.data = {k: v for k, v in data.items() if k != "command"} | {"invocations": calls}

    def reload(self) -> None:
        old = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.runs = {r["dir"]: r for r in old.pop("runs", [])}
        self.data = old

    def set(self, p: PlannedRun, **fields) -> None:
        r = self.runs.setdefault(p.rel, {"dir": p.rel, "arm": p.arm, "seed": p.seed, "repeat": p.repeat, "tag": p.tag})
        r.update(fields)
        runs = sorted(self.runs.values(), key=lambda r: (r["seed"], r["repeat"], r["arm"], r.get("tag", "")))
        write_json_atomic(self.path, {**self.data, "runs": runs})
