"""Sessions beyond one process: the store contract (a directory and a real `redis-server`), and two real
`kvfree serve` replicas sharing Redis: continuing each other's sessions, a `kill -9` mid-turn, concurrent turns,
a Redis restart with AOF, and Redis lost and back."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from kvfree.clients import KvfreeAPIError, KvfreeClient, RetryPolicy
from kvfree.engine.protocol import SessionStoreError
from kvfree.engine.sessions.store import DirectoryStore, RedisStore, StoredSession
from tests.server_fixtures import ProcServer, free_port, make_checkpoint, wait_for

REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(
    REDIS is None, reason="redis-server is not installed (Debian: apt-get install redis-server); .ci/run installs it"
)
GREEDY = {"max_tokens": 10, "temperature": 0}
SYSTEM = [{"role": "system", "content": "You are terse."}]


class RedisServer:
    """A real `redis-server` on a free loopback port, with append-only persistence in `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory)]
        args += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return self
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


@pytest.fixture
def redis_server(tmp_path):
    if REDIS is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def _meta(session_id: str, tokens: int = 3) -> StoredSession:
    return StoredSession(session_id, "owner-1", tokens, 12345, 1.5, 0)


@pytest.mark.parametrize("kind", ["directory", "redis"])
def test_store_contract(kind, tmp_path, request):
    if kind == "redis":
        store = RedisStore(request.getfixturevalue("redis_server").url, "fp", ttl_seconds=None, lease_seconds=0.3)
    else:
        store = DirectoryStore(tmp_path / "sessions", "fp")
    sid = "sess_" + "a" * 24
    assert store.read(sid) is None and store.meta(sid) is None and store.ids() == []
    if kind == "redis":  # the directory store reads metadata from real snapshot headers (tests/engine/test_sessions.py)
        first = store.write(_meta(sid), b"snapshot-1")
        second = store.write(_meta(sid, 9), b"snapshot-2")
        assert second.version > first.version and store.meta(sid) == second
        assert store.read(sid) == b"snapshot-2" and store.ids() == [sid]
        assert store.acquire_lease(sid, "a") and not store.acquire_lease(sid, "b")
        store.release_lease(sid, "b")  # not b's: nothing happens
        assert not store.acquire_lease(sid, "b") and not store.renew_lease(sid, "b")
        for _ in range(4):  # 0.6 s in all, twice the lease: renewed by its holder, it holds
            time.sleep(0.15)
            assert store.renew_lease(sid, "a")
        assert not store.acquire_lease(sid, "b")
        time.sleep(0.4)  # a crashed holder's lease lapses
        assert not store.renew_lease(sid, "a") and store.acquire_lease(sid, "b")
        store.release_lease(sid, "b")
        assert store.acquire_lease(sid, "a")
        store.delete(sid)
        assert store.read(sid) is None and store.ids() == []
    else:
        assert store.acquire_lease(sid, "a") and store.acquire_lease(sid, "b")  # one process: no cross-replica claims
    # Records (stored responses) beside the sessions.
    key = "resp_" + "c" * 32
    assert store.read_record(key) is None
    store.write_record(key, b'{"a": 1}')
    store.write_record(key, b'{"a": 2}')
    assert store.read_record(key) == b'{"a": 2}'
    store.delete_record(key)
    assert store.read_record(key) is None
    with pytest.raises(ValueError, match="record key"):
        store.write_record("../escape", b"x")
    store.ping()  # reachable: nothing raised
    if kind == "redis":
        request.getfixturevalue("redis_server").stop()
    else:
        shutil.rmtree(tmp_path / "sessions")  # a lost volume
    with pytest.raises(SessionStoreError):
        store.ping()
    store.close()



def test_a_claim_the_store_could_not_take_back_is_the_replicas_own_again_and_given_back_when_it_answers(redis_server):
    """Redis goes away while a turn's claim is given back (the turn ended during the outage): the replica that holds
    the claim takes it again at once for its session's next turn (it is not "another replica"), and a claim left
    over is given back by the next renewal that reaches the store, so another replica can take the session then."""
    from kvfree.engine.sessions.leases import TurnLeases
    from kvfree.engine.sessions.session import Session

    store = RedisStore(redis_server.url, "fp", ttl_seconds=None, lease_seconds=30)
    mine, theirs = TurnLeases(store, lambda _: False), TurnLeases(store, lambda _: False)
    session = Session("sess_" + "d" * 24, None)
    assert mine.begin(session) and not theirs.begin(session)
    redis_server.stop()
    mine.end(session)  # the release fails: the claim stays in the (persisted) store for its 30 s
    redis_server.start()
    assert mine.begin(session)  # its own claim: taken again, no 409 for its own session
    redis_server.stop()
    mine.end(session)
    mine.renew()  # the store is still away: nothing given back yet, nothing raised
    redis_server.start()
    assert not theirs.begin(session)
    mine.renew()  # the store answers: the left-over claim goes back
    assert theirs.begin(session)


@needs_redis
def test_stored_sessions_expire_after_their_ttl(redis_server):
    store = RedisStore(redis_server.url, "fp", ttl_seconds=0.3)
    sid = "sess_" + "b" * 24
    store.write(_meta(sid), b"x")
    assert store.read(sid) == b"x"  # reading renews the TTL
    time.sleep(0.5)
    assert store.read(sid) is None and store.meta(sid) is None


def _alloc(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


@needs_redis
def test_redis_stores_large_snapshots_in_chunks(redis_server):
    """A snapshot over 4 MiB is stored as 4 MiB chunks beside its meta (which counts them), read back whole (also
    straight into a buffer), rewritten smaller without leaving stale chunks, and deleted with all its chunks."""
    store = RedisStore(redis_server.url, "fp", ttl_seconds=60)
    sid = "sess_" + "d" * 24

    def keys() -> list[str]:
        return sorted(k.decode().removeprefix(f"{store.prefix}:") for k in store.client.keys(f"{store.prefix}:*"))

    big = bytes(range(256)) * (10 * 4096)  # 10 MiB
    stored = store.write(_meta(sid), big)
    assert keys() == [f"meta:{sid}", f"snap:{sid}:0", f"snap:{sid}:1", f"snap:{sid}:2", "version"]
    assert json.loads(store.client.get(f"{store.prefix}:meta:{sid}"))["chunks"] == 3
    assert store.meta(sid) == stored and store.read(sid) == big
    assert _as_bytes(store.read_into(sid, _alloc)) == big
    assert all(0 < store.client.pttl(f"{store.prefix}:snap:{sid}:{k}") <= 60_000 for k in range(3))
    # Two parts (a header and a state, say) cut across chunk boundaries, without being joined first; one chunk fewer.
    head, state = b"H" * 1000, bytes(reversed(big[: 6 << 20]))
    store.write_parts(_meta(sid), [head, memoryview(state)])
    assert keys() == [f"meta:{sid}", f"snap:{sid}:0", f"snap:{sid}:1", "version"]
    assert store.read(sid) == head + state
    # Small again: one value, as before chunking, and no chunk left.
    store.write(_meta(sid), b"small")
    assert keys() == [f"meta:{sid}", f"snap:{sid}", "version"] and store.read(sid) == b"small"
    store.write(_meta(sid), big)
    assert keys() == [f"meta:{sid}", f"snap:{sid}:0", f"snap:{sid}:1", f"snap:{sid}:2", "version"]
    store.delete(sid)
    assert keys() == ["version"] and store.read(sid) is None and store.read_into(sid, _alloc) is None


@needs_redis
def test_redis_reads_a_snapshot_written_before_chunking(redis_server):
    """A value the code before chunking wrote (one `snap` key however large, a meta without "chunks") reads, and
    is replaced by chunks when the session is written again."""
    store = RedisStore(redis_server.url, "fp", ttl_seconds=0.4)
    sid = "sess_" + "e" * 24
    old = b"\x07" * (6 << 20)
    meta = dataclasses.replace(_meta(sid), version=7)
    store.client.set(f"{store.prefix}:snap:{sid}", old, px=400)
    store.client.set(f"{store.prefix}:meta:{sid}", json.dumps(dataclasses.asdict(meta)), px=400)
    assert store.meta(sid) == meta and store.read(sid) == old and _as_bytes(store.read_into(sid, _alloc)) == old
    time.sleep(0.25)
    assert store.read(sid) == old  # reading renews the TTL of every key of the session ...
    time.sleep(0.25)
    assert store.read(sid) == old  # ... so it is still there, 0.5 s after it was written
    store.write(_meta(sid), old + b"!")
    assert store.client.get(f"{store.prefix}:snap:{sid}") is None and store.read(sid) == old + b"!"
    time.sleep(0.25)
    assert store.read(sid) == old + b"!"  # chunks are renewed too
    time.sleep(0.25)
    assert store.read(sid) == old + b"!"
    time.sleep(0.5)
    assert store.read(sid) is None and store.client.keys(f"{store.prefix}:snap:*") == []


def test_directory_store_writes_parts_and_reads_into_a_buffer(tmp_path, monkeypatch):
    """Parts are written one after the other into one file (no joined copy), `read_into` fills the caller's buffer
    from the file in one read, and with `fsync` the file and then its directory are flushed."""
    store = DirectoryStore(tmp_path / "sessions", "fp")
    sid = "sess_" + "f" * 24
    assert store.read_into(sid, _alloc) is None
    head, state = b"header--", torch.arange(1 << 20, dtype=torch.int32)
    store.write_parts(_meta(sid), [head, memoryview(state.numpy()).cast("B")])
    expected = head + state.numpy().tobytes()
    assert store.read(sid) == expected
    sizes: list[int] = []
    got = store.read_into(sid, lambda n: sizes.append(n) or _alloc(n))
    assert sizes == [len(expected)] and _as_bytes(got) == expected
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    store.write(_meta(sid), b"not synced")
    assert synced == []
    durable = DirectoryStore(tmp_path / "sessions", "fp", fsync=True)
    durable.write(_meta(sid), b"synced")
    assert len(synced) == 2 and durable.read(sid) == b"synced"  # the file, then the directory


def test_unreachable_redis_is_a_clear_error():
    with pytest.raises(SessionStoreError, match="redis://127.0.0.1:1/0 is unavailable"):
        RedisStore("redis://127.0.0.1:1/0", "fp", timeout=1)


# -- two replicas ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


def _replica(checkpoint: Path, redis_url: str, log: Path, lease: float = 3) -> ProcServer:
    args = ["--session-store", redis_url, "--session-lease", str(lease), "--max-sessions", "4", "--max-waiting", "16"]
    return ProcServer(checkpoint, args, log).start()


def _turn(history: list[dict], text: str) -> list[dict]:
    return [*history, {"role": "user", "content": text}]


def _reference(server: ProcServer, history: list[dict]) -> str:
    with KvfreeClient(server.url) as c:
        return c.chat(history, **GREEDY).text  # the same conversation without a session


@needs_redis
def test_two_replicas_share_sessions_and_survive_kill_9(checkpoint, redis_server, tmp_path):
    a = _replica(checkpoint, redis_server.url, tmp_path / "a.log")
    b = _replica(checkpoint, redis_server.url, tmp_path / "b.log")
    try:
        # Two replicas on one host name themselves apart: host and port (`--replica-id` names one otherwise).
        names = [httpx.get(r.url + "/health").headers["x-kvfree-replica"] for r in (a, b)]
        assert names == [f"{socket.gethostname()}:{a.port}", f"{socket.gethostname()}:{b.port}"]
        ca, cb = KvfreeClient(a.url, retry=RetryPolicy(max_retries=0)), KvfreeClient(b.url)
        bystander = ca.create_session(messages=SYSTEM)  # an idle session of A's: the crash must not lose it
        ca.chat(_turn(SYSTEM, "Hi"), session_id=bystander.id, **GREEDY)
        bystander_tokens = ca.get_session(bystander.id).num_tokens
        session = ca.create_session(messages=SYSTEM)
        history = _turn(SYSTEM, "Hello")
        first = ca.chat(history, session_id=session.id, **GREEDY)
        # The next turn on B: B loads the stored state and continues exactly as A would have.
        history = _turn([*history, {"role": "assistant", "content": first.text}], "More")
        on_b = cb.chat(history, session_id=session.id, **GREEDY)
        assert on_b.cached_tokens > 0 and on_b.text == _reference(b, history)
        assert on_b.session["resumed_from"] == "store" and first.session["resumed_from"] in ("gpu", "host")
        history = [*history, {"role": "assistant", "content": on_b.text}]
        completed = cb.get_session(session.id).num_tokens
        assert ca.get_session(session.id).num_tokens == completed  # A sees B's turn (its own copy was stale)

        # Two turns at once on one session, one per replica: one is refused with 409, never interleaved.
        long_turn = ca.chat_stream(_turn(history, "Go on"), session_id=session.id, max_tokens=400, temperature=0)
        next(long_turn)  # A holds the session now
        with KvfreeClient(b.url, retry=RetryPolicy(max_retries=0)) as once, pytest.raises(KvfreeAPIError) as err:
            once.chat(_turn(history, "Go on"), session_id=session.id, **GREEDY)
        assert err.value.status == 409 and "another replica" in err.value.message and err.value.code == "session_busy"

        # kill -9 A in the middle of that turn: the session resumes on B from its last completed turn.
        a.proc.kill()
        a.proc.wait(10)
        with contextlib.suppress(httpx.HTTPError):
            for _ in long_turn:
                pass
        assert cb.get_session(session.id).num_tokens == completed  # the store holds the last completed turn
        history = _turn(history, "Again")
        replies: list[str] = []
        wait_for(lambda: _turn_once(cb, session.id, history, replies), timeout=15, message="A's lease to lapse")
        assert replies == [_reference(b, history)]
        assert cb.get_session(bystander.id).num_tokens == bystander_tokens

        # A tampered snapshot in the store is refused like a tampered upload.
        store = RedisStore(redis_server.url, "unused")
        key = next(k for k in store.client.scan_iter(match=f"*:snap:{bystander.id}"))
        data = bytearray(store.client.get(key))
        data[-1] ^= 0x55
        store.client.set(key, bytes(data))
        meta_key = key.replace(b":snap:", b":meta:")
        store.client.set(meta_key, store.client.get(meta_key).replace(b'"version": ', b'"version": 1'))  # newer
        with pytest.raises(KvfreeAPIError) as err:
            cb.chat(_turn(SYSTEM, "Hi"), session_id=bystander.id, **GREEDY)
        assert err.value.status == 400 and err.value.code == "checksum_mismatch"
        ca.close()
        cb.close()
    finally:
        a.kill()
        b.kill()


@needs_redis
def test_a_turn_keeps_its_lease_however_long_and_a_killed_replicas_claim_lapses_within_one(
    checkpoint, redis_server, tmp_path
):
    """With a 0.6 s lease a turn of thousands of tokens holds its session throughout (its replica renews the claim),
    another replica's turn meanwhile gets 409 with Retry-After; after `kill -9` the claim lapses within a lease and
    a retrying client's turn goes through, from the last completed turn."""
    a = _replica(checkpoint, redis_server.url, tmp_path / "a.log", lease=0.6)
    b = _replica(checkpoint, redis_server.url, tmp_path / "b.log", lease=0.6)
    try:
        ca = KvfreeClient(a.url, retry=RetryPolicy(max_retries=0))
        session = ca.create_session(messages=SYSTEM)
        completed = ca.get_session(session.id).num_tokens
        long_turn = ca.chat_stream(_turn(SYSTEM, "Talk"), session_id=session.id, max_tokens=4000, temperature=0)
        next(long_turn)
        time.sleep(1.5)  # 2.5 leases: without renewals the claim would have lapsed
        with httpx.Client(base_url=b.url, timeout=30) as http:
            body = {"messages": _turn(SYSTEM, "Me too"), "session_id": session.id, **GREEDY}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
            assert r.headers["retry-after"] == "1"
        a.proc.kill()
        a.proc.wait(10)
        with contextlib.suppress(httpx.HTTPError):
            for _ in long_turn:
                pass
        with KvfreeClient(b.url, retry=RetryPolicy(max_retries=5)) as cb:  # retries the 409 until the claim lapses
            reply = cb.chat(_turn(SYSTEM, "Me too"), session_id=session.id, **GREEDY)
            assert reply.session["resumed_from"] == "store" and reply.cached_tokens == completed
        ca.close()
    finally:
        a.kill()
        b.kill()


@needs_redis
def test_stored_responses_continue_on_another_replica_after_kill_9(checkpoint, redis_server, tmp_path):
    """A response stored on replica A is continued, read and deleted on replica B, also after A is killed: the record
    and the state both live in the shared store."""
    a = _replica(checkpoint, redis_server.url, tmp_path / "a.log")
    b = _replica(checkpoint, redis_server.url, tmp_path / "b.log")
    try:
        on_a = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0)
        on_b = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0)
        greedy = {"temperature": 0, "max_output_tokens": 8}  # no model: the server's only one
        first = on_a.responses.create(input="Hello", **greedy)
        second = on_b.responses.create(input="More", previous_response_id=first.id, **greedy)
        assert second.usage.input_tokens_details.cached_tokens > 0  # A's state, loaded from the store by B
        history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text}]
        full = on_b.responses.create(input=[*history, {"role": "user", "content": "More"}], store=False, **greedy)
        assert full.output_text == second.output_text
        # A record deleted on B is gone on A too, although A has it in memory.
        extra = on_a.responses.create(input="Extra", **greedy)
        assert on_a.responses.retrieve(extra.id).id == extra.id
        on_b.responses.delete(extra.id)
        with pytest.raises(openai.NotFoundError):
            on_a.responses.retrieve(extra.id)
        a.proc.kill()
        a.proc.wait(10)
        assert on_b.responses.retrieve(first.id).output_text == first.output_text
        third = on_b.responses.create(input="Again", previous_response_id=first.id, **greedy)  # a fork of A's
        assert third.usage.input_tokens_details.cached_tokens == second.usage.input_tokens_details.cached_tokens
        on_b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            on_b.responses.retrieve(first.id)
    finally:
        a.kill()
        b.kill()


def _turn_once(client: KvfreeClient, session_id: str, history: list[dict], replies: list[str]) -> bool:
    """Run the turn unless the session is still claimed elsewhere (409: try again later)."""
    try:
        replies.append(client.chat(history, session_id=session_id, **GREEDY).text)
    except KvfreeAPIError as e:
        if e.status == 409:
            return False
        raise
    return True


@needs_redis
def test_redis_restart_keeps_sessions_and_an_outage_fails_only_session_requests(checkpoint, redis_server, tmp_path):
    server = _replica(checkpoint, redis_server.url, tmp_path / "s.log")
    try:
        client = KvfreeClient(server.url, retry=RetryPolicy(max_retries=0))
        session = client.create_session(messages=SYSTEM)
        history = _turn(SYSTEM, "Hi")
        reply = client.chat(history, session_id=session.id, **GREEDY)
        tokens = client.get_session(session.id).num_tokens

        redis_server.stop()  # lost mid-run: requests on sessions fail with 503, others keep working
        with pytest.raises(KvfreeAPIError) as err:
            client.chat(_turn(history, "x"), session_id=session.id, **GREEDY)
        assert err.value.status == 503 and "session store" in err.value.message
        assert client.chat(_turn(SYSTEM, "no session"), **GREEDY).finish_reason == "length"
        with httpx.Client(base_url=server.url, timeout=30) as http:
            # Not ready (a load balancer sends sessions elsewhere), yet alive.
            ready = http.get("/ready")
            assert ready.status_code == 503 and "session store" in ready.json()["reason"], ready.text
            assert http.get("/health").status_code == 200
            # A response that asks to be stored (OpenAI's default) is refused before it runs, with Retry-After;
            # one that does not is served.
            turn = {"input": "Hello", "max_output_tokens": 4}
            refused = http.post("/v1/responses", json={**turn, "store": True})
            assert refused.status_code == 503 and "store: false" in refused.json()["error"]["message"]
            assert refused.headers["retry-after"] == "5"
            assert http.post("/v1/responses", json={**turn, "store": False}).status_code == 200

        redis_server.start()  # back, from its append-only file: nothing was lost
        assert httpx.get(server.url + "/ready", timeout=30).status_code == 200
        assert client.get_session(session.id).num_tokens == tokens
        history = _turn([*history, {"role": "assistant", "content": reply.text}], "Then?")
        assert client.chat(history, session_id=session.id, **GREEDY).text == _reference(server, history)
        client.close()
    finally:
        server.kill()


def test_async_writes_land_in_the_background_and_survive_kill_9(checkpoint, tmp_path):
    from tests.server_fixtures import metric_value

    store = tmp_path / "sessions"
    args = ["--session-store", str(store), "--session-write", "async", "--max-sessions", "2"]
    first = ProcServer(checkpoint, args, tmp_path / "first.log").start()
    try:
        with KvfreeClient(first.url) as client:
            session = client.create_session(messages=SYSTEM)
            history = _turn(SYSTEM, "Hello")
            reply = client.chat(history, session_id=session.id, **GREEDY)
            tokens = client.get_session(session.id).num_tokens
            wait_for(
                lambda: metric_value(httpx.get(first.url + "/metrics").text, "kvfree_session_writes_pending") == 0,
                timeout=20,
                message="the background write to land",
            )
            assert metric_value(httpx.get(first.url + "/metrics").text, "kvfree_session_write_lag_seconds") > 0
        first.proc.kill()  # no graceful shutdown: only what was stored survives
        first.proc.wait(10)
        second = ProcServer(checkpoint, args, tmp_path / "second.log").start()
        try:
            with KvfreeClient(second.url) as client:
                assert client.get_session(session.id).num_tokens == tokens
                history = _turn([*history, {"role": "assistant", "content": reply.text}], "And?")
                turn = client.chat(history, session_id=session.id, **GREEDY)
                assert turn.cached_tokens == tokens and turn.text == client.chat(history, **GREEDY).text
        finally:
            second.kill()
    finally:
        first.kill()


def test_serve_refuses_to_start_without_its_redis(capsys):
    from kvfree.cli import main

    argv = ["serve", "--device", "cpu", "--port", str(free_port()), "--session-store", "redis://127.0.0.1:1/0"]
    assert main(argv) == 2
    assert "the session store at redis://127.0.0.1:1/0 is unavailable" in capsys.readouterr().err
