"""LLM: the offline Python API. `LLM(path).generate(prompts, params)` runs a batch of prompts to completion."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoints import default_checkpoint_path
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.sequence import Sequence, TokenLogprob
from engine.state_pool import StatePool
from engine.tokenizer import Tokenizer

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """The result of one prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None


class LLM:
    """A model, its tokenizer and a state pool, with continuous batching over the prompts given to `generate`.

    Args:
        model: checkpoint directory; None for the checkpoint shipped with kvfree.
        device, dtype: where and how to run ("auto": CUDA + bf16 when available, else CPU + fp32).
        max_sessions: state-pool slots, i.e. sequences decoded at once.
        max_context: tokens of context per session for models with full attention (sizes the KV cache).
        prefill_chunk: most prompt tokens fed per prefill call (bounds activation memory for long prompts).
        config_overrides: config values to replace at load, by dotted key, e.g. `{"gka.num_iter": 10}`.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_sessions: int = 64,
        max_context: int = 4096,
        prefill_chunk: int = 4096,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        path = Path(model) if model is not None else default_checkpoint_path()
        self.model = load_model(path, device=device, dtype=dtype, config_overrides=config_overrides)
        self.tokenizer = Tokenizer(path)
        self.pool = StatePool(self.model, max_sessions, max_context)
        self.runner = ModelRunner(self.model, self.pool)
        self.prefill_chunk = prefill_chunk

    @property
    def config(self):
        return self.model.config

    def encode(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> checked token ids."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        return ids

    def new_sequence(self, prompt: Prompt, params: SamplingParams) -> Sequence:
        ids = self.encode(prompt)
        if self.pool.bytes_per_token() and len(ids) + params.max_tokens > self.pool.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds this model's "
                f"max_context of {self.pool.max_context} tokens"
            )
        return Sequence.create(ids, params, self.tokenizer, self.config.vocab_size, self.model.device)

    # -- the step loop ----------------------------------------------------------------------------------------
    def _prefill(self, seqs: list[Sequence]) -> None:
        """Prefill whole prompts, at most `prefill_chunk` tokens per call, then sample each first token."""
        offsets = [0] * len(seqs)
        last_logits: dict[int, torch.Tensor] = {}
        while any(o < len(s.prompt_token_ids) for o, s in zip(offsets, seqs, strict=True)):
            budget, batch, chunks = self.prefill_chunk, [], []
            for i, seq in enumerate(seqs):
                remaining = len(seq.prompt_token_ids) - offsets[i]
                if remaining and budget:
                    n = min(remaining, budget)
                    batch.append(i)
                    chunks.append(seq.prompt_token_ids[offsets[i] : offsets[i] + n])
                    offsets[i] += n
                    budget -= n
            logits = self.runner.prefill([seqs[i] for i in batch], chunks)
            for row, i in enumerate(batch):
                if offsets[i] == len(seqs[i].prompt_token_ids):
                    last_logits[i] = logits[row]
        self.runner.sample(seqs, torch.stack([last_logits[i] for i in range(len(seqs))]))

    def _run(self, seqs: list[Sequence]) -> Iterator[Sequence]:
        """Continuous batching: admit while slots are free, decode all running, free slots as sequences finish.
        Yields each sequence after every token it gets (so callers can stream)."""
        waiting, running = deque(seqs), []
        try:
            while waiting or running:
                admitted = []
                while waiting and self.pool.free_slots:
                    seq = waiting.popleft()
                    seq.slot = self.pool.alloc()
                    admitted.append(seq)
                if admitted:
                    self._prefill(admitted)
                    running += admitted
                    yield from admitted
                decoding = [s for s in running if not s.finished]
                if decoding:
                    self.runner.sample(decoding, self.runner.decode(decoding))
                    yield from decoding
                for seq in running:
                    if seq.finished:
                        self.pool.free(seq.slot)
                        seq.slot = None
                running = [s for s in running if s.slot is not None]
        finally:
            for seq in running:  # the caller stopped early: give the slots back
                if seq.slot is not None:
                    self.pool.free(seq.slot)
                    seq.slot = None

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Complete each prompt (text, or a list of token ids). One SamplingParams for all, or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        seqs = [self.new_sequence(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        for _ in self._run(seqs):
            pass
        return [
            CompletionOutput(
                prompt_token_ids=s.prompt_token_ids,
                token_ids=s.output_token_ids,
                text=s.text,
                finish_reason=s.finish_reason or "length",
                logprobs=s.logprobs if s.params.logprobs is not None else None,
            )
            for s in seqs
        ]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Complete one prompt, yielding text as it is produced. `last_sequence` holds the record afterwards."""
        seq = self.new_sequence(prompt, params or SamplingParams())
        self.last_sequence = seq
        for _ in self._run([seq]):
            delta = seq.take_delta()
            if delta:
                yield delta
