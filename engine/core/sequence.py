"""Sequence: one request's record in the engine (its tokens, sampling state, slot and outcome)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

from kvfree.engine.core.sampling import random_seed
from kvfree.engine.protocol import SamplingParams, TokenLogprob
from kvfree.engine.text.grammar import GrammarMatcher
from kvfree.engine.text.text_output import TextOutput
from kvfree.engine.text.tokenizer import Tokenizer

_ids = itertools.count()



@dataclass
class Sequence:
    """A prompt being continued. The state in `slot` has consumed the prompt and every output token but the last.

    While a step is in flight its token is sampled on the device but not yet appended: `num_sampled` counts it,
    `output_token_ids` does not (engine/core/stepper.py).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # of the row's counter-based random stream (engine/core/sampling.py)
    eos_token_id: int | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    slot: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # With `params.prompt_logprobs`: one entry per prompt token (None where not computed), filled as the prefill
    # steps score the prompt, sent once with choice 0's first output.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    finish_reason: str | None = None  # "stop", "length", "abort" or "prefill"
    # Serving bookkeeping (engine/core/scheduler.py): which request and choice this is, the prompt part to feed (a
    # session may already hold the rest), how much of it is scheduled, and how many output tokens were sampled
    # and fed back (both counted when scheduled: the step runs them in order on the device).
    request_id: str = ""
    index: int = 0
    to_prefill: list[int] = field(default_factory=list)
    prefilled: int = 0
    prefill_done: bool = False
    num_sampled: int = 0
    decoded: int = 0
    emitted_tokens: int = 0
    session: object | None = None
    # The output's text, cut at the first stop string; None when the engine's client detokenizes (a serving front):
    # then only token-level stops (EOS, stop token ids, max_tokens) end the sequence here.
    text_output: TextOutput | None = None
    # Structured output: where the output stands in its grammar (None: unconstrained), and why the grammar failed
    # (a token it rejected: the request fails with this).
    matcher: GrammarMatcher | None = None
    grammar_tokens: int = 0  # output tokens the matcher has consumed (one ahead of `output_token_ids` at times)
    error: str | None = None

    @classmethod
    def create(
        cls,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        seed: int | None = None,
        detokenize: bool = True,
    ) -> Sequence:
        """A new sequence; `seed` defaults to the request's, or a random one. Without `detokenize` it produces token
        ids only, and `params.stop` (stop strings) is left to whoever detokenizes."""
        if seed is None:
            seed = params.seed if params.seed is not None else random_seed()
        return cls(
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=seed,
            eos_token_id=tokenizer.eos_token_id,
            text_output=TextOutput(tokenizer, params.stop, params.skip_special_tokens) if detokenize else None,
        )

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.text_output.text if self.text_output is not None else ""

    @property
    def consumed(self) -> list[int]:
        """Every token this sequence fed into its state: the prefilled prompt part, then the decoded outputs."""
        return self.to_prefill[: self.prefilled] + self.output_token_ids[: self.decoded]

    @functools.cached_property
    def end_tokens(self) -> frozenset[int]:
        """The tokens that end the output (`SamplingParams.end_token_ids`)."""
        return self.params.end_token_ids(self.eos_token_id)

    def advance_grammar(self, token_id: int) -> None:
        """Move the grammar's matcher past the next sampled token, once per token: the engine may do it before
        `append`, to compute the next step's mask sooner (engine/core/stepper.py). A token the grammar rejects sets
        `error`. A stop token where the output may end is the end, not more output: the matcher is left there."""
        matcher = self.matcher
        if matcher is None or self.grammar_tokens > len(self.output_token_ids):
            return
        self.grammar_tokens += 1
        if token_id in self.end_tokens and matcher.accepting:
            return
        if not matcher.consume(token_id):
            self.error = f"the grammar rejected token {token_id}: {matcher.error}"

    def append(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Record a sampled token and decide whether the sequence is finished."""
        if self.matcher is not None:
            self.advance_grammar(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.error is not None or token_id in self.end_tokens:
            self.finish_reason = "stop"
            return
        if self.text_output is not None and self.text_output.add(token_id):
            self.finish_reason = "stop"
            return
        if self.matcher is not None and self.matcher.stopped:  # the output is complete: only its end could follow
            self.finish_reason = "stop"
            return
        if len(self.output_token_ids) >= self.params.max_tokens:
            self.finish_reason = "length"

    def take_delta(self) -> str:
        """Text not yet handed out. While running, the tail that could still become a stop string is held back."""
        return self.text_output.take_delta(final=self.finished) if self.text_output is not None else ""
