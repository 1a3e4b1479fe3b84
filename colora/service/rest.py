"""The RestClient routes the `tinker` command line calls, over the service's store of runs and checkpoints.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... tinker -f json run list
    tinker run info RUN_ID              tinker checkpoint list [--run-id RUN_ID]
    tinker checkpoint info PATH         tinker checkpoint download tinker://RUN/weights/NAME
    tinker checkpoint delete PATH...

A tenant sees only its own runs, checkpoints and sessions; another tenant's are "not found", as on
every route. app.py serves a run, its checkpoints and a checkpoint's deletion; this module adds the
routes below. They are HTTP only: each calls one of the Service's operations (colora/service/service.py,
checkpoints.py), which hold what they do.

| route | answers |
| --- | --- |
| GET /api/v1/training_runs?limit&offset | the tenant's runs, newest first, with a cursor |
| GET /api/v1/checkpoints?limit&offset | every checkpoint of the tenant's runs, newest first, with a cursor |
| POST /api/v1/weights_info `{tinker_path}` | the checkpoint's base model and LoRA settings |
| GET /api/v1/sessions?limit&offset, GET /api/v1/sessions/{id} | the tenant's sessions since the server started |
| POST /api/v1/save_weights_external | future -> `{path: tinker://<model>/external_weights/<name>}` |
| GET .../checkpoints/external_weights/<name>/external_weights_urls | `{urls: {file: signed URL}, expires}` |
| PUT .../checkpoints/<kind>/<name>/ttl `{ttl_seconds}` | the checkpoint expires that long from now |
| GET /api/v1/colora/download/<token>/<file> | one file of an export, for a valid unexpired token |

`tinker checkpoint download` (SDK 0.38) loads the checkpoint into a new training run of its own
session, asks it for `save_weights_external` (with a TTL of an hour), asks for the export's signed
URLs (renewing its TTL) and fetches each file with a plain GET (no key), then deletes the export and
ends its session. The export is the backend's sampler format (for the co-runner a PEFT adapter:
adapter_config.json, adapter_model.safetensors), a checkpoint of kind external_weights in the store
(colora/service/store.py), written in the model's turn under the tenant's checkpoint quotas. Its URLs
carry an HMAC of (tenant, run, checkpoint, expiry) under a key made when the server starts: they reach
only that tenant's export, for 15 minutes, and none survives a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from base64 import urlsafe_b64decode, urlsafe_b64encode
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response

from colora.service import schemas
from colora.service.app import request_tenant
from colora.service.errors import ApiError
from colora.service.service import Service
from colora.service.store import META

URL_LIFETIME_S = 900  # the CLI signs again when fewer than 5 minutes are left
MAX_BODY = 64 << 10  # these routes' JSON bodies are a path and a few numbers


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

    async def parsed(request: Request, model: type[schemas.Body]):
        return schemas.parse(await raw_body(request), model)

    @app.get("/api/v1/training_runs")
    async def list_training_runs(request: Request):
        t, (limit, offset) = tenant(request), page(request)
        return svc(request).list_training_runs(t, limit, offset)

    @app.get("/api/v1/checkpoints")
    async def list_user_checkpoints(request: Request):
        t, (limit, offset) = tenant(request), page(request)
        return svc(request).list_user_checkpoints(t, limit, offset)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request):
        t = tenant(request)
        return svc(request).weights_info(t, (await parsed(request, schemas.WeightsInfo)).tinker_path)

    @app.post("/api/v1/save_weights_external")
    async def save_external(request: Request):
        t = tenant(request)
        b = svc(request).model_request(t, await raw_body(request), schemas.SaveWeightsExternal, "save_weights_external")
        return b if isinstance(b, dict) else svc(request).save_weights_external(t, b)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request):
        t = tenant(request)
        if not checkpoint_id.startswith("external_weights/"):
            raise ApiError(400, f"checkpoint {checkpoint_id!r} is not an external weights checkpoint; export one "
                                "with save_weights_external")
        _, d, _ = svc(request).checkpoint(t, model_id, checkpoint_id)
        expires = int(time.time()) + URL_LIFETIME_S
        base = str(request.base_url).rstrip("/")
        token = signer.token(t, model_id, checkpoint_id, expires)
        files = sorted(str(f.relative_to(d)) for f in d.rglob("*") if f.is_file() and f.name != META)
        return {"urls": {f: f"{base}/api/v1/colora/download/{token}/{f}" for f in files},
                "expires": datetime.fromtimestamp(expires, timezone.utc).isoformat()}

    @app.get("/api/v1/colora/download/{token}/{file:path}")
    async def download(token: str, file: str, request: Request):
        t, model_id, checkpoint_id = signer.check(token, time.time())
        _, d, _ = svc(request).checkpoint(t, model_id, checkpoint_id)
        target = (d / file).resolve()
        if not target.is_relative_to(d.resolve()) or not target.is_file() or target.name == META:
            raise ApiError(404, f"file {file!r} is not in checkpoint tinker://{model_id}/{checkpoint_id}")
        return FileResponse(target, media_type="application/octet-stream", filename=target.name)

    @app.put("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_ttl(model_id: str, checkpoint_id: str, request: Request):
        t = tenant(request)
        b = await parsed(request, schemas.SetTtl)
        svc(request).set_checkpoint_ttl(t, model_id, checkpoint_id, b.ttl_seconds)
        return Response(status_code=204)

    @app.get("/api/v1/sessions")
    async def list_sessions(request: Request):
        t, (limit, offset) = tenant(request), page(request)
        return {"sessions": svc(request).list_sessions(t)[offset:offset + limit]}

    @app.get("/api/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        return svc(request).get_session(tenant(request), session_id)
