"""The live dashboard: ``GET /`` a self-contained page, ``GET /api/stats`` the numbers it draws.

The page (serve/static: index.html, dashboard.js, dashboard.css, shipped as package data) loads nothing
from elsewhere — no CDN, no fonts; a Content-Security-Policy header holds it to its own origin. It polls
/api/stats every second and draws the tiers, the I/O rates, the requests and the expert heat map (a
canvas: MoE layers x routed experts, colour by request count, RAM/VRAM residents and pinned experts
marked). The JSON shape is documented in serve/live_stats.py.

The page is served openly; /api/stats is authenticated like /v1 when API keys are set, and names only
the caller's own sessions (a keyed session's name starts with its ``user`` text). The page then asks
for a key once and keeps it in sessionStorage (this tab only), sending it as ``Authorization: Bearer``.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Any, Protocol

from fastapi import FastAPI, Request, Response

from colibri_stream.runtime.turn import Runtime
from colibri_stream.serve.live_stats import RateWindow, experts_json, residency_json, tier_json
from colibri_stream.serve.model_thread import Admission, ModelThread

STATIC = {  # URL path -> (file in serve/static, media type); nothing else is served from there
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
PAGE_HEADERS = {
    "content-security-policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "cache-control": "no-cache",
}


def static_bytes(name: str) -> bytes:
    return resources.files("colibri_stream.serve").joinpath("static", name).read_bytes()


class Server(Protocol):
    """What the dashboard reads of serve.app.Server (which registers these routes, so no import of it)."""

    runtime: Runtime
    model_thread: ModelThread
    slots: int
    admission: Admission | None

    def authenticate(self, request: Request) -> bytes | None: ...


class Dashboard:
    """Builds /api/stats from the server's store, model thread and admission."""

    def __init__(self, server: Server):
        self.server = server
        self.started = time.monotonic()
        self.window = RateWindow()

    def stats(self, viewer: bytes | None = None) -> dict[str, Any]:
        """``viewer``: the caller's API key; with keys set, sessions of other keys are left out."""
        server = self.server
        store = server.runtime.loaded.experts
        counters = store.snapshot()
        tiers = store.tiers()
        layers = store.routed.layers
        active = visible_activity(server.model_thread, viewer)
        admission = server.admission
        return {
            "model": server.runtime.model_id,
            "uptime_s": round(time.monotonic() - self.started, 3),
            "tiers": [tier_json(tier, counters) for tier in tiers],
            "experts": experts_json(counters),
            "io": self.window.rates(counters),
            "counters": dict(vars(server.model_thread.counters)),
            "queue": {
                "slots": server.slots,
                "busy": admission.busy if admission else 0,
                "queued": admission.waiting if admission else 0,
            },
            "active": active,
            "decode_tok_per_s": round(sum(a["decode_tok_per_s"] for a in active), 3),
            "heat": store.routed.table(),
            "heat_layers": list(layers),
            "resident": residency_json(tiers, layers),
            # a spread container's devices since the store opened (reads, bytes, busy s, MB/s, fallbacks)
            "devices": store.report().get("devices", []),
        }


def visible_activity(model_thread: ModelThread, viewer: bytes | None) -> list[dict[str, Any]]:
    """The requests being generated, as ``viewer`` may see them: a keyed session's name starts with its
    ``user`` text, so a request of another key shows its numbers with ``session`` null."""
    active = []
    for running in list(model_thread.running.values()):
        progress = running.job.progress()
        if running.job.owner != viewer:
            progress["session"] = None
        active.append(progress)
    return active


def add_dashboard_routes(app: FastAPI, server: Server) -> Dashboard:
    """``GET /``, its two assets and ``GET /api/stats`` on ``app``."""
    dashboard = Dashboard(server)
    for path, (name, media_type) in STATIC.items():
        app.add_api_route(path, _static_route(static_bytes(name), media_type), methods=["GET"], include_in_schema=False)

    @app.get("/api/stats", include_in_schema=False)
    async def api_stats(request: Request) -> dict[str, Any]:
        return dashboard.stats(server.authenticate(request))

    return dashboard


def _static_route(body: bytes, media_type: str):
    async def serve_asset() -> Response:
        return Response(body, media_type=media_type, headers=PAGE_HEADERS)

    return serve_asset
