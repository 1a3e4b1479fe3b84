"""docs/configuration.md is what `python -m colora.config_doc` prints, and every key has a meaning.

When this fails after a change to colora/config.py: write the new field's comment there, then
    python -m colora.config_doc > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import re
import textwrap
from pathlib import Path

from colora import config_doc

ROOT = Path(__file__).resolve().parents[1]
# a repository path in a comment: one of the top-level folders, then at least one more part
REPO_PATH = re.compile(r"\b(?:colora|kernels|tasks|tests|experiments|prereg|reports|docs|scripts)/[\w./-]*\w")


def test_the_reference_is_current():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_doc.render(), (
        "docs/configuration.md is not what the config code says: run "
        "`python -m colora.config_doc > docs/configuration.md` and commit it")


def test_every_key_and_section_is_described():
    sections = config_doc.sections()
    assert {s.title for s in sections} >= {"[experiment]", "[engine]", "[trainer]", "[[jobs]]"}
    undocumented = [f"{s.title} {k.name}" for s in sections for k in s.keys if not k.meaning]
    assert not undocumented, f"fields of colora/config.py without a comment: {', '.join(undocumented)}"
    bare = [s.title for s in sections if not s.text]
    assert not bare, f"sections of colora/config.py without a class docstring: {', '.join(bare)}"


def test_every_file_a_comment_names_exists():
    missing = [f"{s.title} {k.name}: {p}" for s in config_doc.sections() for k in s.keys
               for p in REPO_PATH.findall(k.meaning) if not (ROOT / p).exists()]
    assert not missing, f"config comments name files the repository does not have: {missing}"


def test_comments_above_and_trailing_are_both_taken_and_nothing_else(tmp_path, monkeypatch):
    mod = tmp_path / "cfg_sample.py"
    mod.write_text(textwrap.dedent('''
        from dataclasses import dataclass, field

        @dataclass(frozen=True)
        class C:
            """A section."""

            a: int = 1  # trailing only
            # above, line one
            # above, line two
            b: str = "x # not a comment"  # and trailing

            c: float = 2.0
            # a comment before a blank line belongs to nothing

            d: bool = True
            e: tuple[int, ...] = field(
                default=(1, 2),  # on a continuation line
            )
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import cfg_sample

    got = config_doc.field_comments(cfg_sample.C)
    assert got == {"a": "trailing only", "b": "above, line one above, line two and trailing", "c": "", "d": "",
                   "e": "on a continuation line"}


def test_types_and_defaults_read_as_toml():
    from typing import Literal

    assert config_doc.type_name(Literal["auto", "on"]) == 'one of "auto", "on"'
    assert config_doc.type_name(tuple[str, ...]) == "list of strings"
    assert config_doc.type_name(tuple[float, float]) == "list of 2 numbers"
    assert config_doc.type_name(bool) == "boolean"
    values = (True, 1e-4, "x", (1, 2), {})
    assert [config_doc.toml_value(v) for v in values] == ["true", "0.0001", '"x"', "[1, 2]", "{}"]
    job = {k.name: k for s in config_doc.sections() if s.title == "[[jobs]]" for k in s.keys}
    assert job["name"].default == "required"
    assert job["response_length"].type == "table"
    fields = {f.name for f in dataclasses.fields(config_doc.Config)}
    assert {s.title.strip("[]") for s in config_doc.sections() if "." not in s.title} == fields
