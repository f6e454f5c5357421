"""`kvfree loadtest` (package loadtest/) against real servers on loopback ports.

A pair of in-thread uvicorn servers (tests/server_fixtures.py): the tiny Mamba-2 checkpoint under test and the
tiny-attention checkpoint of equal width and depth as the baseline, both with the weights rescaled so that greedy
replies are printable text that depends on the whole context (so a session restored wrong answers differently).
The quick profile runs against the pair once (module fixture) and the tests read its report. Also a soak with an
injected mismatch, the stateless path against a minimal OpenAI-compatible server without kvfree's routes, and the
command line's help and argument errors.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from kvfree.cli import main as kvfree_main
from kvfree.loadtest.capacity import capacity_table
from kvfree.loadtest.cli import main as loadtest_main
from kvfree.loadtest.client import TokenLogprob, sse_lines
from kvfree.loadtest.context_sweep import ContextPoint, ContextSweepResult
from kvfree.loadtest.prom import MetricsSnapshot, ServerMemory, engine_pace, histogram_quantiles
from kvfree.loadtest.soak import NEAR_TIE_NATS, tie_margin
from kvfree.loadtest.stats import fit_line
from kvfree.loadtest.target import TargetError, is_loopback, parse_target_url
from tests.server_fixtures import free_port, make_checkpoint, serve

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# tiny-attention: 4 layers x (k, v) x 2 KV heads x head_dim 32 x 4 bytes (fp32).
ATTENTION_KV_BYTES_PER_TOKEN = 4 * 2 * 2 * 32 * 4
POOL_SLOTS = 4
QUICK_SOAK_SECONDS = "6"  # the quick profile's 20 s soak, shortened: the test needs a few rounds, not 20 s of them


# -- fixtures -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_pair(tmp_path_factory: pytest.TempPathFactory):
    """(server, baseline): tiny Mamba-2 with a small pool spilling to host and disk, and tiny-attention."""
    root = tmp_path_factory.mktemp("loadtest-ckpt")
    server = serve(
        make_checkpoint("tiny", root / "tiny"), "kvfree-tiny", max_sessions=POOL_SLOTS, max_host_sessions=2,
        snapshot_dir=root / "snapshots",
    )  # fmt: skip
    baseline = serve(
        make_checkpoint("tiny-attention", root / "tiny-attention"), "kvfree-tiny-attention", max_sessions=POOL_SLOTS,
        max_context=2048,  # the quick profile's longest context (1024) plus its decode
    )  # fmt: skip
    yield server, baseline
    server.stop()
    baseline.stop()


@pytest.fixture(scope="module")
def quick_run(server_pair, tmp_path_factory) -> dict[str, Any]:
    """The quick profile against the pair: exit status, seconds, output directory and report.json."""
    server, baseline = server_pair
    out = tmp_path_factory.mktemp("loadtest-quick")
    argv = ["--url", server.url, "--baseline-url", baseline.url, "--quick", "--out", str(out), "--no-progress"]
    start = time.monotonic()
    rc = loadtest_main([*argv, "--soak-seconds", QUICK_SOAK_SECONDS])
    seconds = time.monotonic() - start
    return {"rc": rc, "seconds": seconds, "out": out, "report": json.loads((out / "report.json").read_text())}


def _server(report: dict[str, Any], role: str) -> dict[str, Any]:
    return next(s for s in report["servers"] if s["role"] == role)


def _check_png(path: Path) -> None:
    """A complete PNG: signature, an IHDR chunk with a valid CRC and a non-empty size, and an IEND chunk at the end."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, path
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100, (path, width, height)
    (crc,) = struct.unpack(">I", data[16 + length : 20 + length])
    assert crc == zlib.crc32(data[12 : 16 + length]), path
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82", path


# -- the quick profile against a real pair ------------------------------------------------------------------------


PNGS = {
    "memory_vs_context.png",
    "sessions_vs_context.png",
    "latency_vs_concurrency.png",
    "throughput_vs_concurrency.png",
}


def test_quick_profile_writes_the_json_and_markdown_reports(quick_run):
    assert quick_run["rc"] == 0, quick_run["report"]["failures"]
    out: Path = quick_run["out"]
    report = quick_run["report"]
    assert report["passed"] is True and report["failures"] == [] and report["time_limit_reached"] is False
    assert report["profile"] == "quick" and report["version"] == 1
    assert "api_key" not in report["config"]
    md = (out / "report.md").read_text()
    assert "Result: **PASS**" in md
    for heading in ("Memory against context length", "Sessions that fit in 80 GiB", "against concurrency", "soak"):
        assert heading in md
    # The quick profile is meant to finish within 2 minutes on a CPU (here with a 6 s soak instead of 20 s).
    assert quick_run["seconds"] < 100


