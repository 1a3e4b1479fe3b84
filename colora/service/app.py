"""The Tinker API over HTTP (FastAPI): routes, auth, body limits, error answers, long polls.

Every route but healthz needs an `X-API-Key` of a tenant (`colora/service/config.py`); an unknown key
is a 401 with a body. Every error answer has the body `{error, category}`. POSTs are answered at once
with a future (`{request_id, ...}`); `retrieve_future` holds a poll up to `poll_hold_s` and then answers
408, which the SDK retries silently. forward_backward results and samples come back as protobuf when
the client asks for it (SDK 0.25+ always does). The SDK and its routes are described in
`docs/serving.md`; the operations themselves live in `colora/service/service.py`.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from colora.service import schemas, wire
from colora.service.backend import Backend, ForwardResult, SampleResult
from colora.service.config import ServeConfig
from colora.service.service import ApiError, Service

log = logging.getLogger("colora.service")
PROTO = "application/x-protobuf"


def create_app(config: ServeConfig, backend: Backend) -> FastAPI:
    """The service's ASGI app; `app.state.service` is its Service once the app has started."""

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

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return JSONResponse({"error": e.message, "category": e.category}, status_code=e.status)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse({"error": f"{type(e).__name__}: {e}", "category": "server"}, status_code=500)

    def svc(request: Request) -> Service:
        return request.app.state.service

    def tenant(request: Request) -> str:
        t = config.tenant_of(request.headers.get("x-api-key"))
        if t is None:
            raise ApiError(401, "the X-API-Key header holds no key of this server (the SDK sends TINKER_API_KEY)")
        return t

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

    async def parsed(request: Request, model: type[BaseModel]):
        raw = await body(request)
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(map(str, err["loc"])) or "body"
            raise ApiError(400, f"{where}: {err['msg']} (in {model.__name__})") from None

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
        return svc(request).create_session(tenant(request), await parsed(request, schemas.CreateSession))

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat(request: Request):
        b = await parsed(request, schemas.SessionRef)
        return svc(request).heartbeat(tenant(request), b.session_id)

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        await parsed(request, schemas.Finish)
        return svc(request).finish(tenant(request), session_id)

    # -- training ----------------------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        return svc(request).create_model(tenant(request), await parsed(request, schemas.CreateModel))

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        return svc(request).get_info(tenant(request), await parsed(request, schemas.ModelRef))

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
        return svc(request).optim_step(tenant(request), await parsed(request, schemas.OptimStep))

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        return svc(request).save_weights(tenant(request), await parsed(request, schemas.SaveWeights))

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        b = await parsed(request, schemas.SaveWeightsForSampler)
        return svc(request).save_weights_for_sampler(tenant(request), b)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        return svc(request).load_weights(tenant(request), await parsed(request, schemas.LoadWeights))

    # -- sampling ----------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        b = await parsed(request, schemas.CreateSamplingSession)
        return await svc(request).create_sampling_session(tenant(request), b)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        return svc(request).get_sampler(tenant(request), sampler_id)

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        return svc(request).asample(tenant(request), await parsed(request, schemas.Sample))

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
            return {"error": outcome.error, "category": outcome.category}
        r, proto = outcome.result, PROTO in request.headers.get("accept", "")
        if isinstance(r, ForwardResult):
            return Response(wire.encode_forward_output(r), media_type=PROTO) if proto else wire.forward_output_json(r)
        if isinstance(r, SampleResult):
            return Response(wire.encode_sample(r), media_type=PROTO) if proto else wire.sample_json(r)
        return r if r is not None else {}

    # -- the RestClient's routes -------------------------------------------------------------------
    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

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
        """The trainer's counters (cycles, models and forward calls per cycle, optim steps per pass)."""
        tenant(request)
        return svc(request).stats()

    return app


async def _reap(svc: Service, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            svc.reap()
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
