"""Sampling sessions: their lifecycle, their quota, and asample.

A sampler is the base model, a named sampler checkpoint loaded by `create_sampling_session`, or an
ephemeral snapshot of a model made by `save_weights_for_sampler` with a `sampling_session_seq_id` (the
SDK's `save_weights_and_get_sampling_client`, called by RL loops after every step). A model keeps its
newest `keep_samplers` ephemeral samplers: an older one takes no new samples (404, saying why) and is
released once none of its samples is in flight. A session's end releases all of its samplers the same
way. Each request that asample accepts is answered, whatever fails after its answer was recorded.

A sample asked with `record_stability_info` is recorded for stable_reinforce (colora/service/records.py)
when it finishes and before it is answered, so a client holding the answer can train on it at once; a
sample that cannot be recorded fails, saying why.
"""

from __future__ import annotations

import asyncio
import logging
import time

from colora.seeding import derive_seed
from colora.service import schemas, wire
from colora.service.backend import BackendError
from colora.service.errors import ApiError, limit_error
from colora.service.records import RecordError
from colora.service.sampling import build_sample_call
from colora.service.scheduler import SEEN_KEPT, Outcome
from colora.service.state import Sampler
from colora.service.store import CheckpointError

log = logging.getLogger("colora.service")
GONE_KEPT = 4096  # released samplers whose 404 still says why