def test_quick_profile_plots_are_valid_pngs(quick_run):
    pytest.importorskip("matplotlib", reason="plots need matplotlib (not a dependency of kvfree[test] yet)")
    out: Path = quick_run["out"]
    assert set(quick_run["report"]["plots"]) == PNGS and quick_run["report"]["plot_error"] is None
    md = (out / "report.md").read_text()
    for name in PNGS:
        _check_png(out / name)
        assert f"({name})" in md  # linked from the summary


def test_memory_slope_is_flat_for_mamba2_and_the_kv_cache_for_attention(quick_run):
    report = quick_run["report"]
    server, baseline = _server(report, "server"), _server(report, "baseline")
    for s in (server, baseline):
        points = s["context"]["points"]
        assert [p["context"] for p in points] == [64, 128, 256, 512, 1024]
        assert all(p["ok"] for p in points), [p["error"] for p in points]
        assert all(p["num_tokens"] == p["context"] for p in points)
        # The decode continued the session: all of its tokens reused, none prefilled again.
        assert all(p["decode_reused_session"] for p in points)
        assert all(p["decode"]["completion_tokens"] == 16 for p in points)
        assert all(p["prefill_seconds"] > 0 and p["decode"]["ttft"] > 0 for p in points)
    assert abs(server["context"]["slope"]["slope"]) < 1.0
    assert server["context"]["slope"]["intercept"] > 0  # a fixed-size state, but a state
    slope = baseline["context"]["slope"]["slope"]
    assert slope == pytest.approx(ATTENTION_KV_BYTES_PER_TOKEN, rel=0.10)
    # /metrics agrees with GET /v1/sessions/{id}: the in-use gauge grows by the session's bytes.
    assert abs(server["context"]["in_use_slope"]["slope"]) < 1.0
    assert baseline["context"]["in_use_slope"]["slope"] == pytest.approx(ATTENTION_KV_BYTES_PER_TOKEN, rel=0.10)
    for s in (server, baseline):
        for p in s["context"]["points"]:
            assert p["in_use_delta"] == p["state_bytes"]
            assert p["memory_after_prefill"]["pool_slots_total"] == POOL_SLOTS


def test_sessions_that_fit_are_measured_or_marked_extrapolated(quick_run):
    report = quick_run["report"]
    server, baseline = _server(report, "server"), _server(report, "baseline")
    for s in (server, baseline):
        rows = {r["context"]: r for r in s["capacity"]["rows"]}
        assert {rows[c]["source"] for c in (64, 128, 256, 512, 1024)} == {"measured"}
        assert {rows[c]["source"] for c in (4096, 16384, 32768, 131072)} == {"extrapolated"}
        budget = s["capacity"]["budget_bytes"]
        assert budget == 80 * 2**30  # a CPU server: nothing to subtract
        for r in rows.values():
            assert r["sessions"] == budget // r["bytes_per_session"]
    server_rows = {r["context"]: r["sessions"] for r in server["capacity"]["rows"]}
    baseline_rows = {r["context"]: r["sessions"] for r in baseline["capacity"]["rows"]}
    assert len(set(server_rows.values())) == 1  # the same number of sessions at any context
    assert baseline_rows[131072] < baseline_rows[1024] < baseline_rows[64]
    assert server_rows[131072] > 100 * baseline_rows[131072]
    md = (quick_run["out"] / "report.md").read_text()
    assert "~" in md and "extrapolated" in md


def test_concurrency_sweep_records_latency_and_throughput(quick_run):
    report = quick_run["report"]
    for role in ("server", "baseline"):
        levels = _server(report, role)["concurrency"]
        assert [lv["concurrency"] for lv in levels] == [1, 2, 4]
        for lv in levels:
            summary = lv["summary"]
            assert summary["ok"] == summary["requests"] == lv["planned_requests"] > 0, summary["error_messages"]
            assert summary["errors"] == summary["rate_limited"] == 0
            for key in ("ttft", "itl"):
                p = summary[key]
                assert p["n"] > 0 and 0 < p["p50"] <= p["p90"] <= p["p99"]
            assert lv["output_tokens_per_s"] > 0 and lv["requests_per_s"] > 0
            assert len(lv["requests"]) == summary["requests"]
            assert all(r["completion_tokens"] == r["max_tokens"] for r in lv["requests"])  # ignore_eos
            assert lv["server_ttft"]["p50"] > 0  # kvfree's own histogram, as a cross-check
    # The same seeded workload went to both servers.
    lengths = {
        role: [
            (r["prompt_tokens"], r["max_tokens"]) for lv in _server(report, role)["concurrency"] for r in lv["requests"]
        ]
        for role in ("server", "baseline")
    }
    assert sorted(lengths["server"]) == sorted(lengths["baseline"])


