"""AsyncEngine: the model, its pool, sessions and scheduler on one thread, driven from asyncio (architecture.md §5).

HTTP handlers never touch the model. They submit commands (a request, a session operation) to the engine thread
through a queue and receive results and tokens through asyncio futures and queues. The thread runs engine steps
(`core`, an LLMEngine: engine/llm_engine.py) while there is work and sleeps on the command queue otherwise. A step's
outputs for every request reach the event loop in one `loop.call_soon_threadsafe` call, not one per token.

What a front may use: `info` (the engine's facts, an EngineInfo), `generate`, the session operations (which answer
with SessionRecords), `stats()`, `alive`/`accepting`, `start()`/`shutdown()`. Everything else is the engine's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import torch

from kvfree.engine.engine_info import EngineInfo, SessionRecord
from kvfree.engine.llm import LLM
from kvfree.engine.llm_engine import LLMEngine
from kvfree.engine.sampling import SamplingParams
from kvfree.engine.scheduler import QueueFull, Request, RequestOutput, Scheduler
from kvfree.engine.session_store import SessionStore
from kvfree.engine.sessions import Session, SessionManager
from kvfree.engine.snapshot import model_fingerprint

log = logging.getLogger("kvfree.engine")


GIL_SWITCH_INTERVAL_S = 0.0005


class SessionBusy(RuntimeError):
    """Another request is using this session right now (HTTP 409)."""


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new work (HTTP 503)."""


