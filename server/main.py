"""`kvfree serve`: run the app under uvicorn, with graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import logging

import uvicorn

from server.app import create_app
from server.settings import ServerSettings


def serve(settings: ServerSettings) -> None:
    """Load the model and serve until SIGTERM/SIGINT; then finish or cancel requests within the grace period and
    persist sessions (to `snapshot_dir`, when set)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        access_log=False,  # RequestContextMiddleware logs one line per request, with its id and token counts
        timeout_graceful_shutdown=max(1, int(settings.shutdown_grace_seconds)),
    )
    uvicorn.Server(config).run()
