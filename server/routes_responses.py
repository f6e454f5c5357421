"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A stored response keeps a session whose state is the conversation at the end of that response, moved between the
GPU, host memory and the session store like any session. A request with `previous_response_id` forks that session
(so the response can be continued again, and two continuations of one response are two branches), renders the
stored conversation plus its own input through the chat template, and prefills only the tokens the forked state
does not hold yet: `usage.input_tokens_details.cached_tokens` says how many it skipped. `store: false` keeps
nothing: a fork it made is deleted when the response ends.

A checkpoint that declares reasoning tags gets its thinking split out of the reply (server/reasoning.py) into a
`reasoning` item before the message, streamed as `response.reasoning_text.delta` events, and counted in
`usage.output_tokens_details.reasoning_tokens`; the stored conversation keeps it as the reply's
`reasoning_content`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseErrorEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
)
from pydantic import BaseModel

from kvfree.engine.protocol import RequestOutput, SessionNotFound, SessionStoreError
from kvfree.server.auth import OwnerDep, api_key_owner
from kvfree.server.chat_template import render_chat, stop_at_turn_end
from kvfree.server.errors import APIError, error_responses, not_found, service_unavailable
from kvfree.server.lifecycle import ENGINE_ERRORS, Generation, http_errors
from kvfree.server.protocol import ChatMessage, ResponseModel, SystemMessage
from kvfree.server.reasoning import ReasoningFormat
from kvfree.server.responses import (
    OutputBuilder,
    ReasoningTokens,
    ResponsesRequest,
    StoredResponse,
    TurnTokens,
    now,
    response_id,
    response_object,
    sse,
    usage,
)
from kvfree.server.state import ServerState, StateDep, check_model
from kvfree.server.structured_outputs import reply_grammar
from kvfree.server.tools import ToolCallFormat, accepted_tool_names, template_tools

router = APIRouter(tags=["Responses"], dependencies=[Depends(api_key_owner)])


class ResponseDeleted(ResponseModel):
    id: str
    object: str = "response"
    deleted: bool = True


