"""`kvfree bench --sessions` on the CPU with the tiny checkpoint: a real `kvfree serve` subprocess whose sessions are
parked in each tier before their turns, and the JSON it writes. No speed is asserted: the numbers must be there,
positive, and consistent with each other."""

from __future__ import annotations

import json

import pytest

from kvfree.bench.sessions import PLACES, TARGETS
from kvfree.cli import main as kvfree_main
from tests.paths import TINY_CHECKPOINT

REPEATS, CONTEXT, STREAMS = 2, 48, 3


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    out = tmp_path_factory.mktemp("session-bench") / "sessions.json"
    argv = ["bench", "--sessions", str(TINY_CHECKPOINT), "--device", "cpu", "--context", str(CONTEXT)]
    argv += ["--new-tokens", "4", "--repeats", str(REPEATS), "--out", str(out)]
    argv += ["--under-load", str(STREAMS), "--load-seconds", "1", "--load-warmup", "0.5", "--move-rate", "8"]
    status = kvfree_main(argv)
    return status, json.loads(out.read_text())


def test_every_place_was_timed_after_the_session_was_parked_there(report):
    status, data = report
    assert status == 0
    n = data["numbers"]
    assert set(n["turn_ms"]) == {*PLACES, "recompute"}
    for place, times in n["turn_ms"].items():
        assert len(times) == REPEATS and all(t > 0 for t in times), place
        assert n["turn_ms_min"][place] <= n["turn_ms_median"][place]
    # Parking a session in host memory and then on disk took newer sessions: the server's two slots of each.
    assert n["filler_sessions"] >= REPEATS * 2
    assert n["host_over_gpu_ms"] == pytest.approx(n["turn_ms_median"]["host"] - n["turn_ms_median"]["gpu"])
    server = data["server_command"]
    assert server[server.index("--max-sessions") + 1] == "2" and "--snapshot-dir" in server


def test_the_snapshot_was_downloaded_and_restored_and_targets_judged_for_this_device(report):
    _, data = report
    n = data["numbers"]
    assert n["snapshot_bytes"] > 0 and n["snapshot_download_mb_per_s"] > 0 and n["snapshot_restore_mb_per_s"] > 0
    assert n["httpx_download_mb_per_s"] > 0 and n["snapshot_client"] in ("curl", "httpx")
    if n["snapshot_client"] == "curl":
        assert n["snapshot_restore_mb_per_s"] == n["curl_restore_mb_per_s"]
    assert [t["what"] for t in data["targets"]] == [t.what for t in TARGETS]
    for target in data["targets"]:
        assert (target["met"] is None) == (target["device"] != "cpu" or target["metric"] not in n)
    assert data["settings"]["context"] == CONTEXT and data["environment"]["torch"]


def test_under_load_streams_decoded_while_turns_moved_sessions(report):
    _, data = report
    load = data["numbers"]["under_load"]
    assert load["streams"] == STREAMS and data["numbers"]["load_itl_p99_over_p50"] == load["moving"]["p99_over_p50"]
    for phase in ("resident", "moving"):
        x = load[phase]
        assert x["turns"] >= 4 and x["gaps"] > 0 and 0 < x["itl_p50_ms"] <= x["itl_p99_ms"], phase
        assert x["server_itl_ms"]["p50"] > 0 and x["engine"]["steps"] > 0, phase
