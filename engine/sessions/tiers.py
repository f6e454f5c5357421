"""SessionTiers: where each session's state lives (a GPU pool slot, host memory, the session store) and its moves.

A session is resident in a `StatePool` slot while a request runs. When a slot is needed, the least recently used idle
resident session is evicted to host memory: packed into one pinned buffer on a side stream (engine/state/mover.py),
so no step waits for the copy. When more than `max_host_sessions` sessions hold host copies, the least recently
used one is written to the store. A session comes back to a slot on its next request: from host memory in one copy
on the loading stream; from the store, read and verified on an I/O thread as soon as its request is queued
(`prefetch`), so the step that admits it finds the bytes in memory. None is ever dropped to make room: when nothing
can move, the call raises (`PoolExhausted`) and changes nothing.

The store is also where sessions persist: every turn under write-through (`persist_turn`, now or on the background
writer), every idle session at shutdown (`persist_all`). (Turns are claimed across replicas by
engine/sessions/leases.py.)
What a session is and who owns it is the registry's business (engine/sessions/manager.py); this module never creates or
forgets one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from kvfree.engine.protocol import PoolExhausted, SessionNotFound, SnapshotError, SnapshotMismatchError
from kvfree.engine.sessions.session import Session
from kvfree.engine.sessions.store import (
    BackgroundWriter,
    SessionStore,
    StoredSession,
)
from kvfree.engine.state.mover import StateMover
from kvfree.engine.state.packed import PackedState
from kvfree.engine.state.pool import StatePool, staged_tensors
from kvfree.engine.state.snapshot import Snapshot, check_finite_state, decode_snapshot, snapshot_parts

log = logging.getLogger(__name__)


MAX_STAGED = 4  # host-parked sessions of queued requests copied to the device ahead of their admission


class StateLoading(RuntimeError):
    """The session's state is still being read from the store (`prefetch`): its request waits a step or two."""

    def __init__(self, message: str, read: Future) -> None:
        super().__init__(message)
        self.read = read

    def wait(self) -> None:
        """Block until the read has finished (its outcome is taken by the next `make_resident`)."""
        wait([self.read])


@dataclass
class SessionCounters:
    """Tier movements since start, and the turns that started their session over, for metrics."""

    evictions: int = 0  # GPU slot -> host memory
    spills: int = 0  # host memory -> the store
    reloads_from_host: int = 0
    reloads_from_disk: int = 0  # (from the store, a directory or Redis)
    stored_turns: int = 0  # write-through (or async) writes that landed
    failed_writes: int = 0
    resets: int = 0  # turns whose prompt did not continue what the session held: it started over


