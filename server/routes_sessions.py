"""Session routes (architecture.md §6-§7): create (optionally prefilled), inspect, delete, fork, snapshot, restore."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response

from kvfree.engine.sampling import SamplingParams
from kvfree.engine.sessions import Session
from kvfree.server.auth import OwnerDep, api_key_owner
from kvfree.server.errors import error_responses, invalid_request
from kvfree.server.generation import (
    ENGINE_ERRORS,
    ServerState,
    StateDep,
    check_model,
    check_prompt,
    engine_error,
    render_chat,
)
from kvfree.server.protocol import SessionCreateRequest, SessionDeleted, SessionInfo
from kvfree.server.tools import template_tools

router = APIRouter(tags=["Sessions"], dependencies=[Depends(api_key_owner)])

SNAPSHOT_MEDIA_TYPE = "application/octet-stream"


@router.post("/v1/sessions", response_model=SessionInfo, responses=error_responses(400, 401, 404, 413, 429, 503))
async def create_session(
    state: StateDep, owner: OwnerDep, body: Annotated[SessionCreateRequest | None, Body()] = None
) -> SessionInfo:
    """A new session. With `prompt` or `messages` its state is prefilled now, so the first chat turn that
    carries the same messages plus new ones only prefills the new part."""
    body = body or SessionCreateRequest()
    check_model(state, body.model)
    tok = state.engine.tokenizer
    ids: list[int] = []
    if body.messages is not None:
        text = render_chat(state, body.messages, template_tools(body.tools, None), add_generation_prompt=False)
        ids = tok.encode(text)
    elif body.prompt is not None:
        ids = tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    check_prompt(state, ids, SamplingParams(max_tokens=1), "messages" if body.messages else "prompt")
    session = await _engine_call(state.engine.create_session(owner))
    if ids:
        try:
            async for _ in state.engine.generate(
                ids, SamplingParams(max_tokens=1), session_id=session.session_id, owner=owner, prefill_only=True
            ):
                pass
        except ENGINE_ERRORS as exc:
            await state.engine.delete_session(session.session_id, owner)
            raise engine_error(exc) from None
        session = await state.engine.get_session(session.session_id, owner)
    return session_info(state, session)


@router.get("/v1/sessions/{session_id}", response_model=SessionInfo, responses=error_responses(401, 404))
async def get_session(session_id: str, state: StateDep, owner: OwnerDep) -> SessionInfo:
    """A session's size, token count and where its state is (gpu, host or disk)."""
    return session_info(state, await _engine_call(state.engine.get_session(session_id, owner)))


@router.delete("/v1/sessions/{session_id}", response_model=SessionDeleted, responses=error_responses(401, 404, 409))
async def delete_session(session_id: str, state: StateDep, owner: OwnerDep) -> SessionDeleted:
    """Forget a session and free its state everywhere (slot, host memory, snapshot file)."""
    await _engine_call(state.engine.delete_session(session_id, owner))
    return SessionDeleted(id=session_id)


@router.post(
    "/v1/sessions/{session_id}/fork", response_model=SessionInfo, responses=error_responses(401, 404, 409, 429)
)
async def fork_session(session_id: str, state: StateDep, owner: OwnerDep) -> SessionInfo:
    """A new session starting from a copy of this one's state (branch a conversation)."""
    return session_info(state, await _engine_call(state.engine.fork_session(session_id, owner)))


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
    data = await _engine_call(state.engine.export_session(session_id, owner))
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
    return session_info(state, await _engine_call(state.engine.restore_session(data, owner)))


def session_info(state: ServerState, session: Session) -> SessionInfo:
    # The engine keeps last_used on the monotonic clock (immune to clock changes); clients get unix time.
    last_used = time.time() - (time.monotonic() - session.last_used)
    return SessionInfo(
        id=session.session_id,
        created=int(session.created),
        last_used=int(last_used),
        model=state.model_name,
        num_tokens=session.num_tokens,
        location=session.location,
        state_bytes=state.engine.llm.pool.bytes_per_session(session.num_tokens),
    )


async def _engine_call(coro):
    try:
        return await coro
    except ENGINE_ERRORS as exc:
        raise engine_error(exc) from None
