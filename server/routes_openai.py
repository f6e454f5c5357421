"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_usage import CompletionUsage

from kvfree.engine.sampling import SamplingParams
from kvfree.engine.scheduler import RequestOutput
from kvfree.engine.sequence import TokenLogprob
from kvfree.engine.tokenizer import Tokenizer
from kvfree.server.auth import OwnerDep, api_key_owner
from kvfree.server.errors import ErrorInfo, ErrorResponse, error_responses, invalid_request
from kvfree.server.generation import (
    ENGINE_ERRORS,
    ServerState,
    StateDep,
    check_model,
    check_prompt,
    engine_error,
    render_chat,
    start_generation,
    stop_at_turn_end,
)
from kvfree.server.metrics import RequestTimer
from kvfree.server.protocol import (
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    ModelCard,
    ModelList,
    SessionUsage,
    TextEvents,
    new_id,
    sse_event,
    usage_of,
)
from kvfree.server.reasoning import ReasoningFormat, ReasoningStreamParser
from kvfree.server.tools import (
    ContentDelta,
    ToolCallFormat,
    ToolCallStreamParser,
    accepted_tool_names,
    parse_tool_calls,
    template_tools,
)

# Every route needs an API key when the server has some; the routes that scope sessions by key also take `owner`.
router = APIRouter(tags=["OpenAI"], dependencies=[Depends(api_key_owner)])

GENERATION_ERRORS = error_responses(400, 401, 404, 409, 413, 429, 503)


# -- routes -------------------------------------------------------------------------------------------------------


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
async def list_models(state: StateDep) -> ModelList:
    """The model this server serves."""
    pool = state.engine.llm.pool
    card = ModelCard(
        id=state.model_name,
        object="model",
        created=int(time.time()),
        owned_by="kvfree",
        max_prompt_tokens=state.settings.max_prompt_tokens,
        max_output_tokens=state.settings.max_output_tokens,
        max_context=pool.max_context if pool.bytes_per_token() else None,
        state_bytes_per_session=pool.bytes_per_session(),
    )
    return ModelList(data=[card])


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_ERRORS)
async def completions(body: CompletionRequest, request: Request, state: StateDep, owner: OwnerDep):
    """Continue a prompt (text or token ids). Set `stream` for server-sent events."""
    check_model(state, body.model)
    tok = state.engine.tokenizer
    prompt_ids = tok.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    if not prompt_ids:
        raise invalid_request("prompt is empty after tokenization", "prompt")
    params = body.to_sampling_params(state.settings.max_output_tokens)
    ctx = await _prepare(state, request, body, prompt_ids, params, owner, "prompt")
    timer = state.metrics.request_timer()
    outputs = await _run(ctx)
    if body.stream:
        return StreamingResponse(_completion_stream(ctx, body, outputs, timer, request), media_type="text/event-stream")
    choices, cached = await _collect(ctx, outputs, timer)
    usage = _record(ctx, timer, request, sum(len(c.token_ids) for c in choices), cached, choices[0].finish_reason)
    want_logprobs = params.logprobs is not None
    return CompletionResponse(
        model=state.model_name,
        choices=[
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=_completion_logprobs(tok, c.logprobs) if want_logprobs else None,
                finish_reason=_finish(c.finish_reason),
            )
            for i, c in enumerate(choices)
        ],
        usage=usage,
        session=await _session_usage(ctx, cached),
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep, owner: OwnerDep):
    """The assistant's next message, rendered with the checkpoint's chat template. Set `stream` for SSE."""
    check_model(state, body.model)
    tok = state.engine.tokenizer
    choice = body.effective_tool_choice
    text = render_chat(state, body.messages, template_tools(body.tools, choice), add_generation_prompt=True)
    params = stop_at_turn_end(body.to_sampling_params(state.settings.max_output_tokens), tok)
    ctx = await _prepare(state, request, body, tok.encode(text), params, owner, "messages")
    fmt = ToolCallFormat.from_tokenizer_config(tok.config) if body.uses_tools else None
    allowed = accepted_tool_names(body.tools, choice)
    thinking = ReasoningFormat.from_tokenizer_config(tok.config)
    timer = state.metrics.request_timer()
    outputs = await _run(ctx)
    if body.stream:
        stream = _chat_stream(ctx, body, outputs, timer, request, fmt, allowed, thinking)
        return StreamingResponse(stream, media_type="text/event-stream")
    choices, cached = await _collect(ctx, outputs, timer)
    usage = _record(ctx, timer, request, sum(len(c.token_ids) for c in choices), cached, choices[0].finish_reason)
    result = []
    for i, c in enumerate(choices):
        reasoning, content = thinking.split(c.text) if thinking is not None else (None, c.text)
        calls = []
        if fmt is not None:
            content, calls = parse_tool_calls(content, fmt.start, fmt.end, allowed)
        finish = "tool_calls" if calls else _finish(c.finish_reason)
        result.append(
            ChatCompletionChoice(
                index=i,
                message=ChatCompletionMessage(
                    content=content if (content or not calls) else None, reasoning_content=reasoning,
                    tool_calls=calls or None,
                ),
                logprobs=_chat_logprobs(tok, c.logprobs) if ctx.params.logprobs is not None else None,
                finish_reason=finish,
            )
        )
    return ChatCompletionResponse(
        model=state.model_name, choices=result, usage=usage, session=await _session_usage(ctx, cached)
    )


