"""The server's engine-independent parts: request schemas and their mapping onto SamplingParams, OpenAI-shaped
errors (handlers, body limit), tool-call parsing, API keys and metrics. No model, no engine."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from kvfree.engine.protocol import MAX_TOP_LOGPROBS
from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.server import auth as auth_module
from kvfree.server.auth import (
    INCORRECT_KEY_MESSAGE,
    MISSING_KEY_MESSAGE,
    APIKeys,
    OwnerDep,
    key_id,
    parse_keys_file,
)
from kvfree.server.errors import (
    APIError,
    ErrorResponse,
    error_responses,
    install_error_handlers,
    not_found,
    prompt_too_long,
    too_many_requests,
    validation_error,
)
from kvfree.server.metrics import Metrics
from kvfree.server.middleware import BodySizeLimitMiddleware
from kvfree.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    DeltaMessage,
    ModelCard,
    ModelList,
    SessionCreateRequest,
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
    template_messages,
    template_tools,
)
from kvfree.server.unicode_check import UnicodeCheckMiddleware
from tests.paths import TINY_CHECKPOINT

CHECKPOINT = TINY_CHECKPOINT
MSGS = [{"role": "user", "content": "hi"}]
TOOL_F = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TOOL_G = {"type": "function", "function": {"name": "get_time"}}
START, END = "<tool_call>", "</tool_call>"


def _param(model: type, data: Any) -> str | None:
    """Validate `data`; it must fail, and the 400 built from the failure names this param."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    error = validation_error(info.value.errors(), data)
    assert error.status == 400
    return error.param


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSGS, **fields}


def _completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "Once", **fields}


# -- schemas: bad input -------------------------------------------------------------------------------------------