def test_soak_verifies_offloaded_sessions_with_zero_mismatches(quick_run):
    soak = _server(quick_run["report"], "server")["soak"]
    assert soak["passed"] is True
    assert soak["pool_slots_total"] == POOL_SLOTS
    assert soak["sessions_created"] == soak["sessions_planned"] == 2 * POOL_SLOTS
    assert soak["mismatches"] == 0 and soak["errors"] == 0
    assert soak["compared"] >= 2 * soak["sessions_created"]  # at least two rounds
    # The pool holds 4 of 8 sessions: turns resumed from host memory and disk, and were verified there.
    assert soak["locations_before"].get("disk", 0) > 0
    assert soak["reloaded_and_verified"] > 0
    # Turns continued their sessions (cached tokens), not re-prefilled from scratch.
    assert soak["turns_with_cached_tokens"] == soak["compared"] and soak["resets"] == 0
    assert _server(quick_run["report"], "baseline")["soak"] is None  # the soak verifies the server under test


def test_injected_mismatch_is_reported_and_fails_the_run(server_pair, tmp_path, capsys):
    """Through `kvfree loadtest`: one corrupted reference is a mismatch, the report says FAIL, the exit status is 1."""
    server, _ = server_pair
    argv = ["loadtest", "--url", server.url, "--scenarios", "soak", "--soak-seconds", "3", "--inject-mismatch"]
    rc = kvfree_main([*argv, "--out", str(tmp_path), "--no-progress"])
    assert rc == 1
    report = json.loads((tmp_path / "report.json").read_text())
    soak = _server(report, "server")["soak"]
    assert soak["mismatches"] >= 1 and soak["injected"] == 1 and soak["passed"] is False
    bad = [t for t in soak["turns"] if t["match"] is False]
    assert any(t["injected"] and "inject-mismatch" in t["reference"] for t in bad)
    assert report["passed"] is False and "injected" in report["failures"][0]
    md = (tmp_path / "report.md").read_text()
    assert "**FAIL**" in md and "injected by --inject-mismatch" in md
    assert "FAIL" in capsys.readouterr().out
    assert _server(report, "server")["context"] is None  # only the soak ran


# -- a server without kvfree's routes -----------------------------------------------------------------------------


