"""Sequence: one request's record in the engine (its tokens, sampling state, slot and outcome)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from kvfree.engine.sampling import SamplingParams
from kvfree.engine.tokenizer import IncrementalDetokenizer, Tokenizer

_ids = itertools.count()


@dataclass
class TokenLogprob:
    """A generated token's log-probability and, if asked, the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Sequence:
    """A prompt being continued. The state in `slot` has consumed the prompt and every output token but the last."""

    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    eos_token_id: int | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    slot: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length"
    generator: torch.Generator | None = None
    # Penalty bookkeeping, created only for requests that use penalties: [V] counts and prompt membership.
    counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    # Serving bookkeeping (engine/scheduler.py): which request and choice this is, the prompt part to feed (a
    # session may already hold the rest), how much of it is in, and how many output tokens decode fed back.
    request_id: str = ""
    index: int = 0
    to_prefill: list[int] = field(default_factory=list)
    prefilled: int = 0
    prefill_done: bool = False
    decoded: int = 0
    emitted_tokens: int = 0
    session: object | None = None
    _text: str = ""  # output text with any stop string cut off
    _emitted: int = 0  # characters of _text already handed out by take_delta()

    @classmethod
    def create(
        cls, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer, vocab_size: int, device
    ) -> Sequence:
        seq = cls(
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(tokenizer, params.skip_special_tokens),
            eos_token_id=tokenizer.eos_token_id,
        )
        if params.seed is not None:
            seq.generator = torch.Generator(device=device).manual_seed(params.seed)
        if params.uses_penalties:
            seq.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            seq.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seq.prompt_mask[torch.tensor(seq.prompt_token_ids, device=device)] = True
        return seq

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    @property
    def consumed(self) -> list[int]:
        """Every token this sequence fed into its state: the prefilled prompt part, then the decoded outputs."""
        return self.to_prefill[: self.prefilled] + self.output_token_ids[: self.decoded]

    def append(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Record a sampled token and decide whether the sequence is finished."""
        p = self.params
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.counts is not None:
            self.counts[token_id] += 1
        is_eos = token_id == self.eos_token_id and not p.ignore_eos
        if is_eos or token_id in p.stop_token_ids:
            self.finish_reason = "stop"
            return
        before = len(self._text)
        self._text += self.detokenizer.add(token_id)
        if p.stop:
            # A stop string can only complete inside the new text plus the longest stop's length before it.
            window_start = max(0, before - max(len(s) for s in p.stop) + 1)
            hits = [i for s in p.stop if (i := self._text.find(s, window_start)) >= 0]
            if hits:
                self._text = self._text[: min(hits)]
                self.finish_reason = "stop"
                return
        if len(self.output_token_ids) >= p.max_tokens:
            self.finish_reason = "length"

    def take_delta(self) -> str:
        """Text not yet handed out. While running, the tail that could still become a stop string is held back."""
        end = len(self._text)
        if not self.finished and self.params.stop:
            end = max(self._emitted, end - (max(len(s) for s in self.params.stop) - 1))
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta
