"""The RestClient routes the `tinker` command line calls, over the service's store of runs and checkpoints.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... tinker -f json run list
    tinker run info RUN_ID              tinker checkpoint list [--run-id RUN_ID]
    tinker checkpoint info PATH         tinker checkpoint download tinker://RUN/weights/NAME
    tinker checkpoint delete PATH...

A tenant sees only its own runs, checkpoints and sessions; another tenant's are "not found", as on
every route. app.py serves a run, its checkpoints and a checkpoint's deletion; this module adds:

| route | answers |
| --- | --- |
| GET /api/v1/training_runs?limit&offset | the tenant's runs, newest first, with a cursor |
| GET /api/v1/checkpoints?limit&offset | every checkpoint of the tenant's runs, newest first, with a cursor |
| POST /api/v1/weights_info `{tinker_path}` | the checkpoint's base model and LoRA settings |
| GET /api/v1/sessions?limit&offset, GET /api/v1/sessions/{id} | the tenant's sessions since the server started |
| POST /api/v1/save_weights_external | future -> `{path: tinker://<model>/external_weights/<name>}` |
| GET .../checkpoints/external_weights/<name>/external_weights_urls | `{urls: {file: signed URL}, expires}` |
| PUT .../checkpoints/external_weights/<name>/ttl `{ttl_seconds}` | records an export's TTL |
| GET /api/v1/colora/download/<token>/<file> | one file of an export, for a valid unexpired token |

`tinker checkpoint download` (SDK 0.38) loads the checkpoint into a new training run of its own
session, asks it for `save_weights_external`, asks for the export's signed URLs and fetches each
file with a plain GET (no key), then asks to delete the export and ends its session. The export is
the backend's sampler format (for the co-runner a PEFT adapter: adapter_config.json,
adapter_model.safetensors), written in the model's turn under the tenant's checkpoint quotas, to
`<out>/tenants/<tenant>/<model_id>/external_weights/<name>/`. The store (colora/service/store.py)
knows weights and sampler_weights only: it neither lists nor counts nor deletes an export (the CLI
warns that the delete failed), and removes it with its model's folder once the model's session has
ended and the model holds no checkpoint (the download's model holds none). Its URLs carry
an HMAC of (tenant, run, checkpoint, expiry) under a key made when the server starts: they reach only
that tenant's export, for 15 minutes, and none survives a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import shutil
import time
from base64 import urlsafe_b64decode, urlsafe_b64encode
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from colora.service.app import request_tenant
from colora.service.backend import Backend, BackendError
from colora.service.errors import ApiError
from colora.service.service import Service
from colora.service.store import KINDS, META, CheckpointError, CheckpointPath, Store, check_name

EXTERNAL = "external_weights"
SEGMENTS = {**KINDS, EXTERNAL: "external"}  # tinker path segment -> checkpoint_type
URL_LIFETIME_S = 900  # the CLI signs again when fewer than 5 minutes are left
TTL_RANGE = (3600, 10 * 365 * 86400)  # Tinker's: one hour to ten years
MAX_BODY = 64 << 10  # these routes' JSON bodies are a path and a few numbers


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SaveWeightsExternal(_Body):
    model_id: str
    path: str
    seq_id: Optional[int] = None
    ttl_seconds: Optional[int] = None
    age_encryption_recipients: Optional[list[str]] = None


class WeightsInfo(_Body):
    tinker_path: str


class Ttl(_Body):
    ttl_seconds: Optional[int] = None


def split_path(path: str) -> tuple[str, str, str]:
    """`tinker://<model_id>/<weights|sampler_weights|external_weights>/<name>` -> (model_id, kind, name)."""
    parts = path[len("tinker://"):].split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or not parts[0] or parts[1] not in SEGMENTS:
        raise ApiError(400, f"tinker_path {path!r} must be tinker://<run_id>/<{'|'.join(SEGMENTS)}>/<name>")
    return parts[0], parts[1], parts[2]


def checkpoint_dir(store: Store, tenant: str, model_id: str, checkpoint_id: str) -> tuple[Path, dict]:
    """(folder, tinker.json) of the tenant's checkpoint `<kind>/<name>` of run `model_id`; 404 otherwise."""
    kind, _, name = checkpoint_id.partition("/")
    try:
        if kind not in SEGMENTS:
            raise CheckpointError(f"checkpoint_id {checkpoint_id!r} must be <{'|'.join(SEGMENTS)}>/<name>")
        cp = CheckpointPath(model_id, kind, check_name(name, "checkpoint name"))  # type: ignore[arg-type]
        d = store.dir_of(tenant, cp)
    except CheckpointError as e:
        raise ApiError(404, str(e)) from None
    if not (d / META).is_file():
        raise ApiError(404, f"checkpoint tinker://{model_id}/{checkpoint_id} not found")
    return d, json.loads((d / META).read_text())


