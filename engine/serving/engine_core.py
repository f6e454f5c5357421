"""EngineCore: the serving engine itself, synchronous and single-threaded: model, pool, sessions, scheduler, steps.

Whoever drives it calls everything from one thread: `ThreadDriver` from its engine thread (engine and HTTP front in
one process), the engine process's loop (engine/serving/process_loop.py) when the front runs in a process of its
own. Each `step()` returns the outputs it produced, each with its request id; the driver sends them to their requests.
What a front may learn of the engine is its `info` (an EngineInfo), the `SessionRecord`s its session operations
return, and `stats()`: plain records, so that they can cross a process boundary.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvfree.engine.core.scheduler import Output, Request, Scheduler
from kvfree.engine.core.stepper import Stepper
from kvfree.engine.parallel.runtime import Runtime, start_runtime
from kvfree.engine.protocol import (
    ENGINE_CALLS,
    EngineConfig,
    EngineInfo,
    EngineRequest,
    QueueFull,
    SessionBusy,
    SessionNotFound,
    SessionPage,
    SessionRecord,
    default_prefix_cache_bytes,
)
from kvfree.engine.sessions.manager import Session, SessionManager
from kvfree.engine.sessions.prefix_cache import PrefixCache
from kvfree.engine.sessions.store import SessionStore, open_store
from kvfree.engine.state.packed import PackedState, read_file_into
from kvfree.engine.state.snapshot import write_snapshot

log = logging.getLogger("kvfree.engine")

STEP_WINDOW = 256  # the steps `stats` averages its step timings over


class EngineCore:
    """Serves one model; every method runs on the driver's one thread.

    Args:
        runtime: the loaded model, tokenizer and state pool (its pool's capacity is the number of GPU slots).
        max_waiting: requests that may wait for a slot before new ones get QueueFull (HTTP 429).
        max_batch_tokens: tokens per step while sequences decode: one per decoding sequence, the rest for prefill
            chunks. A step's time grows with its tokens, so this bounds the inter-token latency of running
            requests while new prompts are fed; larger values feed prompts faster (lower time to first token).
        max_prefill_tokens: prefill tokens per step when nothing decodes (default: `max_batch_tokens`).
        prefill_batch_wait: seconds a new prompt may wait, while sequences decode, for others to share its
            prefill step (engine/core/scheduler.py).
        max_host_sessions: idle sessions kept in host memory before the oldest go to `snapshot_dir`.
        snapshot_dir: where sessions spill to, persist on shutdown and are found again on start (None: no disk).
        store: instead of `snapshot_dir`, any session store (engine/sessions/store.py), e.g. Redis shared by
            replicas; a turn on a session then holds the store's lease on it.
        write_through: store each session's state after every turn (nothing completed is lost on a crash).
        async_writes: with write_through, store from a background thread (the turn's last event does not wait).
        hmac_key: if set, snapshots are signed and only signed snapshots are accepted.
        prefix_cache: keep checkpoints of every request's state for later requests that share its prefix
            (engine/sessions/prefix_cache.py); prefix_cache_bytes: the host memory they may hold (None: the default,
            `default_prefix_cache_bytes`).
    """

    def __init__(
        self,
        runtime: Runtime,
        *,
        max_waiting: int = 256,
        max_batch_tokens: int = 2048,
        max_prefill_tokens: int | None = None,
        prefill_batch_wait: float = 0.0,
        max_host_sessions: int = 1024,
        snapshot_dir: Path | None = None,
        hmac_key: bytes | None = None,
        store: SessionStore | None = None,
        write_through: bool = False,
        async_writes: bool = False,
        prefix_cache: bool = True,
        prefix_cache_bytes: int | None = None,
    ) -> None:
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.fingerprint = runtime.fingerprint
        self.sessions = SessionManager(
            runtime.pool, self.fingerprint, max_host_sessions, snapshot_dir, hmac_key, store=store,
            write_through=write_through, async_writes=async_writes,
        )  # fmt: skip
        self.prefix_cache = (
            PrefixCache(self.sessions.tiers, default_prefix_cache_bytes() if prefix_cache_bytes is None
                        else prefix_cache_bytes) if prefix_cache else None
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.sessions, runtime.tokenizer, max_waiting, max_batch_tokens, max_prefill_tokens, prefill_batch_wait,
            grammars=runtime.grammars, prefix_cache=self.prefix_cache,
        )
        runtime.grammars.warm_up()  # structured output's tokenizer, on a thread: ready before the first grammar
        # Each step: schedule, run, postprocess, return the outputs.
        self.stepper = Stepper(self.scheduler, runtime.runner)
        # Serving: every prefill graph a step can meet is captured before the first request, not in its middle.
        runtime.runner.capture_prefill_graphs(self.scheduler.max_prefill_tokens)
        self.sessions.tiers.warm_up()  # (likewise the kernels and pinned memory of the first session move)
        self.info = self._describe()
        # A session's state: fixed bytes, plus per token of context for a KV cache (`stats` runs every few steps).
        self._fixed_bytes, self._token_bytes = runtime.pool.bytes_per_session(0), runtime.pool.bytes_per_token()

    def _describe(self) -> EngineInfo:
        pool, model = self.runtime.pool, self.runtime.model
        return EngineInfo(
            checkpoint=self.runtime.path,
            layers=tuple(model.config.layers),
            vocab_size=model.config.vocab_size,
            max_context=pool.max_context,
            state_bytes_per_token=pool.bytes_per_token(),
            state_bytes_per_session=pool.bytes_per_session(),
            gpu_slots=pool.capacity,
            host_sessions=self.sessions.max_host_sessions,
            max_sessions=self.sessions.max_sessions,
            device=str(model.device),
            dtype=str(model.dtype).removeprefix("torch."),
            fingerprint=self.fingerprint,
        )

    @property
    def session_store(self) -> SessionStore | None:
        """Where sessions are stored beyond this process (None: nowhere but `snapshot_dir`, if set)."""
        return self.sessions.store

    # -- stepping -------------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.stepper.has_work

    @property
    def writing(self) -> bool:
        """Background session writes or spills are landing: poll for them soon even when idle."""
        writer = self.sessions.tiers.writer
        return (writer is not None and writer.pending > 0) or self.sessions.tiers.moving

    def step(self, send: Callable[[list[Output]], None] | None = None) -> list[Output]:
        """One engine step, returning its outputs (`Stepper.step`, which says what `send` is for); a failing step
        fails its requests instead of the engine (their errors are its outputs)."""
        try:
            with torch.inference_mode():
                return self.stepper.step(send)
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            return self._fail_in_flight(exc)

    def poll_store(self) -> None:
        """The session store's background work, between steps: apply the writes and spills that landed, renew the
        leases of the turns that run."""
        self.sessions.poll_writes()
        self.sessions.tiers.poll()
        self.sessions.leases.renew()

    def _fail_in_flight(self, exc: Exception) -> list[Output]:
        """Fail every request in flight with `exc` (the outputs returned) and free their slots. A session in the
        failed batch may hold a half-updated state, so it starts over (its next turn re-prefills the whole prompt)."""
        self.stepper.discard_in_flight()
        outputs: list[Output] = []
        for req in self.scheduler.running:
            outputs.append((req.request_id, exc))
            self.scheduler.fail_checkpoints(req)  # their forks may not have run; its own state is not kept
            for seq in req.sequences:
                seq.finish_reason = seq.finish_reason or "abort"
                seq.prefilled = seq.decoded = 0  # nothing of the failed batch stays in the reset session
            if req.session is not None:
                if req.session.slot is not None:
                    self.runtime.pool.reset(req.session.slot)
                req.session.reset()
                req.settled = True  # nothing of the failed turn is recorded or stored: the store keeps the last one
                req.session.store_version = -1  # a shared store's copy (the last completed turn) wins next time
        return outputs + self.scheduler.retire()

    def call(self, method: str, args: Sequence[Any]) -> Any:
        """Run one of `ENGINE_CALLS` by name with `args`: how either driver carries a front's session operation or
        shutdown phase to the engine's thread."""
        if method not in ENGINE_CALLS:
            raise ValueError(f"unknown engine call {method!r}")
        if method == "has_work":
            return self.has_work
        return getattr(self, method)(*args)

    # -- requests -------------------------------------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        """Queue a request; its outputs come out of later steps. Raises QueueFull, SessionNotFound or
        SessionBusy (nothing queued). Without `detokenize` the outputs carry token ids only (no text) and stop
        strings are the caller's to find."""
        session_id = request.session_id
        session = self.sessions.get(session_id, request.owner) if session_id else None
        if session is not None and session.busy:
            raise SessionBusy(f"session {session_id} is in use by another request")
        if session is not None and not self.sessions.leases.begin(session):
            raise SessionBusy(f"session {session_id} is running a turn on another replica; retry when it ends")
        try:
            self.scheduler.add(
                Request(
                    request.request_id, request.prompt_token_ids, request.params, n=request.n, session=session,
                    prefill_only=request.prefill_only, detokenize=request.detokenize, owner=request.owner,
                    checkpoint_at=tuple(request.checkpoint_at),
                )  # fmt: skip
            )
        except QueueFull:
            if session is not None:
                self.sessions.leases.end(session)
            raise

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """Stop a request (its client went away), or one of its choices (`Scheduler.abort`): its slots are freed
        once every choice has ended, its session keeps what it consumed."""
        self.scheduler.abort(request_id, choice)

    def abort_all(self) -> None:
        """Abort every request (shutdown): the driver's next steps end them, free their slots and release their
        sessions, and their outputs say "abort"."""
        for req in [*self.scheduler.waiting, *self.scheduler.running]:
            self.scheduler.abort(req.request_id)

    def persist_all(self) -> int:
        """Store every session that has a place to go (shutdown)."""
        return self.sessions.persist_all()

    def load_index(self) -> int:
        """Find the sessions a previous run left in the snapshot directory or store (start-up)."""
        return self.sessions.load_index()

    # -- sessions -------------------------------------------------------------------------------------------------
    def _record(self, session: Session) -> SessionRecord:
        # The engine keeps last_used on the monotonic clock (immune to clock changes); records carry unix time.
        last_used = time.time() - (time.monotonic() - session.last_used)
        return SessionRecord(
            session_id=session.session_id,
            created=session.created,
            last_used=last_used,
            num_tokens=session.num_tokens,
            location=session.location,
            state_bytes=self.runtime.pool.bytes_per_session(session.num_tokens),
        )

    def _idle(self, session_id: str, owner: str | None) -> Session:
        session = self.sessions.get(session_id, owner)
        if session.busy:
            raise SessionBusy(f"session {session_id} is in use by a running request")
        return session

    def create_session(self, owner: str | None) -> SessionRecord:
        return self._record(self.sessions.create(owner))

    def get_session(self, session_id: str, owner: str | None) -> SessionRecord:
        return self._record(self.sessions.get(session_id, owner))

    def list_sessions(
        self, owner: str | None, limit: int, after: str | None = None, order: str = "desc"
    ) -> SessionPage:
        """Up to `limit` of `owner`'s sessions by creation time (`order` "asc" oldest first, "desc" newest first),
        those after session `after` when given (SessionNotFound when it is not one of theirs)."""
        sessions = sorted(self.sessions.owned(owner), key=lambda s: (s.created, s.session_id), reverse=order == "desc")
        if after is not None:
            at = next((i for i, s in enumerate(sessions) if s.session_id == after), None)
            if at is None:
                raise SessionNotFound(f"session {after!r} not found")
            sessions = sessions[at + 1 :]
        return SessionPage(tuple(self._record(s) for s in sessions[:limit]), len(sessions) > limit)

    def delete_session(self, session_id: str, owner: str | None) -> None:
        self.sessions.delete(self._idle(session_id, owner))

    def discard_session(self, session_id: str, owner: str | None) -> None:
        """Delete a session now or, while a request still uses it (one just aborted, say), when that request ends."""
        session = self.sessions.get(session_id, owner)
        if session.busy:
            session.delete_when_released = True
        else:
            self.sessions.delete(session)

    def fork_session(self, session_id: str, owner: str | None) -> SessionRecord:
        return self._record(self.sessions.fork(self._idle(session_id, owner), owner))

    def export_session(self, session_id: str, owner: str | None, path: str) -> int:
        """Write the session's snapshot (signed when the server has a key; without its owner: whoever restores it
        owns the copy) into the existing file `path` (cut to what was written), which the caller made and removes;
        returns the bytes written. The
        header goes first, then the state straight from its host buffer (`write_snapshot` waits for its copy from
        the GPU): no joined copy of the file is made."""
        snap = self.sessions.snapshot(self._idle(session_id, owner))  # (without the owner)
        with open(path, "r+b") as f:  # (not truncated first: pages a previous snapshot left there are reused)
            written = write_snapshot(f, snap, self.sessions.hmac_key)
            f.truncate()
        return written

    def restore_session(self, path: str, owner: str | None) -> SessionRecord:
        """A new session of `owner` from the snapshot file `path` (the caller made it and removes it), after every
        check (SnapshotError). The file is read with one read into one uint8 buffer `[file size]`, pinned when the
        pool is on a GPU, so that the state crosses to the device in one DMA; the state is a view of that buffer."""
        on_gpu = self.runtime.model.device.type == "cuda"  # where the pool is
        buffer = read_file_into(path, lambda n: PackedState.buffer(n, pin=on_gpu))
        return self._record(self.sessions.restore(buffer, owner))

    # -- numbers for /metrics -------------------------------------------------------------------------------------
    def _resident_checkpoints(self) -> int:
        return sum(s.checkpoint for s in self.sessions.tiers.resident()) if self.prefix_cache is not None else 0

    def _bytes_in_use(self) -> int:
        """`sum(pool.bytes_per_session(n))` over resident sessions (checkpoints left out), without walking every
        layer's specs for each."""
        tokens = self.sessions.resident_tokens()
        used = len(tokens) * self._fixed_bytes
        if self._token_bytes:
            limit = self.runtime.pool.max_context
            used += self._token_bytes * sum(min(n, limit) for n in tokens)
        return used

    def _step_stats(self, window: int = STEP_WINDOW) -> dict[str, Any]:
        """How the engine's last `window` steps spent their time: the mean step, and the share of it spent waiting
        for the device (near 0 with requests running: the engine's host work is the limit, not the GPU); and the
        same summed over every step since start."""
        recent = list(itertools.islice(reversed(self.stepper.history), window))  # not a copy of the whole history
        seconds = sum(r.seconds for r in recent)
        totals = self.stepper.totals
        return {
            "engine_steps": totals.steps,
            "engine_step_seconds": seconds / len(recent) if recent else 0.0,
            "engine_device_wait_fraction": sum(r.wait for r in recent) / seconds if seconds > 0 else 0.0,
            # Since start, for differences over an interval (`kvfree bench serve` reports them per level).
            "engine_busy_seconds": totals.seconds,
            "engine_device_wait_seconds": totals.wait,
            "engine_decode_rows": totals.decode_rows,
            "engine_prefill_tokens": totals.prefill_tokens,
        }

    def stats(self) -> dict[str, Any]:
        """The engine's counters (ints and lengths); a racy but harmless read when called from another thread."""
        pool = self.runtime.pool
        stats = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            # Checkpoints ride on free slots and leave them to any request: not counted as used (see "prefix_cache").
            "pool_slots_used": pool.used_slots - self._resident_checkpoints(),
            "pool_slots_total": pool.capacity,
            "state_bytes_per_session": pool.bytes_per_session(),
            # What resident sessions actually hold: constant per session for recurrent layers; the attention
            # baseline's KV cache counts only its filled entries.
            "state_bytes_in_use": self._bytes_in_use(),
            "sessions": self.sessions.counts(),
            "pool_reserved_bytes": pool.reserved_bytes(),
            "host_state_bytes": self.sessions.host_bytes(),
            "session_moves": dataclasses.asdict(self.sessions.counters),
            "session_writes_pending": self.sessions.tiers.writer.pending if self.sessions.tiers.writer else 0,
            "session_write_lag_seconds": self.sessions.tiers.write_lag_seconds,
            "prefix_cache": self._prefix_cache_stats(),
            # How many sessions fit: decoding at once (pool slots), idle in host memory, in all (None: only the
            # session store's disk bounds it).
            "session_capacity": {
                "gpu": pool.capacity,
                "host": self.sessions.max_host_sessions,
                "total": self.sessions.max_sessions,
            },
        }
        stats.update(self._step_stats())
        if torch.cuda.is_available() and self.runtime.model.device.type == "cuda":
            stats["gpu_memory_allocated"] = torch.cuda.memory_allocated(self.runtime.model.device)
            stats["gpu_memory_reserved"] = torch.cuda.memory_reserved(self.runtime.model.device)
        return stats

    def _prefix_cache_stats(self) -> dict[str, Any]:
        """The prefix cache's checkpoints, their bytes by tier, its budget and counters ({} when it is off)."""
        cache = self.prefix_cache
        if cache is None:
            return {}
        return {"checkpoints": len(cache), "bytes": cache.held_bytes(), "host_budget_bytes": cache.host_budget_bytes,
                **dataclasses.asdict(cache.counters)}  # fmt: skip


def build_engine(config: EngineConfig) -> EngineCore:
    """Load `config`'s checkpoint and build the engine (the store opened, if any)."""
    runtime = start_runtime(
        config.model, device=config.device, dtype=config.dtype, max_sessions=config.max_sessions,
        gpu_memory_utilization=config.gpu_memory_utilization,
        step_tokens=max(config.max_prefill_tokens or config.max_batch_tokens, config.max_batch_tokens),
        max_context=config.max_context, config_overrides=config.config_overrides, enforce_eager=config.enforce_eager,
        tensor_parallel_size=config.tensor_parallel_size, kv_cache_dtype=config.kv_cache_dtype,
    )  # fmt: skip
    store = None
    if config.session_store:
        store = open_store(
            config.session_store, runtime.fingerprint, config.hmac_key,
            ttl_seconds=config.session_ttl_seconds, lease_seconds=config.session_lease_seconds,
            fsync=config.session_write == "through",  # a completed turn's file is on disk before the turn ends
        )  # fmt: skip
    return EngineCore(
        runtime, max_waiting=config.max_waiting, max_batch_tokens=config.max_batch_tokens,
        max_prefill_tokens=config.max_prefill_tokens, prefill_batch_wait=config.prefill_batch_wait,
        max_host_sessions=config.max_host_sessions, snapshot_dir=config.snapshot_dir, hmac_key=config.hmac_key,
        store=store, write_through=store is not None and config.session_write in ("through", "async"),
        async_writes=config.session_write == "async", prefix_cache=config.prefix_cache,
        prefix_cache_bytes=config.prefix_cache_bytes,
    )  # fmt: skip
