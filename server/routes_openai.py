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

from kvfree.engine.protocol import SamplingParams, TokenLogprob
from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.server.auth import OwnerDep, api_key_owner
from kvfree.server.chat_template import render_chat, stop_at_turn_end
from kvfree.server.errors import ErrorInfo, ErrorResponse, error_responses, invalid_request
from kvfree.server.lifecycle import Generation
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
from kvfree.server.state import ServerState, StateDep, check_model
from kvfree.server.structured_outputs import answer_grammar, reply_grammar
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
    info = state.engine.info
    card = ModelCard(
        id=state.model_name,
        object="model",
        created=int(time.time()),
        owned_by="kvfree",
        max_prompt_tokens=state.settings.max_prompt_tokens,
        max_output_tokens=state.settings.max_output_tokens,
        max_context=info.context_limit,
        state_bytes_per_session=info.state_bytes_per_session,
    )
    return ModelList(data=[card])


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_ERRORS)
async def completions(body: CompletionRequest, request: Request, state: StateDep, owner: OwnerDep):
    """Continue a prompt (text or token ids). Set `stream` for server-sent events."""
    check_model(state, body.model)
    tok = state.tokenizer
    if isinstance(body.prompt, str):
        prompt_ids = await state.engine.encode_prompt(body.prompt, "prompt")
    else:
        prompt_ids = list(body.prompt)
    if not prompt_ids:
        raise invalid_request("prompt is empty after tokenization", "prompt")
    params = body.to_sampling_params(state.settings.max_output_tokens)
    params = await state.engine.constrain(params, answer_grammar(body.response_format, body.structured_outputs),
                                          _constraint_param(body))  # fmt: skip
    gen = await _start(state, request, body, prompt_ids, params, owner, "prompt")
    if body.stream:
        return StreamingResponse(_completion_stream(state, body, gen), media_type="text/event-stream")
    choices = await _collect(gen)
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
        usage=_usage(gen),
        session=await gen.session_usage(),
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep, owner: OwnerDep):
    """The assistant's next message, rendered with the checkpoint's chat template. Set `stream` for SSE."""
    check_model(state, body.model)
    tok = state.tokenizer
    choice = body.effective_tool_choice
    text = render_chat(tok, body.messages, template_tools(body.tools, choice), add_generation_prompt=True)
    params = stop_at_turn_end(body.to_sampling_params(state.settings.max_output_tokens), tok)
    answer = answer_grammar(body.response_format, body.structured_outputs)
    grammar = reply_grammar(answer, _constraint_param(body), body.tools, choice, body.parallel_tool_calls, tok)
    params = await state.engine.constrain(params, *grammar)
    fmt = ToolCallFormat.from_tokenizer_config(tok.config) if body.uses_tools else None
    allowed = accepted_tool_names(body.tools, choice)
    thinking = ReasoningFormat.from_tokenizer_config(tok.config)
    prompt_ids = await state.engine.encode_prompt(text, "messages")
    gen = await _start(state, request, body, prompt_ids, params, owner, "messages")
    if body.stream:
        return StreamingResponse(_chat_stream(state, body, gen, fmt, allowed, thinking), media_type="text/event-stream")
    choices = await _collect(gen)
    result = []
    for i, c in enumerate(choices):
        reasoning, content = thinking.split(c.text) if thinking is not None else (None, c.text)
        calls = []
        if fmt is not None:
            content, calls = parse_tool_calls(content, fmt.start, fmt.end, allowed)
        finish = "tool_calls" if calls and c.finish_reason == "stop" else _finish(c.finish_reason)
        result.append(
            ChatCompletionChoice(
                index=i,
                message=ChatCompletionMessage(
                    content=content if (content or not calls) else None, reasoning_content=reasoning,
                    tool_calls=calls or None,
                ),
                logprobs=_chat_logprobs(tok, c.logprobs) if params.logprobs is not None else None,
                finish_reason=finish,
            )
        )
    return ChatCompletionResponse(
        model=state.model_name, choices=result, usage=_usage(gen), session=await gen.session_usage()
    )


# -- streams ------------------------------------------------------------------------------------------------------


def _completion_stream(state: ServerState, body: CompletionRequest, gen: Generation) -> AsyncIterator[str]:
    chunk_id = new_id("cmpl")
    tok = state.tokenizer
    model = state.model_name
    want_logprobs = gen.params.logprobs is not None

    texts = [
        TextEvents(
            lambda text, i=i: CompletionChunk(id=chunk_id, model=model, choices=[CompletionChoice(index=i, text=text)])
        )
        for i in range(gen.n)
    ]

    async def events() -> AsyncIterator[str]:
        offsets = [0] * gen.n
        async for out in gen:
            finish = _finish(out.finish_reason)
            if not out.text and finish is None and not out.logprobs:
                continue
            if finish is None and not want_logprobs:  # the common chunk: text only
                offsets[out.index] += len(out.text)
                yield texts[out.index].event(out.text)
                continue
            logprobs = None
            if want_logprobs:
                logprobs = _completion_logprobs(tok, out.logprobs, offsets[out.index])
            offsets[out.index] += len(out.text)
            choice = CompletionChoice(index=out.index, text=out.text, logprobs=logprobs, finish_reason=finish)
            yield sse_event(CompletionChunk(id=chunk_id, model=model, choices=[choice]))

    def usage_chunk(usage: CompletionUsage, session: SessionUsage | None) -> str:
        return sse_event(CompletionChunk(id=chunk_id, model=model, choices=[], usage=usage, session=session))

    return _sse_stream(gen, events(), usage_chunk if body.include_usage else None)


