"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`."""

from __future__ import annotations

import asyncio
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
from kvfree.server.chat_template import boundary_prefixes, render_chat, stop_at_turn_end
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
    PromptLogprob,
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
        session_slots=info.gpu_slots,
    )
    return ModelList(data=[card])


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_ERRORS)
async def completions(body: CompletionRequest, request: Request, state: StateDep, owner: OwnerDep):
    """Continue a prompt, or each of a batch (text or token ids). Set `stream` for server-sent events; `echo`
    returns the prompt and, with `logprobs`, its tokens' logprobs (`max_tokens: 0` scores it and stops)."""
    check_model(state, body.model)
    tok = state.tokenizer
    _check_scoring(body)
    prompts = [await _prompt_ids(state, prompt) for prompt in body.prompts]
    params = body.to_sampling_params(state.settings.max_output_tokens)
    params = await state.engine.constrain(params, answer_grammar(body.response_format, body.structured_outputs),
                                          _constraint_param(body))  # fmt: skip
    if body.stream:  # (one prompt: `_check_scoring`)
        gen = await _start(state, request, body, prompts[0], params, owner, "prompt")
        return StreamingResponse(_completion_stream(state, body, gen), media_type="text/event-stream")
    score_only = body.max_tokens == 0  # the prompt scored, nothing generated: one engine choice stands for all n
    gens = await _start_all(state, request, body, prompts, params, owner, score_only)
    collected = await asyncio.gather(*(_collect(g) for g in gens))
    choices = []
    for p, (ids, gen_choices) in enumerate(zip(prompts, collected, strict=True)):
        first = gen_choices[0]
        for i in range(body.n):
            c = first if score_only else gen_choices[i]
            choices.append(_completion_choice(tok, body, p * body.n + i, c, ids, first.prompt_logprobs, score_only))
    usages = [_usage(g) for g in gens]
    usage = usage_of(*(sum(getattr(u, f) for u in usages) for f in ("prompt_tokens", "completion_tokens")),
                     sum(u.prompt_tokens_details.cached_tokens for u in usages))  # fmt: skip
    session = await gens[0].session_usage() if len(gens) == 1 else None
    return CompletionResponse(model=state.model_name, choices=choices, usage=usage, session=session)


def _check_scoring(body: CompletionRequest) -> None:
    """400s for the combinations completions do not serve: naming the field to change."""
    if body.max_tokens == 0 and not body.echo:
        raise invalid_request("max_tokens 0 is only for scoring a prompt: set echo (and logprobs)", "max_tokens")
    if body.stream and body.echo:
        raise invalid_request("echo cannot be combined with stream: send the request without stream", "echo")
    if body.stream and body.prompt_logprobs is not None:
        raise invalid_request("prompt_logprobs cannot be combined with stream", "prompt_logprobs")
    if body.stream and len(body.prompts) > 1:
        raise invalid_request("a batch of prompts cannot be streamed: send one request per prompt", "stream")
    if body.session_id is not None and (body.echo or body.prompt_logprobs is not None):
        param = "echo" if body.echo else "prompt_logprobs"
        raise invalid_request(f"{param} cannot be combined with session_id: a session's earlier tokens are not "
                              "scored again; send the whole prompt without session_id", param)  # fmt: skip
    if body.session_id is not None and len(body.prompts) > 1:
        raise invalid_request("a batch of prompts cannot continue one session", "prompt")


async def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    ids = await state.engine.encode_prompt(prompt, "prompt") if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise invalid_request("prompt is empty after tokenization", "prompt")
    return ids


async def _start_all(
    state: ServerState, request: Request, body: CompletionRequest, prompts: list[list[int]], params: SamplingParams,
    owner: str | None, score_only: bool,
) -> list[Generation]:  # fmt: skip
    """A generation per prompt, submitted together; if one is refused, the others are closed and its error raised."""
    started = await asyncio.gather(
        *(_start(state, request, body, ids, params, owner, "prompt", n=1 if score_only else None,
                 prefill_only=score_only) for ids in prompts),
        return_exceptions=True,
    )  # fmt: skip
    failed = [g for g in started if isinstance(g, BaseException)]
    if failed:
        for gen in started:
            if isinstance(gen, Generation):
                await gen.aclose()
        raise failed[0]
    return list(started)


