"""PrefixCache: anonymous checkpoints of conversations' states, found again by the longest prefix of a new prompt.

Agent frameworks call the chat API statelessly and re-send the whole conversation every turn. So that they get the
reuse a session gives without changing a line, every request leaves checkpoints behind: its state at the end of
its prompt, at the message boundaries the front marks inside it (the end of the system prompt, of the last earlier
turn), and at the end of its output. The next request of the same owner resumes from the longest checkpoint whose
tokens begin its prompt: the state is copied into the request's slot and only the rest is prefilled.

A checkpoint is a `Session` flagged `checkpoint`, living in the tiers like any session (docs/design/architecture.md
§6): in a pool slot while one is free, evicted to host memory ahead of every session when a slot is needed, kept
there within the cache's byte budget (least recently used dropped first), never written to the store. It holds
the whole state, a hybrid's KV cache included, so resuming from one is exact for every layer kind. Checkpoints are
scoped by owner (an API key) like sessions: one tenant's prefix is never served to another.

The index keeps each checkpoint's tokens (a compact array), so a hit is checked token for token: a hash collision
cannot hand a request another conversation's state.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvfree.engine.sessions.session import Session
from kvfree.engine.sessions.tiers import SessionTiers
from kvfree.engine.state.snapshot import token_hash


@dataclass
class PrefixCacheCounters:
    """What the cache did since start, for metrics: lookups and hits (requests), the prompt tokens they covered."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    added: int = 0
    dropped: int = 0  # for the byte budget, or a slot needed by a session


