"""Concurrency sweep: latency and throughput of streamed chat requests at 1..N concurrent clients.

At level c, c workers run a closed loop (send a request, read its stream to the end, send the next) over a list
of requests drawn with a fixed seed from the workload's prompt and output length distributions. A level ends when
its requests are used up or its time is over, whichever comes first; requests in flight then finish (each is
bounded by the request timeout). A 429 counts as a rate-limited request, and its worker waits the server's
`Retry-After` (at most a second) before going on, as a polite client would.

Throughput is over the level's wall time: output tokens/s (completion tokens of successful requests) and
requests/s. Where the server exports kvfree's TTFT/ITL histograms, their quantiles over the level (from the
difference of two scrapes) are kept beside the client's numbers as a cross-check, and so is the client's own CPU
time over the level: near the level's wall time, the client (one Python process) was busy all along and may be
what limits the rate.

`run_level` streams any list of request bodies to any generation route: this sweep's chat requests, or the
token-id completions of `kvfree bench --serve` (`loadtest.served_levels`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kvfree.loadtest.client import ServerClient
from kvfree.loadtest.deadline import Deadline
from kvfree.loadtest.progress import Bar
from kvfree.loadtest.prom import ITL_HISTOGRAM, TTFT_HISTOGRAM, MetricsSnapshot, engine_pace, histogram_quantiles
from kvfree.loadtest.records import LatencySummary, RequestRecord
from kvfree.loadtest.workload import RequestSpec, WorkloadSpec, sample_requests

CHAT_PATH = "/v1/chat/completions"
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
    server_engine: dict[str, float] | None = None  # where a kvfree engine's time went (loadtest.prom.engine_pace)
    client_cpu_seconds: float | None = None  # the client's CPU time over the level (summed over its processes)
    client_processes: int = 1  # the processes the level's clients ran in
    requests: list[RequestRecord] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        concurrency: int,
        planned_requests: int,
        wall: float,
        stopped_by_time: bool,
        records: list[RequestRecord],
        before: MetricsSnapshot | None,
        after: MetricsSnapshot | None,
        cpu: float,
    ) -> LevelResult:
        """A level's result from its request records, wall and CPU seconds, and the server's metrics before and
        after it (None: not scraped, or the server has no /metrics)."""
        records = sorted(records, key=lambda r: r.sent_at)
        summary = LatencySummary.of(records)
        return cls(
            concurrency=concurrency,
            planned_requests=planned_requests,
            wall_seconds=round(wall, 6),
            stopped_by_time=stopped_by_time,
            summary=summary,
            output_tokens_per_s=summary.output_tokens / wall if wall > 0 else 0.0,
            requests_per_s=summary.ok / wall if wall > 0 else 0.0,
            server_ttft=histogram_quantiles(before, after, TTFT_HISTOGRAM, _SERVER_QUANTILES),
            server_itl=histogram_quantiles(before, after, ITL_HISTOGRAM, _SERVER_QUANTILES),
            server_engine=engine_pace(before, after, wall),
            client_cpu_seconds=round(cpu, 6),
            requests=records,
        )


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
    concurrency: int,
    bodies: list[dict[str, Any]],
    *,
    path: str = CHAT_PATH,
    level_seconds: float,
    deadline: Deadline,
    bar: Bar,
    scrape_metrics: bool = True,
) -> LevelResult:
    """Stream the request `bodies` to `path` through `concurrency` closed-loop workers until they are used up or
    the level's time is over (each worker sends the next body when its previous stream has ended). Without
    `scrape_metrics`, the server's /metrics is not read before and after (a caller running the level in parts
    reads it once around them all)."""
    level_deadline = deadline.child(level_seconds)
    before = await client.metrics() if scrape_metrics else None
    records: list[RequestRecord] = []
    next_index = 0
    stopped_by_time = False
    cpu_start = time.process_time()
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index, stopped_by_time
        while True:
            if level_deadline.expired:
                stopped_by_time = stopped_by_time or next_index < len(bodies)
                return
            if next_index >= len(bodies):
                return
            body = bodies[next_index]
            next_index += 1  # no await between the check and the increment: workers never share a request
            sent_at = time.perf_counter() - start
            res = await client.stream(path, body)
            records.append(RequestRecord.of(res, sent_at, body.get("max_tokens")))
            bar.advance()
            if res.rate_limited:
                await asyncio.sleep(
                    min(res.retry_after or _MAX_RETRY_WAIT, _MAX_RETRY_WAIT, level_deadline.remaining())
                )

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    after = await client.metrics() if scrape_metrics else None
    return LevelResult.of(concurrency, len(bodies), wall, stopped_by_time, records, before, after, cpu)


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
        bodies = [_chat_body(model, spec, temperature, seed + index, ignore_eos) for index, spec in enumerate(requests)]
        bar.note(f"concurrency {concurrency}")
        results.append(
            await run_level(client, concurrency, bodies, level_seconds=level_seconds, deadline=deadline, bar=bar)
        )
    return results