def _plain_openai_app() -> FastAPI:
    """An OpenAI-compatible server that is not kvfree: models, streamed completions and chat; no /metrics, no
    sessions. Replies are `max_tokens` copies of "ab", one per event."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "plain", "object": "model"}]}

    def events(body: dict, chat: bool):
        n = body.get("max_tokens") or 16
        prompt = body.get("prompt") or body.get("messages") or []
        for _ in range(n):
            choice = {"index": 0, "delta": {"content": "ab"}} if chat else {"index": 0, "text": "ab"}
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: dict):
        return StreamingResponse(events(body, chat=False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        return StreamingResponse(events(body, chat=True), media_type="text/event-stream")

    return app


def test_a_plain_openai_server_gets_the_generic_parts(tmp_path):
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_plain_openai_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        argv = ["--url", f"http://127.0.0.1:{port}/v1/", "--contexts", "32,64", "--concurrency", "1,2"]
        rc = loadtest_main([*argv, "--out", str(tmp_path), "--no-progress", "--soak-seconds", "1"])
    finally:
        server.should_exit = True
        thread.join(30)
    # No session routes: the soak is skipped with a note (not a failure); the generic sweeps ran.
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    s = _server(report, "server")
    assert s["url"] == f"http://127.0.0.1:{port}" and s["model"] == "plain"
    assert s["sessions_api"] is False and s["kvfree_metrics"] is False and s["soak"] is None
    assert any("soak skipped" in note for note in s["notes"])
    assert s["context"]["mode"] == "stateless"
    assert all(p["ok"] and p["num_tokens"] == p["context"] for p in s["context"]["points"])
    assert s["context"]["slope"] is None  # no per-session memory to fit
    assert [lv["summary"]["ok"] for lv in s["concurrency"]] == [8, 8]
    assert report["plots"] == [] or "latency_vs_concurrency.png" in report["plots"]


# -- command line -------------------------------------------------------------------------------------------------


def test_kvfree_loadtest_help(capsys):
    with pytest.raises(SystemExit) as exc:
        kvfree_main(["loadtest", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flags = "--url --baseline-url --out --quick --gpu --contexts --concurrency --device-memory-gib --soak-seconds"
    for flag in [*flags.split(), "--inject-mismatch", "--no-progress", "--time-limit", "--scenarios"]:
        assert flag in out
    # The real console entry point, once, as a process.
    r = subprocess.run(
        [sys.executable, "-m", "kvfree", "loadtest", "-h"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "usage: kvfree loadtest" in r.stdout


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("localhost:8000", "no scheme"),
        ("ftp://127.0.0.1:8000", "scheme must be http or https"),
        ("http://", "no host"),
        ("http://127.0.0.1:99999", "not a valid URL"),
        ("http://127.0.0.1:80a", "not a valid URL"),
        ("http://user:secret@127.0.0.1:8000", "--api-key"),
        ("http://127.0.0.1:8000/?x=1", "no query"),
        ("", "empty"),
    ],
)
def test_malformed_url_is_a_clear_usage_error(url, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        kvfree_main(["loadtest", "--url", url, "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --url" in err and message in err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--contexts", "64,abc"], "'abc' is not an integer"),
        (["--concurrency", "0,4"], "positive"),
        (["--scenarios", "context,bogus"], "choose among"),
        (["--quick", "--gpu"], "not allowed with"),
        (["--prompt-median", "500", "--prompt-max", "100"], "above --prompt-max"),
        (["--baseline-url", "127.0.0.1"], "no scheme"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        loadtest_main([*argv, "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_urls_are_normalised_and_remote_ones_accepted():
    assert parse_target_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert parse_target_url(" https://gpu-box.example:443/kvfree/ ") == "https://gpu-box.example:443/kvfree"
    assert parse_target_url("http://[::1]:8000") == "http://[::1]:8000"
    assert is_loopback("http://[::1]:8000") and is_loopback("http://localhost:1") and is_loopback("http://127.0.0.2")
    assert not is_loopback("http://10.0.0.7:8000") and not is_loopback("http://gpu-box.example")
    with pytest.raises(TargetError):
        parse_target_url("127.0.0.1:8000")


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    rc = loadtest_main(["--url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path), "--no-progress"])
    assert rc == 2
    assert "did not answer" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


# -- pieces -------------------------------------------------------------------------------------------------------


def test_fit_line_recovers_a_slope_and_refuses_a_single_length():
    fit = fit_line([64, 128, 1024, 131072], [32 + 2048 * x for x in (64, 128, 1024, 131072)])
    assert fit.slope == pytest.approx(2048) and fit.intercept == pytest.approx(32, abs=1e-3) and fit.r2 == 1
    flat = fit_line([64, 128, 256], [146432] * 3)
    assert flat.slope == 0 and flat.r2 is None
    assert fit_line([64, 64], [1, 2]) is None


def test_engine_pace_is_the_difference_of_the_engine_counters_over_the_interval():
    def scrape(steps: int, busy: float, wait: float, decode: int, prefill: int) -> MetricsSnapshot:
        return MetricsSnapshot.parse(
            f"kvfree_engine_steps {steps}\nkvfree_engine_busy_seconds {busy}\nkvfree_engine_device_wait_seconds "
            f"{wait}\nkvfree_engine_decode_rows {decode}\nkvfree_engine_prefill_tokens {prefill}\n"
        )

    before, after = scrape(10, 1.0, 0.5, 100, 4096), scrape(110, 1.8, 1.1, 6500, 12288)
    pace = engine_pace(before, after, wall=1.0)
    assert pace == pytest.approx({
        "steps": 100, "step_ms_mean": 8.0, "busy_share": 0.8, "device_wait_share": 0.75,
        "decode_rows_per_step": 64.0, "prefill_tokens_per_step": 81.92,
    })  # fmt: skip
    assert engine_pace(after, after, wall=1.0) is None  # no step in between
    assert engine_pace(MetricsSnapshot.parse("other_metric 1\n"), after, wall=1.0) is None  # not a kvfree server
    assert engine_pace(None, after, wall=1.0) is None


def test_histogram_quantiles_from_two_scrapes():
    def scrape(counts: list[int]) -> MetricsSnapshot:
        bounds = ["0.01", "0.1", "1.0", "+Inf"]
        lines = [f'h_bucket{{le="{b}"}} {c}' for b, c in zip(bounds, counts, strict=True)]
        return MetricsSnapshot.parse("\n".join(["# TYPE h histogram", *lines, f"h_count {counts[-1]}"]))

    before, after = scrape([5, 5, 5, 5]), scrape([5, 15, 15, 15])  # 10 new observations in (0.01, 0.1]
    q = histogram_quantiles(before, after, "h", (0.5, 0.9))
    assert q["p50"] == pytest.approx(0.055) and q["p90"] == pytest.approx(0.091)
    assert histogram_quantiles(after, after, "h", (0.5,)) is None  # nothing observed in between


def test_capacity_uses_measured_bytes_and_extrapolates_the_rest():
    sweep = ContextSweepResult(mode="sessions", decode_tokens=1)
    sweep.points = [ContextPoint(context=c, ok=True, num_tokens=c, state_bytes=1000 + 10 * c) for c in (10, 20)]
    sweep.points.append(ContextPoint(context=40, ok=False, error="too long"))
    sweep.slope = fit_line([10, 20], [1100, 1200])
    table = capacity_table(sweep, [40, 10, 20, 10], device_memory_gib=1.0, idle=None)
    assert [(r.context, r.source, r.bytes_per_session) for r in table.rows] == [
        (10, "measured", 1100),
        (20, "measured", 1200),
        (40, "extrapolated", pytest.approx(1400)),  # 40 failed: the fit stands in for it
    ]
    assert [r.sessions for r in table.rows] == [2**30 // 1100, 2**30 // 1200, 2**30 // 1400]
    # On a GPU server the weights (allocated memory beyond the whole pool) come off the budget.
    idle = ServerMemory(state_bytes_per_session=1000, pool_slots_total=4, gpu_memory_allocated=4000 + 2**20)
    assert capacity_table(sweep, [10], device_memory_gib=1.0, idle=idle).budget_bytes == 2**30 - 2**20


def test_python_dash_m_loadtest_is_the_same_command(tmp_path):
    """`python -m kvfree.loadtest` runs the same main; the package imports nothing of the server side."""
    code = (
        "import sys, loadtest.cli, loadtest.runner, loadtest.report, loadtest.plots; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('engine', 'server', 'kernels', 'checkpoints')); "
        "print(bad); assert not bad"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "loadtest", "--url", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "no scheme" in r.stderr


def test_sse_lines_split_at_newlines_only():
    # httpx's aiter_lines splits like str.splitlines, so a raw U+2028 inside an event's JSON cut it in two.
    class Chunks:
        def __init__(self, pieces: list[str]) -> None:
            self.pieces = pieces

        async def aiter_text(self):
            for piece in self.pieces:
                yield piece

    body = 'data: {"t": "a\u2028b\x85c"}\r\n\ndata: [DONE]\n\n'
    pieces = [body[i : i + 5] for i in range(0, len(body), 5)]  # lines arrive cut anywhere

    async def collect() -> list[str]:
        return [line async for line in sse_lines(Chunks(pieces))]

    lines = asyncio.run(collect())
    assert lines == ['data: {"t": "a\u2028b\x85c"}', "", "data: [DONE]", ""]
    assert json.loads(lines[0].removeprefix("data: ")) == {"t": "a\u2028b\x85c"}


def test_tie_margin_tells_a_rounding_flip_from_a_different_distribution():
    def tok(token: str, logprob: float, **top: float) -> TokenLogprob:
        return TokenLogprob(token, logprob, {token: logprob, **top})

    same = [tok("a", -0.1, b=-3.0), tok("b", -0.2, c=-2.0)]
    assert tie_margin(same, same) is None  # the streams never part
    # Both paths rank the same two tokens within 0.02 nats of each other, in opposite order: a near tie.
    flip_got = [tok("a", -0.1, b=-3.0), tok("x", -0.70, y=-0.71)]
    flip_ref = [tok("a", -0.1, b=-3.0), tok("y", -0.69, x=-0.70)]
    assert tie_margin(flip_got, flip_ref) == pytest.approx(0.01) and tie_margin(flip_got, flip_ref) < NEAR_TIE_NATS
    # One path is sure of its token: not a near tie, whatever the other thinks.
    sure = [tok("a", -0.1, b=-3.0), tok("x", -0.01, y=-5.0)]
    assert tie_margin(sure, flip_ref) == pytest.approx(4.99)
    # The other path did not even rank the token: an infinite margin.
    unranked = [tok("a", -0.1, b=-3.0), tok("z", -0.5, w=-0.6)]
    assert tie_margin(unranked, flip_ref) == float("inf")
    # Two byte tokens that both print as U+FFFD are told apart by their bytes.
    entry = {
        "token": "\ufffd",
        "bytes": [0xE2],
        "logprob": -0.5,
        "top_logprobs": [{"token": "\ufffd", "bytes": [0x9C], "logprob": -0.6}],
    }
    parsed = TokenLogprob.of(entry)
    assert parsed.token == "e2" and parsed.top == {"9c": -0.6}
