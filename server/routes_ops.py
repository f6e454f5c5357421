"""Operations routes: liveness, readiness, Prometheus metrics (no API key needed)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kvfree.server.generation import StateDep

router = APIRouter(tags=["Operations"])


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(state: StateDep) -> JSONResponse:
    """200 while the engine accepts work; 503 while starting or shutting down."""
    engine = state.engine
    if engine.accepting and engine.alive:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    """Prometheus metrics: requests, tokens, latencies, sessions by location, pool slots, state bytes, GPU memory."""
    state.metrics.update_engine(state.engine.stats())
    body, content_type = state.metrics.render()
    return Response(content=body, media_type=content_type)
