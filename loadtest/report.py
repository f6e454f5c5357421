"""Writing a run's results: `report.json` (every raw measurement) and `report.md` (the summary a person reads).

The JSON is the dataclasses of `loadtest.runner.LoadTestReport` as they are, with non-finite numbers written as
null (strict JSON). The Markdown has one section per scenario, side by side for the server and the baseline, and
links the plots written beside it by `loadtest.plots`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvfree.loadtest.capacity import GIB
from kvfree.loadtest.runner import LoadTestReport, ServerReport
from kvfree.loadtest.soak import NEAR_TIE_NATS
from kvfree.loadtest.stats import Percentiles

REPORT_JSON = "report.json"
REPORT_MD = "report.md"


def json_safe(value: Any) -> Any:
    """`value` made strict-JSON-safe: NaN and infinities become None, paths and tuples their plain forms."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def report_dict(report: LoadTestReport) -> dict[str, Any]:
    return json_safe(asdict(report))


# -- formatting ---------------------------------------------------------------------------------------------------


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _num(x: float | None, digits: int = 1) -> str:
    return "–" if x is None or not math.isfinite(x) else f"{x:,.{digits}f}"


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1e3 * x:.1f}"


def _pct_ms(p: Percentiles | None) -> str:
    if p is None or p.n == 0:
        return "–"
    return f"{_ms(p.p50)} / {_ms(p.p90)} / {_ms(p.p99)}"


def _cell(text: str) -> str:
    """A table cell: a `|` or a newline in free text (error messages, replies) would break the row."""
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


# -- sections -----------------------------------------------------------------------------------------------------


def _servers_section(report: LoadTestReport) -> list[str]:
    rows = []
    for s in report.servers:
        idle = s.idle_memory
        rows.append(
            [
                s.role,
                s.url,
                s.model or "–",
                "yes" if s.loopback else "**no**",
                "yes" if s.sessions_api else "no",
                _num(idle.pool_slots_total, 0) if idle else "–",
                _bytes(idle.state_bytes_per_session) if idle else "–",
            ]
        )
    header = ["role", "URL", "model", "loopback", "sessions API", "pool slots", "state bytes/session (reserved)"]
    lines = ["## Servers", "", *_table(header, rows), ""]
    for s in report.servers:
        lines += [f"- {s.role}: {note}" for note in s.notes]
    return [*lines, ""]


def _memory_section(report: LoadTestReport) -> list[str]:
    servers = [s for s in report.servers if s.context is not None]
    if not servers:
        return []
    lines = [
        "## Memory against context length",
        "",
        "One session at a time: prefilled with exactly L token ids (`POST /v1/sessions`), then "
        f"{servers[0].context.decode_tokens} tokens decoded by continuing it. `state_bytes` is "
        "`GET /v1/sessions/{id}`'s; Δ in-use is the change of `kvfree_state_bytes_in_use` in `/metrics`. The slope is "
        "a least-squares line through (tokens, state_bytes) over the lengths.",
        "",
    ]
    rows = []
    for s in servers:
        fit, in_use = s.context.slope, s.context.in_use_slope
        rows.append(
            [
                s.role,
                _num(fit.slope, 2) if fit else "–",
                _bytes(fit.intercept) if fit else "–",
                _num(fit.r2, 4) if fit and fit.r2 is not None else "–",
                _num(in_use.slope, 2) if in_use else "–",
                str(sum(1 for p in s.context.points if p.ok)),
            ]
        )
    lines += _table(
        ["role", "slope (B/token)", "intercept", "R²", "slope of /metrics in-use (B/token)", "points"], rows
    )
    for s in servers:
        lines += ["", f"### {s.role} ({s.model or s.url}), {s.context.mode} mode", ""]
        rows = []
        for p in s.context.points:
            if not p.ok:
                rows.append([str(p.context), f"error: {p.error}", *["–"] * 9])
                continue
            decode = p.decode
            rows.append(
                [
                    str(p.context),
                    str(p.num_tokens),
                    _bytes(p.state_bytes),
                    _bytes(p.in_use_delta),
                    _bytes(p.gpu_allocated_delta),
                    _num(p.prefill_seconds, 3),
                    _num(p.prefill_tokens_per_s, 0),
                    _ms(decode.ttft if decode else None),
                    _ms(p.decode_itl.p50 if p.decode_itl else None),
                    _num(p.decode_tokens_per_s, 1),
                    {True: "yes", False: "**no**", None: "–"}[p.decode_reused_session],
                ]
            )
        header = [
            "context",
            "tokens",
            "state_bytes",
            "Δ in-use",
            "Δ GPU allocated",
            "prefill s",
            "prefill tok/s",
            "decode TTFT ms",
            "ITL p50 ms",
            "decode tok/s",
            "session reused",
        ]
        lines += _table(header, rows)
    return [*lines, ""]


