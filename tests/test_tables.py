"""colora.tables: frozen dataclasses from TOML tables, every key and value checked."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import pytest

from colora.config import ResponseLength, load_config
from colora.tables import ConfigError, build


@dataclass(frozen=True)
class Inner:
    SHORTHAND: ClassVar[str] = "mode"
    mode: Literal["a", "b"] = "a"
    size: int = 1


@dataclass(frozen=True)
class Outer:
    name: str
    rate: float = 0.5
    on: bool = False
    pair: tuple[int, int] = (1, 2)
    many: tuple[str, ...] = ()
    inner: Inner = field(default_factory=Inner)


def test_builds_nested_tables_and_converts_only_int_to_float():
    got = build(Outer, {"name": "x", "rate": 1, "pair": [3, 4], "many": ["p", "q"], "inner": {"size": 5}}, "t")
    assert got == Outer(name="x", rate=1.0, pair=(3, 4), many=("p", "q"), inner=Inner(size=5))
    assert isinstance(got.rate, float)


def test_a_string_stands_for_the_shorthand_field():
    assert build(Outer, {"name": "x", "inner": "b"}, "t").inner == Inner(mode="b")


@pytest.mark.parametrize("raw, message", [
    ({"name": "x", "speed": 1}, "unknown key t.speed in t; accepted: name, rate, on, pair, many, inner"),
    ({"name": "x", "rate": "fast"}, "t.rate = 'fast' is not valid: expected a number"),
    ({"name": "x", "on": 1}, "t.on = 1 is not valid: expected true or false"),
    ({"name": "x", "pair": [1, 2, 3]}, "t.pair = [1, 2, 3] is not valid: expected 2 values"),
    ({"name": "x", "many": ["p", 2]}, "t.many[1] = 2 is not valid: expected a string"),
    ({"name": "x", "inner": "c"}, "t.inner.mode = 'c' is not valid: expected one of 'a', 'b'"),
    ({"name": "x", "inner": {"size": True}}, "t.inner.size = True is not valid: expected an integer"),
    ({"rate": 1.0}, "t is missing required key(s): name"),
])
def test_bad_tables_name_the_key_the_value_and_what_is_accepted(raw, message):
    with pytest.raises(ConfigError) as e:
        build(Outer, raw, "t")
    assert str(e.value) == message


def test_the_response_length_shorthand_in_an_experiment_file(tmp_path):
    p = tmp_path / "e.toml"
    p.write_text('[experiment]\nmodel = "builtin:tiny"\n[[jobs]]\nname = "a"\ntask = "add"\nresponse_length = "fixed"\n')
    assert load_config(p).jobs[0].response_length == ResponseLength(dist="fixed")
