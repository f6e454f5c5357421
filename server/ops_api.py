"""Operations routes: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvfree.server.generation import state_of

api = APIRouter(tags=["Operations"])


@api.get("/health")
async def health() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@api.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 while the engine accepts work; 503 while starting or shutting down."""
    engine = state_of(request).engine
    if engine.accepting and engine.alive:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


@api.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics: requests, tokens, latencies, sessions by location, pool slots, state bytes, GPU memory."""
    state = state_of(request)
    state.metrics.update_engine(state.engine.stats())
    body, content_type = state.metrics.render()
    return Response(content=body, media_type=content_type)
