"""Typed tables: frozen dataclasses built from TOML tables, every key and value checked.

`build(cls, raw, prefix)` accepts only `cls`'s fields and checks each value against its annotation:
`Literal`, bool, int, float, str, dict, tuples (fixed or `tuple[T, ...]`) and nested dataclasses. The
only conversion is int -> float. A dataclass whose class attribute `SHORTHAND` names a field also
accepts a string `s` for `{SHORTHAND: s}`. A problem raises `ConfigError` naming the key, the value
and what would be accepted.
"""

from __future__ import annotations

import dataclasses
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
