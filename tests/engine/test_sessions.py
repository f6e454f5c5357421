"""SessionManager: sessions move between GPU slots, host memory and snapshot files, and continue exactly."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.protocol import PoolExhausted, SessionLimitError, SessionNotFound, SnapshotError
from kvfree.engine.sessions.manager import Session, SessionManager
from kvfree.engine.sessions.store import DirectoryStore
from kvfree.engine.sessions.tiers import StateLoading
from kvfree.engine.state.pool import StatePool
from kvfree.engine.state.snapshot import Snapshot, decode_snapshot, encode_snapshot, model_fingerprint, token_hash
from tests.conftest import make_model

KEY = b"test-key"
LAYERS = ["mamba2", "attention", "swa"]  # a recurrent state, a per-token KV cache and a fixed window
CONTEXT = 96


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return make_model(LAYERS, seed=5, mlp=True)


@pytest.fixture(scope="module")
def fp(model) -> str:
    return model_fingerprint(model)


def feed(model: HybridLM, pool: StatePool, slot: int, tokens: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill `tokens`, then greedy-decode `steps` tokens. Returns the tokens fed in all and every logits row."""
    logits = [model.prefill(torch.tensor(tokens), pool.tensors, StepBatch.prefill([slot], [len(tokens)]))[0]]
    fed = list(tokens)
    for _ in range(steps):
        fed.append(int(logits[-1].argmax()))
        logits.append(model.decode(torch.tensor(fed[-1:]), pool.tensors, StepBatch.decode([slot]))[0])
    return fed, torch.stack(logits)


def turn(manager: SessionManager, session: Session, tokens: list[int], steps: int = 2) -> torch.Tensor:
    """One request in a session, as the engine runs it: acquire, feed, record the tokens, release."""
    slot = manager.acquire_slot(session)
    assert session.busy and session.location == "gpu" and session.slot == slot
    fed, logits = feed(manager.pool.model, manager.pool, slot, tokens, steps)
    session.extend(fed)
    manager.release(session)
    manager.tiers.flush_spills()  # spills run on the I/O thread; the engine applies the landed ones between steps
    return logits


def check_tiers(manager: SessionManager) -> None:
    """Where every session claims to be agrees with the pool, the host cap and the directory (once the spills under
    way have landed: they are written on the I/O thread)."""
    manager.tiers.flush_spills()
    sessions = list(manager._sessions.values())
    resident = [s for s in sessions if s.location == "gpu"]
    assert sorted(s.slot for s in resident) == sorted({s.slot for s in resident})
    assert len(resident) <= manager.pool.used_slots
    assert sum(s.host_state is not None for s in sessions) <= manager.max_host_sessions
    for s in sessions:
        assert (s.slot is not None) == (s.location == "gpu")
        assert s.host_state is None or s.location == "host"
    if manager.snapshot_dir is not None:
        files = {p.name.removesuffix(".safetensors") for p in manager.snapshot_dir.glob("*.safetensors")}
        assert files == {s.session_id for s in sessions if s.location == "disk"}
    counts = manager.counts()
    assert sum(counts.values()) == len(manager)
    assert counts["disk"] == sum(s.location == "disk" for s in sessions)


def rand_tokens(rng: random.Random, lo: int = 1, hi: int = 8) -> list[int]:
    return [rng.randrange(256) for _ in range(rng.randint(lo, hi))]


# -- tiers --------------------------------------------------------------------------------------------------------
def test_twenty_sessions_through_four_slots_continue_exactly(model, fp, tmp_path) -> None:
    manager = SessionManager(StatePool(model, 4, CONTEXT), fp, max_host_sessions=6, snapshot_dir=tmp_path)
    reference = StatePool(model, 20, CONTEXT)  # every session keeps its own slot
    sessions = [manager.create(owner="k") for _ in range(20)]
    history: list[list[int]] = [[] for _ in sessions]
    rng = random.Random(1)
    for round_ in range(4):
        order = list(range(20))
        if round_ % 2:
            rng.shuffle(order)  # revisits recent sessions too, so some come back from host memory
        for i in order:
            tokens = rand_tokens(rng)
            got = turn(manager, sessions[i], tokens)
            fed, want = feed(model, reference, i, tokens, 2)
            assert torch.equal(got, want), f"session {i} round {round_}"
            history[i] += fed
            assert sessions[i].num_tokens == len(history[i]) and sessions[i].is_prefix_of(history[i])
            assert manager.pool.used_slots <= 4
            check_tiers(manager)
    c = manager.counters
    assert c.evictions > 0 and c.spills > 0 and c.reloads_from_disk > 0 and c.reloads_from_host > 0
    assert manager.counts() == {"gpu": 4, "host": 6, "disk": 10}