class SamplerOps:
    """The sampling half of `Service` (colora/service/service.py), whose state it uses: `samplers`,
    `_gone`, `_sampling`, `sessions`, `_lock`, `cfg`, `caps`, `backend`, `usage`, `records`, `scheduler`,
    `_future`, `_answer`."""

    def _sampler(self, tenant: str, sampler_id: str) -> Sampler:
        s = self.samplers.get(sampler_id)
        if s is not None and s.tenant == tenant and s.closing:
            raise ApiError(404, f"sampling session {sampler_id!r} was released: {s.closing}")
        if s is None or s.tenant != tenant:
            owner, why = self._gone.get(sampler_id, (None, ""))
            if owner == tenant:
                raise ApiError(404, f"sampling session {sampler_id!r} was released: {why}")
            raise ApiError(404, f"sampling session {sampler_id!r} not found (or its session ended)")
        return s

    def _maybe_release(self, x: Sampler) -> None:
        with self._lock:
            go = bool(x.closing) and x.inflight == 0 and not x.released
            if go:
                x.released = True
                del self.samplers[x.id]
                self._gone[x.id] = (x.tenant, x.closing)
                while len(self._gone) > GONE_KEPT:
                    self._gone.popitem(last=False)
        if go and x.ref is not None:
            self.backend.release_sampler(x.ref)

    def _sampler_quota(self, tenant: str, model_id: str | None = None) -> ApiError | None:
        """The refusal of one more sampler by the samplers quota, or None. A new ephemeral sampler of a
        model that keeps `keep_samplers` already replaces one of them: it adds none."""
        lim = self.cfg.limits_of(tenant).samplers
        with self._lock:
            live = [x for x in self.samplers.values() if x.tenant == tenant and not x.closing]
        if model_id is not None and sum(x.model_id == model_id for x in live) >= self.cfg.keep_samplers:
            return None
        if len(live) >= lim:
            return limit_error(403, tenant, "samplers", lim, len(live), "live sampling sessions",
                               "finish a session, or sample from fewer checkpoints at once")
        return None

    def _add_sampler(self, x: Sampler) -> bool:
        with self._lock:
            s = self.sessions.get(x.session_id)
            if x.id in self.samplers or s is None or s.ended:
                return False
            self.samplers[x.id] = x
            s.samplers.add(x.id)
            older = []
            if x.model_id is not None:  # the model's ephemeral samplers beyond the newest keep_samplers go
                mine = [y for y in self.samplers.values() if y.model_id == x.model_id and not y.closing]
                older = mine[:max(0, len(mine) - self.cfg.keep_samplers)]
                for y in older:
                    y.closing = (f"a newer sampler of model {x.model_id} replaced it (the server keeps the newest "
                                 f"{self.cfg.keep_samplers} of a model; make a sampling client after each save)")
        for y in older:
            self._maybe_release(y)
        return True

    async def create_sampling_session(self, tenant: str, body: schemas.CreateSamplingSession) -> dict:
        s = self._session(tenant, body.session_id)
        sid = f"{s.id}:sample:{body.sampling_session_seq_id}"
        if sid in self.samplers:  # a retried POST
            return {"type": "create_sampling_session", "sampling_session_id": sid}
        if (refusal := self._sampler_quota(tenant)) is not None:
            raise refusal
        ref, base, d = None, body.base_model or self.caps.model_name, None
        if body.model_path is not None:
            try:
                _, d, meta = self.store.find(tenant, body.model_path, kind="sampler_weights", field="model_path")
            except CheckpointError as e:
                raise ApiError(404, str(e)) from None
            base = meta["base_model"]
        if base != self.caps.model_name:  # before anything is loaded
            raise ApiError(400, f"base_model {base!r} is not served here; this server serves {self.caps.model_name!r}")
        if d is not None:
            try:
                ref = await asyncio.to_thread(self.backend.load_sampler, d)
            except BackendError as e:
                raise ApiError(400 if e.category == "user" else 500, e.message, e.category) from None
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
        lim = self.cfg.limits_of(tenant).pending_samples
        with self._lock:
            if body.seq_id is not None and body.seq_id in x.seen:
                return x.seen[body.seq_id]
            if x.closing:  # released since the lookup (a newer snapshot, its session's end)
                raise ApiError(404, f"sampling session {x.id!r} was released: {x.closing}")
            if self._sampling[tenant] >= lim:
                raise limit_error(429, tenant, "pending_samples", lim, self._sampling[tenant],
                                  "asample requests in flight", "wait for their results")
            rid = self._future(tenant, "asample")
            answer = {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(body.num_samples)]}
            if body.seq_id is not None:
                x.seen[body.seq_id] = answer
                if len(x.seen) > 2 * SEEN_KEPT:  # retries follow their first POST closely: the oldest can go
                    x.seen = dict(list(x.seen.items())[-SEEN_KEPT:])
            x.inflight += 1  # from here on, whatever raises, `done` answers the future and lets x go
            self._sampling[tenant] += 1
        if x.model_id is not None:  # the model is about to train (the scheduler's `gather`)
            self.scheduler.sampling(x.model_id, 1)
        answered, recording = [], []  # recording: the sample's prompt, when it is recorded

        def done(result) -> None:  # once, whoever calls it (the backend, or a failure below)
            with self._lock:
                if answered:
                    return
                answered.append(True)
            if recording and not isinstance(result, BackendError):
                result = self._record(x, rid, recording[0], result)
            if isinstance(result, BackendError):
                self._answer(rid, Outcome(error=result.message, category=result.category, retry=result.retryable))
            else:
                self._answer(rid, Outcome(result=result))
            self.usage.sampled(tenant, None if isinstance(result, BackendError) else result)
            with self._lock:
                x.inflight -= 1
                self._sampling[tenant] -= 1
            if x.model_id is not None:
                self.scheduler.sampling(x.model_id, -1)
            self._maybe_release(x)

        seed_parts = (x.id, body.seq_id if body.seq_id is not None else rid)
        try:
            call = build_sample_call(body, x.ref, self.caps, self.cfg.max_num_samples, derive_seed(0, *seed_parts))
        except wire.InputError as e:
            done(BackendError(str(e), "user"))
            return answer
        except Exception as e:
            log.exception("building a sample call failed")
            done(BackendError(f"{type(e).__name__}: {e}", "server"))
            return answer
        if body.record_stability_info:
            recording.append(call.prompt)
        try:
            self.backend.sample(call, done)
        except Exception as e:
            log.exception("the backend refused a sample")
            done(BackendError(f"{type(e).__name__}: {e}", "server"))
        return answer

    def _record(self, x: Sampler, request_id: str, prompt, result):
        """The finished sample recorded for stable_reinforce: `result`, or the BackendError it fails with."""
        try:
            with self._lock:  # a session that has ended takes no new records (end_session drops its own after)
                s = self.sessions.get(x.session_id)
                if s is not None and not s.ended:
                    self.records.record(x.tenant, x.session_id, request_id, prompt,
                                        [(q.tokens, q.logprobs) for q in result.sequences])
        except RecordError as e:
            return BackendError(str(e), "user")
        except ValueError as e:  # the engine's answer cannot be recorded
            return BackendError(str(e), "server")
        return result
