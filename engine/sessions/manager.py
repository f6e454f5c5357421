"""SessionManager: the registry of sessions: create, find, fork, delete, snapshot and restore them, for their owners.

A session is a conversation's state on the server (docs/design/architecture.md §6). The registry knows every session
and who owns it, and which request holds it (`busy`, set and cleared here only: `reserve`, `release`); where its state
lives and how it moves between a GPU slot, host memory and the session store is the tiers' business
(engine/sessions/tiers.py), which the registry drives. None is ever dropped to make room: when nothing can move, the
call raises (`PoolExhausted`, `SessionLimitError`) and changes nothing.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable
from pathlib import Path

import torch

from kvfree.engine.protocol import PoolExhausted, SessionBusy, SessionLimitError, SessionNotFound, SnapshotError
from kvfree.engine.sessions.leases import TurnLeases
from kvfree.engine.sessions.session import Session
from kvfree.engine.sessions.store import DirectoryStore, SessionStore, StoredSession
from kvfree.engine.sessions.tiers import SessionCounters, SessionTiers, check_state
from kvfree.engine.state.packed import PackedState
from kvfree.engine.state.pool import StatePool
from kvfree.engine.state.snapshot import Snapshot, decode_snapshot, encode_snapshot

__all__ = [
    "PoolExhausted", "Session", "SessionBusy", "SessionLimitError", "SessionManager", "SessionNotFound",
]  # fmt: skip

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"sess_[0-9a-f]{24}")


class SessionManager:
    """Owns every session; places and moves their state through `tiers` (a `SessionTiers`).

    Args:
        pool: the state pool; the manager shares it with sessionless requests and only frees slots it took.
        fingerprint: `model_fingerprint` of the served model (snapshots of other models are refused).
        max_host_sessions: most sessions holding state in host memory. With a store, more are written to it (LRU
            first). Without one, host memory is the last tier and this is a hard cap: the server then holds at most
            `pool.capacity + max_host_sessions` sessions and refuses new ones beyond that (`SessionLimitError`)
            rather than ever drop one.
        snapshot_dir: a shorthand for `store=DirectoryStore(snapshot_dir, ...)` (one `{session_id}.safetensors` each).
        store: where sessions spill and persist beyond the process (engine/sessions/store.py); a shared store
            (Redis) is also where other replicas find them, so `get` checks it for newer versions.
        write_through: after every turn on a session, store its state (`SessionTiers.persist_turn`), so that a crash
            loses no completed turn; a directory store then fsyncs each file before it replaces the previous one.
        async_writes: store those turns from a background thread instead of on the engine's step.
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
        if store is None and snapshot_dir is not None:
            store = DirectoryStore(snapshot_dir, fingerprint, hmac_key, fsync=write_through)
        self.pool = pool
        self.fingerprint = fingerprint
        self.hmac_key = hmac_key
        self.store = store
        self.tiers = SessionTiers(
            pool, fingerprint, max_host_sessions, store, write_through, async_writes, hmac_key, reserved_slots
        )
        self.leases = TurnLeases(store, self.tiers.writing)
        self._sessions: dict[str, Session] = {}
        self._ephemeral = 0  # how many registered sessions are ephemeral

    @property
    def snapshot_dir(self) -> Path | None:
        """The directory sessions are written to, when the store is one."""
        return self.store.path if isinstance(self.store, DirectoryStore) else None

    @property
    def counters(self) -> SessionCounters:
        return self.tiers.counters

    @property
    def max_host_sessions(self) -> int:
        return self.tiers.max_host_sessions

    # -- what is registered -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Sessions held, ephemeral ones excluded."""
        return len(self._sessions) - self._ephemeral

    @property
    def max_sessions(self) -> int | None:
        """The most sessions this manager can hold (None: bounded only by the store)."""
        return None if self.store is not None else self.pool.capacity + self.max_host_sessions

    def counts(self) -> dict[str, int]:
        """Sessions by location (new, never-used sessions count as "host"; ephemeral ones are not counted)."""
        ephemeral = sum(s.ephemeral for s in self.tiers.resident()) if self._ephemeral else 0
        by_tier = self.tiers.counts(ephemeral)
        return {"gpu": by_tier["gpu"], "host": len(self) - by_tier["gpu"] - by_tier["disk"], "disk": by_tier["disk"]}

    def resident_tokens(self) -> list[int]:
        """Tokens consumed by each session that holds a pool slot, the prefix cache's checkpoints left out (safe
        from any thread)."""
        return [s.num_tokens for s in self.tiers.resident() if not s.checkpoint]

    def host_bytes(self) -> int:
        """Host memory held by sessions' state copies."""
        return self.tiers.host_bytes()

    def create(self, owner: str | None, ephemeral: bool = False) -> Session:
        """A new session in the initial state. It takes no slot or memory until its first `acquire_slot`.

        Raises SessionLimitError when the manager could not keep it (only without a store); `ephemeral` sessions
        (see Session) are exempt, as they only ever hold a slot for their running request.
        """
        if not ephemeral:
            self._check_room()
        session = Session(session_id=self._new_id(), owner=owner, ephemeral=ephemeral)
        if self.tiers.write_through and not ephemeral:  # stored at once, so every replica finds it
            self.tiers.write(session, self.tiers.initial_state())
        self._sessions[session.session_id] = session
        self._ephemeral += ephemeral
        self.tiers.place(session, None)
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

    # -- who holds a session ------------------------------------------------------------------------------------
    def reserve(self, session: Session) -> None:
        """Hold `session` for a request from now on (queued: it is not evicted, and its stored copy, if that is
        where it lives, starts loading). SessionBusy when another request holds it."""
        self._check_registered(session)
        if session.busy:
            raise SessionBusy(f"session {session.session_id} is in use by another request")
        session.busy = True
        self.tiers.prefetch(session)

    def release(self, session: Session) -> None:
        """The request holding `session` is done: it stays where it is (evictable, least recently used first)."""
        session.busy = False
        if self._sessions.get(session.session_id) is session:  # (not when deleted while held: an ephemeral one)
            self.tiers.touch(session)

    def acquire_slot(self, session: Session) -> int:
        """Make `session` resident in a pool slot and hold it (as `reserve` does, if it was not yet); returns the slot.

        Raises what `SessionTiers.make_resident` raises (PoolExhausted, StateLoading, SnapshotError, ...): nothing is
        lost and the session stays where it was, held only if it was before.
        """
        self._check_registered(session)
        slot = self.tiers.make_resident(session)
        session.busy = True
        return slot

    def reset(self, session: Session) -> None:
        """Return `session` to the initial state (its tokens are not a prefix of the new prompt): counted, and said
        in the turn's response (`session.reset`)."""
        self._check_registered(session)
        self.tiers.reset_state(session)
        session.reset()

    def unregister(self, session: Session) -> None:
        """Forget an ephemeral session without freeing what it holds: its state is handed on (a finished request's
        slot kept as the prefix cache's checkpoint)."""
        self._check_registered(session)
        if not session.ephemeral:
            raise ValueError(f"{session.session_id} is not an ephemeral session")
        del self._sessions[session.session_id]
        self._ephemeral -= 1

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def fork(self, session: Session, owner: str | None) -> Session:
        """A new session of `owner` with a copy of `session`'s state and tokens (two independent branches).

        A resident source is copied slot to slot when a slot is free; otherwise the copy lives in host memory.
        """
        self._check_registered(session)
        self._check_room()
        child = Session(self._new_id(), owner, num_tokens=session.num_tokens, token_hash=session.token_hash)
        self.tiers.place_copy(session, child)
        self._sessions[child.session_id] = child
        return child

    def delete(self, session: Session) -> None:
        """Forget `session` and free its slot, host memory or stored copy.

        Busy sessions are deleted too (a request deletes its ephemeral ones): the caller refuses to delete a
        session a running request uses.
        """
        self._check_registered(session)
        self.tiers.remove(session)
        del self._sessions[session.session_id]
        self._ephemeral -= session.ephemeral

    def snapshot(self, session: Session) -> Snapshot:
        """The session as a `Snapshot`, wherever its state lives (its copy from the GPU may still run: encoding it
        waits). The owner is left out: whoever restores the snapshot owns the restored session."""
        self._check_registered(session)
        snap = self.tiers.snapshot(session, self.tiers.state_copy(session) or self.tiers.initial_state())
        snap.owner = None
        return snap

    def export(self, session: Session) -> bytes:
        """The session as snapshot file bytes (signed when the manager has a key)."""
        return encode_snapshot(self.snapshot(session), self.hmac_key)

    def restore(self, data: bytes | bytearray | memoryview | torch.Tensor, owner: str | None) -> Session:
        """A new session of `owner` from a snapshot file's bytes (a uint8 CPU tensor: used in place), after every
        check (SnapshotError with a `code`). Nothing is registered or allocated unless the snapshot is valid and fits
        this server's pool."""
        snap = decode_snapshot(data, self.fingerprint, self.hmac_key, check_finite=False)
        self.check_state(snap.state)
        self.tiers.check_finite(snap.state)
        self._check_room()
        session = Session(self._new_id(), owner, num_tokens=snap.num_tokens, token_hash=snap.token_hash)
        self.tiers.place(session, snap.state)
        self._sessions[session.session_id] = session
        return session

    def check_state(self, state: PackedState | dict[str, torch.Tensor]) -> None:
        """Raise SnapshotError("state_mismatch") unless `state` imports into this pool (checked without a slot)."""
        check_state(self.pool, state if isinstance(state, PackedState) else PackedState.pack(state))

    # -- persistence --------------------------------------------------------------------------------------------
    def poll_writes(self) -> None:
        """Apply the background writes that landed (`SessionTiers.poll_writes`), and give back the claims they held."""
        for session in self.tiers.poll_writes(self._sessions.get):
            self.leases.end(session)

    def persist_all(self) -> int:
        """Write every idle session to the store (graceful shutdown); returns how many were written.

        Written sessions become location "disk" and give back their slot or host memory. A busy session's state
        is mid-request, so it is skipped with a warning: stop the engine (releasing sessions) first. Without a
        store there is nowhere to write: returns 0, warning how many sessions end with the process.
        """
        if self.store is None:
            if len(self):
                log.warning("%d sessions are not persisted: no snapshot directory is configured", len(self))
            return 0
        for session in self.tiers.flush_writes(self._sessions.get):  # the turns' own writes land first
            self.leases.end(session)
        self.tiers.flush_spills()
        written = 0
        for session in list(self._sessions.values()):
            if session.location == "disk" or session.ephemeral:
                continue
            if session.busy:
                log.warning("session %s is busy: not persisted", session.session_id)
                continue
            self.tiers.persist(session)
            written += 1
        return written

    def load_index(self) -> int:
        """Register the sessions found in the store (start-up), reading only their metadata.

        Files that are corrupt, of another model, unsigned when a key is set, or named unlike a session are
        skipped with a warning and left in place. Returns how many sessions were registered (0 without a store).
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

    def _register_stored(self, meta: StoredSession) -> Session:
        session = Session(meta.session_id, meta.owner, num_tokens=meta.num_tokens, token_hash=meta.token_hash,
                          created=meta.created)  # fmt: skip
        self._sessions[meta.session_id] = session
        self.tiers.place_stored(session, meta.version)
        return session

    def _sync_from_store(self, session_id: str) -> None:
        """Make the registry agree with a shared store for one session (its copy here may be stale or gone)."""
        meta = self.store.meta(session_id)
        local = self._sessions.get(session_id)
        if local is not None and (local.busy or local.ephemeral or self.tiers.writing(session_id)):
            return  # a turn runs here now, or its write is on its way: this replica's copy is the newest
        if meta is None:
            if local is not None and local.store_version:  # stored once, gone now: deleted elsewhere or expired
                self.delete(local)
            return
        if local is not None and local.store_version == meta.version:
            return
        if local is not None:  # another replica ran a turn since: drop the stale copy, load the stored one
            self.tiers.forget_local(local)
            del self._sessions[session_id]
        self._register_stored(meta)

    # -- helpers ------------------------------------------------------------------------------------------------
    def _check_room(self) -> None:
        limit = self.max_sessions
        if limit is not None and len(self) >= limit:
            raise SessionLimitError(
                f"session limit reached: {limit} sessions ({self.pool.capacity} state slots plus "
                f"max_host_sessions={self.max_host_sessions}) and no snapshot directory to keep more; "
                "delete sessions no longer needed, or start the server with a snapshot directory"
            )

    def _check_registered(self, session: Session) -> None:
        if self._sessions.get(session.session_id) is not session:
            raise SessionNotFound(f"session {session.session_id!r} not found")

    def _new_id(self) -> str:
        while True:
            session_id = "sess_" + secrets.token_hex(12)
            if session_id not in self._sessions:
                return session_id
