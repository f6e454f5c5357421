"""Scheduler: continuous batching over the state pool (docs/design/architecture.md §5).

Each `step()` decodes one token for every running sequence, then spends the rest of a token budget on prefill
chunks of admitted ones, so a long prompt is fed over several steps and never stalls the others. Admission takes a
slot for each sequence through the SessionManager, which evicts idle sessions to host memory or disk when the
pool is full. Everything here runs on the engine thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvfree.engine.model_runner import ModelRunner
from kvfree.engine.sampling import SamplingParams
from kvfree.engine.sequence import Sequence, TokenLogprob
from kvfree.engine.sessions import PoolExhausted, Session, SessionManager
from kvfree.engine.tokenizer import Tokenizer


@dataclass
class Request:
    """One API request: a prompt continued by `n` choices, optionally inside a persistent session.

    prefill_only: feed the prompt into the session and stop (creating a session with a prompt).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[RequestOutput], None]
    n: int = 1
    session: Session | None = None
    prefill_only: bool = False
    arrival: float = field(default_factory=time.monotonic)
    cached_tokens: int = 0
    sequences: list[Sequence] = field(default_factory=list)
    aborted: bool = False


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


class QueueFull(RuntimeError):
    """The waiting queue is at its limit: the client should retry later (HTTP 429)."""


