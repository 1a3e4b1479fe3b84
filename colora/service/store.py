"""Checkpoints and training-run records on disk, per tenant, under the server's `--out` directory.

    <out>/tenants/<tenant>/<model_id>/run.json                       the model's record (base model, LoRA)
    <out>/tenants/<tenant>/<model_id>/weights/<name>/                save_state: the backend's files + tinker.json
    <out>/tenants/<tenant>/<model_id>/sampler_weights/<name>/        save_weights_for_sampler(name)

A checkpoint's Tinker path is `tinker://<model_id>/weights/<name>` (or `sampler_weights`); it resolves
only inside the asking tenant's folder, so another tenant's path is simply not found. A checkpoint is
written into a temporary folder and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from colora.service.backend import LoraSpec

KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> Tinker checkpoint_type
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
META = "tinker.json"


class CheckpointError(ValueError):
    """A bad or unknown checkpoint path or name; the message names it."""


@dataclass(frozen=True)
class CheckpointPath:
    model_id: str
    kind: Literal["weights", "sampler_weights"]
    name: str

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"


def check_name(name: str, field: str = "path") -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise CheckpointError(f"{field} {name!r} must be 1-128 letters, digits, '_', '-' or '.', not starting "
                              "with '.' or '-'")
    return name


def parse_path(path: str, field: str = "path") -> CheckpointPath:
    """`tinker://<model_id>/<weights|sampler_weights>/<name>` -> its parts."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise CheckpointError(f"{field} {path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0]:
        raise CheckpointError(f"{field} {path!r} must be tinker://<model_id>/weights/<name> or "
                              "tinker://<model_id>/sampler_weights/<name>")
    if "/" in parts[0] or parts[0] in (".", ".."):
        raise CheckpointError(f"{field} {path!r} has an invalid model id")
    return CheckpointPath(parts[0], parts[1], check_name(parts[2], field))  # type: ignore[arg-type]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class Store:
    def __init__(self, root: Path):
        self.root = Path(root)

    def _model_dir(self, tenant: str, model_id: str) -> Path:
        if "/" in model_id or model_id in (".", "..") or not model_id:
            raise CheckpointError(f"model id {model_id!r} is invalid")
        return self.root / "tenants" / tenant / model_id

    def write_run(self, tenant: str, model_id: str, base_model: str, spec: LoraSpec, user_metadata=None) -> None:
        d = self._model_dir(tenant, model_id)
        d.mkdir(parents=True, exist_ok=True)
        run = {"training_run_id": model_id, "base_model": base_model, "lora": asdict(spec), "created": _now(),
               "user_metadata": user_metadata or None}
        (d / "run.json").write_text(json.dumps(run, indent=1))

    def read_run(self, tenant: str, model_id: str) -> dict | None:
        f = self._model_dir(tenant, model_id) / "run.json"
        return json.loads(f.read_text()) if f.is_file() else None

    def dir_of(self, tenant: str, cp: CheckpointPath) -> Path:
        return self._model_dir(tenant, cp.model_id) / cp.kind / cp.name

    def find(self, tenant: str, path: str, kind: str | None = None, field: str = "path") -> tuple[CheckpointPath, Path, dict]:
        """The checkpoint at `path` of this tenant: (parts, folder, tinker.json). CheckpointError if absent."""
        cp = parse_path(path, field)
        if kind is not None and cp.kind != kind:
            raise CheckpointError(f"{field} {path!r} is a {KINDS[cp.kind]} checkpoint; this needs a "
                                  f"tinker://<model_id>/{kind}/<name> path")
        d = self.dir_of(tenant, cp)
        if not (d / META).is_file():
            raise CheckpointError(f"{field} {path!r}: checkpoint not found")
        return cp, d, json.loads((d / META).read_text())

    def write(self, tenant: str, cp: CheckpointPath, base_model: str, spec: LoraSpec, writer, overwrite: bool = False,
              **meta) -> Path:
        """Calls writer(tmp_dir) (the backend writes its files), adds tinker.json, renames into place."""
        final = self.dir_of(tenant, cp)
        if final.exists() and not overwrite:
            raise CheckpointError(f"checkpoint {cp} exists; save under another name or pass overwrite")
        tmp = final.parent / f".tmp-{cp.name}-{time.monotonic_ns()}"
        tmp.mkdir(parents=True)
        try:
            writer(tmp)
            info = {"checkpoint_id": f"{cp.kind}/{cp.name}", "checkpoint_type": KINDS[cp.kind], "tinker_path": str(cp),
                    "time": _now(), "base_model": base_model, "lora": asdict(spec), **meta}
            (tmp / META).write_text(json.dumps(info, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return final

    def delete(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        kind, _, name = checkpoint_id.partition("/")
        _, d, _ = self.find(tenant, f"tinker://{model_id}/{kind}/{name}", field="checkpoint_id")
        shutil.rmtree(d)

    def list(self, tenant: str, model_id: str) -> list[dict]:
        """Every checkpoint of the model, oldest first, as Tinker's Checkpoint objects."""
        d = self._model_dir(tenant, model_id)
        out = []
        for kind in KINDS:
            for meta in sorted((d / kind).glob(f"*/{META}")):
                info = json.loads(meta.read_text())
                size = sum(f.stat().st_size for f in meta.parent.rglob("*") if f.is_file())
                out.append({"checkpoint_id": info["checkpoint_id"], "checkpoint_type": info["checkpoint_type"],
                            "time": info["time"], "tinker_path": info["tinker_path"], "size_bytes": size,
                            "public": False, "user_metadata": info.get("user_metadata")})
        return sorted(out, key=lambda c: c["time"])

    def training_run(self, tenant: str, model_id: str) -> dict:
        """Tinker's TrainingRun of a model whose record exists (read_run is not None)."""
        run = self.read_run(tenant, model_id)
        cps = self.list(tenant, model_id)
        last = {k: next((c for c in reversed(cps) if c["checkpoint_type"] == k), None) for k in ("training", "sampler")}
        return {"training_run_id": model_id, "base_model": run["base_model"], "model_owner": tenant, "is_lora": True,
                "corrupted": False, "lora_rank": run["lora"]["rank"], "last_request_time": run["created"],
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": run.get("user_metadata")}
