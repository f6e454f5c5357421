"""The served half of `kvfree bench --serve`: closed-loop streaming clients sending token-id prompts to
`/v1/completions`, one concurrency level after another, and each level's numbers in flat form.

Every request is greedy with `ignore_eos` (kvfree's and vLLM's extension), so it generates exactly `max_tokens`
tokens, as `LLM.generate` does with the same parameters: the served and the offline run do the same work. The
closed loop, the timing of the stream and the summaries are the concurrency sweep's (`run_level`, `ServerClient
.stream`, `LatencySummary`); this module chooses the bodies and the route, and can split a level's clients over
several processes, so that the client's own Python does not limit what a fast server streams.

TTFT and ITL come from the stream's text events (`loadtest.client`). A token whose text is not yet a whole
character (a byte-level token in the middle of a UTF-8 sequence, or a special token) sends no event, so one gap
can span several tokens; `text_chunks_per_token` says how often that happened, and the server's own per-token
histograms (`server_ttft_s`, `server_itl_s`, bucket-interpolated) are kept beside the client's numbers.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from kvfree.loadtest.client import ServerClient
from kvfree.loadtest.concurrency_sweep import LevelResult, run_level
from kvfree.loadtest.deadline import Deadline
from kvfree.loadtest.progress import Bar, Progress
from kvfree.loadtest.prom import MetricsSnapshot

COMPLETIONS_PATH = "/v1/completions"


def completion_bodies(prompts: Sequence[Sequence[int]], max_tokens: int, model: str | None = None) -> list[dict]:
    """Greedy `/v1/completions` bodies for token-id `prompts`, each generating exactly `max_tokens` tokens."""
    base: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if model:
        base["model"] = model
    return [{**base, "prompt": list(prompt)} for prompt in prompts]


def _split(total: int, parts: int) -> list[int]:
    """`total` in `parts` sizes that differ by at most one, larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _run_part(url: str, clients: int, bodies: list[dict], request_timeout: float) -> tuple[float, LevelResult]:
    """One client process's share of a level (the entry point of a worker process): its closed loop, and the
    `time.perf_counter()` it started at (a system-wide monotonic clock, so comparable across processes)."""

    async def part() -> tuple[float, LevelResult]:
        async with ServerClient(url, timeout=request_timeout, max_connections=clients + 8) as client:
            started = time.perf_counter()
            level = await run_level(
                client,
                clients,
                bodies,
                path=COMPLETIONS_PATH,
                level_seconds=math.inf,
                deadline=Deadline(math.inf),
                bar=Bar(),
                scrape_metrics=False,
            )
            return started, level

    return asyncio.run(part())


def _merge(
    clients: int,
    parts: list[tuple[float, LevelResult]],
    before: MetricsSnapshot | None,
    after: MetricsSnapshot | None,
) -> LevelResult:
    """One level from its processes' parts: their requests together, timed from the first part's start to the last
    part's end."""
    start = min(started for started, _ in parts)
    end = max(started + level.wall_seconds for started, level in parts)
    records = [
        replace(r, sent_at=round(r.sent_at + started - start, 6)) for started, level in parts for r in level.requests
    ]
    merged = LevelResult.of(
        clients,
        sum(level.planned_requests for _, level in parts),
        end - start,
        any(level.stopped_by_time for _, level in parts),
        records,
        before,
        after,
        sum(level.client_cpu_seconds for _, level in parts),
    )
    return replace(merged, client_processes=len(parts))