_CREATED = {
    200: {
        "description": "The response object (`object: \"response\"`), or with `stream` the Responses API's "
        "server-sent events.",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


@router.post("/v1/responses", responses=_CREATED | error_responses(400, 401, 404, 409, 413, 429, 503))
async def create_response(body: ResponsesRequest, request: Request, state: StateDep, owner: OwnerDep):
    """The model's next turn. With `previous_response_id` it continues that stored response's exact state; with
    `stream`, the Responses API's typed events (`response.created` ... `response.completed`)."""
    check_model(state, body.model)
    tok = state.tokenizer
    previous = None
    if body.previous_response_id:
        previous = await _stored(state, body.previous_response_id, owner, "previous_response_id")
    history: list[ChatMessage] = previous.messages if previous else []
    conversation = [*history, *body.input_messages()]
    system = [SystemMessage(role="system", content=body.instructions)] if body.instructions else []
    tools, choice = body.chat_tools(), body.chat_tool_choice()
    shown_tools = template_tools(tools, choice)

    def render(messages: list[ChatMessage], add_generation_prompt: bool = False) -> str:
        return render_chat(tok, [*system, *messages], shown_tools, add_generation_prompt)

    text = render(conversation, add_generation_prompt=True)
    params = stop_at_turn_end(body.to_sampling_params(state.settings.max_output_tokens), tok)
    grammar = reply_grammar(body.text_format.grammar(), "text.format", tools, choice, body.parallel_tool_calls, tok)
    params = await state.engine.constrain(params, *grammar)
    # Continuing: the previous turn's own tokens, then only the new text encoded (when the history renders as it
    # did then); otherwise the whole conversation encoded.
    prompt_ids = None
    if previous is not None and previous.turn is not None:
        state.engine.check_prompt_chars(len(text), "input")
        prompt_ids = await state.engine.tokenize(lambda t: previous.turn.continued(t, tok.encode), text)
    if prompt_ids is None:
        prompt_ids = await state.engine.encode_prompt(text, "input")
    state.engine.check(prompt_ids, params, "input")

    if body.store and (problem := await state.engine.session_store_problem()) is not None:
        # Refused before it runs: a stored response whose record cannot be written could never be fetched or continued.
        raise service_unavailable(f"{problem}; this response asks to be stored: retry, or send store: false",
                                  retry_after=5)  # fmt: skip
    session_id = await _session_for(state, previous, body.store, owner)
    fmt = ToolCallFormat.from_tokenizer_config(tok.config) if body.uses_tools else None
    thinking = ReasoningFormat.from_tokenizer_config(tok.config)
    turn = Turn(
        state=state, body=body, owner=owner, prompt_ids=prompt_ids, prompt_text=text,
        render=render, session_id=session_id, conversation=conversation,
        builder=OutputBuilder(fmt, accepted_tool_names(tools, choice), thinking), rid=response_id(), created_at=now(),
        reasoning=ReasoningTokens(tok, thinking, params.skip_special_tokens) if thinking is not None else None,
    )  # fmt: skip
    try:
        gen = await state.engine.start(request, prompt_ids, params, session_id=session_id, owner=owner)
    except BaseException:
        await turn.drop_session()
        raise
    if body.stream:
        return StreamingResponse(turn.events(gen), media_type="text/event-stream")
    try:
        with http_errors():  # e.g. the session store is unreachable when the record is written: 503
            async for out in gen:
                turn.take(out)
            response = await turn.finish(gen)
    finally:
        await gen.aclose()
        await turn.drop_session()  # nothing, once the response is stored
    return JSONResponse(response.model_dump(mode="json"))


@router.get("/v1/responses/{response_id}", responses=error_responses(401, 404))
async def get_response(response_id: str, state: StateDep, owner: OwnerDep):
    """A stored response, as `POST` returned it."""
    stored = await _stored(state, response_id, owner, "response_id")
    return JSONResponse(stored.response.model_dump(mode="json"))


@router.delete(
    "/v1/responses/{response_id}", response_model=ResponseDeleted, responses=error_responses(401, 404, 409, 503)
)
async def delete_response(response_id: str, state: StateDep, owner: OwnerDep) -> ResponseDeleted:
    """Forget a stored response and free its state; it can no longer be continued."""
    stored = await _stored(state, response_id, owner, "response_id")
    # The state first: a session in use by a request (through /v1/sessions) is a 409 and nothing changes.
    with http_errors(), contextlib.suppress(SessionNotFound):  # not found: deleted through /v1/sessions already
        await state.engine.delete_session(stored.session_id, owner)
    with http_errors():
        await state.responses.pop(response_id, owner)
    return ResponseDeleted(id=response_id)


async def _stored(state: ServerState, response_id: str, owner: str | None, param: str) -> StoredResponse:
    """A stored response (404 naming `param` when unknown or another key's; 503 when the store is unreachable)."""
    with http_errors():
        return await state.responses.get(response_id, owner, param)


async def _session_for(
    state: ServerState, previous: StoredResponse | None, store: bool, owner: str | None
) -> str | None:
    """The session this turn runs on: a fork of the previous response's, a new one to store, or none."""
    with http_errors(state.metrics):
        try:
            if previous is not None:
                return (await state.engine.fork_session(previous.session_id, owner)).session_id
            if store:
                return (await state.engine.create_session(owner)).session_id
        except SessionNotFound:
            raise not_found(
                f"the state of response {previous.response.id!r} is gone (its session was deleted)",  # type: ignore[union-attr]
                "previous_response_id",
                code="response_not_found",
            ) from None
    return None


@dataclass
class Turn:
    """One response being generated: the engine's outputs in, output items (or stream events) and a record out."""

    state: ServerState
    body: ResponsesRequest
    owner: str | None
    prompt_ids: list[int]
    prompt_text: str  # the prompt as the template rendered it
    render: Callable[[list[ChatMessage]], str]  # messages after the instructions -> text, no generation prompt
    session_id: str | None
    conversation: list[ChatMessage]
    builder: OutputBuilder
    rid: str
    created_at: float
    reasoning: ReasoningTokens | None = None  # counts the reasoning's tokens, for a checkpoint with reasoning tags
    reply_ids: list[int] = field(default_factory=list)

    def take(self, out: RequestOutput) -> list[BaseModel]:
        """One engine output: its tokens kept for the record, its text through the builder (the events that adds)."""
        self.reply_ids += out.token_ids
        if self.reasoning is not None:
            self.reasoning.add(out.token_ids)
        return self.builder.feed(out.text) if out.text else []

    def close_output(self, gen: Generation) -> list[BaseModel]:
        """The generation ended: the builder's last events (the item the token limit cut: incomplete)."""
        return self.builder.finish(cut=gen.finish_reason == "length")

    def response(self, status: str, gen: Generation | None = None) -> Response:
        """The response object; with `gen` (the generation ended), its usage."""
        counts = None
        if gen is not None:
            thought = self.reasoning.count(gen.finish_reason) if self.reasoning is not None else 0
            counts = usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, thought)
        return response_object(self.body, self.rid, self.state.model_name, self.created_at, self.builder.items, status,
                               counts)  # type: ignore[arg-type]  # fmt: skip

    async def finish(self, gen: Generation) -> Response:
        """The generation ended: close the output, count it, store the response (or drop its state)."""
        self.close_output(gen)
        response = self.response("incomplete" if gen.finish_reason == "length" else "completed", gen)
        gen.finish()
        if self.body.store and self.session_id is not None:
            reply = self.builder.assistant_message()
            # Without stop strings, "stop" means the last token was a stop token: the template writes its own.
            reply_ids = self.reply_ids[:-1] if gen.finish_reason == "stop" else self.reply_ids
            turn = TurnTokens.of_turn(
                self.render, self.prompt_text, self.conversation, reply, self.prompt_ids, reply_ids
            )
            stored = StoredResponse(response, self.owner, self.session_id, [*self.conversation, reply], turn)
            await self.state.responses.put(stored)
            self.session_id = None  # the stored response owns it now
        return response

    async def drop_session(self) -> None:
        """Delete the session this turn made, unless a stored response owns it (it never holds anything else).

        Also when the client went away: shielded from the cancellation, and deferred by the engine until the
        aborted request lets go of the session."""
        if self.session_id is not None:
            session_id, self.session_id = self.session_id, None
            with anyio.CancelScope(shield=True), contextlib.suppress(*ENGINE_ERRORS):
                await self.state.engine.discard_session(session_id, self.owner)

    async def events(self, gen: Generation) -> AsyncIterator[str]:
        """The Responses API stream: created, in_progress, the items' events as text arrives, completed."""
        b = self.builder
        try:
            started = self.response("in_progress")
            yield sse(b.event(ResponseCreatedEvent, response=started))
            yield sse(b.event(ResponseInProgressEvent, response=started))
            async for out in gen:
                for event in self.take(out):
                    yield sse(event)
            for event in self.close_output(gen):
                yield sse(event)
            response = await self.finish(gen)
            done = ResponseIncompleteEvent if response.status == "incomplete" else ResponseCompletedEvent
            yield sse(b.event(done, response=response))
        except APIError as exc:
            yield sse(b.event(ResponseErrorEvent, code=exc.code, message=exc.message, param=exc.param))
        except SessionStoreError as exc:  # the record could not be stored: say so in-band, the status is sent
            yield sse(b.event(ResponseErrorEvent, code="store_unavailable", message=str(exc), param=None))
        except Exception as exc:  # the engine failed midway: the status is sent, so the error goes in-band too
            yield sse(b.event(ResponseErrorEvent, code="server_error", message=f"generation failed: {exc}", param=None))
        finally:
            await gen.aclose()  # aborts the engine request if the client went away
            await self.drop_session()