def test_busy_sessions_are_never_evicted(model, fp, tmp_path) -> None:
    manager = SessionManager(StatePool(model, 3, CONTEXT), fp, max_host_sessions=1, snapshot_dir=tmp_path)
    a, b, c, d, e = (manager.create("k") for _ in range(5))
    slots = {s.session_id: manager.acquire_slot(s) for s in (a, b, c)}
    turn(manager, c, [1, 2, 3])  # c is idle now, a and b stay busy
    manager.acquire_slot(d)
    assert c.location == "host" and d.slot == slots[c.session_id]
    assert (a.location, a.slot, b.location, b.slot) == ("gpu", slots[a.session_id], "gpu", slots[b.session_id])
    # Everything resident is busy: nothing moves and nothing is lost.
    before = manager.counts()
    with pytest.raises(PoolExhausted, match="busy"):
        manager.acquire_slot(e)
    assert manager.counts() == before and manager.pool.used_slots == 3
    assert e.location == "host" and not e.busy and c.host_state is not None
    # A session reserved by a waiting request (busy, not resident) still gets its slot, and is not spilled.
    manager.release(a)
    c.busy = True
    manager.acquire_slot(e)  # evicts a; host now holds a and c, over its cap of 1: spills a, not the busy c
    manager.tiers.flush_spills()
    assert a.location == "disk" and c.location == "host"
    manager.release(d)
    manager.acquire_slot(c)
    assert c.location == "gpu" and d.location == "host"


def test_reserved_slots_are_left_free(model, fp, tmp_path) -> None:
    reserved = 2
    manager = SessionManager(StatePool(model, 3, CONTEXT), fp, 4, tmp_path, reserved_slots=lambda: reserved)
    a, b = manager.create("k"), manager.create("k")
    turn(manager, a, [5, 6])
    turn(manager, b, [7])  # evicts a rather than take one of the two reserved slots
    assert a.location == "host" and manager.pool.used_slots == 1
    manager.acquire_slot(b)
    with pytest.raises(PoolExhausted, match="kept for other requests"):
        manager.acquire_slot(a)
    reserved = 0
    manager.acquire_slot(a)
    assert manager.pool.used_slots == 2


def test_without_snapshot_dir_host_is_a_hard_cap(model, fp) -> None:
    manager = SessionManager(StatePool(model, 2, CONTEXT), fp, max_host_sessions=2)
    reference = StatePool(model, 4, CONTEXT)
    sessions = [manager.create("k") for _ in range(4)]
    with pytest.raises(SessionLimitError, match="snapshot directory"):
        manager.create("k")
    assert len(manager) == 4
    rng = random.Random(2)
    for _ in range(3):
        for i, s in enumerate(sessions):
            tokens = rand_tokens(rng)
            assert torch.equal(turn(manager, s, tokens), feed(model, reference, i, tokens, 2)[1])
            check_tiers(manager)
    assert manager.counts() == {"gpu": 2, "host": 2, "disk": 0}
    assert manager.persist_all() == 0 and manager.load_index() == 0  # nowhere to write or read: a no-op
    # A request slot (ephemeral) is not a session: allowed beyond the limit, evicting an idle session...
    resident = [s for s in sessions if s.location == "gpu"]
    manager.acquire_slot(resident[0])
    extra = manager.create(None, ephemeral=True)
    with pytest.raises(PoolExhausted, match="max_host_sessions"):
        manager.acquire_slot(extra)  # ... but not when host memory is full: nothing is dropped
    manager.delete(resident[1])
    manager.acquire_slot(extra)
    assert manager.counts() == {"gpu": 1, "host": 2, "disk": 0}
    # A fork with host memory full takes the free slot instead.
    manager.delete(extra)
    host = next(s for s in sessions if s.location == "host")
    child = manager.fork(host, "k")
    assert child.location == "gpu"
    with pytest.raises(SessionLimitError):
        manager.fork(host, "k")


