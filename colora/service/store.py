"""Checkpoints and training-run records on disk, per tenant, under the server's `--out` directory.

    <out>/tenants/<tenant>/<model_id>/run.json                       the model's record (base model, LoRA or null)
    <out>/tenants/<tenant>/<model_id>/weights/<name>/                save_state: the backend's files + tinker.json
    <out>/tenants/<tenant>/<model_id>/sampler_weights/<name>/        save_weights_for_sampler(name)
    <out>/tenants/<tenant>/<model_id>/external_weights/<name>/       save_weights_external(name): the sampler format

A record's and a checkpoint's "lora" is the model's LoRA settings, null for a full-parameter model's
(colora/service/full.py). A checkpoint's Tinker path is `tinker://<model_id>/<kind>/<name>`, kind one of
KINDS; it resolves only inside the asking tenant's folder, so another tenant's path is simply not found. A checkpoint is
written into a temporary folder `.tmp-<name>-<n>` and renamed into place, so a reader never sees half of
one; an overwrite first renames the old one aside (`.old-<name>-<n>`), then swaps, then deletes it, so a
kill at any moment leaves the old or the new checkpoint. `sweep` (at the server's start) removes what a
kill left: temporary folders, an old one whose new one is in place (one that is not is put back), and
the folders of models that hold no checkpoint (no model outlives a restart).

The store keeps each tenant's count and bytes of checkpoints of every kind (`usage`, for the quotas)
and which checkpoints expire: one saved with `ttl_seconds` (or given them later by `set_ttl`) expires
that long after, and `expired` lists those whose time has come for the server's reaper to delete.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from colora.service.backend import LoraSpec

# path segment -> Tinker checkpoint_type
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # fullmatch: no trailing newline slips through
TEMP = re.compile(r"\.(tmp|old)-(.+)-\d+")  # fullmatch: a checkpoint <name> being written, or its old one aside
META = "tinker.json"


class CheckpointError(ValueError):
    """A bad or unknown checkpoint path or name; the message names it."""


@dataclass(frozen=True)
class CheckpointPath:
    model_id: str
    kind: Literal["weights", "sampler_weights", "external_weights"]
    name: str

    @property
    def checkpoint_id(self) -> str:  # as Tinker's Checkpoint names it within its run
        return f"{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.checkpoint_id}"


def check_name(name: str, field: str = "path") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise CheckpointError(f"{field} {name!r} must be 1-128 letters, digits, '_', '-' or '.', not starting "
                              "with '.' or '-'")
    return name


def parse_path(path: str, field: str = "path") -> CheckpointPath:
    """`tinker://<model_id>/<kind>/<name>` -> its parts (kind one of KINDS)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise CheckpointError(f"{field} {path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0]:
        raise CheckpointError(f"{field} {path!r} must be tinker://<run_id>/<{'|'.join(KINDS)}>/<name>")
    if parts[0] in (".", ".."):
        raise CheckpointError(f"{field} {path!r} has an invalid model id")
    return CheckpointPath(parts[0], parts[1], check_name(parts[2], field))  # type: ignore[arg-type]


def _lora(spec) -> dict | None:
    """What a record says of a model's spec: its LoRA settings, None for a full-parameter model."""
    return asdict(spec) if isinstance(spec, LoraSpec) else None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._lock = threading.Lock()
        self._usage: dict[str, dict[str, int]] = {}  # tenant -> tinker path -> bytes
        self._expiry: dict[tuple[str, str], float] = {}  # (tenant, tinker path) -> unix time it expires

    def _model_dir(self, tenant: str, model_id: str) -> Path:
        if "/" in model_id or model_id in (".", "..") or not model_id:
            raise CheckpointError(f"model id {model_id!r} is invalid")
        return self.root / "tenants" / tenant / model_id

    @staticmethod
    def _holds_any(d: Path) -> bool:
        """Whether model folder d holds a checkpoint of any kind, a folder of a kind not in KINDS included."""
        return any(not m.parent.name.startswith(".") for m in d.glob(f"*/*/{META}"))

    def _checkpoints(self, d: Path):
        """(CheckpointPath, folder, tinker.json) of every checkpoint in model folder d, temporary ones skipped."""
        for kind in KINDS:
            for meta in sorted((d / kind).glob(f"*/{META}")):
                if not meta.parent.name.startswith("."):
                    yield CheckpointPath(d.name, kind, meta.parent.name), meta.parent, json.loads(meta.read_text())

    # -- start -------------------------------------------------------------------------------------
    def sweep(self) -> list[str]:
        """What a killed server left (module docstring), removed; every tenant's usage and expiry read.
        Returns what it did, a line each, for the operator's log."""
        done = []
        for d in sorted((self.root / "tenants").glob("*/*")):
            for kind in sorted(k.name for k in d.iterdir() if k.is_dir()):
                for x in sorted((d / kind).glob(".*")):
                    m = TEMP.fullmatch(x.name)
                    if m and m[1] == "old" and not (d / kind / m[2]).exists():
                        x.rename(d / kind / m[2])
                        done.append(f"put back {d.parent.name}'s tinker://{d.name}/{kind}/{m[2]} (a kill mid-overwrite)")
                    elif m:
                        shutil.rmtree(x, ignore_errors=True)
                        done.append(f"removed {d.parent.name}'s unfinished {kind}/{x.name} of {d.name}")
            if not self._holds_any(d):
                shutil.rmtree(d, ignore_errors=True)
                continue
            for cp, folder, info in self._checkpoints(d):
                self._count(d.parent.name, cp, folder, info)
        return done

    def _count(self, tenant: str, cp: CheckpointPath, folder: Path, info: dict) -> None:
        """Indexes the checkpoint as it is on disk now: its bytes (tinker.json's included) and its expiry."""
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        with self._lock:
            self._usage.setdefault(tenant, {})[str(cp)] = size
            self._expiry.pop((tenant, str(cp)), None)
            if info.get("expires_at") is not None:
                self._expiry[(tenant, str(cp))] = float(info["expires_at"])

    def _uncount(self, tenant: str, cp: CheckpointPath) -> None:
        with self._lock:
            self._usage.get(tenant, {}).pop(str(cp), None)
            self._expiry.pop((tenant, str(cp)), None)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(checkpoints, bytes) the tenant holds on disk."""
        with self._lock:
            held = self._usage.get(tenant, {})
            return len(held), sum(held.values())

    def size(self, tenant: str, cp: CheckpointPath) -> int:
        """Bytes of the tenant's checkpoint `cp` on disk (0 for one the store does not hold)."""
        with self._lock:
            return self._usage.get(tenant, {}).get(str(cp), 0)

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(t for t, held in self._usage.items() if held)

    def expired(self, now: float | None = None) -> list[tuple[str, CheckpointPath]]:
        """(tenant, checkpoint) of every checkpoint whose ttl_seconds have passed."""
        now = time.time() if now is None else now
        with self._lock:
            due = [k for k, t in self._expiry.items() if t <= now]
        return [(tenant, parse_path(path)) for tenant, path in due]

    # -- records -----------------------------------------------------------------------------------
    def write_run(self, tenant: str, model_id: str, base_model: str, spec, user_metadata=None) -> None:
        """spec: the model's LoraSpec, or a full-parameter model's spec (recorded as "lora": null)."""
        d = self._model_dir(tenant, model_id)
        d.mkdir(parents=True, exist_ok=True)
        run = {"training_run_id": model_id, "base_model": base_model, "lora": _lora(spec), "created": _now(),
               "user_metadata": user_metadata or None}
        (d / "run.json").write_text(json.dumps(run, indent=1))

    def read_run(self, tenant: str, model_id: str) -> dict | None:
        f = self._model_dir(tenant, model_id) / "run.json"
        return json.loads(f.read_text()) if f.is_file() else None

    def runs(self, tenant: str) -> list[str]:
        """The tenant's training runs (models with a record), newest first."""
        folder = self.root / "tenants" / tenant
        runs = [(run["created"], d.name) for d in (folder.iterdir() if folder.is_dir() else ())
                if (run := self.read_run(tenant, d.name)) is not None]  # a folder may go while this reads
        return [mid for _, mid in sorted(runs, reverse=True)]

    def forget_model(self, tenant: str, model_id: str) -> bool:
        """Removes the folder of a model that no longer lives (its session ended) once it holds no
        checkpoint; returns whether it did."""
        d = self._model_dir(tenant, model_id)
        if not d.is_dir() or self._holds_any(d):
            return False
        shutil.rmtree(d, ignore_errors=True)
        return True

    # -- checkpoints -------------------------------------------------------------------------------
    def dir_of(self, tenant: str, cp: CheckpointPath) -> Path:
        return self._model_dir(tenant, cp.model_id) / cp.kind / cp.name

    def holds(self, tenant: str, cp: CheckpointPath) -> bool:
        """Whether the tenant's checkpoint `cp` exists (a save of it would overwrite, not add)."""
        return (self.dir_of(tenant, cp) / META).is_file()

    def find(self, tenant: str, path: str, kind: str | None = None, field: str = "path") -> tuple[CheckpointPath, Path, dict]:
        """The checkpoint at `path` of this tenant: (parts, folder, tinker.json). CheckpointError if absent."""
        cp = parse_path(path, field)
        if kind is not None and cp.kind != kind:
            raise CheckpointError(f"{field} {path!r} is a checkpoint of kind {cp.kind}; this needs a "
                                  f"tinker://<model_id>/{kind}/<name> path")
        if not self.holds(tenant, cp):
            raise CheckpointError(f"{field} {path!r}: checkpoint not found")
        d = self.dir_of(tenant, cp)
        return cp, d, json.loads((d / META).read_text())

    def write(self, tenant: str, cp: CheckpointPath, base_model: str, spec, writer, overwrite: bool = False,
              ttl_seconds: int | None = None, **meta) -> Path:
        """Calls writer(tmp_dir) (the backend writes its files), adds tinker.json, renames into place
        (module docstring). `meta` goes into tinker.json (`automatic`: saved without a name)."""
        final = self.dir_of(tenant, cp)
        if final.exists() and not overwrite:
            raise CheckpointError(f"checkpoint {cp} exists; save under another name or pass overwrite")
        n = time.monotonic_ns()
        tmp, aside = final.parent / f".tmp-{cp.name}-{n}", final.parent / f".old-{cp.name}-{n}"
        tmp.mkdir(parents=True)
        try:
            writer(tmp)
            info = {"checkpoint_id": cp.checkpoint_id, "checkpoint_type": KINDS[cp.kind], "tinker_path": str(cp),
                    "time": _now(), "base_model": base_model, "lora": _lora(spec), "ttl_seconds": ttl_seconds,
                    "expires_at": None if ttl_seconds is None else round(time.time() + ttl_seconds, 3), **meta}
            (tmp / META).write_text(json.dumps(info, indent=1))
            if final.exists():
                final.rename(aside)
            try:
                tmp.rename(final)
            except BaseException:
                if aside.exists() and not final.exists():
                    aside.rename(final)
                raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        shutil.rmtree(aside, ignore_errors=True)
        self._count(tenant, cp, final, info)
        return final

    def set_ttl(self, tenant: str, path: str, ttl_seconds: int | None) -> dict:
        """Records a checkpoint's ttl_seconds from now (None: it never expires); returns its tinker.json."""
        cp, d, info = self.find(tenant, path)
        info = {**info, "ttl_seconds": ttl_seconds,
                "expires_at": None if ttl_seconds is None else round(time.time() + ttl_seconds, 3)}
        tmp = d / f".{META}.{time.monotonic_ns()}"
        tmp.write_text(json.dumps(info, indent=1))
        tmp.replace(d / META)
        self._count(tenant, cp, d, info)
        return info

    def delete(self, tenant: str, model_id: str, checkpoint_id: str) -> CheckpointPath:
        kind, _, name = checkpoint_id.partition("/")
        cp, d, _ = self.find(tenant, f"tinker://{model_id}/{kind}/{name}", field="checkpoint_id")
        self._uncount(tenant, cp)
        shutil.rmtree(d)
        return cp

    def prune_automatic(self, tenant: str, model_id: str, keep: int) -> list[CheckpointPath]:
        """Deletes the model's oldest checkpoints saved without a name beyond the newest `keep`."""
        auto = [c for c in self.list(tenant, model_id) if c.get("automatic")]
        gone = []
        for c in auto[:max(0, len(auto) - keep)]:
            gone.append(self.delete(tenant, model_id, c["checkpoint_id"]))
        return gone

    def list(self, tenant: str, model_id: str) -> list[dict]:
        """Every checkpoint of the model, oldest first, as Tinker's Checkpoint objects (+ `automatic`,
        `expires_at`)."""
        out = []
        for cp, _, info in self._checkpoints(self._model_dir(tenant, model_id)):
            out.append({"checkpoint_id": info["checkpoint_id"], "checkpoint_type": info["checkpoint_type"],
                        "time": info["time"], "tinker_path": info["tinker_path"], "size_bytes": self.size(tenant, cp),
                        "public": False, "user_metadata": info.get("user_metadata"),
                        "automatic": bool(info.get("automatic")), "expires_at": info.get("expires_at")})
        return sorted(out, key=lambda c: c["time"])

    def training_run(self, tenant: str, model_id: str) -> dict:
        """Tinker's TrainingRun of a model whose record exists (read_run is not None)."""
        run = self.read_run(tenant, model_id)
        cps = self.list(tenant, model_id)
        last = {k: next((c for c in reversed(cps) if c["checkpoint_type"] == k), None) for k in ("training", "sampler")}
        lora = run["lora"]
        return {"training_run_id": model_id, "base_model": run["base_model"], "model_owner": tenant,
                "is_lora": lora is not None, "corrupted": False, "lora_rank": lora["rank"] if lora else None,
                "last_request_time": run["created"],
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": run.get("user_metadata")}
