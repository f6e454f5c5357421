"""Session soak: many multi-turn chat sessions, more than the server's pool holds, each turn checked.

More sessions are opened than the pool has slots (`kvfree_pool_slots_total`), so between two turns of a session
the server moves its state to host memory or disk and back. Each round gives every session one turn: a greedy
chat request with `session_id`, then the same conversation sent again *without* `session_id` (the whole history,
prefilled from scratch). The two replies must be identical (text, finish reason, token count): a session whose
offloaded state came back wrong answers differently. So offload/reload is verified, not just timed. Where the
session was before each turn (`GET /v1/sessions/{id}.location`: gpu, host or disk) is recorded, so the report
shows how many verified turns resumed from host memory or disk.

A turn verifies a reloaded state only if the session reused it (`cached_tokens` > 0). When the reply does not
round-trip through text (a random-weight model emitting bytes that are not valid UTF-8), the next turn's prompt is
not a continuation of the state and the server prefills it anew (`reset`): still checked, but that checks the
fallback, not the reload; the report counts both.

`inject_mismatch` corrupts the first reference reply, to show that a mismatch is caught and reported (a test of
the checker, not of the server). The conversation always continues with the session's own reply.

A mismatch can also come from a near tie in greedy decoding that the two prefill paths (cached prefix + suffix
versus the whole history, in batches of other sizes) round differently, which bf16 on a GPU does. Both requests ask
for the top `SOAK_TOP_LOGPROBS` log-probabilities, so at the first token where the replies part the soak sees each
path's margin between the two candidates: if both margins are under `NEAR_TIE_NATS`, the turn is a near-tie flip
(counted, shown, not a failure); otherwise it is a hard mismatch, which fails the soak. A lost or corrupted state
gives hard ones.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvfree.loadtest.client import ServerClient, StreamResult, TokenLogprob
from kvfree.loadtest.deadline import Deadline
from kvfree.loadtest.progress import Bar
from kvfree.loadtest.prom import ServerMemory
from kvfree.loadtest.workload import user_turn

SYSTEM_PROMPT = "You are a terse assistant. Answer in one short sentence."
INJECTED_SUFFIX = " [reference corrupted by --inject-mismatch]"
_SHOWN_CHARS = 160  # of each reply kept in the report for a mismatch
# Both paths' margin between the two tokens where the replies part, under which a mismatch is a rounding flip of
# a near tie. bf16 logits of a random-weight 370M model move by a few hundredths of a nat between prefill paths.
NEAR_TIE_NATS = 0.1
SOAK_TOP_LOGPROBS = 10


@dataclass
class SoakTurn:
    """One verified turn of one session."""

    session: int
    turn: int
    ok: bool
    match: bool | None = None  # None: not compared (an error on either request)
    injected: bool = False
    error: str | None = None
    location_before: str | None = None  # where the session's state was when the turn started
    cached_tokens: int | None = None
    reset: bool | None = None
    num_tokens: int | None = None
    ttft: float | None = None  # the session request's
    reference_ttft: float | None = None
    first_difference: int | None = None  # character index where the replies part, for a mismatch
    tie_margin: float | None = None  # for a mismatch: the larger of the two paths' margins where they part (nats)
    near_tie: bool | None = None  # for a mismatch: both margins under NEAR_TIE_NATS (a rounding flip)
    reply: str | None = None  # both replies (cut), only for a mismatch
    reference: str | None = None


@dataclass
class SoakResult:
    pool_slots_total: int | None
    sessions_planned: int
    sessions_created: int
    seconds: float
    stopped_by: str  # "time", "turns" or "errors"
    turns: list[SoakTurn] = field(default_factory=list)
    compared: int = 0
    mismatches: int = 0
    near_ties: int = 0  # mismatches that are rounding flips of a near tie (not failures)
    injected: int = 0
    errors: int = 0
    create_errors: list[str] = field(default_factory=list)
    locations_before: dict[str, int] = field(default_factory=dict)  # turns by where their session's state was
    reloaded_and_verified: int = 0  # matched turns that resumed from host memory or disk with their cached tokens
    turns_with_cached_tokens: int = 0
    resets: int = 0
    memory_after: ServerMemory | None = None

    # No mismatch but near-tie flips, and at least one turn compared (a soak that verified nothing proves nothing).
    passed: bool = False


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def tie_margin(got: list[TokenLogprob], ref: list[TokenLogprob]) -> float | None:
    """Where two greedy token streams first part, how far each path preferred its own token over the other's.

    Returns the larger of the two margins (nats); +inf where a path did not rank the other's token in its top
    alternatives; None where the streams do not part (or carry no log-probabilities).
    """
    for a, b in zip(got, ref, strict=False):
        if a.token != b.token:
            margin_got = a.logprob - a.top.get(b.token, float("-inf"))
            margin_ref = b.logprob - b.top.get(a.token, float("-inf"))
            return max(margin_got, margin_ref)
    return None


def _same_reply(got: StreamResult, ref: StreamResult) -> bool:
    return (
        got.text == ref.text
        and got.finish_reason == ref.finish_reason
        and got.completion_tokens == ref.completion_tokens
    )


async def run_soak(
    client: ServerClient,
    model: str | None,
    *,
    pool_slots_total: int | None,
    sessions: int | None,
    max_turns: int,
    max_tokens: int,
    user_chars: int,
    concurrency: int | None,
    seconds: float,
    deadline: Deadline,
    seed: int,
    inject_mismatch: bool,
    bar: Bar,
) -> SoakResult:
    """Open the sessions, run rounds of verified turns until `max_turns` or the time is over, delete them."""
    if sessions is None:
        # Twice the pool (and at least two more than it): every round must evict and bring back states.
        pool = pool_slots_total or 4
        sessions = max(2 * pool, pool + 2)
    if concurrency is None:
        concurrency = max(1, pool_slots_total or 4)
    soak_deadline = deadline.child(seconds)
    start = time.perf_counter()
    system = {"role": "system", "content": SYSTEM_PROMPT}
    base: dict[str, Any] = {"model": model} if model else {}

    result = SoakResult(
        pool_slots_total=pool_slots_total,
        sessions_planned=sessions,
        sessions_created=0,
        seconds=0.0,
        stopped_by="turns",
    )
    ids: list[str] = []
    histories: list[list[dict[str, Any]]] = []
    # Sessions are opened `concurrency` at a time (one by one, 512 of them would eat a short soak).
    full = False
    for first in range(0, sessions, max(1, concurrency)):
        if soak_deadline.expired or full:
            break
        batch = range(first, min(sessions, first + max(1, concurrency)))
        replies = await asyncio.gather(*(client.create_session({**base, "messages": [system]}) for _ in batch))
        for created in replies:
            if not created.ok:
                result.create_errors.append(f"{created.status}: {created.error}")
                full = full or created.status in (0, 429)  # the server is full or gone: use the sessions we have
                continue
            histories.append([system, {"role": "user", "content": user_turn(seed, len(ids), 0, user_chars)}])
            ids.append(created.body["id"])
    result.sessions_created = len(ids)

    active = [True] * len(ids)
    pending_injection = inject_mismatch
    sem = asyncio.Semaphore(concurrency)

    async def one_turn(i: int, turn: int) -> None:
        nonlocal pending_injection
        async with sem:
            if soak_deadline.expired:
                return
            record = SoakTurn(session=i, turn=turn, ok=False)
            info = await client.get_session(ids[i])
            if info.ok:
                record.location_before = info.body.get("location")
            body = {**base, "messages": histories[i], "max_tokens": max_tokens, "temperature": 0}
            # To tell a near-tie flip from a wrong state: where the replies part, each path must rank the other's
            # token among its alternatives (with only the top 2, a three-way near tie looks like a wrong state).
            body |= {"logprobs": True, "top_logprobs": SOAK_TOP_LOGPROBS}
            got = await client.stream("/v1/chat/completions", {**body, "session_id": ids[i]})
            ref = await client.stream("/v1/chat/completions", body)
            record.ttft, record.reference_ttft = got.ttft, ref.ttft
            if got.session is not None:
                record.cached_tokens = got.session.get("cached_tokens")
                record.reset = got.session.get("reset")
                record.num_tokens = got.session.get("num_tokens")
            elif got.cached_tokens is not None:
                record.cached_tokens = got.cached_tokens
            if got.ok:
                # The conversation goes on with the session's own reply, whatever the reference said.
                histories[i] += [
                    {"role": "assistant", "content": got.text},
                    {"role": "user", "content": user_turn(seed, i, turn + 1, user_chars)},
                ]
            elif got.status != 429:
                # Failed mid-way, the session's state and the history may disagree: stop this conversation. A 429
                # ran nothing, so the same turn is simply tried again next round.
                active[i] = False
            if not got.ok or not ref.ok:
                failed, which = (got, "session") if not got.ok else (ref, "reference")
                record.error = f"{which} request: {failed.status}: {failed.error}"
            else:
                record.ok = True
                if pending_injection:
                    pending_injection = False
                    ref.text += INJECTED_SUFFIX
                    record.injected = True
                record.match = _same_reply(got, ref)
                if not record.match:
                    record.first_difference = _first_difference(got.text, ref.text)
                    if not record.injected:
                        record.tie_margin = tie_margin(got.tokens, ref.tokens)
                        record.near_tie = record.tie_margin is not None and record.tie_margin < NEAR_TIE_NATS
                    record.reply, record.reference = got.text[:_SHOWN_CHARS], ref.text[:_SHOWN_CHARS]
            result.turns.append(record)
            bar.advance()

    try:
        for turn in range(max_turns):
            if soak_deadline.expired:
                result.stopped_by = "time"
                break
            live = [i for i in range(len(ids)) if active[i]]
            if not live:
                result.stopped_by = "errors"
                break
            bar.note(f"round {turn + 1}, {len(live)} sessions")
            await asyncio.gather(*(one_turn(i, turn) for i in live))
        else:
            result.stopped_by = "turns"
        snap = await client.metrics()
        result.memory_after = ServerMemory.of(snap) if snap is not None and snap.is_kvfree else None
    finally:
        for sid in ids:
            await client.delete_session(sid)

    result.seconds = round(time.perf_counter() - start, 3)
    compared = [t for t in result.turns if t.match is not None]
    result.compared = len(compared)
    result.mismatches = sum(1 for t in compared if not t.match)
    result.injected = sum(1 for t in compared if t.injected)
    result.errors = sum(1 for t in result.turns if not t.ok) + len(result.create_errors)
    result.locations_before = dict(Counter(t.location_before or "unknown" for t in result.turns))
    # A reset turn prefilled the whole history again, so only turns that reused their cached tokens verify a state
    # that went to host memory or disk and came back.
    result.reloaded_and_verified = sum(
        1 for t in compared if t.match and t.location_before in ("host", "disk") and (t.cached_tokens or 0) > 0
    )
    result.turns_with_cached_tokens = sum(1 for t in compared if (t.cached_tokens or 0) > 0)
    result.resets = sum(1 for t in compared if t.reset)
    result.near_ties = sum(1 for t in compared if t.near_tie)
    result.passed = result.mismatches == result.near_ties and result.compared > 0
    result.turns.sort(key=lambda t: (t.turn, t.session))
    return result
