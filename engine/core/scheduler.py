"""Scheduler: continuous batching over the state pool (docs/design/architecture.md §5).

The scheduler decides and never calls the model. `schedule()` admits waiting requests (a slot per choice through
the SessionManager, which evicts idle sessions to host memory or disk when the pool is full), picks every
running sequence for one decode token, and spends the rest of the step's token budget on prefill chunks, so a
long prompt is fed over several steps and never stalls the others. The runner runs that `ScheduledStep`;
`postprocess()` appends the sampled tokens, checks stops and returns each request's new outputs. Everything here
runs on the engine's one thread (a ThreadDriver's, or the engine process's loop).

What is scheduled is counted when scheduled (prefilled, decoded, num_sampled): the device runs steps in order, so
the next step can be scheduled before the previous one's tokens reach the host (engine/core/stepper.py).
"""

from __future__ import annotations

import math
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvfree.engine.core.sequence import Sequence
from kvfree.engine.protocol import (
    GrammarError,
    PoolExhausted,
    QueueFull,
    RequestOutput,
    SamplingParams,
    SessionStoreError,
    TokenLogprob,
)
from kvfree.engine.sessions.manager import Session, SessionManager
from kvfree.engine.sessions.prefix_cache import PrefixCache
from kvfree.engine.sessions.tiers import StateLoading
from kvfree.engine.text.grammar import GrammarCompiler, GrammarMatcher
from kvfree.engine.text.tokenizer import Tokenizer


@dataclass
class Request:
    """One API request: a prompt continued by `n` choices, optionally inside a persistent session.

    prefill_only: feed the prompt into the session and stop (creating a session with a prompt).
    detokenize: the outputs carry text, cut at stop strings; False: token ids only, for a client that detokenizes
        on its side (a serving front), stop strings left to it.
    owner: whose request it is (an API key's id): its checkpoints are found only by the same owner's requests.
    checkpoint_at: prompt lengths at which to keep a checkpoint besides the prompt's end (message boundaries).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    session: Session | None = None
    prefill_only: bool = False
    detokenize: bool = True
    owner: str | None = None
    checkpoint_at: tuple[int, ...] = ()
    arrival: float = field(default_factory=time.monotonic)
    cached_tokens: int = 0
    sequences: list[Sequence] = field(default_factory=list)
    ephemeral: list[Session] = field(default_factory=list)  # slot holders of choices 1..n-1 (or a sessionless 0)
    aborted: bool = False
    settled: bool = False  # the session has recorded (and stored) this turn
    failure: Exception | None = None  # the turn's state could not be stored, or its grammar failed: the request fails
    grammar: Future[GrammarMatcher] | None = None  # the output's grammar, compiling (`params.grammar`)
    checkpoints: list[Session] = field(default_factory=list)  # the prefix cache's, made while this request ran
    state_lost: bool = False  # a failed step left its slot's state unknown: nothing of it is kept



# What a step hands back for one request: a choice's new tokens, or the error that ends the request (its request id
# first, so that whoever submitted it finds it).
Output = tuple[str, RequestOutput | Exception]


@dataclass
class PromptScore:
    """Prompt logprobs one prefill chunk yields: the packed rows `row .. row + len(targets) - 1` of the step, each
    scored on the prompt token after it (`targets`), with the `top_k` most likely tokens."""

    seq: Sequence
    row: int
    targets: list[int]
    top_k: int


@dataclass
class ScheduledStep:
    """One engine step, as decided by the scheduler.

    decode: sequences that feed their last sampled token (on the device) and sample the next.
    prefill, chunks: sequences that feed `chunks[i]` of their prompt.
    forks: (from slot, to slot): after the prefill, a finished prompt's state is copied to its other choices.
    sample: the rows to sample, in order: every decode sequence, then the choices of each prompt that is complete
        after this step; `sample_source[i]` is the prefill row whose logits row `len(decode) + i` reads.
    admitted: sequences new this step (their sampling rows are set up before anything runs).
    prompt_done: prefill-only requests whose prompt is in after this step.
    refused: the errors of requests that failed while this step was decided, before they ran.
    scores: prompt logprobs to compute in this step's prefill, one `PromptScore` per sequence that asks for them.
    """

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[Sequence] = field(default_factory=list)
    chunks: list[list[int]] = field(default_factory=list)
    forks: list[tuple[int, int]] = field(default_factory=list)
    sample: list[Sequence] = field(default_factory=list)
    sample_source: list[int] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    prompt_done: list[Request] = field(default_factory=list)
    refused: list[Output] = field(default_factory=list)
    scores: list[PromptScore] = field(default_factory=list)

    @property
    def runs_model(self) -> bool:
        return bool(self.decode or self.prefill)


@dataclass
class SampledTokens:
    """What the runner returns for a step's `sample` rows: a token each, and its logprob where asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # one list per `ScheduledStep.scores`