class PrefixCache:
    """The checkpoints of one engine, indexed by owner and token prefix (see the module docstring).

    Args:
        tiers: where the checkpoints' states live (shared with the sessions, whose moves they yield to).
        host_budget_bytes: host memory the checkpoints evicted from the pool may hold; beyond it the least recently
            used are dropped (0: checkpoints live only in free pool slots).

    Not thread-safe: every call happens on the engine thread.
    """

    def __init__(self, tiers: SessionTiers, host_budget_bytes: int) -> None:
        self.tiers = tiers
        self.host_budget_bytes = host_budget_bytes
        self.counters = PrefixCacheCounters()
        self._held: dict[str, Session] = {}
        self._tokens: dict[str, array] = {}  # session id -> its tokens (int32: 4 bytes a token)
        self._by_prefix: dict[tuple[str | None, int, int], Session] = {}  # (owner, length, hash) -> checkpoint
        self._lengths: dict[str | None, dict[int, int]] = {}  # owner -> checkpoint length -> how many
        self._ids = itertools.count()
        tiers.keep_evicted_checkpoint = self._keep_on_host

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._held

    def held_bytes(self) -> dict[str, int]:
        """The checkpoints' state bytes by where they are ("gpu": pool slots, "host": host memory)."""
        out = {"gpu": 0, "host": 0}
        for s in list(self._held.values()):  # (a copy: the metrics read it from another thread)
            if s.slot is not None:
                out["gpu"] += self.tiers.pool.bytes_per_session(s.num_tokens)
            elif s.host_state is not None:
                out["host"] += s.host_state.nbytes
        return out

    # -- finding one --------------------------------------------------------------------------------------------
    def lookup(self, owner: str | None, prompt: Sequence[int], limit: int) -> Session | None:
        """The checkpoint of `owner` holding the longest prefix of `prompt` of at most `limit` tokens (None: none).

        Hashes the prompt once, at the lengths the owner's checkpoints have, then checks the candidates' tokens
        from the longest down. Counted as a lookup, and a hit with the tokens it covers."""
        self.counters.lookups += 1
        lengths = sorted(n for n in self._lengths.get(owner, {}) if n <= min(limit, len(prompt)))
        candidates: list[Session] = []
        h, at = 0, 0
        for n in lengths:
            h, at = token_hash(prompt[at:n], start=h), n
            found = self._by_prefix.get((owner, n, h))
            if found is not None and not found.busy:  # (busy: its state is still being written)
                candidates.append(found)
        for found in reversed(candidates):
            if self._tokens[found.session_id] == array("i", prompt[: found.num_tokens]):
                self.counters.hits += 1
                self.counters.hit_tokens += found.num_tokens
                self.tiers.touch(found)
                return found
        return None

    # -- keeping one --------------------------------------------------------------------------------------------
    def new_slot(self, owner: str | None, tokens: Sequence[int], leave_free: int) -> Session | None:
        """A checkpoint of `tokens` for `owner` holding a pool slot, registered now, whose state the caller's step
        writes (a fork from the request's slot after its prefill): a free slot while more than `leave_free` are,
        else an older checkpoint's (`SessionTiers.place_checkpoint`; no session is ever moved for one). None when
        there is neither, or when that prefix is held already."""
        key = (owner, len(tokens), token_hash(list(tokens)))
        if self._same(key, tokens) is not None:
            return None
        session = Session(f"ckpt_{next(self._ids)}", owner, checkpoint=True)
        if self.tiers.place_checkpoint(session, leave_free) is None:
            return None
        self._register(session, key, tokens)
        return session

    def adopt(self, session: Session, owner: str | None, tokens: Sequence[int]) -> None:
        """Keep `session`'s state (a finished request's slot holder, already out of the session registry) as the
        checkpoint of `tokens`; when that prefix is held already, its slot is freed instead."""
        key = (owner, len(tokens), token_hash(list(tokens)))
        session.owner, session.ephemeral, session.checkpoint, session.busy = owner, False, True, False
        if self._same(key, tokens) is not None:
            self.tiers.remove(session)
            return
        self._register(session, key, tokens)
        self.tiers.touch(session)

    def _same(self, key: tuple[str | None, int, int], tokens: Sequence[int]) -> Session | None:
        found = self._by_prefix.get(key)
        if found is not None and self._tokens[found.session_id] == array("i", tokens):
            self.tiers.touch(found)  # the prefix is in use again
            return found
        return None

    def _register(self, session: Session, key: tuple[str | None, int, int], tokens: Sequence[int]) -> None:
        session.num_tokens, session.token_hash = key[1], key[2]
        self._held[session.session_id] = session
        self._tokens[session.session_id] = array("i", tokens)
        self._by_prefix[key] = session
        lengths = self._lengths.setdefault(key[0], {})
        lengths[key[1]] = lengths.get(key[1], 0) + 1
        self.counters.added += 1

    # -- letting one go -----------------------------------------------------------------------------------------
    def drop(self, session: Session) -> None:
        """Forget a checkpoint and free what it holds."""
        self._forget(session)
        self.tiers.remove(session)

    def clear(self) -> None:
        """Drop every checkpoint (shutdown, or the cache switched off)."""
        for session in list(self._held.values()):
            self.drop(session)

    def _forget(self, session: Session) -> None:
        del self._held[session.session_id]
        del self._tokens[session.session_id]
        key = (session.owner, session.num_tokens, session.token_hash)
        if self._by_prefix.get(key) is session:
            del self._by_prefix[key]
        lengths = self._lengths[session.owner]
        lengths[session.num_tokens] -= 1
        if not lengths[session.num_tokens]:
            del lengths[session.num_tokens]
        self.counters.dropped += 1

    def _keep_on_host(self, session: Session, nbytes: int) -> bool:
        """The tiers' question when a checkpoint must leave its slot: whether its `nbytes` go to host memory (older
        host checkpoints dropped to make room), or it is dropped (forgotten here; the tiers free its slot)."""
        if nbytes > self.host_budget_bytes:
            self._forget(session)
            return False
        on_host = sorted((s for s in self._held.values() if s.host_state is not None), key=lambda s: s.lru_tick)
        held = sum(s.host_state.nbytes for s in on_host)
        for old in on_host:
            if held + nbytes <= self.host_budget_bytes:
                break
            held -= old.host_state.nbytes
            self.drop(old)
        return True
