"""The Tinker API over HTTP (FastAPI): routes, auth, body limits, error answers, long polls.

Every route but healthz needs an `X-API-Key` of a tenant (`colora/service/config.py`), checked before
any body is read; an unknown key is a 401 with a body. Every error answer, an unknown route's 404
included, has the body `{error, category}`, with no server path in it, and is one line of the
operator's log. POSTs are answered at once with a future (`{request_id, ...}`); `retrieve_future` holds
a poll up to `poll_hold_s` and then answers 408, which the SDK retries silently. forward_backward
results and samples come back as protobuf when the client asks for it (SDK 0.25+ always does). A
request of a model whose JSON body does not validate still takes its seq_id slot when its model_id and
seq_id can be read, so the model's next request runs. `/api/v1/healthz` (and `/healthz`) tell the
backend's health: 200 when ok, 503 with the reason when degraded or restarting. The SDK and its routes
are described in `docs/serving.md`; the operations themselves live in `colora/service/service.py`.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from contextlib import asynccontextmanager
from typing import Callable, Iterable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from colora.service import schemas, wire
from colora.service.backend import Backend, ForwardResult, SampleResult
from colora.service.config import ServeConfig
from colora.service.futures import failure_answer
from colora.service.service import ApiError, Service

log = logging.getLogger("colora.service")
PROTO = "application/x-protobuf"
NO_KEY = "(no key)"  # the operator's record of a request without a tenant's key


def request_tenant(request: Request) -> str:
    """The tenant of the request's X-API-Key (401 otherwise), remembered for the operator's record."""
    t = request.app.state.config.tenant_of(request.headers.get("x-api-key"))
    if t is None:
        raise ApiError(401, "the X-API-Key header holds no key of this server (the SDK sends TINKER_API_KEY)")
    request.state.tenant = t
    return t


def request_is_admin(request: Request) -> bool:
    """Whether the request's X-API-Key is one of the server's admin keys."""
    return request.app.state.config.is_admin(request.headers.get("x-api-key"))


def create_app(config: ServeConfig, backend: Backend, extra: Iterable[Callable[[FastAPI], None]] = ()) -> FastAPI:
    """The service's ASGI app; `app.state.service` is its Service once the app has started. Each of
    `extra` is called with the app once its own routes are in, to add routes of its own (the lead's
    wiring of the metrics, the status page and the RestClient's listings)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc = Service(config, backend, asyncio.get_running_loop())
        app.state.service = svc
        svc.start()
        reaper = asyncio.create_task(_reap(svc, min(config.heartbeat_timeout_s / 4, 5.0)))
        try:
            yield
        finally:
            reaper.cancel()
            await asyncio.to_thread(svc.stop)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config

    def answer_error(request: Request, e: ApiError) -> JSONResponse:
        svc = getattr(request.app.state, "service", None)
        if svc is not None:
            e.message = svc.scrub(e.message)
            svc.journal.record(getattr(request.state, "tenant", NO_KEY), _route(request), e.status, e.category,
                               e.message)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return answer_error(request, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):  # an unknown route or method
        what = "no such route" if e.status_code == 404 else e.detail
        return answer_error(request, ApiError(e.status_code, f"{request.method} {request.url.path}: {what} on "
                                                             "this server (docs/serving.md lists its routes)"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return answer_error(request, ApiError(400, f"{request.url.path}: {e.errors()[0].get('msg', 'invalid')}"))

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return answer_error(request, ApiError(500, f"{type(e).__name__}: {e}", "server"))

    def svc(request: Request) -> Service:
        return request.app.state.service

    tenant = request_tenant

    async def body(request: Request) -> bytes:
        limit = config.max_request_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise ApiError(413, f"the request body is {request.headers['content-length']} bytes, more than this "
                                f"server's max_request_bytes ({limit}); send fewer datums per call")
        data, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError(413, f"the request body is more than this server's max_request_bytes ({limit})")
            data.append(chunk)
        raw = b"".join(data)
        if request.headers.get("content-encoding", "").lower() == "zstd":
            raw = _unzstd(raw, limit)
        return raw

    def validated(raw: bytes, model: type[BaseModel]):
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(map(str, err["loc"])) or "body"
            raise ApiError(400, f"{where}: {err['msg']} (in {model.__name__})") from None

    async def parsed(request: Request, model: type[BaseModel]):
        return validated(await body(request), model)

    async def model_request(request: Request, t: str, model: type[BaseModel], route: str):
        """A model's JSON request (it has model_id and seq_id). One that does not validate takes its seq_id
        slot, failing there, when its model_id and seq_id can be read: returns that answer (a dict)."""
        raw = await body(request)
        try:
            return validated(raw, model)
        except ApiError as e:
            ids = _ids(raw)
            if ids is None:
                raise
            return svc(request).fail_in_slot(t, ids[0], ids[1], route, e.message)

    # -- client setup and sessions -----------------------------------------------------------------
    @app.post("/api/v1/client/config")
    async def client_config(request: Request):
        tenant(request)
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False,
                "fwdbwd_max_chunk_len": config.fwdbwd_max_chunk_len,
                "sample_max_concurrent_requests": 2000}

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config(request: Request):
        tenant(request)
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        tenant(request)
        await body(request)
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        t = tenant(request)
        return svc(request).create_session(t, await parsed(request, schemas.CreateSession))

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request):
        t = tenant(request)
        return svc(request).heartbeat(t, (await parsed(request, schemas.SessionRef)).session_id)

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        t = tenant(request)
        await parsed(request, schemas.Finish)
        return svc(request).finish(t, session_id)

    # -- training ----------------------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        t = tenant(request)
        return svc(request).create_model(t, await parsed(request, schemas.CreateModel))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        t = tenant(request)
        return svc(request).get_info(t, await parsed(request, schemas.ModelRef))

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        t = tenant(request)
        return svc(request).forward_backward(t, await body(request))

    @app.post("/api/v1/forward")
    async def forward(request: Request):  # SDKs before 0.25; since then forward_backward with forward_only
        t = tenant(request)
        return svc(request).forward_backward(t, await body(request), force_forward_only=True)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        t = tenant(request)
        b = await model_request(request, t, schemas.OptimStep, "optim_step")
        return b if isinstance(b, dict) else svc(request).optim_step(t, b)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        t = tenant(request)
        b = await model_request(request, t, schemas.SaveWeights, "save_weights")
        return b if isinstance(b, dict) else svc(request).save_weights(t, b)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        t = tenant(request)
        b = await model_request(request, t, schemas.SaveWeightsForSampler, "save_weights_for_sampler")
        return b if isinstance(b, dict) else svc(request).save_weights_for_sampler(t, b)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        t = tenant(request)
        b = await model_request(request, t, schemas.LoadWeights, "load_weights")
        return b if isinstance(b, dict) else svc(request).load_weights(t, b)

    # -- sampling ----------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        t = tenant(request)
        return await svc(request).create_sampling_session(t, await parsed(request, schemas.CreateSamplingSession))

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        return svc(request).get_sampler(tenant(request), sampler_id)

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        t = tenant(request)
        return svc(request).asample(t, await parsed(request, schemas.Sample))

    # -- futures -----------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        t = tenant(request)
        b = await parsed(request, schemas.RetrieveFuture)
        try:
            outcome = await svc(request).futures.wait(b.request_id, t, config.poll_hold_s)
        except KeyError:
            raise ApiError(404, f"request {b.request_id!r} not found") from None
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": b.request_id, "queue_state": "active"},
                                status_code=408)
        if outcome.error is not None:
            status, answer = failure_answer(outcome)
            return JSONResponse(answer, status_code=status)
        r, proto = outcome.result, PROTO in request.headers.get("accept", "")
        if isinstance(r, ForwardResult):
            return Response(wire.encode_forward_output(r), media_type=PROTO) if proto else wire.forward_output_json(r)
        if isinstance(r, SampleResult):
            return Response(wire.encode_sample(r), media_type=PROTO) if proto else wire.sample_json(r)
        return r if r is not None else {}

    # -- health and the RestClient's routes --------------------------------------------------------
    @app.get("/api/v1/healthz")
    @app.get("/healthz")
    async def healthz(request: Request):
        h = svc(request).health()
        if h["status"] == "ok":
            return {"status": "ok"}
        reason = h.get("last_engine_error") or "the backend reports it"
        return JSONResponse({"status": h["status"], "error": f"the server is {h['status']}: {reason}",
                             "category": "server", "engine_restarts": h.get("engine_restarts", 0)}, status_code=503)

    @app.get("/api/v1/get_server_capabilities")
    async def get_server_capabilities(request: Request):
        tenant(request)
        caps = backend.capabilities()
        return {"supported_models": [{"model_name": caps.model_name, "max_context_length": caps.max_context,
                                      "trainable": True, "sampleable": True}]}

    @app.get("/api/v1/training_runs/{model_id}")
    async def training_run(model_id: str, request: Request):
        return svc(request).training_run(tenant(request), model_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str, request: Request):
        return svc(request).list_checkpoints(tenant(request), model_id)

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str, request: Request):
        svc(request).delete_checkpoint(tenant(request), model_id, checkpoint_id)
        return Response(status_code=204)

    @app.get("/api/v1/colora/stats")
    async def stats(request: Request):
        """Service.snapshot: an admin key's the whole server's; a tenant's its own counts and errors, and of
        the server only its uptime and health."""
        if request_is_admin(request):
            return await asyncio.to_thread(svc(request).snapshot, None)
        snap = await asyncio.to_thread(svc(request).snapshot, tenant(request))
        return {**snap, "server": {k: snap["server"][k] for k in ("uptime_s", "health")}}

    # -- routes of other modules, wired by the caller (cli.py) -------------------------------------
    for install in extra:
        install(app)

    return app