class Scheduler:
    """Owns the waiting queue and the running sequences of one model."""

    def __init__(
        self,
        runner: ModelRunner,
        sessions: SessionManager,
        tokenizer: Tokenizer,
        max_waiting: int = 256,
        max_batch_tokens: int = 2048,
    ) -> None:
        self.runner = runner
        self.sessions = sessions
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # -- queue --------------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        if request.session is not None:
            request.session.busy = True  # reserved from now on: no other request may use it concurrently
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request (client gone). Its slots are freed; a session keeps what it has consumed so far."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.aborted = True
                self._release_session(req)
                return True
        for req in self.running:
            if req.request_id == request_id:
                req.aborted = True
                for seq in req.sequences:
                    if not seq.finished:
                        seq.finish_reason = "abort"
                return True
        return False

    # -- one step -----------------------------------------------------------------------------------------------
    def step(self) -> None:
        self._admit()
        decoding = [s for r in self.running for s in r.sequences if s.prefill_done and not s.finished]
        if decoding:
            logits = self.runner.decode(decoding)
            for seq in decoding:
                seq.decoded += 1
            self.runner.sample(decoding, logits)
            self._emit(decoding)
        self._prefill(budget=max(1, self.max_batch_tokens - len(decoding)))
        self._retire()

    def _admit(self) -> None:
        """Move waiting requests to running while slots can be found for all their choices."""
        while self.waiting:
            req = self.waiting[0]
            try:
                slots = self._take_slots(req)
            except PoolExhausted:
                return
            self.waiting.popleft()
            self._start(req, slots)
            self.running.append(req)

    def _take_slots(self, req: Request) -> list[int]:
        """One slot per choice: the session's own for choice 0, ephemeral ones for the rest (all or nothing)."""
        taken: list[Session] = []
        try:
            first = req.session or self.sessions.create(owner=None, ephemeral=True)
            if req.session is None:
                taken.append(first)
            slots = [self.sessions.acquire_slot(first)]
            for _ in range(req.n - 1):
                extra = self.sessions.create(owner=None, ephemeral=True)
                taken.append(extra)
                slots.append(self.sessions.acquire_slot(extra))
        except PoolExhausted:
            for s in taken:
                self.sessions.delete(s)
            if req.session is not None and req.session.slot is not None:
                self.sessions.release(req.session)
                req.session.busy = True
            raise
        req.ephemeral = taken  # type: ignore[attr-defined]
        return slots

    def _start(self, req: Request, slots: list[int]) -> None:
        prompt = req.prompt_token_ids
        session = req.session
        if (
            session is not None
            and session.num_tokens
            and session.num_tokens < len(prompt)
            and (session.is_prefix_of(prompt))
        ):
            req.cached_tokens = session.num_tokens
        elif session is not None and session.num_tokens:
            # Not a continuation of what the session holds: start it over from a new state.
            self.sessions.reset(session)
        to_feed = prompt[req.cached_tokens :]
        device = self.runner.device
        vocab = self.runner.model.config.vocab_size
        for index, slot in enumerate(slots):
            params = req.params
            if req.n > 1 and params.seed is not None:
                params = _with_seed(params, params.seed + index)  # independent but reproducible choices
            seq = Sequence.create(prompt, params, self.tokenizer, vocab, device)
            seq.slot = slot
            seq.request_id = req.request_id
            seq.index = index
            seq.to_prefill = to_feed if index == 0 else []
            seq.session = session if index == 0 else None
            req.sequences.append(seq)

    def _prefill(self, budget: int) -> None:
        batch, chunks = [], []
        for req in self.running:
            seq = req.sequences[0]
            if seq.prefill_done or seq.finished or budget <= 0:
                continue
            n = min(len(seq.to_prefill) - seq.prefilled, budget)
            batch.append(seq)
            chunks.append(seq.to_prefill[seq.prefilled : seq.prefilled + n])
            budget -= n
        if not batch:
            return
        logits = self.runner.prefill(batch, chunks)
        done_rows = []
        for row, (seq, chunk) in enumerate(zip(batch, chunks, strict=True)):
            seq.prefilled += len(chunk)
            if seq.prefilled == len(seq.to_prefill):
                done_rows.append(row)
        for row in done_rows:
            self._first_tokens(batch[row], logits[row])

    def _first_tokens(self, first: Sequence, logits: torch.Tensor) -> None:
        """The prompt is in: fork the state to the other choices and sample each one's first token."""
        req = next(r for r in self.running if r.sequences[0] is first)
        for seq in req.sequences:
            seq.prefill_done = True
            if seq is not first:
                self.runner.pool.copy(first.slot, seq.slot)
        if req.prefill_only:
            first.finish_reason = "prefill"
            self._emit([first])
            return
        self.runner.sample(req.sequences, logits.expand(len(req.sequences), -1))
        self._emit(req.sequences)

    def _emit(self, seqs: list[Sequence]) -> None:
        by_id = {r.request_id: r for r in self.running}
        for seq in seqs:
            req = by_id[seq.request_id]
            new_tokens = seq.output_token_ids[seq.emitted_tokens :]
            new_logprobs = seq.logprobs[seq.emitted_tokens :] if seq.params.logprobs is not None else []
            seq.emitted_tokens = len(seq.output_token_ids)
            req.emit(
                RequestOutput(
                    request_id=req.request_id,
                    index=seq.index,
                    token_ids=new_tokens,
                    text=seq.take_delta(),
                    logprobs=new_logprobs,
                    finish_reason=seq.finish_reason,
                    prompt_tokens=len(req.prompt_token_ids),
                    cached_tokens=req.cached_tokens,
                    completion_tokens=len(seq.output_token_ids),
                )
            )

    def _retire(self) -> None:
        """Free what finished requests hold; sessions keep their state (and what it consumed)."""
        still = []
        for req in self.running:
            if all(s.finished for s in req.sequences):
                aborted = [s for s in req.sequences if s.finish_reason == "abort"]
                if aborted:
                    self._emit(aborted)
                for extra in getattr(req, "ephemeral", []):
                    self.sessions.delete(extra)
                self._release_session(req)
            else:
                still.append(req)
        self.running = still

    def _release_session(self, req: Request) -> None:
        if req.session is None:
            return
        first = req.sequences[0] if req.sequences else None
        if first is not None:
            req.session.extend(first.consumed)
        req.session.busy = False
        if req.session.slot is not None:
            self.sessions.release(req.session)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
