"""One run directory's state: complete, unfinished and resumable, or moved aside.

A run directory is complete when its status.json says so and it has summary.json (written last);
anything else that exists is unfinished: resumed from its checkpoint when it was interrupted or
killed (`resumable`), else moved aside, never deleted.
"""

from __future__ import annotations

import json
from pathlib import Path

from colora.run.checkpoint import CheckpointError, verify


def run_state(path: Path) -> str:
    """missing | complete | incomplete (killed or failed: anything else that exists)."""
    if not path.exists():
        return "missing"
    try:
        state = json.loads((path / "status.json").read_text()).get("state")
    except (OSError, json.JSONDecodeError, AttributeError):
        state = None
    return "complete" if state == "complete" and (path / "summary.json").is_file() else "incomplete"


def resumable(path: Path, config_hash: str) -> bool:
    """Whether an unfinished run can continue where it stopped: interrupted by a signal, or killed
    (its status still says running), of the config `config_hash`, with a checkpoint that verifies."""
    try:
        state = json.loads((path / "status.json").read_text()).get("state")
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    if state not in ("interrupted", "running") or run_config_hash(path)[0] != config_hash:
        return False
    for ck in sorted((path / "checkpoints").glob("step-*"), reverse=True):
        try:
            verify(ck)
            return True
        except CheckpointError:
            continue
    return False


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
