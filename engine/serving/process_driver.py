"""The engine in a process of its own, as the HTTP front holds it: `ProcessDriver` (the engine's side is
engine/serving/process_loop.py).

In one process the HTTP front's Python (request validation, templates, JSON, SSE, tokenizing) and the engine's
(scheduling, launching kernels, postprocessing) share one interpreter lock, and every millisecond the front holds
it is a millisecond the GPU may wait for its next step. Here the engine core runs a busy loop in a process started
with `spawn`: it takes commands from the front between steps and sends each step's outputs for every request back
in one frame (engine/serving/ipc.py: msgpack frames of token ids and small records over a pipe). The front keeps the
same
interface as the in-process `ThreadDriver`, so the server does not know which one it holds.

Lifetimes: the front starts the engine and waits for it to load the model; on shutdown it drains the engine
(finish or abort requests, persist sessions) and waits for it to exit. If the engine process dies, every request in
flight fails with EngineStopped, `alive` turns False at once (so /health answers 503) and `on_death` is called (the
server then exits). If the front dies, the engine reads the end of the pipe and exits as a crash of the whole server
would (completed turns already written through to the store stay there): no orphan process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from kvfree.engine.protocol import EngineConfig, EngineInfo, EngineRequest, EngineStopped
from kvfree.engine.serving.handle import EngineHandle, Outputs
from kvfree.engine.serving.ipc import (
    error_from_wire,
    info_from_wire,
    output_from_wire,
    pack,
    request_to_wire,
    result_from_wire,
    unpack,
)
from kvfree.engine.serving.process_loop import serve_engine
from kvfree.engine.sessions.store import SessionStore, open_store
from kvfree.engine.text.tokenizer import Tokenizer

log = logging.getLogger("kvfree.engine")


class ProcessDriver(EngineHandle):
    """An engine in its own process, behind the `EngineHandle` interface. Construction starts the process and waits for
    the model to load (raising the engine's error if it cannot); `start()` inside the event loop begins serving.

    Args:
        config: what to load and the serving limits.
        start_timeout: seconds to wait for the engine to load.
        on_death: called (on the event loop) when the engine process dies while serving.
    """

    def __init__(
        self, config: EngineConfig, start_timeout: float = 900.0, on_death: Callable[[], None] | None = None
    ) -> None:
        self.config = config
        self.on_death = on_death
        self.died = False  # the engine process ended without being told to
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(
            target=serve_engine, args=(config, child, logging.getLogger().getEffectiveLevel()), name="kvfree-engine"
        )
        self._process.start()
        child.close()
        ready = self._wait_ready(start_timeout)
        self.info: EngineInfo = info_from_wire(ready)
        self.tokenizer = Tokenizer(self.info.checkpoint)
        self.accepting = False
        self._stopping = False
        self._stats: dict[str, Any] = {}
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._outgoing: queue.Queue[bytes | None] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: SessionStore | None = None

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if self._conn.poll(0.2):
                try:
                    message = unpack(self._conn.recv_bytes())
                except EOFError:
                    break
                if message[0] == "ready":
                    return message[1]
                if message[0] == "failed":
                    self._process.join(10)
                    raise error_from_wire(*message[1:])
                if message[0] == "stats":
                    continue
            if not self._process.is_alive() or time.monotonic() > deadline:
                break
        self._process.kill()
        raise RuntimeError(f"the engine process did not start (exit code {self._process.exitcode})")

    # -- lifecycle ------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self.died and self._process.is_alive() and self._loop is not None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        """Begin serving: one thread reads the engine's frames, one writes the front's (the event loop never blocks
        on the pipe)."""
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="kvfree-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="kvfree-engine-writer", daemon=True).start()
        self.accepting = True

    async def shutdown(self, grace_seconds: float = 10.0) -> None:
        """Stop admitting, let running requests finish for up to `grace_seconds`, abort the rest, persist sessions,
        and wait for the engine process to exit."""
        self.accepting = False
        self._stopping = True
        if self.alive:
            try:
                await self._drain(grace_seconds)
                await self.call("stop")
            except EngineStopped:
                log.error("the engine process stopped during shutdown")
        else:
            log.error("the engine process had stopped: nothing to finish, sessions in memory are not persisted")
        self._outgoing.put(None)
        await asyncio.to_thread(self._process.join, 30)
        if self._process.is_alive():
            log.error("the engine process did not exit; killing it")
            self._process.kill()
        self._conn.close()

    def _read(self) -> None:
        while True:
            try:
                frame = self._conn.recv_bytes()
            except (EOFError, OSError):
                break
            self._loop.call_soon_threadsafe(self._dispatch, unpack(frame))
        self._loop.call_soon_threadsafe(self._gone)

    def _write(self) -> None:
        while (frame := self._outgoing.get()) is not None:
            try:
                self._conn.send_bytes(frame)
            except OSError:
                return

    def _send(self, message: list) -> None:
        self._outgoing.put(pack(message))

    def _dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "outputs":
            for request_id, out in message[1]:
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put_nowait(output_from_wire(request_id, out))
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "result":
            _, call_id, ok, value = message
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(error_from_wire(*value))

    def _gone(self) -> None:
        """The engine's end of the pipe closed: fail what waits on it; if it was not told to stop, it died (`alive`
        False while `accepting` stays True: what /health reports as 503)."""
        stopped = EngineStopped("the engine process has stopped; restart the server")
        for stream in self._streams.values():
            stream.put_nowait(stopped)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(stopped)
        self._calls.clear()
        if not self._stopping:
            self.died = True
            self._process.join(1)
            log.error("the engine process died (exit code %s)", self._process.exitcode)
            if self.on_death is not None:
                self.on_death()

    # -- EngineHandle ---------------------------------------------------------------------------------------------
    async def call(self, method: str, *args: Any) -> Any:
        if not self.alive:
            raise EngineStopped("the engine process has stopped; restart the server")
        call_id = next(self._ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(["call", call_id, method, list(args)])
        return result_from_wire(method, await future)

    async def _submit(self, request: EngineRequest, outputs: Outputs) -> None:
        self._streams[request.request_id] = outputs  # admission errors arrive as the request's first output
        self._send(["submit", *request_to_wire(request)])

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def abort(self, request_id: str, choice: int | None = None) -> None:
        self._send(["abort", request_id, choice])

    # -- the rest of the interface --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The engine's counters as it last pushed them: fresh after every session operation, every step that admitted
        or retired requests, and whenever the engine goes idle; at most `STATS_INTERVAL_S` old otherwise."""
        return self._stats

    @property
    def session_store(self) -> SessionStore | None:
        """This process's own client of the engine's session store (stored responses go there too), if any."""
        if self._store is None and self.config.session_store:
            c = self.config
            self._store = open_store(
                c.session_store, self.info.fingerprint, c.hmac_key, ttl_seconds=c.session_ttl_seconds,
                lease_seconds=c.session_lease_seconds,
            )  # fmt: skip
        return self._store

    def kill(self) -> None:
        """Kill the engine process (tests of what happens when it dies)."""
        os.kill(self._process.pid, signal.SIGKILL)
