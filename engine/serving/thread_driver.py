"""ThreadDriver: an EngineCore on a thread of this process, driven from asyncio (architecture.md §5).

HTTP handlers never touch the model. They submit commands (a request, a session operation) to the engine thread
through a queue and receive results and tokens through asyncio futures and queues. The thread runs engine steps
(`EngineCore.step`) while there is work and sleeps on the command queue otherwise. A step's outputs for every
request reach the event loop in one `loop.call_soon_threadsafe` call, not one per token.

This is the in-process engine (`kvfree serve --engine-in-process`, tests, embedding). By default `kvfree serve` runs
the same EngineCore in a process of its own (engine/serving/process_driver.py), so that the HTTP front's Python never
competes with the engine's for one interpreter. Both are `EngineHandle`s (engine/serving/handle.py): what a front
uses is written once there; this module says how a command reaches the engine thread and outputs come back.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from kvfree.engine.core.scheduler import Output
from kvfree.engine.protocol import (
    EngineConfig,
    EngineInfo,
    EngineRequest,
    EngineStopped,
    RequestOutput,
)
from kvfree.engine.serving.engine_core import EngineCore, build_engine
from kvfree.engine.serving.handle import EngineHandle, Outputs
from kvfree.engine.sessions.store import SessionStore

log = logging.getLogger("kvfree.engine")


GIL_SWITCH_INTERVAL_S = 0.0005


class ThreadDriver(EngineHandle):
    """Serves one EngineCore from a thread. Create it, `start()` it inside a running event loop, `await shutdown()`.

    `ThreadDriver(core)` takes a built EngineCore; `ThreadDriver.build(config)` loads one from an EngineConfig.
    """

    def __init__(self, core: EngineCore) -> None:
        self.engine_core = core
        self.info: EngineInfo = core.info
        self.tokenizer = core.tokenizer
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        # Each running request's queue, by request id (added on the event loop before the request is submitted,
        # read on the engine thread when its outputs come).
        self._queues: dict[str, Outputs] = {}
        self._commands: queue.Queue[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]] | None]
        self._commands = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvfree-engine", daemon=True)
        self.accepting = False

    @classmethod
    def build(cls, config: EngineConfig) -> ThreadDriver:
        return cls(build_engine(config))

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
        return self.engine_core.stepper.steps

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
        await self._drain(grace_seconds)
        self._commands.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    # -- the engine thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        core = self.engine_core
        while True:
            # Sleep on the command queue when idle (while background writes land, briefly, to apply them);
            # otherwise take what has arrived and go on stepping.
            for command in self._drain_commands(block=not core.has_work, timeout=0.05 if core.writing else None):
                if command is None:
                    core.runtime.close()  # (the other tensor-parallel ranks, if any)
                    return
                self._run_command(*command)
            if core.has_work:
                self._deliver(core.step(self._deliver))
            core.poll_store()

    def _deliver(self, outputs: list[Output]) -> None:
        """Hand a step's outputs to the event loop in one call (on the engine thread). A request whose stream has
        closed meanwhile has no queue: its outputs are dropped."""
        items = [(queue_, out) for request_id, out in outputs if (queue_ := self._queues.get(request_id)) is not None]
        if items:
            self._loop_ref.call_soon_threadsafe(_put_all, items)

    def _drain_commands(self, block: bool, timeout: float | None = None) -> list:
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

    async def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
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

    # -- EngineHandle -------------------------------------------------------------------------------------------
    async def call(self, method: str, *args: Any) -> Any:
        return await self.on_engine_thread(lambda: self.engine_core.call(method, args))

    async def _submit(self, request: EngineRequest, outputs: Outputs) -> None:
        self._queues[request.request_id] = outputs  # (before the engine can have an output for it)
        await self.on_engine_thread(lambda: self.engine_core.submit(request))

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """Thread-safe: stop a request (client disconnected, or its front found a stop string), or one choice of it."""
        self._commands.put((lambda: self.engine_core.abort(request_id, choice), lambda result, exc: None))

    # -- numbers for /metrics -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """A racy but harmless read of engine counters (ints and lengths) from another thread."""
        return self.engine_core.stats()


def _put_all(items: list[tuple[Outputs, RequestOutput | BaseException]]) -> None:
    for queue_, out in items:
        queue_.put_nowait(out)
