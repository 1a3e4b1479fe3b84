"""`GET /metrics`: the service's figures in Prometheus' text format, read from `Service.snapshot`.

    curl -H "X-API-Key: $KEY" http://127.0.0.1:8000/metrics

What a key sees: the admin key every tenant's series (label `tenant`) and the server's; a tenant's key
its own tenant's series and, of the server, its uptime and the engine's health (the trainer's and
the sessions' sums are the operator's). A scraper uses one key, so a tenant can scrape its own usage
and the operator the whole server. Any other key is a 401 with the service's error body.

Counters (`_total`) count from the server's start; gauges are the value now. The exposition is built
per scrape from one snapshot with `prometheus_client`'s metric families, in a registry of its own (the
process-wide default registry is left alone: tests start many apps in one process).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from colora.service.app import request_is_admin, request_tenant

ServiceOf = Callable[[Request], Any]  # the object with `snapshot(tenant | None) -> dict`

# (snapshot key, metric name, help); a counter's exposed name gains `_total`
TENANT_COUNTERS = [
    ("requests", "colora_tenant_requests", "API requests the tenant sent"),
    ("errors", "colora_tenant_errors", "requests of the tenant answered with an error"),
    ("forward_calls", "colora_tenant_forward_calls", "forward and forward_backward calls run"),
    ("forward_datums", "colora_tenant_forward_datums", "datums in the forward calls run"),
    ("trained_tokens", "colora_tenant_trained_tokens", "tokens of the datums in the forward calls run"),
    ("optim_steps", "colora_tenant_optim_steps", "optimizer steps taken"),
    ("samples", "colora_tenant_samples", "sample requests answered"),
    ("sampled_sequences", "colora_tenant_sampled_sequences", "sequences sampled"),
    ("sampled_tokens", "colora_tenant_sampled_tokens", "tokens sampled"),
]
TENANT_GAUGES = [
    ("sessions", "colora_tenant_sessions", "live sessions"),
    ("models", "colora_tenant_models", "live training models (LoRA adapters)"),
    ("samplers", "colora_tenant_samplers", "live sampling sessions"),
    ("queue_depth", "colora_tenant_queue_depth", "requests queued for the trainer, not yet run"),
    ("pending_bytes", "colora_tenant_pending_bytes", "bytes of the queued requests' bodies"),
    ("disk_bytes", "colora_tenant_disk_bytes", "bytes of the tenant's checkpoints on disk"),
    ("checkpoints", "colora_tenant_checkpoints", "checkpoints of the tenant on disk"),
    ("samples_in_flight", "colora_tenant_samples_in_flight", "sample requests accepted and not yet answered"),
    ("recorded_sequences", "colora_tenant_recorded_sequences",
     "sampled sequences recorded for stable_reinforce (record_stability_info)"),
    ("recorded_bytes", "colora_tenant_recorded_bytes", "bytes of the tokens and log-probs of those records"),
]
SERVER_COUNTERS = [
    ("cycles", "colora_trainer_cycles", "trainer cycles that did work"),
    ("cycle_seconds_sum", "colora_trainer_cycle_seconds", "seconds the trainer spent in its cycles"),
    ("cycle_models_sum", "colora_trainer_cycle_models",
     "models summed over cycles (divided by cycles: models per cycle)"),
    ("multi_model_cycles", "colora_trainer_multi_model_cycles", "cycles that held more than one model"),
]
SERVER_GAUGES = [
    ("uptime_s", "colora_uptime_seconds", "seconds since the server started"),
    ("last_cycle_seconds", "colora_trainer_last_cycle_seconds", "seconds of the trainer's last cycle"),
    ("live_sessions", "colora_live_sessions", "live sessions of every tenant"),
    ("live_models", "colora_live_models", "live training models of every tenant"),
    ("live_samplers", "colora_live_samplers", "live sampling sessions of every tenant"),
    ("futures_pending", "colora_futures_pending", "futures not yet answered"),
]
HEALTH_COUNTERS = [("engine_restarts", "colora_engine_restarts", "times the engine was restarted")]
HEALTH_GAUGES = [
    ("samplers_loaded", "colora_engine_samplers_loaded", "samplers the engine holds"),
    ("engine_requests_in_flight", "colora_engine_requests_in_flight", "sample requests inside the engine"),
    ("gpu_memory_bytes", "colora_gpu_memory_bytes", "GPU memory in use by the service's process"),
]
HEALTH_STATES = ("ok", "degraded", "restarting")
TENANT_SERVER_KEYS = ("uptime_s", "health")  # what a tenant's key sees of the server


def scope_of(request: Request) -> str | None:
    """Whose figures the caller may see: None for every tenant (an admin key of the server's config),
    else the key's tenant; any other key is a 401, as on every route of the API."""
    return None if request_is_admin(request) else request_tenant(request)


def default_service(request: Request) -> Any:
    return request.app.state.service


async def snapshot(request: Request, service: ServiceOf, scope: str | None) -> dict:
    """The service's snapshot for `scope`, read off the event loop, holding only what the scope may see
    whatever the service returned (tenancy does not rest on it alone): a tenant's own entry and errors,
    and of the server its uptime and health."""
    snap = await asyncio.to_thread(service(request).snapshot, scope)
    if scope is None:
        return snap
    return {"tenants": {scope: snap["tenants"][scope]} if scope in snap["tenants"] else {},
            "server": {k: snap["server"][k] for k in TENANT_SERVER_KEYS},
            "errors": [e for e in snap["errors"] if e.get("tenant") == scope]}


def families(snap: dict) -> list[Metric]:
    """The metric families of one snapshot: every tenant in it, and the server's figures it holds (a
    tenant's scope holds only uptime and health)."""
    out: list[Metric] = []
    tenants = snap["tenants"]
    for specs, cls in ((TENANT_COUNTERS, CounterMetricFamily), (TENANT_GAUGES, GaugeMetricFamily)):
        for key, name, doc in specs:
            fam = cls(name, doc, labels=["tenant"])
            for tenant, t in sorted(tenants.items()):
                fam.add_metric([tenant], float(t[key]))
            out.append(fam)
    server, health = snap["server"], snap["server"]["health"]
    for src, specs, cls in ((server, SERVER_COUNTERS, CounterMetricFamily), (server, SERVER_GAUGES, GaugeMetricFamily),
                            (health, HEALTH_COUNTERS, CounterMetricFamily), (health, HEALTH_GAUGES, GaugeMetricFamily)):
        out += [cls(name, doc, value=float(src[key])) for key, name, doc in specs if key in src]
    status = GaugeMetricFamily("colora_engine_status", "1 for the engine's state now (ok, degraded, restarting), "
                               "0 for the others", labels=["status"])
    for state in sorted({*HEALTH_STATES, health["status"]}):
        status.add_metric([state], 1.0 if state == health["status"] else 0.0)
    out.append(status)
    full = server.get("full_engines") or {}
    if full:
        status = GaugeMetricFamily("colora_full_engine_status", "1 for a full-parameter model's engine's state now, 0 "
                                   "for the others", labels=["model", "status"])
        restarts = CounterMetricFamily("colora_full_engine_restarts", "times a full-parameter model's engine was "
                                       "restarted", labels=["model"])
        for model_id, h in sorted(full.items()):
            for state in sorted({*HEALTH_STATES, h["status"]}):
                status.add_metric([model_id, state], 1.0 if state == h["status"] else 0.0)
            restarts.add_metric([model_id], float(h.get("engine_restarts", 0)))
        out += [status, restarts]
    return out


class _Snapshot:
    """A collector over one snapshot, for a registry of one scrape."""

    def __init__(self, snap: dict):
        self._snap = snap

    def collect(self):
        return families(self._snap)


def exposition(snap: dict) -> bytes:
    """The Prometheus text format (version 0.0.4) of one snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(snap))
    return generate_latest(registry)


def install(app: FastAPI, service: ServiceOf | None = None) -> None:
    """Adds `GET /metrics` to an app of `colora.service.app.create_app` (which holds the keys in
    `app.state.config`). `service(request)` gives the object whose `snapshot(tenant | None)` is read:
    the app's Service unless a test gives another."""
    service = service or default_service

    @app.get("/metrics")
    async def metrics(request: Request):
        body = exposition(await snapshot(request, service, scope_of(request)))
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
