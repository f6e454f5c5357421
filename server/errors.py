"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, whatever went wrong.

Route code raises `APIError` (usually through one of the helpers below); `install_error_handlers` turns that, and
everything FastAPI or Starlette raise on their own (validation errors, malformed JSON, unknown routes, crashes),
into the same JSON body, so OpenAI SDKs map every failure onto their usual exception classes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kvfree.server")

# Longest repr of an offending value quoted back in a message: enough to recognise it, never a whole prompt.
_MAX_INPUT_REPR = 80


# Not the `openai` package's `ErrorObject`: that one gains fields across releases (`misalignment`); every kvfree
# error sends exactly these four, documented.
class ErrorInfo(BaseModel):
    """The body of every error; the fields of OpenAI's error object."""

    message: str = Field(description="What went wrong, for a human.")
    type: str = Field(description="Error class, e.g. `invalid_request_error`, `server_error`.")
    param: str | None = Field(default=None, description="The request field at fault (e.g. `messages[0].content`).")
    code: str | None = Field(default=None, description="A machine-readable code, e.g. `invalid_value`.")


class ErrorResponse(BaseModel):
    """`{"error": {...}}`: what every non-2xx response carries."""

    error: ErrorInfo


class APIError(Exception):
    """An error to send to the client as-is. Raise it anywhere in a route; the installed handler renders it.

    Args:
        status: HTTP status code.
        message: human-readable explanation (shown by OpenAI SDKs as the exception message).
        type: OpenAI error type; `invalid_request_error` for anything the client can fix.
        param: the request field at fault, if any.
        code: machine-readable code.
        headers: extra response headers (e.g. `Retry-After`, `WWW-Authenticate`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers or None)

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


# -- helpers, one per status the server uses -------------------------------------------------------------------


def invalid_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    """400: a request the client must change (bad value, unknown model in the body, prompt too long...)."""
    return APIError(400, message, param=param, code=code)


def prompt_too_long(num_tokens: int, limit: int, param: str = "prompt") -> APIError:
    """400 for a prompt over the server's token limit, with OpenAI's code for it."""
    return invalid_request(
        f"the prompt is {num_tokens} tokens long; this server's limit is {limit}", param, code="context_length_exceeded"
    )


def prompt_too_many_chars(num_chars: int, fewest_tokens: int, limit: int, param: str = "prompt") -> APIError:
    """400 for a prompt whose characters alone rule it out: it cannot tokenize to fewer than `fewest_tokens`."""
    return invalid_request(
        f"the prompt is {num_chars} characters long, at least {fewest_tokens} tokens; this server's limit is {limit} "
        "tokens",
        param,
        code="context_length_exceeded",
    )


def unauthorized(message: str, code: str = "invalid_api_key") -> APIError:
    """401, with `WWW-Authenticate: Bearer` so generic HTTP clients know which scheme to use."""
    return APIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str, param: str | None = None, code: str = "not_found") -> APIError:
    """404: unknown session, model or route. Also what another key's session looks like (no existence leak)."""
    return APIError(404, message, param=param, code=code)


def conflict(
    message: str, param: str | None = None, code: str = "conflict", retry_after: float | None = None
) -> APIError:
    """409: the resource is busy (a session used by another request right now); with `retry_after`, a conflict that
    ends by itself (the other turn finishes, or a crashed replica's claim lapses), which clients may retry."""
    return APIError(409, message, param=param, code=code, headers=_retry_headers(retry_after))


def payload_too_large(limit_bytes: int) -> APIError:
    """413: the request body is over the server's byte limit."""
    return APIError(413, f"request body is too large: the limit is {limit_bytes} bytes", code="payload_too_large")


def unprocessable(message: str, param: str | None = None, code: str = "unprocessable_entity") -> APIError:
    """422: a well-formed body whose content cannot be used (e.g. a snapshot for another model or a bad checksum)."""
    return APIError(422, message, param=param, code=code)


