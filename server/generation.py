"""What the routes share: the served state and its dependency, prompt checks, engine errors as HTTP errors.

`start_generation` submits a request and waits for its first output, so that admission errors become HTTP errors
before a response (or a stream) is started.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

import jinja2
from fastapi import Depends, Request

from kvfree.checkpoints import CheckpointError
from kvfree.engine.async_engine import AsyncEngine, EngineStopped, QueueFull, SessionBusy
from kvfree.engine.sampling import SamplingParams
from kvfree.engine.scheduler import RequestOutput
from kvfree.engine.session_store import SessionStoreError
from kvfree.engine.sessions import PoolExhausted, SessionLimitError, SessionNotFound
from kvfree.engine.snapshot import SnapshotError
from kvfree.engine.state_pool import SnapshotMismatchError
from kvfree.engine.tokenizer import Tokenizer
from kvfree.server.errors import (
    APIError,
    conflict,
    invalid_request,
    not_found,
    prompt_too_long,
    service_unavailable,
    too_many_requests,
)
from kvfree.server.metrics import Metrics
from kvfree.server.protocol import ChatMessage
from kvfree.server.responses import ResponseStore
from kvfree.server.settings import ServerSettings
from kvfree.server.tools import template_messages


@dataclass
class ServerState:
    """Everything a route needs, kept on `app.state.kvfree`."""

    engine: AsyncEngine
    settings: ServerSettings
    metrics: Metrics
    model_name: str
    responses: ResponseStore = field(default_factory=ResponseStore)  # POST /v1/responses with store


def state_of(request: Request) -> ServerState:
    """The app's `ServerState`; as a dependency, a route parameter `state: StateDep`."""
    return request.app.state.kvfree


StateDep = Annotated[ServerState, Depends(state_of)]


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise not_found(f"model {model!r} is not served here; this server serves {state.model_name!r}", "model")


def render_chat(
    state: ServerState, messages: list[ChatMessage], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
) -> str:
    """A conversation as prompt text, through the checkpoint's chat template; a 400 naming `messages` when the
    checkpoint has no template or it cannot render these messages."""
    try:
        return state.engine.tokenizer.apply_chat_template(
            template_messages(messages), add_generation_prompt=add_generation_prompt, tools=tools
        )
    except CheckpointError as exc:
        raise invalid_request(str(exc), "messages") from None
    except jinja2.TemplateError as exc:
        raise invalid_request(f"the chat template could not render these messages: {exc}", "messages") from None


# Chat templates end an assistant turn with this token; generation must stop there.
TURN_END_TOKENS = ("<|im_end|>",)


def stop_at_turn_end(params: SamplingParams, tok: Tokenizer) -> SamplingParams:
    """`params` that also stop at the chat template's end-of-turn token (when the tokenizer has one)."""
    ids = [i for t in TURN_END_TOKENS if (i := tok.token_to_id(t)) is not None]
    return replace(params, stop_token_ids=[*params.stop_token_ids, *ids]) if ids else params


def check_prompt(state: ServerState, ids: list[int], params: SamplingParams | None, param: str) -> None:
    """Vocabulary, prompt length, and the KV-cache limit of models with full attention."""
    vocab = state.engine.llm.config.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise invalid_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param)
    if len(ids) > state.settings.max_prompt_tokens:
        raise prompt_too_long(len(ids), state.settings.max_prompt_tokens, param)
    pool = state.engine.llm.pool
    if pool.bytes_per_token() and params is not None and len(ids) + params.max_tokens > pool.max_context:
        raise invalid_request(
            f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds this model's context of "
            f"{pool.max_context} tokens (its attention layers keep a KV cache of that size)",
            "max_tokens",
        )


def engine_error(exc: Exception) -> APIError:
    """The HTTP error for an engine exception that a client caused or can retry."""
    if isinstance(exc, QueueFull):
        return too_many_requests(retry_after=1, message=f"server busy: {exc}; retry later")
    if isinstance(exc, PoolExhausted):
        return too_many_requests(retry_after=1, message=f"no state slot free: {exc}; retry later")
    if isinstance(exc, SessionLimitError):
        return too_many_requests(message=f"no room for another session: {exc}")
    if isinstance(exc, SessionNotFound):
        return not_found(str(exc), "session_id")
    if isinstance(exc, SessionBusy):
        return conflict(str(exc), "session_id")
    if isinstance(exc, EngineStopped):
        return service_unavailable(str(exc), retry_after=5)
    if isinstance(exc, SessionStoreError):
        return service_unavailable(f"{exc}; requests without a session still work", retry_after=5)
    if isinstance(exc, SnapshotError):
        return invalid_request(str(exc), "snapshot", code=exc.code)
    if isinstance(exc, SnapshotMismatchError):
        return invalid_request(f"snapshot does not fit this model: {exc}", "snapshot", code="model_mismatch")
    raise exc


ENGINE_ERRORS = (
    QueueFull,
    PoolExhausted,
    SessionLimitError,
    SessionNotFound,
    SessionBusy,
    EngineStopped,
    SessionStoreError,
    SnapshotError,
    SnapshotMismatchError,
)


async def start_generation(
    state: ServerState,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    n: int,
    session_id: str | None,
    owner: str | None,
    request_id: str,
) -> AsyncIterator[RequestOutput]:
    """Submit a request and wait for its first output, so that admission errors become HTTP errors before any
    response is started. Returns an iterator that yields that first output and then the rest."""
    outputs = state.engine.generate(prompt_ids, params, n=n, session_id=session_id, owner=owner, request_id=request_id)
    try:
        first = await anext(outputs)
    except ENGINE_ERRORS as exc:
        state.metrics.count_rejected(type(exc).__name__)
        raise engine_error(exc) from None

    async def rest() -> AsyncIterator[RequestOutput]:
        try:
            yield first
            async for out in outputs:
                yield out
        finally:
            with contextlib.suppress(Exception):
                await outputs.aclose()

    return rest()