def test_ten_thousand_new_sessions_are_cheap(model, fp, tmp_path) -> None:
    manager = SessionManager(StatePool(model, 2, CONTEXT), fp, 4, tmp_path)
    start = time.perf_counter()
    ids = {manager.create("k").session_id for _ in range(10_000)}
    assert time.perf_counter() - start < 1.0
    assert len(ids) == 10_000 and all(i.startswith("sess_") and len(i) == 29 for i in ids)
    assert manager.pool.used_slots == 0 and manager.host_bytes() == 0 and not any(tmp_path.iterdir())
    assert manager.counts() == {"gpu": 0, "host": 10_000, "disk": 0}


# -- ownership, lifecycle -----------------------------------------------------------------------------------------
class GatedStore(DirectoryStore):
    """A directory store whose reads or writes wait for a gate to open: an I/O thread caught mid-move."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read_gate, self.write_gate = threading.Event(), threading.Event()
        self.read_gate.set()
        self.write_gate.set()

    def read_into(self, session_id, alloc):
        self.read_gate.wait(10)
        return super().read_into(session_id, alloc)

    def write_parts(self, meta, parts):
        self.write_gate.wait(10)
        return super().write_parts(meta, parts)


def test_a_stored_session_is_read_while_its_request_waits(model, fp, tmp_path) -> None:
    """Reserving a session that lives in the store starts reading it on the I/O thread; making it resident before the
    read is done says so (StateLoading) and changes nothing; once read, it continues exactly."""
    store = GatedStore(tmp_path, fp)
    manager = SessionManager(StatePool(model, 1, CONTEXT), fp, max_host_sessions=0, store=store)
    reference = StatePool(model, 2, CONTEXT)
    a, b = manager.create("k"), manager.create("k")
    for i, s in enumerate((a, b)):
        turn(manager, s, [3 + i, 4, 5])
        feed(model, reference, i, [3 + i, 4, 5], 2)
    assert a.location == "disk"
    store.read_gate.clear()
    manager.reserve(a)
    assert a.fetch is not None and not a.fetch.done()
    before = (manager.counts(), manager.pool.used_slots, b.location)
    with pytest.raises(StateLoading) as loading:
        manager.acquire_slot(a)
    assert (manager.counts(), manager.pool.used_slots, b.location) == before and a.location == "disk"
    store.read_gate.set()
    loading.value.wait()
    slot = manager.acquire_slot(a)
    assert a.location == "gpu" and a.fetch is None and manager.counters.reloads_from_disk == 1
    got = feed(model, manager.pool, slot, [7, 7], 1)[1]
    assert torch.equal(got, feed(model, reference, 0, [7, 7], 1)[1])


def test_a_session_whose_spill_is_under_way_is_used_from_memory(model, fp, tmp_path) -> None:
    """A spill writes on the I/O thread and the session stays in host memory until it lands; needed meanwhile, it is
    loaded from memory and the file written for it is removed (it lives in the pool now)."""
    store = GatedStore(tmp_path, fp)
    manager = SessionManager(StatePool(model, 1, CONTEXT), fp, max_host_sessions=0, store=store)
    a, b = manager.create("k"), manager.create("k")
    turn(manager, a, [1, 2, 3])
    store.write_gate.clear()
    manager.acquire_slot(b)  # evicts a to host memory, over the cap of 0: its spill starts and waits at the gate
    assert a.location == "host" and a.spill is not None and not a.spill.done() and manager.tiers.moving
    manager.release(b)
    threading.Timer(0.05, store.write_gate.set).start()
    manager.acquire_slot(a)  # waits for the write, keeps the copy in memory, removes the file
    assert a.location == "gpu" and a.spill is None and not (tmp_path / f"{a.session_id}.safetensors").exists()
    check_tiers(manager)


def test_owner_isolation(model, fp) -> None:
    manager = SessionManager(StatePool(model, 2, CONTEXT), fp, 4)
    mine = manager.create("alice")
    assert manager.get(mine.session_id, "alice") is mine
    with pytest.raises(SessionNotFound) as other_owner:
        manager.get(mine.session_id, "bob")
    with pytest.raises(SessionNotFound) as nobody:
        manager.get(mine.session_id, None)
    with pytest.raises(SessionNotFound) as unknown:
        manager.get("sess_" + "0" * 24, "alice")
    # The same answer as for an id that does not exist, apart from the id itself.
    assert str(other_owner.value) == str(nobody.value) == str(unknown.value).replace("0" * 24, mine.session_id[5:])
    ephemeral = manager.create(None, ephemeral=True)
    with pytest.raises(SessionNotFound):
        manager.get(ephemeral.session_id, None)


@pytest.mark.parametrize("where", ["gpu", "host", "disk", "new"])
def test_fork_branches_are_independent(model, fp, tmp_path, where) -> None:
    manager = SessionManager(StatePool(model, 2, CONTEXT), fp, max_host_sessions=1, snapshot_dir=tmp_path)
    parent = manager.create("k")
    rng = random.Random(3)
    if where != "new":
        turn(manager, parent, rand_tokens(rng, 5, 12))
    others = [manager.create("k") for _ in range({"gpu": 0, "host": 2, "disk": 3, "new": 0}[where])]
    for other in others:
        turn(manager, other, [1, 2])
    assert parent.location == ("host" if where == "new" else where)
    at_fork = decode_snapshot(manager.export(parent), fp).tensors
    child = manager.fork(parent, "k2")
    assert child.owner == "k2" and child.session_id != parent.session_id
    assert (child.num_tokens, child.token_hash) == (parent.num_tokens, parent.token_hash)
    if where == "gpu":
        assert child.location == "gpu"  # a slot was free: copied slot to slot
    for name, t in decode_snapshot(manager.export(child), fp).tensors.items():
        assert torch.equal(t, at_fork[name]), name
    # Continue each branch differently; each matches the fork-time state continued alone.
    reference = StatePool(model, 2, CONTEXT)
    for slot in (0, 1):
        reference.import_(slot, at_fork)
    tokens = [rand_tokens(rng, 4, 6), rand_tokens(rng, 4, 6)]
    got = [turn(manager, s, t, 3) for s, t in zip((parent, child), tokens, strict=True)]
    want = [feed(model, reference, slot, t, 3)[1] for slot, t in enumerate(tokens)]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], got[1])
    check_tiers(manager)


def test_delete_frees_slot_memory_and_file(model, fp, tmp_path) -> None:
    manager = SessionManager(StatePool(model, 1, CONTEXT), fp, max_host_sessions=1, snapshot_dir=tmp_path)
    a, b, c = (manager.create("k") for _ in range(3))
    for s in (a, b, c):
        turn(manager, s, [3, 4, 5])
    assert (a.location, b.location, c.location) == ("disk", "host", "gpu")
    path = tmp_path / f"{a.session_id}.safetensors"
    assert path.exists()
    manager.delete(a)
    assert not path.exists()
    manager.delete(b)
    assert manager.host_bytes() == 0
    manager.delete(c)
    assert manager.pool.used_slots == 0 and len(manager) == 0 and not any(tmp_path.iterdir())
    for s in (a, b, c):
        with pytest.raises(SessionNotFound):
            manager.get(s.session_id, "k")
        with pytest.raises(SessionNotFound):
            manager.acquire_slot(s)


def test_reset_returns_to_the_initial_state(model, fp, tmp_path) -> None:
    manager = SessionManager(StatePool(model, 1, CONTEXT), fp, max_host_sessions=0, snapshot_dir=tmp_path)
    initial = StatePool(model, 1, CONTEXT).export(0)
    a, b = manager.create("k"), manager.create("k")
    turn(manager, a, [9, 8, 7])
    turn(manager, b, [6, 5])
    assert a.location == "disk"
    for s in (a, b):  # one on disk, one resident
        manager.reset(s)
        assert (s.num_tokens, s.token_hash) == (0, 0)
        for name, t in decode_snapshot(manager.export(s), fp).tensors.items():
            assert torch.equal(t, initial[name]), name
    assert a.location == "host" and not any(tmp_path.iterdir())


# -- export / restore ---------------------------------------------------------------------------------------------
def test_export_restore_continues_exactly(model, fp, tmp_path) -> None:
    manager = SessionManager(StatePool(model, 2, CONTEXT), fp, 2, tmp_path, hmac_key=KEY)
    original = manager.create("alice")
    turn(manager, original, list(range(20, 40)))
    data = manager.export(original)
    assert "alice" not in data[:4096].decode("latin-1")  # the owner stays on the server
    restored = manager.restore(data, "bob")
    assert restored.owner == "bob" and restored.session_id != original.session_id
    assert (restored.num_tokens, restored.token_hash) == (original.num_tokens, original.token_hash)
    tokens = [200, 3, 77]
    assert torch.equal(turn(manager, restored, tokens, 4), turn(manager, original, tokens, 4))


def test_restore_of_a_bad_snapshot_leaves_nothing(model, fp, tmp_path) -> None:
    manager = SessionManager(StatePool(model, 2, CONTEXT), fp, 1, tmp_path, hmac_key=KEY)
    s = manager.create("k")
    turn(manager, s, [1, 2, 3, 4])
    good = decode_snapshot(manager.export(s), fp, KEY)

    def snap(tensors: dict[str, torch.Tensor]) -> bytes:
        return encode_snapshot(Snapshot(tensors, fp, good.num_tokens, good.token_hash), KEY)

    other_model = make_model(LAYERS, seed=6, mlp=True)
    other_fp = model_fingerprint(other_model)
    bigger = make_model(["mamba2", "attention", "mamba2"], seed=5, mlp=True)
    length = dict(good.tensors, **{"layers.1.length": good.tensors["layers.1.length"] + 1})
    cases = {
        "invalid_snapshot": b"not a snapshot at all",
        "bad_signature": encode_snapshot(Snapshot(good.tensors, fp, good.num_tokens, good.token_hash)),
        "model_mismatch": encode_snapshot(Snapshot(good.tensors, other_fp, 1, 1), KEY),
        "checksum_mismatch": (lambda d: d[:-1] + bytes([d[-1] ^ 1]))(manager.export(s)),
        "state_mismatch": [
            snap({k: v for k, v in good.tensors.items() if k != "layers.0.ssm"}),
            snap(dict(good.tensors, **{"layers.0.conv": good.tensors["layers.0.conv"].double()})),
            snap(dict(good.tensors, **{"layers.2.k": good.tensors["layers.2.k"][:-1]})),
            snap(StatePool(bigger, 1, CONTEXT).export(0)),
            snap(length),
        ],
    }
    before = (len(manager), manager.pool.used_slots, manager.host_bytes(), sorted(tmp_path.iterdir()))
    for code, datas in cases.items():
        for data in datas if isinstance(datas, list) else [datas]:
            with pytest.raises(SnapshotError) as info:
                manager.restore(data, "k")
            assert info.value.code == code, info.value
            assert (len(manager), manager.pool.used_slots, manager.host_bytes(), sorted(tmp_path.iterdir())) == before


def test_restore_when_nothing_can_hold_it(model, fp) -> None:
    manager = SessionManager(StatePool(model, 2, CONTEXT), fp, max_host_sessions=1)
    a = manager.create("k")
    turn(manager, a, [1, 2])
    data = manager.export(a)
    b = manager.restore(data, "k")  # host memory has room
    assert b.location == "host"
    manager.acquire_slot(manager.create(None, ephemeral=True))  # a request without a session takes the other slot
    manager.acquire_slot(a)  # busy: no slot can be freed, and host memory is full
    with pytest.raises(PoolExhausted, match="no slot is free"):
        manager.restore(data, "k")
    assert len(manager) == 2 and manager.counts() == {"gpu": 1, "host": 1, "disk": 0}


# -- restart ------------------------------------------------------------------------------------------------------
def test_persist_all_and_load_index_continue_after_a_restart(model, fp, tmp_path, caplog) -> None:
    pool = StatePool(model, 2, CONTEXT)
    manager = SessionManager(pool, fp, max_host_sessions=2, snapshot_dir=tmp_path, hmac_key=KEY)
    reference = StatePool(model, 6, CONTEXT)
    owners = ["alice", "bob", None, "alice", "carol", "bob"]
    sessions = [manager.create(o) for o in owners]
    rng = random.Random(4)
    for i, s in enumerate(sessions[:-1]):  # the last one stays new, never used
        tokens = rand_tokens(rng, 3, 9)
        turn(manager, s, tokens)
        feed(model, reference, i, tokens, 2)
    assert {s.location for s in sessions} == {"gpu", "host", "disk"}
    saved = [(s.session_id, s.owner, s.num_tokens, s.token_hash, s.created) for s in sessions]
    assert manager.persist_all() == 5  # all but the one already on disk
    assert pool.used_slots == 0 and manager.host_bytes() == 0
    assert manager.counts() == {"gpu": 0, "host": 0, "disk": 6}
    # Junk in the directory: a corrupt file, a snapshot of another model, a stray file, a half-written one.
    (tmp_path / f"sess_{'ab' * 12}.safetensors").write_bytes(b"\x00" * 100)
    other = make_model(LAYERS, seed=9, mlp=True)
    foreign = Snapshot(StatePool(other, 1, CONTEXT).export(0), model_fingerprint(other), 0, 0, session_id="x")
    (tmp_path / f"sess_{'cd' * 12}.safetensors").write_bytes(encode_snapshot(foreign, KEY))
    (tmp_path / "notes.txt").write_text("not a session")
    (tmp_path / f"{sessions[0].session_id}.safetensors.tmp").write_bytes(b"partial")

    # A new process: a new pool and manager over the same directory.
    restarted = SessionManager(StatePool(model, 2, CONTEXT), fp, 2, tmp_path, hmac_key=KEY)
    with caplog.at_level(logging.WARNING, logger="kvfree.engine.sessions.manager"):
        assert restarted.load_index() == 6
    assert "sess_abab" in caplog.text and "sess_cdcd" in caplog.text and "different model" in caplog.text
    assert not list(tmp_path.glob("*.tmp"))
    for i, (session_id, owner, num_tokens, hash_, created) in enumerate(saved):
        s = restarted.get(session_id, owner)
        assert (s.location, s.num_tokens, s.token_hash) == ("disk", num_tokens, hash_)
        assert s.created == pytest.approx(created, abs=1e-5)
        tokens = rand_tokens(rng)
        assert torch.equal(turn(restarted, s, tokens, 3), feed(model, reference, i, tokens, 3)[1]), i
    for junk in ("ab", "cd"):
        (tmp_path / f"sess_{junk * 12}.safetensors").unlink()
    check_tiers(restarted)
    # A server with another key trusts none of these files.
    restarted.persist_all()
    assert SessionManager(StatePool(model, 1, CONTEXT), fp, 2, tmp_path, hmac_key=b"other").load_index() == 0


def test_session_records_its_tokens() -> None:
    s = Session("sess_x", owner=None)
    assert s.is_prefix_of([]) and s.is_prefix_of([1, 2])
    s.extend([5, 6, 7])
    s.extend([8])
    assert (s.num_tokens, s.token_hash) == (4, token_hash([5, 6, 7, 8]))
    assert s.is_prefix_of([5, 6, 7, 8]) and s.is_prefix_of([5, 6, 7, 8, 9])
    assert not s.is_prefix_of([5, 6, 7]) and not s.is_prefix_of([5, 6, 0, 8, 9])
    s.reset()
    assert (s.num_tokens, s.token_hash) == (0, 0)
