"""Seed sweeps: one run directory per (arm, seed, repeat), resumable, with one progress line per run.

    colora sweep CONFIG --seeds 1 2 3 [--arms dedicated shared_sync ...] [--repeats N]
                 [--aa-seeds 1] [--set key=value ...] [--prereg FILE] --out DIR [--dry-run] [--verbose]

Layout: `DIR/<arm>/seed<seed>-r<repeat>/` is a run directory (colora.runner), its log is beside it
as `seed<seed>-r<repeat>.log`, and `DIR/sweep.json` lists every run with its state.

Resuming: a run whose status.json says complete and which has summary.json is skipped; any other
existing run directory (killed, failed) is renamed `<dir>.incomplete-<n>` (never deleted) and run
again. A complete run made with a different config is refused before anything runs, and so is a
DIR that holds a sweep of another config: a sweep never mixes configs.

Order: seed by seed, and within a seed repeat by repeat and arm by arm, so slow drift of the
machine falls on every arm alike rather than on the arm run last. The dedicated arm runs twice
(repeats 0 and 1) on the `--aa-seeds` (the A/A: two runs of the baseline that should not differ).

Engines: one `EngineCache` serves every in-process run (vLLM's start is the dominant cost of a
short run). MPS arms on a GPU run in a child process (`python -m colora.cli run ...`): whether a
process is an MPS client is fixed when its CUDA context is made, and the cached engine is closed
first so that the measured run has the GPU to itself; within a seed those arms run after the others
so the cache is rebuilt once per seed. On the CPU there is no MPS and every run is in-process.

With `--prereg`, the config (with `--set`) must be the one the pre-registration locked, except
experiment.arm and experiment.seed, which the sweep sets; otherwise nothing runs. Arms, seeds,
repeats and A/A seeds default to the pre-registration's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import python_m
from .config import ARMS, Config, ConfigError, diff, from_dict, load_config, replace
from .runlog import write_json_atomic

MPS_ARMS = ("mps", "overlap_mps")


@dataclass(frozen=True)
class PlannedRun:
    arm: str
    seed: int
    repeat: int

    @property
    def rel(self) -> str:
        return f"{self.arm}/seed{self.seed}-r{self.repeat}"

    @property
    def label(self) -> str:
        return f"{self.arm} seed {self.seed} r{self.repeat}"

    def overrides(self) -> list[str]:
        return [f"experiment.arm={self.arm}", f"experiment.seed={self.seed}"]


def plan_runs(arms: list[str], seeds: list[int], repeats: int = 1, aa_seeds: list[int] = ()) -> list[PlannedRun]:
    """Every (arm, seed, repeat) in run order (see the module docstring)."""
    if repeats < 1:
        raise ConfigError(f"--repeats ({repeats}) must be at least 1")
    for name, xs in (("--arms", arms), ("--seeds", seeds)):
        if not xs:
            raise ConfigError(f"{name} must name at least one value")
        if len(set(xs)) != len(xs):
            raise ConfigError(f"{name} {list(xs)} repeats a value")
    for a in arms:
        if a not in ARMS:
            raise ConfigError(f"--arms: {a!r} is not an arm; accepted: {', '.join(ARMS)}")
    extra = sorted(set(aa_seeds) - set(seeds))
    if extra:
        raise ConfigError(f"--aa-seeds {extra} are not among --seeds {list(seeds)}")
    if aa_seeds and "dedicated" not in arms:
        raise ConfigError("--aa-seeds repeat the dedicated arm, which is not among --arms")
    out = []
    for s in seeds:
        n = {a: max(repeats, 2) if (a == "dedicated" and s in aa_seeds) else repeats for a in arms}
        for r in range(max(n.values())):
            ordered = [a for a in arms if a not in MPS_ARMS] + [a for a in arms if a in MPS_ARMS]
            out += [PlannedRun(a, s, r) for a in ordered if r < n[a]]
    return out


# -- run directories ------------------------------------------------------------------------------
def run_state(path: Path) -> str:
    """missing | complete | incomplete (killed or failed: anything else that exists)."""
    if not path.exists():
        return "missing"
    try:
        state = json.loads((path / "status.json").read_text()).get("state")
    except (OSError, json.JSONDecodeError, AttributeError):
        state = None
    return "complete" if state == "complete" and (path / "summary.json").is_file() else "incomplete"


def run_config_hash(path: Path) -> tuple[str | None, dict | None]:
    try:
        d = json.loads((path / "config.json").read_text())
        return d.get("hash"), d.get("config")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None, None


def move_aside(path: Path) -> Path:
    """Rename an unfinished run directory to `<name>.incomplete-<n>` (first free n)."""
    n = 1
    while (dest := path.with_name(f"{path.name}.incomplete-{n}")).exists():
        n += 1
    path.rename(dest)
    return dest


def _describe_diff(a: dict, b: Config) -> str:
    try:
        d = diff(from_dict(a), b)
    except ConfigError:
        return "(the old config no longer resolves)"
    return "; ".join(f"{k}: {x!r} there, {y!r} here" for k, x, y in d[:6]) + (" ..." if len(d) > 6 else "")


def check_existing(out: Path, base: Config, planned: list[PlannedRun]) -> dict[str, str]:
    """State of each planned run; refuses (ConfigError) complete runs or a sweep.json of another config."""
    from .prereg import lock_hash

    sj = out / "sweep.json"
    if sj.is_file():
        try:
            old = json.loads(sj.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{sj} is not valid JSON ({e}); move it away or use another --out") from None
        if old.get("lock_hash") not in (None, lock_hash(base)):
            raise ConfigError(f"--out {str(out)!r} holds a sweep of another config ({old.get('lock_hash')}, this one "
                              f"{lock_hash(base)}: {_describe_diff(old.get('config', {}), base)}); use another --out")
    states = {}
    for p in planned:
        d = out / p.rel
        st = run_state(d)
        if st == "complete":
            want = replace(base, p.overrides())
            h, cfgd = run_config_hash(d)
            if h != want.hash():
                raise ConfigError(f"{d} is a complete run of another config ({h}, this sweep's is {want.hash()}: "
                                  f"{_describe_diff(cfgd or {}, want)}); use another --out")
        states[p.rel] = st
    return states


# -- running --------------------------------------------------------------------------------------
RunFn = Callable[[Config, Path, object, Callable[[str], None]], dict]


def run_in_process(cfg: Config, out: Path, cache, log: Callable[[str], None]) -> dict:
    from .runner import run

    return run(cfg, out, log=log, engine_cache=cache)


def run_in_child(config_path: str, overrides: list[str], out: Path, log_path: Path) -> dict:
    """`colora run` in a child process (MPS arms on a GPU); its output goes to `log_path`."""
    cmd = [*python_m("colora.cli"), "run", str(config_path)]
    for o in overrides:
        cmd += ["--set", o]
    cmd += ["--out", str(out)]
    with open(log_path, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log_path.read_text().splitlines()[-5:]
        raise RuntimeError(f"child run exited with status {rc}; last lines of {log_path}: " + " | ".join(tail))
    return json.loads((out / "summary.json").read_text())


def needs_child(cfg: Config) -> bool:
    """MPS arms on a GPU need a fresh process; on the CPU there is no MPS to set up."""
    if cfg.experiment.arm not in MPS_ARMS or cfg.experiment.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def release_gpu_memory() -> None:
    """Give back what this process's earlier runs left in torch's CUDA cache before a child run."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _dur(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class _Record:
    """sweep.json: every run the directory holds (also from earlier invocations) and its state."""

    def __init__(self, out: Path, base: Config, config_path: str, overrides: list[str], command: str,
                 prereg: str | None):
        from .prereg import lock_hash

        self.path = out / "sweep.json"
        old = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.runs: dict[str, dict] = {r["dir"]: r for r in old.get("runs", [])}
        self.data = {"config_path": str(config_path), "overrides": list(overrides), "lock_hash": lock_hash(base),
                     "config": base.to_dict(), "prereg": prereg,
                     "invocations": old.get("invocations", []) + [
                         {"command": command, "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}]}

    def set(self, p: PlannedRun, **fields) -> None:
        r = self.runs.setdefault(p.rel, {"dir": p.rel, "arm": p.arm, "seed": p.seed, "repeat": p.repeat})
        r.update(fields)
        self.write()

    def write(self) -> None:
        runs = sorted(self.runs.values(), key=lambda r: (r["seed"], r["repeat"], r["arm"]))
        write_json_atomic(self.path, {**self.data, "runs": runs})


def run_sweep(base: Config, planned: list[PlannedRun], out: str | Path, *, config_path: str = "",
              overrides: list[str] = (), command: str = "", prereg: str | None = None,
              run_fn: RunFn = run_in_process, child_fn=run_in_child, use_child: Callable[[Config], bool] = needs_child,
              progress: Callable[[str], None] | None = None, verbose: bool = False,
              clock: Callable[[], float] = time.monotonic) -> dict:
    """Run every planned run that is not complete yet; returns {rel dir: state}.

    Runs that raise are recorded as failed and the sweep goes on; a RunError (bad input, the same
    for every run) stops it. `run_fn`, `child_fn` and `use_child` are injectable for tests.
    """
    from .runner import EngineCache, RunError

    out = Path(out)
    progress = progress or (lambda s: print(s, file=sys.stderr, flush=True))
    configs = {p.rel: replace(base, p.overrides()) for p in planned}  # every config error before any run
    states = check_existing(out, base, planned)
    out.mkdir(parents=True, exist_ok=True)
    rec = _Record(out, base, config_path, list(overrides), command, prereg)
    for p in planned:
        rec.set(p, state="pending" if states[p.rel] != "complete" else "complete",
                config_hash=configs[p.rel].hash())
    todo = sum(1 for p in planned if states[p.rel] != "complete")
    progress(f"sweep: {len(planned)} runs into {out} ({len(planned) - todo} complete already, {todo} to run)")
    cache = EngineCache()
    t0, done_s, n_done = clock(), 0.0, 0
    try:
        for i, p in enumerate(planned, 1):
            tag = f"[{i}/{len(planned)}] {p.label}"
            d = out / p.rel
            if states[p.rel] == "complete":
                progress(f"{tag}: complete, skipped")
                continue
            if d.exists():
                moved = move_aside(d)
                progress(f"{tag}: unfinished run moved aside to {moved.name}; running it again")
            eta = f"ETA {_dur(done_s / n_done * (todo - n_done))}" if n_done else "ETA after the first run"
            progress(f"{tag}: running (elapsed {_dur(clock() - t0)}, {eta})")
            cfg = configs[p.rel]
            log_path = out / p.arm / f"seed{p.seed}-r{p.repeat}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            rec.set(p, state="running", log=str(log_path.relative_to(out)))
            t = clock()
            try:
                if use_child(cfg):
                    cache.close()  # the measured MPS run gets the GPU to itself
                    release_gpu_memory()
                    summary = child_fn(config_path, list(overrides) + p.overrides(), d, log_path)
                    got, _ = run_config_hash(d)
                    if got != cfg.hash():
                        raise RuntimeError(f"the child run's config hashes to {got}, not {cfg.hash()}: was "
                                           f"{config_path} edited during the sweep?")
                else:
                    with open(log_path, "a") as logf:
                        def log(s: str, _f=logf) -> None:
                            _f.write(s + "\n")
                            _f.flush()
                            if verbose:
                                progress(f"  {s}")

                        summary = run_fn(cfg, d, cache, log)
            except RunError as e:
                rec.set(p, state="failed", error=f"RunError: {e}")
                raise
            except Exception as e:
                secs = clock() - t
                rec.set(p, state="failed", seconds=secs, error=f"{type(e).__name__}: {e}")
                states[p.rel] = "failed"
                progress(f"{tag}: FAILED after {_dur(secs)}: {type(e).__name__}: {e} (log: {log_path})")
                n_done, done_s = n_done + 1, done_s + secs
                continue
            secs = clock() - t
            n_done, done_s = n_done + 1, done_s + secs
            states[p.rel] = "complete"
            sph = summary.get("steps_per_hour")
            rec.set(p, state="complete", seconds=secs, steps_per_hour=sph, error=None)
            rate = f"{sph:.0f} steps/h" if isinstance(sph, (int, float)) else f"steps/h {sph}"
            progress(f"{tag}: done in {_dur(secs)}, {rate}")
    except KeyboardInterrupt:
        progress("sweep: interrupted; run it again to resume")
        raise
    finally:
        cache.close()
    failed = [r for r, s in states.items() if s == "failed"]
    progress(f"sweep: {len(planned) - len(failed)}/{len(planned)} complete in {_dur(clock() - t0)}"
             + (f"; failed: {', '.join(failed)}" if failed else ""))
    return states


# -- command line ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora sweep", description="Run a config over arms, seeds and repeats.")
    p.add_argument("config", help="experiment TOML file")
    p.add_argument("--seeds", type=int, nargs="+", help="run seeds (default: the pre-registration's)")
    p.add_argument("--arms", nargs="+", choices=ARMS, help="arms (default: the pre-registration's, else dedicated "
                                                          "and the config's arm)")
    p.add_argument("--repeats", type=int, help="runs per (arm, seed) (default: the pre-registration's, else 1)")
    p.add_argument("--aa-seeds", type=int, nargs="*", help="seeds on which dedicated also runs repeat 1, the A/A "
                                                           "(default: the pre-registration's, else none)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--prereg", help="refuse to run unless the config is the one this pre-registration locked")
    p.add_argument("--out", required=True, help="sweep directory")
    p.add_argument("--dry-run", action="store_true", help="print the plan and each run's state; run nothing")
    p.add_argument("--verbose", action="store_true", help="also print each run's log lines")
    return p


def main(argv: list[str] | None = None, run_fn: RunFn = run_in_process) -> int:
    from .prereg import PreregError, PreregMismatch, load_prereg, require_match
    from .runner import RunError

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (or --help): return its status
        return int(e.code or 0)
    command = "colora sweep " + " ".join(argv)
    try:
        for o in args.set:
            if o.split("=", 1)[0].strip() in ("experiment.arm", "experiment.seed"):
                raise ConfigError(f"--set {o}: the sweep sets experiment.arm and experiment.seed per run; "
                                  "use --arms and --seeds")
        base = load_config(args.config, args.set)
        pr = load_prereg(args.prereg) if args.prereg else None
        if pr is not None:
            require_match(pr, base, f"{args.config}" + (f" with --set {' '.join(args.set)}" if args.set else ""))
        arms = args.arms or (list(pr.arms) if pr else list(dict.fromkeys(["dedicated", base.experiment.arm])))
        if args.seeds is None and pr is None:
            raise ConfigError("give --seeds (e.g. --seeds 1 2 3) or a --prereg that lists them")
        seeds = args.seeds or list(pr.seeds)
        repeats = args.repeats if args.repeats is not None else (pr.repeats if pr else 1)
        aa = args.aa_seeds if args.aa_seeds is not None else ([s for s in pr.aa_seeds if s in seeds] if pr else [])
        planned = plan_runs(arms, seeds, repeats, aa)
        if pr is not None:
            extra = [f"arm {a}" for a in arms if a not in pr.arms] + [f"seed {s}" for s in seeds if s not in pr.seeds]
            if extra:
                print(f"note: {', '.join(extra)} not pre-registered in {pr.path}: exploratory", file=sys.stderr)
        if args.dry_run:
            states = check_existing(Path(args.out), base, planned)
            for i, p in enumerate(planned, 1):
                print(f"[{i}/{len(planned)}] {p.label} -> {Path(args.out) / p.rel}: {states[p.rel]}")
            return 0
        states = run_sweep(base, planned, args.out, config_path=args.config, overrides=args.set, command=command,
                           prereg=args.prereg, run_fn=run_fn, verbose=args.verbose)
    except PreregMismatch as e:
        print(f"colora: error: refusing to sweep: {e}", file=sys.stderr)
        return 2
    except (ConfigError, PreregError, RunError) as e:
        print(f"colora: error: {e}", file=sys.stderr)
        return 2
    return 1 if any(s == "failed" for s in states.values()) else 0
