"""Sessions, and the tiers their state moves through: a GPU pool slot -> host memory -> a snapshot file.

A session is a conversation's state on the server (docs/design/architecture.md §6). While a request runs, its session is
resident in a `StatePool` slot. When a slot is needed, the least recently used idle resident session is exported
to host memory; when more than `max_host_sessions` sessions hold host copies, the least recently used one is
written to the snapshot directory. A session comes back to a slot on its next request. None is ever dropped to
make room: when nothing can move, the call raises (`PoolExhausted`, `SessionLimitError`) and changes nothing.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from kvfree.engine.session_store import (
    BackgroundWriter,
    DirectoryStore,
    SessionStore,
    SessionStoreError,
    StoredSession,
    new_holder,
)
from kvfree.engine.snapshot import Snapshot, SnapshotError, decode_snapshot, encode_snapshot, token_hash
from kvfree.engine.state_pool import SnapshotMismatchError, StatePool

log = logging.getLogger(__name__)

Location = Literal["gpu", "host", "disk"]
SESSION_ID = re.compile(r"sess_[0-9a-f]{24}")
_SUFFIX = ".safetensors"


class SessionNotFound(LookupError):
    """No such session for this owner (the same answer whether it does not exist or belongs to another key)."""


class PoolExhausted(RuntimeError):
    """No slot can be made free now: every resident session is busy, or host memory is full with no snapshot
    directory to spill to. Nothing was changed; retrying after running requests finish can succeed."""


class SessionLimitError(RuntimeError):
    """A new session was refused because, without a snapshot directory, the server could not keep it."""


@dataclass(eq=False)  # an entity: compared by identity (its fields hold tensors)
class Session:
    """One conversation's state and where it lives.

    location: "gpu" (in pool `slot`), "host" (`host_state`: CPU tensors as `StatePool.export` names them, or
        None for a new session's initial state, which costs nothing until first use) or "disk" (a snapshot file).
    num_tokens / token_hash: the tokens consumed so far (`engine.snapshot.token_hash` of them), so a new prompt
        can be checked to extend them without storing them.
    created: time.time() at creation. last_used: time.monotonic() of the last acquire or release.
    busy: a request holds the session (set by `acquire_slot`, or earlier by a scheduler reserving it for a
        waiting request); it is never evicted while busy. Refusing a second concurrent request is the caller's job.
    ephemeral: a slot holder for a request without a session (e.g. the extra choices of n > 1): never evicted,
        persisted or counted, invisible to `get`, and deleted by its request when it ends.
    """

    session_id: str
    owner: str | None
    num_tokens: int = 0
    token_hash: int = 0
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    location: Location = "host"
    slot: int | None = None
    host_state: dict[str, torch.Tensor] | None = None
    busy: bool = False
    ephemeral: bool = False
    delete_when_released: bool = False  # deleted as soon as the request using it ends (`AsyncEngine.discard_session`)
    # LRU order set by the manager: a counter, because monotonic clocks can tie on coarse platforms.
    lru_tick: int = field(default=0, repr=False)
    store_version: int = field(default=0, repr=False)  # the store's version this copy matches (0: none)

    def extend(self, tokens: list[int]) -> None:
        """Record that the state has consumed `tokens` after the ones before."""
        self.token_hash = token_hash(tokens, start=self.token_hash)
        self.num_tokens += len(tokens)

    def reset(self) -> None:
        """Forget the consumed tokens (the manager's `reset` also resets the state itself)."""
        self.num_tokens = 0
        self.token_hash = 0

    def is_prefix_of(self, prompt_tokens: list[int]) -> bool:
        """Whether the consumed tokens are the first `num_tokens` of `prompt_tokens` (by hash)."""
        n = self.num_tokens
        return n <= len(prompt_tokens) and token_hash(prompt_tokens[:n]) == self.token_hash


@dataclass
class SessionCounters:
    """Tier movements since start, and the turns that started their session over, for metrics."""

    evictions: int = 0  # GPU slot -> host memory
    spills: int = 0  # host memory -> snapshot file
    reloads_from_host: int = 0
    reloads_from_disk: int = 0
    stored_turns: int = 0  # write-through (or async) writes that landed
    failed_writes: int = 0
    resets: int = 0  # turns whose prompt did not continue what the session held: it started over (`reset`)


class SessionManager:
    """Owns every session and moves their state between a GPU slot, host memory and the snapshot directory.

    Args:
        pool: the state pool; the manager shares it with sessionless requests and only frees slots it took.
        fingerprint: `model_fingerprint` of the served model (snapshots of other models are refused).
        max_host_sessions: most sessions holding state in host memory. With `snapshot_dir`, more are written to
            it (LRU first). Without one, host memory is the last tier and this is a hard cap: the server then
            holds at most `pool.capacity + max_host_sessions` sessions and refuses new ones beyond that
            (`SessionLimitError`) rather than ever drop one.
        snapshot_dir: where sessions spill and persist across restarts (one `{session_id}.safetensors` each); a
            shorthand for `store=DirectoryStore(snapshot_dir, ...)`.
        store: where sessions spill and persist beyond the process (engine/session_store.py); a shared store
            (Redis) is also where other replicas find them, so `get` checks it for newer versions.
        write_through: after every turn on a session, write its state to the store (`persist_turn`), so that a
            crash loses no completed turn; a loaded session's stored copy is then kept, not removed.
        async_writes: store those turns from a background thread (`BackgroundWriter`) instead of on the
            engine's step: the turn's last event does not wait, and a crash can lose the writes still queued.
        hmac_key: sign written snapshots and require valid signatures on every snapshot read or restored.
        reserved_slots: called on each slot request; the number of free slots to leave to others (e.g. requests
            without a session the scheduler has admitted). The manager evicts its own sessions instead.

    Not thread-safe by design: every call happens on the engine thread, which owns the pool.
    """

    def __init__(
        self,
        pool: StatePool,
        fingerprint: str,
        max_host_sessions: int,
        snapshot_dir: Path | None = None,
        hmac_key: bytes | None = None,
        reserved_slots: Callable[[], int] | None = None,
        store: SessionStore | None = None,
        write_through: bool = False,
        async_writes: bool = False,
    ) -> None:
        if max_host_sessions < 0:
            raise ValueError(f"max_host_sessions must be >= 0, got {max_host_sessions}")
        self.pool = pool
        self.fingerprint = fingerprint
        self.max_host_sessions = max_host_sessions
        if store is None and snapshot_dir is not None:
            store = DirectoryStore(snapshot_dir, fingerprint, hmac_key)
        self.store = store
        self.write_through = write_through and store is not None
        self.lease_holder = new_holder()
        self._leases: dict[str, float] = {}  # session id -> time.monotonic() its lease was taken or last renewed
        self.writer = BackgroundWriter(store, self._encode) if self.write_through and async_writes else None
        self._writing: dict[str, int] = {}  # session id -> background writes not landed yet
        self.write_lag_seconds = 0.0  # how long the last background write took to land after its turn
        self.hmac_key = hmac_key
        self._reserved = reserved_slots or (lambda: 0)
        self.counters = SessionCounters()
        self._sessions: dict[str, Session] = {}
        self._resident: dict[str, Session] = {}  # location "gpu"
        self._host: dict[str, Session] = {}  # location "host" with host_state set (new sessions hold nothing)
        self._host_bytes: dict[str, int] = {}  # each `_host` session's host_state bytes, counted once on arrival
        self._disk: dict[str, Session] = {}  # location "disk"
        self._ephemeral = 0  # how many registered sessions are ephemeral
        self._tick = 0
        self._initial: dict[str, torch.Tensor] | None = None

    @property
    def snapshot_dir(self) -> Path | None:
        """The directory sessions are written to, when the store is one."""
        return self.store.path if isinstance(self.store, DirectoryStore) else None

    # -- registry -----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Sessions held, ephemeral ones excluded."""
        return len(self._sessions) - self._ephemeral

    @property
    def max_sessions(self) -> int | None:
        """The most sessions this manager can hold (None: bounded only by the snapshot directory's disk)."""
        return None if self.store is not None else self.pool.capacity + self.max_host_sessions

    def counts(self) -> dict[str, int]:
        """Sessions by location (new, never-used sessions count as "host"; ephemeral ones are not counted)."""
        disk, gpu = len(self._disk), len(self._resident) - self._ephemeral_resident()
        return {"gpu": gpu, "host": len(self) - gpu - disk, "disk": disk}

    def resident_tokens(self) -> list[int]:
        """Tokens consumed by each session that holds a pool slot (a snapshot of the list: safe from any thread)."""
        return [s.num_tokens for s in list(self._resident.values())]

    def host_bytes(self) -> int:
        """Host memory held by sessions' state copies."""
        return sum(self._host_bytes.values())

    def create(self, owner: str | None, ephemeral: bool = False) -> Session:
        """A new session in the initial state. It takes no slot or memory until its first `acquire_slot`.

        Raises SessionLimitError when the manager could not keep it (only without a snapshot directory);
        `ephemeral` sessions (see Session) are exempt, as they only ever hold a slot for their running request.
        """
        if not ephemeral:
            self._check_room()
        session = Session(session_id=self._new_id(), owner=owner, ephemeral=ephemeral)
        if self.write_through and not ephemeral:  # stored at once, so every replica finds it
            self._store(session, self._initial_state())
        self._sessions[session.session_id] = session
        self._ephemeral += ephemeral
        self._touch(session)
        return session

    def get(self, session_id: str, owner: str | None) -> Session:
        """The session `session_id` of `owner`; SessionNotFound for other owners too, so ids do not leak.

        With a shared store the stored copy wins when it is newer than this replica's (another replica ran a turn
        since), and sessions this replica never saw are found there.
        """
        if self.store is not None and self.store.shared and SESSION_ID.fullmatch(session_id):
            self._sync_from_store(session_id)
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner or session.ephemeral:
            raise SessionNotFound(f"session {session_id!r} not found")
        return session

    def owned(self, owner: str | None) -> list[Session]:
        """Every session of `owner` this replica knows (resident, in host memory, or found in the store)."""
        return [s for s in self._sessions.values() if s.owner == owner and not s.ephemeral]

    # -- slots --------------------------------------------------------------------------------------------------
    def acquire_slot(self, session: Session) -> int:
        """Make `session` resident in a pool slot and mark it busy; returns the slot (idempotent while resident).

        Takes a free slot (leaving `reserved_slots()` free), else evicts the least recently used idle resident
        session to host memory. Reloads the state from host memory or its snapshot file (removed once loaded).
        Raises PoolExhausted, SnapshotError (its file is corrupt or no longer fits) or OSError (its
        file cannot be read); in every case nothing is lost and the session stays where it was.
        """
        self._check_registered(session)
        if session.slot is None:
            source = session.location
            # Read the file first: a corrupt one fails here, before another session was moved for it.
            state = self._read(session).tensors if source == "disk" else session.host_state
            slot = self._take_slot(frees_host=session.session_id in self._host)
            if state is not None:
                try:
                    self.pool.import_(slot, state)
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
            self._place_gpu(session, slot)
            self._spill_over()
        session.busy = True
        self._touch(session)
        return session.slot

    def release(self, session: Session) -> None:
        """The request using `session` is done: it stays resident (evictable, least recently used first)."""
        self._check_registered(session)
        session.busy = False
        self._touch(session)

    def reset(self, session: Session) -> None:
        """Return `session` to the initial state (its tokens are not a prefix of the new prompt): counted, and said
        in the turn's response (`session.reset`)."""
        self._check_registered(session)
        self.counters.resets += 1
        if session.slot is not None:
            self.pool.reset(session.slot)
        elif session.location != "host" or session.host_state is not None:
            self._drop_stored(session)
            self._detach(session)
            self._place_host(session, None)
        session.reset()

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def fork(self, session: Session, owner: str | None) -> Session:
        """A new session of `owner` with a copy of `session`'s state and tokens (two independent branches).

        A resident source is copied slot to slot when a slot is free; otherwise the copy lives in host memory.
        """
        self._check_registered(session)
        self._check_room()
        child = Session(self._new_id(), owner, num_tokens=session.num_tokens, token_hash=session.token_hash)
        if session.slot is not None and self.pool.free_slots > self._reserved():
            slot = self.pool.alloc()
            self.pool.copy(session.slot, slot)
            self._sessions[child.session_id] = child
            self._place_gpu(child, slot)
        else:
            self._admit(child, self._state_copy(session))
        self._touch(child)
        return child

    def delete(self, session: Session) -> None:
        """Forget `session` and free its slot, host memory or file.

        Busy sessions are deleted too (a request deletes its ephemeral ones): the caller refuses to delete a
        session a running request uses.
        """
        self._check_registered(session)
        if session.slot is not None:
            self.pool.free(session.slot)
        self._drop_stored(session)
        if self.write_through and not session.ephemeral:
            self.store.delete(session.session_id)
        self._detach(session)
        del self._sessions[session.session_id]
        self._ephemeral -= session.ephemeral

    def export(self, session: Session) -> bytes:
        """The session as snapshot bytes (signed when the manager has a key), wherever its state lives.

        The owner is left out: whoever restores the snapshot owns the restored session.
        """
        self._check_registered(session)
        snap = self._snapshot(session, self._state_copy(session) or self._initial_state())
        snap.owner = None
        return encode_snapshot(snap, self.hmac_key)

    def restore(self, data: bytes, owner: str | None) -> Session:
        """A new session of `owner` from snapshot bytes, after every check (SnapshotError with a `code`).

        Nothing is registered or allocated unless the snapshot is valid and fits this server's pool.
        """
        snap = decode_snapshot(data, self.fingerprint, self.hmac_key)
        self.check_state(snap.tensors)
        self._check_room()
        session = Session(self._new_id(), owner, num_tokens=snap.num_tokens, token_hash=snap.token_hash)
        self._admit(session, snap.tensors)
        self._touch(session)
        return session

    def check_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise SnapshotError("state_mismatch") unless `tensors` import into this pool (checked without a slot)."""
        try:
            self.pool.check(tensors)
        except SnapshotMismatchError as e:
            raise SnapshotError(f"snapshot state does not fit this server's model: {e}", "state_mismatch") from None

    # -- persistence --------------------------------------------------------------------------------------------
    def persist_all(self) -> int:
        """Write every idle session to the snapshot directory (graceful shutdown); returns how many were written.

        Written sessions become location "disk" and give back their slot or host memory. A busy session's state
        is mid-request, so it is skipped with a warning: stop the engine (releasing sessions) first. Without a
        snapshot directory there is nowhere to write: returns 0, warning how many sessions end with the process.
        """
        if self.store is None:
            if len(self):
                log.warning("%d sessions are not persisted: no snapshot directory is configured", len(self))
            return 0
        if self.writer is not None:  # the turns' own writes land first
            self.writer.flush()
            self.poll_writes()
        written = 0
        for session in list(self._sessions.values()):
            if session.location == "disk" or session.ephemeral:
                continue
            if session.busy:
                log.warning("session %s is busy: not persisted", session.session_id)
                continue
            self._write(session, self._state_copy(session) or self._initial_state())
            if session.slot is not None:
                self.pool.free(session.slot)
            self._detach(session)
            self._place_disk(session)
            written += 1
        return written

    def load_index(self) -> int:
        """Register the sessions found in the snapshot directory (start-up), reading only their metadata.

        Files that are corrupt, of another model, unsigned when a key is set, or named unlike a session are
        skipped with a warning and left in place. Returns how many sessions were registered (0 without a
        snapshot directory).
        """
        if self.store is None:
            return 0
        found = 0
        for session_id in self.store.ids():
            if not SESSION_ID.fullmatch(session_id) or session_id in self._sessions:
                continue
            try:
                meta = self.store.meta(session_id)
            except (SnapshotError, OSError) as e:
                log.warning("skipping stored session %s: %s", session_id, e)
                continue
            if meta is not None:
                self._register_stored(meta)
                found += 1
        return found

    def begin_turn(self, session: Session) -> bool:
        """Claim `session` for a turn across replicas (the store's lease); False when another replica runs one.
        The claim is renewed while the turn runs (`renew_leases`)."""
        if self.store is None:
            return True
        if not self.store.acquire_lease(session.session_id, self.lease_holder):
            return False
        self._leases[session.session_id] = time.monotonic()
        return True

    def end_turn(self, session: Session) -> None:
        """Give the turn's claim back (a failure only delays the next turn until the lease expires); with
        background writes, once the turn's write has landed (`poll_writes`)."""
        if self.store is not None and not session.ephemeral and not self._writing.get(session.session_id):
            self._leases.pop(session.session_id, None)
            try:
                self.store.release_lease(session.session_id, self.lease_holder)
            except SessionStoreError as e:
                log.warning("could not release the lease of session %s: %s", session.session_id, e)

    def renew_leases(self) -> None:
        """Renew the claims of the turns that run (and of writes still landing) once a third of a lease has passed
        since the last renewal: a claim lasts as long as its turn, however long, while a crashed holder's lapses
        within one lease. Called often (every engine step); does nothing in between."""
        period = self.store.lease_seconds / 3 if self.store is not None and self.store.lease_seconds else None
        if period is None or not self._leases:
            return
        now = time.monotonic()
        for session_id, renewed in list(self._leases.items()):
            if now - renewed < period:
                continue
            try:
                held = self.store.renew_lease(session_id, self.lease_holder)
            except SessionStoreError as e:  # tried again at the next call; the claim lapses if the store stays away
                log.warning("could not renew the lease of session %s: %s", session_id, e)
                continue
            if held:
                self._leases[session_id] = now
            else:
                self._leases.pop(session_id)
                log.error("the lease of session %s lapsed while its turn ran (the store was unreachable too long)",
                          session_id)  # fmt: skip

    def persist_turn(self, session: Session) -> None:
        """Write-through: store the session's state now (a turn on it just finished). Raises SessionStoreError
        when the store fails; the state stays where it is."""
        if self.write_through and not session.ephemeral:
            self._store(session, self._state_copy(session) or self._initial_state())

    def _store(self, session: Session, tensors: dict[str, torch.Tensor]) -> None:
        """Write `tensors` as the session's stored state: now, or through the background writer."""
        if self.writer is None:
            self._write(session, tensors)
            self.counters.stored_turns += 1
            return
        self.poll_writes()
        self._writing[session.session_id] = self._writing.get(session.session_id, 0) + 1
        self.writer.submit(self._stored_meta(session), self._snapshot(session, tensors))

    def poll_writes(self) -> None:
        """Apply the background writes that landed: versions, counters, the leases they were holding."""
        if self.writer is None:
            return
        for done in self.writer.done():
            left = self._writing.get(done.session_id, 1) - 1
            if left:
                self._writing[done.session_id] = left
            else:
                self._writing.pop(done.session_id, None)
            self.write_lag_seconds = done.lag_seconds
            session = self._sessions.get(done.session_id)
            if done.error is not None:
                self.counters.failed_writes += 1
                log.error("could not store session %s: %s", done.session_id, done.error)
            else:
                self.counters.stored_turns += 1
                if session is not None:
                    session.store_version = max(session.store_version, done.version)
            if session is not None and not left and not session.busy:
                self.end_turn(session)

    def _encode(self, snap: Snapshot) -> bytes:
        return encode_snapshot(snap, self.hmac_key)

    def _register_stored(self, meta: StoredSession) -> Session:
        session = Session(meta.session_id, meta.owner, num_tokens=meta.num_tokens, token_hash=meta.token_hash,
                          created=meta.created)  # fmt: skip
        session.store_version = meta.version
        self._sessions[meta.session_id] = session
        self._place_disk(session)
        self._touch(session)
        return session

    def _sync_from_store(self, session_id: str) -> None:
        """Make the registry agree with a shared store for one session (its copy here may be stale or gone)."""
        meta = self.store.meta(session_id)
        local = self._sessions.get(session_id)
        if local is not None and (local.busy or local.ephemeral or self._writing.get(session_id)):
            return  # a turn runs here now, or its write is on its way: this replica's copy is the newest
        if meta is None:
            if local is not None and local.store_version:  # stored once, gone now: deleted elsewhere or expired
                self.delete(local)
            return
        if local is not None and local.store_version == meta.version:
            return
        if local is not None:  # another replica ran a turn since: drop the stale copy, load the stored one
            if local.slot is not None:
                self.pool.free(local.slot)
            local.host_state = None
            self._detach(local)
            del self._sessions[session_id]
        self._register_stored(meta)

    # -- tier moves ---------------------------------------------------------------------------------------------
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
        if self.store is None and len(self._host) + (0 if frees_host else 1) > self.max_host_sessions:
            raise PoolExhausted(
                f"no slot free and host memory already holds max_host_sessions={self.max_host_sessions} sessions, "
                "with no snapshot directory to spill to; retry later, delete idle sessions, or configure one"
            )
        victim = min(idle, key=lambda s: s.lru_tick)
        state = self.pool.export(victim.slot)
        self.pool.free(victim.slot)
        self._detach(victim)
        self._place_host(victim, state)
        self.counters.evictions += 1
        return self.pool.alloc()

    def _spill_over(self) -> None:
        """Write LRU host copies to the snapshot directory until at most `max_host_sessions` remain."""
        if self.store is None:
            return
        while len(self._host) > self.max_host_sessions:
            # Sessions reserved by waiting requests go last: they are about to be loaded again.
            victim = min(self._host.values(), key=lambda s: (s.busy, s.lru_tick))
            try:
                self._write(victim, victim.host_state)
            except (OSError, SessionStoreError) as e:
                # Keep it in memory (over the cap) rather than lose it; the next spill tries again.
                log.error("could not write session %s to the session store: %s", victim.session_id, e)
                return
            self._detach(victim)
            self._place_disk(victim)
            self.counters.spills += 1

    def _admit(self, session: Session, state: dict[str, torch.Tensor] | None) -> None:
        """Register a new session holding `state` (None: initial) in host memory, or in a free slot when host
        memory is full and nothing can spill. Raises PoolExhausted before registering when neither fits."""
        host_full = self.store is None and len(self._host) >= self.max_host_sessions
        if state is not None and host_full:
            if self.pool.free_slots <= self._reserved():
                raise PoolExhausted(
                    f"host memory holds max_host_sessions={self.max_host_sessions} sessions, no slot is free and "
                    "there is no snapshot directory; retry later or delete idle sessions"
                )
            slot = self.pool.alloc()
            try:
                self.pool.import_(slot, state)
            except Exception:
                self.pool.free(slot)
                raise
            self._sessions[session.session_id] = session
            self._place_gpu(session, slot)
            return
        self._sessions[session.session_id] = session
        self._touch(session)
        self._place_host(session, state)
        self._spill_over()

    def _place_gpu(self, session: Session, slot: int) -> None:
        session.location, session.slot, session.host_state = "gpu", slot, None
        self._resident[session.session_id] = session

    def _place_host(self, session: Session, state: dict[str, torch.Tensor] | None) -> None:
        session.location, session.slot, session.host_state = "host", None, state
        if state is not None:
            self._host[session.session_id] = session
            self._host_bytes[session.session_id] = sum(t.numel() * t.element_size() for t in state.values())

    def _place_disk(self, session: Session) -> None:
        session.location, session.slot, session.host_state = "disk", None, None
        self._disk[session.session_id] = session

    def _detach(self, session: Session) -> None:
        """Remove `session` from the tier indexes (its slot, memory or file are handled by the caller)."""
        for tier in (self._resident, self._host, self._disk, self._host_bytes):
            tier.pop(session.session_id, None)

    def _drop_stored(self, session: Session) -> None:
        session.host_state = None
        if session.location == "disk" and not self.write_through:  # then a stored copy exists only while "disk"
            self.store.delete(session.session_id)

    # -- state copies and files ---------------------------------------------------------------------------------
    def _state_copy(self, session: Session) -> dict[str, torch.Tensor] | None:
        """An independent CPU copy of the session's state, or None for the initial state."""
        if session.slot is not None:
            return self.pool.export(session.slot)
        if session.location == "disk":
            return self._read(session).tensors
        if session.host_state is not None:
            return {k: v.clone() for k, v in session.host_state.items()}
        return None

    def _initial_state(self) -> dict[str, torch.Tensor]:
        """A new session's state (not always zeros), from a one-slot pool so no shared slot is needed."""
        if self._initial is None:
            self._initial = StatePool(self.pool.model, 1, self.pool.max_context).export(0)
        return {k: v.clone() for k, v in self._initial.items()}

    def _snapshot(self, session: Session, tensors: dict[str, torch.Tensor]) -> Snapshot:
        return Snapshot(
            tensors=tensors,
            fingerprint=self.fingerprint,
            num_tokens=session.num_tokens,
            token_hash=session.token_hash,
            session_id=session.session_id,
            session_created=session.created,
            owner=session.owner,
        )

    def _write(self, session: Session, tensors: dict[str, torch.Tensor]) -> None:
        data = encode_snapshot(self._snapshot(session, tensors), self.hmac_key)
        session.store_version = self.store.write(self._stored_meta(session), data).version

    def _stored_meta(self, session: Session) -> StoredSession:
        return StoredSession(session.session_id, session.owner, session.num_tokens, session.token_hash,
                             session.created, session.store_version)  # fmt: skip

    def _read(self, session: Session) -> Snapshot:
        data = self.store.read(session.session_id)
        if data is None:
            raise SessionNotFound(f"session {session.session_id!r} is no longer in the session store (expired?)")
        snap = decode_snapshot(data, self.fingerprint, self.hmac_key)
        if snap.session_id != session.session_id:
            raise SnapshotError(f"stored snapshot of session {session.session_id} holds session {snap.session_id}")
        self.check_state(snap.tensors)
        return snap

    # -- helpers ------------------------------------------------------------------------------------------------
    def _check_room(self) -> None:
        limit = self.max_sessions
        if limit is not None and len(self) >= limit:
            raise SessionLimitError(
                f"session limit reached: {limit} sessions ({self.pool.capacity} state slots plus "
                f"max_host_sessions={self.max_host_sessions}) and no snapshot directory to keep more; "
                "delete sessions no longer needed, or start the server with a snapshot directory"
            )

    def _ephemeral_resident(self) -> int:
        return sum(s.ephemeral for s in self._resident.values()) if self._ephemeral else 0

    def _check_registered(self, session: Session) -> None:
        if self._sessions.get(session.session_id) is not session:
            raise SessionNotFound(f"session {session.session_id!r} not found")

    def _new_id(self) -> str:
        while True:
            session_id = "sess_" + secrets.token_hex(12)
            if session_id not in self._sessions:
                return session_id

    def _touch(self, session: Session) -> None:
        self._tick += 1
        session.lru_tick = self._tick
        session.last_used = time.monotonic()
