"""Checkpoints: saves and exports in a model's seq order under the tenant's quotas, the RestClient's
listing, deletes and TTLs, automatic pruning and expiry.

A save is checked against the tenant's `checkpoints` and `disk_bytes` quotas when it is posted (a 403
that still takes its seq_id slot) and again in its turn, when the saves queued before it have landed.
An unnamed save_weights (`automatic`) keeps the model's newest `keep_checkpoints` unnamed ones; a save
with `ttl_seconds` is deleted by the reaper once they pass (unless a live sampler reads it: then at the
next reap after that sampler is released); `set_checkpoint_ttl` gives any checkpoint a new one. An export
(`save_weights_external`, what `tinker checkpoint download` fetches) is the backend's sampler format
written as a checkpoint of kind external_weights: listed, counted, expired and deleted like the others.
A model that no longer lives loses its folder (its record, run.json) with its last checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

from colora.service import schemas
from colora.service.backend import Backend, BackendError
from colora.service.errors import ApiError, limit_error
from colora.service.scheduler import barrier_work
from colora.service.state import Model, Sampler
from colora.service.store import CheckpointError, CheckpointPath, check_name, parse_path

log = logging.getLogger("colora.service")
SET_TTL_RANGE = (3600, schemas.TTL_MAX)  # Tinker's, for a TTL set after the save: one hour to ten years


class CheckpointOps:
    """The checkpoint half of `Service` (colora/service/service.py), whose state it uses: `store`, `models`,
    `samplers`, `_lock`, `cfg`, `_model`, `_submit`, `fail_in_slot`, `_sampler_quota`, `_add_sampler`."""

    def _disk_quota(self, tenant: str, cp: CheckpointPath) -> ApiError | None:
        """The refusal of a save of `cp` by the tenant's checkpoints or disk_bytes quota, or None."""
        lim = self.cfg.limits_of(tenant)
        count, nbytes = self.store.usage(tenant)
        if count >= lim.checkpoints and not self.store.holds(tenant, cp):
            return limit_error(403, tenant, "checkpoints", lim.checkpoints, count, "checkpoints on disk",
                               "delete some (RestClient.delete_checkpoint) before saving another")
        if nbytes >= lim.disk_bytes:
            return limit_error(403, tenant, "disk_bytes", lim.disk_bytes, nbytes, "bytes of checkpoints on disk",
                               "delete some (RestClient.delete_checkpoint) before saving another")
        return None

    def _save(self, tenant: str, m: Model, seq_id: int, route: str, cp: CheckpointPath, write) -> dict:
        """Queues a checkpoint save (write(backend) -> result) in the model's seq order, under the quotas
        (checked at the POST and again in its turn, when earlier saves have landed)."""
        refusal = self._disk_quota(tenant, cp)
        if refusal is not None:
            return self.fail_in_slot(tenant, m.id, seq_id, route, refusal.message, refusal)

        def save(b: Backend) -> dict:
            late = self._disk_quota(tenant, cp)
            if late is not None:
                raise BackendError(late.message, "user")
            return write(b)

        return self._submit(tenant, m.id, lambda rid: barrier_work(rid, m.id, seq_id, route, save), route)

    def save_weights(self, tenant: str, body: schemas.SaveWeights) -> dict:
        m = self._model(tenant, body.model_id)
        try:
            cp = CheckpointPath(m.id, "weights", check_name(body.path or f"seq-{body.seq_id}"))
        except CheckpointError as e:
            return self.fail_in_slot(tenant, m.id, body.seq_id, "save_weights", str(e))

        def write(b: Backend) -> dict:
            _user(lambda: self.store.write(tenant, cp, m.base_model, m.spec, lambda d: b.save_state(m.id, d, True),
                                           overwrite=body.overwrite, seq_id=body.seq_id, optimizer=True,
                                           ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata,
                                           automatic=body.path is None))
            if body.path is None:
                for gone in self.store.prune_automatic(tenant, m.id, self.cfg.keep_checkpoints):
                    log.info("checkpoint %s of tenant %s deleted: keep_checkpoints keeps the newest %d unnamed "
                             "ones of a model", gone, tenant, self.cfg.keep_checkpoints)
            return {"type": "save_weights", "path": str(cp)}

        return self._save(tenant, m, body.seq_id, "save_weights", cp, write)

    def save_weights_for_sampler(self, tenant: str, body: schemas.SaveWeightsForSampler) -> dict:
        m = self._model(tenant, body.model_id)
        if body.path is not None:
            try:
                cp = CheckpointPath(m.id, "sampler_weights", check_name(body.path))
            except CheckpointError as e:
                return self.fail_in_slot(tenant, m.id, body.seq_id, "save_weights_for_sampler", str(e))

            def write(b: Backend) -> dict:
                self._write_sampler(b, tenant, m, cp, seq_id=body.seq_id, ttl_seconds=body.ttl_seconds,
                                    user_metadata=body.user_metadata)
                return {"type": "save_weights_for_sampler", "path": str(cp)}

            return self._save(tenant, m, body.seq_id, "save_weights_for_sampler", cp, write)
        if body.sampling_session_seq_id is None:
            return self.fail_in_slot(tenant, m.id, body.seq_id, "save_weights_for_sampler", "save_weights_for_sampler "
                                     "needs a path (a named checkpoint) or a sampling_session_seq_id (an ephemeral "
                                     "sampler)")
        sid = f"{m.session_id}:sample:{body.sampling_session_seq_id}"
        refusal = self._sampler_quota(tenant, m.id)
        if refusal is not None:
            return self.fail_in_slot(tenant, m.id, body.seq_id, "save_weights_for_sampler", refusal.message, refusal)

        def snapshot(b: Backend) -> dict:
            ref = b.save_for_sampler(m.id, None)
            if not self._add_sampler(Sampler(sid, tenant, m.session_id, m.base_model, None, ref, model_id=m.id)):
                b.release_sampler(ref)
                raise BackendError(f"sampling_session_seq_id {body.sampling_session_seq_id} is taken in this "
                                   "session, or the session ended", "user")
            return {"type": "save_weights_for_sampler", "path": None, "sampling_session_id": sid}

        return self._submit(tenant, m.id, lambda rid: barrier_work(rid, m.id, body.seq_id, "snapshot", snapshot),
                            "save_weights_for_sampler")

    def save_weights_external(self, tenant: str, body: schemas.SaveWeightsExternal) -> dict:
        """Exports the model's adapter in its seq_id turn, as a named save_weights_for_sampler to
        `tinker://<model_id>/external_weights/<name>` (an export of the same name is replaced); one that
        cannot run still takes its slot."""
        m, route = self._model(tenant, body.model_id), "save_weights_external"
        if body.seq_id is None:
            raise ApiError(400, "save_weights_external needs its seq_id (the SDK sends one)")
        if body.age_encryption_recipients:
            return self.fail_in_slot(tenant, m.id, body.seq_id, route, "age_encryption_recipients: encrypted exports "
                                     "are not served here; export without them")
        try:
            cp = CheckpointPath(m.id, "external_weights", check_name(body.path))
        except CheckpointError as e:
            return self.fail_in_slot(tenant, m.id, body.seq_id, route, str(e))

        def write(b: Backend) -> dict:
            self._write_sampler(b, tenant, m, cp, seq_id=body.seq_id, ttl_seconds=body.ttl_seconds)
            return {"type": route, "path": str(cp), "size_bytes": self.store.size(tenant, cp)}

        return self._save(tenant, m, body.seq_id, route, cp, write)

    def _write_sampler(self, b: Backend, tenant: str, m: Model, cp: CheckpointPath, **meta) -> None:
        """Writes the model's sampler files as checkpoint `cp` (replacing one of that name); `meta` as in
        `Store.write`."""
        refs = []
        _user(lambda: self.store.write(tenant, cp, m.base_model, m.spec, lambda d: refs.append(b.save_for_sampler(m.id, d)),
                                       overwrite=True, **meta))
        for r in refs:  # a sampling session loads the folder when it needs it
            b.release_sampler(r)

    def _run(self, tenant: str, model_id: str) -> dict:
        run = _found(lambda: self.store.read_run(tenant, model_id))
        if run is None:
            raise ApiError(404, f"training run {model_id!r} not found")
        return run

    def checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> tuple[CheckpointPath, Path, dict]:
        """The tenant's checkpoint `<kind>/<name>` of run `model_id`: (parts, folder, tinker.json); 404 otherwise."""
        return _found(lambda: self.store.find(tenant, f"tinker://{model_id}/{checkpoint_id}", field="checkpoint"))

    def set_checkpoint_ttl(self, tenant: str, model_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        """The checkpoint expires `ttl_seconds` from now (None: never), whatever its kind."""
        lo, hi = SET_TTL_RANGE
        if ttl_seconds is not None and not lo <= ttl_seconds <= hi:
            raise ApiError(400, f"ttl_seconds ({ttl_seconds}) must be from {lo} (one hour) to {hi} (ten years), "
                                "or null for none")
        _found(lambda: self.store.set_ttl(tenant, f"tinker://{model_id}/{checkpoint_id}", ttl_seconds))

    def list_checkpoints(self, tenant: str, model_id: str) -> dict:
        self._run(tenant, model_id)
        return {"checkpoints": self.store.list(tenant, model_id), "cursor": None}

    def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        self._run(tenant, model_id)
        _found(lambda: self._delete(tenant, model_id, checkpoint_id, "deleted by its owner"))

    def _delete(self, tenant: str, model_id: str, checkpoint_id: str, why: str) -> None:
        """Deletes a checkpoint (CheckpointError if it is not there); a model that no longer lives loses its
        folder with its last checkpoint."""
        cp = self.store.delete(tenant, model_id, checkpoint_id)
        log.info("checkpoint %s of tenant %s %s", cp, tenant, why)
        if model_id not in self.models:
            self.store.forget_model(tenant, model_id)

    def training_run(self, tenant: str, model_id: str) -> dict:
        self._run(tenant, model_id)
        return self.store.training_run(tenant, model_id)

    def list_training_runs(self, tenant: str, limit: int, offset: int) -> dict:
        """The tenant's runs, newest first, from `offset`."""
        ids = self.store.runs(tenant)
        return {"training_runs": [self.store.training_run(tenant, mid) for mid in ids[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}

    def list_user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict:
        """Every checkpoint of the tenant's runs, newest first, from `offset`."""
        cps = sorted((c for mid in self.store.runs(tenant) for c in self.store.list(tenant, mid)),
                     key=lambda c: c["time"], reverse=True)
        return {"checkpoints": cps[offset:offset + limit],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(cps)}}

    def weights_info(self, tenant: str, tinker_path: str) -> dict:
        """The base model and LoRA settings of the checkpoint at `tinker_path` (400: not a checkpoint path); a
        full-parameter model's is not LoRA and has no rank."""
        try:
            parse_path(tinker_path, "tinker_path")
        except CheckpointError as e:
            raise ApiError(400, str(e)) from None
        _, _, meta = _found(lambda: self.store.find(tenant, tinker_path, field="tinker_path"))
        lora = meta["lora"]
        if lora is None:
            return {"base_model": meta["base_model"], "is_lora": False, "lora_rank": None}
        return {"base_model": meta["base_model"], "is_lora": True, "lora_rank": lora["rank"],
                "train_unembed": lora["train_unembed"], "train_mlp": lora["train_mlp"], "train_attn": lora["train_attn"]}

    def _expire(self) -> None:
        with self._lock:
            in_use = {x.model_path for x in self.samplers.values() if x.model_path}
        for tenant, cp in self.store.expired():
            if str(cp) in in_use:
                continue  # a live sampler reads it: deleted once that sampler is released
            try:
                self._delete(tenant, cp.model_id, cp.checkpoint_id, "expired (its ttl_seconds passed): deleted")
            except CheckpointError:
                continue  # deleted meanwhile


def _user(fn):
    """Runs fn on the trainer thread; a CheckpointError (a bad name, an absent checkpoint) is the client's error."""
    try:
        return fn()
    except CheckpointError as e:
        raise BackendError(str(e), "user") from None


def _found(fn):
    """Runs fn for a route; a CheckpointError (a bad path, an absent checkpoint) is a 404 naming it."""
    try:
        return fn()
    except CheckpointError as e:
        raise ApiError(404, str(e)) from None