def run_ids(store: Store, tenant: str) -> list[str]:
    """The tenant's training runs (models with a record), newest first."""
    folder = store.root / "tenants" / tenant
    runs = [(run["created"], d.name) for d in (folder.iterdir() if folder.is_dir() else ())
            if (run := store.read_run(tenant, d.name)) is not None]  # a folder may go while this reads
    return [mid for _, mid in sorted(runs, reverse=True)]


def page(request: Request) -> tuple[int, int]:
    """The (limit, offset) query parameters, each checked."""
    out = []
    for name, default, lo, hi in (("limit", 20, 1, 10_000), ("offset", 0, 0, 1 << 40)):
        raw = request.query_params.get(name, str(default))
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise ApiError(400, f"query parameter {name}={raw!r} must be an integer from {lo} to {hi}")
        out.append(value)
    return out[0], out[1]


def model_and_seq(raw: bytes) -> tuple[str, int] | None:
    """(model_id, seq_id) of a JSON body that has them with the right types, else None."""
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return None
    mid, seq = (data.get("model_id"), data.get("seq_id")) if isinstance(data, dict) else (None, None)
    return (mid, seq) if isinstance(mid, str) and mid and type(seq) is int else None


def save_weights_external(svc: Service, tenant: str, body: SaveWeightsExternal) -> dict:
    """Queues the export of a model's adapter in its seq_id turn, under the tenant's checkpoint quotas
    (as a save_weights_for_sampler with a path); one that cannot run still takes its slot."""
    m, route = svc._model(tenant, body.model_id), "save_weights_external"
    if body.seq_id is None:
        raise ApiError(400, "save_weights_external needs its seq_id (the SDK sends one)")
    if body.age_encryption_recipients:
        return svc.fail_in_slot(tenant, m.id, body.seq_id, route, "age_encryption_recipients: encrypted exports "
                                "are not served here; export without them")
    try:
        cp = CheckpointPath(m.id, EXTERNAL, check_name(body.path))  # type: ignore[arg-type]
    except CheckpointError as e:
        return svc.fail_in_slot(tenant, m.id, body.seq_id, route, str(e))

    def write(b: Backend) -> dict:
        final = svc.store.dir_of(tenant, cp)
        tmp = final.parent / f".tmp-{cp.name}-{time.monotonic_ns()}"
        tmp.mkdir(parents=True)
        try:
            b.release_sampler(b.save_for_sampler(m.id, tmp))
            size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            info = {"checkpoint_id": f"{EXTERNAL}/{cp.name}", "checkpoint_type": "external", "tinker_path": str(cp),
                    "time": datetime.now(timezone.utc).isoformat(), "base_model": m.base_model,
                    "lora": asdict(m.spec), "seq_id": body.seq_id, "ttl_seconds": body.ttl_seconds}
            (tmp / META).write_text(json.dumps(info, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
        except OSError as e:
            raise BackendError(f"the export {cp} could not be written: {e}", "server") from None
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        return {"type": "save_weights_external", "path": str(cp), "size_bytes": size}

    return svc._save(tenant, m, body.seq_id, route, cp, write)


class Signer:
    """Signed download URLs of exports: an HMAC under a key of this server's run."""

    def __init__(self, key: bytes | None = None):
        self._key = key or secrets.token_bytes(32)

    def _mac(self, payload: bytes) -> str:
        return hmac.new(self._key, payload, hashlib.sha256).hexdigest()

    def token(self, tenant: str, model_id: str, checkpoint_id: str, expires: int) -> str:
        payload = json.dumps([tenant, model_id, checkpoint_id, expires]).encode()
        return f"{urlsafe_b64encode(payload).decode()}.{self._mac(payload)}"

    def check(self, token: str, now: float) -> tuple[str, str, str]:
        """(tenant, model_id, checkpoint_id) of a token this server signed and that has not expired."""
        try:
            b64, mac = token.split(".")
            payload = urlsafe_b64decode(b64.encode())
            tenant, model_id, checkpoint_id, expires = json.loads(payload)
        except ValueError:
            raise ApiError(403, "the download URL is malformed; ask for new URLs") from None
        if not hmac.compare_digest(mac, self._mac(payload)):
            raise ApiError(403, "the download URL's signature is not this server's (it may have restarted); "
                                "ask for new URLs")
        if now >= expires:
            raise ApiError(403, "the download URL has expired; ask for new URLs")
        return tenant, model_id, checkpoint_id


def install(app: FastAPI) -> None:
    """Adds this module's routes (the table in the module docstring) to an app of `create_app`."""
    signer = Signer()
    tenant = request_tenant

    def svc(request: Request) -> Service:
        return request.app.state.service

    async def raw_body(request: Request) -> bytes:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY:
                raise ApiError(413, f"the request body is more than {MAX_BODY} bytes, this route's limit")
        return raw

    def validated(raw: bytes, model: type[BaseModel]):
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as e:
            err = e.errors()[0]
            raise ApiError(400, f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']} (in {model.__name__})") \
                from None

    async def parsed(request: Request, model: type[BaseModel]):
        return validated(await raw_body(request), model)

    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request):
        t, (limit, offset) = tenant(request), page(request)
        store = svc(request).store
        ids = run_ids(store, t)
        return {"training_runs": [store.training_run(t, mid) for mid in ids[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request):
        t, (limit, offset) = tenant(request), page(request)
        store = svc(request).store
        cps = sorted((c for mid in run_ids(store, t) for c in store.list(t, mid)), key=lambda c: c["time"],
                     reverse=True)
        return {"checkpoints": cps[offset:offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(cps)}}

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        t = tenant(request)
        b = await parsed(request, WeightsInfo)
        model_id, kind, name = split_path(b.tinker_path)
        _, meta = checkpoint_dir(svc(request).store, t, model_id, f"{kind}/{name}")
        lora = meta["lora"]
        return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": lora["rank"],
                "train_unembed": lora["train_unembed"], "train_mlp": lora["train_mlp"],
                "train_attn": lora["train_attn"]}

    @app.post("/api/v1/save_weights_external")
    async def save_external(request: Request):
        t, raw = tenant(request), await raw_body(request)
        try:
            b = validated(raw, SaveWeightsExternal)
        except ApiError as e:  # one whose model_id and seq_id can be read still takes its slot
            ids = model_and_seq(raw)
            if ids is None:
                raise
            return svc(request).fail_in_slot(t, ids[0], ids[1], "save_weights_external", e.message)
        return save_weights_external(svc(request), t, b)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request):
        t = tenant(request)
        if not checkpoint_id.startswith(f"{EXTERNAL}/"):
            raise ApiError(400, f"checkpoint {checkpoint_id!r} is not an external weights checkpoint; export one "
                                "with save_weights_external")
        d, _ = checkpoint_dir(svc(request).store, t, model_id, checkpoint_id)
        expires = int(time.time()) + URL_LIFETIME_S
        base = str(request.base_url).rstrip("/")
        token = signer.token(t, model_id, checkpoint_id, expires)
        files = sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file() and f.name != META)
        return {"urls": {f: f"{base}/api/v1/colora/download/{token}/{f}" for f in files},
                "expires": datetime.fromtimestamp(expires, timezone.utc).isoformat()}

    @app.get("/api/v1/colora/download/{token}/{file:path}")
    async def download(token: str, file: str, request: Request):
        t, model_id, checkpoint_id = signer.check(token, time.time())
        d, _ = checkpoint_dir(svc(request).store, t, model_id, checkpoint_id)
        target = (d / file).resolve()
        if not target.is_relative_to(d.resolve()) or not target.is_file() or target.name == META:
            raise ApiError(404, f"file {file!r} is not in checkpoint tinker://{model_id}/{checkpoint_id}")
        return FileResponse(target, media_type="application/octet-stream", filename=target.name)

    @app.put("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_ttl(model_id: str, checkpoint_id: str, request: Request):
        t = tenant(request)
        b = await parsed(request, Ttl)
        lo, hi = TTL_RANGE
        if b.ttl_seconds is not None and not lo <= b.ttl_seconds <= hi:
            raise ApiError(400, f"ttl_seconds ({b.ttl_seconds}) must be from {lo} (one hour) to {hi} (ten years), "
                                "or null for none")
        d, meta = checkpoint_dir(svc(request).store, t, model_id, checkpoint_id)
        if not checkpoint_id.startswith(f"{EXTERNAL}/"):
            raise ApiError(400, f"checkpoint {checkpoint_id!r}: a training or sampler checkpoint's TTL is set when "
                                "it is saved (ttl_seconds) and cannot be changed here yet")
        tmp = d / f".{META}.{time.monotonic_ns()}"
        tmp.write_text(json.dumps({**meta, "ttl_seconds": b.ttl_seconds}, indent=1))
        tmp.replace(d / META)
        return Response(status_code=204)

    @app.get("/api/v1/sessions")
    async def list_sessions(request: Request):
        t, (limit, offset) = tenant(request), page(request)
        mine = [s.id for s in reversed(list(svc(request).sessions.values())) if s.tenant == t]
        return {"sessions": mine[offset:offset + limit]}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        t = tenant(request)
        s = svc(request).sessions.get(session_id)
        if s is None or s.tenant != t:
            raise ApiError(404, f"session {session_id!r} not found")
        return {"training_run_ids": sorted(s.models), "sampler_ids": sorted(s.samplers), "user_metadata": None}