BAD_CHAT = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "assistant"}]}, "messages[0]"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
    (_chat(model=7), "model"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(max_tokens=-5), "max_tokens"),
    (_chat(max_tokens="10"), "max_tokens"),
    (_chat(max_tokens=1.5), "max_tokens"),
    (_chat(max_completion_tokens=0), "max_completion_tokens"),
    (_chat(temperature=2.5), "temperature"),
    (_chat(temperature=-0.1), "temperature"),
    (_chat(temperature="hot"), "temperature"),
    (_chat(temperature=True), "temperature"),
    (_chat(top_p=0), "top_p"),
    (_chat(top_p=1.01), "top_p"),
    (_chat(top_k=-2), "top_k"),
    (_chat(top_k=2**31), "top_k"),  # (past what crosses to the engine process)
    (_chat(min_p=1.5), "min_p"),
    (_chat(presence_penalty=2.1), "presence_penalty"),
    (_chat(frequency_penalty=-3), "frequency_penalty"),
    (_chat(repetition_penalty=0), "repetition_penalty"),
    (_chat(repetition_penalty=2.5), "repetition_penalty"),
    (_chat(seed=2**63), "seed"),
    (_chat(seed="1"), "seed"),
    (_chat(n=0), "n"),
    (_chat(n=17), "n"),
    (_chat(stream="yes"), "stream"),
    (_chat(stream_options={"include_usage": True}), "stream_options"),
    (_chat(logprobs=1), "logprobs"),
    (_chat(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1), "top_logprobs"),
    (_chat(top_logprobs=2), "top_logprobs"),
    (_chat(stop=""), "stop"),
    (_chat(stop=["a", ""]), "stop[1]"),
    (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_chat(stop=5), "stop"),
    (_chat(tools=[{"type": "function"}]), "tools[0].function"),
    (_chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0].type"),
    (_chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
    (_chat(tools=[TOOL_F, TOOL_F]), "tools"),
    (_chat(tool_choice="required"), "tool_choice"),
    (_chat(tools=[TOOL_F], tool_choice="any"), "tool_choice"),
    (_chat(tools=[TOOL_F], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (_chat(tools=[TOOL_F], tool_choice={"type": "function", "function": {"name": 1}}), "tool_choice.function.name"),
    (_chat(response_format={"type": "json_schema"}), "response_format"),
    (_chat(response_format={"type": "xml"}), "response_format.type"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
     "response_format.json_schema.name"),
    (_chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (_chat(structured_outputs={}), "structured_outputs"),
    (_chat(structured_outputs={"choice": []}), "structured_outputs.choice"),
    (_chat(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), "structured_outputs"),
    (_chat(logit_bias={"fifty": 10}), "logit_bias"),
    (_chat(logit_bias={"50": 100.5}), "logit_bias"),
    (_chat(session_id=""), "session_id"),
    (_chat(stop_token_ids=[-1]), "stop_token_ids[0]"),
]


@pytest.mark.parametrize(("data", "param"), BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_chat_request_rejects_bad_input_naming_the_field(data: dict, param: str) -> None:
    assert _param(ChatCompletionRequest, data) == param


BAD_COMPLETION = [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": ["a"] * 257}, "prompt"),
    (_completion(logprobs=True), "logprobs"),
    (_completion(logprobs=MAX_TOP_LOGPROBS + 1), "logprobs"),
    (_completion(prompt_logprobs=21), "prompt_logprobs"),
    (_completion(suffix="x"), "suffix"),
    (_completion(best_of=3), "best_of"),
    (_completion(max_tokens=-1), "max_tokens"),
]


@pytest.mark.parametrize(("data", "param"), BAD_COMPLETION, ids=[p for _, p in BAD_COMPLETION])
def test_completion_request_rejects_bad_input_naming_the_field(data: dict, param: str) -> None:
    assert _param(CompletionRequest, data) == param


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
)
def test_non_finite_sampling_values_are_rejected(field: str, value: float) -> None:
    assert _param(ChatCompletionRequest, _chat(**{field: value})) == field
    assert _param(CompletionRequest, _completion(**{field: value})) == field


def test_session_create_request_rules() -> None:
    assert SessionCreateRequest.model_validate({}).prompt is None
    assert SessionCreateRequest.model_validate({"prompt": [1, 2]}).prompt == [1, 2]
    assert len(SessionCreateRequest.model_validate({"messages": MSGS, "tools": [TOOL_F]}).messages or []) == 1
    assert _param(SessionCreateRequest, {"prompt": "x", "messages": MSGS}) == "messages"
    assert _param(SessionCreateRequest, {"messages": []}) == "messages"
    assert _param(SessionCreateRequest, {"prompt": "x", "tools": [TOOL_F]}) == "tools"


def test_unknown_fields_are_ignored_and_compat_fields_accepted() -> None:
    req = ChatCompletionRequest.model_validate(
        _chat(user="u1", metadata={"k": "v"}, store=False, parallel_tool_calls=True, response_format={"type": "text"})
    )
    assert req.messages[0].content == "hi"
    assert CompletionRequest.model_validate(_completion(best_of=2, n=2, echo=False, logit_bias={})).n == 2


def test_prompt_forms() -> None:
    assert CompletionRequest.model_validate({"prompt": "abc"}).prompts == ["abc"]
    assert CompletionRequest.model_validate({"prompt": [5, 6]}).prompts == [[5, 6]]
    assert CompletionRequest.model_validate({"prompt": ["abc"]}).prompts == ["abc"]  # a batch of one
    assert CompletionRequest.model_validate({"prompt": [[5, 6]]}).prompts == [[5, 6]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert CompletionRequest.model_validate({"prompt": [[5], [6, 7]]}).prompts == [[5], [6, 7]]


def test_validation_message_names_field_and_problem() -> None:
    data = _chat(temperature=9)
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(data)
    error = validation_error(info.value.errors(), data)
    assert "'temperature'" in error.message and "less than or equal to 2" in error.message and "9" in error.message
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({})
    assert validation_error(info.value.errors(), {}).message == "Missing required parameter: 'messages'."


# -- schemas: mapping onto SamplingParams -------------------------------------------------------------------------


def test_to_sampling_params_maps_every_field() -> None:
    req = ChatCompletionRequest.model_validate(
        _chat(
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            seed=123,
            stop="END",
            stop_token_ids=[3],
            ignore_eos=True,
            logprobs=True,
            top_logprobs=3,
        )
    )
    p = req.to_sampling_params(max_tokens_limit=100)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.5, 0.9, 40, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos, p.logprobs) == (123, ["END"], [3], True, 3)
    assert p.skip_special_tokens


def test_to_sampling_params_defaults() -> None:
    p = ChatCompletionRequest.model_validate(_chat()).to_sampling_params(max_tokens_limit=64)
    assert (p.max_tokens, p.temperature, p.top_k, p.logprobs, p.seed, p.stop) == (64, 1.0, 0, None, None, [])
    c = CompletionRequest.model_validate(_completion()).to_sampling_params(max_tokens_limit=64)
    assert c.max_tokens == 16  # OpenAI's default for completions
    assert CompletionRequest.model_validate(_completion()).to_sampling_params(max_tokens_limit=8).max_tokens == 8


def test_top_k_off_logprobs_and_seed_folding() -> None:
    assert ChatCompletionRequest.model_validate(_chat(top_k=-1)).to_sampling_params(10).top_k == 0
    assert ChatCompletionRequest.model_validate(_chat(logprobs=True)).to_sampling_params(10).logprobs == 0
    assert CompletionRequest.model_validate(_completion(logprobs=5)).to_sampling_params(10).logprobs == 5
    assert CompletionRequest.model_validate(_completion(logprobs=0)).to_sampling_params(10).logprobs == 0
    seed = ChatCompletionRequest.model_validate(_chat(seed=-1)).to_sampling_params(10).seed
    assert seed is not None and 0 <= seed < 2**63
    assert ChatCompletionRequest.model_validate(_chat(temperature=0)).to_sampling_params(10).greedy


def test_max_completion_tokens_wins_and_server_max_is_enforced() -> None:
    req = ChatCompletionRequest.model_validate(_chat(max_tokens=50, max_completion_tokens=5))
    assert req.to_sampling_params(max_tokens_limit=10).max_tokens == 5
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate(_chat(max_completion_tokens=11)).to_sampling_params(10)
    assert (info.value.status, info.value.param) == (400, "max_completion_tokens")
    assert "10" in info.value.message
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate(_chat(max_tokens=10**30)).to_sampling_params(10)
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    with pytest.raises(APIError) as info:
        CompletionRequest.model_validate(_completion(max_tokens=11)).to_sampling_params(10)
    assert info.value.param == "max_tokens"


def test_tools_keep_special_tokens_and_default_choice() -> None:
    req = ChatCompletionRequest.model_validate(_chat(tools=[TOOL_F]))
    assert req.effective_tool_choice == "auto" and req.uses_tools
    assert not req.to_sampling_params(10).skip_special_tokens  # the tool-call tags are special tokens
    off = ChatCompletionRequest.model_validate(_chat(tools=[TOOL_F], tool_choice="none"))
    assert not off.uses_tools and off.to_sampling_params(10).skip_special_tokens
    assert ChatCompletionRequest.model_validate(_chat()).effective_tool_choice == "none"


def test_include_usage() -> None:
    assert ChatCompletionRequest.model_validate(
        _chat(stream=True, stream_options={"include_usage": True})
    ).include_usage
    assert not ChatCompletionRequest.model_validate(_chat(stream=True)).include_usage


# -- schemas: responses -------------------------------------------------------------------------------------------


def test_stream_chunks_omit_unchanged_delta_fields_and_parse_with_the_openai_sdk() -> None:
    from openai.types.chat import ChatCompletion
    from openai.types.chat import ChatCompletionChunk as SDKChunk

    chunk = ChatCompletionChunk(
        id="chatcmpl-1", model="m", choices=[ChatCompletionChunkChoice(index=0, delta=DeltaMessage(content="Hi"))]
    )
    event = sse_event(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    data = json.loads(event.removeprefix("data: "))
    assert data["choices"][0]["delta"] == {"content": "Hi"}
    assert data["choices"][0]["finish_reason"] is None
    assert SDKChunk.model_validate(data).choices[0].delta.content == "Hi"

    response = ChatCompletionResponse.model_validate(
        {
            "model": "m",
            "choices": [{"index": 0, "message": {"content": None}, "finish_reason": "tool_calls"}],
            "usage": usage_of(prompt_tokens=5, completion_tokens=2, cached_tokens=3),
        }
    )
    sdk = ChatCompletion.model_validate(json.loads(response.model_dump_json()))
    assert sdk.usage is not None and sdk.usage.total_tokens == 7
    assert sdk.usage.prompt_tokens_details is not None and sdk.usage.prompt_tokens_details.cached_tokens == 3
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"


def test_openai_types_in_responses_send_only_the_fields_set() -> None:
    """The `openai` types inside kvfree's responses (usage, logprobs, tool calls, the model card) declare optional
    fields of features kvfree lacks (refusal, audio, completion_tokens_details...): those stay off the wire, through
    FastAPI's response_model as in SSE events, instead of going out as nulls."""
    from openai.types.chat import ChatCompletionTokenLogprob
    from openai.types.chat.chat_completion import ChoiceLogprobs

    call = parse_tool_calls(f'{START}{{"name": "f", "arguments": {{}}}}{END}', START, END)[1][0]
    logprobs = ChoiceLogprobs(
        content=[ChatCompletionTokenLogprob(token="a", logprob=-0.5, bytes=[97], top_logprobs=[])]
    )
    response = ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0, message=ChatCompletionMessage(tool_calls=[call]), logprobs=logprobs, finish_reason="tool_calls"
            )
        ],
        usage=usage_of(prompt_tokens=5, completion_tokens=2, cached_tokens=3),
    )
    card = ModelCard(id="m", object="model", created=1, owned_by="kvfree", max_context=None)
    app = FastAPI()

    @app.get("/chat", response_model=ChatCompletionResponse)
    async def chat() -> ChatCompletionResponse:
        return response

    @app.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card])

    client = TestClient(app)
    for data in (client.get("/chat").json(), json.loads(response.model_dump_json())):
        assert data["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 3},
        }
        choice = data["choices"][0]
        assert choice["message"] == {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        }
        assert choice["logprobs"] == {"content": [{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}]}
        assert set(data) == {"id", "object", "created", "model", "choices", "usage", "system_fingerprint", "session",
                             "prompt_logprobs"}  # (vLLM's, null unless asked)
    assert client.get("/models").json()["data"] == [
        {"id": "m", "object": "model", "created": 1, "owned_by": "kvfree", "max_context": None}
    ]


