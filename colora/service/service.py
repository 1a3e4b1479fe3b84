"""The Tinker service's state and operations, without HTTP: sessions, models, samplers, tenancy.

Every operation takes the caller's tenant first; a session, model, sampler, checkpoint or future of
another tenant is "not found" (the same answer as for one that does not exist). Ids follow the SDK:
`<session_id>:train:<model_seq_id>` for models (the SDK computes it itself when it creates a model
from a checkpoint), `<session_id>:sample:<sampling_session_seq_id>` for sampling sessions.

Requests that act on a model are queued on the scheduler in seq_id order (`colora/service/scheduler.py`);
those whose content is invalid still take their seq_id slot and answer their error there. Samples go
to the backend at once. A session that finishes, or whose heartbeats lapse for `heartbeat_timeout_s`,
ends: its models are deleted and its samplers released once no sample of theirs is in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from colora.seeding import derive_seed
from colora.service import schemas, wire
from colora.service.backend import Backend, BackendError, ForwardCall, LoraSpec
from colora.service.config import ServeConfig
from colora.service.futures import FutureStore
from colora.service.sampling import build_sample_call
from colora.service.scheduler import (
    SEEN_KEPT,
    Outcome,
    Scheduler,
    SeqError,
    barrier_work,
    failed_work,
    forward_work,
    optim_work,
)
from colora.service.store import CheckpointError, CheckpointPath, Store, check_name

log = logging.getLogger("colora.service")


class ApiError(Exception):
    """An HTTP error answer: the body is {error, category} (an empty error body reads as a proxy fault)."""

    def __init__(self, status: int, message: str, category: str = "user"):
        super().__init__(message)
        self.status, self.message, self.category = status, message, category


@dataclass
class Session:
    id: str
    tenant: str
    last_seen: float
    ended: str | None = None  # "finished" or "expired"
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


@dataclass
class Model:
    id: str
    tenant: str
    session_id: str
    base_model: str
    spec: LoraSpec


@dataclass
class Sampler:
    id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None
    ref: Any
    inflight: int = 0
    closing: bool = False
    released: bool = False
    seen: dict[int, dict] = field(default_factory=dict)  # seq_id -> the first answer, for retried POSTs


class Service:
    def __init__(self, config: ServeConfig, backend: Backend, loop: asyncio.AbstractEventLoop):
        self.cfg, self.backend = config, backend
        self.caps = backend.capabilities()
        config.out.mkdir(parents=True, exist_ok=True)
        self.store = Store(config.out)
        self.futures = FutureStore(loop, config.future_ttl_s)
        self.scheduler = Scheduler(backend, self.futures.resolve, config.out / "stats.jsonl", config.batch_window_s)
        self._lock = threading.Lock()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self._creations: dict[tuple[str, int], str] = {}  # (session, model_seq_id) -> request_id
        self._ids = itertools.count(1)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.backend.close()

    def _request_id(self) -> str:
        return f"req-{next(self._ids)}-{secrets.token_hex(4)}"

    def _future(self, tenant: str) -> str:
        rid = self._request_id()
        self.futures.create(rid, tenant)
        return rid

    def _creation(self, tenant: str, s: Session, model_seq_id: int) -> tuple[str, bool]:
        """The request id that creates model `model_seq_id` of session s, and whether it is new: a
        retried create (or load) gets the first one's id, and only the first creates a model."""
        key = (s.id, model_seq_id)
        with self._lock:
            if key in self._creations:
                return self._creations[key], False
            self._creations[key] = rid = self._future(tenant)
        return rid, True

    # -- lookups (404 for what is not the tenant's) ------------------------------------------------
    def _session(self, tenant: str, session_id: str, live: bool = True) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.tenant != tenant:
            raise ApiError(404, f"session {session_id!r} not found")
        if live and s.ended:
            raise ApiError(410, f"session {session_id!r} has {s.ended}")
        s.last_seen = time.monotonic()
        return s

    def _model(self, tenant: str, model_id: str) -> Model:
        m = self.models.get(model_id)
        if m is None or m.tenant != tenant:
            raise ApiError(404, f"model {model_id!r} not found (never created, another tenant's, or its session ended)")
        self.sessions[m.session_id].last_seen = time.monotonic()
        return m

    def _sampler(self, tenant: str, sampler_id: str) -> Sampler:
        s = self.samplers.get(sampler_id)
        if s is None or s.tenant != tenant or s.closing:
            raise ApiError(404, f"sampling session {sampler_id!r} not found (or its session ended)")
        return s

    # -- sessions ----------------------------------------------------------------------------------
    def create_session(self, tenant: str, body: schemas.CreateSession) -> dict:
        sid = f"s{next(self._ids)}-{secrets.token_hex(6)}"
        with self._lock:
            self.sessions[sid] = Session(sid, tenant, time.monotonic())
        log.info("session %s of tenant %s (sdk %s)", sid, tenant, body.sdk_version)
        return {"type": "create_session", "session_id": sid}

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
            s.ended = why
            models = [self.models.pop(m) for m in s.models if m in self.models]
            samplers = [self.samplers[x] for x in s.samplers if x in self.samplers]
            for x in samplers:
                x.closing = True
        for m in models:
            self.scheduler.remove_model(m.id, f"model {m.id} was deleted: its session {why}")
            self.scheduler.control(None, lambda b, mid=m.id: b.delete_model(mid))
        for x in samplers:
            self._maybe_release(x)
        log.info("session %s %s: %d model(s) deleted, %d sampler(s) closing", s.id, why, len(models), len(samplers))

    def _maybe_release(self, x: Sampler) -> None:
        with self._lock:
            go = x.closing and x.inflight == 0 and not x.released
            if go:
                x.released = True
                del self.samplers[x.id]
        if go and x.ref is not None:
            self.backend.release_sampler(x.ref)

    def reap(self, now: float | None = None) -> list[str]:
        """Ends the sessions whose heartbeats lapsed; drops old futures. Returns the ended session ids."""
        now = time.monotonic() if now is None else now
        lapsed = [s for s in list(self.sessions.values())
                  if not s.ended and now - s.last_seen > self.cfg.heartbeat_timeout_s]
        for s in lapsed:
            self.end_session(s, "expired")
        self.futures.sweep()
        return [s.id for s in lapsed]

    # -- models ------------------------------------------------------------------------------------
    def create_model(self, tenant: str, body: schemas.CreateModel) -> dict:
        s = self._session(tenant, body.session_id)
        rid, new = self._creation(tenant, s, body.model_seq_id)
        if not new:
            return {"request_id": rid}
        model_id = f"{s.id}:train:{body.model_seq_id}"
        try:
            spec = self._lora_spec(body.base_model, body.lora_config or schemas.LoraConfig(), model_id,
                                   body.optimizer_config.type)
        except ValueError as e:
            self.futures.resolve(rid, Outcome(error=str(e)))
            return {"request_id": rid}

        def create(b: Backend) -> dict:
            b.create_model(model_id, spec)
            self._register(s, model_id, body.base_model, spec, body.user_metadata)
            return {"type": "create_model", "model_id": model_id}

        self.scheduler.control(rid, create)
        return {"request_id": rid, "model_id": model_id}

    def _lora_spec(self, base_model: str, lc: schemas.LoraConfig, model_id: str, optimizer: str) -> LoraSpec:
        if base_model != self.caps.model_name:
            raise ValueError(f"base_model {base_model!r} is not served here; this server serves {self.caps.model_name!r}")
        if not 1 <= lc.rank <= self.caps.max_lora_rank:
            raise ValueError(f"lora_config.rank ({lc.rank}) must be from 1 to this server's maximum, "
                             f"{self.caps.max_lora_rank}")
        if not (lc.train_mlp or lc.train_attn or lc.train_unembed):
            raise ValueError("lora_config: at least one of train_mlp, train_attn, train_unembed must be true")
        if optimizer not in ("adamw", "adam"):
            raise ValueError(f"optimizer_config.type {optimizer!r} is not supported; this server has adamw")
        # lm_head adapters are not served by vLLM's multi-LoRA: the flag is recorded, not honoured
        unembed = lc.train_unembed and self.caps.train_unembed
        seed = lc.seed if lc.seed is not None else derive_seed(0, model_id, "lora-init")
        return LoraSpec(rank=lc.rank, seed=seed, train_mlp=lc.train_mlp, train_attn=lc.train_attn, train_unembed=unembed)

    def _register(self, s: Session, model_id: str, base_model: str, spec: LoraSpec, user_metadata) -> None:
        """Called on the trainer thread once the backend holds the model."""
        with self._lock:
            if s.ended:
                self.backend.delete_model(model_id)
                raise BackendError(f"session {s.id} has {s.ended}", "user")
            self.models[model_id] = Model(model_id, s.tenant, s.id, base_model, spec)
            s.models.add(model_id)
        self.store.write_run(s.tenant, model_id, base_model, spec, user_metadata)
        self.scheduler.add_model(model_id, next_seq=1)

    def get_info(self, tenant: str, body: schemas.ModelRef) -> dict:
        m = self._model(tenant, body.model_id)
        return {"type": "get_info", "model_id": m.id, "is_lora": True, "lora_rank": m.spec.rank,
                "model_name": m.base_model,
                "model_data": {"model_name": m.base_model, "arch": self.caps.arch,
                               "tokenizer_id": self.caps.tokenizer_id or m.base_model}}

    def _submit(self, tenant: str, model_id: str, make) -> dict:
        """Queues make(request_id) -> Work; a repeated seq_id answers the first request's id."""
        rid = self._future(tenant)
        try:
            got, new = self.scheduler.submit(model_id, make(rid))
        except KeyError:
            self.futures.discard(rid)
            raise ApiError(404, f"model {model_id!r} not found") from None
        except SeqError as e:
            self.futures.discard(rid)
            raise ApiError(400, str(e)) from None
        if not new:
            self.futures.discard(rid)
        return {"request_id": got, "model_id": model_id}

    def forward_backward(self, tenant: str, body: bytes, force_forward_only: bool = False) -> dict:
        try:
            req = wire.parse_forward_backward(body, self.caps, self.cfg.max_datums)
        except wire.InputError as e:
            raise ApiError(400, str(e)) from None
        self._model(tenant, req.model_id)
        if force_forward_only:
            req = dataclasses.replace(req, forward_only=True)
        if req.error is not None:
            return self._submit(tenant, req.model_id, lambda rid: failed_work(rid, req.model_id, req.seq_id, req.error))
        call = ForwardCall(req.model_id, req.seq_id, req.datums, req.loss_fn, req.loss_fn_config, req.forward_only)
        return self._submit(tenant, req.model_id, lambda rid: forward_work(rid, call))

    def optim_step(self, tenant: str, body: schemas.OptimStep) -> dict:
        m = self._model(tenant, body.model_id)
        try:
            params = schemas.adam_params(body)
        except ValueError as e:
            msg = str(e)
            return self._submit(tenant, m.id, lambda rid: failed_work(rid, m.id, body.seq_id, msg))
        return self._submit(tenant, m.id, lambda rid: optim_work(rid, m.id, body.seq_id, params))

    def save_weights(self, tenant: str, body: schemas.SaveWeights) -> dict:
        m = self._model(tenant, body.model_id)
        try:
            cp = CheckpointPath(m.id, "weights", check_name(body.path or f"seq-{body.seq_id}"))
        except CheckpointError as e:
            msg = str(e)
            return self._submit(tenant, m.id, lambda rid: failed_work(rid, m.id, body.seq_id, msg))

        def save(b: Backend) -> dict:
            _user(lambda: self.store.write(tenant, cp, m.base_model, m.spec, lambda d: b.save_state(m.id, d, True),
                                           overwrite=body.overwrite, seq_id=body.seq_id, optimizer=True,
                                           ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata))
            return {"type": "save_weights", "path": str(cp)}

        return self._submit(tenant, m.id, lambda rid: barrier_work(rid, m.id, body.seq_id, "save_weights", save))

    def save_weights_for_sampler(self, tenant: str, body: schemas.SaveWeightsForSampler) -> dict:
        m = self._model(tenant, body.model_id)
        if body.path is not None:
            try:
                cp = CheckpointPath(m.id, "sampler_weights", check_name(body.path))
            except CheckpointError as e:
                msg = str(e)
                return self._submit(tenant, m.id, lambda rid: failed_work(rid, m.id, body.seq_id, msg))

            def save(b: Backend) -> dict:
                refs = []
                _user(lambda: self.store.write(tenant, cp, m.base_model, m.spec,
                                               lambda d: refs.append(b.save_for_sampler(m.id, d)),
                                               overwrite=True, seq_id=body.seq_id, ttl_seconds=body.ttl_seconds,
                                               user_metadata=body.user_metadata))
                for r in refs:  # a sampling session loads the folder when it needs it
                    b.release_sampler(r)
                return {"type": "save_weights_for_sampler", "path": str(cp)}

            return self._submit(tenant, m.id, lambda rid: barrier_work(rid, m.id, body.seq_id, "save_for_sampler", save))
        if body.sampling_session_seq_id is None:
            return self._submit(tenant, m.id, lambda rid: failed_work(
                rid, m.id, body.seq_id, "save_weights_for_sampler needs a path (a named checkpoint) or a "
                "sampling_session_seq_id (an ephemeral sampler)"))
        sid = f"{m.session_id}:sample:{body.sampling_session_seq_id}"

        def snapshot(b: Backend) -> dict:
            ref = b.save_for_sampler(m.id, None)
            if not self._add_sampler(Sampler(sid, tenant, m.session_id, m.base_model, None, ref)):
                b.release_sampler(ref)
                raise BackendError(f"sampling_session_seq_id {body.sampling_session_seq_id} is taken in this "
                                   "session, or the session ended", "user")
            return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sid}

        return self._submit(tenant, m.id, lambda rid: barrier_work(rid, m.id, body.seq_id, "snapshot", snapshot))

    def load_weights(self, tenant: str, body: schemas.LoadWeights) -> dict:
        if body.model_id is not None:  # into an existing model, in its seq order
            m = self._model(tenant, body.model_id)
            if body.seq_id is None:
                raise ApiError(400, "load_weights with model_id needs its seq_id")

            def load(b: Backend) -> dict:
                _, d, _ = _user(lambda: self.store.find(tenant, body.path, kind="weights"))
                b.load_state(m.id, d, body.optimizer)
                return {"type": "load_weights", "path": body.path, "model_id": m.id}

            return self._submit(tenant, m.id, lambda rid: barrier_work(rid, m.id, body.seq_id, "load_weights", load))
        if body.session_id is None or body.model_seq_id is None:
            raise ApiError(400, "load_weights needs model_id and seq_id, or session_id and model_seq_id")
        s = self._session(tenant, body.session_id)
        rid, new = self._creation(tenant, s, body.model_seq_id)
        if not new:
            return {"request_id": rid}
        model_id = f"{s.id}:train:{body.model_seq_id}"

        def create_from(b: Backend) -> dict:
            _, d, meta = _user(lambda: self.store.find(tenant, body.path, kind="weights"))
            base = body.base_model or meta["base_model"]
            if base != self.caps.model_name or meta["base_model"] != self.caps.model_name:
                raise BackendError(f"checkpoint {body.path} is of base model {meta['base_model']!r}; this server "
                                   f"serves {self.caps.model_name!r}", "user")
            spec = LoraSpec(**meta["lora"])
            if spec.rank > self.caps.max_lora_rank:
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

        self.scheduler.control(rid, create_from)
        return {"request_id": rid, "model_id": model_id}

    # -- sampling ----------------------------------------------------------------------------------
    def _add_sampler(self, x: Sampler) -> bool:
        with self._lock:
            s = self.sessions.get(x.session_id)
            if x.id in self.samplers or s is None or s.ended:
                return False
            self.samplers[x.id] = x
            s.samplers.add(x.id)
            return True

    async def create_sampling_session(self, tenant: str, body: schemas.CreateSamplingSession) -> dict:
        s = self._session(tenant, body.session_id)
        sid = f"{s.id}:sample:{body.sampling_session_seq_id}"
        if sid in self.samplers:  # a retried POST
            return {"type": "create_sampling_session", "sampling_session_id": sid}
        ref, base = None, body.base_model or self.caps.model_name
        if body.model_path is not None:
            try:
                _, d, meta = self.store.find(tenant, body.model_path, kind="sampler_weights", field="model_path")
            except CheckpointError as e:
                raise ApiError(404, str(e)) from None
            base = meta["base_model"]
            ref = await asyncio.to_thread(self.backend.load_sampler, d)
        if base != self.caps.model_name:
            raise ApiError(400, f"base_model {base!r} is not served here; this server serves {self.caps.model_name!r}")
        if not self._add_sampler(Sampler(sid, tenant, s.id, base, body.model_path, ref)):
            if ref is not None:
                self.backend.release_sampler(ref)
            if sid in self.samplers:
                return {"type": "create_sampling_session", "sampling_session_id": sid}
            raise ApiError(410, f"session {s.id} has ended")
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def get_sampler(self, tenant: str, sampler_id: str) -> dict:
        x = self._sampler(tenant, sampler_id)
        return {"sampler_id": x.id, "base_model": x.base_model, "model_path": x.model_path}

    def asample(self, tenant: str, body: schemas.Sample) -> dict:
        if body.sampling_session_id is None:
            raise ApiError(400, "asample needs a sampling_session_id (SDK >= 0.18 always sends one)")
        x = self._sampler(tenant, body.sampling_session_id)
        self.sessions[x.session_id].last_seen = time.monotonic()
        if not 1 <= body.num_samples <= self.cfg.max_num_samples:  # before the ids list is made
            raise ApiError(400, f"num_samples ({body.num_samples}) must be from 1 to this server's max_num_samples "
                                f"({self.cfg.max_num_samples})")
        with self._lock:
            if body.seq_id is not None and body.seq_id in x.seen:
                return x.seen[body.seq_id]
            rid = self._future(tenant)
            answer = {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(body.num_samples)]}
            if body.seq_id is not None:
                x.seen[body.seq_id] = answer
                if len(x.seen) > 2 * SEEN_KEPT:  # retries follow their first POST closely: the oldest can go
                    x.seen = dict(list(x.seen.items())[-SEEN_KEPT:])
        seed_parts = (x.id, body.seq_id if body.seq_id is not None else rid)
        try:
            call = build_sample_call(body, x.ref, self.caps, self.cfg.max_num_samples, derive_seed(0, *seed_parts))
        except wire.InputError as e:
            self.futures.resolve(rid, Outcome(error=str(e)))
            return answer
        with self._lock:
            x.inflight += 1

        def done(result) -> None:
            if isinstance(result, BackendError):
                self.futures.resolve(rid, Outcome(error=result.message, category=result.category))
            else:
                self.futures.resolve(rid, Outcome(result=result))
            with self._lock:
                x.inflight -= 1
            self._maybe_release(x)

        self.backend.sample(call, done)
        return answer

    # -- checkpoints and runs (RestClient) ---------------------------------------------------------
    def _run(self, tenant: str, model_id: str) -> dict:
        try:
            run = self.store.read_run(tenant, model_id)
        except CheckpointError as e:
            raise ApiError(404, str(e)) from None
        if run is None:
            raise ApiError(404, f"training run {model_id!r} not found")
        return run

    def list_checkpoints(self, tenant: str, model_id: str) -> dict:
        self._run(tenant, model_id)
        return {"checkpoints": self.store.list(tenant, model_id), "cursor": None}

    def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        self._run(tenant, model_id)
        try:
            self.store.delete(tenant, model_id, checkpoint_id)
        except CheckpointError as e:
            raise ApiError(404, str(e)) from None

    def training_run(self, tenant: str, model_id: str) -> dict:
        self._run(tenant, model_id)
        return self.store.training_run(tenant, model_id)

    def stats(self) -> dict:
        with self._lock:
            live = sum(not s.ended for s in self.sessions.values())
            return {**self.scheduler.stats(), "live_sessions": live, "live_models": len(self.models),
                    "live_samplers": len(self.samplers), "futures": len(self.futures)}


def _user(fn):
    """Runs fn; a CheckpointError (a bad name, an absent checkpoint) is the client's error."""
    try:
        return fn()
    except CheckpointError as e:
        raise BackendError(str(e), "user") from None
