"""A request's life in the engine, and the one place the server talks to the engine (`EngineClient`).

Every route that runs the model (chat, completions, responses, a session's prefill) goes the same way:
`check` (vocabulary, prompt length, context, choices) -> `start` (submit and wait for the first output, so that
admission errors become HTTP errors before a response or a stream is started) -> iterate the `Generation` (its tokens
counted, TTFT and inter-token latency timed as they arrive) -> `finish` (usage and metrics) or `aclose` (the
client went away: the engine aborts the request and frees its slots). The session operations, health and stats go
through `EngineClient` too, and what the routes need to know of the engine is its `EngineInfo`. Routes never hold
the engine: a `ProcessDriver` (the engine core in a process of its own, the default) or a `ThreadDriver` (on a
thread of this process), which answer to the same calls. Outputs arrive as token ids; their text and stop strings
are made here (server/detokenize.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import anyio
from fastapi import Request

from kvfree.engine.protocol import (
    FRONT_ERRORS,
    EngineInfo,
    EngineStopped,
    Grammar,
    GrammarError,
    PoolExhausted,
    QueueFull,
    RequestOutput,
    SamplingParams,
    SessionBusy,
    SessionLimitError,
    SessionNotFound,
    SessionOperations,
    SessionRecord,
    SessionStoreError,
    SnapshotError,
    SnapshotMismatchError,
)
from kvfree.engine.serving.handle import EngineHandle
from kvfree.engine.text.grammar import check_grammar
from kvfree.engine.text.tokenizer import LONG_TEXT_CHARS, Tokenizer
from kvfree.server.detokenize import ChoiceTexts
from kvfree.server.errors import (
    APIError,
    conflict,
    invalid_request,
    not_found,
    prompt_too_long,
    prompt_too_many_chars,
    service_unavailable,
    too_many_requests,
)
from kvfree.server.metrics import Metrics, RequestTimer
from kvfree.server.protocol import SessionUsage, new_id

T = TypeVar("T")

STORE_PING_TIMEOUT_S = 2.0  # a store that does not answer a ping this fast is reported unavailable

# -- engine errors --------------------------------------------------------------------------------------------------

ENGINE_ERRORS = FRONT_ERRORS  # (the contract's list: every error the engine answers a front with)


def engine_error(exc: Exception) -> APIError:
    """The HTTP error for an engine exception that a client caused or can retry (others are re-raised)."""
    if isinstance(exc, QueueFull):
        return too_many_requests(retry_after=1, message=f"server busy: {exc}; retry later")
    if isinstance(exc, PoolExhausted):
        return too_many_requests(retry_after=1, message=f"no state slot free: {exc}; retry later")
    if isinstance(exc, SessionLimitError):
        return too_many_requests(message=f"no room for another session: {exc}")
    if isinstance(exc, SessionNotFound):
        return not_found(str(exc), "session_id")
    if isinstance(exc, SessionBusy):
        return conflict(str(exc), "session_id", code="session_busy", retry_after=1)
    if isinstance(exc, EngineStopped):
        return service_unavailable(str(exc), retry_after=5)
    if isinstance(exc, SessionStoreError):
        return service_unavailable(f"{exc}; requests without a session still work", retry_after=5)
    if isinstance(exc, SnapshotError):
        return invalid_request(str(exc), "snapshot", code=exc.code)
    if isinstance(exc, SnapshotMismatchError):
        return invalid_request(f"snapshot does not fit this model: {exc}", "snapshot", code="model_mismatch")
    if isinstance(exc, GrammarError):  # (what the front's check could not see: the model's vocabulary)
        message = (
            "the reply's grammar (response_format, structured_outputs, tools or text.format) cannot be used with this "
            f"model's vocabulary: {exc}"
        )
        return invalid_request(message, None)
    raise exc


@contextlib.contextmanager
def http_errors(metrics: Metrics | None = None) -> Iterator[None]:
    """Engine exceptions raised inside become their HTTP errors; with `metrics`, each counts as a rejection."""
    try:
        yield
    except ENGINE_ERRORS as exc:
        if metrics is not None:
            metrics.count_rejected(type(exc).__name__)
        raise engine_error(exc) from None


# -- the engine, as the routes see it -------------------------------------------------------------------------------


class EngineClient(SessionOperations):
    """The server's side of the engine: checks, generation, session operations, health and stats.

    Session operations raise the engine's exceptions (wrap them in `http_errors()`, or catch the ones a route
    answers its own way); `start` answers admission errors as HTTP errors itself.
    """

    def __init__(self, engine: EngineHandle, metrics: Metrics, max_prompt_tokens: int, tokenizer: Tokenizer) -> None:
        self._engine = engine
        self.metrics = metrics
        self.max_prompt_tokens = max_prompt_tokens
        self.tokenizer = tokenizer  # the front's: outputs are detokenized here, not in the engine

    @property
    def info(self) -> EngineInfo:
        return self._engine.info

    @property
    def alive(self) -> bool:
        """The engine (its thread or its process) is running (False before start and after it died or stopped)."""
        return self._engine.alive

    @property
    def accepting(self) -> bool:
        """The engine takes new work (False while starting and shutting down)."""
        return self._engine.accepting

    def abort(self, engine_request_id: str, choice: int | None = None) -> None:
        """Stop a request in the engine, or only its choice `choice` (it answers with their last outputs, finish
        "abort")."""
        self._engine.abort(engine_request_id, choice)

    def stats(self) -> dict[str, Any]:
        """The engine's counters for /metrics (`EngineCore.stats`, as the engine last reported them)."""
        return self._engine.stats()

    async def session_store_problem(self) -> str | None:
        """Why the session store cannot be used now, or None when it can (or there is none): what /ready reports,
        and why a turn that must be stored is refused before it runs."""
        store = self._engine.session_store
        if store is None:
            return None
        try:
            await asyncio.wait_for(asyncio.to_thread(store.ping), STORE_PING_TIMEOUT_S)
        except SessionStoreError as exc:
            return str(exc)
        except TimeoutError:
            return f"the session store did not answer within {STORE_PING_TIMEOUT_S:g} s"
        return None

    # -- tokenizing prompts ---------------------------------------------------------------------------------------
    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """A 400 `context_length_exceeded` for a prompt text of `num_chars` characters that cannot fit the prompt
        limit whatever it tokenizes to (a bound from the longest token: no need to tokenize megabytes to say no)."""
        fewest = -(-num_chars // self.tokenizer.max_token_chars)
        if fewest > self.max_prompt_tokens:
            raise prompt_too_many_chars(num_chars, fewest, self.max_prompt_tokens, param)

    async def encode_prompt(self, text: str, param: str) -> list[int]:
        """A prompt's token ids, after `check_prompt_chars`."""
        self.check_prompt_chars(len(text), param)
        return await self.tokenize(self.tokenizer.encode, text)

    async def tokenize(self, encode: Callable[[str], T], text: str) -> T:
        """`encode(text)`: inline for a short text, on a worker thread for a long one (tokenizing a megabyte takes
        seconds, during which the event loop would serve no one else; a long text's tokenizing releases the
        interpreter lock, `Tokenizer.encode`)."""
        if len(text) <= LONG_TEXT_CHARS:
            return encode(text)
        return await asyncio.to_thread(encode, text)

    async def boundaries(self, prefixes: list[str], prompt_ids: list[int]) -> list[int]:
        """The token lengths of `prefixes` (prompt texts ending at message boundaries) where they tokenize to a
        prefix of `prompt_ids`: where the prefix cache should keep the state (a prefix that tokenizes otherwise
        inside the whole prompt marks nothing)."""
        out = []
        for text in prefixes:
            ids = await self.tokenize(self.tokenizer.encode, text)
            if 0 < len(ids) < len(prompt_ids) and prompt_ids[: len(ids)] == ids:
                out.append(len(ids))
        return out

    # -- checks, before anything reaches the engine ---------------------------------------------------------------
    async def constrain(self, params: SamplingParams, grammar: Grammar | None, param: str) -> SamplingParams:
        """`params` with the reply held to `grammar` (server/structured_outputs.py), after a check: a 400 naming
        `param` when the grammar cannot be compiled (bad syntax, a JSON-schema keyword llguidance does not support),
        found before the request reaches the engine. Checked without a tokenizer (what a grammar says of tokens, a
        special token's name, is the engine's to check: a 400 too), on a worker thread."""
        if grammar is None:
            return params
        try:
            await asyncio.to_thread(check_grammar, grammar)
        except GrammarError as e:
            raise invalid_request(f"{param} cannot be enforced: {e}", param) from None
        return replace(params, grammar=grammar)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """A 400 naming `param` when a token id is outside the vocabulary."""
        vocab = self.info.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise invalid_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param)

    def check(
        self, ids: list[int], params: SamplingParams, param: str, *, n: int = 1, session_id: str | None = None
    ) -> None:
        """Vocabulary (of the prompt and of `logit_bias`), prompt length, the KV-cache limit of models with full
        attention, and `n` choices."""
        self.check_token_ids(ids, param)
        self.check_token_ids(list(params.logit_bias), "logit_bias")
        if len(ids) > self.max_prompt_tokens:
            raise prompt_too_long(len(ids), self.max_prompt_tokens, param)
        context = self.info.context_limit
        if context is not None and len(ids) + params.max_tokens > context:
            raise invalid_request(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds this model's context of "
                f"{context} tokens (its attention layers keep a KV cache of that size)",
                "max_tokens",
            )
        slots = self.info.gpu_slots
        if n > slots:  # each choice needs a state slot at once: more than the pool has could never be admitted
            raise invalid_request(f"n={n} exceeds this server's {slots} state slots (--max-sessions)", "n")
        if session_id is not None and n > 1:
            message = "n > 1 cannot be combined with session_id (a session continues one conversation)"
            raise invalid_request(message, "n")

    # -- generation -----------------------------------------------------------------------------------------------
    async def start(
        self,
        request: Request,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        n: int = 1,
        session_id: str | None = None,
        owner: str | None = None,
        prefill_only: bool = False,
        session_usage: bool = False,
        checkpoint_at: list[int] | None = None,
    ) -> Generation:
        """Submit a checked request and wait for its first output (admission errors: HTTP errors, counted as
        rejections). With `session_usage`, the session is looked up first, for `Generation.session_usage`.
        `checkpoint_at`: prompt lengths where the prefix cache keeps the state too (message boundaries)."""
        gen = Generation(self, request, prompt_ids, params, n, session_id, owner)
        if session_usage and session_id is not None:
            with http_errors():
                gen.session_before = await self._engine.get_session(session_id, owner)
        gen.timer = self.metrics.request_timer()
        stream = self._engine.generate(
            prompt_ids, params, n=n, session_id=session_id, owner=owner, request_id=gen.engine_request_id,
            prefill_only=prefill_only, detokenize=False, checkpoint_at=tuple(checkpoint_at or ()),
        )  # fmt: skip
        with http_errors(self.metrics):
            first = await anext(stream)
        gen._stream, gen._first = stream, first
        return gen

    # -- sessions: `SessionOperations`' methods, each this one call (the engine's exceptions are raised as they are)
    async def call(self, method: str, *args: Any) -> Any:
        return await self._engine.call(method, *args)


