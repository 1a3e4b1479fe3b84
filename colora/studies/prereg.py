"""Pre-registrations: what an experiment claims, how it will be judged, and the config it locks.

    colora prereg lock experiments/reference8.toml --out prereg/reference8.md [--title T] [--set k=v]
    colora prereg check prereg/reference8.md experiments/reference8.toml [--set k=v ...]

A pre-registration is a Markdown file that opens with a TOML header between `+++` lines (the
project's configs are TOML too) and continues with prose:

    +++
    title = "..."
    date = "2026-11-29"                     # the day the config was locked (UTC)
    config = "experiments/reference8.toml"  # the file it was locked from (informational)
    config_hash = "0123456789abcdef"        # see `lock_hash`
    locked_config = "reference8.config.json"  # sidecar next to this file: the resolved config
    primary_metric = "..."
    primary_arm = "overlap_mps"
    arms = ["dedicated", "shared_sync", ...]
    seeds = [1, 2, 3]
    repeats = 1
    [aa]        seeds = [1]           # dedicated runs twice (repeat 0 and 1) on these seeds
    [gates]     min_ratio, aa_multiple, min_lower_bound, conf, interval   (colora.studies.stats.Gates)
    [analysis]  bootstrap_resamples, bootstrap_method, bootstrap_seed, plan
    [[hypotheses]] id, arm, statement
    +++

The locked hash is `Config.hash()` of the resolved config with `experiment.arm` and
`experiment.seed` set to "dedicated" and 0: those two keys are what a sweep sets per run (the arms
and seeds are listed in the header instead); every other key of the experiment is locked. The run
options (`[runtime]`) are not: they change how a run executes, not what it measures. The sidecar holds the
resolved config itself so that `check` can name each setting that differs, not just say that the
hash does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colora.config import ARMS, Config, ConfigError, dict_hash, diff, experiment_dict, from_dict, load_config
from colora.record.runlog import write_json_atomic
from colora.studies.stats import Gates

FREE_KEYS = ("experiment.arm", "experiment.seed")  # set per run by a sweep; never locked
_NORMAL = {"arm": "dedicated", "seed": 0}
_FENCE = "+++"


class PreregError(ValueError):
    """A malformed pre-registration or a refused lock; the message names the file and the key."""


class PreregMismatch(PreregError):
    """A config that differs from the one a pre-registration locked."""

    def __init__(self, message: str, differences: list[tuple[str, Any, Any]]):
        super().__init__(message)
        self.differences = differences


@dataclass(frozen=True)
class Hypothesis:
    id: str
    statement: str
    arm: str = ""


@dataclass(frozen=True)
class Prereg:
    path: Path
    title: str
    date: str
    config: str
    config_hash: str
    locked_config: str
    primary_metric: str
    primary_arm: str
    arms: tuple[str, ...]
    seeds: tuple[int, ...]
    repeats: int
    aa_seeds: tuple[int, ...]
    gates: Gates
    analysis: dict
    hypotheses: tuple[Hypothesis, ...] = field(default=())

    @property
    def sidecar(self) -> Path:
        return self.path.parent / self.locked_config

    def header_dict(self) -> dict:
        """The header as plain data (reports copy it into their summary.json)."""
        return {"path": str(self.path), "title": self.title, "date": self.date, "config": self.config,
                "config_hash": self.config_hash, "primary_metric": self.primary_metric,
                "primary_arm": self.primary_arm, "arms": list(self.arms), "seeds": list(self.seeds),
                "repeats": self.repeats, "aa_seeds": list(self.aa_seeds), "gates": self.gates.__dict__,
                "analysis": self.analysis,
                "hypotheses": [h.__dict__ for h in self.hypotheses]}


# -- hashing --------------------------------------------------------------------------------------
def _normalised(d: dict) -> dict:
    """The experiment's settings (no run options) with the per-run keys at their normal values."""
    d = experiment_dict(d)
    d.setdefault("experiment", {}).update(_NORMAL)
    return d


def lock_hash(cfg: Config) -> str:
    """Config.hash() with the per-run keys (FREE_KEYS) normalised: equal for every run of a sweep."""
    return dict_hash(_normalised(cfg.to_dict()))