def _chat_stream(
    state: ServerState,
    body: ChatCompletionRequest,
    gen: Generation,
    fmt: ToolCallFormat | None,
    allowed: frozenset[str] | None,
    thinking: ReasoningFormat | None,
) -> AsyncIterator[str]:
    chunk_id = new_id("chatcmpl")
    tok = state.tokenizer
    model = state.model_name
    parsers = [ToolCallStreamParser(fmt.start, fmt.end, allowed) for _ in range(gen.n)] if fmt else None
    thinkers = [ReasoningStreamParser(thinking) for _ in range(gen.n)] if thinking else None

    def chunk(index: int, delta: DeltaMessage, finish: str | None = None, logprobs=None) -> str:
        choice = ChatCompletionChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=logprobs)
        return sse_event(ChatCompletionChunk(id=chunk_id, model=model, choices=[choice]))

    texts = [TextEvents(lambda text, i=i: _text_chunk(chunk_id, model, i, text)) for i in range(gen.n)]

    async def events() -> AsyncIterator[str]:
        for i in range(gen.n):
            yield chunk(i, DeltaMessage(role="assistant", content=""))
        async for out in gen:
            want_logprobs = gen.params.logprobs is not None and out.logprobs
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
                if parsers is not None and parsers[out.index].tool_calls and finish == "stop":
                    finish = "tool_calls"
                if finish is not None:
                    yield chunk(out.index, DeltaMessage(), finish)

    def usage_chunk(usage: CompletionUsage, session: SessionUsage | None) -> str:
        return sse_event(ChatCompletionChunk(id=chunk_id, model=model, choices=[], usage=usage, session=session))

    return _sse_stream(gen, events(), usage_chunk if body.include_usage else None)


def _text_chunk(chunk_id: str, model: str, index: int, text: str) -> ChatCompletionChunk:
    choice = ChatCompletionChunkChoice(index=index, delta=DeltaMessage(content=text))
    return ChatCompletionChunk(id=chunk_id, model=model, choices=[choice])


async def _sse_stream(
    gen: Generation,
    events: AsyncIterator[str],
    usage_chunk: Callable[[CompletionUsage, SessionUsage | None], str] | None,
) -> AsyncIterator[str]:
    """The events of a streamed reply, then (when asked) a usage chunk, then `[DONE]`. An engine failure midway is
    reported in-band as an error event, since the HTTP status has already been sent."""
    try:
        try:
            async for event in events:
                yield event
        except Exception as exc:
            yield _stream_error(f"generation failed: {exc}")
            yield SSE_DONE
            return
        gen.finish()
        if usage_chunk is not None:
            yield usage_chunk(_usage(gen), await gen.session_usage())
        yield SSE_DONE
    finally:
        await gen.aclose()  # aborts the engine request if the client went away


def _stream_error(message: str) -> str:
    return sse_event(ErrorResponse(error=ErrorInfo(message=message, type="server_error", param=None, code=None)))


# -- a generation request, from validation to usage ---------------------------------------------------------------


@dataclass
class Choice:
    """One completion being assembled from engine outputs."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


async def _start(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    params: SamplingParams,
    owner: str | None,
    param: str,
) -> Generation:
    state.engine.check(prompt_ids, params, param, n=body.n, session_id=body.session_id)
    return await state.engine.start(
        request, prompt_ids, params, n=body.n, session_id=body.session_id, owner=owner, session_usage=True
    )


async def _collect(gen: Generation) -> list[Choice]:
    """The whole reply of every choice; the request's usage is recorded when it ends."""
    choices = [Choice() for _ in range(gen.n)]
    try:
        async for out in gen:
            choice = choices[out.index]
            choice.text += out.text
            choice.logprobs += out.logprobs
            if out.finish_reason is not None:
                choice.finish_reason = out.finish_reason
    finally:
        await gen.aclose()
    gen.finish()
    return choices


def _constraint_param(body: CompletionRequest | ChatCompletionRequest) -> str:
    """The field a reply's own constraint comes from (what a 400 about it names)."""
    return "structured_outputs" if body.structured_outputs is not None else "response_format"


def _usage(gen: Generation) -> CompletionUsage:
    return usage_of(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)


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