# -- streams ------------------------------------------------------------------------------------------------------


def _completion_stream(
    ctx: Context,
    body: CompletionRequest,
    outputs: AsyncIterator[RequestOutput],
    timer: RequestTimer,
    request: Request,
) -> AsyncIterator[str]:
    chunk_id = new_id("cmpl")
    tok = ctx.state.engine.tokenizer
    model = ctx.state.model_name
    tally = Tally()

    texts = [
        TextEvents(
            lambda text, i=i: CompletionChunk(id=chunk_id, model=model, choices=[CompletionChoice(index=i, text=text)])
        )
        for i in range(ctx.n)
    ]

    async def events() -> AsyncIterator[str]:
        offsets = [0] * ctx.n
        async for out in _tallied(outputs, tally, timer):
            finish = _finish(out.finish_reason)
            if not out.text and finish is None and not out.logprobs:
                continue
            if finish is None and ctx.params.logprobs is None:  # the common chunk: text only
                offsets[out.index] += len(out.text)
                yield texts[out.index].event(out.text)
                continue
            logprobs = None
            if ctx.params.logprobs is not None:
                logprobs = _completion_logprobs(tok, out.logprobs, offsets[out.index])
            offsets[out.index] += len(out.text)
            choice = CompletionChoice(index=out.index, text=out.text, logprobs=logprobs, finish_reason=finish)
            yield sse_event(CompletionChunk(id=chunk_id, model=model, choices=[choice]))

    def usage_chunk(usage: CompletionUsage, session: SessionUsage | None) -> str:
        return sse_event(CompletionChunk(id=chunk_id, model=model, choices=[], usage=usage, session=session))

    return _sse_stream(ctx, request, timer, tally, events(), usage_chunk if body.include_usage else None)