# -- reading --------------------------------------------------------------------------------------
def split_front_matter(text: str, where: str = "pre-registration") -> tuple[str, str]:
    """(TOML header, Markdown body) of a file that opens with a `+++` fenced header."""
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].strip() != _FENCE:
        raise PreregError(f"{where}: must open with a '+++' line, then the TOML header, then '+++'")
    for i in range(1, len(lines)):
        if lines[i].strip() == _FENCE:
            return "".join(lines[1:i]), "".join(lines[i + 1:])
    raise PreregError(f"{where}: the TOML header opened with '+++' is never closed by another '+++' line")


def _need(h: dict, key: str, tp: type | tuple, where: str, what: str) -> Any:
    if key not in h:
        raise PreregError(f"{where}: header key {key!r} is missing; it must be {what}")
    v = h[key]
    if isinstance(v, bool) or not isinstance(v, tp):
        raise PreregError(f"{where}: header key {key} = {v!r} is not valid: expected {what}")
    return v


def _int_list(h: dict, key: str, where: str, default: list | None = None) -> tuple[int, ...]:
    if default is not None and key not in h:
        return tuple(default)
    v = _need(h, key, list, where, "a list of integers")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise PreregError(f"{where}: header key {key} = {v!r} is not valid: expected a list of integers")
    return tuple(v)


_HEADER_KEYS = {"title", "date", "config", "config_hash", "locked_config", "primary_metric", "primary_arm",
                "arms", "seeds", "repeats", "aa", "gates", "analysis", "hypotheses"}


def load_prereg(path: str | Path) -> Prereg:
    """Parse and validate a pre-registration's header; errors name the file and the key."""
    p = Path(path)
    if not p.is_file():
        raise PreregError(f"pre-registration {str(p)!r} does not exist")
    header, _ = split_front_matter(p.read_text(), str(p))
    try:
        h = tomllib.loads(header)
    except tomllib.TOMLDecodeError as e:
        raise PreregError(f"{p}: the header is not valid TOML ({e})") from None
    where = str(p)
    unknown = sorted(set(h) - _HEADER_KEYS)
    if unknown:
        raise PreregError(f"{where}: unknown header key {unknown[0]!r}; accepted: {', '.join(sorted(_HEADER_KEYS))}")
    arms = tuple(_need(h, "arms", list, where, "a list of arms"))
    for a in arms:
        if a not in ARMS:
            raise PreregError(f"{where}: arms holds {a!r}; accepted arms: {', '.join(ARMS)}")
    if "dedicated" not in arms:
        raise PreregError(f"{where}: arms must include 'dedicated', the baseline every arm is paired with")
    primary = _need(h, "primary_arm", str, where, "one of the arms")
    if primary not in arms:
        raise PreregError(f"{where}: primary_arm = {primary!r} is not in arms ({', '.join(arms)})")
    repeats = _need(h, "repeats", int, where, "an integer, at least 1")
    if repeats < 1:
        raise PreregError(f"{where}: repeats = {repeats} must be at least 1")
    aa = h.get("aa", {})
    if not isinstance(aa, dict):
        raise PreregError(f"{where}: [aa] must be a table with key seeds")
    gates_raw = h.get("gates", {})
    if not isinstance(gates_raw, dict):
        raise PreregError(f"{where}: [gates] must be a table")
    try:
        gates = Gates(**gates_raw)
    except TypeError:
        bad = sorted(set(gates_raw) - set(Gates.__dataclass_fields__))
        raise PreregError(f"{where}: unknown key gates.{bad[0] if bad else '?'}; accepted: "
                          f"{', '.join(Gates.__dataclass_fields__)}") from None
    except ValueError as e:
        raise PreregError(f"{where}: {e}") from None
    hyps = []
    for i, hy in enumerate(h.get("hypotheses", [])):
        if not isinstance(hy, dict) or "id" not in hy or "statement" not in hy:
            raise PreregError(f"{where}: hypotheses[{i}] must be a [[hypotheses]] table with id and statement")
        hyps.append(Hypothesis(str(hy["id"]), str(hy["statement"]), str(hy.get("arm", ""))))
    analysis = h.get("analysis", {})
    if not isinstance(analysis, dict):
        raise PreregError(f"{where}: [analysis] must be a table")
    return Prereg(
        path=p, title=_need(h, "title", str, where, "a string"),
        date=str(_need(h, "date", (str, datetime.date), where, "a date")),
        config=_need(h, "config", str, where, "the config file's path"),
        config_hash=_need(h, "config_hash", str, where, "the locked hash (colora prereg lock writes it)"),
        locked_config=_need(h, "locked_config", str, where, "the sidecar JSON's file name"),
        primary_metric=_need(h, "primary_metric", str, where, "a string"), primary_arm=primary, arms=arms,
        seeds=_int_list(h, "seeds", where), repeats=repeats, aa_seeds=_int_list(aa, "seeds", where, default=[]),
        gates=gates, analysis=analysis, hypotheses=tuple(hyps))


