"""End-to-end tests of the HTTP server: a real uvicorn server on a free loopback port, driven by the official
`openai` SDK, httpx and schemathesis, in-process (uvicorn in a thread) or as a `kvfree serve` subprocess where a
process boundary matters (restore into a fresh process, SIGTERM and restart).

The models are tiny random checkpoints built by tests/server_fixtures.py: "tiny" (Mamba-2) and "tiny-hybrid"
(Mamba-2 + attention), with weights scaled so that greedy output depends on the whole context and is printable
text, and a "bigram" checkpoint whose greedy reply to any chat is one `get_weather` tool call.
Engine-independent pieces (schemas, error handlers, tool parsing, keys, metrics) are unit-tested in
tests/server/test_server_units.py; these tests check what a client sees.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import re
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvfree.engine.state.snapshot import header_length
from kvfree.server.settings import ServerSettings
from tests.server_fixtures import (
    TOOL_CALL_TEXT,
    TOOL_PIECES,
    ProcServer,
    ThreadServer,
    assert_openai_error,
    make_checkpoint,
    make_thinking_checkpoint,
    make_tool_checkpoint,
    metric_value,
    serve,
    served_fixture,
    wait_for,
)

SYSTEM = {"role": "system", "content": "You are a terse assistant."}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
MAX_FUZZ_EXAMPLES = 20  # per route, mode and target: ~20 s in all on 2 CPU cores


# -- fixtures -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "tiny": make_checkpoint("tiny", root / "tiny"),
        "tiny-hybrid": make_checkpoint("tiny-hybrid", root / "tiny-hybrid"),
        "tool": make_tool_checkpoint(root / "tool"),
        "thinking": make_thinking_checkpoint(root / "thinking"),
    }


tiny_server = served_fixture("tiny", "kvfree-tiny", max_sessions=16)
hybrid_server = served_fixture("tiny-hybrid", "kvfree-hybrid", max_sessions=16, max_context=2048)


@pytest.fixture(params=["tiny", "tiny-hybrid"])
def server(request) -> ThreadServer:
    """The same test against the Mamba-2 and the hybrid (attention KV cache) model."""
    return request.getfixturevalue("tiny_server" if request.param == "tiny" else "hybrid_server")


tool_server = served_fixture("tool", "kvfree-tool", max_sessions=4)


@pytest.fixture(scope="module")
def limits_server(ckpts, tmp_path_factory):
    """Small limits, for bad input and fuzzing: a tiny snapshot (~150 KB) fits under the body limit. Idle sessions
    (the fuzzer's, and those of stored responses) spill to a snapshot directory, so they never hold every slot."""
    server = serve(
        ckpts["tiny"],
        "kvfree-tiny",
        max_sessions=8,
        max_host_sessions=8,
        snapshot_dir=tmp_path_factory.mktemp("limits-snapshots"),
        max_prompt_tokens=128,
        max_output_tokens=32,
        max_body_bytes=200_000,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def restore_proc(ckpts, tmp_path_factory):
    """A fresh `kvfree serve` process of the tiny checkpoint, to restore snapshots taken elsewhere into."""
    log = tmp_path_factory.mktemp("restore-proc") / "server.log"
    proc = ProcServer(ckpts["tiny"], ["--served-model-name", "kvfree-tiny", "--max-sessions", "4"], log).start()
    yield proc
    proc.kill()


# -- helpers ------------------------------------------------------------------------------------------------------


def _served(server) -> str:
    return server.settings.served_model_name if isinstance(server, ThreadServer) else "kvfree-tiny"


def chat(server, messages: list[dict], session_id: str | None = None, max_tokens: int = 8, **kw: Any):
    """A greedy chat completion through the openai SDK (session_id, if any, in extra_body)."""
    extra = dict(kw.pop("extra_body", {}) or {})
    if session_id is not None:
        extra["session_id"] = session_id
    kw.setdefault("temperature", 0)
    return server.openai().chat.completions.create(
        model=_served(server), messages=messages, max_tokens=max_tokens, extra_body=extra or None, **kw
    )


def session_ext(response) -> dict[str, Any]:
    """The `session` extension of a response parsed by the openai SDK."""
    return response.model_extra["session"]


def same_reply(a, b) -> None:
    """Two chat responses carry the same single reply (text, finish reason, token counts)."""
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason == b.choices[0].finish_reason
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.usage.completion_tokens == b.usage.completion_tokens


def new_session(server, **body: Any) -> dict[str, Any]:
    with server.http() as http:
        r = http.post("/v1/sessions", json=body)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["object"] == "session" and info["id"].startswith("sess_")
    return info


def get_session(server, sid: str, **kw: Any) -> httpx.Response:
    with server.http() as http:
        return http.get(f"/v1/sessions/{sid}", **kw)


def continue_and_check(server, sid: str, history: list[dict], expect_cached: int | None) -> Any:
    """One session turn: same reply as the whole history without a session, only the new part prefilled.
    `expect_cached` None: a new session's first turn, which may resume from a prefix cache checkpoint of an earlier
    request (the shared system prompt), whatever its length."""
    r = chat(server, history, session_id=sid)
    same_reply(r, chat(server, history))
    ext = session_ext(r)
    assert ext["id"] == sid
    if expect_cached is None:
        expect_cached = ext["cached_tokens"]
        assert 0 <= expect_cached < r.usage.prompt_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == expect_cached == ext["cached_tokens"]
    assert ext["reset"] is False
    # The state now holds the prompt and the reply (all but, possibly, the last sampled token).
    assert r.usage.prompt_tokens <= ext["num_tokens"] <= r.usage.prompt_tokens + r.usage.completion_tokens
    assert get_session(server, sid).json()["num_tokens"] == ext["num_tokens"]
    return r


def metrics(server) -> str:
    with server.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200
    return r.text


def sse_events(lines) -> list[Any]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def snapshot_of(server, sid: str) -> bytes:
    with server.http() as http:
        r = http.get(f"/v1/sessions/{sid}/snapshot")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    return r.content


def restore(server, data: bytes, **kw: Any) -> httpx.Response:
    with server.http() as http:
        return http.post(
            "/v1/sessions/restore", content=data, headers={"content-type": "application/octet-stream"}, **kw
        )


def tampered(data: bytes) -> bytes:
    """The snapshot with one bit flipped in its tensor data (after the safetensors header)."""
    (header_len,) = struct.unpack("<Q", data[:8])
    pos = 8 + header_len + (len(data) - 8 - header_len) // 2
    return data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1 :]


def two_turn_session(server, user_turns=("Hello there.", "Tell me more.")) -> tuple[str, list[dict]]:
    """A session with a system prompt and `user_turns` answered; returns (id, history ending with the reply)."""
    sid = new_session(server)["id"]
    history = [SYSTEM]
    for text in user_turns:
        history.append({"role": "user", "content": text})
        r = chat(server, history, session_id=sid)
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    return sid, history


def test_the_test_models_remember_distant_tokens(server):
    """Not a server property but a premise of the session and snapshot tests: with these checkpoints a state that
    lost or garbled a token a hundred tokens back gives another reply, so "same reply" means "same state"."""
    client = server.openai()
    tail = " The quick brown fox jumps over the lazy dog." * 3
    replies = {
        client.completions.create(model=_served(server), prompt=first + tail, max_tokens=24, temperature=0)
        .choices[0]
        .text
        for first in "ABCD"
    }
    assert len(replies) >= 3, replies  # (two first letters may happen to leave the same trace)


# == 1. the openai SDK as client ==================================================================================


def test_openai_sdk_completions_and_chat(tiny_server):
    client = tiny_server.openai()
    assert [m.id for m in client.models.list().data] == ["kvfree-tiny"]

    c = client.completions.create(
        model="kvfree-tiny", prompt="Hello", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert c.object == "text_completion" and c.id.startswith("cmpl-") and c.model == "kvfree-tiny"
    assert len(c.choices) == 1 and c.choices[0].index == 0
    assert c.choices[0].finish_reason == "length" and len(c.choices[0].text) == 6  # byte tokenizer, ASCII output
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (5, 6, 11)

    r = client.chat.completions.create(
        model="kvfree-tiny", messages=[SYSTEM, {"role": "user", "content": "hi"}], max_tokens=6, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "kvfree-tiny"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 6

    # Streaming through the SDK: chunks parse, the first carries the role, the last a finish_reason.
    stream = client.chat.completions.create(
        model="kvfree-tiny",
        messages=[SYSTEM, {"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens

    # A model name the server does not serve is the SDK's NotFoundError.
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=2)
    assert info.value.body["param"] == "model"


def test_logit_bias_steers_both_endpoints_through_the_sdk(tiny_server):
    """OpenAI's `logit_bias` (token ids as strings): +100 makes a sampled reply that one token, on every choice of
    n=2 and streamed too; -100 bans it."""
    client = tiny_server.openai()
    with tiny_server.http() as http:
        a = http.post("/tokenize", json={"prompt": "A"}).json()["tokens"][-1]
        forced = http.post("/detokenize", json={"tokens": [a] * 5}).json()["prompt"]
    common = {"model": "kvfree-tiny", "max_tokens": 5, "temperature": 1.0, "seed": 3, "logit_bias": {str(a): 100},
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    r = client.completions.create(prompt="Once upon a time", n=2, **common)
    assert [c.text for c in r.choices] == [forced, forced]
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **common)
    assert chat.choices[0].message.content == forced
    streamed = client.completions.create(prompt="Once upon a time", stream=True, **common)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == forced
    banned = client.completions.create(prompt="Once upon a time", **{**common, "logit_bias": {str(a): -100}})
    assert forced[0] not in banned.choices[0].text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_n2_seeded_sampling_is_reproducible_and_choices_differ(tiny_server, endpoint):
    client = tiny_server.openai()
    common = {"model": "kvfree-tiny", "n": 2, "temperature": 1.0, "seed": 1234, "max_tokens": 12}

    def texts(**kw):
        if endpoint == "chat":
            r = client.chat.completions.create(
                messages=[{"role": "user", "content": "Tell a story"}], **{**common, **kw}
            )
            return r, [c.message.content for c in r.choices]
        r = client.completions.create(prompt="Once upon a time", **{**common, **kw})
        return r, [c.text for c in r.choices]

    first, a = texts()
    assert [c.index for c in first.choices] == [0, 1]
    assert a[0] != a[1], "two choices of one seeded request must be independent draws"
    assert texts()[1] == a, "the same seed must give the same choices"
    assert texts(seed=4321)[1] != a
    assert 2 <= first.usage.completion_tokens <= 24  # both choices, counted together

    # Streamed, each choice's deltas (interleaved by index) add up to the same texts.
    stream = (
        client.chat.completions.create(messages=[{"role": "user", "content": "Tell a story"}], stream=True, **common)
        if endpoint == "chat"
        else client.completions.create(prompt="Once upon a time", stream=True, **common)
    )
    got = ["", ""]
    finish = [None, None]
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] += (c.delta.content or "") if endpoint == "chat" else c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert got == a
    assert finish == [c.finish_reason for c in first.choices]


def test_tools_are_accepted_and_plain_replies_have_no_tool_calls(tiny_server, tool_server):
    # A model that does not call the tool: the reply is text, finish_reason stop or length.
    r = chat(tiny_server, [{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL])
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")

    # The tool-calling model cut short by max_tokens: an unclosed call stays text, finish_reason length.
    r = chat(tool_server, [{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL], max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "<tool_call>" + TOOL_PIECES[0]

    # ... or by a stop string inside the call: text up to the stop string, finish_reason stop.
    r = chat(tool_server, [{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL], stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == "<tool_call>" + TOOL_CALL_TEXT.split("Paris")[0]


def _check_weather_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_tool_call_parsed_non_streamed_and_streamed(tool_server):
    client = tool_server.openai()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="kvfree-tool", messages=messages, tools=[WEATHER_TOOL], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    _check_weather_call(choice.message.tool_calls[0])

    # Through the SDK's stream accumulation (`chat.completions.stream`): the same call.
    with client.chat.completions.stream(
        model="kvfree-tool", messages=messages, tools=[WEATHER_TOOL], temperature=0
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    fc = final.choices[0]
    assert fc.finish_reason == "tool_calls" and not fc.message.content
    assert len(fc.message.tool_calls) == 1
    _check_weather_call(fc.message.tool_calls[0])

    # The raw deltas, as OpenAI streams them: id, type and name with empty arguments, then the arguments.
    with (
        tool_server.http() as http,
        http.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": messages, "tools": [WEATHER_TOOL], "temperature": 0, "stream": True},
        ) as resp,
    ):
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Paris"}
    assert not "".join(d.get("content") or "" for d in deltas), "a reply of only a tool call has no content"
    assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "tool_calls"

    # n=2: every choice is parsed on its own.
    r = client.chat.completions.create(model="kvfree-tool", messages=messages, tools=[WEATHER_TOOL], temperature=0, n=2)
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "tool_calls"]
    for c in r.choices:
        _check_weather_call(c.message.tool_calls[0])


def test_reasoning_is_split_out_non_streamed_and_streamed(ckpts):
    """A checkpoint that declares reasoning tags (Qwen3's `<think>`): the thinking comes back as
    `reasoning_content`, the answer as `content`, the same whether streamed or not; a client that sends the message
    back with its reasoning is accepted."""
    server = serve(ckpts["thinking"], "kvfree-thinking", max_sessions=2)
    try:
        client = server.openai()
        messages = [{"role": "user", "content": "Where is Paris?"}]
        r = client.chat.completions.create(model="kvfree-thinking", messages=messages, temperature=0)
        message = r.choices[0].message
        assert message.reasoning_content == "Paris is in France."
        assert message.content == "It is in France, Europe." and r.choices[0].finish_reason == "stop"
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(model="kvfree-thinking", messages=messages, temperature=0,
                                                    stream=True):  # fmt: skip
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
        assert (reasoning, content) == ("Paris is in France.", "It is in France, Europe.")
        history = [*messages, {"role": "assistant", "content": message.content,
                               "reasoning_content": message.reasoning_content},
                   {"role": "user", "content": "And Rome?"}]  # fmt: skip
        again = client.chat.completions.create(model="kvfree-thinking", messages=history, temperature=0)
        assert again.choices[0].message.content == "It is in France, Europe."
    finally:
        server.stop()


def test_tool_choice_none_named_and_history_with_tool_results(tool_server):
    client = tool_server.openai()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    # "none": tools hidden from the model, nothing parsed; the tags are special tokens, dropped from the text.
    r = client.chat.completions.create(
        model="kvfree-tool", messages=messages, tools=[WEATHER_TOOL], tool_choice="none", temperature=0
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == TOOL_CALL_TEXT
    assert r.choices[0].finish_reason == "stop"

    # A named function: its call is parsed.
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model="kvfree-tool", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named, temperature=0
    )
    _check_weather_call(r.choices[0].message.tool_calls[0])
    # Another function named: the grammar makes the reply a call to it, whatever the model prefers (this one knows
    # only get_weather's call, so it is cut by max_tokens inside the arguments: text, finish_reason length).
    other = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model="kvfree-tool", messages=messages, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=other, temperature=0,
        max_tokens=40,
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith('<tool_call>{"name": "get_time", "arguments": {')
    assert r.choices[0].finish_reason == "length"

    # The SDK sends the call and its result back: the history renders and the model answers again.
    call = (
        client.chat.completions.create(model="kvfree-tool", messages=messages, tools=[WEATHER_TOOL], temperature=0)
        .choices[0]
        .message
    )
    history = [
        *messages,
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temp_c": 18}'},
    ]
    r = client.chat.completions.create(model="kvfree-tool", messages=history, tools=[WEATHER_TOOL], temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_weather_call(r.choices[0].message.tool_calls[0])


# == 2. streamed == non-streamed; concurrency ======================================================================


def test_streamed_equals_non_streamed(server):
    client = server.openai()
    name = _served(server)
    messages = [SYSTEM, {"role": "user", "content": "Describe the sea in one line."}]
    full = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(
        model=name,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert text == full.choices[0].message.content and len(text) > 0
    assert finish == full.choices[0].finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)

    # Completions, with logprobs: the same tokens, and they spell the text.
    kw = {"model": name, "prompt": "The lighthouse keeper", "max_tokens": 24, "temperature": 0, "logprobs": 2}
    full = client.completions.create(**kw)
    tokens, text = [], ""
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens if c.logprobs else []
    assert text == full.choices[0].text
    assert tokens == full.choices[0].logprobs.tokens
    assert "".join(tokens) == text
    assert all(len(top) <= 2 for top in full.choices[0].logprobs.top_logprobs)

    # A stop string: both cut the text before its first occurrence and finish with "stop".
    whole = full.choices[0].text
    assert len(whole) >= 12, whole
    stop = whole[8:10]
    expected = whole[: whole.find(stop)]
    cut = client.completions.create(stop=[stop], **kw)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    streamed = "".join(
        c.text for chunk in client.completions.create(stream=True, stop=[stop], **kw) for c in chunk.choices
    )
    assert streamed == expected


def test_chat_logprobs_bytes_are_each_tokens_own(server):
    """`bytes` is what the token stands for: byte-level tokens that split a UTF-8 character all read as U+FFFD, yet
    each keeps its own byte, so clients can tell alternatives apart and rebuild the exact text."""
    client = server.openai()
    reply = client.chat.completions.create(
        model=_served(server),
        messages=[{"role": "user", "content": "Say something"}],
        max_tokens=24,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 24
    raw = b"".join(bytes(entry.bytes) for entry in content)
    assert raw.decode("utf-8", errors="replace") == reply.choices[0].message.content
    for entry in content:
        alternatives = [bytes(top.bytes) for top in entry.top_logprobs]
        assert len(set(alternatives)) == len(alternatives) == 5  # no two alternatives read alike
        assert bytes(entry.bytes) in alternatives  # greedy: the pick is the top one


def _request(i: int) -> tuple[str, dict[str, Any]]:
    """The i-th of a set of different requests: chat or completion, prompts and lengths of various sizes, most
    greedy, some seeded sampling (whose draws must not depend on the batch either)."""
    words = " ".join(f"w{(i * 7 + k) % 23}" for k in range((i * 5) % 40 + 1))
    body: dict[str, Any] = {"max_tokens": 3 + (i * 3) % 14, "temperature": 0}
    if i % 5 == 4:
        body.update(temperature=0.8, seed=i)
    if i % 2:
        return "chat", {**body, "messages": [SYSTEM, {"role": "user", "content": f"#{i}: {words}"}]}
    return "completions", {**body, "prompt": f"#{i}: {words}"}


async def _run_request(client: openai.AsyncOpenAI, name: str, kind: str, body: dict, stream: bool):
    if kind == "chat":
        if not stream:
            r = await client.chat.completions.create(model=name, **body)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        text, finish, usage = "", None, None
        s = await client.chat.completions.create(
            model=name, stream=True, stream_options={"include_usage": True}, **body
        )
        async for chunk in s:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            else:
                usage = chunk.usage
        return text, finish, usage.completion_tokens
    if not stream:
        r = await client.completions.create(model=name, **body)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    text, finish, usage = "", None, None
    s = await client.completions.create(model=name, stream=True, stream_options={"include_usage": True}, **body)
    async for chunk in s:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    return text, finish, usage.completion_tokens


def test_32_concurrent_requests_equal_each_run_alone(server):
    name = _served(server)
    requests = [_request(i) for i in range(32)]

    async def alone():
        async with server.async_openai() as client:
            return [await _run_request(client, name, kind, body, False) for kind, body in requests]

    async def together():
        async with server.async_openai() as client:
            return await asyncio.gather(
                *(_run_request(client, name, kind, body, i % 3 == 0) for i, (kind, body) in enumerate(requests))
            )

    reference = asyncio.run(alone())
    assert len({r[0] for r in reference}) > 16, "the requests must give different replies to be a test"
    concurrent = asyncio.run(together())
    for i, (want, got) in enumerate(zip(reference, concurrent, strict=True)):
        assert got == want, f"request {i} ({requests[i][0]}) differs when run with 31 others"


# == 3. sessions ===================================================================================================


def test_session_turns_prefill_only_the_new_part_and_match_the_whole_history(server):
    sid = new_session(server)["id"]
    history = [SYSTEM]
    cached = None
    for turn, text in enumerate(["Hello there.", "Tell me more.", "And then?"]):
        history.append({"role": "user", "content": text})
        r = continue_and_check(server, sid, history, expect_cached=cached)
        if turn > 0:
            assert cached > 0
        cached = session_ext(r)["num_tokens"]
        history.append({"role": "assistant", "content": r.choices[0].message.content})

    # Edit the history (the first user turn): not a continuation, so the session starts over, from the prefix
    # cache's checkpoint at the end of the system prompt, and is correct; the response says so, and /metrics counts
    # it.
    resets = metric_value(metrics(server), "kvfree_session_resets")
    edited = [SYSTEM, {"role": "user", "content": "Good evening."}, *history[2:], {"role": "user", "content": "Why?"}]
    r = chat(server, edited, session_id=sid)
    same_reply(r, chat(server, edited))
    ext = session_ext(r)
    system_only = len(server.app.state.kvfree.tokenizer.apply_chat_template([SYSTEM]))
    assert ext["reset"] is True and ext["cached_tokens"] == r.usage.prompt_tokens_details.cached_tokens
    assert 0 < ext["cached_tokens"] <= system_only + 2  # (the template's tokens around the message)
    wait_for(lambda: metric_value(metrics(server), "kvfree_session_resets") == resets + 1, timeout=5,
             message="the reset counted in /metrics")  # fmt: skip
    # ... and continues the edited conversation from then on.
    edited += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "Ok."}]
    continue_and_check(server, sid, edited, expect_cached=ext["num_tokens"])


def test_session_created_with_messages_is_prefilled(server):
    info = new_session(server, messages=[SYSTEM])
    assert info["num_tokens"] > 0
    history = [SYSTEM, {"role": "user", "content": "Hi!"}]
    continue_and_check(server, info["id"], history, expect_cached=info["num_tokens"])
    # A completions session continues a text prompt the same way.
    info = new_session(server, prompt="Once upon a time")
    client = server.openai()
    kw = {"model": _served(server), "prompt": "Once upon a time, far away", "max_tokens": 8, "temperature": 0}
    r = client.completions.create(extra_body={"session_id": info["id"]}, **kw)
    assert r.choices[0].text == client.completions.create(**kw).choices[0].text
    assert r.usage.prompt_tokens_details.cached_tokens == len("Once upon a time")


# == 4. snapshots: restore in a fresh process, refusals, fork ======================================================


def test_snapshot_restores_into_a_fresh_process(tiny_server, restore_proc):
    sid, history = two_turn_session(tiny_server)
    info = get_session(tiny_server, sid).json()
    data = snapshot_of(tiny_server, sid)

    r = restore(restore_proc, data)
    assert r.status_code == 200, r.text
    restored = r.json()
    assert restored["num_tokens"] == info["num_tokens"] and restored["id"] != sid

    history.append({"role": "user", "content": "What next?"})
    here = continue_and_check(tiny_server, sid, history, expect_cached=info["num_tokens"])
    there = chat(restore_proc, history, session_id=restored["id"])
    same_reply(there, here)
    assert session_ext(there)["cached_tokens"] == info["num_tokens"]
    assert session_ext(there)["reset"] is False


def test_bad_snapshots_are_refused(tiny_server, hybrid_server, tool_server, restore_proc):
    sid, _ = two_turn_session(tiny_server, user_turns=("Hello.",))
    good = snapshot_of(tiny_server, sid)
    other_model = snapshot_of(tool_server, new_session(tool_server, prompt="hello")["id"])
    other_arch = snapshot_of(hybrid_server, new_session(hybrid_server, prompt="hello")["id"])
    cases = {
        "tampered": (tampered(good), "checksum_mismatch"),
        "truncated": (good[: len(good) - 100], "invalid_snapshot"),
        "half": (good[: len(good) // 2], "invalid_snapshot"),
        "garbage": (b"definitely not a snapshot", "invalid_snapshot"),
        "other model": (other_model, "model_mismatch"),
        "other architecture": (other_arch, "model_mismatch"),
    }
    for name, (data, code) in cases.items():
        r = restore(restore_proc, data)
        err = assert_openai_error(r, 400, param="snapshot")
        assert err["code"] == code, (name, err)
    assert_openai_error(restore(restore_proc, b""), 400, param="snapshot")
    # The SDK maps the refusal onto BadRequestError.
    with pytest.raises(openai.BadRequestError):
        restore_proc.openai().post(
            "/sessions/restore",
            cast_to=httpx.Response,
            content=tampered(good),
            options={"headers": {"Content-Type": "application/octet-stream"}},
        )
    # The good one still restores.
    assert restore(restore_proc, good).status_code == 200


def _send_restore_head(server, body: bytes, declared: int) -> socket.socket:
    """A raw connection that has sent a restore request declaring `declared` body bytes, of which only `body`."""
    sock = socket.create_connection(("127.0.0.1", server.settings.port), timeout=30)
    head = "POST /v1/sessions/restore HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
    sock.sendall(f"{head}Content-Length: {declared}\r\n\r\n".encode() + body)
    return sock


def _read_response(sock: socket.socket) -> httpx.Response:
    """The HTTP response read off a raw connection (one with a Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"connection closed before a response: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    headers = [tuple(part.strip() for part in line.split(":", 1)) for line in lines]
    length = int(dict((k.lower(), v) for k, v in headers)["content-length"])
    while len(body) < length:
        body += sock.recv(65536) or pytest.fail("connection closed inside the response")
    return httpx.Response(int(status.split()[1]), headers=headers, content=body[:length])


def test_snapshots_stream_through_temp_files_that_never_outlive_their_request(
    tiny_server, tool_server, tmp_path, monkeypatch
):
    """Without memory files (memfd: not Linux), both snapshot routes pass the file through a temporary file of the
    front (in /dev/shm where it exists; here a directory of the test's), gone when the request ends, whether it
    succeeded, failed, or its client went away. A restore is refused from the header alone, while the client still
    has most of the body to send."""
    from kvfree.server import snapshot_files

    temp = tmp_path / "shm"
    temp.mkdir()
    monkeypatch.setattr(snapshot_files, "FAST_TEMP_DIR", str(temp))
    monkeypatch.setattr(tiny_server.app.state.kvfree, "snapshot_files", snapshot_files.SnapshotFiles(memfd=False))

    def left() -> list[str]:
        return sorted(p.name for p in temp.iterdir())

    sid, history = two_turn_session(tiny_server, user_turns=("Hello.",))
    with tiny_server.http() as http:
        r = http.get(f"/v1/sessions/{sid}/snapshot")
        assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
        assert r.headers["content-disposition"] == f'attachment; filename="{sid}.safetensors"'
        good = r.content
        assert left() == []
        assert_openai_error(http.get("/v1/sessions/sess_0123456789abcdef01234567/snapshot"), 404)
        assert left() == []
    other = snapshot_of(tool_server, new_session(tool_server, prompt="hello")["id"])
    for data, code in [(good[:-1], "invalid_snapshot"), (good[:5], "invalid_snapshot"), (other, "model_mismatch")]:
        assert assert_openai_error(restore(tiny_server, data), 400, param="snapshot")["code"] == code
        assert left() == []
    assert_openai_error(restore(tiny_server, b""), 400, param="snapshot")
    assert left() == []
    r = restore(tiny_server, good)
    assert r.status_code == 200, r.text
    assert left() == []
    history.append({"role": "user", "content": "And then?"})
    before = get_session(tiny_server, sid).json()["num_tokens"]
    continue_and_check(tiny_server, r.json()["id"], history, expect_cached=before)

    # Another model's snapshot is refused once its header is in: the rest of its body is never sent.
    (n,) = struct.unpack("<Q", other[:8])
    with contextlib.closing(_send_restore_head(tiny_server, other[: 8 + n + 100], len(other))) as sock:
        err = assert_openai_error(_read_response(sock), 400, param="snapshot")
    assert err["code"] == "model_mismatch" and left() == []
    # A client that goes away mid-upload leaves nothing behind either.
    sock = _send_restore_head(tiny_server, good[: len(good) // 2], len(good))
    wait_for(lambda: left() != [], 10, message="the upload's temporary file")
    sock.close()
    wait_for(lambda: left() == [], 10, message="the temporary file of an abandoned upload to go")


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memory files (memfd) are Linux's")
def test_snapshots_cross_in_memory_files_that_are_reused(tiny_server):
    """On Linux a snapshot crosses between the front and the engine in a memory file (no name anywhere, freed by the
    kernel however the server ends), kept after its request so that the next snapshot writes into pages already
    there; at most `keep` are kept. Several downloads and restores in a row, some failing, all come out whole."""
    files = tiny_server.app.state.kvfree.snapshot_files
    assert files.memfd
    sid, history = two_turn_session(tiny_server, user_turns=("Hello.",))
    first = snapshot_of(tiny_server, sid)
    # (a download's file goes back once its response has ended, a moment after the client has the last byte)
    wait_for(lambda: files.idle == 1, 10, message="the download's file to go back")
    carrier = files._idle[0]
    state = first[header_length(first) :]

    def same_state(data: bytes) -> bool:  # (the header differs: it says when the snapshot was taken)
        return len(data) == len(first) and data[header_length(data) :] == state

    for _ in range(3):
        assert same_state(snapshot_of(tiny_server, sid))  # the same bytes from a reused file, cut to their length
        wait_for(lambda: files.idle == 1, 10, message="the download's file to go back")
        assert files._idle[0] == carrier
    assert_openai_error(restore(tiny_server, first[:-7]), 400, param="snapshot")
    restored = restore(tiny_server, first)
    assert restored.status_code == 200 and files.idle == 1, restored.text
    held = get_session(tiny_server, sid).json()["num_tokens"]
    history.append({"role": "user", "content": "And then?"})
    continue_and_check(tiny_server, restored.json()["id"], history, expect_cached=held)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # four at once: four files, two kept afterwards
        assert all(map(same_state, pool.map(lambda _: snapshot_of(tiny_server, sid), range(4))))
    wait_for(lambda: 1 <= files.idle <= files.keep, 10, message="the downloads' files to go back")


def test_a_snapshot_upload_over_the_body_limit_is_413_as_it_streams(ckpts):
    """The restore route reads its body as it arrives (never buffered whole by the middlewares), and the body
    limit still holds: declared too large, or growing past the limit while it streams (chunked), it is a 413."""
    server = serve(ckpts["tiny"], "kvfree-tiny", max_sessions=2, max_body_bytes=50_000)
    try:
        data = snapshot_of(server, new_session(server, prompt="a snapshot larger than the limit")["id"])
        assert len(data) > 50_000
        assert_openai_error(restore(server, data), 413, code="payload_too_large")  # Content-Length
        with server.http() as http:  # chunked, no Content-Length: counted as the chunks pass
            chunks = (data[i : i + 16_384] for i in range(0, len(data), 16_384))
            r = http.post("/v1/sessions/restore", content=chunks, headers={"content-type": "application/octet-stream"})
        assert_openai_error(r, 413, code="payload_too_large")
        # Without a content type (httpx sends none for raw bytes) it is streamed too, and refused the same way.
        with server.http() as http:
            r = http.post("/v1/sessions/restore", content=iter([data]))
        assert_openai_error(r, 413, code="payload_too_large")
    finally:
        server.stop()


def test_fork_gives_independent_branches(server):
    sid, history = two_turn_session(server, user_turns=("Pick a colour.",))
    before = get_session(server, sid).json()["num_tokens"]
    with server.http() as http:
        r = http.post(f"/v1/sessions/{sid}/fork")
    assert r.status_code == 200, r.text
    fork = r.json()
    assert fork["id"] != sid and fork["num_tokens"] == before

    branch_b = [*history, {"role": "user", "content": "Blue, then."}]
    rb = continue_and_check(server, fork["id"], branch_b, expect_cached=before)
    branch_b += [{"role": "assistant", "content": rb.choices[0].message.content}, {"role": "user", "content": "Why?"}]
    # The original is where it was: branch A continues from the shared prefix, not from branch B.
    assert get_session(server, sid).json()["num_tokens"] == before
    branch_a = [*history, {"role": "user", "content": "Red, please."}]
    ra = continue_and_check(server, sid, branch_a, expect_cached=before)
    assert ra.choices[0].message.content != rb.choices[0].message.content
    # ... and the fork is still where branch B left it.
    continue_and_check(server, fork["id"], branch_b, expect_cached=session_ext(rb)["num_tokens"])


def test_snapshot_delete_restore_round_trip(server):
    sid, history = two_turn_session(server)
    info = get_session(server, sid).json()
    data = snapshot_of(server, sid)
    with server.http() as http:
        r = http.delete(f"/v1/sessions/{sid}")
        assert r.status_code == 200 and r.json() == {"id": sid, "object": "session.deleted", "deleted": True}
        assert_openai_error(http.get(f"/v1/sessions/{sid}"), 404)
    r = restore(server, data)
    assert r.status_code == 200, r.text
    new = r.json()["id"]
    history.append({"role": "user", "content": "Go on."})
    continue_and_check(server, new, history, expect_cached=info["num_tokens"])


# == 5. pool pressure ==============================================================================================


def test_many_sessions_over_few_slots_continue_correctly(ckpts, tmp_path):
    server = serve(
        ckpts["tiny"], "kvfree-tiny", max_sessions=4, max_host_sessions=3, snapshot_dir=tmp_path / "snapshots"
    )
    try:
        name = "kvfree-tiny"
        sids = [new_session(server)["id"] for _ in range(20)]
        histories = [[{"role": "user", "content": f"Session {i} says hello."}] for i in range(20)]
        cached = [0] * 20

        async def turn(client, i, session):
            extra = {"session_id": sids[i]} if session else None
            return await client.chat.completions.create(
                model=name, messages=histories[i], max_tokens=6, temperature=0, extra_body=extra
            )

        async def one_round():
            async with server.async_openai() as client:
                got = await asyncio.gather(*(turn(client, i, True) for i in range(20)))
                want = await asyncio.gather(*(turn(client, i, False) for i in range(20)))
            return got, want

        for round_ in range(3):
            got, want = asyncio.run(one_round())
            for i in range(20):
                same_reply(got[i], want[i])
                ext = session_ext(got[i])
                assert (ext["cached_tokens"], ext["reset"]) == (cached[i], False), (round_, i, ext)
                cached[i] = ext["num_tokens"]
                histories[i] += [
                    {"role": "assistant", "content": got[i].choices[0].message.content},
                    {"role": "user", "content": f"Round {round_} for {i}."},
                ]
        text = metrics(server)
        where = {loc: metric_value(text, "kvfree_sessions", f'location="{loc}"') for loc in ("gpu", "host", "disk")}
        assert sum(where.values()) == 20
        assert where["gpu"] <= 4 and where["host"] <= 3 and where["disk"] >= 13, where
        assert metric_value(text, "kvfree_pool_slots_total") == 4
        locations = {get_session(server, s).json()["location"] for s in sids}
        assert locations <= {"gpu", "host", "disk"} and "disk" in locations
        assert len(list((tmp_path / "snapshots").glob("sess_*.safetensors"))) == where["disk"]
    finally:
        server.stop()


# == 6. bad input ==================================================================================================


def _bad_chat_bodies() -> list[tuple[str, dict[str, Any] | str, int, str | None]]:
    """(name, body, status, param). A str body is sent as raw JSON text."""
    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("unknown model", {"model": "gpt-4o", "messages": msgs}, 404, "model"),
        ("messages not a list", {"messages": "hi"}, 400, "messages"),
        ("content wrong type", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
        ("temperature as string", {"messages": msgs, "temperature": "0.5"}, 400, "temperature"),
        ("max_tokens bool", {"messages": msgs, "max_tokens": True}, 400, "max_tokens"),
        ("max_tokens float", {"messages": msgs, "max_tokens": 1e30}, 400, "max_tokens"),
        ("stream as string", {"messages": msgs, "stream": "yes"}, 400, "stream"),
        ("negative max_tokens", {"messages": msgs, "max_tokens": -5}, 400, "max_tokens"),
        ("zero max_tokens", {"messages": msgs, "max_tokens": 0}, 400, "max_tokens"),
        ("huge max_tokens", {"messages": msgs, "max_tokens": 10**12}, 400, "max_tokens"),
        (
            "huge max_completion_tokens",
            {"messages": msgs, "max_completion_tokens": 2**40},
            400,
            "max_completion_tokens",
        ),
        ("empty messages", {"messages": []}, 400, "messages"),
        ("missing messages", {"max_tokens": 3}, 400, "messages"),
        ("prompt over the limit", {"messages": [{"role": "user", "content": "x" * 500}]}, 400, "messages"),
        ("unknown session", {"messages": msgs, "session_id": "sess_000000000000000000000000"}, 404, "session_id"),
        ("n too large", {"messages": msgs, "n": 17}, 400, "n"),
        ("n zero", {"messages": msgs, "n": 0}, 400, "n"),
        (
            "stream_options without stream",
            {"messages": msgs, "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        (
            "NaN temperature",
            '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            400,
            "temperature",
        ),
        ("Infinity top_p", '{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400, "top_p"),
        (
            "-Infinity presence_penalty",
            '{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -Infinity}',
            400,
            "presence_penalty",
        ),
        (
            "NaN frequency_penalty",
            '{"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": NaN}',
            400,
            "frequency_penalty",
        ),
        ("top_p out of range", {"messages": msgs, "top_p": 0}, 400, "top_p"),
        ("logit_bias outside the vocabulary", {"messages": msgs, "logit_bias": {"99999999": 10}}, 400, "logit_bias"),
        ("logit_bias out of range", {"messages": msgs, "logit_bias": {"50": -101}}, 400, "logit_bias"),
        ("top_logprobs without logprobs", {"messages": msgs, "top_logprobs": 2}, 400, "top_logprobs"),
        ("too many stop strings", {"messages": msgs, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (
            "tool_choice without that tool",
            {
                "messages": msgs,
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            400,
            "tool_choice",
        ),
        (
            "image content",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
            "messages[0].content[0]",
        ),
        ("n with a session", {"messages": msgs, "n": 2, "session_id": "sess_000000000000000000000000"}, 400, "n"),
        (
            "json_schema response_format without its schema",
            {"messages": msgs, "response_format": {"type": "json_schema"}},
            400,
            "response_format",
        ),
        (
            "a schema keyword the grammar engine lacks",
            {"messages": msgs, "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "s", "schema": {"$dynamicRef": "#a"}}}},
            400,
            "response_format",
        ),
        (
            "an unclosed regex group",
            {"messages": msgs, "structured_outputs": {"regex": "a("}},
            400,
            "structured_outputs",
        ),
        (
            "a tool whose parameters use an unknown format",
            {"messages": msgs, "tool_choice": "required",
             "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"x": {"type": "string", "format": "idn-email"}}}}}]},
            400,
            "tools",
        ),
    ]


def _bad_completion_bodies() -> list[tuple[str, dict[str, Any] | str, int, str | None]]:
    return [
        ("unknown model", {"model": "davinci", "prompt": "hi"}, 404, "model"),
        ("empty prompt", {"prompt": ""}, 400, "prompt"),
        ("prompt wrong type", {"prompt": 5}, 400, "prompt"),
        ("token out of vocabulary", {"prompt": [1, 2, 999]}, 400, "prompt"),
        ("negative token", {"prompt": [1, -2]}, 400, "prompt[1]"),
        ("batch with an empty prompt", {"prompt": ["a", ""]}, 400, "prompt[1]"),
        ("prompt over the limit", {"prompt": "x" * 500}, 400, "prompt"),
        ("token prompt over the limit", {"prompt": [65] * 129}, 400, "prompt"),
        ("huge max_tokens", {"prompt": "hi", "max_tokens": 33}, 400, "max_tokens"),
        ("logprobs too many", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("echo streamed", {"prompt": "hi", "echo": True, "stream": True}, 400, "echo"),
        ("best_of", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ("NaN min_p", '{"prompt": "hi", "min_p": NaN}', 400, "min_p"),
        ("Infinity repetition_penalty", '{"prompt": "hi", "repetition_penalty": Infinity}', 400, "repetition_penalty"),
        ("seed beyond int64", {"prompt": "hi", "seed": 2**63}, 400, "seed"),
        (
            "stream_options without stream",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            400,
            "stream_options",
        ),
        ("unknown session", {"prompt": "hi", "session_id": "sess_nope"}, 404, "session_id"),
    ]


def test_every_bad_input_is_an_openai_shaped_4xx_and_the_server_carries_on(limits_server, tool_server):
    server = limits_server
    # A session in use before the storm, continued after it.
    sid, history = two_turn_session(server, user_turns=("Hello.",))
    before = get_session(server, sid).json()["num_tokens"]
    slots_before = metric_value(metrics(server), "kvfree_pool_slots_used")

    with server.http() as http:

        def post(path: str, body):
            if isinstance(body, str):
                return http.post(path, content=body, headers={"content-type": "application/json"})
            return http.post(path, json=body)

        for path, cases in (
            ("/v1/chat/completions", _bad_chat_bodies()),
            ("/v1/completions", _bad_completion_bodies()),
        ):
            for name, body, status, param in cases:
                r = post(path, body)
                err = assert_openai_error(r, status, param=param)
                assert r.status_code == status, (path, name, err)
                if status == 400 and name.startswith(("NaN", "Infinity", "-Infinity")):
                    assert err["code"] == "invalid_value"

        # Not JSON, though labelled so; JSON but not an object; no body at all.
        err = assert_openai_error(post("/v1/chat/completions", '{"messages": [{"role": "user", '), 400, param=None)
        assert err["code"] == "invalid_json"
        assert_openai_error(post("/v1/completions", "[1, 2, 3]"), 400, param=None)
        assert_openai_error(http.post("/v1/chat/completions"), 400, param=None)
        # Over the body limit: refused before it is parsed.
        err = assert_openai_error(
            post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 300_000}]}), 413
        )
        assert err["code"] == "payload_too_large"
        # Context over the limit for a session prefill too.
        assert_openai_error(http.post("/v1/sessions", json={"prompt": "y" * 200}), 400, param="prompt")
        assert_openai_error(
            http.post("/v1/sessions", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}), 400
        )
        # Unknown sessions, on every session route.
        ghost = "sess_0123456789abcdef01234567"
        assert_openai_error(http.get(f"/v1/sessions/{ghost}"), 404)
        assert_openai_error(http.delete(f"/v1/sessions/{ghost}"), 404)
        assert_openai_error(http.post(f"/v1/sessions/{ghost}/fork"), 404)
        assert_openai_error(http.get(f"/v1/sessions/{ghost}/snapshot"), 404)
        # Snapshots: of another model, truncated, tampered.
        good = snapshot_of(server, sid)
        other = snapshot_of(tool_server, new_session(tool_server, prompt="hi")["id"])
        assert assert_openai_error(restore(server, other), 400, param="snapshot")["code"] == "model_mismatch"
        assert assert_openai_error(restore(server, good[:-7]), 400, param="snapshot")["code"] == "invalid_snapshot"
        assert (
            assert_openai_error(restore(server, tampered(good)), 400, param="snapshot")["code"] == "checksum_mismatch"
        )
        # Unknown routes and methods are OpenAI-shaped too.
        assert_openai_error(http.get("/v1/nothing"), 404)
        assert_openai_error(http.get("/v1/chat/completions"), 405)

        # The SDK maps these onto its exception classes.
        client = server.openai()
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="kvfree-tiny", messages=[], max_tokens=3)
        assert info.value.body["param"] == "messages"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="kvfree-tiny", messages=[{"role": "user", "content": "hi"}], extra_body={"session_id": ghost}
            )

        # Still serving: a normal request, and the session continues exactly where it was.
        assert client.completions.create(model="kvfree-tiny", prompt="hi", max_tokens=3).choices[0].text is not None
        assert get_session(server, sid).json()["num_tokens"] == before
        history.append({"role": "user", "content": "Still there?"})
        continue_and_check(server, sid, history, expect_cached=before)
        text = metrics(server)
        assert metric_value(text, "kvfree_requests_running") == 0
        assert metric_value(text, "kvfree_pool_slots_used") <= slots_before  # no refused request holds a slot


def test_attention_context_limit_is_400_naming_max_tokens(hybrid_server):
    """A model with attention layers keeps a KV cache of max_context tokens: prompt + max_tokens beyond it is
    refused up front (400, param max_tokens) instead of failing mid-generation; at the limit it is served."""
    with hybrid_server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2047})
        assert_openai_error(r, 400, param="max_tokens")
        r = http.post("/v1/completions", json={"prompt": "x" * 2040, "max_tokens": 9})
        assert_openai_error(r, 400, param="max_tokens")
        r = http.post("/v1/completions", json={"prompt": "x" * 2040, "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {
            "prompt_tokens": 2040,
            "completion_tokens": 8,
            "total_tokens": 2048,
            "prompt_tokens_details": {"cached_tokens": 0},
        }


def test_session_limit_without_snapshot_dir_is_429_not_500(ckpts):
    """Without a snapshot directory a server keeps at most max_sessions + max_host_sessions sessions; one more is
    refused in OpenAI's shape (it used to be an opaque 500), on every route that makes a session."""
    server = serve(ckpts["tiny"], "kvfree-tiny", max_sessions=2, max_host_sessions=1)
    try:
        sids = [new_session(server, prompt=f"session {i}")["id"] for i in range(3)]
        data = snapshot_of(server, sids[0])
        with server.http() as http:
            for r in (
                http.post("/v1/sessions", json={}),
                http.post(f"/v1/sessions/{sids[0]}/fork"),
                restore(server, data),
            ):
                err = assert_openai_error(r, 429, error_type="rate_limit_error")
                assert "session" in err["message"]
            # Sessions already held are unaffected, and deleting one makes room again.
            assert get_session(server, sids[2]).json()["num_tokens"] == len("session 2")
            assert http.delete(f"/v1/sessions/{sids[1]}").status_code == 200
            assert restore(server, data).status_code == 200
    finally:
        server.stop()


def test_a_lone_utf16_surrogate_is_a_400_naming_the_field_on_every_route(limits_server):
    """JSON can spell half a surrogate pair (`"\\ud83d"`), which no UTF-8 text holds: every route answers 400
    `invalid_unicode` naming the field (it was a 500, or on /v1/responses a connection reset); a whole pair (an
    emoji) is valid text and served."""
    bodies = {
        "/v1/chat/completions": ('{"messages": [{"role": "user", "content": "hi %s"}], "max_tokens": 2}',
                                 "messages[0].content"),
        "/v1/completions": ('{"prompt": "a %s", "max_tokens": 2}', "prompt"),
        "/v1/responses": ('{"input": "hey %s", "max_output_tokens": 2}', "input"),
        "/v1/sessions": ('{"prompt": "sess %s"}', "prompt"),
        "/tokenize": ('{"prompt": "tok %s"}', "prompt"),
    }  # fmt: skip
    with limits_server.http() as http:
        for path, (template, param) in bodies.items():
            for bad in ("\\ud83d", "\\uDC00x", "x\\ud800\\ud800"):
                r = http.post(path, content=template % bad, headers={"content-type": "application/json"})
                err = assert_openai_error(r, 400, param=param)
                assert err["code"] == "invalid_unicode" and "surrogate" in err["message"], (path, bad, err)
            r = http.post(path, content=template % "\\ud83d\\ude00", headers={"content-type": "application/json"})
            assert r.status_code == 200, (path, r.text)
        # A key is text too; the field named is the object holding it.
        r = http.post("/v1/completions", content='{"prompt": "a", "max_tokens": 2, "metadata": {"k\\udfff": "v"}}',
                      headers={"content-type": "application/json"})  # fmt: skip
        assert assert_openai_error(r, 400, param="metadata")["code"] == "invalid_unicode"


def test_a_prompt_too_long_by_its_characters_alone_is_refused_without_tokenizing_it(tiny_server):
    """5 MB of text cannot fit 32,768 tokens whatever it tokenizes to (a token is at most the vocabulary's longest
    entry): every route refuses it from its length, naming the characters, instead of tokenizing for seconds."""
    huge = "x" * 5_000_000
    cases = {
        "/v1/completions": ({"prompt": huge, "max_tokens": 2}, "prompt"),
        "/v1/chat/completions": ({"messages": [{"role": "user", "content": huge}], "max_tokens": 2}, "messages"),
        "/v1/responses": ({"input": huge, "max_output_tokens": 2}, "input"),
        "/v1/sessions": ({"prompt": huge}, "prompt"),
    }
    with tiny_server.http() as http:
        for path, (body, param) in cases.items():
            err = assert_openai_error(http.post(path, json=body), 400, param=param, code="context_length_exceeded")
            assert "characters long, at least" in err["message"] and "limit is 32768" in err["message"], (path, err)
        # A long text within the bound is tokenized (on a worker thread) and refused by its real count.
        err = assert_openai_error(http.post("/v1/completions", json={"prompt": "y" * 40_000}), 400, param="prompt")
        assert err["message"].startswith("the prompt is 40000 tokens long"), err
        # /tokenize only counts: any length the body limit allows.
        assert http.post("/tokenize", json={"prompt": "z" * 100_000}).json()["count"] == 100_000


# == 7. client disconnect ==========================================================================================


@pytest.fixture
def fresh_server(ckpts):
    """A server of its own, for tests that count pool slots from zero."""
    server = serve(ckpts["tiny"], "kvfree-tiny", max_sessions=4)
    yield server
    server.stop()


def test_client_disconnect_mid_stream_frees_the_slot(fresh_server):
    tiny_server = fresh_server
    base = metrics(tiny_server)
    slots_before = metric_value(base, "kvfree_pool_slots_used")
    generated_before = metric_value(base, "kvfree_generation_tokens_total")
    sid = new_session(tiny_server)["id"]
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 4096,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "session_id": sid,
    }
    with (
        httpx.Client(base_url=tiny_server.url, timeout=60) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        # Read three events without leaving the iterator (closing it would close the connection).
        lines = resp.iter_lines()
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        during = metrics(tiny_server)
        assert metric_value(during, "kvfree_requests_running") == 1
        assert metric_value(during, "kvfree_pool_slots_used") == slots_before + 1
    left = time.monotonic()

    def freed() -> bool:
        text = metrics(tiny_server)
        return (
            metric_value(text, "kvfree_requests_running") == 0
            and metric_value(text, "kvfree_pool_slots_used") <= slots_before + 1  # + the idle session's slot
        )

    wait_for(freed, timeout=5, message="the aborted request to free its slot")
    assert time.monotonic() - left < 5
    # Aborted, not run to the end: the 4096 tokens were never all generated.
    assert metric_value(metrics(tiny_server), "kvfree_generation_tokens_total") - generated_before < 4096
    # The session is free again (not 409 busy) and usable: a prompt that does not extend what it consumed
    # starts it over, correctly.
    client = tiny_server.openai()
    kw = {"model": "kvfree-tiny", "prompt": "A new story", "max_tokens": 6, "temperature": 0}
    r = client.completions.create(extra_body={"session_id": sid}, **kw)
    assert r.choices[0].text == client.completions.create(**kw).choices[0].text
    assert session_ext(r)["reset"] is True
    with tiny_server.http() as http:
        assert http.delete(f"/v1/sessions/{sid}").status_code == 200
    assert metric_value(metrics(tiny_server), "kvfree_pool_slots_used") == slots_before


# == 8. back-pressure ==============================================================================================


def test_queue_full_is_429_with_retry_after_and_the_rest_complete(ckpts):
    server = serve(ckpts["tiny"], "kvfree-tiny", max_sessions=1, max_waiting=1)
    try:
        body = {"prompt": "Busy busy", "max_tokens": 150, "ignore_eos": True, "temperature": 0}
        sdk_body = {"prompt": "Busy busy", "max_tokens": 150, "temperature": 0, "extra_body": {"ignore_eos": True}}

        async def fire():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6)))

        responses = asyncio.run(fire())
        ok = [r for r in responses if r.status_code == 200]
        busy = [r for r in responses if r.status_code == 429]
        assert len(ok) + len(busy) == 6, [r.status_code for r in responses]
        assert ok and busy, [r.status_code for r in responses]
        texts = {r.json()["choices"][0]["text"] for r in ok}
        assert len(texts) == 1 and all(r.json()["usage"]["completion_tokens"] == 150 for r in ok)
        for r in busy:
            err = assert_openai_error(r, 429, error_type="rate_limit_error")
            assert err["code"] == "rate_limit_exceeded"
            assert int(r.headers["retry-after"]) >= 1

        # The SDK (retries off) raises RateLimitError for the refused ones, with the header at hand.
        async def sdk():
            async with server.async_openai() as client:
                return await asyncio.gather(
                    *(client.completions.create(model="kvfree-tiny", **sdk_body) for _ in range(4)),
                    return_exceptions=True,
                )

        results = asyncio.run(sdk())
        refused = [r for r in results if isinstance(r, Exception)]
        assert refused and all(isinstance(e, openai.RateLimitError) for e in refused), results
        assert all(int(e.response.headers["retry-after"]) >= 1 for e in refused)
        assert all(r.choices[0].text in texts for r in results if not isinstance(r, Exception))

        text = metrics(server)
        assert metric_value(text, "kvfree_requests_rejected_total", 'reason="QueueFull"') == len(busy) + len(refused)
        # And once the queue drains, requests are served again.
        c = server.openai().completions.create(model="kvfree-tiny", **sdk_body)
        assert c.choices[0].text in texts
    finally:
        server.stop()


# == 9. API keys ===================================================================================================


def test_api_keys_authenticate_and_isolate_sessions(ckpts):
    server = serve(ckpts["tiny"], "kvfree-tiny", env={"KVFREE_API_KEYS": "k1,k2"})
    try:
        k1 = {"Authorization": "Bearer k1"}
        k2 = {"Authorization": "Bearer k2"}
        msgs = [SYSTEM, {"role": "user", "content": "hi"}]
        with server.http() as http:
            for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic azE6"}):
                for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/sessions")):
                    r = http.request(method, path, headers=headers, json={"messages": msgs})
                    assert_openai_error(r, 401)
                    assert r.headers["www-authenticate"] == "Bearer"
            with pytest.raises(openai.AuthenticationError):
                server.openai(api_key="nope").models.list()

            r = http.post("/v1/sessions", headers=k1, json={"messages": [SYSTEM]})
            assert r.status_code == 200, r.text
            sid = r.json()["id"]
            first = chat(server, msgs, session_id=sid, extra_headers=k1)  # header wins over the SDK's key
            cached = session_ext(first)["num_tokens"]

            # Another key: the session does not exist, on every route.
            assert_openai_error(http.get(f"/v1/sessions/{sid}", headers=k2), 404)
            r = http.post("/v1/chat/completions", headers=k2, json={"messages": msgs, "session_id": sid})
            assert_openai_error(r, 404, param="session_id")
            assert_openai_error(http.get(f"/v1/sessions/{sid}/snapshot", headers=k2), 404)
            assert_openai_error(http.post(f"/v1/sessions/{sid}/fork", headers=k2), 404)
            assert_openai_error(http.delete(f"/v1/sessions/{sid}", headers=k2), 404)
            with pytest.raises(openai.NotFoundError):
                server.openai(api_key="k2").chat.completions.create(
                    model="kvfree-tiny", messages=msgs, max_tokens=4, extra_body={"session_id": sid}
                )

            # The owner still has it, untouched.
            assert http.get(f"/v1/sessions/{sid}", headers=k1).json()["num_tokens"] == cached
            history = [
                *msgs,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "more"},
            ]
            r = server.openai(api_key="k1").chat.completions.create(
                model="kvfree-tiny", messages=history, max_tokens=8, temperature=0, extra_body={"session_id": sid}
            )
            assert session_ext(r)["cached_tokens"] == cached
            ref = server.openai(api_key="k2").chat.completions.create(
                model="kvfree-tiny", messages=history, max_tokens=8, temperature=0
            )
            same_reply(r, ref)
            # A snapshot restored by k2 belongs to k2.
            data = http.get(f"/v1/sessions/{sid}/snapshot", headers=k1).content
            r = http.post(
                "/v1/sessions/restore", headers={**k2, "content-type": "application/octet-stream"}, content=data
            )
            assert r.status_code == 200
            assert http.get(f"/v1/sessions/{r.json()['id']}", headers=k2).status_code == 200
            assert_openai_error(http.get(f"/v1/sessions/{r.json()['id']}", headers=k1), 404)
            restored = r.json()["id"]

            # Listing: each key sees its own sessions only, a page at a time, as OpenAI lists objects.
            mine = http.get("/v1/sessions", headers=k1).json()
            assert mine["object"] == "list" and [s["id"] for s in mine["data"]] == [sid] and not mine["has_more"]
            made = [restored] + [http.post("/v1/sessions", headers=k2, json={}).json()["id"] for _ in range(3)]
            first = http.get("/v1/sessions", headers=k2, params={"limit": 3, "order": "asc"}).json()
            assert [s["id"] for s in first["data"]] == made[:3] and first["has_more"]
            assert (first["first_id"], first["last_id"]) == (made[0], made[2])
            rest = http.get("/v1/sessions", headers=k2, params={"limit": 3, "order": "asc", "after": first["last_id"]})
            assert [s["id"] for s in rest.json()["data"]] == made[3:] and not rest.json()["has_more"]
            newest = http.get("/v1/sessions", headers=k2, params={"limit": 1}).json()  # default order: newest first
            assert [s["id"] for s in newest["data"]] == [made[3]] and newest["data"][0]["object"] == "session"
            assert_openai_error(http.get("/v1/sessions", headers=k2, params={"after": sid}), 404, param="after")
            assert_openai_error(http.get("/v1/sessions", headers=k2, params={"limit": 0}), 400, param="limit")
            assert_openai_error(http.get("/v1/sessions"), 401)
            assert http.delete(f"/v1/sessions/{sid}", headers=k1).status_code == 200
            # Liveness, readiness and metrics stay open (probes and scrapers carry no key).
            assert http.get("/health").status_code == 200
            assert http.get("/ready").status_code == 200
            assert http.get("/metrics").status_code == 200
    finally:
        server.stop()


# == 10. graceful shutdown and restart =============================================================================


def test_sigterm_finishes_requests_persists_sessions_and_a_restart_continues_them(ckpts, tmp_path):
    snapshots = tmp_path / "snapshots"
    args = ["--served-model-name", "kvfree-tiny", "--snapshot-dir", str(snapshots), "--shutdown-grace", "5"]
    first = ProcServer(ckpts["tiny"], args, tmp_path / "first.log").start()
    try:
        sid = new_session(first)["id"]
        history = [SYSTEM, {"role": "user", "content": "Remember the number 42."}]
        r = chat(first, history, session_id=sid, extra_headers={"X-Request-ID": "graceful-turn-1"})
        num_tokens = session_ext(r)["num_tokens"]
        history += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "Which number?"},
        ]
        reference = chat(first, history)  # the next turn, as an uninterrupted server computes it

        # A request in flight when SIGTERM arrives is finished, not cut.
        result: dict[str, Any] = {}

        def long_request():
            with first.http() as http:
                result["r"] = http.post(
                    "/v1/completions",
                    json={"prompt": "In flight", "max_tokens": 300, "ignore_eos": True, "temperature": 0},
                )

        worker = threading.Thread(target=long_request)
        worker.start()
        wait_for(
            lambda: metric_value(metrics(first), "kvfree_requests_running") == 1,
            timeout=10,
            message="the long request to run",
        )
        start = time.monotonic()
        code = first.terminate(timeout=30)
        elapsed = time.monotonic() - start
        worker.join(30)
        assert code == 0, first.log()
        assert elapsed < 5 + 5, f"shutdown took {elapsed:.1f}s with a 5s grace period"
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 300
        assert (snapshots / f"{sid}.safetensors").is_file()
        log = first.log()
        assert "graceful-turn-1 POST /v1/chat/completions 200" in log
    finally:
        first.kill()

    second = ProcServer(ckpts["tiny"], args, tmp_path / "second.log").start()
    try:
        info = get_session(second, sid)
        assert info.status_code == 200, info.text
        assert info.json()["num_tokens"] == num_tokens and info.json()["location"] == "disk"
        r = chat(second, history, session_id=sid)
        same_reply(r, reference)
        assert session_ext(r)["cached_tokens"] == num_tokens and session_ext(r)["reset"] is False
    finally:
        second.kill()


# == 11. operations ================================================================================================


def test_tokenize_detokenize_ping_version(tiny_server):
    with tiny_server.http() as http:
        assert http.get("/ping").status_code == 200
        assert http.get("/version").json()["version"]
        r = http.post("/tokenize", json={"prompt": "Hello, world"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) == len("Hello, world") and body["max_model_len"] > 0
        assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": "Hello, world"}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"].endswith("assistant\n")
        for wrong in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
            error = assert_openai_error(http.post("/tokenize", json=wrong), 400, None)
            assert "give `prompt` or `messages`" in error["message"]
        assert_openai_error(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
        assert_openai_error(http.post("/tokenize", json={"prompt": "a", "model": "other"}), 404, "model")


def test_health_is_503_when_the_engine_thread_died(ckpts):
    server = serve(ckpts["tiny"], "kvfree-dying", max_sessions=2, engine_process=False)
    try:
        with server.http() as http:
            assert http.get("/health").status_code == 200
            engine = server.app.state.kvfree.engine._engine  # the ThreadDriver behind the server's EngineClient
            engine._commands.put(None)  # the engine loop's stop signal, as if it had died
            wait_for(lambda: not engine.alive, timeout=10, message="the engine thread")
            assert http.get("/health").status_code == 503 and http.get("/ping").status_code == 503
            assert http.get("/ready").status_code == 503
    finally:
        server.stop()


def test_health_is_503_within_a_second_when_the_engine_process_dies_and_requests_fail_cleanly(ckpts):
    server = serve(ckpts["tiny"], "kvfree-dying", max_sessions=2)
    try:
        with server.http() as http, server.openai() as client:
            assert http.get("/health").status_code == 200
            stream = client.completions.create(model="kvfree-dying", prompt="a", max_tokens=4000, stream=True,
                                               extra_body={"ignore_eos": True})  # (sampled: EOS could end it early)
            next(iter(stream))  # a streamed request in flight when the engine dies, and a non-streamed one
            body = {"prompt": "b", "max_tokens": 4000, "ignore_eos": True}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                whole = pool.submit(lambda: httpx.post(server.url + "/v1/completions", json=body, timeout=60))
                wait_for(lambda: metric_value(metrics(server), "kvfree_requests_running") == 2, timeout=10,
                         message="both requests to run")  # fmt: skip
                server.app.state.kvfree.engine._engine.kill()
                assert_openai_error(whole.result(), 503)
            wait_for(lambda: http.get("/health").status_code == 503, timeout=1.0, message="/health to say 503")
            assert http.get("/ready").status_code == 503
            assert_openai_error(http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}), 503)
            with pytest.raises(openai.APIError):  # the stream in flight ends with an error, not a hang
                for _ in stream:
                    pass
    finally:
        server.stop()


def _engine_processes(pid: int) -> list[int]:
    """The engine processes the server `pid` started (children spawned by multiprocessing, not its resource
    tracker), from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                out.append(int(stat.parent.name))
    return out


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # a zombie has exited; its parent has not reaped it yet


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the engine process through /proc")
def test_the_engine_process_exits_when_the_server_is_killed_and_the_server_exits_when_the_engine_dies(ckpts, tmp_path):
    first = ProcServer(ckpts["tiny"], ["--max-sessions", "2", "--replica-id", "replica-a"], tmp_path / "first.log")
    first.start()
    assert httpx.get(f"http://127.0.0.1:{first.port}/health").headers["x-kvfree-replica"] == "replica-a"
    engines = _engine_processes(first.proc.pid)
    assert len(engines) == 1, f"one engine process under the server, found {engines}"
    first.proc.kill()  # kill -9 of the HTTP front: the engine reads the end of its pipe and exits
    first.proc.wait(30)
    wait_for(lambda: _gone(engines[0]), timeout=15, message="the orphaned engine process to exit")

    second = ProcServer(ckpts["tiny"], ["--max-sessions", "2"], tmp_path / "second.log").start()
    try:
        (engine,) = _engine_processes(second.proc.pid)
        os.kill(engine, signal.SIGKILL)  # the engine dies: the server answers 503, then exits with status 1
        assert second.proc.wait(30) == 1, second.log()
        assert "the engine process died" in second.log()
    finally:
        second.kill()


def test_health_ready_metrics_request_ids_and_request_log(tiny_server, caplog):
    caplog.set_level(logging.INFO, logger="kvfree.server")
    with tiny_server.http() as http:
        r = http.get("/health")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        r = http.get("/ready")
        assert (r.status_code, r.json()) == (200, {"status": "ready"})

        r = http.get("/v1/models", headers={"X-Request-ID": "my-request-1"})
        assert r.headers["x-request-id"] == "my-request-1"
        assert r.json()["object"] == "list" and [m["id"] for m in r.json()["data"]] == ["kvfree-tiny"]
        r = http.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-ID": "my-request-2"}
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == "my-request-2"
        r = http.post("/v1/completions", json={"prompt": ""}, headers={"X-Request-ID": "my-request-3"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "my-request-3"
        generated = http.get("/health").headers["x-request-id"]
        assert generated.startswith("req-") and len(generated) > 8
        assert http.get("/health", headers={"X-Request-ID": "x" * 500}).headers["x-request-id"].startswith("req-")

        text = http.get("/metrics").text
    for name in (
        "kvfree_requests_total",
        "kvfree_requests_rejected",
        "kvfree_prompt_tokens_total",
        "kvfree_generation_tokens_total",
        "kvfree_cached_prompt_tokens_total",
        "kvfree_time_to_first_token_seconds_bucket",
        "kvfree_inter_token_latency_seconds_bucket",
        "kvfree_e2e_request_latency_seconds_bucket",
        "kvfree_requests_running",
        "kvfree_requests_waiting",
        'kvfree_sessions{location="gpu"}',
        'kvfree_sessions{location="host"}',
        'kvfree_sessions{location="disk"}',
        "kvfree_pool_slots_used",
        "kvfree_pool_slots_total",
        "kvfree_state_bytes_per_session",
        "kvfree_state_bytes_in_use",
    ):
        assert name in text, name
    assert metric_value(text, "kvfree_pool_slots_total") == 16
    assert 'kvfree_requests_total{route="/v1/completions",status="400"}' in text
    assert metric_value(text, "kvfree_state_bytes_per_session") > 0
    # The engine's own pace, reported from its process: it has stepped, and its mean step took some time.
    assert metric_value(text, "kvfree_engine_steps") > 0 and metric_value(text, "kvfree_engine_step_seconds") > 0
    assert 0 <= metric_value(text, "kvfree_engine_device_wait_fraction") <= 1
    # ... and the same since start: the steps fed the prompts and the decode rows of the requests above.
    busy = metric_value(text, "kvfree_engine_busy_seconds")
    assert busy > 0 and 0 <= metric_value(text, "kvfree_engine_device_wait_seconds") <= busy
    assert metric_value(text, "kvfree_engine_prefill_tokens") > 0
    assert metric_value(text, "kvfree_engine_decode_rows") > 0

    wait_for(
        lambda: all(any(f"my-request-{i} " in m for m in caplog.messages) for i in (1, 2, 3)),
        timeout=5,
        message="the request log lines",
    )
    for i, (method, path, status) in enumerate(
        [("GET", "/v1/models", 200), ("POST", "/v1/completions", 200), ("POST", "/v1/completions", 400)], start=1
    ):
        lines = [m for m in caplog.messages if m.startswith(f"my-request-{i} ")]
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"my-request-{i} {method} {path} {status} ")
    completion_line = next(m for m in caplog.messages if m.startswith("my-request-2 "))
    assert "prompt=2 completion=2 cached=0" in completion_line


# == 12. fuzzing from the OpenAPI schema ===========================================================================


def _fuzz(strategy, base_url: str, label: str, seen: dict[str, set[int]], max_examples: int) -> None:
    """Send `max_examples` cases drawn from `strategy`; fail on any 5xx (schemathesis' not_a_server_error)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case):
        response = case.call(base_url=base_url, timeout=60)
        seen.setdefault(label, set()).add(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    run()


# Text no route may answer with a 5xx, put into every string of a valid body: half a surrogate pair (JSON can spell
# it; no UTF-8 text holds it), a NUL, and more text than any prompt limit (within the body limit).
BAD_TEXTS = {
    "lone high surrogate": "\ud83d", "lone low surrogate": "a\udfffb", "NUL": "a\x00b", "oversized": "x" * 60_000,
}  # fmt: skip


JSON_HEADERS = {"content-type": "application/json"}


def _with_text(value: Any, text: str) -> tuple[Any, int]:
    """`value` (a parsed JSON body) with every string replaced by `text`; and how many were."""
    if isinstance(value, str):
        return text, 1
    if isinstance(value, list):
        items = [_with_text(v, text) for v in value]
        return [v for v, _ in items], sum(n for _, n in items)
    if isinstance(value, dict):
        items = {k: _with_text(v, text) for k, v in value.items()}
        return {k: v for k, (v, _) in items.items()}, sum(n for _, n in items.values())
    return value, 0


def test_fuzz_every_route_with_invalid_unicode_and_oversized_text(limits_server):
    """Every route of the OpenAPI schema that takes a JSON body (routes added later included), with valid bodies
    drawn by schemathesis whose every string is then replaced by one of BAD_TEXTS: no 5xx, and a lone surrogate is
    always the 400 `invalid_unicode`. Path parameters get the same text, percent-encoded."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(limits_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    with_body = [op for op in operations if op.body and any(b.media_type == "application/json" for b in op.body)]
    assert len(with_body) >= 6, [op.label for op in with_body]  # generation, sessions, (de)tokenize
    statuses: dict[tuple[str, str], set[int]] = {}

    def send_bad_text(op, name: str, text: str) -> None:
        @settings(max_examples=3, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE, media_type="application/json"))
        def run(case):
            drawn = case.body if isinstance(case.body, dict | list) else {}  # an optional body may be left unset
            body, replaced = _with_text(drawn, text)
            url, content = limits_server.url + case.formatted_path, json.dumps(body).encode()
            r = httpx.request(op.method.upper(), url, content=content, headers=JSON_HEADERS, timeout=60)
            statuses.setdefault((op.label, name), set()).add(r.status_code)
            assert r.status_code < 500, (op.label, name, r.status_code, r.text[:300])
            if replaced and "surrogate" in name:
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_unicode", (op.label, r.text)

        run()

    for op in with_body:
        for name, text in BAD_TEXTS.items():
            send_bad_text(op, name, text)
    assert {label for label, _ in statuses} == {op.label for op in with_body}
    with limits_server.http() as http:
        for op in operations:
            for raw in ("%ED%A0%BD", "a%00b", "x" * 4000) if "{" in op.path else ():
                path = re.sub(r"\{[^}]+\}", raw, op.path)  # every path parameter (session and response ids)
                r = http.request(op.method.upper(), path)
                assert r.status_code < 500, (op.label, raw, r.status_code, r.text[:300])
        r = http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_fuzz_from_openapi_schema_no_server_errors(limits_server):
    """Property-based fuzzing of every route in the server's own OpenAPI schema (schemathesis, positive and negative
    cases, bounded to about a minute): no request, valid or not, may get a 5xx. No route is excluded."""
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_url(limits_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = sorted(op.label for op in operations)
    assert len(labels) == 21, labels  # every route is fuzzed; none is excluded
    deadline = time.monotonic() + 60
    seen: dict[str, set[int]] = {}
    unsatisfiable: list[str] = []
    # Besides random ids and bodies, aim at sessions that exist (one per route and mode, made before the fuzzing
    # of POST /v1/sessions can fill the server up) and upload a valid snapshot.
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    sids = {
        (op.label, mode): new_session(limits_server, prompt="fuzz me")["id"]
        for op in operations
        for mode in modes
        if "{session_id}" in op.path
    }
    snapshot = snapshot_of(limits_server, next(iter(sids.values())))

    for mode in modes:
        for op in operations:
            if time.monotonic() > deadline:
                break
            strategies = [op.as_strategy(generation_mode=mode)]
            if "{session_id}" in op.path:
                strategies.append(
                    op.as_strategy(generation_mode=mode, path_parameters={"session_id": sids[op.label, mode]})
                )
            if op.label == "POST /v1/sessions/restore" and mode == GenerationMode.POSITIVE:
                strategies.append(op.as_strategy(body=snapshot, media_type="application/octet-stream"))
            for strategy in strategies:
                try:
                    _fuzz(strategy, limits_server.url, op.label, seen, max_examples=MAX_FUZZ_EXAMPLES)
                except Unsatisfiable:
                    # Nothing to make invalid (no parameters, no body): negative mode cannot generate a case.
                    assert mode == GenerationMode.NEGATIVE, op.label
                    unsatisfiable.append(op.label)
    assert set(seen) == set(labels)
    parameterless = {"GET /health", "GET /ping", "GET /version", "GET /ready", "GET /metrics", "GET /v1/models"}
    assert set(unsatisfiable) <= parameterless, unsatisfiable
    # After the fuzzing the server still serves.
    r = limits_server.openai().completions.create(model="kvfree-tiny", prompt="hi", max_tokens=2)
    assert r.choices[0].text is not None


def test_n_larger_than_the_pool_is_refused_not_queued_forever(tmp_path) -> None:
    """Every choice needs a state slot at once: n beyond the pool is a 400 naming n, not a request that never runs."""
    from fastapi.testclient import TestClient

    from kvfree.server.app import create_app

    with TestClient(create_app(ServerSettings(max_sessions=2))) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert client.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 2}).status_code == 200


def test_session_state_bytes_are_constant_for_recurrent_and_grow_for_attention(tmp_path) -> None:
    """SessionInfo.state_bytes and kvfree_state_bytes_in_use report what a session holds: the same at any length
    for Mamba-2, and the attention baseline's filled KV entries (4 layers x k,v x 2 heads x 32 dims x 4 B per token)."""
    from fastapi.testclient import TestClient

    from kvfree.engine.model.presets import init_checkpoint
    from kvfree.server.app import create_app

    for preset, per_token in (("tiny", 0), ("tiny-attention", 4 * 2 * 2 * 32 * 4)):
        path = init_checkpoint(preset, tmp_path / preset)
        with TestClient(create_app(ServerSettings(model=path, max_context=512))) as client:
            short = client.post("/v1/sessions", json={"prompt": [65] * 10}).json()
            long = client.post("/v1/sessions", json={"prompt": [66] * 310}).json()
            assert (short["num_tokens"], long["num_tokens"]) == (10, 310)
            assert long["state_bytes"] - short["state_bytes"] == 300 * per_token
            metrics = client.get("/metrics").text
            in_use = next(
                float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("kvfree_state_bytes_in_use")
            )
            assert in_use == short["state_bytes"] + long["state_bytes"]


def test_models_card_and_metrics_expose_limits_and_memory(tmp_path) -> None:
    """/v1/models tells the limits a load test would otherwise probe for; /metrics the pool and host memory."""
    from fastapi.testclient import TestClient

    from kvfree.engine.model.presets import init_checkpoint
    from kvfree.server.app import create_app

    path = init_checkpoint("tiny-attention", tmp_path / "att")
    settings = ServerSettings(model=path, max_context=512, max_prompt_tokens=300, max_output_tokens=40, max_sessions=2)
    with TestClient(create_app(settings)) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert (card["max_prompt_tokens"], card["max_output_tokens"], card["max_context"]) == (300, 40, 512)
        per_slot = card["state_bytes_per_session"]
        assert per_slot == 4 * 2 * 512 * 2 * 32 * 4 + 4 * 8  # KV cache at max_context + the length counters
        metrics = {
            line.split()[0]: float(line.split()[-1])
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("kvfree_") and " " in line
        }
        # Two slots and the scratch row; the template row of a new session's state holds the length counters only
        # (a new session's KV cache is never read: engine/state/pool.py).
        assert metrics["kvfree_pool_reserved_bytes"] == (2 + 1) * per_slot + 4 * 8
        assert metrics["kvfree_host_state_bytes"] == 0
        assert 'kvfree_session_moves{kind="evictions"}' in metrics


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_a_turn_ended_by_a_stop_string_frees_its_session_before_its_last_event(ckpts, engine_process):
    """Stop strings are found by the HTTP front (the engine sends token ids): the front stops the engine's request
    and sends the turn's last event only once the engine has let the session go, so the next turn is never 409."""
    tiny_server = serve(ckpts["tiny"], "kvfree-tiny", max_sessions=4, engine_process=engine_process)
    try:
        _stop_string_turns(tiny_server)
    finally:
        tiny_server.stop()


def _stop_string_turns(tiny_server) -> None:
    with tiny_server.http() as http:
        free = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 24, "temperature": 0}).json()
        text = free["choices"][0]["text"]
        stop = next((text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].isprintable()), None)
        if stop is None:
            pytest.skip(f"the tiny model's greedy text {text!r} has no printable pair to stop at")
        sid = new_session(tiny_server)["id"]
        body = {"prompt": [1, 2, 3], "max_tokens": 24, "temperature": 0, "stop": [stop], "session_id": sid}
        for _ in range(3):  # back to back on one session
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop" and stop not in choice["text"] and text.startswith(choice["text"])


def test_a_choice_ended_by_a_stop_string_stops_decoding_while_the_others_run_on(tiny_server):
    """With n > 1 the front finds each choice's stop string: the engine stops decoding that choice at once (the
    engine's decode rows say so) while the other runs to its end, its text unchanged."""

    def decode_rows_when_idle(http) -> float:
        def idle() -> bool:
            return metric_value(http.get("/metrics").text, "kvfree_requests_running") == 0

        wait_for(idle, timeout=5, message="the engine to go idle")
        return metric_value(http.get("/metrics").text, "kvfree_engine_decode_rows")

    with tiny_server.http() as http:
        body = {"prompt": [1, 2, 3], "max_tokens": 24, "temperature": 1.0, "seed": 11, "n": 2, "ignore_eos": True}
        free = {c["index"]: c["text"] for c in http.post("/v1/completions", json=body).json()["choices"]}
        pairs = (free[0][i : i + 2] for i in range(1, min(8, len(free[0]) - 1)))
        stop = next((p for p in pairs if p.isprintable() and p not in free[1]), None)
        if stop is None:
            pytest.skip(f"no early printable pair of {free[0]!r} is absent from {free[1]!r}")
        before = decode_rows_when_idle(http)
        r = http.post("/v1/completions", json={**body, "stop": [stop]})
        assert r.status_code == 200, r.text
        choices = {c["index"]: c for c in r.json()["choices"]}
        assert choices[0]["finish_reason"] == "stop" and free[0].startswith(choices[0]["text"] + stop)
        assert (choices[1]["finish_reason"], choices[1]["text"]) == ("length", free[1])
        # Choice 1 decodes 23 rows; choice 0 stopped within its first 8 characters (a few rows, and the steps in
        # flight when its abort landed), not after 23.
        assert decode_rows_when_idle(http) - before <= 23 + 8 + 4
