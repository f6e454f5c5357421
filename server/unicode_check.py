"""Refuse JSON bodies whose text is not valid Unicode (a lone UTF-16 surrogate) with a 400 naming the field.

JSON may spell any UTF-16 code unit as an escape, so `"\\ud83d"` parses into a Python string holding half of a
surrogate pair. Such a string cannot be encoded as UTF-8: the tokenizer, a JSON encoder writing a stored response,
or a session store fails on it deep inside a route (a 500, or a stream cut off). Checking every body once, here,
before any route runs, covers every route, including those added later. Valid pairs (`"\\ud83d\\ude00"`) are joined
by the JSON parser and pass.

The check costs one byte search per JSON body; only a body that spells a surrogate escape is parsed here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from kvfree.server.errors import invalid_request
from kvfree.server.middleware import read_body, replay_body

# `\uD800` to `\uDFFF`, any case: the only way a surrogate code unit can appear in a JSON body that is valid UTF-8.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF][0-9a-fA-F]{2}")


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Where in a parsed JSON `value` the first string (or key) holding a lone surrogate is, as a request field
    (`messages[0].content`; `body` for the whole body), or None when every string is valid Unicode."""
    if isinstance(value, str):
        return None if _encodes(value) else (path or "body")
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}[{i}]")
            if found is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            field = f"{path}.{key}" if path else str(key)
            if not _encodes(key):
                return path or "body"
            found = lone_surrogate_path(item, field)
            if found is not None:
                return found
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class UnicodeCheckMiddleware:
    """Pure ASGI middleware: a 400 in OpenAI's shape (code `invalid_unicode`, `param` the field) for a JSON body
    holding a lone surrogate; every other request passes through unchanged (its body replayed).

    `stream_paths`: exact paths whose routes read a binary body as it arrives (a snapshot upload): their requests
    pass through unread, whatever content type the client sent (none, with some clients, which would otherwise
    count as JSON and be buffered whole here).
    """

    def __init__(self, app: ASGIApp, stream_paths: Collection[str] = ()) -> None:
        self.app = app
        self.stream_paths = frozenset(stream_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") not in ("POST", "PUT", "PATCH")
            or scope.get("path") in self.stream_paths
            or not _maybe_json(scope)
        ):
            await self.app(scope, receive, send)  # a snapshot upload's megabytes are neither held nor searched
            return
        body = await read_body(receive)
        if body is None:
            return  # the client went away before sending its body: nothing to answer
        path = _bad_field(body) if _SURROGATE_ESCAPE.search(body) else None
        if path is not None:
            error = invalid_request(
                f"{path} is not valid Unicode: it holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff alone); "
                "send the text as UTF-8, and a character beyond U+FFFF as a surrogate pair",
                param=path,
                code="invalid_unicode",
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, replay_body(body, receive), send)


def _maybe_json(scope: Scope) -> bool:
    """Whether the body may be parsed as JSON by a route: a JSON content type, or none (FastAPI reads it as JSON)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return b"json" in value.lower()
    return True


def _bad_field(body: bytes) -> str | None:
    try:
        parsed = json.loads(body)
    except ValueError:
        return None  # not JSON (a snapshot upload) or malformed: the route answers as it would
    return lone_surrogate_path(parsed)
