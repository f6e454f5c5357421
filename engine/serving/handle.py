"""EngineHandle: what an HTTP front holds of an engine, whichever driver runs it (a thread here, or its own process).

The two drivers, `ThreadDriver` (engine/serving/thread_driver.py) and `ProcessDriver`
(engine/serving/process_driver.py), differ only in how a command reaches the `EngineCore` and how outputs come back:
each implements `_submit`, `call` (one of `ENGINE_CALLS` by name) and `abort`. Everything else a front uses is
written once: `generate` and the drain that ends `shutdown` here, the session operations in `SessionOperations`
(engine/protocol.py), each one `call`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvfree.engine.protocol import (
    EngineInfo,
    EngineRequest,
    EngineStopped,
    RequestOutput,
    SamplingParams,
    SessionOperations,
)

Outputs = asyncio.Queue  # of RequestOutput | BaseException: one request's outputs, as the driver delivers them


class EngineHandle(SessionOperations):
    """The interface a front uses; a driver implements `alive`, `_submit`, `call` and `abort` (the session
    operations are `SessionOperations`', each one `call`).

    Attributes: `info` (the engine's facts, an EngineInfo), `tokenizer`, `accepting` (False before `start()` and once
    `shutdown()` began).
    """

    info: EngineInfo
    accepting: bool = False

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    async def _submit(self, request: EngineRequest, outputs: Outputs) -> None:
        """Hand the request to the engine; its outputs (or an admission error) arrive on `outputs`."""
        raise NotImplementedError

    async def call(self, method: str, *args: Any) -> Any:
        """`EngineCore.call(method, args)` on the engine's side, between steps; raises its exception."""
        raise NotImplementedError

    def abort(self, request_id: str, choice: int | None = None) -> None:
        """Stop a request (its client went away, or its front found a stop string in every choice): its choices end
        with finish "abort" and its slots are freed. With `choice`, only that choice ends (its front found a stop
        string in it while others run on); the slots are freed when the last one ends."""
        raise NotImplementedError

    def _forget(self, request_id: str) -> None:
        """The request's stream is closed: drop what the driver keeps for it."""

    # -- generation -----------------------------------------------------------------------------------------------
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
        checkpoint_at: tuple[int, ...] = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: one RequestOutput per choice per step; each choice ends with a finish_reason.

        Admission errors (QueueFull, SessionNotFound, SessionBusy, EngineStopped) are raised before anything is
        streamed. If the caller stops iterating early (client gone), the request is aborted and its slots are freed.
        Without `detokenize` the outputs carry no text and stop strings are the caller's (see `EngineCore.submit`).
        `request_id` must be unique among the requests running (a front makes it so). `checkpoint_at`: prompt
        lengths where the prefix cache keeps the state too (`EngineRequest`).
        """
        if not self.accepting or not self.alive:
            raise EngineStopped("the server is shutting down" if self.alive else "the engine has stopped")
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        outputs: Outputs = asyncio.Queue()
        try:
            request = EngineRequest(
                request_id, list(prompt_token_ids), params, n=n, session_id=session_id, owner=owner,
                prefill_only=prefill_only, detokenize=detokenize, checkpoint_at=tuple(checkpoint_at),
            )  # fmt: skip
            await self._submit(request, outputs)
            async for out in stream_outputs(outputs, n, prefill_only, lambda: self.abort(request_id)):
                yield out
        finally:
            self._forget(request_id)

    # -- shutdown -------------------------------------------------------------------------------------------------
    async def _drain(self, grace_seconds: float) -> None:
        """Let running requests finish for up to `grace_seconds`, abort the rest, persist sessions."""
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline and await self.call("has_work"):
            await asyncio.sleep(0.05)
        await self.call("abort_all")
        while await self.call("has_work"):  # the driver steps the aborted requests out (their slots freed)
            await asyncio.sleep(0.01)
        await self.call("persist_all")


async def stream_outputs(
    outputs: Outputs, n: int, prefill_only: bool, abort: Callable[[], None]
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


def _coalesced(first: RequestOutput | BaseException, queued: Outputs) -> list[RequestOutput | BaseException]:
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
