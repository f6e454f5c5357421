"""Session: one conversation's state on the server, as the registry and the tiers see it."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from kvfree.engine.state.packed import PackedState
from kvfree.engine.state.pool import StagedState
from kvfree.engine.state.snapshot import Snapshot, token_hash

Location = Literal["gpu", "host", "disk"]



@dataclass(eq=False)  # an entity: compared by identity (its fields hold tensors)
class Session:
    """One conversation's state and where it lives.

    location: "gpu" (in pool `slot`), "host" (`host_state`, packed in host memory, or None for a new session's
        initial state, which costs nothing until first use) or "disk" (in the session store: a file, or Redis).
    num_tokens / token_hash: the tokens consumed so far (`engine.snapshot.token_hash` of them), so a new prompt
        can be checked to extend them without storing them.
    created: time.time() at creation. last_used: time.monotonic() of the last use.
    busy: a request holds the session, from when it is queued until it ends; it is never evicted while busy. Set
        and cleared only by `SessionManager.reserve` and `SessionManager.release`.
    ephemeral: a slot holder for a request without a session (e.g. the extra choices of n > 1): never evicted,
        persisted or counted, invisible to `get`, and deleted by its request when it ends (or kept as a checkpoint).
    checkpoint: an anonymous checkpoint of the prefix cache (engine/sessions/prefix_cache.py), not a session: not in
        the registry, evicted first, never stored, dropped when the cache's budget is spent.
    fetch: the read of its stored copy on the I/O thread, while one runs (`SessionTiers.prefetch`).
    spill: the write of its host copy to the store on the I/O thread, while one runs (it stays in host memory until
        the write has landed).
    staged: its host copy already copied to the device for its queued request (`SessionTiers.prefetch`).
    """

    session_id: str
    owner: str | None
    num_tokens: int = 0
    token_hash: int = 0
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    location: Location = "host"
    slot: int | None = None
    host_state: PackedState | None = None
    busy: bool = False
    ephemeral: bool = False
    checkpoint: bool = False
    delete_when_released: bool = False  # deleted as soon as the request using it ends (`ThreadDriver.discard_session`)
    # LRU order set by the tiers: a counter, because monotonic clocks can tie on coarse platforms.
    lru_tick: int = field(default=0, repr=False)
    store_version: int = field(default=0, repr=False)  # the store's version this copy matches (0: none)
    fetch: Future[Snapshot] | None = field(default=None, repr=False)
    spill: Future[int] | None = field(default=None, repr=False)  # its host copy's write to the store, in flight
    staged: StagedState | None = field(default=None, repr=False)  # its host copy on the device ahead of admission

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