# -- errors -------------------------------------------------------------------------------------------------------


def _error_app(max_body: int = 2048, keys: APIKeys | None = None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body)
    app.state.api_keys = keys or APIKeys()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> dict:
        return {"max_tokens": req.to_sampling_params(max_tokens_limit=100).max_tokens}

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: str) -> dict:
        raise not_found(f"no session {session_id!r}", param="session_id")

    @app.get("/busy")
    async def busy() -> dict:
        raise too_many_requests(retry_after=2.5)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("secret internals /home/user/key.txt")

    @app.get("/whoami")
    async def whoami(owner: OwnerDep) -> dict:
        return {"owner": owner}

    return app


def _assert_openai_error(response: Any, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_error_handlers_answer_in_openai_shape() -> None:
    client = TestClient(_error_app(), raise_server_exceptions=False)
    ok = client.post("/v1/chat/completions", json=_chat(max_tokens=3))
    assert ok.status_code == 200 and ok.json() == {"max_tokens": 3}

    error = _assert_openai_error(
        client.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}),
        400,
    )
    assert error["message"].startswith("invalid JSON body:") and error["code"] == "invalid_json"

    error = _assert_openai_error(client.post("/v1/chat/completions", json=_chat(temperature=-1)), 400)
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"

    nan_body = json.dumps(_chat(top_p=math.nan)).encode()  # Python writes NaN, and its parser reads it
    error = _assert_openai_error(
        client.post("/v1/chat/completions", content=nan_body, headers={"content-type": "application/json"}), 400
    )
    assert error["param"] == "top_p" and "finite" in error["message"]

    error = _assert_openai_error(client.post("/v1/chat/completions", json=_chat(max_tokens=1000)), 400)
    assert error["param"] == "max_tokens"

    error = _assert_openai_error(client.post("/v1/chat/completions", json=[1, 2]), 400)
    assert error["param"] is None

    error = _assert_openai_error(client.post("/v1/chat/completions"), 400)
    assert "body" in error["message"]

    error = _assert_openai_error(client.get("/v1/nope"), 404)
    assert "/v1/nope" in error["message"]
    _assert_openai_error(client.get("/v1/chat/completions"), 405)

    error = _assert_openai_error(client.get("/v1/sessions/abc"), 404)
    assert error["param"] == "session_id" and "abc" in error["message"]

    busy = client.get("/busy")
    _assert_openai_error(busy, 429)
    assert busy.headers["retry-after"] == "3"


