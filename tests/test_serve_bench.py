"""`kvfree bench --serve` on the CPU with the tiny checkpoint: a real `kvfree serve` subprocess, two small levels of
streaming clients, `LLM.generate` of the same work, and the JSON it writes. Nothing here asserts a speed: the
numbers must only be there, positive and consistent with each other."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvfree.bench.serve import TARGETS, ServerProcess, evaluate_targets
from kvfree.cli import main as kvfree_main
from tests.paths import TINY_CHECKPOINT

CLIENTS, REQUESTS_PER_CLIENT, PROMPT_TOKENS, MAX_TOKENS = (1, 4), 2, 8, 4


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path]:
    """One small run through `kvfree bench --serve` (exit status, its JSON, its folder)."""
    out_dir = tmp_path_factory.mktemp("serve-bench")
    argv = ["bench", "--serve", str(TINY_CHECKPOINT), "--device", "cpu", "--clients", *map(str, CLIENTS)]
    argv += ["--requests-per-client", str(REQUESTS_PER_CLIENT), "--prompt-tokens", str(PROMPT_TOKENS)]
    argv += ["--max-tokens", str(MAX_TOKENS), "--out", str(out_dir / "serve.json")]
    # Two client processes: the level of 1 client runs in this process, the level of 4 in two spawned ones.
    argv += ["--server-log", str(out_dir / "server.log"), "--client-processes", "2", "--no-progress"]
    argv += ["--serve-arg=--served-model-name", "--serve-arg=bench-tiny"]  # passed to `kvfree serve` as they are
    status = kvfree_main(argv)
    return status, json.loads((out_dir / "serve.json").read_text()), out_dir


def test_the_run_succeeds_and_says_what_was_run(report):
    status, data, out_dir = report
    assert status == 0
    assert data["command"][2:5] == ["kvfree", "bench", "--serve"]
    server = data["server_command"]
    assert server[2:4] == ["kvfree", "serve"] and str(TINY_CHECKPOINT) in server
    assert server[server.index("--max-sessions") + 1] == str(max(CLIENTS))  # default: the largest level
    assert server[server.index("--host") + 1] == "127.0.0.1"
    assert server[server.index("--served-model-name") + 1] == "bench-tiny"
    assert data["settings"]["server_only_args"] == ["--served-model-name", "bench-tiny"]
    assert data["server_exit_code"] == 0, "the server must stop cleanly on SIGTERM"
    assert Path(data["server_log"]) == out_dir / "server.log" and Path(data["server_log"]).stat().st_size > 0
    settings = data["settings"]
    assert settings["clients"] == list(CLIENTS) and settings["requests_per_client"] == REQUESTS_PER_CLIENT
    assert (settings["prompt_tokens"], settings["max_tokens"]) == (PROMPT_TOKENS, MAX_TOKENS)
    assert (settings["device"], settings["dtype"], data["device_type"]) == ("cpu", "float32", "cpu")
    env = data["environment"]
    assert env["torch"] and env["date"] and "kvfree_commit" in env
    assert "min(clients, max sessions)" in data["definitions"]["offline"]


def test_every_level_did_the_asked_work_served_and_offline(report):
    _, data, _ = report
    assert [level["clients"] for level in data["levels"]] == list(CLIENTS)
    for level in data["levels"]:
        requests = level["clients"] * REQUESTS_PER_CLIENT
        assert level["requests"] == level["ok"] == requests and level["errors"] == 0
        assert level["completion_tokens"] == level["expected_completion_tokens"] == requests * MAX_TOKENS
        assert level["complete"] is True
        offline = level["offline"]
        assert offline["prompts"] == requests and offline["output_tokens"] == requests * MAX_TOKENS
        assert offline["sessions"] == min(level["clients"], max(CLIENTS))
        assert offline["prompt_tokens"] == PROMPT_TOKENS and offline["max_tokens"] == MAX_TOKENS
        # Split over the bench's 2 client processes where there are clients to split (the value the level records).
        assert level["client_processes"] == min(level["clients"], 2)
    assert data["warmup"]["ok"] == data["warmup"]["requests"] > 0


def test_rates_latencies_and_ratios_are_positive_and_consistent(report):
    _, data, _ = report
    for level in data["levels"]:
        assert level["wall_s"] > 0 and level["output_tokens_per_s"] > 0
        rate = level["completion_tokens"] / level["wall_s"]
        assert level["output_tokens_per_s"] == pytest.approx(rate, rel=1e-3)  # wall_s is rounded to microseconds
        offline_rate = level["offline"]["output_tokens_per_s"]
        assert offline_rate == pytest.approx(level["offline"]["output_tokens"] / level["offline"]["wall_s"])
        assert level["served_over_offline"] == pytest.approx(level["output_tokens_per_s"] / offline_rate)
        assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"] and level["ttft_p50_s"] <= level["e2e_p50_s"]
        if level["itl_p50_s"] is not None:  # a stream whose tokens all came in one text event has no gap
            assert 0 < level["itl_p50_s"] <= level["itl_p99_s"]
        assert 0 < level["text_chunks_per_token"] <= 1
        assert level["client_cpu_s"] > 0 and level["client_cpu_fraction"] > 0
        # The engine's own account of the level: it stepped, fed every prompt and decoded the rest of the tokens.
        pace = level["server_engine"]
        assert pace["steps"] > 0 and pace["step_ms_mean"] > 0 and 0 <= pace["device_wait_share"] <= 1
        assert 0 < pace["busy_share"] <= 1.05  # the engine's counters can trail the level's end by one push
        prompts = level["requests"] * PROMPT_TOKENS
        assert pace["prefill_tokens_per_step"] * pace["steps"] == pytest.approx(prompts, abs=PROMPT_TOKENS)


def test_targets_are_in_the_json_and_judged_only_where_they_apply(report):
    _, data, _ = report
    assert [t["what"] for t in data["targets"]] == [t.what for t in TARGETS]
    for target in data["targets"]:
        assert target["met"] is None  # GPU targets on a CPU run; the CPU one needs a level of 32 clients
        assert target["note"]


def test_targets_are_met_or_missed_from_the_level_they_name():
    level = {
        "clients": 64,
        "complete": True,
        "served_over_offline": 0.9,
        "itl_p99_over_p50": 4.0,
        "ttft_p99_s": 0.2,
        "text_chunks_per_token": 0.5,
        "server_itl_s": {"p50": 0.01, "p99": 0.02},
        "server_ttft_s": {"p50": 0.1, "p99": 0.3},
    }
    rows = {(t["clients"], t["metric"]): t for t in evaluate_targets("cuda", [level])}
    assert rows[(64, "served_over_offline")]["met"] is True
    itl = rows[(64, "itl_p99_over_p50")]
    assert itl["met"] is False and itl["server_value"] == pytest.approx(2.0) and "per token" in itl["note"]
    assert rows[(64, "ttft_p99_s")]["met"] is True and rows[(64, "ttft_p99_s")]["server_value"] == 0.3
    assert rows[(256, "served_over_offline")]["met"] is None  # not run
    incomplete = evaluate_targets("cuda", [{**level, "complete": False}])
    assert not any(t["met"] for t in incomplete), "a level that lost requests meets no target"


def test_a_server_that_cannot_load_its_checkpoint_is_an_error_with_its_log(tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(TINY_CHECKPOINT, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    argv = ["bench", "--serve", str(broken), "--device", "cpu", "--clients", "1", "--out", str(tmp_path / "s.json")]
    assert kvfree_main([*argv, "--server-log", str(tmp_path / "server.log"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the server exited" in err and "model.safetensors" in err
    assert not (tmp_path / "s.json").exists()


def test_an_interrupted_run_still_stops_its_server(tmp_path):
    server = ServerProcess([str(TINY_CHECKPOINT), "--device", "cpu"], tmp_path / "server.log", start_timeout=120)
    with pytest.raises(KeyboardInterrupt), server as url:
        assert url.startswith("http://127.0.0.1:")
        raise KeyboardInterrupt
    assert server.proc is not None and server.proc.poll() is not None, "no server may outlive the benchmark"
    assert server.exit_code == 0  # SIGTERM: a clean shutdown


def test_bench_serve_help_names_its_flags_and_the_offline_rule(capsys):
    with pytest.raises(SystemExit) as exit_info:
        kvfree_main(["bench", "--serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--clients", "--requests-per-client", "--prompt-tokens", "--max-tokens", "--max-sessions"):
        assert flag in out
    assert "min(C, --max-sessions)" in " ".join(out.split())
    with pytest.raises(SystemExit):
        kvfree_main(["--help"])
    assert "--serve" in capsys.readouterr().out
