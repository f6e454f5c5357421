"""The ASGI middlewares every request passes through: request ids, metrics and the request log; the body limit."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfree.server.errors import payload_too_large
from kvfree.server.metrics import Metrics
from kvfree.server.protocol import new_id

log = logging.getLogger("kvfree.server")


class RequestContextMiddleware:
    """Gives each request an id (the client's `X-Request-ID` or a new one), returns it in the response headers
    with the replica's name (`X-Kvfree-Replica`, for load balancers and for debugging session affinity), counts
    the request in the metrics, and logs one line when the response is complete."""

    def __init__(self, app: ASGIApp, metrics: Metrics, replica: str = "") -> None:
        self.app = app
        self.metrics = metrics
        self.replica = replica.encode("latin-1", "replace")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if given and len(given) <= 128 and given.isprintable() else new_id("req")
        scope.setdefault("state", {})["request_id"] = request_id
        start = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (b"x-request-id", request_id.encode("latin-1")),
                    (b"x-kvfree-replica", self.replica),
                ]
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


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: 413 in OpenAI's shape when a request body is over `max_bytes`.

    A `Content-Length` over the limit is refused before anything is read. Otherwise the body is read here, up to
    the limit, and replayed to the app: a chunked upload that grows past the limit is refused without the app
    ever seeing it, and an app that has started to parse a body never has it cut off under its feet (which
    FastAPI would report as a 400). JSON bodies are small, so holding one in memory costs no more than the route
    reading it would.

    The paths in `path_limits` are streamed instead: their routes read the body as it arrives (a snapshot upload
    of tens of MB is checked from its header on and written out chunk by chunk, never held whole). Their `receive`
    counts the bytes as they pass and raises `BodyTooLarge` once they are over the path's limit; the exception
    ends the route, and this middleware answers the 413 (unless the route had started its response, which an
    uploading route does only once it has read its body).

    Args:
        app: the ASGI app to protect.
        max_bytes: the default limit.
        path_limits: exact request paths whose routes stream their bodies, with their limits.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: Mapping[str, int] | None = None) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        limit = self.path_limits.get(path, self.max_bytes)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await payload_too_large(limit).response()(scope, receive, send)
            return
        if path in self.path_limits:
            await self._streamed(scope, receive, send, limit)
            return
        try:
            body = await read_body(receive, limit)
        except BodyTooLarge:
            await payload_too_large(limit).response()(scope, receive, send)
            return
        if body is not None:  # (None: the client went away before sending its body, nothing to answer)
            await self.app(scope, replay_body(body, receive), send)

    async def _streamed(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        """Run the app on the live body, counted; the 413 when it grows past `limit`."""
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive(receive, limit), watched_send)
        except BodyTooLarge:
            if started:
                raise  # too late for a 413: the route answered before reading its whole body, and then read on
            await payload_too_large(limit).response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server (uvicorn, h11) rejects such requests before they get here
    return None


class BodyTooLarge(Exception):
    """A request body grew past the limit it was read with."""


async def read_body(receive: Receive, limit: float = math.inf) -> bytes | None:
    """The whole request body from `receive` (None when the client went away first); BodyTooLarge as soon as it
    grows past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def counted_receive(receive: Receive, limit: float) -> Receive:
    """`receive`, raising BodyTooLarge as soon as the body's bytes so far are over `limit`."""
    size = 0

    async def counted() -> Message:
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                raise BodyTooLarge
        return message

    return counted


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands out the buffered body once, then the real channel (for `http.disconnect`)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
