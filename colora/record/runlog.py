"""The run's record: JSONL metrics (namespaced per job), the phase timeline, atomic JSON files.

Everything a report needs is written here as it happens, flushed line by line, so a run that dies
keeps what it measured. TensorBoard or plots are made from these files, never the other way round.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable


def _clean(v: Any) -> Any:
    """JSON has no NaN or infinity: write them as strings so a reader sees them and json parses."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON through a temporary file, fsync and rename: a crash leaves the old file or the new
    one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_clean(obj), f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (the writer died mid-line) is skipped."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class JsonlWriter:
    """Rows appended to a JSONL file, one flushed line each, from any thread. `on_row` sees every
    row after it is written (the progress display: colora/output.py)."""

    def __init__(self, path: str | Path, on_row: Callable[[dict], None] | None = None):
        self.path = Path(path)
        self._f = open(self.path, "a", buffering=1)
        self._lock = threading.Lock()
        self.on_row = on_row

    def write(self, row: dict) -> None:
        line = json.dumps(_clean(row), sort_keys=True)
        with self._lock:
            self._f.write(line + "\n")
        if self.on_row is not None:
            self.on_row(row)

    def close(self) -> None:
        self._f.close()


class Timeline:
    """Phase spans (job or group, phase, start, end) in seconds since the timeline's origin.

    Thread-safe: the engine thread and the trainer thread both record spans.
    """

    def __init__(self, writer: JsonlWriter | None = None, origin: float | None = None):
        self.origin = time.perf_counter() if origin is None else origin
        self.writer = writer
        self.spans: list[dict] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    @contextlib.contextmanager
    def span(self, phase: str, *, group: int = -1, jobs: tuple[str, ...] = (), **extra: Any):
        """Record the block as one span. Yields the span's extra fields: what the block learns while
        it runs (what compiled in a training step, say) goes into the span too."""
        start = self.now()
        try:
            yield extra
        finally:
            self.add(phase, start, self.now(), group=group, jobs=jobs, **extra)

    def add(self, phase: str, start: float, end: float, *, group: int = -1, jobs: tuple[str, ...] = (),
            **extra: Any) -> dict:
        row = {"phase": phase, "group": group, "jobs": list(jobs), "start": round(start, 6),
               "end": round(end, 6), **extra}
        with self._lock:
            self.spans.append(row)
        if self.writer is not None:
            self.writer.write(row)
        return row


def busy_fraction(spans: list[dict], start: float, end: float, phases=("generate", "train", "reload")) -> float:
    """Share of [start, end] covered by at least one span of the given phases (the union)."""
    if end <= start:
        return 0.0
    iv = sorted((max(s["start"], start), min(s["end"], end)) for s in spans if s["phase"] in phases)
    covered, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                covered += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        covered += cur_e - cur_s
    return covered / (end - start)


def write_report(out: str, result: dict, markdown: str) -> None:
    """A benchmark's record: OUT.json (every figure) and OUT.md (its tables), then the tables on
    stdout."""
    Path(out + ".json").write_text(json.dumps(result, indent=1))
    Path(out + ".md").write_text(markdown)
    print(markdown)
