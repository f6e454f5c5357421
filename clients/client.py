"""Python clients for what the OpenAI SDK does not cover: kvfree's sessions, and chat turns on them.

    from kvfree.clients import KvfreeClient

    with KvfreeClient("http://127.0.0.1:8000") as client:
        session = client.create_session(messages=[{"role": "system", "content": "Be brief."}])
        for delta in client.chat_stream([{"role": "user", "content": "Hi"}], session_id=session.id):
            print(delta.text, end="")
        fork = client.fork_session(session.id)
        saved = client.snapshot(session.id)           # bytes: restore them here or on another server
        restored = client.restore(saved)

`AsyncKvfreeClient` has the same methods as coroutines (and `chat_stream` as an async iterator). Both retry on 429,
503 and a 409 with `Retry-After` (a session busy on another replica) honouring it, and on refused connections
(clients/retry.py); other errors raise
`KvfreeAPIError` with the server's message.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfree.clients.retry import RetryPolicy
from kvfree.clients.types import ChatDelta, ChatResult, KvfreeAPIError, SessionInfo

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Call:
    """One API call: what to send, and how to read a successful response."""

    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    headers: dict[str, str] | None = None
    parse: Callable[[httpx.Response], Any] = field(default=lambda r: r.json())


def _session(r: httpx.Response) -> SessionInfo:
    return SessionInfo.of(r.json())


def _chat_body(messages: Messages, session_id: str | None, model: str | None, stream: bool, **params: Any) -> dict:
    body: dict[str, Any] = {"messages": messages, "stream": stream, **params}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if session_id is not None:
        body["session_id"] = session_id
    if model is not None:
        body["model"] = model
    return body


class _Calls:
    """The calls both clients make (their bodies and parsers), so the sync and async clients share them."""

    @staticmethod
    def create_session(messages: Messages | None, prompt: str | list[int] | None, model: str | None) -> Call:
        body: dict[str, Any] = {}
        if messages is not None:
            body["messages"] = messages
        if prompt is not None:
            body["prompt"] = prompt
        if model is not None:
            body["model"] = model
        return Call("POST", "/v1/sessions", json=body, parse=_session)

    @staticmethod
    def get_session(session_id: str) -> Call:
        return Call("GET", f"/v1/sessions/{session_id}", parse=_session)

    @staticmethod
    def fork_session(session_id: str) -> Call:
        return Call("POST", f"/v1/sessions/{session_id}/fork", parse=_session)

    @staticmethod
    def delete_session(session_id: str) -> Call:
        return Call("DELETE", f"/v1/sessions/{session_id}", parse=lambda r: bool(r.json().get("deleted")))

    @staticmethod
    def snapshot(session_id: str) -> Call:
        return Call("GET", f"/v1/sessions/{session_id}/snapshot", parse=lambda r: r.content)

    @staticmethod
    def restore(data: bytes) -> Call:
        return Call("POST", "/v1/sessions/restore", content=data, parse=_session)

    @staticmethod
    def chat(messages: Messages, session_id: str | None, model: str | None, params: dict[str, Any]) -> Call:
        return Call(
            "POST",
            "/v1/chat/completions",
            json=_chat_body(messages, session_id, model, False, **params),
            headers=_affinity(session_id),
            parse=_chat_result,
        )

    @staticmethod
    def chat_stream(messages: Messages, session_id: str | None, model: str | None, params: dict[str, Any]) -> Call:
        body = _chat_body(messages, session_id, model, True, **params)
        return Call("POST", "/v1/chat/completions", json=body, headers=_affinity(session_id))


def _chat_result(r: httpx.Response) -> ChatResult:
    body = r.json()
    choice = body["choices"][0]
    return ChatResult(
        choice["message"].get("content") or "",
        choice.get("finish_reason"),
        body.get("usage") or {},
        body.get("session"),
    )


def _delta(data: str) -> ChatDelta | None:
    """One SSE `data:` payload of a chat stream -> ChatDelta (None for `[DONE]`); an in-band error raises."""
    if data == "[DONE]":
        return None
    event = json.loads(data)
    if "error" in event:
        err = event["error"]
        raise KvfreeAPIError(200, err.get("message", str(err)) if isinstance(err, dict) else str(err))
    choices = event.get("choices") or []
    text = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
    finish = next((c["finish_reason"] for c in choices if c.get("finish_reason")), None)
    return ChatDelta(text, finish, event.get("usage"), event.get("session"))


def _wait_after_response(retry: RetryPolicy, attempt: int, r: httpx.Response, body: bytes) -> float:
    """Seconds to wait before retrying a failed response, or raise its error when it is final."""
    wait = retry.delay(attempt, r.status_code, r.headers.get("retry-after"))
    if wait is None:
        raise KvfreeAPIError.from_response(r.status_code, body)
    return wait


def _wait_after_refusal(retry: RetryPolicy, attempt: int, exc: httpx.ConnectError) -> float:
    """Seconds to wait before retrying a refused connection, or re-raise it when retries are spent."""
    wait = retry.delay(attempt, None, None)
    if wait is None:
        raise exc
    return wait


def _content_headers(call: Call) -> dict[str, str] | None:
    if call.content is not None:
        return {"Content-Type": "application/octet-stream", **(call.headers or {})}
    return call.headers


def _affinity(session_id: str | None) -> dict[str, str] | None:
    """`X-Session-Id`: a load balancer may route a session's turns to one replica on it (deploy/nginx.conf)."""
    return {"X-Session-Id": session_id} if session_id else None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def collect(deltas: list[ChatDelta]) -> ChatResult:
    """A streamed reply's deltas as one ChatResult."""
    result = ChatResult("".join(d.text for d in deltas), None)
    for d in deltas:
        result.finish_reason = d.finish_reason or result.finish_reason
        result.usage = d.usage or result.usage
        result.session = d.session or result.session
    return result


