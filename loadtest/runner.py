"""One load test from start to end: probe the servers, run the chosen scenarios on each, gather the report.

Order: the context sweep on the server then on the baseline, the concurrency sweep likewise, then the soak on the
server only (it verifies the server under test; the baseline is there to be compared with). Scenarios run one at
a time so that two servers on one machine never load each other's measurements. The whole run is bounded by
`time_limit`; what did not run in time is recorded as skipped.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvfree.loadtest.capacity import CapacityTable, capacity_table
from kvfree.loadtest.client import ServerClient
from kvfree.loadtest.concurrency_sweep import LevelResult, level_request_count, run_concurrency_sweep
from kvfree.loadtest.config import LoadTestConfig
from kvfree.loadtest.context_sweep import ContextSweepResult, run_context_sweep
from kvfree.loadtest.deadline import Deadline
from kvfree.loadtest.progress import Progress
from kvfree.loadtest.prom import ServerMemory
from kvfree.loadtest.soak import SoakResult, run_soak
from kvfree.loadtest.target import is_loopback

REPORT_VERSION = 1


class TargetUnreachable(RuntimeError):
    """A server did not answer (or refused us) before any measurement: nothing to report."""


@dataclass
class ServerReport:
    """Everything measured on one server."""

    role: str  # "server" (under test) or "baseline"
    url: str
    loopback: bool
    model: str | None = None
    kvfree_metrics: bool = False  # /metrics exports kvfree's gauges
    sessions_api: bool = False  # POST /v1/sessions works
    idle_memory: ServerMemory | None = None
    context: ContextSweepResult | None = None
    capacity: CapacityTable | None = None
    concurrency: list[LevelResult] | None = None
    soak: SoakResult | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class LoadTestReport:
    profile: str
    started_at: str
    seconds: float
    config: dict[str, Any]
    servers: list[ServerReport]
    time_limit_reached: bool
    passed: bool
    failures: list[str] = field(default_factory=list)
    version: int = REPORT_VERSION

    def server(self, role: str) -> ServerReport | None:
        return next((s for s in self.servers if s.role == role), None)


async def _probe(client: ServerClient, role: str, url: str, model: str | None) -> ServerReport:
    report = ServerReport(role=role, url=url, loopback=is_loopback(url), model=model)
    models = await client.models()
    if models.status == 0:
        raise TargetUnreachable(f"the {role} at {url} did not answer: {models.error}")
    if models.status in (401, 403):
        raise TargetUnreachable(f"the {role} at {url} refused GET /v1/models ({models.status}): give --api-key")
    if models.ok and report.model is None:
        data = (models.body or {}).get("data") or []
        report.model = data[0].get("id") if data else None
    elif not models.ok:
        report.notes.append(f"GET /v1/models: {models.status}: {models.error}")
    snap = await client.metrics()
    report.kvfree_metrics = snap is not None and snap.is_kvfree
    report.idle_memory = ServerMemory.of(snap) if report.kvfree_metrics else None
    if not report.kvfree_metrics:
        report.notes.append("no kvfree metrics at /metrics: memory gauges and pool size are not reported")
    body = {"model": report.model} if report.model else {}
    created = await client.create_session(body)
    report.sessions_api = created.ok
    if created.ok:
        await client.delete_session(created.body["id"])
    else:
        report.notes.append(
            f"POST /v1/sessions: {created.status}: {created.error}; context sweep without sessions, no soak"
        )
    return report


def _pool_slots(server: ServerReport) -> int | None:
    total = server.idle_memory.pool_slots_total if server.idle_memory else None
    return int(total) if total else None


async def run_loadtest(config: LoadTestConfig, progress: Progress | None = None) -> LoadTestReport:
    """Run `config` and return the report (not yet written: see `loadtest.report.write_report`).

    Raises:
        TargetUnreachable: a server did not answer the first request.
    """
    progress = progress or Progress(False)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    start = time.perf_counter()
    deadline = Deadline(config.time_limit if config.time_limit > 0 else math.inf)
    targets = [("server", config.url, config.model, config.api_key)]
    if config.baseline_url:
        targets.append(("baseline", config.baseline_url, config.baseline_model, config.baseline_api_key))
    clients = [
        ServerClient(url, key or config.api_key, config.request_timeout, config.max_connections)
        for _, url, _, key in targets
    ]
    try:
        servers = [
            await _probe(client, role, url, model)
            for client, (role, url, model, _) in zip(clients, targets, strict=True)
        ]
        pairs = list(zip(servers, clients, strict=True))
        if "context" in config.scenarios:
            for server, client in pairs:
                with progress.bar(f"context sweep [{server.role}]", len(config.contexts), unit="len") as bar:
                    server.context = await run_context_sweep(
                        client,
                        server.model,
                        config.contexts,
                        config.decode_tokens,
                        sessions_api=server.sessions_api,
                        seed=config.seed,
                        deadline=deadline,
                        bar=bar,
                        ignore_eos=config.ignore_eos,
                    )
                server.capacity = capacity_table(
                    server.context,
                    [*config.contexts, *config.capacity_contexts],
                    config.device_memory_gib,
                    server.idle_memory,
                )
        if "concurrency" in config.scenarios:
            total = sum(
                level_request_count(c, config.requests_per_worker, config.min_requests_per_level)
                for c in config.concurrency
            )
            for server, client in pairs:
                with progress.bar(f"concurrency sweep [{server.role}]", total) as bar:
                    server.concurrency = await run_concurrency_sweep(
                        client,
                        server.model,
                        config.concurrency,
                        config.workload,
                        requests_per_worker=config.requests_per_worker,
                        min_requests=config.min_requests_per_level,
                        level_seconds=config.level_seconds,
                        deadline=deadline,
                        temperature=config.temperature,
                        seed=config.seed,
                        bar=bar,
                        ignore_eos=config.ignore_eos,
                    )
        if "soak" in config.scenarios:
            server, client = pairs[0]
            if not server.sessions_api:
                server.notes.append("soak skipped: the server has no session routes")
            else:
                with progress.bar("session soak [server]", None, unit="turn") as bar:
                    server.soak = await run_soak(
                        client,
                        server.model,
                        pool_slots_total=_pool_slots(server),
                        sessions=config.soak_sessions,
                        max_turns=config.soak_turns,
                        max_tokens=config.soak_max_tokens,
                        user_chars=config.soak_user_chars,
                        concurrency=config.soak_concurrency,
                        seconds=config.soak_seconds,
                        deadline=deadline,
                        seed=config.seed,
                        inject_mismatch=config.inject_mismatch,
                        bar=bar,
                    )
    finally:
        for client in clients:
            await client.aclose()

    failures = []
    soak = servers[0].soak
    if soak is not None and soak.mismatches > soak.near_ties:
        injected = f" ({soak.injected} injected by --inject-mismatch)" if soak.injected else ""
        ties = f", besides {soak.near_ties} near-tie flips" if soak.near_ties else ""
        failures.append(
            f"soak: {soak.mismatches - soak.near_ties} of {soak.compared} verified turns differ from their "
            f"reference{injected}{ties}"
        )
    elif soak is not None and soak.compared == 0:
        failures.append("soak: no turn could be verified (see its errors)")
    config_dict = asdict(config)
    config_dict["out"] = str(config.out)
    config_dict.pop("api_key", None)  # never write secrets into a report
    config_dict.pop("baseline_api_key", None)
    return LoadTestReport(
        profile=config.profile,
        started_at=started_at,
        seconds=round(time.perf_counter() - start, 3),
        config=config_dict,
        servers=servers,
        time_limit_reached=deadline.expired,
        passed=not failures,
        failures=failures,
    )
