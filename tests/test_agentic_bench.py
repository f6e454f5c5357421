"""`kvfree bench agentic` on the CPU with the tiny checkpoint: conversations re-sent whole every round to two real
`kvfree serve` subprocesses, the prefix cache on and off. With the cache every round after the first resumes from
the previous round's state (its whole reusable prefix), and the greedy replies are those the server without the
cache gives; without it nothing is reused. No speed is asserted."""

from __future__ import annotations

import json

from kvfree.cli import main as kvfree_main
from tests.paths import TINY_CHECKPOINT

CONVERSATIONS, ROUNDS, MAX_TOKENS = 2, 3, 6


def test_agentic_replay_reuses_every_reusable_token_and_changes_no_reply(tmp_path):
    out = tmp_path / "agentic.json"
    argv = ["bench", "agentic", str(TINY_CHECKPOINT), "--device", "cpu", "--conversations", str(CONVERSATIONS)]
    argv += ["--rounds", str(ROUNDS), "--system-tokens", "40", "--user-tokens", "12", "--max-tokens", str(MAX_TOKENS)]
    argv += ["--max-sessions", "4", "--out", str(out)]  # fewer slots than requests' checkpoints: some go to host
    assert kvfree_main(argv) == 0
    report = json.loads(out.read_text())
    on, off = report["modes"]["cache_on"], report["modes"]["cache_off"]
    assert on["hit_rate"] == 1.0 and off["hit_rate"] == 0.0 and off["cached_tokens"] == 0
    assert report["values"]["outputs_equal"] == 1.0
    assert on["reusable_tokens"] == CONVERSATIONS * sum(40 + r * (12 + MAX_TOKENS) + 12 + MAX_TOKENS - 1
                                                        for r in range(ROUNDS - 1))  # fmt: skip
    assert [r["round"] for r in on["by_round"]] == list(range(1, ROUNDS + 1))
    assert on["prefix_cache"]["checkpoints"] > 0 and off["prefix_cache"].get("checkpoints", 0) == 0
    assert {t["metric"] for t in report["targets"]} == {"hit_rate", "ttft_last_over_first", "outputs_equal"}
