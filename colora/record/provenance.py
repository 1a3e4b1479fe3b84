"""Which code made a run: the git commit where there is one, and always a hash of the source tree.

A run's summary records both (`code_version`), so every figure names the code it came from, also
where the code arrives without its git folder (the GPU host gets a copy of the working tree).
The source hash covers every `.py` file of the three installed packages (`colora`, `colora.kernels`,
`colora.tasks`) by relative path and content; it equals for two copies of the same tree wherever
they lie.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import colora
import colora.kernels
import colora.tasks


def package_dirs() -> dict[str, Path]:
    """{package: folder} of colora and its two mapped subpackages (resolved through symlinks)."""
    return {name: Path(mod.__file__).resolve().parent
            for name, mod in (("colora", colora), ("colora.kernels", colora.kernels), ("colora.tasks", colora.tasks))}


def source_hash(dirs: dict[str, Path] | None = None) -> str:
    """sha256 (first 16 hex digits) over (package, relative path, content) of every .py file."""
    h = hashlib.sha256()
    for name, d in sorted((dirs or package_dirs()).items()):
        for f in sorted(p for p in d.rglob("*.py") if "__pycache__" not in p.parts):
            rel = f.relative_to(d).as_posix()
            if name == "colora" and rel.split("/", 1)[0] in ("kernels", "tasks"):
                continue  # a shim that links the subpackages inside colora/: hashed under their own name
            h.update(f"{name}/{rel}\0".encode())
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def git_commit(where: Path | None = None) -> tuple[str | None, bool | None]:
    """(HEAD's commit, whether tracked files differ from it) of the checkout holding colora, or
    (None, None) where there is no git or no checkout."""
    where = where or package_dirs()["colora"]
    try:
        head = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None, None
        dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


def code_version() -> dict:
    """{"commit", "dirty", "source_hash"} for a run's summary."""
    commit, dirty = git_commit()
    return {"commit": commit, "dirty": dirty, "source_hash": source_hash()}