def _completion_choice(
    tok: Tokenizer, body: CompletionRequest, index: int, c: Choice, prompt_ids: list[int],
    prompt_logprobs: list[TokenLogprob | None] | None, score_only: bool,
) -> CompletionChoice:  # fmt: skip
    """One choice of a completions response: the text (after the prompt's with `echo`), its logprobs (the prompt's
    first with `echo`), vLLM's `prompt_logprobs`."""
    as_ids = body.return_tokens_as_token_ids
    text, logprobs = c.text, None
    prompt_text = ""
    if body.echo:
        prompt_text = body.prompt if isinstance(body.prompt, str) else tok.decode(prompt_ids, skip_special_tokens=False)
        text = prompt_text + text
    if body.logprobs is not None:
        logprobs = _completion_logprobs(tok, c.logprobs, len(prompt_text), as_ids)
        if body.echo:
            echoed = _echo_logprobs(tok, prompt_ids, prompt_logprobs, body.logprobs, as_ids)
            logprobs = CompletionLogprobs(**{f: getattr(echoed, f) + getattr(logprobs, f) for f in logprobs_fields})
    return CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason="length" if score_only else _finish(c.finish_reason),
        prompt_logprobs=_vllm_prompt_logprobs(tok, prompt_logprobs, body.prompt_logprobs)
        if body.prompt_logprobs is not None else None,
    )  # fmt: skip


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep, owner: OwnerDep):
    """The assistant's next message, rendered with the checkpoint's chat template. Set `stream` for SSE."""
    check_model(state, body.model)
    tok = state.tokenizer
    if body.prompt_logprobs is not None and (body.stream or body.session_id is not None):
        other = "stream" if body.stream else "session_id"
        raise invalid_request(f"prompt_logprobs cannot be combined with {other}", "prompt_logprobs")
    choice = body.effective_tool_choice
    tools = template_tools(body.tools, choice)
    text = render_chat(tok, body.messages, tools, add_generation_prompt=True)
    params = stop_at_turn_end(body.to_sampling_params(state.settings.max_output_tokens), tok)
    answer = answer_grammar(body.response_format, body.structured_outputs)
    grammar = reply_grammar(answer, _constraint_param(body), body.tools, choice, body.parallel_tool_calls, tok)
    params = await state.engine.constrain(params, *grammar)
    fmt = ToolCallFormat.from_tokenizer_config(tok.config) if body.uses_tools else None
    allowed = accepted_tool_names(body.tools, choice)
    thinking = ReasoningFormat.from_tokenizer_config(tok.config)
    prompt_ids = await state.engine.encode_prompt(text, "messages")
    checkpoint_at = await state.engine.boundaries(boundary_prefixes(tok, body.messages, tools, text), prompt_ids)
    gen = await _start(state, request, body, prompt_ids, params, owner, "messages", checkpoint_at)
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
                logprobs=_chat_logprobs(tok, c.logprobs, body.return_tokens_as_token_ids)
                if params.logprobs is not None else None,
                finish_reason=finish,
            )
        )
    prompt_logprobs = None
    if body.prompt_logprobs is not None:
        prompt_logprobs = _vllm_prompt_logprobs(tok, choices[0].prompt_logprobs, body.prompt_logprobs)
    return ChatCompletionResponse(
        model=state.model_name, choices=result, usage=_usage(gen), session=await gen.session_usage(),
        prompt_logprobs=prompt_logprobs,
    )  # fmt: skip


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
                logprobs = _completion_logprobs(tok, out.logprobs, offsets[out.index], body.return_tokens_as_token_ids)
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
            logprobs = _chat_logprobs(tok, out.logprobs, body.return_tokens_as_token_ids) if want_logprobs else None
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
    prompt_logprobs: list[TokenLogprob | None] | None = None  # (choice 0's: the prompt is the same for all)


