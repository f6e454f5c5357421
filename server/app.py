"""The FastAPI application: the engine, the routers, the error handlers and the middlewares, put together."""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from kvfree.engine.protocol import EngineConfig
from kvfree.engine.serving.process_driver import ProcessDriver
from kvfree.engine.serving.thread_driver import ThreadDriver
from kvfree.server import routes_openai, routes_ops, routes_responses, routes_sessions
from kvfree.server.auth import APIKeys
from kvfree.server.errors import install_error_handlers
from kvfree.server.lifecycle import EngineClient
from kvfree.server.metrics import Metrics
from kvfree.server.middleware import BodySizeLimitMiddleware, RequestContextMiddleware
from kvfree.server.responses import ResponseStore
from kvfree.server.settings import ServerSettings
from kvfree.server.state import ServerState
from kvfree.server.unicode_check import UnicodeCheckMiddleware

log = logging.getLogger("kvfree.server")


def engine_config(settings: ServerSettings) -> EngineConfig:
    """What the engine needs of the server's settings."""
    return EngineConfig(
        model=settings.model, device=settings.device, dtype=settings.dtype, max_sessions=settings.max_sessions,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_context=settings.max_context, config_overrides=settings.config_overrides,
        enforce_eager=settings.enforce_eager, tensor_parallel_size=settings.tensor_parallel_size,
        kv_cache_dtype=settings.kv_cache_dtype,
        max_waiting=settings.max_waiting,
        max_batch_tokens=settings.max_batch_tokens, max_prefill_tokens=settings.max_prefill_tokens,
        prefill_batch_wait=settings.prefill_batch_wait_ms / 1e3, max_host_sessions=settings.max_host_sessions,
        snapshot_dir=settings.snapshot_dir, hmac_key=settings.snapshot_hmac_key, session_store=settings.session_store,
        session_ttl_seconds=settings.session_ttl_seconds, session_lease_seconds=settings.session_lease_seconds,
        session_write=settings.session_write, prefix_cache=settings.prefix_cache,
        prefix_cache_bytes=settings.prefix_cache_bytes,
    )  # fmt: skip


def build_driver(
    settings: ServerSettings, on_engine_death: Callable[[], None] | None = None
) -> ThreadDriver | ProcessDriver:
    """Load the checkpoint into an (unstarted) engine sized by `settings`: in a process of its own (the default), or
    on a thread of this one (`settings.engine_process` False)."""
    config = engine_config(settings)
    if settings.engine_process:
        return ProcessDriver(config, on_death=on_engine_death)
    return ThreadDriver.build(config)


def create_app(
    settings: ServerSettings,
    engine: ThreadDriver | ProcessDriver | None = None,
    on_engine_death: Callable[[], None] | None = None,
) -> FastAPI:
    """The app for `settings`. The engine is built from them unless given; it starts and stops with the app.

    on_engine_death: called when an engine process dies while serving (`kvfree serve` then exits); until the app
    stops, /health answers 503 and requests get 503.
    """
    engine = engine or build_driver(settings, on_engine_death)
    keys = APIKeys.from_sources(settings.api_keys_file)
    name = settings.served_model_name or _default_name(settings.model)
    metrics = Metrics(model_name=name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info(
            "serving %r (%s) on %s; %d state slots of %.1f MiB (%d tokens of context)", name, engine.info.device,
            settings.port, engine.info.gpu_slots, engine.info.state_bytes_per_session / 2**20, engine.info.max_context,
        )
        yield
        log.info(
            "shutting down: finishing requests for up to %.0fs, then persisting sessions",
            settings.shutdown_grace_seconds,
        )
        await engine.shutdown(settings.shutdown_grace_seconds)
        app.state.kvfree.snapshot_files.close()

    app = FastAPI(
        title="kvfree",
        summary="OpenAI-compatible server for recurrent, KV-cache-free language models, with persistent sessions.",
        version="0.1.0",
        lifespan=lifespan,
    )
    # Stored responses go to the session store too (when there is one), beside the states of their sessions.
    responses = ResponseStore(engine.session_store)
    client = EngineClient(engine, metrics, settings.max_prompt_tokens, engine.tokenizer)
    # The server's one tokenizer (prompts, templates, and the text of the engine's token ids): the engine's own while
    # both share a process, the front's copy of the checkpoint's (`Tokenizer(info.checkpoint)`) otherwise.
    app.state.kvfree = ServerState(client, engine.tokenizer, settings, metrics, name, responses)
    app.state.api_keys = keys
    app.include_router(routes_openai.router)
    app.include_router(routes_responses.router)
    app.include_router(routes_sessions.router)
    app.include_router(routes_ops.router)
    app.include_router(routes_ops.tokens_router)
    install_error_handlers(app)
    # Inside the size limit: it reads bodies already bounded. A snapshot upload passes both unread: its route checks
    # the header as soon as it has arrived and writes the rest out as it comes, counted against the limit.
    streamed = {routes_sessions.RESTORE_PATH: settings.max_body_bytes}
    app.add_middleware(UnicodeCheckMiddleware, stream_paths=streamed)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes, path_limits=streamed)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"], allow_headers=["*"]
        )
    app.add_middleware(RequestContextMiddleware, metrics=metrics, replica=settings.replica)
    return app


def _default_name(model: Path | None) -> str:
    return "kvfree-default" if model is None else Path(model).resolve().name