class KvfreeClient:
    """A synchronous client of one kvfree server (or load balancer). Use it as a context manager or `close()` it.

    Args:
        base_url: the server, e.g. http://127.0.0.1:8000 (no /v1).
        api_key: sent as a bearer token (default: none).
        timeout: seconds per request (a stream's reads each get this long).
        retry: when to retry (default: 3 retries on 429/503, a 409 with Retry-After, refused connections,
            honouring Retry-After).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 120.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport)

    def __enter__(self) -> KvfreeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- sessions -----------------------------------------------------------------------------------------------
    def create_session(
        self, messages: Messages | None = None, prompt: str | list[int] | None = None, model: str | None = None
    ) -> SessionInfo:
        """A new session; with `messages` (or `prompt`) its state is prefilled now."""
        return self._call(_Calls.create_session(messages, prompt, model))

    def get_session(self, session_id: str) -> SessionInfo:
        return self._call(_Calls.get_session(session_id))

    def fork_session(self, session_id: str) -> SessionInfo:
        """A new session with a copy of this one's state: two branches of one conversation."""
        return self._call(_Calls.fork_session(session_id))

    def delete_session(self, session_id: str) -> bool:
        return self._call(_Calls.delete_session(session_id))

    def snapshot(self, session_id: str) -> bytes:
        """The session's state as a snapshot file's bytes (checksummed, tied to the model)."""
        return self._call(_Calls.snapshot(session_id))

    def restore(self, data: bytes) -> SessionInfo:
        """A new session from snapshot bytes (from this server or another serving the same model)."""
        return self._call(_Calls.restore(data))

    # -- chat ---------------------------------------------------------------------------------------------------
    def chat(
        self, messages: Messages, session_id: str | None = None, model: str | None = None, **params: Any
    ) -> ChatResult:
        """One chat turn (any OpenAI chat parameter as a keyword: max_tokens, temperature, ...)."""
        return self._call(_Calls.chat(messages, session_id, model, params))

    def chat_stream(
        self, messages: Messages, session_id: str | None = None, model: str | None = None, **params: Any
    ) -> Iterator[ChatDelta]:
        """One chat turn, streamed: ChatDelta events as text arrives; the last carries finish reason and usage."""
        call = _Calls.chat_stream(messages, session_id, model, params)
        attempt = 0
        while True:
            try:
                with self._http.stream(call.method, call.path, json=call.json, headers=call.headers) as r:
                    if r.status_code == 200:
                        for line in r.iter_lines():
                            if line.startswith("data:"):
                                delta = _delta(line[5:].strip())
                                if delta is None:
                                    return
                                yield delta
                        return
                    wait = _wait_after_response(self.retry, attempt, r, r.read())
            except httpx.ConnectError as exc:
                wait = _wait_after_refusal(self.retry, attempt, exc)
            time.sleep(wait)
            attempt += 1

    # -- transport ----------------------------------------------------------------------------------------------
    def _call(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                r = self._http.request(
                    call.method, call.path, json=call.json, content=call.content, headers=_content_headers(call)
                )
            except httpx.ConnectError as exc:
                wait = _wait_after_refusal(self.retry, attempt, exc)
            else:
                if r.is_success:
                    return call.parse(r)
                wait = _wait_after_response(self.retry, attempt, r, r.content)
            time.sleep(wait)
            attempt += 1


class AsyncKvfreeClient:
    """The asynchronous twin of `KvfreeClient` (same arguments; methods are coroutines)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 120.0,
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport
        )

    async def __aenter__(self) -> AsyncKvfreeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def create_session(
        self, messages: Messages | None = None, prompt: str | list[int] | None = None, model: str | None = None
    ) -> SessionInfo:
        return await self._call(_Calls.create_session(messages, prompt, model))

    async def get_session(self, session_id: str) -> SessionInfo:
        return await self._call(_Calls.get_session(session_id))

    async def fork_session(self, session_id: str) -> SessionInfo:
        return await self._call(_Calls.fork_session(session_id))

    async def delete_session(self, session_id: str) -> bool:
        return await self._call(_Calls.delete_session(session_id))

    async def snapshot(self, session_id: str) -> bytes:
        return await self._call(_Calls.snapshot(session_id))

    async def restore(self, data: bytes) -> SessionInfo:
        return await self._call(_Calls.restore(data))

    async def chat(
        self, messages: Messages, session_id: str | None = None, model: str | None = None, **params: Any
    ) -> ChatResult:
        return await self._call(_Calls.chat(messages, session_id, model, params))

    async def chat_stream(
        self, messages: Messages, session_id: str | None = None, model: str | None = None, **params: Any
    ) -> AsyncIterator[ChatDelta]:
        call = _Calls.chat_stream(messages, session_id, model, params)
        attempt = 0
        while True:
            try:
                async with self._http.stream(call.method, call.path, json=call.json, headers=call.headers) as r:
                    if r.status_code == 200:
                        async for line in r.aiter_lines():
                            if line.startswith("data:"):
                                delta = _delta(line[5:].strip())
                                if delta is None:
                                    return
                                yield delta
                        return
                    wait = _wait_after_response(self.retry, attempt, r, await r.aread())
            except httpx.ConnectError as exc:
                wait = _wait_after_refusal(self.retry, attempt, exc)
            await asyncio.sleep(wait)
            attempt += 1

    async def _call(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                r = await self._http.request(
                    call.method, call.path, json=call.json, content=call.content, headers=_content_headers(call)
                )
            except httpx.ConnectError as exc:
                wait = _wait_after_refusal(self.retry, attempt, exc)
            else:
                if r.is_success:
                    return call.parse(r)
                wait = _wait_after_response(self.retry, attempt, r, r.content)
            await asyncio.sleep(wait)
            attempt += 1
