"""Per-request records kept in report.json, and the latency/throughput summary of a group of them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvfree.loadtest.client import StreamResult
from kvfree.loadtest.stats import Percentiles

# Seconds are rounded to microseconds in the report: finer digits are noise and would only bloat report.json.
_DIGITS = 6


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, _DIGITS)


@dataclass
class RequestRecord:
    """One streamed request as measured by the client (seconds; `sent_at` is relative to its group's start)."""

    sent_at: float
    status: int
    ok: bool
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    max_tokens: int | None = None
    finish_reason: str | None = None

    @classmethod
    def of(cls, res: StreamResult, sent_at: float, max_tokens: int | None = None) -> RequestRecord:
        return cls(
            sent_at=round(sent_at, _DIGITS),
            status=res.status,
            ok=res.ok,
            error=res.error,
            ttft=_round(res.ttft),
            e2e=_round(res.e2e),
            tpot=_round(res.tpot),
            itl=[round(x, _DIGITS) for x in res.itl],
            prompt_tokens=res.prompt_tokens,
            completion_tokens=res.completion_tokens,
            cached_tokens=res.cached_tokens,
            max_tokens=max_tokens,
            finish_reason=res.finish_reason,
        )


@dataclass
class LatencySummary:
    """Client-side latency percentiles (seconds) and token totals of a group of requests (successful ones only)."""

    requests: int
    ok: int
    errors: int
    rate_limited: int
    output_tokens: int
    ttft: Percentiles
    itl: Percentiles
    tpot: Percentiles
    e2e: Percentiles
    error_messages: dict[str, int] = field(default_factory=dict)  # the 5 most common, with their counts

    @classmethod
    def of(cls, records: list[RequestRecord]) -> LatencySummary:
        good = [r for r in records if r.ok]
        failed = [r for r in records if not r.ok]
        messages = Counter(f"{r.status}: {r.error}"[:200] for r in failed)
        return cls(
            requests=len(records),
            ok=len(good),
            errors=len(failed),
            rate_limited=sum(1 for r in records if r.status == 429),
            output_tokens=sum(r.completion_tokens or 0 for r in good),
            ttft=Percentiles.of([r.ttft for r in good if r.ttft is not None]),
            itl=Percentiles.of([x for r in good for x in r.itl]),
            tpot=Percentiles.of([r.tpot for r in good if r.tpot is not None]),
            e2e=Percentiles.of([r.e2e for r in good if r.e2e is not None]),
            error_messages=dict(messages.most_common(5)),
        )