# -- one request ----------------------------------------------------------------------------------------------------

_engine_ids = itertools.count()


class Generation:
    """One started request: iterate it for its outputs (one per choice per step, the first already received), then
    `finish()` it for its usage; `aclose()` it in any case, which aborts it in the engine if it has not ended.

    As outputs pass by it counts them: `completion_tokens` (all choices), `cached_tokens` (prompt tokens a
    session's state already held), `finish_reason` (the first choice's), and times them (`timer`).
    """

    def __init__(
        self,
        client: EngineClient,
        request: Request,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        session_id: str | None,
        owner: str | None,
    ) -> None:
        self.client = client
        self.request = request
        self.prompt_ids = prompt_ids
        self.params = params
        self.n = n
        self.session_id = session_id
        self.owner = owner
        self.request_id: str = getattr(request.state, "request_id", None) or new_id("req")
        # Unique in the engine whatever request id the client sent (two requests may share one).
        self.engine_request_id = f"{self.request_id}.{next(_engine_ids)}"
        self.session_before: SessionRecord | None = None
        self.timer: RequestTimer | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self._stream: AsyncIterator[RequestOutput] | None = None
        self._first: RequestOutput | None = None
        self._texts = ChoiceTexts(client.tokenizer, params, n)  # the engine sends token ids; text is made here

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        first, self._first = self._first, None
        outputs = self._stream if first is None else _then(first, self._stream)
        engine_done = [False] * self.n
        last: RequestOutput | None = None
        # An engine error in mid-request (the engine died, a store write failed) is an HTTP error for every route.
        with http_errors():
            async for raw in outputs:
                if raw.finish_reason is not None:
                    engine_done[raw.index] = True
                if last is not None:
                    continue  # what the engine ran after the stop, until its abort lands
                out = self._texts.add(raw)
                if out is None:
                    continue
                self._count(out)
                if out.finish_reason is not None and self._texts.all_finished and not all(engine_done):
                    # Every choice ended here (a stop string) while the engine still runs some: stop them, and send
                    # the last event once the engine has (its session's turn is then recorded before the client can
                    # send the next one, as when the engine itself ends a turn).
                    self.client.abort(self.engine_request_id)
                    last = out
                    continue
                if out.finish_reason is not None and not engine_done[out.index]:
                    # This choice ended here while others run on: the engine stops decoding it now, not when the
                    # others end.
                    self.client.abort(self.engine_request_id, out.index)
                yield out
        if last is not None:
            yield last

    def _count(self, out: RequestOutput) -> None:
        self.completion_tokens += len(out.token_ids)
        self.cached_tokens = out.cached_tokens
        if out.index == 0 and out.finish_reason is not None:
            self.finish_reason = out.finish_reason
        self.timer.tokens(len(out.token_ids))

    def finish(self) -> None:
        """The request ended: count its tokens and end-to-end latency, and leave its usage for the access log."""
        usage = (self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        self.client.metrics.count_tokens(*usage, self.finish_reason)
        self.timer.finish()
        self.request.state.usage = usage

    async def aclose(self) -> None:
        """Nothing once the request has ended; before that (the client went away, or the route stopped reading)
        the engine aborts it and frees its slots. Shielded, so that it runs in a cancelled task too."""
        if self._stream is not None:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await self._stream.aclose()

    async def session_usage(self) -> SessionUsage | None:
        """How the request used its session (None without one); needs `start(..., session_usage=True)`."""
        if self.session_id is None:
            return None
        session = await self.client.get_session(self.session_id, self.owner)
        before = self.session_before
        # Not a continuation: the session started over, from nothing or from a prefix cache checkpoint (a
        # continuation reuses exactly what the session held).
        reset = before is not None and before.num_tokens > 0 and self.cached_tokens != before.num_tokens
        location = before.location if before is not None else None
        # "disk" is the session store (a directory or Redis): the state was loaded, not found resident.
        resumed_from = "store" if location == "disk" else location
        return SessionUsage(
            id=self.session_id, cached_tokens=self.cached_tokens, reset=reset, num_tokens=session.num_tokens,
            resumed_from=resumed_from,
        )  # fmt: skip


async def _then(first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in rest:
        yield out