def test_internal_error_is_an_opaque_500_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    client = TestClient(_error_app(), raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR, logger="kvfree.server"):
        response = client.get("/boom")
    error = _assert_openai_error(response, 500)
    assert error["type"] == "server_error"
    assert "secret" not in response.text and "Traceback" not in response.text and "RuntimeError" not in response.text
    assert any(record.exc_info and "secret internals" in str(record.exc_info[1]) for record in caplog.records)


def test_body_over_the_limit_is_413() -> None:
    client = TestClient(_error_app(max_body=200))
    big = _chat(user="x" * 500)
    error = _assert_openai_error(client.post("/v1/chat/completions", json=big), 413)
    assert "200" in error["message"]
    assert client.post("/v1/chat/completions", json=_chat()).status_code == 200


async def _asgi_call(
    chunks: list[bytes],
    headers: list[tuple[bytes, bytes]],
    path_limits: dict[str, int] | None = None,
    wrap: Callable[[Any], Any] | None = None,
) -> tuple[int, bytes, int]:
    """Send a body in `chunks` (no Content-Length: a chunked upload) to `/x` through `wrap(app)` (default: a
    10-byte BodySizeLimitMiddleware with `path_limits`); (status, body, receives the app made)."""
    pending = list(chunks)
    seen = 0

    async def receive() -> dict:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def inner(scope: dict, receive_: Any, send_: Any) -> None:
        nonlocal seen
        body = b""
        while True:
            message = await receive_()
            seen += 1
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send_({"type": "http.response.start", "status": 200, "headers": []})
        await send_({"type": "http.response.body", "body": body})

    middleware = wrap(inner) if wrap else BodySizeLimitMiddleware(inner, max_bytes=10, path_limits=path_limits)
    scope = {"type": "http", "method": "POST", "path": "/x", "headers": headers}
    await middleware(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], body, seen


def test_body_limit_counts_streamed_chunks_and_replays_small_bodies() -> None:
    status, body, seen = asyncio.run(_asgi_call([b"12345", b"67890", b"X"], []))
    assert status == 413 and json.loads(body)["error"]["code"] == "payload_too_large" and seen == 0
    status, body, seen = asyncio.run(_asgi_call([b"12345", b"67890"], []))
    assert (status, body, seen) == (200, b"1234567890", 1)
    status, body, _ = asyncio.run(_asgi_call([b"1"], [(b"content-length", b"11")]))
    assert status == 413  # refused on the declared length alone
    status, body, _ = asyncio.run(_asgi_call([b"x" * 50], [], path_limits={"/x": 100}))
    assert (status, body) == (200, b"x" * 50)  # a path with a larger limit (snapshot uploads)


