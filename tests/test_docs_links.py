"""Every file the README, the changelog, docs/ and the reports name exists in the repository.

Checked: every relative Markdown link (and its #anchor, where it points into a Markdown file), and every
backticked repository path (`colora/config.py`, `reports/trainer_step/`) outside code blocks: a path whose first
part is one of the repository's top-level entries, or one that starts with ./ or ../. Nothing may point outside the
repository: it must stand alone.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"^\.{0,2}/?[\w.-]+(/[\w.-]*)+$")
EXTERNAL = ("http://", "https://", "mailto:")


def documents() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted(ROOT.glob("reports/*/report.md"))]
    return [p for p in docs if p.is_file()]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced (```) and indented (4 spaces) code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced and not line.startswith(("    ", "\t")):
            out.append(line)
    return out


def anchors(md: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    heads = [line.lstrip("#").strip() for line in prose_lines(md.read_text()) if re.match(r"#{1,6} ", line)]
    return {"".join(c for c in h.lower() if c.isalnum() or c in "-_ ").replace(" ", "-") for h in heads}


def top_level() -> set[str]:
    """The repository's top-level entries: those git tracks (a checkout also holds .venv and the run
    directories `make smoke` writes, which are not the repository's), else every entry."""
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {p.name for p in ROOT.iterdir()} - {".git"}
    return {f.split("/")[0] for f in files.splitlines()}


def problems(doc: Path, text: str | None = None) -> list[str]:
    """What `doc` (or `text`, read as if it were `doc`) names that does not exist."""
    top = top_level()
    bad = []

    def check(ref: str, base: Path) -> None:
        path, _, anchor = ref.partition("#")
        target = (base / path).resolve() if path else doc
        if not target.is_relative_to(ROOT):
            bad.append(f"{ref}: outside the repository")
        elif not target.exists():
            bad.append(f"{ref}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{ref}: no heading #{anchor} in {target.relative_to(ROOT)}")

    for line in prose_lines(doc.read_text() if text is None else text):
        for ref in LINK.findall(line):
            if not ref.startswith(EXTERNAL):
                check(ref, doc.parent)
        for span in CODE.findall(line):
            span = span.strip()
            if not PATHLIKE.match(span):
                continue
            if span.startswith(("./", "../")):
                check(span, doc.parent)
            elif span.split("/")[0] in top:
                check(span, ROOT)
    return bad


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_document_names_exists(doc):
    bad = problems(doc)
    assert not bad, f"{doc.relative_to(ROOT)} names what the repository does not have: {bad}"


def test_the_check_finds_what_is_missing():
    text = ("See [a](architecture.md), [b](missing.md), [c](../../outside.md), [d](architecture.md#no-such-heading),\n"
            "[e](configuration.md#engine), `colora/config.py`, `colora/nope.py`, `runs/mine`, `../../x.py`,\n"
            "[f](https://example.org).\n"
            "```\n`colora/in_a_code_block.py` [g](in_a_code_block.md)\n```\n"
            "    `colora/in_an_indented_block.py`\n")
    got = problems(ROOT / "docs" / "probe.md", text)
    assert got == ["missing.md: no such file", "../../outside.md: outside the repository",
                   "architecture.md#no-such-heading: no heading #no-such-heading in docs/architecture.md",
                   "colora/nope.py: no such file", "../../x.py: outside the repository"]
