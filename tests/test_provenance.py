"""colora.record.provenance: the code version a run's summary records.

    pytest tests/test_provenance.py -q
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from colora.record.provenance import code_version, git_commit, package_dirs, source_hash


def _copy(tmp: Path) -> dict[str, Path]:
    dirs = {}
    for name, d in package_dirs().items():
        dest = tmp / name
        shutil.copytree(d, dest, ignore=shutil.ignore_patterns("__pycache__"))
        dirs[name] = dest
    return dirs


def test_source_hash_is_the_same_for_a_copy_and_changes_with_one_byte(tmp_path):
    dirs = _copy(tmp_path)
    assert source_hash(dirs) == source_hash()
    f = dirs["colora.tasks"] / "extract.py"
    f.write_text(f.read_text() + "\n")
    assert source_hash(dirs) != source_hash()


def test_source_hash_ignores_bytecode_and_files_that_are_not_python(tmp_path):
    dirs = _copy(tmp_path)
    before = source_hash(dirs)
    (dirs["colora"] / "__pycache__").mkdir(exist_ok=True)
    (dirs["colora"] / "__pycache__" / "x.cpython-311.py").write_text("junk")
    (dirs["colora"] / "notes.txt").write_text("junk")
    assert source_hash(dirs) == before


def test_git_commit_outside_a_checkout_is_none(tmp_path):
    assert git_commit(tmp_path) == (None, None)


def test_code_version_names_the_checkout_commit():
    v = code_version()
    assert len(v["source_hash"]) == 16
    root = package_dirs()["colora"]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert v["commit"] == head.stdout.strip() and isinstance(v["dirty"], bool)
    else:
        assert v["commit"] is None
