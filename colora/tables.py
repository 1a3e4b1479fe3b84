"""Typed tables: frozen dataclasses built from TOML tables, every key and value checked.

`build(cls, raw, prefix)` accepts only `cls`'s fields and checks each value against its annotation:
`Literal`, bool, int, float, str, dict, tuples (fixed or `tuple[T, ...]`) and nested dataclasses. The
only conversion is int -> float. A dataclass whose class attribute `SHORTHAND` names a field also
accepts a string `s` for `{SHORTHAND: s}`. A problem raises `ConfigError` naming the key, the value
and what would be accepted. `parse_override` and `set_override` put a `--set key=value` into a raw
config dict.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A config problem; the message names the key, the value and what is accepted."""


def _accepts(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a table with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}.get(
        tp, str(tp).replace("typing.", "")
    )


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; the only conversion is int -> float."""
    origin = get_origin(tp)
    bad = ConfigError(f"{key} = {value!r} is not valid: expected {_accepts(tp)}")
    if origin is Literal:
        if value not in get_args(tp):
            raise bad
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str) and getattr(tp, "SHORTHAND", None):
            value = {tp.SHORTHAND: value}
        if not isinstance(value, dict):
            raise bad
        return build(tp, value, key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key} = {value!r} is not valid: expected {len(args)} values")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad
        return value
    if tp is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    raise TypeError(f"unsupported annotation {tp!r} for {key}")


def build(cls: type, raw: dict, prefix: str) -> Any:
    """`cls(**raw)`, each key of `raw` checked against `cls`'s fields and each value against its
    annotation; `prefix` is the table's dotted name in messages ("" for the top level)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        where = prefix or "the top level"
        raise ConfigError(f"unknown key {prefix + '.' if prefix else ''}{unknown[0]} in {where}; accepted: {', '.join(names)}")
    kwargs = {k: _coerce(f"{prefix}.{k}" if prefix else k, v, hints[k]) for k, v in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kwargs]
        raise ConfigError(f"{prefix or 'config'} is missing required key(s): {', '.join(missing)}") from e


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with a TOML value (`3`, `1e-4`, `true`, `"x"`, `[1, 2]`); a bare word is a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. experiment.steps=3)")
    key, raw = (s.strip() for s in text.split("=", 1))
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def set_override(raw: dict, key: str, value: Any, *, sections: tuple[str, ...], hint=lambda section: "") -> None:
    """`key = value` into a raw config dict: `section.key...`, `jobs.<index|name|*>.key` into every
    job it selects, or `jobs = ["a", "b"]` (`jobs=a,b`): only those jobs, in that order. An error names
    the key and what is accepted (`hint(section)` adds to it)."""
    parts = key.split(".")
    if parts == ["jobs"]:
        raw["jobs"] = _select_jobs(raw.get("jobs", []), value)
        return
    if parts[0] == "jobs":
        jobs = raw.get("jobs", [])
        if len(parts) < 3:
            raise ConfigError(f"override {key!r}: use jobs.<index|name|*>.<key>, e.g. jobs.0.learning_rate")
        sel, rest = parts[1], parts[2:]
        if sel == "*":
            targets = jobs
        elif sel.isdigit():
            if int(sel) >= len(jobs):
                raise ConfigError(f"override {key!r}: there are only {len(jobs)} jobs (indices 0-{len(jobs) - 1})")
            targets = [jobs[int(sel)]]
        else:
            targets = [j for j in jobs if j.get("name") == sel]
            if not targets:
                names = ", ".join(str(j.get("name")) for j in jobs)
                raise ConfigError(f"override {key!r}: no job named {sel!r}; jobs are: {names}")
        for j in targets:
            _set_path(j, rest, value)
        return
    if parts[0] not in sections:
        raise ConfigError(f"unknown key {key!r}; the top level accepts: "
                          f"{', '.join([*sections, 'jobs'])}{hint(parts[0])}")
    _set_path(raw.setdefault(parts[0], {}), parts[1:], value)


def _select_jobs(jobs: list, names: Any) -> list:
    names_now = ", ".join(str(j.get("name")) for j in jobs if isinstance(j, dict))
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",")]
    if not (isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)):
        raise ConfigError(f"override 'jobs' takes a list of job names, e.g. jobs=a,b "
                          f"(got {names!r}); jobs are: {names_now}")
    by_name = {j.get("name"): j for j in jobs if isinstance(j, dict)}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(f"override 'jobs': no job named {unknown[0]!r}; jobs are: {names_now}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"override 'jobs': {twice[0]!r} is named more than once")
    return [by_name[n] for n in names]


def _set_path(d: dict, parts: list[str], value: Any) -> None:
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"override path through {p!r} is not a table")
    d[parts[-1]] = value