def _chat_stream(
    ctx: Context,
    body: ChatCompletionRequest,
    outputs: AsyncIterator[RequestOutput],
    timer: RequestTimer,
    request: Request,
    fmt: ToolCallFormat | None,
    allowed: frozenset[str] | None,
    thinking: ReasoningFormat | None,
) -> AsyncIterator[str]:
    chunk_id = new_id("chatcmpl")
    tok = ctx.state.engine.tokenizer
    model = ctx.state.model_name
    parsers = [ToolCallStreamParser(fmt.start, fmt.end, allowed) for _ in range(ctx.n)] if fmt else None
    thinkers = [ReasoningStreamParser(thinking) for _ in range(ctx.n)] if thinking else None
    tally = Tally()

    def chunk(index: int, delta: DeltaMessage, finish: str | None = None, logprobs=None) -> str:
        choice = ChatCompletionChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse_event(ChatCompletionChunk(id=chunk_id, model=model, choices=[choice]))

    texts = [TextEvents(lambda text, i=i: _text_chunk(chunk_id, model, i, text)) for i in range(ctx.n)]

    async def events() -> AsyncIterator[str]:
        for i in range(ctx.n):
            yield chunk(i, DeltaMessage(role="assistant", content=""))
        async for out in _tallied(outputs, tally, timer):
            want_logprobs = ctx.params.logprobs is not None and out.logprobs
            logprobs = _chat_logprobs(tok, out.logprobs) if want_logprobs else None
            deltas: list[DeltaMessage] = []
            text = out.text
            if thinkers is not None:  # the reasoning goes out as it comes; the content goes on to the tool parser
                parts = thinkers[out.index].feed(text)
                if out.finish_reason is not None:
                    parts += thinkers[out.index].finish()
                deltas += [DeltaMessage(reasoning_content=t) for kind, t in parts if kind == "reasoning"]
                text = "".join(t for kind, t in parts if kind == "content")
            if parsers is not None:
                found = parsers[out.index].feed(text)
                if out.finish_reason is not None:
                    found += parsers[out.index].finish()
                for event in found:
                    if isinstance(event, ContentDelta):
                        deltas.append(DeltaMessage(content=event.text))
                    elif isinstance(event, DeltaToolCall):
                        deltas.append(DeltaMessage(tool_calls=[event]))
            elif thinkers is not None:
                if text:
                    deltas.append(DeltaMessage(content=text))
            elif out.text and logprobs is None:  # the common chunk: text only
                yield texts[out.index].event(out.text)
            elif out.text:
                deltas.append(DeltaMessage(content=out.text))
            if logprobs is not None and not deltas:
                deltas.append(DeltaMessage())
            for j, delta in enumerate(deltas):
                yield chunk(out.index, delta, logprobs=logprobs if j == 0 else None)
            if out.finish_reason is not None:
                finish = _finish(out.finish_reason)
                if parsers is not None and parsers[out.index].tool_calls:
                    finish = "tool_calls"
                if finish is not None:
                    yield chunk(out.index, DeltaMessage(), finish)

    def usage_chunk(usage: CompletionUsage, session: SessionUsage | None) -> str:
        return sse_event(ChatCompletionChunk(id=chunk_id, model=model, choices=[], usage=usage, session=session))

    return _sse_stream(ctx, request, timer, tally, events(), usage_chunk if body.include_usage else None)


def _text_chunk(chunk_id: str, model: str, index: int, text: str) -> ChatCompletionChunk:
    choice = ChatCompletionChunkChoice(index=index, delta=DeltaMessage(content=text))
    return ChatCompletionChunk(id=chunk_id, model=model, choices=[choice])


@dataclass
class Tally:
    """Token counts of a streamed request, accumulated as its outputs pass by."""

    completion_tokens: int = 0
    cached: int = 0
    finish_reason: str | None = None  # the first choice's


async def _tallied(
    outputs: AsyncIterator[RequestOutput], tally: Tally, timer: RequestTimer
) -> AsyncIterator[RequestOutput]:
    async for out in outputs:
        tally.completion_tokens += len(out.token_ids)
        tally.cached = out.cached_tokens
        if out.index == 0 and out.finish_reason is not None:
            tally.finish_reason = out.finish_reason
        timer.tokens(len(out.token_ids))
        yield out


async def _sse_stream(
    ctx: Context,
    request: Request,
    timer: RequestTimer,
    tally: Tally,
    events: AsyncIterator[str],
    usage_chunk: Callable[[CompletionUsage, SessionUsage | None], str] | None,
) -> AsyncIterator[str]:
    """The events of a streamed reply, then (when asked) a usage chunk, then `[DONE]`. An engine failure midway is
    reported in-band as an error event, since the HTTP status has already been sent."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield _stream_error(f"generation failed: {exc}")
        yield SSE_DONE
        return
    usage = _record(ctx, timer, request, tally.completion_tokens, tally.cached, tally.finish_reason)
    if usage_chunk is not None:
        yield usage_chunk(usage, await _session_usage(ctx, tally.cached))
    yield SSE_DONE


def _stream_error(message: str) -> str:
    return sse_event(ErrorResponse(error=ErrorInfo(message=message, type="server_error", param=None, code=None)))


# -- a generation request, from validation to usage ---------------------------------------------------------------


@dataclass
class Choice:
    """One completion being assembled from engine outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Context:
    """A generation request after validation: what the engine gets and what the response needs."""

    state: ServerState
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    session_id: str | None
    owner: str | None
    request_id: str
    session_tokens_before: int = 0
    session_location_before: str | None = None


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or new_id("req")


