"""`kvfree serve`: run the app under uvicorn, with graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

import uvicorn

from kvfree.server.app import create_app
from kvfree.server.settings import ServerSettings

ENGINE_DEATH_EXIT_DELAY_S = 1.0


def serve(settings: ServerSettings) -> int:
    """Load the model and serve until SIGTERM/SIGINT; then finish or cancel requests within the grace period and
    persist sessions (to `snapshot_dir`, when set). Returns the exit status: 0 after a clean stop, 1 when the engine
    process died (the server then stops by itself, a second after /health started answering 503)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: uvicorn.Server | None = None
    engine_died = False

    def stop_after_engine_death() -> None:
        nonlocal engine_died
        engine_died = True
        # A second of 503s from /health first, so that a load balancer's probe sees why this replica goes away.
        asyncio.get_running_loop().call_later(ENGINE_DEATH_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True))

    app = create_app(settings, on_engine_death=stop_after_engine_death)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,  # RequestContextMiddleware logs one line per request, with its id and token counts
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_seconds)),
    )
    server = uvicorn.Server(config)
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        server.run()
        return 1 if engine_died else 0
    # After its graceful shutdown uvicorn re-raises the signal it caught, so that the process dies of it (exit
    # status 143 / -15). Here finishing the requests and persisting the sessions is a clean stop: with this handler
    # in place the re-raised SIGTERM returns, and `kvfree serve` exits with status 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if engine_died else 0
