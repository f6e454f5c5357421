"""The engine process's side of `kvfree serve`: `serve_engine` (its main) and `ProcessLoop` (its busy loop).

The front starts this process with `spawn` (engine/serving/process_driver.py) and talks to it over a pipe in msgpack
frames (engine/serving/ipc.py). The loop builds the engine core, says it is ready, then takes the front's commands
between steps and sends each step's outputs for every request back in one frame. If the front dies, the loop reads
the end of the pipe and exits as a crash of the whole server would: no orphan process.
"""

from __future__ import annotations

import logging
import signal
import time
from multiprocessing.connection import Connection

import torch

from kvfree.engine.core.scheduler import Output
from kvfree.engine.protocol import EngineConfig
from kvfree.engine.serving.engine_core import EngineCore, build_engine
from kvfree.engine.serving.ipc import (
    ERRORS,
    error_to_wire,
    info_to_wire,
    output_to_wire,
    pack,
    request_from_wire,
    result_to_wire,
    unpack,
)

log = logging.getLogger("kvfree.engine")

STATS_INTERVAL_S = 0.05  # a busy engine pushes its counters to the front at least this often

def serve_engine(config: EngineConfig, conn: Connection, log_level: int = logging.INFO) -> None:
    """The engine process's main: build the engine, say it is ready, serve the front until told to stop or the front
    is gone."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    # The front owns the signals: Ctrl-C or SIGTERM to the process group must not kill the engine before the front
    # has drained it. A front that dies closes the pipe, which the loop reads as the end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        core = build_engine(config)
        core.load_index()
    except Exception as exc:
        if type(exc).__name__ in ERRORS:  # a bad checkpoint or setting: the front reports it in one line
            log.error("the engine could not start: %s", exc)
        else:
            log.exception("the engine could not start")
        conn.send_bytes(pack(["failed", *error_to_wire(exc)]))
        return
    ProcessLoop(core, conn).run()


class ProcessLoop:
    """The engine process's busy loop: commands between steps, one frame of outputs per step."""

    def __init__(self, core: EngineCore, conn: Connection) -> None:
        self.core = core
        self.conn = conn
        self.refused: list[Output] = []  # the errors of this round's submits, refused at admission
        self._stats_sent = 0.0
        self._front_gone: OSError | None = None  # a send of outputs found the pipe closed (inside a step)

    def run(self) -> None:
        torch.set_grad_enabled(False)
        core = self.core
        self._send(["ready", info_to_wire(core.info)])
        self._send_stats()
        try:
            while True:
                idle = not core.has_work
                # Idle: sleep on the pipe (waking now and then for background writes and the counters).
                timeout = (0.05 if core.writing else 1.0) if idle else 0.0
                if self.conn.poll(timeout):
                    while True:
                        if not self._handle(unpack(self.conn.recv_bytes())):
                            return
                        if not self.conn.poll(0):
                            break
                    self._send_outputs(self.refused)
                    self.refused = []
                shape = self._shape()
                admitted_or_retired = False
                if core.has_work:
                    outputs = core.step(self._send_outputs)
                    admitted_or_retired = self._shape() != shape
                    if admitted_or_retired:
                        # Such a step's counters go out before its outputs: a client that sees its request end and
                        # then reads /metrics finds this step counted.
                        self._send_stats()
                    self._send_outputs(outputs)
                if self._front_gone is not None:
                    raise self._front_gone
                core.poll_store()
                # Counters also go out when the engine goes idle, and at least every STATS_INTERVAL_S while it is busy
                # (what the store's background work changed goes out with the next of these).
                if not admitted_or_retired and (
                    not core.has_work or time.monotonic() - self._stats_sent >= STATS_INTERVAL_S
                ):
                    self._send_stats()
        except (EOFError, OSError):
            # The front died without draining the engine (a drain ends with "stop"): exit as a crash of the whole
            # server would, keeping only what is already on its way to the store (write-through of completed turns).
            # Persisting now would store the turns the front's clients never saw completed.
            log.warning("the front has gone: exiting after the session writes under way")
            deadline = time.monotonic() + 10
            while core.writing and time.monotonic() < deadline:
                core.poll_store()
                time.sleep(0.01)
        finally:
            core.runtime.close()  # (the other tensor-parallel ranks, if any)

    def _shape(self) -> tuple[int, int, int]:
        """What a step can change that the counters report at once: waiting and running requests, used slots."""
        scheduler = self.core.scheduler
        return len(scheduler.waiting), len(scheduler.running), self.core.runtime.pool.used_slots

    def _handle(self, message: list) -> bool:
        """Carry out one command; False when the front says stop."""
        kind = message[0]
        if kind == "submit":
            request = request_from_wire(message[1:])
            try:
                self.core.submit(request)
            except Exception as exc:  # refused at admission: the request's one output is the error
                self.refused.append((request.request_id, exc))
        elif kind == "abort":
            _, request_id, choice = message
            self.core.abort(request_id, choice)
        elif kind == "call":
            _, call_id, method, args = message
            if method == "stop":
                self._send(["result", call_id, True, None])
                return False
            try:
                with torch.inference_mode():
                    value = result_to_wire(self.core.call(method, args))
            except Exception as exc:
                self._send_stats()
                self._send(["result", call_id, False, error_to_wire(exc)])
            else:
                self._send_stats()  # counters first: the caller sees them updated when its call returns
                self._send(["result", call_id, True, value])
        return True

    def _send_outputs(self, outputs: list[Output]) -> None:
        """One frame of outputs, each with its request id."""
        if outputs:
            items = [[request_id, output_to_wire(out)] for request_id, out in outputs]
            try:
                self._send(["outputs", items])
            except OSError as exc:
                # The front has gone (killed mid-step). Not the step's failure: the loop ends once the step returns.
                self._front_gone = exc

    def _send_stats(self) -> None:
        self._stats_sent = time.monotonic()
        self._send(["stats", self.core.stats()])

    def _send(self, message: list) -> None:
        self.conn.send_bytes(pack(message))