def test_body_limit_streams_the_bodies_of_paths_with_their_own_limit() -> None:
    """A path in `path_limits` (the snapshot upload) gets its body as it arrives, one receive per chunk instead of
    one replayed whole, still counted: past the limit the app's receive raises and the answer is the 413."""
    status, body, seen = asyncio.run(_asgi_call([b"x" * 60, b"y" * 30], [], path_limits={"/x": 100}))
    assert (status, body, seen) == (200, b"x" * 60 + b"y" * 30, 2)
    status, body, seen = asyncio.run(_asgi_call([b"x" * 60, b"y" * 60, b"z"], [], path_limits={"/x": 100}))
    assert status == 413 and json.loads(body)["error"]["code"] == "payload_too_large"
    assert seen == 1  # the app had the first chunk; the second, over the limit, never reached it
    status, _, seen = asyncio.run(_asgi_call([b"x"], [(b"content-length", b"101")], path_limits={"/x": 100}))
    assert (status, seen) == (413, 0)  # a declared length over the limit is refused before anything is read


def test_unicode_check_leaves_streamed_uploads_unread() -> None:
    """Without a content type a body counts as JSON and is read whole for the check, except on `stream_paths`."""
    chunks = [b"\x00" * 8, b"\xff" * 8]
    streamed = asyncio.run(_asgi_call(chunks, [], wrap=lambda app: UnicodeCheckMiddleware(app, stream_paths={"/x"})))
    assert streamed == (200, b"".join(chunks), 2)
    checked = asyncio.run(_asgi_call(chunks, [], wrap=UnicodeCheckMiddleware))
    assert checked == (200, b"".join(chunks), 1)  # read here, then replayed in one piece


def test_error_helpers() -> None:
    error = prompt_too_long(5000, 4096, param="messages")
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert "5000" in error.message and "4096" in error.message
    assert error.body() == {
        "error": {"message": error.message, "type": "invalid_request_error", "param": "messages", "code": error.code}
    }
    docs = error_responses(400, 429)
    assert set(docs) == {400, 429} and docs[400]["model"] is ErrorResponse


# -- tools --------------------------------------------------------------------------------------------------------


def _call(name: str, args: dict) -> str:
    return f"{START}{json.dumps({'name': name, 'arguments': args})}{END}"


def _stream(text: str, step: int, allowed: set[str] | None = None) -> tuple[str, list, ToolCallStreamParser]:
    parser = ToolCallStreamParser(START, END, allowed)
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i : i + step])
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return content, [e for e in events if not isinstance(e, ContentDelta)], parser


def test_parse_one_call_arguments_as_json_string() -> None:
    content, calls = parse_tool_calls(_call("get_weather", {"city": "Paris", "days": 2}), START, END)
    assert content == ""
    assert len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24
    assert isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_parse_several_calls_with_content_around() -> None:
    text = f"Let me check.\n{_call('get_weather', {'city': 'Oslo'})}\n{_call('get_time', {})}\nDone."
    content, calls = parse_tool_calls(text, START, END)
    assert content == "Let me check.Done."
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert calls[0].id != calls[1].id
    assert json.loads(calls[1].function.arguments) == {}


@pytest.mark.parametrize(
    "text",
    [
        f"{START}{{not json}}{END}",
        f'{START}["a list"]{END}',
        f'{START}{{"arguments": {{}}}}{END}',  # no name
        f'{START}{{"name": "f", "arguments": [1]}}{END}',  # arguments not an object
        f'x {START}{{"name": "f", "arguments": {{}}}}',  # unclosed (cut by max_tokens)
        "plain text, no tags  \n",
        "a < b and <tool but no call",
    ],
)
def test_malformed_or_absent_calls_stay_as_text(text: str) -> None:
    content, calls = parse_tool_calls(text, START, END)
    assert calls == [] and content == text


def test_parameters_alias_and_string_arguments() -> None:
    body = json.dumps({"name": "f", "parameters": {"a": 1}})
    assert json.loads(parse_tool_calls(f"{START}{body}{END}", START, END)[1][0].function.arguments) == {"a": 1}
    body = json.dumps({"name": "f", "arguments": json.dumps({"a": 1})})
    assert json.loads(parse_tool_calls(f"{START}{body}{END}", START, END)[1][0].function.arguments) == {"a": 1}


