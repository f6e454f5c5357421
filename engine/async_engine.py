"""AsyncEngine: an EngineCore on a thread of this process, driven from asyncio (architecture.md §5).

HTTP handlers never touch the model. They submit commands (a request, a session operation) to the engine thread
through a queue and receive results and tokens through asyncio futures and queues. The thread runs engine steps
(`EngineCore.step`) while there is work and sleeps on the command queue otherwise. A step's outputs for every
request reach the event loop in one `loop.call_soon_threadsafe` call, not one per token.

This is the in-process engine (`kvfree serve --engine-in-process`, tests, embedding). By default `kvfree serve` runs
the same EngineCore in a process of its own behind the same interface (engine/engine_process.py), so that the HTTP
front's Python never competes with the engine's for one interpreter.

What a front may use: `info` (the engine's facts, an EngineInfo), `generate`, the session operations (which answer
with SessionRecords), `stats()`, `alive`/`accepting`, `start()`/`shutdown()`, `tokenizer`, `session_store`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from kvfree.engine.engine_core import EngineConfig, EngineCore, EngineStopped, SessionBusy
from kvfree.engine.engine_info import EngineInfo, SessionRecord
from kvfree.engine.sampling import SamplingParams
from kvfree.engine.scheduler import QueueFull, RequestOutput
from kvfree.engine.session_store import SessionStore

log = logging.getLogger("kvfree.engine")


GIL_SWITCH_INTERVAL_S = 0.0005


class AsyncEngine:
    """Serves one EngineCore from a thread. Create it, `start()` it inside a running event loop, `await shutdown()`.

    `AsyncEngine(core)` takes a built EngineCore; `AsyncEngine.build(config)` loads one from an EngineConfig.
    """

    def __init__(self, core: EngineCore) -> None:
        self.engine_core = core
        core.on_outputs = self._flush
        self.info: EngineInfo = core.info
        self.tokenizer = core.tokenizer
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self._pending: list[tuple[asyncio.Queue, RequestOutput | BaseException]] = []  # this step's emissions
        self._commands: queue.Queue[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]] | None]
        self._commands = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvfree-engine", daemon=True)
        self.accepting = False

    @classmethod
    def build(cls, config: EngineConfig) -> AsyncEngine:
        return cls(config.build())

    # The engine's parts, for tests and tools in this process (a front uses the interface above).
    @property
    def llm(self):
        return self.engine_core.llm

    @property
    def sessions(self):
        return self.engine_core.sessions

    @property
    def scheduler(self):
        return self.engine_core.scheduler

    @property
    def core(self):
        return self.engine_core.core

    @property
    def session_store(self) -> SessionStore | None:
        """Where sessions are stored beyond this process (None: nowhere but `snapshot_dir`, if set)."""
        return self.engine_core.session_store

    # -- lifecycle ----------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def steps(self) -> int:
        return self.engine_core.core.steps

    def start(self) -> None:
        # The engine thread and the event loop share the GIL. Python hands it over every 5 ms by default, so each
        # side could stall the other for that long; a step is a few milliseconds, so hand it over more often.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._loop_ref = asyncio.get_running_loop()
        self.engine_core.load_index()
        self.accepting = True
        self._thread.start()

    async def shutdown(self, grace_seconds: float = 10.0) -> None:
        """Stop admitting, let running requests finish for up to `grace_seconds`, abort the rest, persist sessions."""
        self.accepting = False
        if not self.alive:
            log.error("the engine thread had stopped: nothing to finish, sessions in memory are not persisted")
            return
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and await self.call(lambda: self.engine_core.has_work):
            await asyncio.sleep(0.05)
        await self.call(self.engine_core.abort_all)
        await self.call(self.engine_core.persist_all)
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    # -- the engine thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        core = self.engine_core
        while True:
            # Sleep on the command queue when idle (while background writes land, briefly, to apply them);
            # otherwise take what has arrived and go on stepping.
            for command in self._drain(block=not core.has_work, timeout=0.05 if core.writing else None):
                if command is None:
                    return
                self._run_command(*command)
            if core.has_work:
                core.step()
            core.poll_writes()

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
        self._commands.put((lambda: self.engine_core.abort(request_id), lambda result, exc: None))

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
        detokenize: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: one RequestOutput per choice per step; each choice ends with a finish_reason.

        Raises QueueFull, SessionNotFound, SessionBusy or EngineStopped before anything is streamed. If the caller
        stops iterating early (client gone), the request is aborted and its slots are freed. Without `detokenize`
        the outputs carry no text and stop strings are the caller's (see `EngineCore.submit`).
        """
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def emit(out: RequestOutput | BaseException) -> None:  # on the engine thread, flushed after the step
            self._pending.append((outputs, out))

        await self.call(
            lambda: self.engine_core.submit(
                request_id, prompt_token_ids, params, emit, n=n, session_id=session_id, owner=owner,
                prefill_only=prefill_only, detokenize=detokenize,
            )
        )  # fmt: skip
        async for out in stream_outputs(outputs, n, prefill_only, lambda: self.abort(request_id)):
            yield out

    # -- sessions -----------------------------------------------------------------------------------------------
    async def create_session(self, owner: str | None) -> SessionRecord:
        return await self.call(lambda: self.engine_core.create_session(owner))

    async def get_session(self, session_id: str, owner: str | None) -> SessionRecord:
        return await self.call(lambda: self.engine_core.get_session(session_id, owner))

    async def delete_session(self, session_id: str, owner: str | None) -> None:
        await self.call(lambda: self.engine_core.delete_session(session_id, owner))

    async def discard_session(self, session_id: str, owner: str | None) -> None:
        """Delete a session now or, while a request still uses it (one just aborted, say), when that request ends."""
        await self.call(lambda: self.engine_core.discard_session(session_id, owner))

    async def fork_session(self, session_id: str, owner: str | None) -> SessionRecord:
        return await self.call(lambda: self.engine_core.fork_session(session_id, owner))

    async def export_session(self, session_id: str, owner: str | None) -> bytes:
        return await self.call(lambda: self.engine_core.export_session(session_id, owner))

    async def restore_session(self, data: bytes, owner: str | None) -> SessionRecord:
        return await self.call(lambda: self.engine_core.restore_session(data, owner))

    # -- numbers for /metrics -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A racy but harmless read of engine counters (ints and lengths) from another thread."""
        return self.engine_core.stats()


async def stream_outputs(
    outputs: asyncio.Queue[RequestOutput | BaseException], n: int, prefill_only: bool, abort: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    """A request's outputs as they arrive on `outputs`, until each of its `n` choices has finished (or, for a
    prefill-only request, its prompt is in); an exception on the queue is raised. If the caller stops early (its
    client went away), `abort()` stops the request in the engine."""
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
            abort()


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


__all__ = ["AsyncEngine", "EngineConfig", "EngineStopped", "QueueFull", "RequestOutput", "SessionBusy"]
