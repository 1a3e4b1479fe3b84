"""The Tinker service's state and operations, without HTTP: sessions, models, samplers, tenancy.

Every operation takes the caller's tenant first; a session, model, sampler, checkpoint or future of
another tenant is "not found" (the same answer as for one that does not exist). Ids follow the SDK:
`<session_id>:train:<model_seq_id>` for models (the SDK computes it itself when it creates a model
from a checkpoint), `<session_id>:sample:<sampling_session_seq_id>` for sampling sessions.

Requests that act on a model are queued on the scheduler in seq_id order (`colora/service/scheduler.py`);
those whose content is invalid, and those refused by a quota (403), still take their seq_id slot and
answer their error there, so the model's next request runs. A request refused for a backlog (429: too
many pending, a seq_id too far ahead) takes nothing: the SDK sends it again. Samples go to the backend
at once. Every request that got a request id is answered, whatever fails after; every answer passes
through `_answer`, which takes server paths out of its error and records it for the operator.

A session that finishes, or whose heartbeats lapse for `heartbeat_timeout_s`, ends: its models are
deleted (and their folders, once they hold no checkpoint) and its samplers released once no sample of
theirs is in flight. An ephemeral sampler (`save_weights_and_get_sampling_client`) is released the same
way once `keep_samplers` newer ones of its model exist. The reaper (`reap`) also deletes checkpoints
whose `ttl_seconds` have passed and logs each change of the backend's health.

stable_reinforce is served here, above the backend: its datums' provenance is resolved against the
samples the server recorded (colora/service/records.py), and the call goes to the backend as cispo with
the recorded log-probs; a datum naming a sequence that is not the model's session's fails its request.
A session's end drops its records; the reaper drops those unused for a day.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import secrets
import threading
import time

from colora.seeding import derive_seed
from colora.service import schemas, wire
from colora.service.backend import (SCORE_WEIGHTED, Backend, BackendError, Datum, ForwardCall, FullSpec, LoraSpec,
                                    spec_of)
from colora.service.checkpoints import CheckpointOps, _user
from colora.service.config import ServeConfig
from colora.service.errors import ApiError, Journal, limit_error, scrub
from colora.service.full import full_refusal
from colora.service.futures import FutureStore, failure_answer
from colora.service.records import RecordError, Records, behaviour_logprobs
from colora.service.samplers import SamplerOps
from colora.service.sampling import SEED_RANGE
from colora.service.scheduler import Backlog, Outcome, Scheduler, SeqError, barrier_work, failed_work
from colora.service.scheduler import forward_work, optim_work
from colora.service.state import Model, Sampler, Session
from colora.service.store import Store
from colora.service.usage import Usage

log = logging.getLogger("colora.service")
__all__ = ["ApiError", "Model", "Sampler", "Service", "Session"]
# backend.health()'s keys, with what a backend that reports none of them is taken to mean
HEALTH = {"status": "ok", "engine_restarts": 0, "last_engine_error": None, "samplers_loaded": 0,
          "engine_requests_in_flight": 0, "gpu_memory_bytes": 0}


class Service(CheckpointOps, SamplerOps):
    """See the module docstring; checkpoints and samplers are in the two halves it inherits."""

    def __init__(self, config: ServeConfig, backend: Backend, loop: asyncio.AbstractEventLoop):
        self.cfg, self.backend = config, backend
        self.caps = backend.capabilities()
        config.out.mkdir(parents=True, exist_ok=True)
        self.store = Store(config.out)
        self.futures = FutureStore(loop, config.future_ttl_s)
        self.journal = Journal()
        self.usage = Usage()
        self.records = Records(config.limits_of)  # stable_reinforce's recorded samples
        self.scheduler = Scheduler(backend, self._answer, config.out / "stats.jsonl", config.batch_window_s,
                                   config.cycle_datums, config.cycle_tokens,
                                   observe=lambda results: self.usage.cycle(self._tenant_of_model, results))
        self._lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self._creations: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> request_id
        self._creating: collections.Counter = collections.Counter()  # tenant -> models being created
        self._sampling: collections.Counter = collections.Counter()  # tenant -> asample requests in flight
        self._gone: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()  # id -> (tenant, why)
        self._ids = itertools.count(1)
        self.started = time.monotonic()
        self._health: dict = dict(HEALTH)  # what the log said last: a change from it is logged

    def start(self) -> None:
        for line in self.store.sweep():
            log.info("start: %s", line)
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.backend.close()

    # -- answers and refusals ----------------------------------------------------------------------
    def scrub(self, message: str) -> str:
        return scrub(message, self.cfg.out, (self.caps.model_name, self.caps.tokenizer_id or ""))

    def _answer(self, rid: str, outcome: Outcome) -> None:
        """Every future's answer passes here (any thread)."""
        if outcome.error is not None:
            outcome = dataclasses.replace(outcome, error=self.scrub(outcome.error))
        who = self.futures.resolve(rid, outcome)
        if who is not None and who[1] and outcome.error is not None:
            self.journal.record(who[0], who[1], failure_answer(outcome)[0], outcome.category, outcome.error)

    def _request_id(self) -> str:
        return f"req-{next(self._ids)}-{secrets.token_hex(4)}"

    def _future(self, tenant: str, route: str | None) -> str:
        """A new future; route None: a refusal already answered and recorded (not journaled again)."""
        rid = self._request_id()
        self.futures.create(rid, tenant, route or "")
        if route:
            self.usage.request(tenant)
        return rid

    def _creation(self, tenant: str, s: Session, model_seq_id: int, route: str) -> tuple[str, bool]:
        """The request id that creates model `model_seq_id` of session s, and whether it is new: a
        retried create (or load) gets the first one's id, and only the first creates a model. A new
        one counts against the tenant's models quota until it is created or fails."""
        key = (s.id, model_seq_id)
        lim = self.cfg.limits_of(tenant).models
        with self._lock:
            if key in self._creations:
                return self._creations[key], False
            held = sum(m.tenant == tenant for m in self.models.values()) + self._creating[tenant]
            if held >= lim:
                raise limit_error(403, tenant, "models", lim, held, "live models",
                                  "finish a session (its models are freed) before creating another model")
            self._creations[key] = rid = self._future(tenant, route)
            self._creating[tenant] += 1
        return rid, True

    def _created(self, tenant: str) -> None:
        with self._lock:
            self._creating[tenant] -= 1

    # -- lookups (404 for what is not the tenant's) ------------------------------------------------
    def _session(self, tenant: str, session_id: str, live: bool = True, touch: bool = True) -> Session:
        """The tenant's session; `live`: 410 once it has ended; `touch`: the call counts as a sign of life."""
        s = self.sessions.get(session_id)
        if s is None or s.tenant != tenant:
            raise ApiError(404, f"session {session_id!r} not found")
        if live and s.ended:
            raise ApiError(410, f"session {session_id!r} has {s.ended}")
        if touch:
            s.last_seen = time.monotonic()
        return s

    def _model(self, tenant: str, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None or m.tenant != tenant:
            raise ApiError(404, f"model {model_id!r} not found (never created, another tenant's, or its session ended)")
        self.sessions[m.session_id].last_seen = time.monotonic()
        return m

    def _tenant_of_model(self, model_id: str) -> str | None:
        s = self.sessions.get(model_id.split(":", 1)[0])
        return None if s is None else s.tenant

    # -- sessions ----------------------------------------------------------------------------------
    def create_session(self, tenant: str, body: schemas.CreateSession) -> dict:
        sid = f"s{next(self._ids)}-{secrets.token_hex(6)}"
        lim = self.cfg.limits_of(tenant).sessions
        with self._lock:
            held = sum(s.tenant == tenant and not s.ended for s in self.sessions.values())
            if held >= lim:
                raise limit_error(403, tenant, "sessions", lim, held, "live sessions", "close a ServiceClient "
                                  "(its session finishes) or let an idle one's heartbeats lapse")
            self.sessions[sid] = Session(sid, tenant, time.monotonic(), user_metadata=body.user_metadata,
                                         display_name=body.display_name)
        log.info("session %s of tenant %s started (sdk %s)", sid, tenant, body.sdk_version or "unknown")
        return {"type": "create_session", "session_id": sid}

    def list_sessions(self, tenant: str) -> list[str]:
        """The tenant's sessions since the server started (ended ones until they are forgotten), newest first."""
        with self._lock:
            return [s.id for s in reversed(self.sessions.values()) if s.tenant == tenant]

    def get_session(self, tenant: str, session_id: str) -> dict:
        """Tinker's GetSessionResponse; reading a session is no heartbeat of it."""
        s = self._session(tenant, session_id, live=False, touch=False)
        return {"training_run_ids": sorted(s.models), "sampler_ids": sorted(s.samplers),
                "user_metadata": s.user_metadata, "display_name": s.display_name}

    def heartbeat(self, tenant: str, session_id: str) -> dict:
        self._session(tenant, session_id)
        return {"type": "session_heartbeat"}

    def finish(self, tenant: str, session_id: str) -> dict:
        s = self._session(tenant, session_id, live=False)
        if not s.ended:
            self.end_session(s, "finished")
        return {"type": "finish_session"}

    def end_session(self, s: Session, why: str) -> None:
        """Deletes the session's models and releases its samplers (each once none of its samples runs)."""
        with self._lock:
            s.ended, s.ended_at = why, time.monotonic()
            models = [self.models.pop(m) for m in s.models if m in self.models]
            samplers = [self.samplers[x] for x in s.samplers if x in self.samplers]
            for x in samplers:
                x.closing = x.closing or f"its session {why}"
        for m in models:
            self.scheduler.remove_model(m.id, f"model {m.id} was deleted: its session {why}")
            self.scheduler.control(None, lambda b, m=m: self._delete_model(b, m))
        for x in samplers:
            self._maybe_release(x)
        recorded = self.records.drop_session(s.tenant, s.id, why)  # after `ended`: no record joins after this
        log.info("session %s of tenant %s %s: %d model(s) deleted, %d sampler(s) released, %d recorded sample(s) "
                 "dropped", s.id, s.tenant, why, len(models), len(samplers), recorded)

    def _delete_model(self, b: Backend, m: Model) -> None:
        b.delete_model(m.id)
        self.usage.forget_model(m.id)
        self.store.forget_model(m.tenant, m.id)

    def reap(self, now: float | None = None) -> list[str]:
        """Ends the sessions whose heartbeats lapsed, forgets long-ended ones, drops old futures, deletes
        expired checkpoints, logs a change of the backend's health. Returns the ended session ids."""
        now = time.monotonic() if now is None else now
        lapsed = [s for s in list(self.sessions.values())
                  if not s.ended and now - s.last_seen > self.cfg.heartbeat_timeout_s]
        for s in lapsed:
            log.info("session %s of tenant %s lapsed: no heartbeat for %.0f s", s.id, s.tenant, now - s.last_seen)
            self.end_session(s, "expired")
        with self._lock:  # an ended session answers 410 for a while, then is forgotten
            old = {k for k, s in self.sessions.items() if s.ended and now - s.ended_at > self.cfg.future_ttl_s}
            for k in old:
                del self.sessions[k]
            self._creations = {k: v for k, v in self._creations.items() if k[0] not in old}
        self.futures.sweep()
        self.records.expire()
        self._expire()
        self._watch_health()
        return [s.id for s in lapsed]

    # -- health ------------------------------------------------------------------------------------
    def health(self) -> dict:
        """backend.health() (a backend without one is "ok") with every key of HEALTH, its error made fit
        for clients."""
        try:
            h = {**HEALTH, **getattr(self.backend, "health", lambda: {"status": "ok"})()}
        except Exception as e:  # a health check that fails says so, and the server is not ok
            h = {**HEALTH, "status": "degraded", "last_engine_error": f"health() failed: {type(e).__name__}: {e}"}
        if h.get("status") not in ("ok", "degraded", "restarting"):
            h = {**h, "status": "degraded", "last_engine_error": f"backend health status {h.get('status')!r}"}
        if h.get("last_engine_error"):
            h["last_engine_error"] = self.scrub(str(h["last_engine_error"]))
        return h

    def full_engines(self) -> dict[str, dict]:
        """Each full-parameter model's engine's health (a backend without them: none), errors made fit for
        clients; the server's view only (a tenant's scope holds the shared engine's health alone)."""
        return {model_id: {**h, "last_engine_error": h.get("last_engine_error") and self.scrub(str(h["last_engine_error"]))}
                for model_id, h in getattr(self.backend, "full_health", dict)().items()}

    def _watch_health(self) -> None:
        h, was = self.health(), self._health
        self._health = h
        keys = ("status", "engine_restarts", "last_engine_error")
        if any(h.get(k) != was.get(k) for k in keys):
            level = logging.INFO if h["status"] == "ok" else logging.WARNING
            log.log(level, "backend health: %s (was %s); engine restarts %s; last engine error: %s", h["status"],
                    was.get("status"), h.get("engine_restarts", 0), h.get("last_engine_error") or "none")

    # -- models ------------------------------------------------------------------------------------
    def create_model(self, tenant: str, body: schemas.CreateModel) -> dict:
        s = self._session(tenant, body.session_id)
        rid, new = self._creation(tenant, s, body.model_seq_id, "create_model")
        if not new:
            return {"request_id": rid}
        model_id = f"{s.id}:train:{body.model_seq_id}"
        try:
            spec = self._lora_spec(body.base_model, body.lora_config, model_id, body.optimizer_config.type)
        except ValueError as e:
            self._created(tenant)
            self._answer(rid, Outcome(error=str(e)))
            return {"request_id": rid}

        def create(b: Backend) -> dict:
            try:
                self._full_room(spec)
                b.create_model(model_id, spec)
                self._register(s, model_id, body.base_model, spec, body.user_metadata)
            finally:
                self._created(tenant)
            return {"type": "create_model", "model_id": model_id}

        self.scheduler.control(rid, create)
        return {"request_id": rid, "model_id": model_id}

    def _lora_spec(self, base_model: str, lc: schemas.LoraConfig | None, model_id: str,
                   optimizer: str) -> LoraSpec | FullSpec:
        """The new model's spec; no lora_config: a full-parameter model, where --full-models allows any."""
        if base_model != self.caps.model_name:
            raise ValueError(f"base_model {base_model!r} is not served here; this server serves {self.caps.model_name!r}")
        if optimizer not in ("adamw", "adam"):
            raise ValueError(f"optimizer_config.type {optimizer!r} is not supported; this server has adamw")
        if lc is None:
            if self.cfg.full_models < 1:
                raise ValueError(full_refusal(self.cfg.full_models, 0))
            return FullSpec()
        if not 1 <= lc.rank <= self.caps.max_lora_rank:
            raise ValueError(f"lora_config.rank ({lc.rank}) must be from 1 to this server's maximum, "
                             f"{self.caps.max_lora_rank}")
        if not (lc.train_mlp or lc.train_attn or lc.train_unembed):
            raise ValueError("lora_config: at least one of train_mlp, train_attn, train_unembed must be true")
        # lm_head adapters are not served by vLLM's multi-LoRA: the flag is recorded, not honoured
        unembed = lc.train_unembed and self.caps.train_unembed
        seed = lc.seed % SEED_RANGE if lc.seed is not None else derive_seed(0, model_id, "lora-init")
        return LoraSpec(rank=lc.rank, seed=seed, train_mlp=lc.train_mlp, train_attn=lc.train_attn, train_unembed=unembed)

    def _full_room(self, spec) -> None:
        """On the trainer thread, before a model of `spec` is made: a full-parameter one beyond --full-models is refused."""
        live = sum(isinstance(m.spec, FullSpec) for m in self.models.values())
        if isinstance(spec, FullSpec) and (why := full_refusal(self.cfg.full_models, live)):
            raise BackendError(why, "user")

    def _register(self, s: Session, model_id: str, base_model: str, spec: LoraSpec | FullSpec, user_metadata) -> None:
        """Called on the trainer thread once the backend holds the model."""
        with self._lock:  # the session cannot end between here and its queue: end_session takes this lock
            if s.ended:
                self.backend.delete_model(model_id)
                raise BackendError(f"session {s.id} has {s.ended}", "user")
            self.models[model_id] = Model(model_id, s.tenant, s.id, base_model, spec)
            s.models.add(model_id)
            self.scheduler.add_model(model_id, next_seq=1, owner=s.tenant)
        self.store.write_run(s.tenant, model_id, base_model, spec, user_metadata)
        log.info("model %s of tenant %s created: %s", model_id, s.tenant,
                 "full-parameter" if isinstance(spec, FullSpec) else f"LoRA rank {spec.rank}")

    def get_info(self, tenant: str, body: schemas.ModelRef) -> dict:
        m = self._model(tenant, body.model_id)
        lora = not isinstance(m.spec, FullSpec)
        return {"type": "get_info", "model_id": m.id, "is_lora": lora, "lora_rank": m.spec.rank if lora else None,
                "model_name": m.base_model,
                "model_data": {"model_name": m.base_model, "arch": self.caps.arch,
                               "tokenizer_id": self.caps.tokenizer_id or m.base_model}}

    def _submit(self, tenant: str, model_id: str, make, route: str | None = "request", nbytes: int = 0) -> dict:
        """Queues make(request_id) -> Work; a repeated seq_id answers the first request's id. `route` names
        the request in the operator's record (None: a refusal already recorded); `nbytes`, its body's size
        (counted against the tenant's pending_bytes while it waits)."""
        lim = self.cfg.limits_of(tenant)
        rid = self._future(tenant, route)
        try:
            got, new = self.scheduler.submit(model_id, dataclasses.replace(make(rid), nbytes=nbytes), lim.seq_window,
                                             lim.pending_requests, lim.pending_bytes)
        except KeyError:
            self.futures.discard(rid)
            raise ApiError(404, f"model {model_id!r} not found") from None
        except SeqError as e:
            self.futures.discard(rid)
            raise ApiError(400, str(e)) from None
        except Backlog as e:
            self.futures.discard(rid)
            raise ApiError(429, f"tenant {tenant!r}: {e.message}", limit=e.limit, value=e.value, count=e.count) from None
        if not new:
            self.futures.discard(rid)
        return {"request_id": got, "model_id": model_id}

    def fail_in_slot(self, tenant: str, model_id: str, seq_id: int, route: str, error: str,
                     refusal: ApiError | None = None) -> dict:
        """A request of this model that cannot run takes its seq_id slot and is answered `error` there, so
        the model's next request runs. With `refusal`, that is raised after (a quota's 403)."""
        self._model(tenant, model_id)
        out = self._submit(tenant, model_id, lambda rid: failed_work(rid, model_id, seq_id, error, label=route),
                           None if refusal else route)
        if refusal is not None:
            raise refusal
        return out

    def model_request(self, tenant: str, raw: bytes, model: type[schemas.Body], route: str) -> schemas.Body | dict:
        """A model's JSON request (it has model_id and seq_id) as `model`. One that does not validate takes its
        seq_id slot, failing there, when its model_id and seq_id can be read: returns that answer (a dict)."""
        try:
            return schemas.parse(raw, model)
        except ApiError as e:
            ids = schemas.model_and_seq(raw)
            if ids is None:
                raise
            return self.fail_in_slot(tenant, ids[0], ids[1], route, e.message)

    def forward_backward(self, tenant: str, body: bytes, force_forward_only: bool = False) -> dict:
        try:
            req = wire.parse_forward_backward(body, self.caps, self.cfg.max_datums)
        except wire.InputError as e:
            raise ApiError(400, str(e)) from None
        m = self._model(tenant, req.model_id)
        if force_forward_only:
            req = dataclasses.replace(req, forward_only=True)
        route = "forward" if req.forward_only else "forward_backward"
        if req.error is None and req.loss_fn == wire.STABLE:
            try:
                req = self._stable_reinforce(tenant, m, req)
            except RecordError as e:
                req = dataclasses.replace(req, error=str(e))
        if req.error is not None:
            return self.fail_in_slot(tenant, req.model_id, req.seq_id, route, req.error)
        call = ForwardCall(req.model_id, req.seq_id, req.datums, req.loss_fn, req.loss_fn_config, req.forward_only)
        return self._submit(tenant, req.model_id, lambda rid: forward_work(rid, call), route, nbytes=len(body))

    def _stable_reinforce(self, tenant: str, m: Model, req: wire.ForwardRequest) -> wire.ForwardRequest:
        """stable_reinforce (colora/service/records.py) as the backend's cispo with the ratio clipped to [0, C]:
        each datum's `logprobs` the sampler's, as the server recorded them where its provenance names them."""
        def get(sequence_id: str, where: str):
            return self.records.get(tenant, m.session_id, sequence_id, where)

        datums = tuple(Datum(d.tokens, {**d.inputs, "logprobs": behaviour_logprobs(
            d.tokens, d.inputs["target_tokens"], d.inputs["advantages"], prov, get, f"data[{i}]")})
            for i, (d, prov) in enumerate(zip(req.datums, req.provenance, strict=True)))
        config = {"clip_low_threshold": 0.0, "clip_high_threshold": req.loss_fn_config["clip_high_threshold"],
                  SCORE_WEIGHTED: req.loss_fn_config.get(SCORE_WEIGHTED, 0.0)}
        return dataclasses.replace(req, loss_fn="cispo", loss_fn_config=config, datums=datums, provenance=())

    def optim_step(self, tenant: str, body: schemas.OptimStep) -> dict:
        m = self._model(tenant, body.model_id)
        try:
            params = schemas.adam_params(body)
        except ValueError as e:
            return self.fail_in_slot(tenant, m.id, body.seq_id, "optim_step", str(e))
        return self._submit(tenant, m.id, lambda rid: optim_work(rid, m.id, body.seq_id, params), "optim_step")

    def load_weights(self, tenant: str, body: schemas.LoadWeights) -> dict:
        if body.model_id is not None:  # into an existing model, in its seq order
            m = self._model(tenant, body.model_id)
            if body.seq_id is None:
                raise ApiError(400, "load_weights with model_id needs its seq_id")

            def load(b: Backend) -> dict:
                _, d, _ = _user(lambda: self.store.find(tenant, body.path, kind="weights"))
                b.load_state(m.id, d, body.optimizer)
                return {"type": "load_weights", "path": body.path, "model_id": m.id}

            return self._submit(tenant, m.id, lambda rid: barrier_work(rid, m.id, body.seq_id, "load_weights", load),
                                "load_weights")
        if body.session_id is None or body.model_seq_id is None:
            raise ApiError(400, "load_weights needs model_id and seq_id, or session_id and model_seq_id")
        s = self._session(tenant, body.session_id)
        rid, new = self._creation(tenant, s, body.model_seq_id, "load_weights")
        if not new:
            return {"request_id": rid}
        model_id = f"{s.id}:train:{body.model_seq_id}"

        def create_from(b: Backend) -> dict:
            try:
                return self._create_from(b, s, model_id, body)
            finally:
                self._created(tenant)

        self.scheduler.control(rid, create_from)
        return {"request_id": rid, "model_id": model_id}

    def _create_from(self, b: Backend, s: Session, model_id: str, body: schemas.LoadWeights) -> dict:
        _, d, meta = _user(lambda: self.store.find(s.tenant, body.path, kind="weights"))
        base = body.base_model or meta["base_model"]
        if base != self.caps.model_name or meta["base_model"] != self.caps.model_name:
            raise BackendError(f"checkpoint {body.path} is of base model {meta['base_model']!r}; this server "
                               f"serves {self.caps.model_name!r}", "user")
        spec = spec_of(meta["lora"])
        self._full_room(spec)
        if isinstance(spec, LoraSpec) and spec.rank > self.caps.max_lora_rank:
            raise BackendError(f"checkpoint {body.path} has LoRA rank {spec.rank}, above this server's "
                               f"maximum {self.caps.max_lora_rank}", "user")
        b.create_model(model_id, spec)
        try:
            b.load_state(model_id, d, body.optimizer)
        except Exception:
            b.delete_model(model_id)
            raise
        self._register(s, model_id, base, spec, body.user_metadata)
        return {"type": "load_weights", "path": body.path, "model_id": model_id}

    # -- what the server holds ---------------------------------------------------------------------
    def stats(self) -> dict:
        """The trainer's totals and what lives now, server-wide (for the admin and tests)."""
        with self._lock:
            live = sum(not s.ended for s in self.sessions.values())
            return {**self.scheduler.stats(), "live_sessions": live, "live_models": len(self.models),
                    "live_samplers": len(self.samplers), "futures": len(self.futures)}

    def snapshot(self, tenant: str | None) -> dict:
        """The server as colora/service/usage.py describes; tenant None: every tenant's (the admin's view),
        else that tenant's entry and errors alone. The "server" sums name no tenant; /api/v1/colora/stats
        shows a tenant only their uptime and health."""
        with self._lock:
            sessions, models = list(self.sessions.values()), list(self.models.values())
            samplers, sampling = list(self.samplers.values()), dict(self._sampling)
        names = [tenant] if tenant is not None else sorted(
            {s.tenant for s in sessions} | set(self.usage.tenants()) | set(self.store.tenants()))
        tenants = {}
        for t in names:
            requests, nbytes = self.scheduler.pending(t)
            count, disk = self.store.usage(t)
            recorded, recorded_bytes = self.records.usage(t)
            detail = [{"model_id": m.id, "session_id": m.session_id, "rank": getattr(m.spec, "rank", None), **self.usage.model(m.id)}
                      for m in models if m.tenant == t]
            tenants[t] = {"sessions": sum(s.tenant == t and not s.ended for s in sessions), "models": len(detail),
                          "samplers": sum(x.tenant == t and not x.closing for x in samplers),
                          **self.usage.counts(t), "errors": self.journal.count(t), "queue_depth": requests,
                          "pending_bytes": nbytes, "disk_bytes": disk, "checkpoints": count,
                          "samples_in_flight": sampling.get(t, 0), "recorded_sequences": recorded,
                          "recorded_bytes": recorded_bytes, "models_detail": detail}
        st = self.stats()
        server = {"uptime_s": round(time.monotonic() - self.started, 3), "health": self.health(),
                  **{k: st[k] for k in ("cycles", "cycle_seconds_sum", "last_cycle_seconds", "cycle_models_sum",
                                        "multi_model_cycles", "max_models_per_cycle", "forward_calls", "forward_datums",
                                        "optim_steps", "max_optim_steps_per_pass", "multi_model_optim_passes",
                                        "live_sessions", "live_models", "live_samplers", "futures")},
                  "futures_pending": self.futures.unresolved(), "full_engines": self.full_engines()}
        return {"tenants": tenants, "server": server, "errors": self.journal.recent(tenant)}
