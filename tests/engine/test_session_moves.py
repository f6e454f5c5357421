"""A real `kvfree serve` whose sessions move between the tiers on nearly every turn (two state slots, two host-memory
slots, a directory store written through), killed with SIGKILL in the middle of it: after a restart every session is
at its last completed turn and continues from it."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server_fixtures import ProcServer, make_checkpoint, metric_value

SESSIONS = 6  # sessions taking turns, over 2 slots and 2 host slots: most turns evict, load and spill
CLIENTS = 3  # each drives two sessions, one turn at a time (a session never has two turns at once)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


class SessionTurns:
    """Turns on some sessions, round robin: each prompt extends the last by a few random token ids, one token is
    generated (so that after a turn the session holds exactly its prompt's tokens)."""

    def __init__(self, url: str, session_ids: list[str], seed: int) -> None:
        self.http = httpx.Client(base_url=url, timeout=30, trust_env=False)
        self.rng = random.Random(seed)
        self.prompts: dict[str, list[int]] = {sid: [] for sid in session_ids}
        self.completed: dict[str, int] = {sid: 0 for sid in session_ids}  # tokens held after the last completed turn
        self.in_flight: dict[str, int] = {}  # tokens the session would hold after the turn still running

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for sid in self.rng.sample(list(self.prompts), len(self.prompts)):  # some come back from host memory
                prompt = self.prompts[sid]
                nxt = prompt + [self.rng.randrange(1, 250) for _ in range(self.rng.randint(3, 12))]
                self.in_flight[sid] = len(nxt)
                try:
                    r = self.http.post("/v1/completions", json={"prompt": nxt, "max_tokens": 1, "temperature": 0,
                                                                "session_id": sid})  # fmt: skip
                except httpx.HTTPError:
                    return  # the server was killed under this turn
                assert r.status_code == 200, r.text
                assert r.json()["session"]["num_tokens"] == len(nxt)
                self.prompts[sid] = nxt
                self.completed[sid] = len(nxt)
                del self.in_flight[sid]


def test_killed_in_the_middle_of_moves_every_session_is_at_its_last_completed_turn(checkpoint, tmp_path: Path):
    args = ["--session-store", str(tmp_path / "sessions"), "--session-write", "through", "--max-sessions", "2",
            "--max-host-sessions", "2"]  # fmt: skip
    first = ProcServer(checkpoint, args, tmp_path / "first.log").start()
    try:
        ids = [httpx.post(first.url + "/v1/sessions", json={}, timeout=30).json()["id"] for _ in range(SESSIONS)]
        drivers = [SessionTurns(first.url, ids[i::CLIENTS], seed=i) for i in range(CLIENTS)]
        stop = threading.Event()
        threads = [threading.Thread(target=d.run, args=(stop,)) for d in drivers]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all(n for d in drivers for n in d.completed.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # turns, evictions, loads and spills under way
        metrics = httpx.get(first.url + "/metrics", timeout=30).text
        first.proc.kill()  # SIGKILL: no shutdown, no persist_all; only what was stored survives
        first.proc.wait(10)
        stop.set()
        for t in threads:
            t.join(30)
        log = first.log()
    finally:
        first.kill()
    assert all(n for d in drivers for n in d.completed.values()), "every session completed a turn before the kill"
    for kind in ("evictions", "reloads_from_host", "reloads_from_disk", "spills"):
        assert metric_value(metrics, "kvfree_session_moves", f'kind="{kind}"') > 0, kind  # the kill came amid moves

    second = ProcServer(checkpoint, args, tmp_path / "second.log").start()
    try:
        with httpx.Client(base_url=second.url, timeout=30, trust_env=False) as http:
            for d in drivers:
                for sid, prompt in d.prompts.items():
                    held = http.get(f"/v1/sessions/{sid}").json()["num_tokens"]
                    # The last completed turn, or the one the kill cut off after its write landed but before its
                    # response reached the client: never an older state, never a torn one.
                    assert held in (d.completed[sid], d.in_flight.get(sid)), (sid, held, d.completed, d.in_flight)
                    if held != d.completed[sid]:
                        continue  # (its prompt is not known here: it was cut off with the connection)
                    nxt = prompt + [7, 8, 9]
                    r = http.post("/v1/completions", json={"prompt": nxt, "max_tokens": 2, "temperature": 0,
                                                           "session_id": sid})  # fmt: skip
                    assert r.status_code == 200, r.text
                    assert r.json()["session"]["cached_tokens"] == held  # continued, not recomputed
    finally:
        second.kill()
    assert "Traceback" not in log, log[-3000:]
