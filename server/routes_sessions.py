"""Session routes (architecture.md §6-§7): create (optionally prefilled), list, inspect, delete, fork, snapshot,
restore."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Annotated, BinaryIO, Literal

import anyio
from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from kvfree.engine.protocol import SamplingParams, SessionNotFound, SessionRecord, SnapshotError
from kvfree.engine.state.snapshot import check_header, header_length, parse_header
from kvfree.server.auth import OwnerDep, api_key_owner
from kvfree.server.chat_template import render_chat
from kvfree.server.errors import APIError, error_responses, invalid_request, not_found
from kvfree.server.lifecycle import http_errors
from kvfree.server.protocol import SessionCreateRequest, SessionDeleted, SessionInfo, SessionList
from kvfree.server.state import ServerState, StateDep, check_model
from kvfree.server.tools import template_tools

router = APIRouter(tags=["Sessions"], dependencies=[Depends(api_key_owner)])

SNAPSHOT_MEDIA_TYPE = "application/octet-stream"
RESTORE_PATH = "/v1/sessions/restore"  # its body is streamed past the middlewares (server/app.py)
SNAPSHOT_CHUNK_BYTES = 1 << 20  # file reads of a download, and batched file writes of an upload


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
    files = state.snapshot_files
    carrier = files.take()
    try:
        # Shielded: the carrier goes back (a temporary file: removed) only once the engine has stopped writing it.
        with anyio.CancelScope(shield=True), http_errors():
            size = await state.engine.export_session(session_id, owner, carrier.path)
        f = open(carrier.path, "rb", buffering=0)  # noqa: SIM115 (the response closes it, however it ends)
    except BaseException:
        files.give_back(carrier)
        raise
    return SnapshotStream(f, size, f"{session_id}.safetensors", on_close=lambda: files.give_back(carrier))


class SnapshotStream(StreamingResponse):
    """An open snapshot file sent in `SNAPSHOT_CHUNK_BYTES` chunks, each read on a worker thread (a read never holds
    the event loop), with its Content-Length; the file is closed however the response ends (sent, or the client
    gone)."""

    def __init__(self, f: BinaryIO, size: int, filename: str, on_close: Callable[[], None]) -> None:
        self.file, self.size, self.on_close = f, size, on_close
        headers = {"Content-Disposition": f'attachment; filename="{filename}"', "Content-Length": str(size)}
        super().__init__(self._chunks(), media_type=SNAPSHOT_MEDIA_TYPE, headers=headers)

    async def _chunks(self) -> AsyncIterator[bytes]:
        left = self.size
        while left > 0 and (chunk := await anyio.to_thread.run_sync(self.file.read, min(left, SNAPSHOT_CHUNK_BYTES))):
            left -= len(chunk)
            yield chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.file.close()  # (a cancelled read has finished first: worker threads are waited for)
            self.on_close()


@router.post(
    RESTORE_PATH,
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
    Snapshots of another model, truncated or tampered files are refused with 400; what the header alone shows
    (not a snapshot, an unreadable version, a bad signature, another model) is refused as soon as the header has
    arrived, before the rest of the body is read."""
    carrier = state.snapshot_files.take()
    try:
        with http_errors():
            info = state.engine.info
            await receive_snapshot(request, carrier.path, info.fingerprint, state.settings.snapshot_hmac_key)
            return session_info(state, await state.engine.restore_session(carrier.path, owner))
    finally:
        state.snapshot_files.give_back(carrier)


async def receive_snapshot(request: Request, path: str, fingerprint: str, hmac_key: bytes | None) -> None:
    """Write the request body into the file `path` as it arrives, refusing a bad snapshot (SnapshotError) as soon
    as its header has arrived (`check_header`), or its length shows it cut short or overlong; an empty
    body is a 400. The writes run on a worker thread, `SNAPSHOT_CHUNK_BYTES` or more at a time (a body arrives in
    pieces of 64 KB: one thread hop each would cost more than the writes)."""
    head = bytearray()  # the body until its header is whole and checked; nothing is written before
    expected: int | None = None  # the file size the header implies (None: not known)
    checked = False
    batch: list[bytes | bytearray] = []
    batched = total = 0
    with open(path, "r+b") as f:  # (not truncated now: the pages a previous snapshot left are reused)
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if not checked:
                    head += chunk
                    if len(head) < 8 or len(head) < header_length(head):
                        continue
                    expected = check_header(head, fingerprint, hmac_key)
                    checked, chunk, head = True, head, bytearray()
                if expected is not None and total > expected:
                    raise SnapshotError(
                        f"not a snapshot (with bytes after its end): its header says {expected} bytes, more were sent"
                    )
                batch.append(chunk)
                batched += len(chunk)
                if batched >= SNAPSHOT_CHUNK_BYTES:
                    await anyio.to_thread.run_sync(f.writelines, batch)
                    batch, batched = [], 0
        except ClientDisconnect:
            raise invalid_request("the client went away before the snapshot was uploaded", "snapshot") from None
        if not total:
            raise invalid_request("empty body: upload the snapshot file's bytes as the request body", "snapshot")
        if not checked:  # the body ended inside the header: this says how
            header_length(head)
            parse_header(head)
        if expected is not None and total != expected:
            raise SnapshotError(f"not a snapshot (truncated): its header says {expected} bytes, it has {total}")
        await anyio.to_thread.run_sync(f.writelines, batch)
        f.truncate()


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