def test_only_allowed_names_are_calls() -> None:
    text = _call("get_weather", {}) + _call("rm_rf", {})
    content, calls = parse_tool_calls(text, START, END, allowed_names={"get_weather"})
    assert [c.function.name for c in calls] == ["get_weather"]
    assert content == _call("rm_rf", {})


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_an_end_tag_inside_a_string_value_is_part_of_the_value(step: int) -> None:
    """A grammar-valid call may hold its own end tag in a string (a small model wrote `"tier": "}}</tool_call>{"`):
    the call ends at the first end tag outside a JSON string, streamed or whole. An end tag inside a string that
    never closes still ends the (invalid) call as text, and a call after it is still read."""
    value = '}}</tool_call>{"\\'
    text = f"{_call('f', {'tier': value})} and {_call('g', {})}"
    content, deltas, parser = _stream(text, step)
    assert content == parse_tool_calls(text, START, END)[0] == "and"
    assert [json.loads(c.function.arguments) for c in parser.tool_calls] == [{"tier": value}, {}]
    broken = f'{START}{{"name": "f", "arguments": {{"a": "b}}{END} text {_call("g", {})}'
    content, calls = parse_tool_calls(broken, START, END)
    assert content == f'{START}{{"name": "f", "arguments": {{"a": "b}}{END} text'
    assert [c.function.name for c in calls] == ["g"]


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 11, 1000])
def test_streaming_matches_whole_text_for_any_chunking(step: int) -> None:
    text = f"Hi <there>.\n{_call('get_weather', {'city': 'Zürich'})} \n{_call('get_time', {})}\nbye <tool"
    whole_content, whole_calls = parse_tool_calls(text, START, END)
    content, deltas, parser = _stream(text, step)
    assert content == whole_content == "Hi <there>.bye <tool"
    assert [c.function for c in parser.tool_calls] == [c.function for c in whole_calls]
    # OpenAI's streaming shape: per call, a head (index, id, type, name, "" arguments), then the arguments.
    assert [d.index for d in deltas] == [0, 0, 1, 1]
    head, args = deltas[0], deltas[1]
    assert head.id and head.type == "function" and head.function.name == "get_weather"
    assert head.function.arguments == ""
    assert args.id is None and args.function.name is None
    assert json.loads(args.function.arguments) == {"city": "Zürich"}
    assert head.model_dump() == {
        "index": 0,
        "id": head.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert args.model_dump() == {"index": 0, "function": {"arguments": args.function.arguments}}


def test_partial_start_tag_is_held_back_not_lost() -> None:
    parser = ToolCallStreamParser(START, END)
    assert [e.text for e in parser.feed("Hello <tool_") if isinstance(e, ContentDelta)] == ["Hello"]
    assert parser.feed("ca") == []
    events = parser.feed('ll>{"name": "f", "arguments": {}}</tool_')
    assert events == []  # inside a call, the end tag not complete yet
    events = parser.feed("call>")
    assert [type(e).__name__ for e in events] == ["DeltaToolCall", "DeltaToolCall"]
    assert parser.finish() == []
    # A partial tag that turns out not to be one is given back.
    parser = ToolCallStreamParser(START, END)
    held = parser.feed("a <tool")
    assert "".join(e.text for e in held + parser.feed("box> b") + parser.finish()) == "a <toolbox> b"


def test_tool_choice_policies_and_template_inputs() -> None:
    req = ChatCompletionRequest.model_validate(_chat(tools=[TOOL_F, TOOL_G]))
    assert accepted_tool_names(req.tools, req.effective_tool_choice) == {"get_weather", "get_time"}
    assert accepted_tool_names(req.tools, "none") is None
    assert accepted_tool_names(None, "auto") is None
    named = {"type": "function", "function": {"name": "get_time"}}
    req = ChatCompletionRequest.model_validate(_chat(tools=[TOOL_F, TOOL_G], tool_choice=named))
    assert accepted_tool_names(req.tools, req.tool_choice) == {"get_time"}
    assert template_tools(req.tools, req.tool_choice) == [TOOL_G]
    assert template_tools(req.tools, "none") is None
    assert template_tools(req.tools, "required") == [TOOL_F, TOOL_G]
    assert ToolCallFormat.from_tokenizer_config({"tool_call_start": START, "tool_call_end": END}) == ToolCallFormat(
        START, END
    )
    assert ToolCallFormat.from_tokenizer_config({}) is None


def test_template_renders_history_tool_calls_in_the_models_format() -> None:
    tok = Tokenizer(CHECKPOINT)
    fmt = ToolCallFormat.from_tokenizer_config(tok.config)
    assert fmt is not None and fmt == ToolCallFormat(START, END)
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": [TOOL_F]})
    rendered = template_messages(req.messages)
    assert rendered[0]["role"] == "system"
    assert rendered[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    prompt = tok.apply_chat_template(rendered, tools=template_tools(req.tools, req.effective_tool_choice))
    assert '"name": "get_weather"' in prompt and "Weather in Oslo?" in prompt
    assert f'{START}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{END}' in prompt
    # What the model would write back parses into the same call.
    reply = f'{START}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{END}'
    _, calls = parse_tool_calls(reply, fmt.start, fmt.end)
    assert calls[0].function.arguments == '{"city": "Oslo"}'


# -- auth ---------------------------------------------------------------------------------------------------------


def test_keys_from_file_and_env(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("# operators\nsk-one\n\n  sk-two  # laptop\n#sk-disabled\n")
    assert parse_keys_file(path.read_text()) == ["sk-one", "sk-two"]
    keys = APIKeys.from_sources(path, environ={"KVFREE_API_KEYS": " sk-three, ,sk-four"})
    assert keys.enabled and len(keys) == 4
    for key in ("sk-one", "sk-two", "sk-three", "sk-four"):
        assert keys.owner(key) == key_id(key)
    assert keys.owner("sk-disabled") is None and keys.owner("") is None
    assert not APIKeys.from_sources(None, environ={}).enabled
    assert len(APIKeys.from_sources(None, env_var="OTHER", environ={"OTHER": "k1,k2"})) == 2
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="no API key"):
        APIKeys.from_sources(empty, environ={})


def test_key_id_is_short_stable_and_hides_the_key() -> None:
    assert key_id("sk-secret-123") == key_id("sk-secret-123") != key_id("sk-secret-124")
    assert key_id("sk-secret-123").startswith("key-") and len(key_id("sk-secret-123")) == 20
    assert "secret" not in key_id("sk-secret-123")


def test_key_check_compares_every_key_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real_compare = hmac.compare_digest

    def compare(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", compare)
    keys = APIKeys(["k1", "k2", "k3"])
    assert keys.owner("k1") == key_id("k1")
    assert len(calls) == 3  # no early exit at the match
    assert all(len(a) == len(b) == 32 for a, b in calls)  # digests: equal lengths whatever the key's length


def test_api_key_owner_401_messages_and_owner() -> None:
    client = TestClient(_error_app(keys=APIKeys(["sk-good"])))
    error = _assert_openai_error(client.get("/whoami"), 401)
    assert error["message"] == MISSING_KEY_MESSAGE
    error = _assert_openai_error(client.get("/whoami", headers={"Authorization": "Basic abc"}), 401)
    assert error["message"].startswith(MISSING_KEY_MESSAGE)
    response = client.get("/whoami", headers={"Authorization": "Bearer sk-bad"})
    error = _assert_openai_error(response, 401)
    assert error["message"] == INCORRECT_KEY_MESSAGE and error["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer" and "sk-bad" not in response.text
    ok = client.get("/whoami", headers={"Authorization": "Bearer sk-good"})
    assert ok.json() == {"owner": key_id("sk-good")}
    assert TestClient(_error_app()).get("/whoami").json() == {"owner": None}  # auth off


# -- metrics ------------------------------------------------------------------------------------------------------

METRIC_NAMES = [
    "kvfree_requests_total",
    "kvfree_prompt_tokens_total",
    "kvfree_generation_tokens_total",
    "kvfree_cached_prompt_tokens_total",
    "kvfree_time_to_first_token_seconds_bucket",
    "kvfree_inter_token_latency_seconds_bucket",
    "kvfree_e2e_request_latency_seconds_bucket",
    "kvfree_requests_running",
    "kvfree_requests_waiting",
    "kvfree_sessions",
    "kvfree_pool_slots_used",
    "kvfree_pool_slots_total",
    "kvfree_state_bytes_per_session",
    "kvfree_state_bytes_in_use",
    "kvfree_gpu_memory_allocated_bytes",
    "kvfree_gpu_memory_reserved_bytes",
    "kvfree_requests_rejected_total",
]


def test_metrics_render_every_metric_and_instances_do_not_clash() -> None:
    metrics, other = Metrics(), Metrics()  # own registries: no "Duplicated timeseries"
    metrics.count_request("/v1/chat/completions", 200)
    metrics.count_rejected("queue_full")
    metrics.count_tokens(prompt=10, generated=4, cached=6)
    clock = iter([0.0, 0.5, 0.6, 0.9, 1.0]).__next__
    timer = metrics.request_timer(clock=clock)
    timer.tokens(1)  # first token at 0.5
    timer.tokens(1)  # 0.1 later
    timer.tokens(2)  # two tokens 0.3 later: 0.15 each
    timer.finish()
    timer.finish()  # once only
    metrics.update_engine(
        {
            "running": 2,
            "waiting": 1,
            "pool_slots_used": 3,
            "pool_slots_total": 8,
            "state_bytes_per_session": 1000,
            "sessions": {"gpu": 3, "host": 1, "disk": 0},
        }
    )
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in METRIC_NAMES:
        assert name in text, name
    assert 'kvfree_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'kvfree_sessions{location="gpu"} 3.0' in text
    assert "kvfree_state_bytes_in_use 3000.0" in text
    assert "kvfree_gpu_memory_allocated_bytes 0.0" in text
    assert "kvfree_time_to_first_token_seconds_count 1.0" in text
    assert "kvfree_inter_token_latency_seconds_count 3.0" in text
    assert "kvfree_e2e_request_latency_seconds_count 1.0" in text
    assert "kvfree_e2e_request_latency_seconds_sum 1.0" in text
    assert "kvfree_requests_total{" not in other.render()[0].decode()


def test_sse_event_is_one_line_whatever_the_text_holds():
    # A byte-level model can emit U+2028, U+2029 or U+0085: JSON leaves them raw, but str.splitlines (httpx's
    # aiter_lines, many SSE readers) breaks lines at them, which cut an event in two on the device run.
    text = "a\u2028b\u2029c\x85d\re\nf\x1cg"
    chunk = ChatCompletionChunk(
        id="chatcmpl-1", model="m", choices=[ChatCompletionChunkChoice(index=0, delta=DeltaMessage(content=text))]
    )
    event = sse_event(chunk)
    assert event.endswith("\n\n") and len(event.removesuffix("\n\n").splitlines()) == 1
    assert json.loads(event.removeprefix("data: "))["choices"][0]["delta"]["content"] == text


# -- the streaming hot path ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["hi", "", 'é\u2028\u2029\x85\x00"\\\n\x1e日本 </script>'])
def test_text_events_are_byte_identical_to_serialised_chunks(text):
    from kvfree.server.protocol import (
        ChatCompletionChunk,
        ChatCompletionChunkChoice,
        DeltaMessage,
        TextEvents,
        sse_event,
    )

    def make(t: str) -> ChatCompletionChunk:
        choice = ChatCompletionChunkChoice(index=2, delta=DeltaMessage(content=t))
        return ChatCompletionChunk(id="chatcmpl-1", model="m", created=7, choices=[choice])

    event = TextEvents(make).event(text)
    assert event == sse_event(make(text))
    assert event.count("\n") == 2  # one line of data, then the blank line


def test_queued_outputs_of_one_choice_are_coalesced():
    import asyncio

    from kvfree.engine.protocol import RequestOutput
    from kvfree.engine.serving.handle import _coalesced

    def out(index: int, tokens: list[int], finish: str | None = None) -> RequestOutput:
        text = "".join(chr(97 + t) for t in tokens)
        return RequestOutput("r", index, tokens, text, [], finish, 3, 0, len(tokens))

    queue: asyncio.Queue = asyncio.Queue()
    error = RuntimeError("boom")
    for item in [out(0, [1]), out(0, [2], "length"), out(0, [5]), out(1, [3]), out(1, [4]), error]:
        queue.put_nowait(item)
    merged = _coalesced(out(0, [0]), queue)
    assert [(m.index, m.token_ids, m.text, m.finish_reason) for m in merged[:-1]] == [
        (0, [0, 1, 2], "abc", "length"),  # merged up to and including the finish
        (0, [5], "f", None),  # nothing is merged across a finished output
        (1, [3, 4], "de", None),
    ]
    assert merged[-1] is error and queue.empty()


# -- reasoning ----------------------------------------------------------------------------------------------------
THINK = ReasoningFormat("<think>", "</think>")


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        ("<think>\nsteps\n</think>\n\nthe answer", "\nsteps\n", "the answer"),
        ("  <think>a</think>b", "a", "b"),
        ("<think>cut off by max_tokens", "cut off by max_tokens", ""),
        ("<think></think>\n\nx", "", "x"),
        ("no thinking here", None, "no thinking here"),
        (
            "an answer that mentions </think> but never opened it",
            None,
            "an answer that mentions </think> but never opened it",
        ),
        ("<thin is not the tag", None, "<thin is not the tag"),
        ("", None, ""),
    ],
)
def test_reasoning_split_and_its_stream_agree_at_every_chunking(text, reasoning, content):
    """`ReasoningFormat.split` on the whole reply; the stream parser gives the same reasoning and content however
    the reply is cut into pieces (every split into two, and one character at a time), tags cut included."""
    assert THINK.split(text) == (reasoning, content)
    chunkings = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in chunkings:
        parser = ReasoningStreamParser(THINK)
        parts = [p for piece in pieces for p in parser.feed(piece)] + parser.finish()
        got_reasoning = "".join(t for kind, t in parts if kind == "reasoning")
        got_content = "".join(t for kind, t in parts if kind == "content")
        assert (got_reasoning, got_content) == (reasoning or "", content), pieces
        assert all(t for _, t in parts), "no empty parts"


def test_reasoning_format_is_declared_by_the_checkpoint():
    assert ReasoningFormat.from_tokenizer_config({}) is None
    assert ReasoningFormat.from_tokenizer_config({"reasoning_start": "<think>"}) is None
    assert ReasoningFormat.from_tokenizer_config({"reasoning_start": "<think>", "reasoning_end": "</think>"}) == THINK


def test_prompts_are_refused_by_their_length_first_and_long_ones_tokenized_off_the_event_loop() -> None:
    import threading

    from kvfree.engine.text.tokenizer import LONG_TEXT_CHARS
    from kvfree.server.errors import APIError
    from kvfree.server.lifecycle import EngineClient

    class Tokens:
        max_token_chars = 4  # no token is longer than 4 characters

        def __init__(self) -> None:
            self.threads: list[str] = []

        def encode(self, text: str) -> list[int]:
            self.threads.append(threading.current_thread().name)
            return [0] * -(-len(text) // 4)

    tok = Tokens()
    client = EngineClient(engine=None, metrics=None, max_prompt_tokens=100_000, tokenizer=tok)  # type: ignore[arg-type]

    async def main() -> None:
        loop_thread = threading.current_thread().name
        assert len(await client.encode_prompt("a" * 400_000, "prompt")) == 100_000  # at the limit: tokenized
        with pytest.raises(APIError) as refused:
            await client.encode_prompt("a" * 400_001, "messages")  # at least 100,001 tokens: never tokenized
        assert (refused.value.status, refused.value.param, refused.value.code) == (
            400, "messages", "context_length_exceeded"
        )  # fmt: skip
        await client.encode_prompt("b" * LONG_TEXT_CHARS, "prompt")
        assert tok.threads == [tok.threads[0], loop_thread] and tok.threads[0] != loop_thread

    asyncio.run(main())