def _retry_headers(retry_after: float | None) -> dict[str, str]:
    # Retry-After takes whole seconds; round up so a client never comes back too early.
    return {} if retry_after is None else {"Retry-After": str(max(1, int(-(-retry_after // 1))))}


def too_many_requests(retry_after: float | None = None, message: str = "the server is at capacity") -> APIError:
    """429 with `Retry-After`: the request queue is full. OpenAI SDKs retry these on their own."""
    return APIError(
        429,
        f"{message}; try again later",
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers=_retry_headers(retry_after),
    )


def service_unavailable(message: str, retry_after: float | None = None) -> APIError:
    """503: the server cannot serve now (starting, shutting down, engine stopped)."""
    return APIError(503, message, type="server_error", code="service_unavailable", headers=_retry_headers(retry_after))


def internal_error() -> APIError:
    """500 with nothing of the internals in it: the traceback goes to the log only."""
    return APIError(500, "internal server error; see the server log", type="server_error", code="internal_error")


_DESCRIPTIONS = {
    400: "Invalid request: the message names the field (`param`).",
    401: "Missing or incorrect API key.",
    404: "No such model, session or route (another key's sessions look like unknown ones).",
    409: "The session is in use by another request.",
    413: "Request body over the server's limit.",
    422: "Well-formed but unusable content (e.g. a snapshot of another model).",
    429: "The server is at capacity; retry after `Retry-After` seconds.",
    500: "Internal error.",
    503: "The server is starting or shutting down.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route decorator, so the OpenAPI docs show these statuses with the `ErrorResponse` body."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS.get(status, "Error.")} for status in statuses}


# -- validation errors -> one message naming the field ------------------------------------------------------------


def _walk(loc: Sequence[Any], error_type: str, body: Any) -> list[str | int]:
    """The real path of an error in the request data.

    Pydantic's `loc` interleaves field names with union-branch tags (`'str'`, `'list[int]'`, a discriminator value,
    a model's class name). Walking the loc through the data the client sent tells them apart: a component that
    indexes into the data is part of the path, anything else is a tag. A missing field is the one exception: it is
    not in the data by definition, so the last component of a `missing` error is kept.
    """
    path: list[str | int] = []
    node = body
    for i, part in enumerate(loc):
        if _indexes(node, part):
            path.append(part)
            node = node[part]
        elif i == len(loc) - 1 and error_type == "missing":
            path.append(part)
    return path


def _indexes(node: Any, part: Any) -> bool:
    """Whether `node[part]` is a step into the client's data (a key of an object, an index of an array)."""
    if isinstance(node, Mapping):
        return isinstance(part, str) and part in node
    if isinstance(node, list):
        return isinstance(part, int) and not isinstance(part, bool) and 0 <= part < len(node)
    return False


def format_param(path: Sequence[str | int]) -> str | None:
    """`["messages", 0, "content"]` -> `"messages[0].content"`; empty path -> None (the body as a whole)."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def _error_path(error: Mapping[str, Any], body: Any) -> list[str | int]:
    loc = list(error.get("loc", ()))
    if loc and loc[0] in ("query", "path", "header", "cookie"):
        # Parameters outside the body carry no union tags: their loc is the parameter's name.
        return loc[1:]
    if loc and loc[0] == "body":  # FastAPI's prefix; a model validated directly has none
        loc = loc[1:]
    return _walk(loc, error.get("type", ""), body)


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_INPUT_REPR else text[: _MAX_INPUT_REPR - 3] + "..."


def validation_error(errors: Sequence[Mapping[str, Any]], body: Any = None) -> APIError:
    """One 400 from pydantic's error list (`exc.errors()`) and the data validated: the first offending field, with
    its most specific error.

    When a field fails a union, pydantic reports one error per branch; the one that went deepest into the data
    (`content[0].type` rather than `content`) is the one that says what the client meant and got wrong.
    """
    if not errors:
        return invalid_request("invalid request body")
    paths = [_error_path(e, body) for e in errors]
    head = paths[0][:1]
    candidates = [i for i, p in enumerate(paths) if p[:1] == head]
    # Deepest first; at equal depth, a branch whose type did not even match the input says least.
    best = max(candidates, key=lambda i: (len(paths[i]), not errors[i].get("type", "").endswith("_type")))
    error, path = errors[best], paths[best]
    etype = error.get("type", "")
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if etype in ("union_tag_invalid", "union_tag_not_found"):
        # A discriminated union (chat messages by `role`): the fault is in the discriminator field itself.
        path = [*path, str(ctx.get("discriminator", "")).strip("'")]
        etype = "missing" if etype == "union_tag_not_found" else "literal_error"
        value = ctx.get("tag")
    param = format_param(path)
    if etype == "json_invalid":
        return _json_error(error, body)
    msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if param is None:
        if etype == "missing":
            return invalid_request("request body is required: send a JSON object", code="missing_required_parameter")
        hint = " (send it with Content-Type: application/json)" if isinstance(body, bytes | str) else ""
        return invalid_request(f"request body must be a JSON object{hint}: {msg}", code="invalid_type")
    if etype == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param, code="missing_required_parameter")
    got = f" (got {_short_repr(value)})" if "input" in error and etype != "value_error" else ""
    code = "invalid_type" if etype.endswith("_type") or etype.endswith("_parsing") else "invalid_value"
    return invalid_request(f"Invalid value for '{param}': {msg}{got}.", param, code=code)


def _json_error(error: Mapping[str, Any], body: Any) -> APIError:
    """400 for a body that is not JSON at all, with the parser's reason and where it stopped."""
    reason = (error.get("ctx") or {}).get("error", "cannot parse")
    loc = error.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    where = ""
    if pos is not None and isinstance(body, str):
        line = body.count("\n", 0, pos) + 1
        column = pos - (body.rfind("\n", 0, pos) + 1) + 1
        where = f" (line {line} column {column})"
    elif pos is not None:
        where = f" (char {pos})"
    return invalid_request(f"invalid JSON body: {reason}{where}", code="invalid_json")


# -- handlers -----------------------------------------------------------------------------------------------------

_STATUS_CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "unprocessable_entity",
    429: "rate_limit_exceeded",
}


async def _api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors(), exc.body).response()


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (no such route, wrong method, a route's HTTPException) in OpenAI's shape."""
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404 and exc.detail == "Not Found":
        message = f"no such route: {request.method} {request.url.path}"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    err_type = "server_error" if status >= 500 else "invalid_request_error"
    error = APIError(status, message, type=err_type, code=_STATUS_CODES.get(status), headers=exc.headers)
    return error.response()


async def _unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    # Starlette runs this from ServerErrorMiddleware and re-raises afterwards, so the server's own logger may
    # print the traceback too; ours names the route, which the re-raise does not.
    logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return internal_error().response()


def install_error_handlers(app: FastAPI) -> None:
    """Render every error `app` can produce in OpenAI's shape (see the module docstring)."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