def _route(request: Request) -> str:
    """The route's name for the record: its path template after /api/v1/ (ids left out)."""
    route = request.scope.get("route")
    path = getattr(route, "path", None) or request.url.path
    return path.removeprefix("/api/v1/").lstrip("/") or "/"


def _ids(raw: bytes) -> tuple[str, int] | None:
    """(model_id, seq_id) of a JSON body that has them with the right types, else None."""
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    mid, seq = data.get("model_id"), data.get("seq_id")
    if isinstance(mid, str) and mid and isinstance(seq, int) and not isinstance(seq, bool):
        return mid, seq
    return None


async def _reap(svc: Service, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            await asyncio.to_thread(svc.reap)  # it may delete expired checkpoints: off the event loop
        except Exception:
            log.exception("reaping lapsed sessions failed")


def _unzstd(raw: bytes, limit: int) -> bytes:
    """Decompresses a zstd body, refusing more than `limit` bytes of output (a small body can expand a lot).
    zstandard is imported here: the server tells clients not to compress (client/config), so a host without
    it (the GPU host's kit) serves every client that follows that."""
    import zstandard

    out, n = io.BytesIO(), 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw)) as r:
            while chunk := r.read(1 << 20):
                n += len(chunk)
                if n > limit:
                    raise ApiError(413, f"the decompressed request body is more than this server's "
                                        f"max_request_bytes ({limit})")
                out.write(chunk)
    except zstandard.ZstdError as e:
        raise ApiError(400, f"Content-Encoding is zstd but the body does not decompress ({e})") from None
    return out.getvalue()


class ServerThread:
    """Serves an app with uvicorn on a thread of this process; `port=0` takes a free port (`.port`).
    For tests and notebooks: `with ServerThread(app) as s: ... s.url ...`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                     lifespan="on", timeout_graceful_shutdown=2))
        self._server.install_signal_handlers = lambda: None  # signals belong to the main thread's owner
        self._thread = threading.Thread(target=self._server.run, name="colora-serve", daemon=True)
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        for _ in range(600):
            if self._server.started or not self._thread.is_alive():
                break
            threading.Event().wait(0.05)
        if not self._server.started:
            raise RuntimeError("the server did not start (see the log above)")
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
