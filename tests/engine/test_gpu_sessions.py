"""Session moves on a GPU (skipped elsewhere; run by tests/gpu_run.sh on the device): evictions and loads run on side
streams while steps run, never make the host wait, and sessions continue exactly where they left off."""

from __future__ import annotations

import pytest
import torch

from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.protocol import SnapshotError
from kvfree.engine.sessions.manager import Session, SessionManager
from kvfree.engine.state.pool import StatePool
from kvfree.engine.state.snapshot import Snapshot, encode_snapshot, model_fingerprint
from tests.conftest import make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEVICE = torch.device("cuda")
LAYERS = ["mamba2", "gka", "mamba2"]  # recurrent states only: no per-token cache, so no length is read back


@pytest.fixture(scope="module")
def model() -> HybridLM:
    return make_model(LAYERS, seed=7, mlp=True).to(DEVICE)


def prefill(model: HybridLM, pool: StatePool, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    return model.prefill(ids, pool.tensors, StepBatch.prefill(slots, [len(p) for p in prompts], DEVICE))


def decode(model: HybridLM, pool: StatePool, slots: list[int], tokens: list[int]) -> torch.Tensor:
    return model.decode(torch.tensor(tokens, device=DEVICE), pool.tensors, StepBatch.decode(slots, DEVICE))


def test_an_evicted_session_continues_exactly_while_its_slot_is_reused_at_once(model) -> None:
    """The eviction's copy to the host runs on a side stream while the next step writes the freed slot; the step
    waits only for the gather, so the host copy holds the state as it was, and the session, loaded back into
    another slot, decodes the tokens it would have decoded without moving."""
    fp = model_fingerprint(model)
    manager = SessionManager(StatePool(model, 2, 64), fp, max_host_sessions=4)
    reference = StatePool(model, 1, 64)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 200, (n,), generator=gen).tolist() for n in (37, 21, 50)]
    a, b, c = (manager.create("k") for _ in range(3))
    slots = [manager.acquire_slot(s) for s in (a, b)]
    prefill(model, manager.pool, slots, prompts[:2])
    prefill(model, reference, [0], prompts[:1])
    want = decode(model, reference, [0], [5])
    for s in (a, b):
        manager.release(s)
    manager.acquire_slot(b)  # b is the most recently used: a is evicted next
    torch.cuda.set_sync_debug_mode("error")
    try:
        slot_c = manager.acquire_slot(c)  # evicts a on the side stream; c's new state goes into a's old slot
    finally:
        torch.cuda.set_sync_debug_mode("default")
    prefill(model, manager.pool, [slot_c], prompts[2:])  # queued at once, overwriting a's rows on the device
    assert a.location == "host" and slot_c == slots[0] and a.host_state.ready is not None
    manager.release(c)
    manager.release(b)
    manager.acquire_slot(b)  # most recently used again: c is evicted to make room for a
    slot_a = manager.acquire_slot(a)
    got = decode(model, manager.pool, [slot_a], [5])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_loads_and_evictions_never_make_the_host_wait(model) -> None:
    """Sessions cycling through two slots (each acquire evicts one and loads another) queue their copies without
    a host sync, and every session's state survives the round trips bit for bit."""
    fp = model_fingerprint(model)
    pool = StatePool(model, 2, 64)
    manager = SessionManager(pool, fp, max_host_sessions=8)
    sessions: list[Session] = [manager.create("k") for _ in range(6)]
    gen = torch.Generator().manual_seed(4)
    states = {}
    for s in sessions:
        slot = manager.acquire_slot(s)
        prefill(model, pool, [slot], [torch.randint(1, 200, (19,), generator=gen).tolist()])
        states[s.session_id] = pool.export(slot)
        manager.release(s)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            for s in sessions:
                manager.acquire_slot(s)
                manager.release(s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert manager.counters.evictions >= 18 and manager.counters.reloads_from_host >= 18
    for s in sessions:
        slot = manager.acquire_slot(s)
        for name, t in pool.export(slot).items():
            assert torch.equal(t, states[s.session_id][name]), (s.session_id, name)
        manager.release(s)


def test_a_restored_state_is_checked_for_nan_and_inf_on_the_gpu(model) -> None:
    """A restored snapshot's values are checked on the device (one copy over and a reduction per tensor): a NaN or
    an Inf anywhere is refused with `non_finite_state` naming the tensor, and nothing is registered; a clean one is
    restored and continues exactly."""
    fp = model_fingerprint(model)
    manager = SessionManager(StatePool(model, 2, 64), fp, max_host_sessions=4)
    s = manager.create("k")
    slot = manager.acquire_slot(s)
    prefill(model, manager.pool, [slot], [list(range(3, 40))])
    s.extend(list(range(3, 40)))
    manager.release(s)
    snap = manager.snapshot(s)
    names = [n for n, t in snap.tensors.items() if t.is_floating_point()]
    for name, value in ((names[0], float("nan")), (names[-1], float("inf"))):
        tensors = {k: v.clone() for k, v in snap.tensors.items()}
        tensors[name].view(-1)[-1] = value
        bad = encode_snapshot(Snapshot(tensors, fp, snap.num_tokens, snap.token_hash))
        with pytest.raises(SnapshotError) as info:
            manager.restore(bad, "k")
        assert info.value.code == "non_finite_state" and name in str(info.value)
        assert len(manager) == 1
    twin = manager.restore(encode_snapshot(snap), "k")
    want = decode(model, manager.pool, [manager.acquire_slot(s)], [9])
    got = decode(model, manager.pool, [manager.acquire_slot(twin)], [9])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_queued_sessions_host_copy_is_on_the_device_before_its_admission(model) -> None:
    """Reserving a host-parked session (its request is queued) copies its state to the device on the loading stream at
    once, so that admitting it later is one scatter; it continues exactly, and at most MAX_STAGED are held."""
    from kvfree.engine.sessions.tiers import MAX_STAGED

    fp = model_fingerprint(model)
    manager = SessionManager(StatePool(model, 1, 64), fp, max_host_sessions=16)
    reference = StatePool(model, MAX_STAGED + 2, 64)
    sessions = [manager.create("k") for _ in range(MAX_STAGED + 2)]
    for i, s in enumerate(sessions):
        prompt = [3 + i, 9, 27, 81, 5]
        prefill(model, manager.pool, [manager.acquire_slot(s)], [prompt])
        prefill(model, reference, [i], [prompt])
        manager.release(s)
    parked = sessions[:-1]  # the last one holds the slot
    for s in parked:
        manager.reserve(s)
    staged = [s for s in parked if s.staged is not None]
    assert len(staged) == MAX_STAGED and all(s.location == "host" for s in parked)
    for i, s in enumerate(parked):
        got = decode(model, manager.pool, [manager.acquire_slot(s)], [7])
        torch.testing.assert_close(got, decode(model, reference, [i], [7]), rtol=0, atol=0)
        assert s.staged is None
        manager.release(s)
