"""TurnLeases: a session's turn claimed across replicas through the store's leases, for as long as the turn runs.

Replicas sharing a store (Redis) must never run two turns on one session at once. A turn takes the session's lease
in the store (`begin`), renews it while it runs (`renew`, a third of a lease at a time, between engine steps) and
gives it back when its state is stored (`end`). A crashed replica's claim lapses within one lease.

A claim that could not be given back (the store did not answer) is given back by the next `renew` that reaches the
store, and a claim this replica still holds is its own to take again at once: a store outage never leaves a replica
locked out of its own session until the lease lapses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvfree.engine.protocol import SessionStoreError
from kvfree.engine.sessions.session import Session
from kvfree.engine.sessions.store import SessionStore, new_holder

log = logging.getLogger(__name__)


class TurnLeases:
    """The claims this replica holds on sessions' turns.

    Args:
        store: the session store (None: one process, nothing to claim).
        writing: `writing(session_id)`, whether a background write of the session has not landed yet: the claim is
            kept until it has, so that no other replica reads an older state.
    """

    def __init__(self, store: SessionStore | None, writing: Callable[[str], bool]) -> None:
        self.store = store
        self._writing = writing
        self.holder = new_holder()
        self._leases: dict[str, float] = {}  # session id -> time.monotonic() its lease was taken or last renewed
        self._unreleased: set[str] = set()  # claims `end` could not give back (the store did not answer)

    def begin(self, session: Session) -> bool:
        """Claim `session` for a turn across replicas (the store's lease); False when another replica runs one.
        A claim this replica still holds (one it could not give back) is taken again. The claim is renewed while the
        turn runs (`renew`)."""
        if self.store is None:
            return True
        sid = session.session_id
        # (Renewing succeeds only for this holder's own lease: compare and extend in one step.)
        if not self.store.acquire_lease(sid, self.holder) and not self.store.renew_lease(sid, self.holder):
            return False
        self._unreleased.discard(sid)
        self._leases[sid] = time.monotonic()
        return True

    def end(self, session: Session) -> None:
        """Give the turn's claim back; with background writes, once the turn's write has landed
        (`SessionManager.poll_writes`). When the store does not answer, the next `renew` that reaches it does."""
        if self.store is not None and not session.ephemeral and not self._writing(session.session_id):
            self._leases.pop(session.session_id, None)
            self._release(session.session_id)

    def _release(self, session_id: str) -> None:
        try:
            self.store.release_lease(session_id, self.holder)
        except SessionStoreError as e:
            if session_id not in self._unreleased:
                log.warning("could not release the lease of session %s (given back once the store answers): %s",
                            session_id, e)  # fmt: skip
            self._unreleased.add(session_id)
        else:
            self._unreleased.discard(session_id)

    def renew(self) -> None:
        """Renew the claims of the turns that run (and of writes still landing) once a third of a lease has passed
        since the last renewal: a claim lasts as long as its turn, however long, while a crashed holder's lapses
        within one lease; and give back the claims `end` could not. Called often (every engine step); does nothing
        in between."""
        for session_id in list(self._unreleased):
            self._release(session_id)
            if session_id in self._unreleased:
                break  # the store is still away: tried again at the next call
        period = self.store.lease_seconds / 3 if self.store is not None and self.store.lease_seconds else None
        if period is None or not self._leases:
            return
        now = time.monotonic()
        for session_id, renewed in list(self._leases.items()):
            if now - renewed < period:
                continue
            try:
                held = self.store.renew_lease(session_id, self.holder)
            except SessionStoreError as e:  # tried again at the next call; the claim lapses if the store stays away
                log.warning("could not renew the lease of session %s: %s", session_id, e)
                continue
            if held:
                self._leases[session_id] = now
            else:
                self._leases.pop(session_id)
                log.error("the lease of session %s lapsed while its turn ran (the store was unreachable too long)",
                          session_id)  # fmt: skip