def _capacity_section(report: LoadTestReport, device_memory_gib: float) -> list[str]:
    servers = [s for s in report.servers if s.capacity is not None]
    if not servers:
        return []
    lines = [f"## Sessions that fit in {device_memory_gib:g} GiB of device memory", ""]
    for s in servers:
        cap = s.capacity
        lines.append(
            f"- {s.role}: budget {_bytes(cap.budget_bytes)} = {_bytes(cap.device_memory_bytes)} minus "
            f"{_bytes(cap.non_state_bytes)} the server holds besides session states (weights; 0 on a CPU server)"
            + (
                f"; its pool reserves {_bytes(cap.reserved_bytes_per_slot)} per slot, so as configured the budget "
                f"holds {cap.slots_at_reserved_size:,} slots"
                if cap.slots_at_reserved_size is not None
                else ""
            )
        )
    lines += [
        "",
        "Numbers marked ~ are extrapolated from the fitted bytes per session (that length was not measured); the "
        "others use the bytes per session measured at that length.",
        "",
    ]
    contexts = sorted({row.context for s in servers for row in s.capacity.rows})
    rows = []
    for context in contexts:
        row = [f"{context:,}"]
        for s in servers:
            found = next((r for r in s.capacity.rows if r.context == context), None)
            if found is None or found.sessions is None:
                row += ["–", "–"]
                continue
            mark = "~" if found.source == "extrapolated" else ""
            row += [f"{mark}{_bytes(found.bytes_per_session)}", f"{mark}{found.sessions:,}"]
        rows.append(row)
    header = ["context"]
    for s in servers:
        header += [f"{s.role} bytes/session", f"{s.role} sessions"]
    return [*lines, *_table(header, rows), ""]


def _concurrency_section(report: LoadTestReport) -> list[str]:
    servers = [s for s in report.servers if s.concurrency is not None]
    if not servers:
        return []
    lines = [
        "## Latency and throughput against concurrency",
        "",
        "Streamed chat requests in a closed loop per client. TTFT and ITL (gaps between streamed text events) are "
        "measured by the client, as p50 / p90 / p99 in ms; the server's own histograms (bucket-interpolated p50) are "
        "shown as a cross-check where exported.",
        "",
    ]
    for s in servers:
        rows = []
        for level in s.concurrency:
            summary = level.summary
            rows.append(
                [
                    str(level.concurrency),
                    f"{summary.ok}/{summary.requests}" + (" (time)" if level.stopped_by_time else ""),
                    str(summary.errors),
                    str(summary.rate_limited),
                    _pct_ms(summary.ttft),
                    _pct_ms(summary.itl),
                    _num(level.output_tokens_per_s, 1),
                    _num(level.requests_per_s, 2),
                    _ms((level.server_ttft or {}).get("p50")),
                    _ms((level.server_itl or {}).get("p50")),
                ]
            )
        header = [
            "clients",
            "ok/sent",
            "errors",
            "429",
            "TTFT ms",
            "ITL ms",
            "output tok/s",
            "req/s",
            "server TTFT p50",
            "server ITL p50",
        ]
        lines += [f"### {s.role} ({s.model or s.url})", "", *_table(header, rows), ""]
        errors = {m: n for level in s.concurrency for m, n in level.summary.error_messages.items()}
        lines += [f"- error ×{n}: {m}" for m, n in errors.items()]
        if errors:
            lines.append("")
    return lines


