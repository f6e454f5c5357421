"""The contract between a serving front and the engine: every record and error that crosses between them.

A front (the HTTP server in server/, or any other) hands the engine a prompt's token ids and its `SamplingParams`
and gets `RequestOutput`s back, one per choice per step; it learns the engine's facts once (`EngineInfo`) and a
session's with each operation (`SessionRecord`); it builds the engine from an `EngineConfig`; and it answers the
errors below (an HTTP status each, server/lifecycle.py). The records hold only plain values (strings, numbers,
lists, paths), so that they cross a process boundary as they are (engine/serving/ipc.py) when the engine runs in a
process of its own. This module imports nothing of kvfree: every wing of the engine may import it, and the
server reaches the engine through it (tests/test_layout.py).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

# -- what to generate: structured output's grammars and the sampling parameters ----------------------------------------

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark")
MAX_GRAMMAR_CHARS = 1 << 20  # a grammar's source text (a schema, a regex, a Lark file): 1 MiB


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match. Hashable: equal grammars share one compilation.

    kind / source:
      - "json_schema": a JSON schema, as JSON text;
      - "json_object": any JSON object (source ignored, "");
      - "regex": a regular expression (Rust `regex` syntax) the whole output must match;
      - "choice": a JSON list of strings, the output being exactly one of them;
      - "lark": a Lark grammar in llguidance's dialect (`%json {...}` inlines a schema); GBNF (llama.cpp's, with
        `::=`) is converted to it.
    """

    kind: GrammarKind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.source, str) or len(self.source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"a grammar's source must be a string of at most {MAX_GRAMMAR_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> Grammar:
        """Output valid for `schema` (a dict, or True/False as JSON schema allows)."""
        return cls("json_schema", json.dumps(schema, sort_keys=False, ensure_ascii=False))

    @classmethod
    def choice(cls, options: list[str]) -> Grammar:
        return cls("choice", json.dumps(list(options), ensure_ascii=False))


MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a `logit_bias` value: +-100 forces or bans a token
# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): dividing logits by 1e-300 would overflow them.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request. Invalid values raise ValueError naming the field.

    temperature 0 means greedy. top_k <= 0, top_p = 1 and min_p = 0 disable those filters. Penalties follow the
    OpenAI API (presence, frequency: over generated tokens) and HF/vLLM (repetition: over prompt and generated
    tokens; 1 disables). `logprobs`: None for none, 0 for the sampled token's, k for the k most likely as well.
    `prompt_logprobs`: the same for every prompt token the request prefills (the model's own distribution: no
    temperature, penalty or bias); such a request prefills its whole prompt, never from the prefix cache.
    `logit_bias`: token id -> a value in [-100, 100] added to its logit before sampling (OpenAI's), so that 100
    all but forces a token and -100 all but bans it; the logprobs reported stay the model's.
    `grammar`: the output must match it (structured output, engine/text/grammar.py): tokens it does not allow next are
    never sampled, and the sequence ends where the grammar is complete.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        if isinstance(self.grammar, dict):  # from the wire (engine/serving/ipc.py) or a config
            self.grammar = Grammar(**self.grammar)
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a Grammar, got {type(self.grammar).__name__}")

    def end_token_ids(self, eos_token_id: int | None) -> frozenset[int]:
        """The tokens that end this request's output: the tokenizer's EOS (unless `ignore_eos`) and `stop_token_ids`.
        Such a token is not part of the output's text."""
        eos = () if self.ignore_eos or eos_token_id is None else (eos_token_id,)
        return frozenset((*eos, *self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

@dataclass(frozen=True)
class EngineRequest:
    """A request as a front hands it to the engine (`EngineHandle.generate` makes it; it crosses to an engine
    process as it is).

    request_id: unique among the requests running (a front makes it so). prompt_token_ids: the tokens to feed (a
    session's new ones only). n: choices, each continued from the prompt. session_id, owner: the session to continue
    and its owner (None: no session; the owner also scopes the prefix cache's checkpoints). prefill_only: feed the
    prompt into the session and stop. detokenize: the outputs carry text, cut at stop strings; False: token ids only,
    stop strings left to the front. checkpoint_at: prompt lengths where the prefix cache keeps the state besides the
    prompt's end (the front's message boundaries: the end of the system prompt, of the last earlier turn).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    session_id: str | None = None
    owner: str | None = None
    prefill_only: bool = False
    detokenize: bool = True
    checkpoint_at: tuple[int, ...] = ()


# -- what comes back: a choice's new tokens each step ------------------------------------------------------------------

@dataclass
class TokenLogprob:
    """A token's log-probability and, if asked, the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # a prompt token's rank in the model's distribution (1: the most likely); None: not known


@dataclass
class RequestOutput:
    """What a request gained in one step, for one choice. The last event of a choice has `finish_reason` set."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # With `prompt_logprobs`, once (choice 0's first output): a TokenLogprob per prompt token, the token itself with
    # its log-probability after the tokens before it; None where nothing was computed (the first token, and the
    # part a session already held).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and a `later` one of the same choice as one (a stream that fell behind catches up in one
        event instead of one per step)."""
        return replace(
            later,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=self.logprobs + later.logprobs,
            prompt_logprobs=self.prompt_logprobs if later.prompt_logprobs is None else later.prompt_logprobs,
        )

# -- the engine's facts, and sessions as their operations report them --------------------------------------------------

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

# -- the session operations a front runs on the engine --------------------------------------------------------------
class SessionOperations:
    """A front's session operations, each written once here as one `call` by name: whoever holds the engine (its
    handle, engine/serving/handle.py, or the server's client of that handle, server/lifecycle.py) implements `call`,
    and the engine runs the method of that name (`EngineCore.call`, between steps). Errors are the engine's:
    SessionNotFound, SessionBusy, PoolExhausted, SessionLimitError, SnapshotError, SessionStoreError."""

    async def call(self, method: str, *args: Any) -> Any:
        """Run the engine's method `method` (one of `ENGINE_CALLS`) with `args` on its thread; its result or error."""
        raise NotImplementedError

    async def create_session(self, owner: str | None) -> SessionRecord:
        return await self.call("create_session", owner)

    async def get_session(self, session_id: str, owner: str | None) -> SessionRecord:
        return await self.call("get_session", session_id, owner)

    async def list_sessions(self, owner: str | None, limit: int, after: str | None, order: str) -> SessionPage:
        """Up to `limit` of `owner`'s sessions by creation time ("asc" or "desc"), those after `after` if given."""
        return await self.call("list_sessions", owner, limit, after, order)

    async def delete_session(self, session_id: str, owner: str | None) -> None:
        await self.call("delete_session", session_id, owner)

    async def discard_session(self, session_id: str, owner: str | None) -> None:
        """Delete a session now or, while a request still uses it (one just aborted, say), when that request ends."""
        await self.call("discard_session", session_id, owner)

    async def fork_session(self, session_id: str, owner: str | None) -> SessionRecord:
        return await self.call("fork_session", session_id, owner)

    async def export_session(self, session_id: str, owner: str | None, path: str) -> int:
        """Write the session's snapshot into the file `path` (made by the caller, who removes it; the engine opens it
        by name, so it lies on the engine's host); returns its size in bytes."""
        return await self.call("export_session", session_id, owner, path)

    async def restore_session(self, path: str, owner: str | None) -> SessionRecord:
        """A new session of `owner` from the snapshot file `path` (the caller's to remove)."""
        return await self.call("restore_session", path, owner)


# What a front may run on the engine by name: the session operations above, and the phases of a shutdown.
SESSION_CALLS = frozenset(name for name in vars(SessionOperations) if name.endswith(("_session", "_sessions")))
ENGINE_CALLS = SESSION_CALLS | {"has_work", "abort_all", "persist_all"}
# The calls that answer a SessionRecord (the others answer a SessionPage or plain values: ints, bools, None).
RECORD_CALLS = frozenset({"create_session", "get_session", "fork_session", "restore_session"})


# -- what an engine is built from --------------------------------------------------------------------------------------

@dataclass
class EngineConfig:
    """Everything needed to build an engine: the model, the pool and the serving limits (`kvfree serve`'s flags,
    less the HTTP ones). Plain values only, so that it can be handed to an engine process.

    model: checkpoint directory (None: the one shipped with kvfree). The other fields are documented where they are
    used: `LLM` (device, dtype, max_sessions, gpu_memory_utilization, max_context, config_overrides, enforce_eager,
    max_batch_tokens as its step budget), `Scheduler` (max_waiting, max_batch_tokens, max_prefill_tokens,
    prefill_batch_wait),
    `SessionManager` (max_host_sessions, snapshot_dir, hmac_key), `open_store` (session_store, ttl, lease,
    write mode: "through", "async" or "spill") and `PrefixCache` (prefix_cache: on or off; prefix_cache_bytes: the
    host memory its checkpoints may hold, None: `default_prefix_cache_bytes()`).
    """

    model: Path | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_sessions: int | None = None
    gpu_memory_utilization: float | None = 0.9
    max_context: int = 8192
    config_overrides: dict[str, Any] = field(default_factory=dict)
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    max_waiting: int = 256
    max_batch_tokens: int = 2048
    max_prefill_tokens: int | None = None
    prefill_batch_wait: float = 0.0
    max_host_sessions: int = 1024
    snapshot_dir: Path | None = None
    hmac_key: bytes | None = None
    session_store: str | None = None
    session_ttl_seconds: float | None = None
    session_lease_seconds: float = 10.0
    session_write: str = "through"
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None


def host_memory_bytes() -> int:
    """This machine's memory in bytes (16 GiB assumed where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX system
        return 16 << 30


def default_prefix_cache_bytes() -> int:
    """The prefix cache's host memory by default: a tenth of the machine's memory, at most 8 GiB."""
    return min(8 << 30, host_memory_bytes() // 10)


# -- the errors a front answers (each with an HTTP status, server/lifecycle.py) ----------------------------------------

class GrammarError(ValueError):
    """A grammar that cannot be compiled (bad syntax, an unsupported JSON-schema keyword): the client's to fix."""


class QueueFull(RuntimeError):
    """The waiting queue is at its limit: the client should retry later (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down, or has stopped, and takes no new work (HTTP 503)."""


class SessionNotFound(LookupError):
    """No such session for this owner (the same answer whether it does not exist or belongs to another key)."""


class SessionBusy(RuntimeError):
    """Another request is using this session right now (HTTP 409)."""


class PoolExhausted(RuntimeError):
    """No slot can be made free now: every resident session is busy, or host memory is full with no snapshot
    directory to spill to. Nothing was changed; retrying after running requests finish can succeed."""


class SessionLimitError(RuntimeError):
    """A new session was refused because, without a snapshot directory, the server could not keep it."""


class SessionStoreError(RuntimeError):
    """The store cannot be reached or written now (HTTP 503); what it held is not lost."""


class SnapshotError(ValueError):
    """A snapshot this server cannot restore. `code` is a short machine-readable reason:

    invalid_snapshot (not a snapshot, truncated, malformed metadata), unsupported_version, model_mismatch,
    checksum_mismatch, bad_signature, non_finite_state, state_mismatch (names, shapes or dtypes that do not fit
    this server's state pool; raised by the session manager).
    """

    def __init__(self, message: str, code: str = "invalid_snapshot") -> None:
        super().__init__(message)
        self.code = code


class SnapshotMismatchError(ValueError):
    """Exported state tensors that do not fit this pool's model (wrong names, shapes or dtypes)."""


# Every error above: what a front answers with an HTTP status (server/lifecycle.py), and what crosses a process
# boundary by its name (engine/serving/ipc.py).
FRONT_ERRORS: tuple[type[Exception], ...] = (
    GrammarError, QueueFull, EngineStopped, SessionNotFound, SessionBusy, PoolExhausted, SessionLimitError,
    SessionStoreError, SnapshotError, SnapshotMismatchError,
)  # fmt: skip
