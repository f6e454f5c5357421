"""`/metrics` after real traffic: the vLLM-style set (vLLM's names under the prefix `kvfree:`) with sane values, the
session-capacity gauge, and the shipped Grafana dashboard querying only metrics the server exports.

A real uvicorn server on a loopback port, driven by the official `openai` SDK.
"""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixtures import make_checkpoint, serve

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana"
NAME = "kvfree-tiny"

# The series vLLM's example Grafana dashboard and `vllm bench`-style tooling read, without their `vllm:` prefix.
VLLM_SERIES = [
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "gpu_cache_usage_perc",
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket",
    "time_per_output_token_seconds_bucket",
    "e2e_request_latency_seconds_bucket",
    "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket",
    "request_success_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
]


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list]:
    """Samples by name after a chat completion, a streamed one, and two turns of the Responses API."""
    ckpt = make_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")
    server = serve(ckpt, NAME, max_sessions=6, max_host_sessions=10)
    try:
        client = server.openai()
        messages = [{"role": "user", "content": "hello"}]
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0)
        list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, stream=True))
        first = client.responses.create(model=NAME, input="hi", max_output_tokens=4, temperature=0)
        client.responses.create(
            model=NAME, input="again", previous_response_id=first.id, max_output_tokens=4, temperature=0
        )
        with server.http() as http:
            text = http.get("/metrics").text
    finally:
        server.stop()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    (match,) = [s for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    return match.value


def test_vllm_style_metrics_after_traffic(scraped):
    for series in VLLM_SERIES:
        assert f"kvfree:{series}" in scraped, series
        assert all(s.labels["model_name"] == NAME for s in scraped[f"kvfree:{series}"]), series
    requests = 4
    assert value(scraped, "kvfree:request_success_total", finished_reason="length") == requests
    assert value(scraped, "kvfree:generation_tokens_total") == 5 + 3 + 4 + 4
    assert value(scraped, "kvfree:prompt_tokens_total") == value(scraped, "kvfree_prompt_tokens_total") > 0
    # The second turn of the Responses API reused the first turn's state.
    hits = value(scraped, "kvfree:prefix_cache_hits_total")
    queries = value(scraped, "kvfree:prefix_cache_queries_total")
    assert 0 < hits < queries == value(scraped, "kvfree:prompt_tokens_total")
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens"):
        assert value(scraped, f"kvfree:{hist}_count") == requests, hist
    # One gap per token after the first of each request, under both of vLLM's names.
    gaps = (5 - 1) + (3 - 1) + (4 - 1) * 2
    assert value(scraped, "kvfree:inter_token_latency_seconds_count") == gaps
    assert value(scraped, "kvfree:time_per_output_token_seconds_count") == gaps
    assert value(scraped, "kvfree:num_requests_running") == value(scraped, "kvfree:num_requests_waiting") == 0
    # Two stored responses hold a session each; the pool has 6 slots.
    usage = value(scraped, "kvfree:kv_cache_usage_perc")
    assert usage == value(scraped, "kvfree:gpu_cache_usage_perc") == value(scraped, "kvfree_pool_slots_used") / 6
    assert value(scraped, "kvfree:num_preemptions_total") == 0


def test_session_capacity_gauge(scraped):
    assert value(scraped, "kvfree_session_capacity", tier="gpu") == 6
    assert value(scraped, "kvfree_session_capacity", tier="host") == 10
    # No snapshot directory or store: host memory is the last tier, so the bound is the sum.
    assert value(scraped, "kvfree_session_capacity", tier="total") == 16


def test_grafana_dashboard_is_current_and_queries_exported_metrics(scraped):
    module = runpy.run_path(str(DASHBOARD / "dashboard.py"))
    assert (DASHBOARD / "kvfree.json").read_text() == module["render"](), "rerun deploy/grafana/dashboard.py"
    exprs = [t["expr"] for p in module["dashboard"]()["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"\b(kvfree[:_][a-z0-9_:]+)", e)}
    assert len(names) >= 15
    missing = sorted(n for n in names if n not in scraped)
    assert not missing, missing