async def _prepare(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    params: SamplingParams,
    owner: str | None,
    param: str,
) -> Context:
    check_prompt(state, prompt_ids, params, param)
    capacity = state.engine.llm.pool.capacity
    if body.n > capacity:
        # Each choice needs a state slot at once; more than the pool has could never be admitted.
        raise invalid_request(f"n={body.n} exceeds this server's {capacity} state slots (--max-sessions)", "n")
    if body.session_id is not None and body.n > 1:
        raise invalid_request("n > 1 cannot be combined with session_id (a session continues one conversation)", "n")
    ctx = Context(state, prompt_ids, params, body.n, body.session_id, owner, _request_id(request))
    if body.session_id is not None:
        try:
            session = await state.engine.get_session(body.session_id, owner)
        except ENGINE_ERRORS as exc:
            raise engine_error(exc) from None
        ctx.session_tokens_before = session.num_tokens
        ctx.session_location_before = session.location
    return ctx


async def _run(ctx: Context) -> AsyncIterator[RequestOutput]:
    return await start_generation(
        ctx.state,
        ctx.prompt_ids,
        ctx.params,
        n=ctx.n,
        session_id=ctx.session_id,
        owner=ctx.owner,
        request_id=ctx.request_id,
    )


async def _collect(
    ctx: Context, outputs: AsyncIterator[RequestOutput], timer: RequestTimer
) -> tuple[list[Choice], int]:
    choices = [Choice() for _ in range(ctx.n)]
    cached = 0
    async for out in outputs:
        choice = choices[out.index]
        choice.text += out.text
        choice.token_ids += out.token_ids
        choice.logprobs += out.logprobs
        if out.finish_reason is not None:
            choice.finish_reason = out.finish_reason
        cached = out.cached_tokens
        timer.tokens(len(out.token_ids))
    return choices, cached


def _record(
    ctx: Context, timer: RequestTimer, request: Request, completion_tokens: int, cached: int, finish: str | None
) -> CompletionUsage:
    ctx.state.metrics.count_tokens(len(ctx.prompt_ids), completion_tokens, cached, finish)
    timer.finish()
    request.state.usage = (len(ctx.prompt_ids), completion_tokens, cached)
    return usage_of(len(ctx.prompt_ids), completion_tokens, cached)


async def _session_usage(ctx: Context, cached: int) -> SessionUsage | None:
    if ctx.session_id is None:
        return None
    session = await ctx.state.engine.get_session(ctx.session_id, ctx.owner)
    reset = ctx.session_tokens_before > 0 and cached == 0
    # "disk" is the session store (a directory or Redis): the state was loaded, not found resident.
    resumed_from = "store" if ctx.session_location_before == "disk" else ctx.session_location_before
    return SessionUsage(
        id=ctx.session_id, cached_tokens=cached, reset=reset, num_tokens=session.num_tokens, resumed_from=resumed_from
    )


# -- response pieces ----------------------------------------------------------------------------------------------


def _finish(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else None


def _token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(tok: Tokenizer, entries: list[TokenLogprob]) -> ChoiceLogprobs:
    def token(token_id: int) -> dict[str, Any]:
        return {"token": _token_text(tok, token_id), "bytes": list(tok.token_bytes(token_id))}

    return ChoiceLogprobs(
        content=[
            ChatCompletionTokenLogprob(
                **token(e.token_id),
                logprob=e.logprob,
                top_logprobs=[TopLogprob(**token(i), logprob=lp) for i, lp in e.top],
            )
            for e in entries
        ]
    )


def _completion_logprobs(tok: Tokenizer, entries: list[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for e in entries:
        text = _token_text(tok, e.token_id)
        out.text_offset.append(offset)
        offset += len(text)
        out.tokens.append(text)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({_token_text(tok, i): lp for i, lp in e.top} if e.top else None)
    return out
