"""The HTTP side of the load generator: one `httpx.AsyncClient` per server, streamed generations timed on arrival,
and kvfree's session and metrics routes. Nothing here knows the server's code: it speaks HTTP only.

A streamed request's time to first token (TTFT) is the time from sending the request to the first server-sent
event that carries text; its inter-token latencies (ITL) are the gaps between later events that carry text (as
vLLM's serving benchmark measures them: an event holding several tokens counts as one gap). Token counts come
from the usage chunk (`stream_options.include_usage`), which OpenAI-compatible servers send before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvfree.loadtest.prom import MetricsSnapshot


@dataclass
class ApiResult:
    """A non-streamed call: HTTP status (0: no response), JSON body, seconds, and the error message if any."""

    status: int
    body: Any = None
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class TokenLogprob:
    """One generated token of a chat stream with `logprobs`: its identity, log-probability and the top alternatives.

    `token` identifies the token by its bytes where the server sends them (byte-level tokens that are not valid
    UTF-8 all read as "\ufffd"), else by its text; `top` maps the alternatives' identities to log-probabilities.
    """

    token: str
    logprob: float
    top: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def identity(entry: dict[str, Any]) -> str:
        raw = entry.get("bytes")
        return bytes(raw).hex() if raw is not None else entry["token"]

    @classmethod
    def of(cls, entry: dict[str, Any]) -> TokenLogprob:
        """From one entry of `choices[].logprobs.content`."""
        top = {cls.identity(alt): alt["logprob"] for alt in entry.get("top_logprobs") or []}
        return cls(cls.identity(entry), entry["logprob"], top)


@dataclass
class StreamResult:
    """One streamed generation, timed on the client. Times are seconds; None where nothing arrived."""

    status: int = 0
    ok: bool = False
    error: str | None = None
    retry_after: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    session: dict[str, Any] | None = None  # kvfree's `session` extension: cached_tokens, reset, num_tokens
    tokens: list[TokenLogprob] = field(default_factory=list)  # chat `logprobs.content`, when the request asked

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        tokens = self.completion_tokens
        if self.ttft is None or self.e2e is None or tokens is None or tokens < 2:
            return None
        return (self.e2e - self.ttft) / (tokens - 1)

    @property
    def rate_limited(self) -> bool:
        return self.status == 429


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an SSE body, split at \\n only (SSE's own rule, with \\r stripped): httpx's aiter_lines splits
    like str.splitlines, so a raw U+2028 or U+0085 inside an event's JSON (which JSON allows) would cut it in two."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


def _error_message(raw: bytes) -> str:
    """The `error.message` of an OpenAI-shaped error body, else the body's start."""
    try:
        body = json.loads(raw)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])
    except (ValueError, AttributeError):
        pass
    return raw[:300].decode("utf-8", "replace")


def _retry_after(headers: httpx.Headers) -> float | None:
    try:
        return float(headers["retry-after"])
    except (KeyError, ValueError):
        return None


class ServerClient:
    """Async HTTP client of one server. Use as `async with ServerClient(url) as client:`."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 300.0, max_connections: int = 64) -> None:
        self.url = url
        self.timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # trust_env=False: a proxy from the environment would add its own latency to every number (and could send
        # loopback traffic elsewhere); the load test talks to exactly the URL it was given.
        self._http = httpx.AsyncClient(
            base_url=url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            trust_env=False,
        )

    async def __aenter__(self) -> ServerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plain JSON calls ---------------------------------------------------------------------------------------
    async def call(self, method: str, path: str, json_body: Any = None) -> ApiResult:
        """One request with a JSON reply; transport errors become `ApiResult(status=0, error=...)`."""
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                r = await self._http.request(method, path, json=json_body)
        except httpx.HTTPError as exc:
            return ApiResult(0, None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
        except TimeoutError:
            return ApiResult(0, None, time.perf_counter() - start, f"timed out after {self.timeout:g}s")
        seconds = time.perf_counter() - start
        if r.status_code != 200:
            return ApiResult(r.status_code, None, seconds, _error_message(r.content))
        try:
            return ApiResult(200, r.json(), seconds)
        except ValueError:
            return ApiResult(200, None, seconds, "the reply is not JSON")

    async def models(self) -> ApiResult:
        return await self.call("GET", "/v1/models")

    async def metrics(self) -> MetricsSnapshot | None:
        """A scrape of `/metrics`, or None when the server has none (not every OpenAI server does)."""
        try:
            r = await self._http.get("/metrics")
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        return MetricsSnapshot.parse(r.text)

    async def create_session(self, body: dict[str, Any]) -> ApiResult:
        """`POST /v1/sessions` (prefilled with `prompt` or `messages` when given); `seconds` is the prefill time
        seen by the client."""
        return await self.call("POST", "/v1/sessions", body)

    async def get_session(self, session_id: str) -> ApiResult:
        return await self.call("GET", f"/v1/sessions/{session_id}")

    async def delete_session(self, session_id: str) -> ApiResult:
        return await self.call("DELETE", f"/v1/sessions/{session_id}")

    # -- streamed generations -----------------------------------------------------------------------------------
    async def stream(self, path: str, body: dict[str, Any]) -> StreamResult:
        """POST a generation to `path` (`/v1/completions` or `/v1/chat/completions`) as a stream and time it."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        res = StreamResult()
        pieces: list[str] = []
        done = False
        start = time.perf_counter()
        last: float | None = None
        try:
            # httpx's timeout bounds each read; this bounds the whole request, however slowly tokens trickle in.
            async with asyncio.timeout(self.timeout), self._http.stream("POST", path, json=body) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    res.error = _error_message(await r.aread())
                    res.retry_after = _retry_after(r.headers)
                    res.e2e = time.perf_counter() - start
                    return res
                async for line in sse_lines(r):
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:  # the server failed mid-stream, in-band
                        err = event["error"]
                        res.error = str(err.get("message") if isinstance(err, dict) else err)
                        break
                    for choice in event.get("choices") or []:
                        piece = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
                        if piece:
                            pieces.append(piece)
                            if last is None:
                                res.ttft = now - start
                            else:
                                res.itl.append(now - last)
                            last = now
                        for entry in (choice.get("logprobs") or {}).get("content") or []:
                            res.tokens.append(TokenLogprob.of(entry))
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                    usage = event.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens")
                        res.completion_tokens = usage.get("completion_tokens")
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                    if event.get("session"):
                        res.session = event["session"]
        except httpx.HTTPError as exc:
            res.error = f"{type(exc).__name__}: {exc}"
        except TimeoutError:
            res.error = f"timed out after {self.timeout:g}s"
        except ValueError as exc:
            res.error = f"malformed server-sent event: {exc}"
        res.e2e = time.perf_counter() - start
        res.text = "".join(pieces)
        if res.error is None and not done:
            res.error = "the stream ended without [DONE]"
        res.ok = res.status == 200 and res.error is None
        return res
