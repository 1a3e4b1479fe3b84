"""Every repository path that the code's docstrings, comments and configs name exists.

tests/test_docs_links.py checks the Markdown documents; this checks the rest of the tracked text: a path
whose first part is one of the repository's folders (`colora/engine/rollout.py`, `reports/smollm2/report.md`)
must exist, and nothing may name a file outside the repository (`../shared/...`, a design document
that is not in it). Exempt: what a command writes (`--out reports/NAME`), placeholders in capitals or
angle brackets (`prereg/NAME.md`, `configs/<GPU>.json`), and globs that match a file.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("colora", "kernels", "tasks", "experiments", "scripts", "docs", "tests", "prereg", "reports")
PATH = re.compile(r"(?<![\w/.~$-])((?:\.\./)*(?:" + "|".join(FOLDERS) + r")/[\w./*<>-]*)")
OUTSIDE = re.compile(r"\.\./shared\b|\bDESIGN\.md\b|\bMETHOD\.md\b|(?<![\w/])seeds/\d+")
WRITTEN = re.compile(r"(--out|--runs)[ =]$")
# prereg/reference8.md is locked by its hash; it names the reference study as the brief does
LOCKED = {"prereg/reference8.md"}
# these two hold paths that must not exist: the checks' own examples
SELF = {"tests/test_docs_links.py", "tests/test_source_refs.py"}


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", *FOLDERS, "Makefile", "pyproject.toml", ".ci"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [f for f in out if f.endswith((".py", ".toml", ".sh", ".json", "Makefile", "run")) and (ROOT / f).is_file()]


def problems(name: str, text: str) -> list[str]:
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in OUTSIDE.finditer(line):
            bad.append(f"{name}:{n}: {m.group(0)} is not in the repository")
        for m in PATH.finditer(line):
            ref = m.group(1).rstrip(".")
            if WRITTEN.search(line[: m.start()]) or re.search(r"/[A-Z_]+(\.\w+)?/?$|<", ref):
                continue
            if ref.startswith("../"):
                bad.append(f"{name}:{n}: {ref} is outside the repository")
            elif not (any(ROOT.glob(ref)) if "*" in ref else (ROOT / ref).exists()):
                bad.append(f"{name}:{n}: {ref}: no such file")
    return bad


def test_every_path_the_code_names_exists():
    files = [f for f in tracked() if f not in LOCKED | SELF]
    assert len(files) > 50, files  # the listing found the code
    bad = [p for f in files for p in problems(f, (ROOT / f).read_text(errors="replace"))]
    assert not bad, "\n".join(bad)


def test_the_check_finds_what_is_missing():
    text = ("# see reports/h200/eighth and colora/engine/rollout.py; ../shared/gpu/README.md; DESIGN.md\n"
            "'''(seeds/002, `reports/smollm2/report.md`, ~/.cache/colora/models, kernels/lora/configs/<GPU>.json)\n"
            "    colora report RUNS --out reports/NAME; colora bench kernels --out reports/kernels\n"
            "    reports/*/report.md and reports/*/nothing.md, prereg/NAME.md, tests/nope.py.\n")
    assert problems("x.py", text) == [
        "x.py:1: ../shared is not in the repository", "x.py:1: DESIGN.md is not in the repository",
        "x.py:1: reports/h200/eighth: no such file", "x.py:2: seeds/002 is not in the repository",
        "x.py:4: reports/*/nothing.md: no such file", "x.py:4: tests/nope.py: no such file"]
