"""The status page of `colora serve`: what a person opens in a browser to see the server at work.

    http://127.0.0.1:8000/status#key=tml-...      (or open /status and type the key into its form)

`GET /status` (and `/`) answer the page itself, `colora/service/status.html`: plain HTML, CSS and a
little JavaScript, nothing fetched from elsewhere (the machines are offline). The page holds no data,
so it is served without a key. It takes the key from the URL's fragment (which never reaches the
server, and which the page then clears from the address bar) or from its form, keeps it in the tab's
sessionStorage, and every 2 s fetches `GET /api/v1/colora/status.json` with it as `X-API-Key`.

status.json is the service's snapshot (`Service.snapshot`) as the key may see it, with the scope it was
read for: the admin key every tenant and the whole server; a tenant's key its own tenant and errors,
and of the server its uptime and the engine's health (`colora/service/metrics.py`, `snapshot`). The
page shows the engine's health and restarts, the trainer's cycles, each tenant's sessions, models,
samplers, queue and counts, each model's recent losses as a small SVG plot, and the last errors.
"""

from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from colora.service.metrics import ServiceOf, default_service, scope_of, snapshot

STATUS_JSON = "/api/v1/colora/status.json"


def page() -> str:
    """The page's HTML (a data file of this package)."""
    return resources.files("colora.service").joinpath("status.html").read_text(encoding="utf-8")


def install(app: FastAPI, service: ServiceOf | None = None) -> None:
    """Adds `GET /`, `GET /status` and `GET /api/v1/colora/status.json` to an app of `create_app`;
    `service` as in `colora.service.metrics.install`."""
    service = service or default_service
    html = page()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    @app.get("/status", response_class=HTMLResponse)
    async def status_page():
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @app.get(STATUS_JSON)
    async def status_json(request: Request):
        scope = scope_of(request)
        snap = await snapshot(request, service, scope)
        return {"scope": "server" if scope is None else "tenant", "tenant": scope, "time": time.time(), **snap}