async def run_served_levels(
    url: str,
    levels: Sequence[tuple[int, Sequence[Sequence[int]]]],
    max_tokens: int,
    *,
    warmup: Sequence[Sequence[int]] = (),
    warmup_tokens: int = 4,
    model: str | None = None,
    request_timeout: float = 600.0,
    client_processes: int = 1,
    progress: Progress | None = None,
    on_level: Callable[[LevelResult], None] | None = None,
) -> tuple[LevelResult | None, list[LevelResult]]:
    """Stream each level's prompts through that many closed-loop clients, in order, after a warm-up level.

    `levels` holds (clients, prompts) pairs; every prompt is one request. `warmup` prompts run first, all at
    once, `warmup_tokens` tokens each (first kernels compiled, allocator grown), and are reported apart.

    A level of C clients runs in min(C, `client_processes`) processes, the clients and requests split evenly
    among them: one Python process reading a few hundred fast streams can become what limits the rate (its CPU
    time is each level's `client_cpu_seconds`, summed over its processes). `on_level` is called as each level
    ends. Returns (the warm-up level or None, the levels).
    """
    progress = progress or Progress(False)
    connections = max([len(warmup), *(clients for clients, _ in levels)]) + 8
    unbounded = Deadline(math.inf)  # a level runs all its requests: the offline comparison needs the same work
    workers = max(1, min(client_processes, max(clients for clients, _ in levels)))
    # Spawned, not forked: the caller may hold threads or a device context that a fork would copy half-made.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None
    loop = asyncio.get_running_loop()

    async def level(label: str, clients: int, prompts: Sequence[Sequence[int]], tokens: int) -> LevelResult:
        bodies = completion_bodies(prompts, tokens, model)
        processes = min(clients, client_processes)
        with progress.bar(label, len(prompts)) as bar:
            if pool is None or processes == 1:
                return await run_level(
                    client, clients, bodies, path=COMPLETIONS_PATH, level_seconds=math.inf, deadline=unbounded, bar=bar
                )
            before = await client.metrics()
            shares = _split(clients, processes)
            # Requests in proportion to clients, so every process's clients send as many each.
            bounds = [len(bodies) * done // clients for done in itertools.accumulate(shares, initial=0)]
            parts = await asyncio.gather(
                *(
                    loop.run_in_executor(pool, _run_part, url, share, bodies[lo:hi], request_timeout)
                    for share, lo, hi in zip(shares, bounds, bounds[1:], strict=False)
                )
            )
            after = await client.metrics()
            bar.advance(len(prompts))
            return _merge(clients, parts, before, after)

    try:
        async with ServerClient(url, timeout=request_timeout, max_connections=connections) as client:
            if pool is not None:  # start the workers (a spawn imports this package) before anything is timed
                await asyncio.gather(*(loop.run_in_executor(pool, time.sleep, 0.2) for _ in range(workers)))
            warm = await level("warm-up", len(warmup), warmup, warmup_tokens) if warmup else None
            results = []
            for clients, prompts in levels:
                results.append(await level(f"{clients} clients", clients, prompts, max_tokens))
                if on_level is not None:
                    on_level(results[-1])
    except BaseException:
        if pool is not None:  # don't wait for the workers' streams: they end when the caller stops the server
            pool.shutdown(wait=False, cancel_futures=True)
        raise
    if pool is not None:
        pool.shutdown()
    return warm, results


def level_numbers(level: LevelResult) -> dict[str, Any]:
    """The numbers of one level that `kvfree bench --serve` reports (seconds; None where nothing was measured); the
    client's CPU fraction is per process it ran in."""
    s = level.summary
    # Streams that sent text sent one event for their first text and one per later gap.
    chunks = s.ttft.n + s.itl.n
    itl_ratio = s.itl.p99 / s.itl.p50 if s.itl.p50 else None
    return {
        "clients": level.concurrency,
        "requests": s.requests,
        "ok": s.ok,
        "errors": s.errors,
        "error_messages": s.error_messages,
        "completion_tokens": s.output_tokens,
        "wall_s": level.wall_seconds,
        "output_tokens_per_s": level.output_tokens_per_s,
        "requests_per_s": level.requests_per_s,
        "ttft_p50_s": s.ttft.p50,
        "ttft_p99_s": s.ttft.p99,
        "itl_p50_s": s.itl.p50,
        "itl_p99_s": s.itl.p99,
        "itl_p99_over_p50": itl_ratio,
        "tpot_mean_s": s.tpot.mean,
        "e2e_p50_s": s.e2e.p50,
        "text_chunks_per_token": chunks / s.output_tokens if s.output_tokens else None,
        "server_ttft_s": level.server_ttft,
        "server_itl_s": level.server_itl,
        "server_engine": level.server_engine,
        "client_cpu_s": level.client_cpu_seconds,
        "client_processes": level.client_processes,
        "client_cpu_fraction": level.client_cpu_seconds / level.wall_seconds / level.client_processes
        if level.client_cpu_seconds is not None and level.wall_seconds > 0
        else None,
    }
