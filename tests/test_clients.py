"""kvfree.clients against a real server on loopback (sync, async, streaming, sessions, snapshots), retries on 429
and 503 honouring Retry-After (a real server's forced 429 and a scripted transport), and `kvfree chat` driven
through a pseudo-terminal."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import pytest

from kvfree.clients import AsyncKvfreeClient, KvfreeAPIError, KvfreeClient, RetryPolicy, collect
from kvfree.server.settings import ServerSettings
from tests.server_fixtures import ThreadServer, make_checkpoint

SYSTEM = [{"role": "system", "content": "You are terse."}]
GREEDY = {"max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def server(checkpoint):
    server = ThreadServer(ServerSettings(model=checkpoint, served_model_name="m", device="cpu", max_sessions=8))
    yield server.start()
    server.stop()


def _turn(history: list[dict], text: str) -> list[dict]:
    return [*history, {"role": "user", "content": text}]


def test_sessions_and_chat_turns(server):
    with KvfreeClient(server.url) as client:
        session = client.create_session(messages=SYSTEM)
        assert session.num_tokens > 0 and session.location in ("gpu", "host") and session.state_bytes > 0
        history = _turn(SYSTEM, "Hello there")
        first = client.chat(history, session_id=session.id, **GREEDY)
        assert first.cached_tokens == session.num_tokens  # the system prompt was not prefilled again
        assert first.text == client.chat(history, **GREEDY).text  # the same as without a session
        history = _turn([*history, {"role": "assistant", "content": first.text}], "And then?")
        streamed = list(client.chat_stream(history, session_id=session.id, **GREEDY))
        second = collect(streamed)
        assert second.finish_reason == "length" and second.cached_tokens > first.cached_tokens
        assert second.session["id"] == session.id
        assert second.text == client.chat(history, **GREEDY).text

        # A fork and a snapshot restored as a new session continue exactly like the original.
        fork = client.fork_session(session.id)
        restored = client.restore(client.snapshot(session.id))
        assert fork.num_tokens == restored.num_tokens == client.get_session(session.id).num_tokens
        history = _turn([*history, {"role": "assistant", "content": second.text}], "Why?")
        replies = {client.chat(history, session_id=sid, **GREEDY).text for sid in (session.id, fork.id, restored.id)}
        assert len(replies) == 1

        assert client.delete_session(fork.id) is True
        with pytest.raises(KvfreeAPIError) as err:
            client.get_session(fork.id)
        assert err.value.status == 404 and err.value.param == "session_id" and fork.id in err.value.message
        with pytest.raises(KvfreeAPIError) as err:
            client.restore(b"not a snapshot")
        assert err.value.status == 400


def test_async_client_matches_the_sync_one(server):
    history = _turn(SYSTEM, "Tell me something")

    async def run():
        async with AsyncKvfreeClient(server.url) as client:
            session = await client.create_session(messages=SYSTEM)
            deltas = [d async for d in client.chat_stream(history, session_id=session.id, **GREEDY)]
            whole = await client.chat(history, **GREEDY)
            fork = await client.fork_session(session.id)
            info = await client.get_session(fork.id)
            assert await client.delete_session(fork.id) and await client.delete_session(session.id)
            return collect(deltas), whole, info

    streamed, whole, info = asyncio.run(run())
    assert streamed.text == whole.text and streamed.finish_reason == whole.finish_reason == "length"
    assert len(streamed.text) > 0 and info.num_tokens > 0
    with KvfreeClient(server.url) as client:
        assert client.chat(history, **GREEDY).text == whole.text


class CountingTransport(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.requests = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return super().handle_request(request)


def test_retries_a_real_servers_429_then_reports_it(checkpoint):
    busy = ThreadServer(ServerSettings(model=checkpoint, device="cpu", max_sessions=2, max_waiting=0)).start()
    try:
        transport = CountingTransport()
        retry = RetryPolicy(max_retries=2, backoff=0.01, max_backoff=0.02)  # caps the server's Retry-After: 1
        with KvfreeClient(busy.url, retry=retry, transport=transport) as client:
            with pytest.raises(KvfreeAPIError) as err:
                client.chat(_turn([], "hi"), max_tokens=2)
            assert err.value.status == 429 and "busy" in err.value.message
            assert transport.requests == 3  # the first attempt and two retries
            with pytest.raises(KvfreeAPIError):
                list(client.chat_stream(_turn([], "hi"), max_tokens=2))
            assert transport.requests == 6
    finally:
        busy.stop()


def _scripted(responses: list[httpx.Response], seen: list[float]):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(time.monotonic())
        return responses.pop(0)

    return handler


def test_retry_after_is_honoured_and_other_errors_are_not_retried():
    seen: list[float] = []
    session = {"id": "sess_1", "created": 1, "model": "m", "num_tokens": 3, "location": "gpu", "state_bytes": 9}
    script = [
        httpx.Response(429, headers={"Retry-After": "0.2"}, json={"error": {"message": "busy"}}),
        httpx.Response(503, json={"error": {"message": "restarting"}}),  # no Retry-After: backoff 0.05
        httpx.Response(200, json=session),
    ]
    retry = RetryPolicy(max_retries=3, backoff=0.05)
    with KvfreeClient("http://kvfree.test", retry=retry, transport=httpx.MockTransport(_scripted(script, seen))) as c:
        assert c.get_session("sess_1").num_tokens == 3
    assert len(seen) == 3 and seen[1] - seen[0] >= 0.2 and seen[2] - seen[1] >= 0.05
    seen.clear()
    script = [httpx.Response(409, json={"error": {"message": "in use", "param": "session_id", "code": None}})]
    transport = httpx.MockTransport(_scripted(script, seen))
    with KvfreeClient("http://kvfree.test", transport=transport) as c, pytest.raises(KvfreeAPIError) as err:
        c.delete_session("sess_1")
    assert len(seen) == 1 and err.value.status == 409 and err.value.message == "in use"
    # A 409 that says when to retry (a session busy with a turn on another replica) is retried like a 429.
    seen.clear()
    busy = {"error": {"message": "running a turn on another replica", "param": "session_id", "code": "session_busy"}}
    script = [httpx.Response(409, headers={"Retry-After": "0.1"}, json=busy), httpx.Response(200, json=session)]
    with KvfreeClient("http://kvfree.test", transport=httpx.MockTransport(_scripted(script, seen))) as c:
        assert c.get_session("sess_1").num_tokens == 3
    assert len(seen) == 2 and seen[1] - seen[0] >= 0.1
    assert RetryPolicy().delay(0, 429, "Wed, 21 Oct 2015 07:28:00 GMT") == 0.5  # a date: the backoff instead


def test_kvfree_chat_in_a_terminal(server, tmp_path):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "kvfree", "chat", "--url", server.url, "--temperature", "0", "--max-tokens", "8", "--system", "Hi."],
        encoding="utf-8",
        timeout=120,
        cwd=str(tmp_path),
    )
    child.expect(r"\[session (sess_[0-9a-f]+);")
    first_id = child.match.group(1)
    child.expect("> ")
    child.sendline("hello")
    child.expect("> ")
    child.sendline("/fork")
    child.expect(r"forked: now on session (sess_[0-9a-f]+)")
    assert child.match.group(1) != first_id
    child.expect("> ")
    child.sendline("/save saved.safetensors")
    child.expect("saved session")
    child.expect("> ")
    child.sendline("/load saved.safetensors")
    child.expect(r"loaded saved.safetensors: session sess_[0-9a-f]+, (\d+) tokens")
    assert int(child.match.group(1)) > 0
    child.expect("> ")
    child.sendline("/load missing.safetensors")
    child.expect(r"\[error: ")  # a missing file is reported, the chat goes on
    child.expect("> ")
    child.sendline("/session")
    child.expect(r"tokens, on ")
    child.expect("> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    history = json.loads((tmp_path / "saved.safetensors.messages.json").read_text())
    assert [m["role"] for m in history] == ["system", "user", "assistant"] and history[1]["content"] == "hello"


def test_session_turns_carry_an_affinity_header():
    sent: list[httpx.Request] = []
    reply = {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": {}}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json=reply)

    with KvfreeClient("http://kvfree.test", transport=httpx.MockTransport(handler)) as client:
        assert client.chat(_turn([], "hi"), session_id="sess_1").text == "ok"
        client.chat(_turn([], "hi"))
    assert sent[0].headers["x-session-id"] == "sess_1" and "x-session-id" not in sent[1].headers
    assert json.loads(sent[0].content)["session_id"] == "sess_1"
