"""Concurrency sweep: latency and throughput of streamed chat requests at 1..N concurrent clients.

At level c, c workers run a closed loop (send a request, read its stream to the end, send the next) over a list
of requests drawn with a fixed seed from the workload's prompt and output length distributions. A level ends when
its requests are used up or its time is over, whichever comes first; requests in flight then finish (each is
bounded by the request timeout). A 429 counts as a rate-limited request, and its worker waits the server's
`Retry-After` (at most a second) before going on, as a polite client would.

Throughput is over the level's wall time: output tokens/s (completion tokens of successful requests) and
requests/s. Where the server exports kvfree's TTFT/ITL histograms, their quantiles over the level (from the
difference of two scrapes) are kept beside the client's numbers as a cross-check.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kvfree.loadtest.client import ServerClient
from kvfree.loadtest.deadline import Deadline
from kvfree.loadtest.progress import Bar
from kvfree.loadtest.prom import ITL_HISTOGRAM, TTFT_HISTOGRAM, histogram_quantiles
from kvfree.loadtest.records import LatencySummary, RequestRecord
from kvfree.loadtest.workload import RequestSpec, WorkloadSpec, sample_requests

_SERVER_QUANTILES = (0.5, 0.9, 0.99)
_MAX_RETRY_WAIT = 1.0


@dataclass
class LevelResult:
    """One concurrency level on one server."""

    concurrency: int
    planned_requests: int
    wall_seconds: float
    stopped_by_time: bool
    summary: LatencySummary
    output_tokens_per_s: float
    requests_per_s: float
    server_ttft: dict[str, float] | None = None  # seconds, estimated from kvfree's histogram buckets
    server_itl: dict[str, float] | None = None
    requests: list[RequestRecord] = field(default_factory=list)


def _chat_body(model: str | None, spec: RequestSpec, temperature: float, seed: int, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": spec.prompt}],
        "max_tokens": spec.max_tokens,
        "temperature": temperature,
        "seed": seed,  # sampled replies are reproducible, so both servers of a comparison get comparable lengths
    }
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True  # output lengths follow the workload's distribution, not the model's EOS
    return body


async def run_level(
    client: ServerClient,
    model: str | None,
    concurrency: int,
    requests: list[RequestSpec],
    *,
    level_seconds: float,
    deadline: Deadline,
    temperature: float,
    seed: int,
    bar: Bar,
    ignore_eos: bool = True,
) -> LevelResult:
    """Run `requests` through `concurrency` workers until they are used up or the level's time is over."""
    level_deadline = deadline.child(level_seconds)
    before = await client.metrics()
    records: list[RequestRecord] = []
    next_index = 0
    stopped_by_time = False
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index, stopped_by_time
        while True:
            if level_deadline.expired:
                stopped_by_time = stopped_by_time or next_index < len(requests)
                return
            if next_index >= len(requests):
                return
            index = next_index
            next_index += 1  # no await between the check and the increment: workers never share a request
            spec = requests[index]
            sent_at = time.perf_counter() - start
            res = await client.stream(
                "/v1/chat/completions", _chat_body(model, spec, temperature, seed + index, ignore_eos)
            )
            records.append(RequestRecord.of(res, sent_at, spec.max_tokens))
            bar.advance()
            if res.rate_limited:
                await asyncio.sleep(
                    min(res.retry_after or _MAX_RETRY_WAIT, _MAX_RETRY_WAIT, level_deadline.remaining())
                )

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    after = await client.metrics()
    records.sort(key=lambda r: r.sent_at)
    summary = LatencySummary.of(records)
    return LevelResult(
        concurrency=concurrency,
        planned_requests=len(requests),
        wall_seconds=round(wall, 6),
        stopped_by_time=stopped_by_time,
        summary=summary,
        output_tokens_per_s=summary.output_tokens / wall if wall > 0 else 0.0,
        requests_per_s=summary.ok / wall if wall > 0 else 0.0,
        server_ttft=histogram_quantiles(before, after, TTFT_HISTOGRAM, _SERVER_QUANTILES),
        server_itl=histogram_quantiles(before, after, ITL_HISTOGRAM, _SERVER_QUANTILES),
        requests=records,
    )


def level_request_count(concurrency: int, requests_per_worker: int, min_requests: int) -> int:
    """How many requests a level sends at most: enough for every worker to send several."""
    return max(min_requests, concurrency * requests_per_worker)


async def run_concurrency_sweep(
    client: ServerClient,
    model: str | None,
    levels: list[int],
    workload: WorkloadSpec,
    *,
    requests_per_worker: int,
    min_requests: int,
    level_seconds: float,
    deadline: Deadline,
    temperature: float,
    seed: int,
    bar: Bar,
    ignore_eos: bool = True,
) -> list[LevelResult]:
    """Every level of `levels` in turn; levels left when `deadline` passes are recorded as not run."""
    results = []
    for concurrency in levels:
        count = level_request_count(concurrency, requests_per_worker, min_requests)
        # Seeded per level: the same requests at the same level on both servers of a comparison.
        requests = sample_requests(workload, count, seed * 7919 + concurrency)
        bar.note(f"concurrency {concurrency}")
        results.append(
            await run_level(
                client,
                model,
                concurrency,
                requests,
                level_seconds=level_seconds,
                deadline=deadline,
                temperature=temperature,
                seed=seed,
                bar=bar,
                ignore_eos=ignore_eos,
            )
        )
    return results