PREFILL_ALIGN = 256  # prefill token budgets are rounded down to a multiple of this



class Scheduler:
    """Owns the waiting queue and the running requests of one model.

    Args:
        max_waiting: requests that may wait for a slot before `add` raises QueueFull.
        max_batch_tokens: tokens per step while sequences decode: one per decoding sequence, the rest for prefill
            chunks. It bounds how long a step (and so every decoding sequence's next token) can take: larger
            values admit prompts faster (lower time to first token), smaller ones keep the inter-token latency
            of running sequences low.
        max_prefill_tokens: prefill tokens per step when nothing decodes (no one is waiting on a token, so a
            larger chunk only speeds up prefill). Defaults to `max_batch_tokens`.
        prefill_batch_wait: seconds a new prompt may wait, while sequences decode, for others to share its
            prefill step. A prefill step has a fixed cost whatever its size (on a GPU, milliseconds replayed from a
            CUDA graph, tens of them launched eagerly), and every decoding sequence waits for it; sharing one step
            among several prompts raises throughput and makes fewer long steps, at the price of up to this much
            time to first token. 0: never wait.
        grammars: compiles the grammars of structured-output requests (for the model's vocabulary, which may be
            larger than the tokenizer's); by default one over the tokenizer's.
        prefix_cache: where requests leave checkpoints and resume from them (None: no reuse beyond sessions).
    """

    def __init__(
        self,
        sessions: SessionManager,
        tokenizer: Tokenizer,
        max_waiting: int = 256,
        max_batch_tokens: int = 2048,
        max_prefill_tokens: int | None = None,
        prefill_batch_wait: float = 0.0,
        grammars: GrammarCompiler | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.sessions = sessions
        self.prefix_cache = prefix_cache
        self.grammars = grammars or GrammarCompiler(tokenizer)
        self.tokenizer = tokenizer
        self.max_waiting = max_waiting
        self.max_batch_tokens = max_batch_tokens
        self.max_prefill_tokens = max(max_prefill_tokens or max_batch_tokens, max_batch_tokens)
        self.prefill_batch_wait = prefill_batch_wait
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Checkpoints made by the step being decided, held (busy) until it is launched: their forks fill them.
        self._filling: list[Session] = []

    # -- queue --------------------------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        if request.params.grammar is not None:  # compiled off the engine thread; admitted once it is
            request.grammar = self.grammars.compile_async(request.params.grammar)
        if request.session is not None:
            self.sessions.reserve(request.session)  # no other request may use it now; a stored one starts loading
        self.waiting.append(request)

    def abort(self, request_id: str, choice: int | None = None) -> bool:
        """Stop a request (client gone), or only its choice `choice` (its front ended it at a stop string while
        the others run on). A request's slots are freed when all its choices have ended; a session keeps what it has
        consumed so far. False when no such request (or choice) is waiting or running."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                if choice is not None:
                    return False  # nothing has run, so no choice has ended in the front
                self.waiting.remove(req)
                req.aborted = req.settled = True  # nothing ran: nothing to record or store
                self._release_session(req)
                return True
        for req in self.running:
            if req.request_id == request_id:
                if choice is None:
                    req.aborted = True
                for seq in req.sequences:
                    if not seq.finished and choice in (None, seq.index):
                        seq.finish_reason = "abort"
                return choice is None or choice < len(req.sequences)
        return False

    # -- deciding a step ----------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        """Admit what fits, then one decode token for every running sequence and prefill chunks in the rest."""
        step = ScheduledStep()
        for ckpt in self._filling:  # the previous step, launched, fills them before anything after it reads them
            ckpt.busy = False
        self._filling.clear()
        self._admit(step)
        for req in self.running:
            for seq in req.sequences:
                # A token sampled by the step in flight may still finish the sequence (EOS, a stop string): it is
                # decoded once more anyway, and postprocess drops the extra token. Length is known here.
                if seq.prefill_done and not seq.finished and 0 < seq.num_sampled < seq.params.max_tokens:
                    seq.decoded += 1
                    seq.num_sampled += 1
                    step.decode.append(seq)
                    step.sample.append(seq)
        budget = self.max_batch_tokens - len(step.decode) if step.decode else self.max_prefill_tokens
        if budget >= 2 * PREFILL_ALIGN:
            # Whole multiples: the prefill's token count then stays the same from step to step while the decode
            # batch grows, so the GEMMs and allocations of a step meet shapes already seen.
            budget -= budget % PREFILL_ALIGN
        if self._prefill_due(bool(step.decode), budget):
            self._schedule_prefill(step, max(1, budget))
        return step

    def _prefill_due(self, decoding: bool, budget: int) -> bool:
        """Whether this step feeds prompts: always when nothing decodes; while sequences decode, once a full
        budget of prompt tokens waits or the oldest waiting prompt has waited `prefill_batch_wait` seconds."""
        if not decoding or self.prefill_batch_wait <= 0:
            return True
        pending, oldest = 0, math.inf
        for req in self.running:
            first = req.sequences[0]
            if not (first.prefill_done or first.finished):
                pending += len(first.to_prefill) - first.prefilled
                oldest = min(oldest, req.arrival)
        return pending >= budget or (pending > 0 and time.monotonic() - oldest >= self.prefill_batch_wait)

    def _admit(self, step: ScheduledStep) -> None:
        """Move waiting requests to running while slots can be found for all their choices."""
        while self.waiting:
            req = self.waiting[0]
            if req.grammar is not None and not req.grammar.done():
                if self.running or step.admitted:
                    return  # its grammar is still compiling: the step goes on without it
                req.grammar.exception()  # nothing else to run: wait for the compiler
            if req.grammar is not None and req.grammar.exception() is not None:
                self._refuse(step, req, req.grammar.exception())
                continue
            try:
                slots = self._take_slots(req)
            except StateLoading as loading:
                if self.running or step.admitted:
                    return  # its session is still being read from the store: the step goes on without it
                loading.wait()  # nothing else to run: wait for the read rather than spin
                continue
            except PoolExhausted as exc:
                if self.running or self._admit_resident(step):
                    return  # a running request frees a slot when it ends: wait for it
                # Nothing runs, so nothing will free a slot: idle sessions hold them all and cannot move out (host
                # memory full, no session store). Waiting would be forever; the request fails now (HTTP 429).
                self._refuse(step, req, exc)
                continue
            except Exception as exc:  # the session's stored state cannot be loaded: this request fails, not the step
                self._refuse(step, req, exc)
                continue
            self.waiting.popleft()
            self._start(req, slots)
            step.admitted.extend(req.sequences)
            self.running.append(req)

    def _admit_resident(self, step: ScheduledStep) -> bool:
        """Admit waiting requests behind the first whose session already holds a slot (they need no new one, and
        their sessions, reserved for them, cannot be evicted to make room for the first). True if any was."""
        ready = [
            r for r in list(self.waiting)[1:]
            if r.n == 1 and r.session is not None and r.session.slot is not None
            and (r.grammar is None or (r.grammar.done() and r.grammar.exception() is None))
        ]  # fmt: skip
        for req in ready:
            self.waiting.remove(req)
            self._start(req, self._take_slots(req))  # its own slot: cannot fail for want of one
            step.admitted.extend(req.sequences)
            self.running.append(req)
        return bool(ready)

    def _refuse(self, step: ScheduledStep, req: Request, exc: Exception) -> None:
        """Fail the first waiting request before it ran (its error goes out with `step`): the session keeps what it
        had."""
        self.waiting.popleft()
        req.settled = True
        self._release_session(req)
        step.refused.append((req.request_id, exc))

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
        except Exception:  # no slot now, or the session's stored state cannot be loaded: take nothing
            for s in taken:
                self.sessions.delete(s)
            raise
        req.ephemeral = taken
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
        else:
            # No session, or not a continuation of what it holds: resume from the longest checkpoint of the
            # prompt (a prefix of it, leaving a token to prefill for the first sample's logits), or start over.
            # (A request that wants prompt logprobs prefills its whole prompt: a checkpoint holds no logits.)
            scoring = req.params.prompt_logprobs is not None
            hit = None
            if self.prefix_cache is not None and not scoring:
                hit = self.prefix_cache.lookup(req.owner, prompt, len(prompt) - 1)
            if hit is not None:
                self.sessions.tiers.copy_into(hit, slots[0])
                req.cached_tokens = hit.num_tokens
                if session is not None:
                    if session.num_tokens:  # it started over all the same (from the checkpoint): counted as a reset
                        self.sessions.tiers.counters.resets += 1
                    session.num_tokens, session.token_hash = hit.num_tokens, hit.token_hash
            elif session is not None and session.num_tokens:
                self.sessions.reset(session)
        to_feed = prompt[req.cached_tokens :]
        for index, slot in enumerate(slots):
            seed = req.params.seed
            if seed is not None and req.n > 1:
                seed = (seed + index) % 2**63  # independent but reproducible choices
            seq = Sequence.create(prompt, req.params, self.tokenizer, seed, detokenize=req.detokenize)
            seq.slot = slot
            seq.request_id = req.request_id
            seq.index = index
            seq.to_prefill = to_feed if index == 0 else []
            seq.session = session if index == 0 else None
            if index == 0 and req.params.prompt_logprobs is not None:  # none before what this request prefills
                seq.prompt_logprobs = [None] * min(req.cached_tokens + 1, len(prompt))
            if req.grammar is not None:
                seq.matcher = req.grammar.result() if index == 0 else req.grammar.result().copy()
            req.sequences.append(seq)

    def _schedule_prefill(self, step: ScheduledStep, budget: int) -> None:
        packed = 0  # the step's prefill tokens so far (the next chunk's first row)
        for req in self.running:
            first = req.sequences[0]
            if first.prefill_done or first.finished or budget <= 0:
                continue
            n = min(len(first.to_prefill) - first.prefilled, budget)
            # A chunk ends at the next message boundary, so that the state there can be kept.
            boundary = self._next_boundary(req, req.cached_tokens + first.prefilled)
            if boundary is not None:
                n = min(n, boundary - req.cached_tokens - first.prefilled)
            step.prefill.append(first)
            step.chunks.append(first.to_prefill[first.prefilled : first.prefilled + n])
            if first.prompt_logprobs is not None:  # each row scores the prompt token after it, up to the last
                at = req.cached_tokens + first.prefilled
                targets = req.prompt_token_ids[at + 1 : at + n + 1]
                step.scores.append(PromptScore(first, packed, targets, req.params.prompt_logprobs))
            packed += n
            first.prefilled += n
            budget -= n
            fed = req.cached_tokens + first.prefilled
            if fed == boundary or fed == len(req.prompt_token_ids):
                self._checkpoint(step, req, fed)
            if first.prefilled < len(first.to_prefill):
                continue
            # The prompt is in after this step: fork the state to the other choices and sample each one's first.
            for seq in req.sequences:
                seq.prefill_done = True
                if seq is not first:
                    step.forks.append((first.slot, seq.slot))
            if req.prefill_only:
                step.prompt_done.append(req)
                continue
            for seq in req.sequences:
                seq.num_sampled += 1
                step.sample.append(seq)
                step.sample_source.append(len(step.prefill) - 1)

    def _next_boundary(self, req: Request, fed: int) -> int | None:
        """The first of the request's message boundaries past `fed` prompt tokens (None: none, or no cache)."""
        if self.prefix_cache is None:
            return None
        return min((b for b in req.checkpoint_at if fed < b < len(req.prompt_token_ids)), default=None)

    def _checkpoint(self, step: ScheduledStep, req: Request, length: int) -> None:
        """Keep the state after the first `length` prompt tokens, which this step's prefill reaches: a checkpoint
        in a free slot (left to waiting requests first) or an older idle checkpoint's, filled by a fork after the
        prefill. Skipped when neither is there: a checkpoint is never worth moving a session."""
        if self.prefix_cache is None:
            return
        ckpt = self.prefix_cache.new_slot(req.owner, req.prompt_token_ids[:length], leave_free=len(self.waiting))
        if ckpt is not None:
            step.forks.append((req.sequences[0].slot, ckpt.slot))
            req.checkpoints.append(ckpt)
            ckpt.busy = True  # not moved, copied from or given away before its fork has run
            self._filling.append(ckpt)

    # -- after a step -------------------------------------------------------------------------------------------
    def advance_grammars(self, step: ScheduledStep, sampled: SampledTokens) -> None:
        """Move the grammars of `step`'s constrained rows past their sampled tokens ahead of `postprocess` (which
        then does not again), so that the next step's masks can be computed before the rest of the host work."""
        for seq, token in zip(step.sample, sampled.token_ids, strict=True):
            if seq.matcher is not None and not seq.finished:
                seq.advance_grammar(token)

    def postprocess(self, step: ScheduledStep, sampled: SampledTokens) -> list[Output]:
        """Append each sampled token (dropping those of sequences that finished meanwhile), retire what finished;
        return the new outputs, one per choice that gained tokens or ended."""
        touched: list[Sequence] = []
        for score, entries in zip(step.scores, sampled.prompt_logprobs, strict=True):
            score.seq.prompt_logprobs.extend(entries)
        for seq, token, logprob in zip(step.sample, sampled.token_ids, sampled.logprobs, strict=True):
            if not seq.finished:
                seq.append(token, logprob)
                touched.append(seq)
                if seq.error is not None:
                    self._fail(seq, GrammarError(seq.error))
        for req in step.prompt_done:
            first = req.sequences[0]
            if not first.finished:
                first.finish_reason = "prefill"
                touched.append(first)
        ended = {seq.request_id for seq in touched if seq.finished}
        for req in self.running if ended else ():  # a finished turn is stored before its last event goes out
            if req.request_id in ended and req.session is not None and all(s.finished for s in req.sequences):
                self._settle_session(req)
        return self._outputs(touched) + self.retire()

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """The request of `seq` fails with `error` (its other choices end with it)."""
        for req in self.running:
            if req.request_id == seq.request_id:
                req.failure = req.failure or error
                for other in req.sequences:
                    other.finish_reason = other.finish_reason or "abort"

    def _outputs(self, seqs: list[Sequence]) -> list[Output]:
        """What `seqs` gained since their last output (their request's failure instead, once, if it failed)."""
        by_id = {r.request_id: r for r in self.running}
        outputs: list[Output] = []
        for seq in seqs:
            req = by_id[seq.request_id]
            if req.failure is not None:
                if seq.index == 0:
                    outputs.append((req.request_id, req.failure))
                continue
            new_tokens = seq.output_token_ids[seq.emitted_tokens :]
            new_logprobs = seq.logprobs[seq.emitted_tokens :] if seq.params.logprobs is not None else []
            seq.emitted_tokens = len(seq.output_token_ids)
            prompt_logprobs = None
            if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
                prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
            outputs.append((
                req.request_id,
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
                    prompt_logprobs=prompt_logprobs,
                ),
            ))  # fmt: skip
        return outputs

    def retire(self) -> list[Output]:
        """Free what finished requests hold; sessions keep their state (and what it consumed). Returns the last
        outputs of the choices that were aborted."""
        still, outputs = [], []
        for req in self.running:
            if all(s.finished for s in req.sequences):
                aborted = [s for s in req.sequences if s.finish_reason == "abort"]
                if aborted:
                    outputs += self._outputs(aborted)
                for i, extra in enumerate(req.ephemeral):
                    if i == 0 and req.session is None and self._keeps_output_state(req):
                        # A request without a session leaves its state at its output's end as a checkpoint.
                        self.sessions.unregister(extra)
                        tokens = req.prompt_token_ids[: req.cached_tokens] + req.sequences[0].consumed
                        self.prefix_cache.adopt(extra, req.owner, tokens)
                    else:
                        self.sessions.delete(extra)
                self._release_session(req)
            else:
                still.append(req)
        self.running = still
        return outputs

    def _keeps_output_state(self, req: Request) -> bool:
        """Whether a finished request's choice-0 state is worth a checkpoint: a cache, a known state, new tokens."""
        return (
            self.prefix_cache is not None and not req.state_lost and req.failure is None and bool(req.sequences)
            and bool(req.sequences[0].consumed) and not req.prefill_only
        )  # fmt: skip

    def fail_checkpoints(self, req: Request) -> None:
        """A step of `req` failed: drop the checkpoints it made (their forks may not have run) and keep no state."""
        req.state_lost = True
        for ckpt in req.checkpoints:
            if self.prefix_cache is not None and ckpt.session_id in self.prefix_cache:
                self.prefix_cache.drop(ckpt)
        req.checkpoints.clear()

    def _settle_session(self, req: Request) -> None:
        """Record what the turn fed into the session and, under write-through, store its state."""
        if req.settled:
            return
        req.settled = True
        first = req.sequences[0] if req.sequences else None
        if first is not None:
            req.session.extend(first.consumed)
        try:
            self.sessions.tiers.persist_turn(req.session)
        except SessionStoreError as exc:
            req.failure = exc

    def _release_session(self, req: Request) -> None:
        if req.session is None:
            return
        self._settle_session(req)
        self.sessions.release(req.session)
        self.sessions.leases.end(req.session)
        if req.session.delete_when_released:  # its owner gave it up while this request ran (an aborted stream)
            self.sessions.delete(req.session)