async def _start(
    state: ServerState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    params: SamplingParams,
    owner: str | None,
    param: str,
    checkpoint_at: list[int] | None = None,
    n: int | None = None,
    prefill_only: bool = False,
) -> Generation:
    """Check and submit one prompt's generation (`n` choices, by default the body's; `prefill_only`: the prompt
    only, scored), and wait for its first output."""
    n = body.n if n is None else n
    state.engine.check(prompt_ids, params, param, n=n, session_id=body.session_id)
    return await state.engine.start(
        request, prompt_ids, params, n=n, session_id=body.session_id, owner=owner, session_usage=True,
        checkpoint_at=checkpoint_at or [], prefill_only=prefill_only,
    )  # fmt: skip


async def _collect(gen: Generation) -> list[Choice]:
    """The whole reply of every choice; the request's usage is recorded when it ends."""
    choices = [Choice() for _ in range(gen.n)]
    try:
        async for out in gen:
            choice = choices[out.index]
            choice.text += out.text
            choice.logprobs += out.logprobs
            if out.prompt_logprobs is not None:
                choice.prompt_logprobs = out.prompt_logprobs
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


def _token_text(tok: Tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, or `token_id:<id>` (`return_tokens_as_token_ids`)."""
    return f"token_id:{token_id}" if as_id else tok.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(tok: Tokenizer, entries: list[TokenLogprob], as_ids: bool = False) -> ChoiceLogprobs:
    def token(token_id: int) -> dict[str, Any]:
        return {"token": _token_text(tok, token_id, as_ids), "bytes": list(tok.token_bytes(token_id))}

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


logprobs_fields = tuple(CompletionLogprobs.model_fields)  # (parallel lists, one entry per token)


def _echo_logprobs(
    tok: Tokenizer, prompt_ids: list[int], entries: list[TokenLogprob | None] | None, k: int, as_ids: bool
) -> CompletionLogprobs:
    """The prompt's part of echoed logprobs (OpenAI's legacy shape): each prompt token, its logprob and its `k`
    most likely alternatives (null for the first token, and where none was computed), offsets from the text's start."""
    out, offset = CompletionLogprobs(), 0
    entries = entries or [None] * len(prompt_ids)
    for token_id, e in zip(prompt_ids, entries, strict=True):
        text = _token_text(tok, token_id)
        out.text_offset.append(offset)
        offset += len(text)
        out.tokens.append(_token_text(tok, token_id, as_ids) if as_ids else text)
        out.token_logprobs.append(None if e is None else e.logprob)
        out.top_logprobs.append(None if e is None else {_token_text(tok, i, as_ids): lp for i, lp in e.top[:k]})
    return out


def _vllm_prompt_logprobs(tok: Tokenizer, entries: list[TokenLogprob | None] | None, k: int) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), by token id, the token itself (with its
    rank) and the `k` most likely."""
    if entries is None:
        return None
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {str(i): PromptLogprob(logprob=lp, rank=r + 1, decoded_token=_token_text(tok, i))
                  for r, (i, lp) in enumerate(e.top[:k])}  # fmt: skip
        ranked.setdefault(str(e.token_id), PromptLogprob(logprob=e.logprob, rank=e.rank,
                                                          decoded_token=_token_text(tok, e.token_id)))  # fmt: skip
        out.append(ranked)
    return out


def _completion_logprobs(
    tok: Tokenizer, entries: list[TokenLogprob], offset: int = 0, as_ids: bool = False
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for e in entries:
        text = _token_text(tok, e.token_id)
        out.text_offset.append(offset)
        offset += len(text)
        out.tokens.append(_token_text(tok, e.token_id, as_ids) if as_ids else text)
        out.token_logprobs.append(e.logprob)
        out.top_logprobs.append({_token_text(tok, i, as_ids): lp for i, lp in e.top} if e.top else None)
    return out
