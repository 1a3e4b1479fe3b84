"""What a report reads: the complete run directories under the given paths (folders, or archives of
them), each run's numbers as `RunData`.

RUNS are run directories, directories holding them (a sweep's DIR), or `.tar.gz` / `.tgz` archives
of such directories, read as the folder they hold: every `summary.json` below them whose status.json
says complete is one run (directories moved aside as `*.incomplete-<n>` are left out; another is
named with what became of it: still running, killed, interrupted, failed). Each run's arm
and seed come from its config.json; its repeat index from the sweep.json that lists it, else from
its order among runs of the same (arm, seed).
"""

from __future__ import annotations

import json
import math
import tarfile
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colora.config import ARMS, ConfigError, from_dict
from colora.record.runlog import read_jsonl
from colora.run.rundir import describe
from colora.studies.prereg import lock_hash

METRICS = (("eval_accuracy", "final eval accuracy"), ("train_reward", "mean training reward"))


class ReportError(ValueError):
    """Nothing to report on, or an input that cannot be read; the message names the path."""


@dataclass
class RunData:
    path: Path
    arm: str
    seed: int
    repeat: int | None
    lock_hash: str
    summary: dict
    eval_after: dict[str, float]  # job -> final eval accuracy
    reward_mean: dict[str, float]  # job -> mean over ok steps of the step's mean reward
    curves: dict[str, list[tuple[int, float]]]  # job -> [(step, reward)]
    spans: list[dict] = field(default_factory=list)
    eval_before: dict[str, float] = field(default_factory=dict)  # job -> eval accuracy before training

    @property
    def steps_per_hour(self) -> float:
        v = self.summary.get("steps_per_hour")
        try:
            return float(v)
        except (TypeError, ValueError):
            return math.nan


# -- reading runs ---------------------------------------------------------------------------------
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
_unpacked: dict[Path, tuple[Path, tempfile.TemporaryDirectory]] = {}  # archive -> (its folder, the temp dir)


def is_archive(p: Path) -> bool:
    return p.is_file() and p.name.endswith(ARCHIVE_SUFFIXES)


def unpack(archive: Path) -> Path:
    """The folder an archive of run directories holds, unpacked once per process into a temporary
    directory (removed at exit). Members that would land outside it, links and devices are refused."""
    archive = archive.resolve()
    if archive not in _unpacked:
        tmp = tempfile.TemporaryDirectory(prefix="colora-report-")
        try:
            with tarfile.open(archive, "r:gz") as tf:
                tf.extractall(tmp.name, filter="data")
        except (tarfile.TarError, OSError, EOFError) as e:
            tmp.cleanup()
            raise ReportError(f"{str(archive)!r}: not a readable .tar.gz of run directories ({e})") from None
        _unpacked[archive] = (Path(tmp.name), tmp)
    return _unpacked[archive][0]


def display_path(p: Path) -> str:
    """A run directory as a reader finds it: inside an archive, `ARCHIVE:member/path`."""
    for archive, (root, _) in _unpacked.items():
        if p.is_relative_to(root):
            return f"{archive.name}:{p.relative_to(root).as_posix()}"
    return str(p)


def is_run_dir(p: Path) -> bool:
    """A run directory holds summary.json beside its config.json (a report's folder has no config.json)."""
    return (p / "summary.json").is_file() and (p / "config.json").is_file()


def find_run_dirs(paths: list[str | Path]) -> list[Path]:
    """Every run directory (`is_run_dir`) given or below the given paths (folders or archives of
    them)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ReportError(f"{str(p)!r} does not exist")
        if is_archive(p):
            p = unpack(p)
        if is_run_dir(p):
            found.append(p)
            continue
        below = sorted(s.parent for s in p.rglob("summary.json")
                       if is_run_dir(s.parent) and not any(".incomplete-" in part for part in s.relative_to(p).parts))
        if not below:
            raise ReportError(f"{str(p)!r} holds no run directory (none has a summary.json)")
        found += below
    return sorted(dict.fromkeys(q.resolve() for q in found))


def _sweep_repeat(run: Path) -> int | None:
    """The repeat index a sweep.json in one of the run's parents gives this run."""
    for parent in list(run.parents)[:3]:
        sj = parent / "sweep.json"
        if sj.is_file():
            try:
                runs = json.loads(sj.read_text()).get("runs", [])
            except (json.JSONDecodeError, AttributeError):
                return None
            rel = str(run.relative_to(parent))
            for r in runs:
                if r.get("dir") == rel:
                    return int(r["repeat"])
    return None


def load_run(path: Path) -> RunData | None:
    """One run's numbers; None (skipped) when its status is not complete."""
    try:
        status = json.loads((path / "status.json").read_text()).get("state")
        summary = json.loads((path / "summary.json").read_text())
        cfg = from_dict(json.loads((path / "config.json").read_text())["config"])
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise ReportError(f"{path}: cannot read the run ({type(e).__name__}: {e})") from None
    except ConfigError as e:
        raise ReportError(f"{path}/config.json: {e}") from None
    if status != "complete":
        return None
    ev = json.loads((path / "eval.json").read_text()) if (path / "eval.json").is_file() else {}
    eval_after = {j: float(v["accuracy"]) for j, v in ev.get("after", {}).items() if v.get("accuracy") is not None}
    eval_before = {j: float(v["accuracy"]) for j, v in ev.get("before", {}).items() if v.get("accuracy") is not None}
    rows = [r for r in read_jsonl(path / "metrics.jsonl")
            if r.get("status") == "ok" and "reward" in r and "event" not in r]
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in rows:
        curves[r["job"]].append((int(r["step"]), float(r["reward"])))
    curves = {j: sorted(v) for j, v in curves.items()}
    reward_mean = {j: float(np.mean([r for _, r in v])) for j, v in curves.items()}
    return RunData(path, cfg.experiment.arm, cfg.experiment.seed, _sweep_repeat(path), lock_hash(cfg), summary,
                   eval_after, reward_mean, curves, read_jsonl(path / "timeline.jsonl"), eval_before)


def load_runs(paths: list[str | Path]) -> tuple[list[RunData], list[str]]:
    """Complete runs with repeat indices filled in, and warnings about what was left out."""
    runs, warnings = [], []
    for d in find_run_dirs(paths):
        r = load_run(d)
        if r is None:
            warnings.append(f"{display_path(d)}: not complete ({describe(d)}), left out")
            continue
        runs.append(r)
        failed = r.summary.get("failed_jobs") or []
        if failed:
            warnings.append(f"{display_path(d)}: job(s) {', '.join(failed)} failed in this run (summary.json): "
                            "their numbers stop where they stopped")
    if not runs:
        raise ReportError("no complete run among " + ", ".join(map(str, paths)))
    by_key: dict[tuple, list[RunData]] = defaultdict(list)
    for r in runs:
        by_key[(r.arm, r.seed)].append(r)
    for key, rs in by_key.items():
        taken = {r.repeat for r in rs if r.repeat is not None}
        free = (i for i in range(len(rs) + len(taken)) if i not in taken)
        for r in sorted((r for r in rs if r.repeat is None), key=lambda r: str(r.path)):
            r.repeat = next(free)
        reps = [r.repeat for r in rs]
        if len(set(reps)) != len(reps):
            raise ReportError(f"{key[0]} seed {key[1]}: several runs claim the same repeat ({sorted(reps)}): "
                              + ", ".join(display_path(r.path) for r in rs))
    arm_order = {a: i for i, a in enumerate(ARMS)}
    runs.sort(key=lambda r: (arm_order[r.arm], r.seed, r.repeat))
    return runs, warnings
