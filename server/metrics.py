"""Prometheus metrics of one server, in a registry of their own: kvfree's own (`kvfree_...`) and the vLLM-style set.

A registry per `Metrics` (not prometheus_client's global one) lets several apps live in one process, as they do
in tests, without "Duplicated timeseries" errors. Counters and histograms are updated by the routes as requests
go; gauges that describe the engine (queues, pool, sessions, memory) are copied from `ThreadDriver.stats()` by
`update_engine`, typically right before `render`, so a scrape always sees current values.

The vLLM-style set (`VllmStyleMetrics`) carries vLLM's metric names and meanings under the prefix `kvfree:`
instead of `vllm:` (`kvfree:num_requests_running`, `kvfree:time_to_first_token_seconds`, ...), labelled with
`model_name`, so a dashboard built for vLLM works after replacing the prefix; most of it is kvfree's own metrics
re-exported under those names at scrape time. Its KV-cache usage is the state pool's slot usage: what limits how
many sessions decode at once here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Metric, generate_latest
from prometheus_client.registry import Collector

# Buckets sized for interactive serving: first tokens from ms (small models, short prompts) to a minute (long
# prompts under load); gaps between tokens from 1 ms to seconds; whole requests up to 10 minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2)
ITL_BUCKETS += (0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 600)

# Where a session's state can be (architecture.md §6); always exported, so a location with no session reads 0.
SESSION_LOCATIONS = ("gpu", "host", "disk")


class Metrics:
    """The server's metrics. Attributes are the prometheus_client objects, for updates the helpers do not cover."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvfree_requests", "HTTP requests answered, by route and status.", ["route", "status"], registry=r
        )
        self.requests_rejected = Counter(
            "kvfree_requests_rejected",
            "Requests refused before running, by reason (queue_full, ...).",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("kvfree_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("kvfree_generation_tokens", "Tokens generated.", registry=r)
        self.cached_prompt_tokens = Counter(
            "kvfree_cached_prompt_tokens",
            "Prompt tokens not prefilled because a session's state already held them.",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "kvfree_time_to_first_token_seconds",
            "From request arrival to its first token.",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "kvfree_inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "kvfree_e2e_request_latency_seconds",
            "From request arrival to its last token.",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.requests_running = Gauge("kvfree_requests_running", "Requests decoding now.", registry=r)
        self.requests_waiting = Gauge("kvfree_requests_waiting", "Requests queued for a pool slot.", registry=r)
        self.sessions = Gauge("kvfree_sessions", "Sessions, by where their state is.", ["location"], registry=r)
        self.pool_slots_used = Gauge("kvfree_pool_slots_used", "State-pool slots in use.", registry=r)
        self.pool_slots_total = Gauge("kvfree_pool_slots_total", "State-pool slots.", registry=r)
        self.state_bytes_per_session = Gauge(
            "kvfree_state_bytes_per_session",
            "Bytes of one session's state (fixed for a model).",
            registry=r,
        )
        self.state_bytes_in_use = Gauge("kvfree_state_bytes_in_use", "Bytes of state in used pool slots.", registry=r)
        self.gpu_memory_allocated = Gauge(
            "kvfree_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated (0: CPU).", registry=r
        )
        self.gpu_memory_reserved = Gauge(
            "kvfree_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved (0: CPU).", registry=r
        )
        self.pool_reserved_bytes = Gauge(
            "kvfree_pool_reserved_bytes",
            "Device bytes of the state pool (every slot, the scratch row and the template row of a new session).",
            registry=r,
        )
        self.host_state_bytes = Gauge(
            "kvfree_host_state_bytes", "Bytes of session state offloaded to host memory.", registry=r
        )
        self.engine_steps = Gauge("kvfree_engine_steps", "Engine steps run since start.", registry=r)
        self.engine_step_seconds = Gauge(
            "kvfree_engine_step_seconds", "Mean wall time of the engine's last 256 steps.", registry=r
        )
        self.engine_device_wait_fraction = Gauge(
            "kvfree_engine_device_wait_fraction",
            "Share of the last 256 steps' time the engine waited for the device (near 0 while requests run: the "
            "engine's host work, not the GPU, sets the pace).",
            registry=r,
        )
        self.engine_busy_seconds = Gauge(
            "kvfree_engine_busy_seconds",
            "Wall time the engine has spent in steps since start (its rate over an interval: the share of the "
            "interval the engine was stepping, not idle or handling commands).",
            registry=r,
        )
        self.engine_device_wait_seconds = Gauge(
            "kvfree_engine_device_wait_seconds",
            "The part of kvfree_engine_busy_seconds spent waiting for the device.",
            registry=r,
        )
        self.engine_decode_rows = Gauge(
            "kvfree_engine_decode_rows", "Decode rows (one token of one sequence) the engine's steps ran.", registry=r
        )
        self.engine_prefill_tokens = Gauge(
            "kvfree_engine_prefill_tokens", "Prompt tokens the engine's steps prefilled.", registry=r
        )
        self.session_moves = Gauge(
            "kvfree_session_moves",
            "Session state moves between tiers since start (evictions: GPU->host, spills: host->disk, reloads).",
            ["kind"],
            registry=r,
        )
        self.session_resets = Gauge(
            "kvfree_session_resets",
            "Turns on a session whose history did not continue what the session held, so it started over (the "
            "response says `session.reset`), since start.",
            registry=r,
        )
        self.session_writes_pending = Gauge(
            "kvfree_session_writes_pending",
            "Finished turns whose state is still on its way to the session store (--session-write async).",
            registry=r,
        )
        self.session_write_lag = Gauge(
            "kvfree_session_write_lag_seconds",
            "How long the last background session write took to land after its turn ended.",
            registry=r,
        )
        self.session_capacity = Gauge(
            "kvfree_session_capacity",
            "Sessions that fit, by tier: gpu (pool slots: decoding at once), host (idle in host memory), total "
            "(held in all; +Inf when only the session store's disk bounds it).",
            ["tier"],
            registry=r,
        )
        self.prefix_cache_checkpoints = Gauge(
            "kvfree_prefix_cache_checkpoints",
            "Checkpoints the prefix cache holds: states at the ends of earlier requests' prompts, outputs and message "
            "boundaries, which later requests of the same key resume from.",
            registry=r,
        )
        self.prefix_cache_bytes = Gauge(
            "kvfree_prefix_cache_bytes", "State bytes the prefix cache's checkpoints hold, by tier (gpu, host).",
            ["tier"], registry=r,
        )  # fmt: skip
        self.prefix_cache_events = Gauge(
            "kvfree_prefix_cache_events",
            "The prefix cache since start: lookups and hits (requests), hit_tokens (prompt tokens resumed), added and "
            "dropped checkpoints.",
            ["kind"],
            registry=r,
        )
        for location in SESSION_LOCATIONS:
            self.sessions.labels(location=location).set(0)
        # The vLLM-style set needs the served model's name for its label; without one, only kvfree's own.
        self.vllm = VllmStyleMetrics(self, model_name) if model_name is not None else None

    # -- updates ------------------------------------------------------------------------------------------------
    def count_request(self, route: str, status: int) -> None:
        """One answered request. `route` is the route's path template (`/v1/sessions/{id}`), never the raw path,
        so that ids do not make a new time series each."""
        self.requests.labels(route=route, status=str(status)).inc()

    def count_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(reason=reason).inc()

    def count_tokens(self, prompt: int, generated: int, cached: int = 0, finish_reason: str | None = None) -> None:
        """Token counts of one finished request, and how it ended ("stop", "length", ...; None: not said)."""
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.cached_prompt_tokens.inc(cached)
        if self.vllm is not None:
            self.vllm.count_request(prompt, generated, finish_reason or "stop")

    def request_timer(self, clock: Callable[[], float] = time.perf_counter) -> RequestTimer:
        """A timer started now, for one request's TTFT, inter-token and end-to-end latencies."""
        return RequestTimer(self, clock)

    def update_engine(self, stats: Mapping[str, Any]) -> None:
        """Copy the engine's gauges from `ThreadDriver.stats()`; keys that are absent leave a gauge as it is,
        except GPU memory, which reads 0 when the engine reports none (CPU)."""
        gauges = {
            "running": self.requests_running,
            "waiting": self.requests_waiting,
            "pool_slots_used": self.pool_slots_used,
            "pool_slots_total": self.pool_slots_total,
            "state_bytes_per_session": self.state_bytes_per_session,
            "pool_reserved_bytes": self.pool_reserved_bytes,
            "host_state_bytes": self.host_state_bytes,
            "session_writes_pending": self.session_writes_pending,
            "session_write_lag_seconds": self.session_write_lag,
            "engine_steps": self.engine_steps,
            "engine_step_seconds": self.engine_step_seconds,
            "engine_device_wait_fraction": self.engine_device_wait_fraction,
            "engine_busy_seconds": self.engine_busy_seconds,
            "engine_device_wait_seconds": self.engine_device_wait_seconds,
            "engine_decode_rows": self.engine_decode_rows,
            "engine_prefill_tokens": self.engine_prefill_tokens,
        }
        for key, gauge in gauges.items():
            if key in stats:
                gauge.set(stats[key])
        if "state_bytes_in_use" in stats:
            self.state_bytes_in_use.set(stats["state_bytes_in_use"])
        elif "pool_slots_used" in stats and "state_bytes_per_session" in stats:
            self.state_bytes_in_use.set(stats["pool_slots_used"] * stats["state_bytes_per_session"])
        if "sessions" in stats:
            counts: Mapping[str, int] = stats["sessions"]
            for location in {*SESSION_LOCATIONS, *counts}:
                self.sessions.labels(location=location).set(counts.get(location, 0))
        for kind, count in stats.get("session_moves", {}).items():
            if kind == "resets":
                self.session_resets.set(count)
            else:
                self.session_moves.labels(kind=kind).set(count)
        for tier, count in stats.get("session_capacity", {}).items():
            self.session_capacity.labels(tier=tier).set(math.inf if count is None else count)
        cache = stats.get("prefix_cache") or {}
        if cache:
            self.prefix_cache_checkpoints.set(cache["checkpoints"])
            for tier, nbytes in cache["bytes"].items():
                self.prefix_cache_bytes.labels(tier=tier).set(nbytes)
            for kind in ("lookups", "hits", "hit_tokens", "added", "dropped"):
                self.prefix_cache_events.labels(kind=kind).set(cache[kind])
        if self.vllm is not None:
            self.vllm.update_engine(stats)
        self.gpu_memory_allocated.set(stats.get("gpu_memory_allocated", 0))
        self.gpu_memory_reserved.set(stats.get("gpu_memory_reserved", 0))

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of a `GET /metrics` response in Prometheus' text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Latencies of one request: call `tokens(k)` whenever k new tokens arrive and `finish()` once at the end.

    Tokens that arrive together (several in one step, or held back by the detokenizer) split the gap since the
    previous arrival evenly, so the inter-token histogram counts every token once.
    """

    def __init__(self, metrics: Metrics, clock: Callable[[], float] = time.perf_counter) -> None:
        self.metrics = metrics
        self.clock = clock
        self.start = clock()
        self.first_token_at: float | None = None
        self._last = self.start
        self._finished = False

    def tokens(self, count: int = 1) -> None:
        if count <= 0:
            return
        now = self.clock()
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.time_to_first_token.observe(now - self.start)
            count -= 1  # the first token has a TTFT, not an inter-token gap
            if count == 0:
                self._last = now
                return
        gap = (now - self._last) / count
        for _ in range(count):
            self.metrics.inter_token_latency.observe(gap)
        self._last = now

    def finish(self) -> None:
        """Record the end-to-end latency (once; later calls do nothing)."""
        if not self._finished:
            self._finished = True
            self.metrics.e2e_request_latency.observe(self.clock() - self.start)


TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class VllmStyleMetrics(Collector):
    """vLLM's serving metrics under the prefix `kvfree:`, same names, meanings and `model_name` label.

    Most are kvfree's own metrics under vLLM's names, copied at scrape time (`collect`), so no token is timed or
    counted twice on the way. Prefix caching maps to session reuse: a query is a prompt token, a hit a prompt token
    a session's state already held. Recorded here are only what kvfree's own set lacks: finished requests by
    reason, per-request token counts, state-pool usage as a fraction (vLLM's KV-cache usage), and preemptions
    (kvfree never preempts a running request: always 0).
    """

    # vLLM's name (after `kvfree:`) -> the attribute of `Metrics` whose samples it re-exports.
    ALIASES = {
        "num_requests_running": "requests_running",
        "num_requests_waiting": "requests_waiting",
        "prompt_tokens": "prompt_tokens",
        "generation_tokens": "generation_tokens",
        "prefix_cache_queries": "prompt_tokens",
        "prefix_cache_hits": "cached_prompt_tokens",
        "time_to_first_token_seconds": "time_to_first_token",
        "inter_token_latency_seconds": "inter_token_latency",
        "time_per_output_token_seconds": "inter_token_latency",  # vLLM's older name for the same gaps
        "e2e_request_latency_seconds": "e2e_request_latency",
    }

    def __init__(self, metrics: Metrics, model_name: str) -> None:
        r, m = metrics.registry, ["model_name"]
        self.metrics, self.model_name = metrics, model_name

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"kvfree:{name}", doc, m, buckets=TOKEN_COUNT_BUCKETS, registry=r).labels(model_name)

        self.kv_cache_usage_perc = Gauge("kvfree:kv_cache_usage_perc", "State-pool slot usage, 0 to 1 (vLLM: KV "
                                         "cache).", m, registry=r).labels(model_name)  # fmt: skip
        self.gpu_cache_usage_perc = Gauge("kvfree:gpu_cache_usage_perc", "The same, under vLLM's older name.", m,
                                          registry=r).labels(model_name)  # fmt: skip
        Counter("kvfree:num_preemptions", "Running requests preempted (never, here).", m, registry=r).labels(model_name)
        self.request_success = Counter(
            "kvfree:request_success", "Finished requests, by how they ended.", [*m, "finished_reason"], registry=r
        )
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.")
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.")
        r.register(self)

    def collect(self) -> Iterator[Metric]:
        for name, source in self.ALIASES.items():
            for family in getattr(self.metrics, source).collect():
                alias = Metric(f"kvfree:{name}", family.documentation, family.type)
                alias.samples = [
                    sample._replace(
                        name=f"kvfree:{name}" + sample.name[len(family.name) :],
                        labels={"model_name": self.model_name, **sample.labels},
                    )
                    for sample in family.samples
                ]
                yield alias

    def describe(self) -> list[Metric]:
        # Without this the registry would call `collect` at registration to learn the names (auto_describe).
        return [Metric(f"kvfree:{name}", "", "untyped") for name in self.ALIASES]

    def count_request(self, prompt: int, generated: int, finish_reason: str) -> None:
        self.request_prompt_tokens.observe(prompt)
        self.request_generation_tokens.observe(generated)
        self.request_success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()

    def update_engine(self, stats: Mapping[str, Any]) -> None:
        if stats.get("pool_slots_total"):
            usage = stats.get("pool_slots_used", 0) / stats["pool_slots_total"]
            self.kv_cache_usage_perc.set(usage)
            self.gpu_cache_usage_perc.set(usage)
