"""The FastAPI application: routes, error handlers, and the middleware every request passes through."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from kvfree.engine.async_engine import AsyncEngine
from kvfree.engine.llm import LLM
from kvfree.server import openai_api, ops_api, sessions_api
from kvfree.server.auth import APIKeys, require_api_key
from kvfree.server.errors import BodySizeLimitMiddleware, install_error_handlers
from kvfree.server.generation import ServerState
from kvfree.server.metrics import Metrics
from kvfree.server.schemas import new_id
from kvfree.server.settings import ServerSettings

log = logging.getLogger("kvfree.server")


def build_engine(settings: ServerSettings) -> AsyncEngine:
    """Load the checkpoint and wrap it in an (unstarted) AsyncEngine sized by `settings`."""
    llm = LLM(
        settings.model,
        device=settings.device,
        dtype=settings.dtype,
        max_sessions=settings.max_sessions,
        max_context=settings.max_context,
        config_overrides=settings.config_overrides,
    )
    return AsyncEngine(
        llm,
        max_waiting=settings.max_waiting,
        max_batch_tokens=settings.max_batch_tokens,
        max_host_sessions=settings.max_host_sessions,
        snapshot_dir=settings.snapshot_dir,
        hmac_key=settings.snapshot_hmac_key,
    )


class RequestContextMiddleware:
    """Gives each request an id (the client's `X-Request-ID` or a new one), returns it in the response headers,
    counts the request in the metrics, and logs one line when the response is complete."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if given and len(given) <= 128 and given.isprintable() else new_id("req")
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = 500

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.count_request(route, status)
            usage = scope["state"].get("usage")
            tokens = f" prompt={usage[0]} completion={usage[1]} cached={usage[2]}" if usage else ""
            log.info(
                "%s %s %s %d %.1fms%s",
                request_id,
                scope["method"],
                scope["path"],
                status,
                1e3 * (time.perf_counter() - start),
                tokens,
            )


def create_app(settings: ServerSettings, engine: AsyncEngine | None = None) -> FastAPI:
    """The app for `settings`. The engine is built from them unless given; it starts and stops with the app."""
    engine = engine or build_engine(settings)
    keys = APIKeys.from_sources(settings.api_keys_file)
    metrics = Metrics()
    name = settings.served_model_name or _default_name(settings.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info(
            "serving %r (%s) on %s; %d state slots", name, engine.llm.model.device, settings.port, settings.max_sessions
        )
        yield
        log.info(
            "shutting down: finishing requests for up to %.0fs, then persisting sessions",
            settings.shutdown_grace_seconds,
        )
        await engine.shutdown(settings.shutdown_grace_seconds)

    app = FastAPI(
        title="kvfree",
        summary="OpenAI-compatible server for recurrent, KV-cache-free language models, with persistent sessions.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.kvfree = ServerState(engine=engine, settings=settings, metrics=metrics, model_name=name)
    owner = require_api_key(keys)
    app.include_router(openai_api.router(owner))
    app.include_router(sessions_api.router(owner))
    app.include_router(ops_api.api)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(RequestContextMiddleware, metrics=metrics)
    return app


def _default_name(model: Path | None) -> str:
    return "kvfree-default" if model is None else Path(model).resolve().name