def _soak_section(server: ServerReport | None) -> list[str]:
    if server is None or server.soak is None:
        return []
    soak = server.soak
    verdict = "**PASS**" if soak.passed else "**FAIL**"
    lines = [
        "## Session soak",
        "",
        f"{verdict}: {soak.compared} turns verified against the reference (the same conversation sent without "
        f"`session_id`), **{soak.mismatches} mismatches**"
        + (f" ({soak.injected} injected by --inject-mismatch)" if soak.injected else "")
        + (
            f" ({soak.near_ties} of them near-tie flips: both paths' margin under {NEAR_TIE_NATS} nats, not failures)"
            if soak.near_ties
            else ""
        )
        + f", {soak.errors} errors.",
        "",
        f"- sessions: {soak.sessions_created} of {soak.sessions_planned} planned, over "
        f"{soak.pool_slots_total if soak.pool_slots_total is not None else '?'} pool slots; {soak.seconds:.1f} s, "
        f"stopped by {soak.stopped_by}",
        "- where each session's state was when its turn started: "
        + ", ".join(f"{loc} {n}" for loc, n in sorted(soak.locations_before.items())),
        "- verified turns that resumed from host memory or disk and reused their cached tokens: "
        f"{soak.reloaded_and_verified}",
        f"- turns that reused cached tokens: {soak.turns_with_cached_tokens}; resets (history not a prefix of the "
        f"state, prefilled anew): {soak.resets}",
    ]
    lines += [f"- session creation error: {e}" for e in soak.create_errors[:5]]
    if soak.compared and soak.resets * 2 > soak.compared:
        lines.append(
            "- **note**: most turns were resets: the model's replies do not round-trip through text (e.g. random "
            "weights emitting invalid UTF-8), so those turns checked a fresh prefill, not a reloaded state; only "
            "turns with cached tokens verify offload and reload"
        )
    bad = [t for t in soak.turns if t.match is False]
    if bad:
        lines += ["", "Mismatches (first 10):", ""]
        rows = [
            [
                str(t.session),
                str(t.turn),
                t.location_before or "–",
                "yes" if t.injected else "no",
                str(t.first_difference),
                "–" if t.tie_margin is None else f"{t.tie_margin:.3f}" + (" (near tie)" if t.near_tie else ""),
                f"`{(t.reply or '')!r}`",
                f"`{(t.reference or '')!r}`",
            ]
            for t in bad[:10]
        ]
        header = ["session", "turn", "was on", "injected", "first diff", "margin (nats)", "reply", "reference"]
        lines += _table(header, rows)
    return [*lines, ""]


def render_markdown(report: LoadTestReport, plots: list[str]) -> str:
    device_memory = report.config.get("device_memory_gib", 0.0)
    verdict = "PASS" if report.passed else "FAIL"
    lines = [
        f"# kvfree load test ({report.profile} profile)",
        "",
        f"Started {report.started_at}, ran {report.seconds:.1f} s. Result: **{verdict}**."
        + (" The run's time limit was reached: later scenarios may be cut short." if report.time_limit_reached else ""),
        "",
    ]
    lines += [f"- **failure**: {f}" for f in report.failures]
    if report.failures:
        lines.append("")
    lines += _servers_section(report)
    lines += _memory_section(report)
    lines += _capacity_section(report, device_memory)
    lines += _concurrency_section(report)
    lines += _soak_section(report.server("server"))
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
        lines.append("")
    lines.append(f"All raw measurements: `{REPORT_JSON}`.")
    return "\n".join(lines) + "\n"


def write_report(
    report: LoadTestReport, out_dir: Path, plots: list[str] | None = None, plot_error: str | None = None
) -> tuple[Path, Path]:
    """Write report.json and report.md into `out_dir` (created if needed); returns their paths. `plots` are the
    PNG files written beside them (linked from the Markdown), `plot_error` why there are none."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = report_dict(report)
    data["plots"] = [Path(p).name for p in plots or []]
    data["plot_error"] = plot_error
    json_path = out_dir / REPORT_JSON
    json_path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    md_path = out_dir / REPORT_MD
    text = render_markdown(report, plots or [])
    if plot_error:
        text += f"\n{plot_error}\n"
    md_path.write_text(text)
    return json_path, md_path
