"""What the engine tells its serving front, as plain records: its facts once (EngineInfo), a session's per operation.

The HTTP front (server/) validates requests, renders templates and shapes responses; it needs a few facts about the
engine (vocabulary, context limit, slots, state sizes) and about sessions, but none of the engine's objects. These
records carry only strings, numbers and paths, so that they can cross a process boundary as they are once the
engine runs in a process of its own. They import nothing of the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EngineInfo:
    """The facts of a served engine, fixed from start-up on.

    checkpoint: the checkpoint directory (its tokenizer files are what a front tokenizes with).
    layers: the model's mixer kind per layer (`config.layers`).
    vocab_size: token ids are in [0, vocab_size).
    max_context: tokens of context per session for layers with a KV cache (recurrent layers have no limit).
    state_bytes_per_token: how much a session's state grows per token of context (0: no KV cache).
    state_bytes_per_session: one session's state, a KV cache counted at `max_context`.
    gpu_slots: sessions decoding at once (state-pool slots); also the most choices (`n`) one request can have.
    host_sessions: idle sessions kept in host memory.
    max_sessions: sessions held in all (None: only the session store's disk bounds them).
    device, dtype: where the model runs and its weights' dtype (`"cuda:0"`, `"bfloat16"`).
    fingerprint: sha256 of the model's config and weights (engine/state/snapshot.py); snapshots carry it.
    """

    checkpoint: Path
    layers: tuple[str, ...]
    vocab_size: int
    max_context: int
    state_bytes_per_token: int
    state_bytes_per_session: int
    gpu_slots: int
    host_sessions: int
    max_sessions: int | None
    device: str
    dtype: str
    fingerprint: str

    @property
    def keeps_kv_cache(self) -> bool:
        """True when some layer keeps a KV cache, so that prompt plus output must fit `max_context`."""
        return self.state_bytes_per_token > 0

    @property
    def context_limit(self) -> int | None:
        """The tokens a session can hold: `max_context` with a KV cache, else None (no limit)."""
        return self.max_context if self.keeps_kv_cache else None


@dataclass(frozen=True)
class SessionRecord:
    """A session as its operations report it: a copy taken on the engine's thread, not the live session.

    created, last_used: unix times. location: where its state is now (`gpu`, `host` or `disk`).
    state_bytes: what its state holds (fixed for recurrent layers; a KV cache adds its filled entries).
    """

    session_id: str
    created: float
    last_used: float
    num_tokens: int
    location: str
    state_bytes: int



@dataclass(frozen=True)
class SessionPage:
    """One page of an owner's sessions, in the order asked (`EngineCore.list_sessions`), and whether more follow."""

    records: tuple[SessionRecord, ...]
    has_more: bool
