"""Context sweep: memory and latency of one session as its context grows.

For each context length L a session is opened with `POST /v1/sessions` and a prompt of exactly L token ids (the
server prefills it), its size is read from `GET /v1/sessions/{id}` (`state_bytes`) and from `/metrics` (state bytes
in use, pool slots, device memory), then it decodes a fixed number of tokens by continuing the session with a
streamed `/v1/completions` request whose prompt is the same L ids plus one new id. The session is deleted before
the next length, so each point measures one session alone.

Why completions and not chat for the decode: a chat request's prompt is the chat template's rendering, which
does not start with L arbitrary token ids, so the server would find no common prefix and prefill everything anew
(`session.reset`); a token-id prompt that extends the session's own tokens reuses all L of them
(`cached_tokens == L`, checked per point), so TTFT measures the continuation, not a second prefill.

The memory slope (bytes per token) is a least-squares line through (num_tokens, state_bytes) over the lengths:
about 0 for recurrent models, the KV-cache bytes per token for the attention baseline.

Servers without kvfree's session routes get a stateless sweep: one streamed completion per length (its TTFT
includes the prefill) and no per-session memory.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from kvfree.loadtest.client import ServerClient
from kvfree.loadtest.deadline import Deadline
from kvfree.loadtest.progress import Bar
from kvfree.loadtest.prom import ServerMemory
from kvfree.loadtest.records import RequestRecord
from kvfree.loadtest.stats import LinearFit, Percentiles, fit_line
from kvfree.loadtest.workload import random_token_ids


@dataclass
class ContextPoint:
    """One context length on one server. Memory in bytes, times in seconds."""

    context: int
    ok: bool
    error: str | None = None
    status: int | None = None
    num_tokens: int | None = None  # the session's token count after the prefill (== context when all went well)
    state_bytes: int | None = None  # GET /v1/sessions/{id}.state_bytes after the prefill
    location: str | None = None
    prefill_seconds: float | None = None  # POST /v1/sessions with the prompt, as the client saw it
    prefill_tokens_per_s: float | None = None
    decode: RequestRecord | None = None
    decode_itl: Percentiles | None = None
    decode_tokens_per_s: float | None = None  # completion tokens after the first, over the time after TTFT
    decode_reused_session: bool | None = None  # the decode's cached_tokens == the session's tokens (no re-prefill)
    num_tokens_after_decode: int | None = None
    state_bytes_after_decode: int | None = None
    in_use_delta: float | None = None  # kvfree_state_bytes_in_use after the prefill minus before the session
    gpu_allocated_delta: float | None = None  # kvfree_gpu_memory_allocated_bytes, same difference
    memory_before: ServerMemory | None = None
    memory_after_prefill: ServerMemory | None = None
    memory_after_decode: ServerMemory | None = None


@dataclass
class ContextSweepResult:
    """All points of one server, and the memory slopes fitted through them."""

    mode: str  # "sessions" (kvfree's session routes) or "stateless" (plain completions, no per-session memory)
    decode_tokens: int
    points: list[ContextPoint] = field(default_factory=list)
    slope: LinearFit | None = None  # state_bytes against num_tokens
    in_use_slope: LinearFit | None = None  # /metrics kvfree_state_bytes_in_use delta against num_tokens

    def measured(self) -> dict[int, int]:
        """{context: state_bytes} of the points that were measured."""
        return {p.context: p.state_bytes for p in self.points if p.ok and p.state_bytes is not None}


def _delta(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before


async def _memory(client: ServerClient) -> ServerMemory | None:
    snap = await client.metrics()
    return ServerMemory.of(snap) if snap is not None and snap.is_kvfree else None


def _decode_body(model: str | None, prompt: list[int], decode_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": decode_tokens, "temperature": 0}
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True  # a random model may emit EOS at once; the sweep wants exactly decode_tokens
    return body


def _fill_decode(point: ContextPoint, res, sent_at: float, decode_tokens: int) -> None:
    point.decode = RequestRecord.of(res, sent_at, decode_tokens)
    point.decode_itl = Percentiles.of(res.itl)
    tokens = res.completion_tokens or 0
    if res.ok and res.ttft is not None and res.e2e is not None and tokens > 1 and res.e2e > res.ttft:
        point.decode_tokens_per_s = (tokens - 1) / (res.e2e - res.ttft)


async def _session_point(
    client: ServerClient, model: str | None, context: int, ids: list[int], decode_tokens: int, ignore_eos: bool
) -> ContextPoint:
    point = ContextPoint(context=context, ok=False)
    point.memory_before = await _memory(client)
    body: dict[str, Any] = {"prompt": ids}
    if model:
        body["model"] = model
    created = await client.create_session(body)
    point.status = created.status
    if not created.ok:
        point.error = f"POST /v1/sessions: {created.status}: {created.error}"
        return point
    sid = created.body["id"]
    point.prefill_seconds = created.seconds
    point.prefill_tokens_per_s = context / created.seconds if created.seconds > 0 else None
    try:
        info = await client.get_session(sid)
        if info.ok:
            point.num_tokens = info.body.get("num_tokens")
            point.state_bytes = info.body.get("state_bytes")
            point.location = info.body.get("location")
        point.memory_after_prefill = await _memory(client)
        # One new id after the session's own tokens: the server reuses all of them and prefills one.
        body = {**_decode_body(model, [*ids, ids[0]], decode_tokens, ignore_eos), "session_id": sid}
        res = await client.stream("/v1/completions", body)
        _fill_decode(point, res, 0.0, decode_tokens)
        if res.session is not None:
            point.decode_reused_session = res.session.get("cached_tokens") == point.num_tokens
        elif res.cached_tokens is not None:
            point.decode_reused_session = res.cached_tokens == point.num_tokens
        after = await client.get_session(sid)
        if after.ok:
            point.num_tokens_after_decode = after.body.get("num_tokens")
            point.state_bytes_after_decode = after.body.get("state_bytes")
        point.memory_after_decode = await _memory(client)
        if not res.ok:
            point.status = res.status
            point.error = f"decode: {res.status}: {res.error}"
        elif point.state_bytes is None:
            point.error = f"GET /v1/sessions/{sid}: {info.status}: {info.error}"
        else:
            point.ok = True
    finally:
        await client.delete_session(sid)
    before, after_prefill = point.memory_before, point.memory_after_prefill
    if before is not None and after_prefill is not None:
        point.in_use_delta = _delta(after_prefill.state_bytes_in_use, before.state_bytes_in_use)
        point.gpu_allocated_delta = _delta(after_prefill.gpu_memory_allocated, before.gpu_memory_allocated)
    return point


async def _stateless_point(
    client: ServerClient, model: str | None, context: int, ids: list[int], decode_tokens: int, ignore_eos: bool
) -> ContextPoint:
    point = ContextPoint(context=context, ok=False)
    point.memory_before = await _memory(client)
    res = await client.stream("/v1/completions", _decode_body(model, ids, decode_tokens, ignore_eos))
    point.status = res.status
    _fill_decode(point, res, 0.0, decode_tokens)
    point.num_tokens = res.prompt_tokens
    point.memory_after_decode = await _memory(client)
    if res.ok:
        point.ok = True
    else:
        point.error = f"completion: {res.status}: {res.error}"
    return point


async def run_context_sweep(
    client: ServerClient,
    model: str | None,
    contexts: list[int],
    decode_tokens: int,
    *,
    sessions_api: bool,
    seed: int,
    deadline: Deadline,
    bar: Bar,
    ignore_eos: bool = True,
) -> ContextSweepResult:
    """Measure every length of `contexts` in turn (one session at a time); stops early at `deadline`."""
    result = ContextSweepResult(mode="sessions" if sessions_api else "stateless", decode_tokens=decode_tokens)
    measure = _session_point if sessions_api else _stateless_point
    for context in contexts:
        if deadline.expired:
            result.points.append(ContextPoint(context=context, ok=False, error="skipped: time limit reached"))
            bar.advance()
            continue
        bar.note(f"context {context}")
        # One generator per length: both servers of a side-by-side run get the same prompt at each length.
        ids = random_token_ids(random.Random(seed * 1_000_003 + context), context)
        result.points.append(await measure(client, model, context, ids, decode_tokens, ignore_eos))
        bar.advance()
    good = [p for p in result.points if p.ok and p.num_tokens is not None]
    with_bytes = [p for p in good if p.state_bytes is not None]
    result.slope = fit_line([p.num_tokens for p in with_bytes], [p.state_bytes for p in with_bytes])
    with_delta = [p for p in good if p.in_use_delta is not None]
    result.in_use_slope = fit_line([p.num_tokens for p in with_delta], [p.in_use_delta for p in with_delta])
    return result
