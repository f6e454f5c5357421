"""Writes deploy/grafana/kvfree.json, the Grafana dashboard of a kvfree server: `python deploy/grafana/dashboard.py`.

The panels chart the vLLM-style metrics (`kvfree:...`, vLLM's names and meanings) beside kvfree's own (`kvfree_...`:
sessions by tier against their capacity, state memory, session-store writes). Import the JSON in Grafana and pick a
Prometheus data source that scrapes the server's `/metrics`. tests/server/test_metrics.py checks that the committed
JSON is what this script writes and that every metric it queries is exported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("kvfree.json")
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
M = 'model_name="$model_name"'
RATE = "[$__rate_interval]"


def quantiles(metric: str) -> list[tuple[str, str]]:
    """p50, p90 and p99 of a histogram over the dashboard's rate window."""
    return [
        (f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{M}}}{RATE})))", f"p{round(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ]


# (title, unit, [(PromQL, legend)]), two panels per row.
PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    ("Time to first token", "s", quantiles("kvfree:time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("kvfree:inter_token_latency_seconds")),
    ("End-to-end request latency", "s", quantiles("kvfree:e2e_request_latency_seconds")),
    (
        "Token throughput",
        "tokens/s",
        [
            (f"rate(kvfree:prompt_tokens_total{{{M}}}{RATE})", "prompt"),
            (f"rate(kvfree:generation_tokens_total{{{M}}}{RATE})", "generation"),
        ],
    ),
    (
        "Requests running and waiting",
        "short",
        [(f"kvfree:num_requests_running{{{M}}}", "running"), (f"kvfree:num_requests_waiting{{{M}}}", "waiting")],
    ),
    ("State-pool usage (vLLM: KV cache usage)", "percentunit", [(f"kvfree:kv_cache_usage_perc{{{M}}}", "slots used")]),
    (
        "Prompt tokens reused from session state",
        "percentunit",
        [
            (
                f"rate(kvfree:prefix_cache_hits_total{{{M}}}{RATE})"
                f" / rate(kvfree:prefix_cache_queries_total{{{M}}}{RATE})",
                "reused",
            )
        ],
    ),
    (
        "Finished requests by reason",
        "reqps",
        [(f"sum by (finished_reason) (rate(kvfree:request_success_total{{{M}}}{RATE}))", "{{finished_reason}}")],
    ),
    (
        "Sessions by tier, and how many fit",
        "short",
        [("kvfree_sessions", "{{location}}"), ("kvfree_session_capacity", "capacity {{tier}}")],
    ),
    (
        "Session state memory",
        "bytes",
        [
            ("kvfree_state_bytes_in_use", "in pool slots"),
            ("kvfree_pool_reserved_bytes", "pool reserved"),
            ("kvfree_host_state_bytes", "host memory"),
        ],
    ),
    (
        "Request lengths",
        "short",
        [
            *[(e, "prompt " + leg) for e, leg in quantiles("kvfree:request_prompt_tokens")],
            *[(e, "generation " + leg) for e, leg in quantiles("kvfree:request_generation_tokens")],
        ],
    ),
    (
        "Session store",
        "short",
        [("kvfree_session_writes_pending", "writes pending"), ("kvfree_session_write_lag_seconds", "write lag (s)")],
    ),
]


def panel(index: int, title: str, unit: str, targets: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict[str, Any]:
    return {
        "title": "kvfree",
        "uid": "kvfree-serving",
        "description": "A kvfree server: vLLM-style serving metrics (prefix kvfree:) and session state.",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "tags": ["kvfree", "llm-serving"],
        "templating": {
            "list": [
                {"name": "DS_PROMETHEUS", "label": "Data source", "type": "datasource", "query": "prometheus"},
                {
                    "name": "model_name",
                    "label": "Model",
                    "type": "query",
                    "datasource": DS,
                    "query": "label_values(kvfree:num_requests_running, model_name)",
                    "refresh": 2,
                },
            ]
        },
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