def locked_dict(pr: Prereg) -> dict:
    """The locked resolved config (sidecar), verified against the header's hash."""
    if not pr.config_hash:
        raise PreregError(f"{pr.path}: config_hash is empty: the config is not locked yet; run "
                          f"`colora prereg lock {pr.config} --out {pr.path}`")
    if not pr.sidecar.is_file():
        raise PreregError(f"{pr.path}: the locked config {str(pr.sidecar)!r} (locked_config) does not exist")
    try:
        side = json.loads(pr.sidecar.read_text())
        d = side["config"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise PreregError(f"{pr.sidecar}: not a locked config (expected JSON with a 'config' table: {e})") from None
    got = dict_hash(_normalised(d))
    if got != pr.config_hash:
        raise PreregError(f"{pr.sidecar}: its config hashes to {got}, but {pr.path} locks {pr.config_hash}: "
                          "the sidecar was edited or belongs to another pre-registration")
    return d


def compare(pr: Prereg, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, locked value, given value) for every locked setting that differs; [] when the config is
    the locked one. Raises PreregMismatch when only the hash differs (a changed config schema)."""
    d = locked_dict(pr)
    if lock_hash(cfg) == pr.config_hash:
        return []
    try:
        locked = from_dict(d)
    except ConfigError as e:
        raise PreregError(f"{pr.sidecar}: the locked config no longer resolves with this colora ({e}); "
                          "re-lock it") from None
    diffs = [(k, a, b) for k, a, b in diff(locked, cfg) if k not in FREE_KEYS]
    if not diffs:
        raise PreregMismatch(f"the config hashes to {lock_hash(cfg)}, {pr.path} locks {pr.config_hash}, but no "
                             "setting differs: colora's config schema changed since the lock; re-lock it", [])
    return diffs


def mismatch_message(pr: Prereg, cfg: Config, diffs: list[tuple[str, Any, Any]], what: str) -> str:
    lines = [f"{what} differs from the config locked by {pr.path} on {pr.date} "
             f"(locked {pr.config_hash}, this one {lock_hash(cfg)}) in {len(diffs)} setting(s):"]
    lines += [f"  {k}: locked {a!r}, here {b!r}" for k, a, b in diffs]
    return "\n".join(lines)


def require_match(pr: Prereg, cfg: Config, what: str = "the config") -> None:
    """Raise PreregMismatch naming every differing setting (sweeps call this before running)."""
    diffs = compare(pr, cfg)
    if diffs:
        raise PreregMismatch(mismatch_message(pr, cfg, diffs, what), diffs)


# -- writing --------------------------------------------------------------------------------------
def _toml(v: Any) -> str:
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML here")


def skeleton(title: str, cfg: Config, config_path: str, out: Path, date: str, chash: str) -> str:
    """A new pre-registration with the locked part filled in and the rest to be written."""
    arm = cfg.experiment.arm if cfg.experiment.arm != "dedicated" else "shared_sync"
    g = Gates()
    return f"""+++
title = {_toml(title)}
date = {_toml(date)}
config = {_toml(config_path)}
config_hash = {_toml(chash)}
locked_config = {_toml(out.with_suffix(".config.json").name)}
primary_metric = "optimizer steps per GPU-hour summed over jobs, over the dedicated baseline's on the same seed"
primary_arm = {_toml(arm)}
arms = {_toml(["dedicated", arm])}
seeds = [1, 2, 3]
repeats = 1

[aa]
seeds = [1]  # the dedicated arm runs twice on these seeds (the A/A)

[gates]
min_ratio = {g.min_ratio!r}
aa_multiple = {g.aa_multiple!r}
min_lower_bound = {g.min_lower_bound!r}
conf = {g.conf!r}
interval = {_toml(g.interval)}

[analysis]
bootstrap_resamples = 10000
bootstrap_method = "percentile"
bootstrap_seed = 0
plan = "TODO: how each hypothesis is tested"

[[hypotheses]]
id = "H1"
arm = {_toml(arm)}
statement = "TODO"
+++

# {title}

TODO: motivation, what is measured, what would count against the hypotheses.

Locked from `{config_path}` on {date}: every setting except {', '.join(FREE_KEYS)} (set per run by
`colora sweep`). Check a config against it with `colora prereg check {out} CONFIG`.
"""


def _set_header_line(header: str, key: str, value: str) -> str:
    """Replace a top-level `key = ...` line of the header, or insert it first (top-level keys must
    come before any table)."""
    line = f"{key} = {value}"
    pat = re.compile(rf"^{re.escape(key)}\s*=.*$", re.M)
    first_table = re.search(r"^\s*\[", header, re.M)
    m = pat.search(header)
    if m and (first_table is None or m.start() < first_table.start()):
        return header[:m.start()] + line + header[m.end():]
    return line + "\n" + header


def lock(config_path: str | Path, out: str | Path, overrides: list[str] = (), title: str | None = None,
         force: bool = False, today: str | None = None) -> tuple[Path, Path, str]:
    """Lock a config: write the sidecar and the header's config, config_hash, date, locked_config.

    A new file gets a skeleton to edit. An existing file keeps its prose and header and has only
    those four lines set; it must not be locked already unless `force` (a re-lock is a new
    pre-registration, dated anew). Returns (pre-registration, sidecar, hash).
    """
    out = Path(out)
    if out.suffix != ".md":
        raise PreregError(f"--out {str(out)!r}: a pre-registration is a Markdown file (NAME.md)")
    cfg = load_config(config_path, overrides)
    chash = lock_hash(cfg)
    sidecar = out.with_suffix(".config.json")
    date = today or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    if out.exists():
        pr_text = out.read_text()
        header, body = split_front_matter(pr_text, str(out))
        try:
            old = tomllib.loads(header)
        except tomllib.TOMLDecodeError as e:
            raise PreregError(f"{out}: the header is not valid TOML ({e})") from None
        if old.get("config_hash") and not force:
            raise PreregError(f"{out} already locks config {old['config_hash']} (dated {old.get('date')}); a "
                              "pre-registration is not re-locked silently: pass --force to re-lock it, "
                              "which dates it anew")
        for k, v in (("date", date), ("config", str(config_path)), ("config_hash", chash),
                     ("locked_config", sidecar.name)):
            header = _set_header_line(header, k, _toml(v))
        text = f"{_FENCE}\n{header}{'' if header.endswith(chr(10)) else chr(10)}{_FENCE}\n{body}"
    else:
        text = skeleton(title or cfg.experiment.name, cfg, str(config_path), out, date, chash)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(sidecar, {"hash": chash, "free_keys": list(FREE_KEYS), "source": str(config_path),
                                "overrides": list(overrides), "config": cfg.to_dict()})
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    load_prereg(out)  # what we wrote must read back
    return out, sidecar, chash


# -- command line ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora prereg",
                                description="Lock a config in a pre-registration, or check one against it.")
    sub = p.add_subparsers(dest="action", required=True)
    lk = sub.add_parser("lock", help="write the locked config and its hash into a pre-registration")
    lk.add_argument("config", help="experiment TOML file")
    lk.add_argument("--out", required=True, help="pre-registration to write, prereg/NAME.md")
    lk.add_argument("--title", help="title of a new pre-registration (default: experiment.name)")
    lk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    lk.add_argument("--force", action="store_true", help="re-lock a pre-registration that is already locked")
    ck = sub.add_parser("check", help="exit 0 if CONFIG is the locked config, else 1 naming each difference")
    ck.add_argument("prereg", help="pre-registration, prereg/NAME.md")
    ck.add_argument("config", help="experiment TOML file")
    ck.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (or --help): return its status
        return int(e.code or 0)
    try:
        if args.action == "lock":
            out, side, chash = lock(args.config, args.out, args.set, args.title, args.force)
            print(f"locked {args.config} ({chash}) in {out}; resolved config in {side}")
            return 0
        pr = load_prereg(args.prereg)
        cfg = load_config(args.config, args.set)
        what = args.config + (f" with {' '.join('--set ' + s for s in args.set)}" if args.set else "")
        diffs = compare(pr, cfg)
        if diffs:
            print(f"colora: prereg check: {mismatch_message(pr, cfg, diffs, what)}", file=sys.stderr)
            return 1
        print(f"matches: {what} is the config locked by {pr.path} on {pr.date} ({pr.config_hash}); "
              f"{' and '.join(FREE_KEYS)} are set per run")
        return 0
    except PreregMismatch as e:
        print(f"colora: prereg check: {e}", file=sys.stderr)
        return 1
    except (PreregError, ConfigError) as e:
        print(f"colora: error: {e}", file=sys.stderr)
        return 2
