"""Session routes (architecture.md §6-§7): create (optionally prefilled), list, inspect, delete, fork, snapshot,
restore."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.responses import Response

from kvfree.engine.engine_info import SessionRecord
from kvfree.engine.sampling import SamplingParams
from kvfree.engine.sessions import SessionNotFound
from kvfree.server.auth import OwnerDep, api_key_owner
from kvfree.server.chat_template import render_chat
from kvfree.server.errors import APIError, error_responses, invalid_request, not_found
from kvfree.server.lifecycle import http_errors
from kvfree.server.protocol import SessionCreateRequest, SessionDeleted, SessionInfo, SessionList
from kvfree.server.state import ServerState, StateDep, check_model
from kvfree.server.tools import template_tools

router = APIRouter(tags=["Sessions"], dependencies=[Depends(api_key_owner)])

SNAPSHOT_MEDIA_TYPE = "application/octet-stream"


@router.post("/v1/sessions", response_model=SessionInfo, responses=error_responses(400, 401, 404, 413, 429, 503))
async def create_session(
    request: Request, state: StateDep, owner: OwnerDep, body: Annotated[SessionCreateRequest | None, Body()] = None
) -> SessionInfo:
    """A new session. With `prompt` or `messages` its state is prefilled now, so the first chat turn that
    carries the same messages plus new ones only prefills the new part."""
    body = body or SessionCreateRequest()
    check_model(state, body.model)
    tok = state.tokenizer
    ids: list[int] = []
    if body.messages is not None:
        text = render_chat(tok, body.messages, template_tools(body.tools, None), add_generation_prompt=False)
        ids = await state.engine.encode_prompt(text, "messages")
    elif isinstance(body.prompt, str):
        ids = await state.engine.encode_prompt(body.prompt, "prompt")
    elif body.prompt is not None:
        ids = list(body.prompt)
    params = SamplingParams(max_tokens=1)
    state.engine.check(ids, params, "messages" if body.messages else "prompt")
    with http_errors():
        session = await state.engine.create_session(owner)
    if ids:
        try:
            gen = await state.engine.start(
                request, ids, params, session_id=session.session_id, owner=owner, prefill_only=True
            )
            try:
                async for _ in gen:
                    pass
            finally:
                await gen.aclose()
        except APIError:  # the prompt never made it into the state: no half-made session is left behind
            await state.engine.delete_session(session.session_id, owner)
            raise
        session = await state.engine.get_session(session.session_id, owner)
    return session_info(state, session)


@router.get("/v1/sessions", response_model=SessionList, responses=error_responses(400, 401, 404))
async def list_sessions(
    state: StateDep,
    owner: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=100, description="Sessions per page, 1-100.")] = 20,
    after: Annotated[str | None, Query(description="A session id: the page starts after it (`last_id`).")] = None,
    order: Annotated[Literal["asc", "desc"], Query(description="By creation time: `desc` newest first.")] = "desc",
) -> SessionList:
    """The caller's sessions (those of its API key; stored responses' states among them), a page at a time, as
    OpenAI lists objects: pass the page's `last_id` as `after` while `has_more`. A replica lists the sessions it
    holds or has found in the session store."""
    with http_errors():
        try:
            page = await state.engine.list_sessions(owner, limit, after, order)
        except SessionNotFound:
            raise not_found(f"session {after!r} not found: `after` takes the `last_id` of a page", "after") from None
    data = [session_info(state, record) for record in page.records]
    return SessionList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=page.has_more,
    )


@router.get("/v1/sessions/{session_id}", response_model=SessionInfo, responses=error_responses(401, 404))
async def get_session(session_id: str, state: StateDep, owner: OwnerDep) -> SessionInfo:
    """A session's size, token count and where its state is (gpu, host or disk)."""
    with http_errors():
        return session_info(state, await state.engine.get_session(session_id, owner))


@router.delete("/v1/sessions/{session_id}", response_model=SessionDeleted, responses=error_responses(401, 404, 409))
async def delete_session(session_id: str, state: StateDep, owner: OwnerDep) -> SessionDeleted:
    """Forget a session and free its state everywhere (slot, host memory, snapshot file)."""
    with http_errors():
        await state.engine.delete_session(session_id, owner)
    return SessionDeleted(id=session_id)


@router.post(
    "/v1/sessions/{session_id}/fork", response_model=SessionInfo, responses=error_responses(401, 404, 409, 429)
)
async def fork_session(session_id: str, state: StateDep, owner: OwnerDep) -> SessionInfo:
    """A new session starting from a copy of this one's state (branch a conversation)."""
    with http_errors():
        return session_info(state, await state.engine.fork_session(session_id, owner))


@router.get(
    "/v1/sessions/{session_id}/snapshot",
    response_class=Response,
    responses={
        200: {"content": {SNAPSHOT_MEDIA_TYPE: {}}, "description": "A safetensors snapshot."},
        **error_responses(401, 404, 409),
    },
)
async def snapshot(session_id: str, state: StateDep, owner: OwnerDep) -> Response:
    """The session's state as a safetensors file (same size at any context length); restore it anywhere the
    same model is served with `POST /v1/sessions/restore`."""
    with http_errors():
        data = await state.engine.export_session(session_id, owner)
    return Response(
        content=data,
        media_type=SNAPSHOT_MEDIA_TYPE,
        headers={"Content-Disposition": f'attachment; filename="{session_id}.safetensors"'},
    )


@router.post(
    "/v1/sessions/restore",
    response_model=SessionInfo,
    responses=error_responses(400, 401, 413, 429),
    openapi_extra={
        "requestBody": {
            "content": {SNAPSHOT_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
            "required": True,
        }
    },
)
async def restore(request: Request, state: StateDep, owner: OwnerDep) -> SessionInfo:
    """A new session from an uploaded snapshot (the raw bytes of `GET .../snapshot` as the request body).
    Snapshots of another model, truncated or tampered files are refused with 400."""
    data = await request.body()
    if not data:
        raise invalid_request("empty body: upload the snapshot file's bytes as the request body", "snapshot")
    with http_errors():
        return session_info(state, await state.engine.restore_session(data, owner))


def session_info(state: ServerState, session: SessionRecord) -> SessionInfo:
    """A session as the API shows it."""
    return SessionInfo(
        id=session.session_id,
        created=int(session.created),
        last_used=int(session.last_used),
        model=state.model_name,
        num_tokens=session.num_tokens,
        location=session.location,
        state_bytes=session.state_bytes,
    )