class SessionTiers:
    """Places sessions' states in the pool, host memory or the store, and moves them (see the module docstring).

    Args:
        pool: the state pool; shared with sessionless requests, only the slots taken here are freed here.
        fingerprint: `model_fingerprint` of the served model (snapshots of other models are refused).
        max_host_sessions: most sessions holding state in host memory; beyond, the LRU ones go to the store. Without
            a store, host memory is the last tier and this is a hard cap.
        store: where sessions spill and persist beyond the process (engine/sessions/store.py).
        write_through: store every finished turn (`persist_turn`), so a crash loses no completed turn; a loaded
            session's stored copy is then kept, not removed.
        async_writes: store those turns from a background thread (`BackgroundWriter`), off the engine's step.
        hmac_key: sign written snapshots and require valid signatures on every snapshot read.
        reserved_slots: called on each slot request; free slots to leave to others (requests without a session).

    Not thread-safe: every call happens on the engine thread. The I/O thread only reads and decodes files.
    """

    def __init__(
        self,
        pool: StatePool,
        fingerprint: str,
        max_host_sessions: int,
        store: SessionStore | None = None,
        write_through: bool = False,
        async_writes: bool = False,
        hmac_key: bytes | None = None,
        reserved_slots: Callable[[], int] | None = None,
    ) -> None:
        if max_host_sessions < 0:
            raise ValueError(f"max_host_sessions must be >= 0, got {max_host_sessions}")
        self.pool = pool
        self.mover = StateMover(pool)
        self.fingerprint = fingerprint
        self.max_host_sessions = max_host_sessions
        self.store = store
        self.hmac_key = hmac_key
        self.write_through = write_through and store is not None
        self.writer = BackgroundWriter(store, self._encode) if self.write_through and async_writes else None
        self._writing: dict[str, int] = {}  # session id -> background writes not landed yet
        self.write_lag_seconds = 0.0  # how long the last background write took to land after its turn
        self._reserved = reserved_slots or (lambda: 0)
        self.counters = SessionCounters()
        self._resident: dict[str, Session] = {}  # location "gpu"
        self._host: dict[str, Session] = {}  # location "host" with host_state set (new sessions hold nothing)
        self._host_checkpoints: dict[str, Session] = {}  # the prefix cache's, in host memory (its budget bounds them)
        # Asked when a checkpoint must leave its slot, with its bytes: True to keep it in host memory, False to drop
        # it (the prefix cache decides, by its budget; engine/sessions/prefix_cache.py sets this).
        self.keep_evicted_checkpoint: Callable[[Session, int], bool] = lambda session, nbytes: False
        self._disk: dict[str, Session] = {}  # location "disk" (in the store)
        self._staged: set[str] = set()  # sessions whose host copy `prefetch` copied to the device already
        # Sessions whose spill is under way (`Session.spill`), so that the engine's per-step poll looks at them only.
        self._spilling: dict[str, Session] = {}
        self._tick = 0
        self._initial: PackedState | None = None
        # I/O threads, made on first use: reads (`prefetch`) apart from spill writes, so that a read a request waits
        # for never queues behind writes nobody waits for.
        self._reads: ThreadPoolExecutor | None = None
        self._writes: ThreadPoolExecutor | None = None

    def warm_up(self) -> None:
        """Run one eviction and one load through the scratch slot (start-up): the move kernels are compiled and a
        pinned buffer is in the allocator's cache before the first session moves, not on that request's time."""
        scratch = self.pool.scratch_slot
        self.mover.load(scratch, self.mover.evict(scratch))
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)

    # -- what is where --------------------------------------------------------------------------------------------
    def counts(self, ephemeral_resident: int = 0) -> dict[str, int]:
        """Registered sessions by tier (sessions holding nothing count as "host"), less `ephemeral_resident`; the
        prefix cache's checkpoints are not sessions and not counted."""
        checkpoints = sum(s.checkpoint for s in self._resident.values())
        gpu = len(self._resident) - ephemeral_resident - checkpoints
        return {"gpu": gpu, "host": len(self._host), "disk": len(self._disk)}

    def resident(self) -> list[Session]:
        """The sessions holding a pool slot (a snapshot of the list: safe from any thread)."""
        return list(self._resident.values())

    def host_bytes(self) -> int:
        """Host memory held by sessions' state copies."""
        return sum(s.host_state.nbytes for s in list(self._host.values()) if s.host_state is not None)

    def touch(self, session: Session) -> None:
        """Mark `session` the most recently used (LRU order for evictions and spills)."""
        self._tick += 1
        session.lru_tick = self._tick
        session.last_used = time.monotonic()

    # -- placing and moving -------------------------------------------------------------------------------------
    def place(self, session: Session, state: PackedState | None) -> None:
        """A session new to the tiers, holding `state` (None: the initial state), in host memory or, when host
        memory is full and nothing can spill, a free slot. Raises PoolExhausted (nothing placed) when neither fits."""
        host_full = self.store is None and len(self._host) >= self.max_host_sessions
        if state is not None and host_full:
            if self.pool.free_slots <= self._reserved():
                raise PoolExhausted(
                    f"host memory holds max_host_sessions={self.max_host_sessions} sessions, no slot is free and "
                    "there is no session store; retry later or delete idle sessions"
                )
            slot = self.pool.alloc()
            try:
                self.mover.load(slot, state)
            except Exception:
                self.pool.free(slot)
                raise
            self._to_gpu(session, slot)
        else:
            self._to_host(session, state)
            self._spill_over()
        self.touch(session)

    def place_stored(self, session: Session, version: int) -> None:
        """A session found in the store (another replica's, or a previous run's): it lives there until used."""
        session.store_version = version
        self._to_disk(session)
        self.touch(session)

    def place_copy(self, source: Session, child: Session) -> None:
        """`child` holding a copy of `source`'s state: slot to slot when `source` is resident and a slot is free,
        else in host memory."""
        if source.slot is not None and self.pool.free_slots > self._reserved():
            slot = self.pool.alloc()
            self.pool.copy(source.slot, slot)
            self._to_gpu(child, slot)
            self.touch(child)
        else:
            self.place(child, self.state_copy(source))

    def place_checkpoint(self, session: Session, leave_free: int) -> int | None:
        """Give a new checkpoint a slot, whose state the caller writes (a fork in its next step): a free one while
        more than `leave_free` are, else the slot of the least recently used idle checkpoint (moved to host memory
        or dropped, as the prefix cache says). Never a session's: None when neither is there."""
        if self.pool.free_slots > max(leave_free, self._reserved()):
            slot = self.pool.alloc()
        else:
            older = [s for s in self._resident.values() if s.checkpoint and not s.busy]
            if not older:
                return None
            slot = self._slot_of_checkpoint(min(older, key=lambda s: s.lru_tick))
        self._to_gpu(session, slot)
        self.touch(session)
        return slot

    def _slot_of_checkpoint(self, victim: Session) -> int:
        """Free a resident checkpoint's slot for another holder: its state to host memory if the prefix cache keeps
        it there, else dropped (the cache forgets it); returns the slot, allocated."""
        nbytes = self.pool.bytes_per_session(victim.num_tokens)
        state = self.mover.evict(victim.slot) if self.keep_evicted_checkpoint(victim, nbytes) else None
        self.pool.free(victim.slot)
        self._detach(victim)
        if state is not None:
            self._to_host(victim, state)
        else:
            victim.location, victim.slot = "host", None
        return self.pool.alloc()

    def copy_into(self, source: Session, slot: int) -> None:
        """Make `slot`'s state a copy of `source`'s (a request resuming from a checkpoint): slot to slot on the
        compute stream, or loaded from its host copy, which it keeps."""
        if source.slot is not None:
            self.pool.copy(source.slot, slot)
        elif source.host_state is not None:
            self.mover.load(slot, source.host_state, keep=True)
        else:
            raise ValueError(f"{source.session_id} holds no state to copy")
        self.touch(source)

    def make_resident(self, session: Session) -> int:
        """Give `session` a pool slot holding its state; returns the slot (at once when it has one).

        Takes a free slot (leaving `reserved_slots()` free), else evicts the least recently used idle resident
        session to host memory. The state comes from host memory or the store (verified, then removed from the store
        unless under write-through). Raises StateLoading while a `prefetch` is still reading it, PoolExhausted,
        SnapshotError (its stored copy is corrupt or no longer fits) or SessionStoreError; in every case nothing is
        lost and the session stays where it was.
        """
        if session.slot is not None:
            self.touch(session)
            return session.slot
        source = session.location
        self._cancel_spill(session)
        # Read the stored copy first: a corrupt one fails here, before another session was moved for it.
        state = self._fetched(session) if source == "disk" else session.staged or session.host_state
        slot = self._take_slot(frees_host=session.session_id in self._host)
        if state is not None:
            try:
                self.mover.load(slot, state)
            except Exception:
                self.pool.free(slot)
                raise
        self._detach(session)
        if source == "disk":
            if not self.write_through:  # the stored copy is the durable one under write-through
                self.store.delete(session.session_id)
            self.counters.reloads_from_disk += 1
        elif state is not None:
            self.counters.reloads_from_host += 1
        self._to_gpu(session, slot)
        self._spill_over()
        self.touch(session)
        return slot

    def prefetch(self, session: Session) -> None:
        """Start fetching the state of a session whose request was just queued, so that the step that admits it
        finds it close: from the store, read on the I/O thread into memory; from host memory on a GPU, copied to the
        device on the loading stream (at most `MAX_STAGED` at a time: each holds a state's device bytes)."""
        if session.location == "host" and session.host_state is not None and self.mover.loading_stream is not None:
            if session.staged is None and len(self._staged) < MAX_STAGED:
                session.staged = self.mover.stage(session.host_state)
                self._staged.add(session.session_id)
            return
        if session.location != "disk" or session.fetch is not None:
            return
        if self._reads is None:
            self._reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfree-session-read")
        session.fetch = self._reads.submit(self._read, session.session_id)

    def reset_state(self, session: Session) -> None:
        """Return `session`'s state to the initial one (the registry resets its tokens)."""
        self.counters.resets += 1
        self._cancel_spill(session)
        if session.slot is not None:
            self.pool.reset(session.slot)
        elif session.location != "host" or session.host_state is not None:
            self._drop_stored(session)
            self._detach(session)
            self._to_host(session, None)

    def remove(self, session: Session) -> None:
        """Free everything `session` holds: its slot, host copy and stored copy."""
        self._cancel_spill(session)
        if session.slot is not None:
            self.pool.free(session.slot)
        self._drop_stored(session)
        if self.write_through and not session.ephemeral and not session.checkpoint:
            self.store.delete(session.session_id)
        self._detach(session)

    def forget_local(self, session: Session) -> None:
        """Drop this replica's copy of a session whose stored copy is newer (the store's copy is kept)."""
        self._cancel_spill(session)
        if session.slot is not None:
            self.pool.free(session.slot)
        session.host_state = None
        session.fetch = None
        self._unstage(session)
        self._detach(session)

    def state_copy(self, session: Session) -> PackedState | None:
        """An independent host copy of the session's state (None for the initial state); on a GPU its copy from the
        pool may still run (`PackedState.wait`)."""
        if session.slot is not None:
            return self.mover.evict(session.slot)  # (a copy: the slot keeps its state)
        if session.location == "disk":
            return self._fetched(session)
        if session.host_state is not None:
            return session.host_state.clone()
        return None

    def check_finite(self, state: PackedState) -> None:
        """SnapshotError("non_finite_state") when a floating-point tensor of `state` holds a NaN or Inf. On a GPU the
        state is checked there (one copy over and a reduction per tensor: 49 MB in ~3 ms on an H100, where the host
        took 19 ms); `state` must fit the pool (`check_state` first)."""
        if self.pool.device.type != "cuda":
            check_finite_state(state.tensors())
            return
        staged = self.mover.stage(state)
        with torch.cuda.stream(self.mover.loading_stream):
            views = staged_tensors(staged)
            check_finite_state(views)

    def initial_state(self) -> PackedState:
        """A new session's state (not always zeros), packed."""
        if self._initial is None:
            self._initial = self.pool.export_initial()
        return self._initial

    def _take_slot(self, frees_host: bool) -> int:
        """A slot for a session about to become resident, evicting the LRU idle resident one if needed.
        `frees_host`: the incoming session gives back a host copy (so an eviction keeps the host count)."""
        if self.pool.free_slots > self._reserved():
            return self.pool.alloc()
        idle = [s for s in self._resident.values() if not s.busy and not s.ephemeral]
        if not idle:
            raise PoolExhausted(
                f"no state slot is free for a session ({self.pool.used_slots} of {self.pool.capacity} in use, "
                f"{self._reserved()} kept for other requests) and every resident session is busy; "
                "retry when a request finishes"
            )
        # The prefix cache's checkpoints make room first (least recently used first), then idle sessions.
        victim = min(idle, key=lambda s: (not s.checkpoint, s.lru_tick))
        if victim.checkpoint:
            return self._slot_of_checkpoint(victim)
        if self.store is None and len(self._host) + (0 if frees_host else 1) > self.max_host_sessions:
            raise PoolExhausted(
                f"no slot free and host memory already holds max_host_sessions={self.max_host_sessions} sessions, "
                "with no session store to spill to; retry later, delete idle sessions, or configure one"
            )
        state = self.mover.evict(victim.slot)
        self.pool.free(victim.slot)
        self._detach(victim)
        self._to_host(victim, state)
        self.counters.evictions += 1
        return self.pool.alloc()

    def _spill_over(self) -> None:
        """Send LRU host copies to the store until at most `max_host_sessions` stay in host memory. Their writes run
        on the I/O thread (a session is usable from memory until its write lands, `poll`): the step never waits for
        a file or Redis. Under write-through a stored session's copy is already the stored one: it is just dropped."""
        if self.store is None:
            return
        staying = [s for s in self._host.values() if s.spill is None]
        excess = max(len(staying) - self.max_host_sessions, 0)
        # Sessions reserved by waiting requests go last: they are about to be loaded again.
        for victim in sorted(staying, key=lambda s: (s.busy, s.lru_tick))[:excess]:
            if self.write_through and victim.store_version:
                self._detach(victim)
                self._to_disk(victim)
                self.counters.spills += 1
                continue
            # The snapshot's fields are taken here; its header (hash) and write run on the I/O thread.
            if self._writes is None:
                self._writes = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvfree-session-spill")
            victim.spill = self._writes.submit(
                self._write_parts, self._stored_meta(victim), self.snapshot(victim, victim.host_state)
            )
            self._spilling[victim.session_id] = victim

    def _write_parts(self, meta: StoredSession, snap: Snapshot) -> int:
        """Store a snapshot (on any thread); returns the stored version."""
        return self.store.write_parts(meta, snapshot_parts(snap, self.hmac_key)).version

    def poll(self) -> None:
        """Apply the spills that landed: those sessions now live in the store, their host memory is given back. A
        failed one stays in host memory (over the cap) rather than be lost; the next spill tries again."""
        for session in [s for s in self._spilling.values() if s.spill.done()]:
            del self._spilling[session.session_id]
            future, session.spill = session.spill, None
            try:
                session.store_version = future.result()
            except Exception as e:
                log.error("could not write session %s to the session store: %s", session.session_id, e)
                continue
            self._detach(session)
            self._to_disk(session)
            self.counters.spills += 1

    @property
    def moving(self) -> bool:
        """Whether spills are in flight (the engine polls soon even when idle)."""
        return bool(self._spilling)

    def _cancel_spill(self, session: Session) -> None:
        """The session is needed (or changed) while its spill runs: wait for the write, then keep the copy in memory
        and drop the stored one (kept under write-through, where the stored copy is the durable one)."""
        future, session.spill = session.spill, None
        if future is None:
            return
        del self._spilling[session.session_id]
        try:
            version = future.result()
        except Exception:  # nothing was stored
            return
        if self.write_through:
            session.store_version = version
        else:
            self.store.delete(session.session_id)

    def flush_spills(self) -> None:
        """Wait for every spill in flight and apply it (shutdown)."""
        wait([session.spill for session in self._spilling.values()])
        self.poll()

    def _fetched(self, session: Session) -> PackedState:
        """The state of a session in the store: from its `prefetch` (StateLoading while that still runs), else read
        now. A failed read is not kept: the next request tries again."""
        future, session.fetch = session.fetch, None
        if future is None:
            return self._checked(self._read(session.session_id), session)
        if not future.done():
            session.fetch = future
            raise StateLoading(f"session {session.session_id} is being read from the session store", future)
        return self._checked(future.result(), session)

    def _checked(self, snap: Snapshot, session: Session) -> PackedState:
        if snap.session_id != session.session_id:
            raise SnapshotError(f"stored snapshot of session {session.session_id} holds session {snap.session_id}")
        check_state(self.pool, snap.state)
        return snap.state

    def _to_gpu(self, session: Session, slot: int) -> None:
        session.location, session.slot, session.host_state = "gpu", slot, None
        self._unstage(session)
        self._resident[session.session_id] = session

    def _to_host(self, session: Session, state: PackedState | None) -> None:
        session.location, session.slot, session.host_state = "host", None, state
        self._unstage(session)
        if state is not None:
            (self._host_checkpoints if session.checkpoint else self._host)[session.session_id] = session

    def _to_disk(self, session: Session) -> None:
        session.location, session.slot, session.host_state = "disk", None, None
        self._unstage(session)
        self._disk[session.session_id] = session

    def _unstage(self, session: Session) -> None:
        """Drop the device copy `prefetch` made (its host copy moved or changed; its bytes go back to the cache)."""
        session.staged = None
        self._staged.discard(session.session_id)

    def _detach(self, session: Session) -> None:
        """Remove `session` from the tier indexes (its slot, memory or stored copy are handled by the caller)."""
        for tier in (self._resident, self._host, self._disk, self._host_checkpoints):
            tier.pop(session.session_id, None)

    def _drop_stored(self, session: Session) -> None:
        session.host_state = None
        session.fetch = None
        self._unstage(session)
        if session.location == "disk" and not self.write_through:  # then a stored copy exists only while "disk"
            self.store.delete(session.session_id)

    # -- the store ----------------------------------------------------------------------------------------------
    def snapshot(self, session: Session, state: PackedState) -> Snapshot:
        """`state` as the snapshot of `session` (its tokens, id, owner)."""
        return Snapshot(
            state=state,
            fingerprint=self.fingerprint,
            num_tokens=session.num_tokens,
            token_hash=session.token_hash,
            session_id=session.session_id,
            session_created=session.created,
            owner=session.owner,
        )

    def write(self, session: Session, state: PackedState) -> None:
        """Store `state` as the session's snapshot now (the header, then the state's buffer as it is)."""
        session.store_version = self._write_parts(self._stored_meta(session), self.snapshot(session, state))

    def _read(self, session_id: str) -> Snapshot:
        """The stored snapshot of a session, read into (pinned) memory and verified (on any thread)."""
        pin = self.pool.device.type == "cuda"
        data = self.store.read_into(session_id, lambda n: PackedState.buffer(n, pin))
        if data is None:
            raise SessionNotFound(f"session {session_id!r} is no longer in the session store (expired?)")
        # The server wrote this file itself: the checksum (and signature) vouch for it, the values are as they were.
        return decode_snapshot(data, self.fingerprint, self.hmac_key, check_finite=False)

    def read_snapshot(self, session: Session) -> Snapshot:
        """The stored snapshot of `session`, verified and checked against the pool."""
        snap = self._read(session.session_id)
        self._checked(snap, session)
        return snap

    def persist(self, session: Session) -> None:
        """Write the session to the store and give back its slot or host memory (shutdown)."""
        self.write(session, self.state_copy(session) or self.initial_state())
        if session.slot is not None:
            self.pool.free(session.slot)
        self._detach(session)
        self._to_disk(session)

    def persist_turn(self, session: Session) -> None:
        """Write-through: store the session's state now (a turn on it just finished), or hand it to the background
        writer. Raises SessionStoreError when the store fails; the state stays where it is."""
        if not self.write_through or session.ephemeral:
            return
        state = self.state_copy(session) or self.initial_state()
        if self.writer is None:
            self.write(session, state)
            self.counters.stored_turns += 1
            return
        self.poll_writes(lambda _: None)
        self._writing[session.session_id] = self._writing.get(session.session_id, 0) + 1
        self.writer.submit(self._stored_meta(session), self.snapshot(session, state))

    def writing(self, session_id: str) -> bool:
        """Whether a background write of the session has not landed yet."""
        return bool(self._writing.get(session_id))

    def poll_writes(self, landed: Callable[[str], Session | None]) -> list[Session]:
        """Apply the background writes that landed: versions, counters. `landed(session_id)`: the registered session
        of that id, if any. Returns the idle sessions whose last write has landed (their turn's claim can go)."""
        settled: list[Session] = []
        if self.writer is None:
            return settled
        for done in self.writer.done():
            left = self._writing.get(done.session_id, 1) - 1
            if left:
                self._writing[done.session_id] = left
            else:
                self._writing.pop(done.session_id, None)
            self.write_lag_seconds = done.lag_seconds
            session = landed(done.session_id)
            if done.error is not None:
                self.counters.failed_writes += 1
                log.error("could not store session %s: %s", done.session_id, done.error)
            else:
                self.counters.stored_turns += 1
                if session is not None:
                    session.store_version = max(session.store_version, done.version)
            if session is not None and not left and not session.busy:
                settled.append(session)
        return settled

    def _encode(self, snap: Snapshot) -> list[bytes | memoryview]:
        return snapshot_parts(snap, self.hmac_key)  # (the header and the state's buffer: never joined)

    def _stored_meta(self, session: Session) -> StoredSession:
        return StoredSession(session.session_id, session.owner, session.num_tokens, session.token_hash,
                             session.created, session.store_version)  # fmt: skip

    def flush_writes(self, landed: Callable[[str], Session | None]) -> list[Session]:
        """Wait for every background write to land, and apply them (shutdown; returns as `poll_writes` does)."""
        if self.writer is None:
            return []
        self.writer.flush()
        return self.poll_writes(landed)


def check_state(pool: StatePool, state: PackedState) -> None:
    """Raise SnapshotError("state_mismatch") unless `state` imports into `pool` (checked without a slot)."""
    try:
        pool.check_packed(state)
    except SnapshotMismatchError as e:
        raise SnapshotError(f"snapshot state does not fit this server's model: {e}", "state_mismatch") from None