class AsyncEngine:
    """Serves one model. Create it, `start()` it inside a running event loop, `await shutdown()` at the end.

    Args:
        llm: the loaded model, tokenizer and state pool (its `max_sessions` is the number of GPU slots).
        max_waiting: requests that may wait for a slot before new ones get QueueFull (HTTP 429).
        max_batch_tokens: tokens per step while sequences decode: one per decoding sequence, the rest for prefill
            chunks. A step's time grows with its tokens, so this bounds the inter-token latency of running
            requests while new prompts are fed; larger values feed prompts faster (lower time to first token).
        max_prefill_tokens: prefill tokens per step when nothing decodes (default: `max_batch_tokens`).
        prefill_batch_wait: seconds a new prompt may wait, while sequences decode, for others to share its
            prefill step (engine/scheduler.py).
        max_host_sessions: idle sessions kept in host memory before the oldest go to `snapshot_dir`.
        snapshot_dir: where sessions spill to, persist on shutdown and are found again on start (None: no disk).
        store: instead of `snapshot_dir`, any session store (engine/session_store.py), e.g. Redis shared by
            replicas; a turn on a session then holds the store's lease on it.
        write_through: store each session's state after every turn (nothing completed is lost on a crash).
        async_writes: with write_through, store from a background thread (the turn's last event does not wait).
        hmac_key: if set, snapshots are signed and only signed snapshots are accepted.
    """

    def __init__(
        self,
        llm: LLM,
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
    ) -> None:
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.fingerprint = model_fingerprint(llm.model)
        self.sessions = SessionManager(
            llm.pool, self.fingerprint, max_host_sessions, snapshot_dir, hmac_key, store=store,
            write_through=write_through,
            async_writes=async_writes,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.sessions, llm.tokenizer, max_waiting, max_batch_tokens, max_prefill_tokens, prefill_batch_wait
        )
        self.core = LLMEngine(self.scheduler, llm.runner, on_outputs=self._flush)  # schedule -> run -> postprocess
        self.info = self._describe()
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[asyncio.Queue, RequestOutput | BaseException]] = []  # this step's emissions
        self._commands: queue.Queue[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]] | None]
        self._commands = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvfree-engine", daemon=True)
        self.accepting = False

    def _describe(self) -> EngineInfo:
        pool, model = self.llm.pool, self.llm.model
        return EngineInfo(
            checkpoint=self.llm.path,
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

    # -- lifecycle ----------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def steps(self) -> int:
        return self.core.steps

    def start(self) -> None:
        # The engine thread and the event loop share the GIL. Python hands it over every 5 ms by default, so each
        # side could stall the other for that long; a step is a few milliseconds, so hand it over more often.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._loop_ref = asyncio.get_running_loop()
        self.sessions.load_index()
        self.accepting = True
        self._thread.start()

    async def shutdown(self, grace_seconds: float = 10.0) -> None:
        """Stop admitting, let running requests finish for up to `grace_seconds`, abort the rest, persist sessions."""
        self.accepting = False
        if not self.alive:
            log.error("the engine thread had stopped: nothing to finish, sessions in memory are not persisted")
            return
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and await self.call(lambda: self.core.has_work):
            await asyncio.sleep(0.05)
        await self.call(self._abort_all)
        await self.call(self.sessions.persist_all)
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    def _abort_all(self) -> None:
        for req in [*self.scheduler.waiting, *self.scheduler.running]:
            self.scheduler.abort(req.request_id)
        while self.core.has_work:  # finish the aborts (free slots, release sessions)
            self.core.step()
        self._flush()

    # -- the engine thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            # Sleep on the command queue when idle; otherwise take what has arrived and go on stepping.
            # Idle, sleep until a command comes (or, while background writes are landing, briefly, to apply them).
            writing = self.sessions.writer is not None and self.sessions.writer.pending > 0
            for command in self._drain(block=not self.core.has_work, timeout=0.05 if writing else None):
                if command is None:
                    return
                self._run_command(*command)
            if self.core.has_work:
                try:
                    with torch.inference_mode():
                        self.core.step()
                except Exception as exc:  # a failing step must not take the engine down: fail its requests
                    log.exception("engine step failed; failing the requests in flight")
                    self._fail_in_flight(exc)
                self._flush()
            self.sessions.poll_writes()

    def _flush(self) -> None:
        """Hand this step's outputs to the event loop in one call."""
        if self._pending:
            items, self._pending = self._pending, []
            self._loop_ref.call_soon_threadsafe(_deliver, items)

    def _drain(self, block: bool, timeout: float | None = None) -> list:
        items = []
        try:
            items.append(self._commands.get(block=block, timeout=timeout if block else None))
            while True:
                items.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return items

    @staticmethod
    def _run_command(fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        try:
            with torch.inference_mode():
                result = fn()
        except Exception as exc:
            done(None, exc)
        else:
            done(result, None)

    def _fail_in_flight(self, exc: Exception) -> None:
        """Send `exc` to every request in flight and free their slots. A session in the failed batch may hold a
        half-updated state, so it starts over (its next turn re-prefills the whole prompt)."""
        self.core.discard_in_flight()
        for req in self.scheduler.running:
            req.emit(exc)  # type: ignore[arg-type]
            for seq in req.sequences:
                seq.finish_reason = seq.finish_reason or "abort"
                seq.prefilled = seq.decoded = 0  # nothing of the failed batch stays in the reset session
            if req.session is not None:
                if req.session.slot is not None:
                    self.llm.pool.reset(req.session.slot)
                req.session.reset()
                req.settled = True  # nothing of the failed turn is recorded or stored: the store keeps the last one
                req.session.store_version = -1  # a shared store's copy (the last completed turn) wins next time
        self.scheduler.retire()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the engine thread (between steps) and return its result, or raise its exception."""
        if not self.alive:
            raise EngineStopped("the engine thread has stopped; restart the server")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def done(result: Any, exc: BaseException | None) -> None:
            def settle() -> None:
                if future.cancelled():
                    return
                if exc is not None:
                    future.set_exception(exc)
                else:
                    future.set_result(result)

            loop.call_soon_threadsafe(settle)

        self._commands.put((fn, done))
        return await future

    def abort(self, request_id: str) -> None:
        """Thread-safe: stop a request (client disconnected)."""
        self._commands.put((lambda: self.scheduler.abort(request_id), lambda result, exc: None))

    # -- generation ---------------------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        session_id: str | None = None,
        owner: str | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: one RequestOutput per choice per step; each choice ends with a finish_reason.

        Raises QueueFull, SessionNotFound, SessionBusy or EngineStopped before anything is streamed. If the caller
        stops iterating early (client gone), the request is aborted and its slots are freed.
        """
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def emit(out: RequestOutput | BaseException) -> None:  # on the engine thread, flushed after the step
            self._pending.append((outputs, out))

        def submit() -> None:
            session = self.sessions.get(session_id, owner) if session_id else None
            if session is not None and session.busy:
                raise SessionBusy(f"session {session_id} is in use by another request")
            if session is not None and not self.sessions.begin_turn(session):
                raise SessionBusy(f"session {session_id} is running a turn on another replica; retry when it ends")
            try:
                self.scheduler.add(
                    Request(request_id, prompt_token_ids, params, emit, n=n, session=session, prefill_only=prefill_only)
                )
            except QueueFull:
                if session is not None:
                    self.sessions.end_turn(session)
                raise

        await self.call(submit)
        finished: set[int] = set()
        try:
            while len(finished) < n:
                for out in _coalesced(await outputs.get(), outputs):
                    if isinstance(out, BaseException):
                        raise out
                    if out.finish_reason is not None:
                        finished.add(out.index)
                    yield out
                    if prefill_only and out.finish_reason is not None:
                        return
        finally:
            if len(finished) < n and not (prefill_only and finished):
                self.abort(request_id)

    # -- sessions -----------------------------------------------------------------------------------------------
    def _record(self, session: Session) -> SessionRecord:
        """`session` as a record, on the engine thread (the live session changes under later steps)."""
        # The engine keeps last_used on the monotonic clock (immune to clock changes); records carry unix time.
        last_used = time.time() - (time.monotonic() - session.last_used)
        return SessionRecord(
            session_id=session.session_id,
            created=session.created,
            last_used=last_used,
            num_tokens=session.num_tokens,
            location=session.location,
            state_bytes=self.llm.pool.bytes_per_session(session.num_tokens),
        )

    async def create_session(self, owner: str | None) -> SessionRecord:
        return await self.call(lambda: self._record(self.sessions.create(owner)))

    async def get_session(self, session_id: str, owner: str | None) -> SessionRecord:
        return await self.call(lambda: self._record(self.sessions.get(session_id, owner)))

    async def delete_session(self, session_id: str, owner: str | None) -> None:
        def delete() -> None:
            session = self.sessions.get(session_id, owner)
            if session.busy:
                raise SessionBusy(f"session {session_id} is in use by a running request")
            self.sessions.delete(session)

        await self.call(delete)

    async def discard_session(self, session_id: str, owner: str | None) -> None:
        """Delete a session now or, while a request still uses it (one just aborted, say), when that request ends."""

        def discard() -> None:
            session = self.sessions.get(session_id, owner)
            if session.busy:
                session.delete_when_released = True
            else:
                self.sessions.delete(session)

        await self.call(discard)

    async def fork_session(self, session_id: str, owner: str | None) -> SessionRecord:
        def fork() -> SessionRecord:
            session = self.sessions.get(session_id, owner)
            if session.busy:
                raise SessionBusy(f"session {session_id} is in use by a running request")
            return self._record(self.sessions.fork(session, owner))

        return await self.call(fork)

    async def export_session(self, session_id: str, owner: str | None) -> bytes:
        def export() -> bytes:
            session = self.sessions.get(session_id, owner)
            if session.busy:
                raise SessionBusy(f"session {session_id} is in use by a running request")
            return self.sessions.export(session)

        return await self.call(export)

    async def restore_session(self, data: bytes, owner: str | None) -> SessionRecord:
        return await self.call(lambda: self._record(self.sessions.restore(data, owner)))

    # -- numbers for /metrics -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A racy but harmless read of engine counters (ints and lengths) from another thread."""
        pool = self.llm.pool
        stats = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pool_slots_used": pool.used_slots,
            "pool_slots_total": pool.capacity,
            "state_bytes_per_session": pool.bytes_per_session(),
            # What resident sessions actually hold: constant per session for recurrent layers; the attention
            # baseline's KV cache counts only its filled entries.
            "state_bytes_in_use": sum(pool.bytes_per_session(n) for n in self.sessions.resident_tokens()),
            "sessions": self.sessions.counts(),
            "pool_reserved_bytes": pool.reserved_bytes(),
            "host_state_bytes": self.sessions.host_bytes(),
            "session_moves": dataclasses.asdict(self.sessions.counters),
            "session_writes_pending": self.sessions.writer.pending if self.sessions.writer is not None else 0,
            "session_write_lag_seconds": self.sessions.write_lag_seconds,
            # How many sessions fit: decoding at once (pool slots), idle in host memory, in all (None: only the
            # session store's disk bounds it).
            "session_capacity": {
                "gpu": pool.capacity,
                "host": self.sessions.max_host_sessions,
                "total": self.sessions.max_sessions,
            },
        }
        if torch.cuda.is_available() and self.llm.model.device.type == "cuda":
            stats["gpu_memory_allocated"] = torch.cuda.memory_allocated(self.llm.model.device)
            stats["gpu_memory_reserved"] = torch.cuda.memory_reserved(self.llm.model.device)
        return stats


def _coalesced(
    first: RequestOutput | BaseException, queued: asyncio.Queue[RequestOutput | BaseException]
) -> list[RequestOutput | BaseException]:
    """`first` and whatever else is already queued, with consecutive outputs of one choice merged: when a client
    reads slower than the engine steps, it gets one event per read instead of falling further behind."""
    items = [first]
    while not queued.empty():
        items.append(queued.get_nowait())
    merged: list[RequestOutput | BaseException] = []
    for item in items:
        last = merged[-1] if merged else None
        if (
            isinstance(item, RequestOutput)
            and isinstance(last, RequestOutput)
            and last.index == item.index
            and last.finish_reason is None
        ):
            merged[-1] = last.then(item)
        else:
            merged.append(item)
    return merged


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue_, out in items:
        queue_.put_nowait(out)


__all__ = ["AsyncEngine", "EngineStopped", "QueueFull", "RequestOutput", "SessionBusy"]
