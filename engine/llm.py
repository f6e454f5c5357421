"""LLM: the offline Python API. `LLM(path).generate(prompts, params)` runs a batch of prompts to completion."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfree.engine.core.scheduler import Request, Scheduler
from kvfree.engine.core.sequence import Sequence
from kvfree.engine.core.stepper import Stepper
from kvfree.engine.model.config import ModelConfig
from kvfree.engine.parallel.runtime import start_runtime
from kvfree.engine.protocol import RequestOutput, SamplingParams, TokenLogprob
from kvfree.engine.sessions.manager import SessionManager

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    """The result of one prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    # With `SamplingParams.prompt_logprobs`: one per prompt token, the first None (nothing comes before it).
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """A model, its tokenizer and a state pool, with continuous batching over the prompts given to `generate`.

    Args:
        model: checkpoint directory; None for the checkpoint shipped with kvfree.
        device, dtype: where and how to run ("auto": CUDA + bf16 when available, else CPU + fp32).
        max_sessions: state-pool slots, i.e. sequences decoded at once: at most this many on a GPU, where the pool is
            sized by `gpu_memory_utilization` (None: as many as fit, at most 1024), exactly this many on the CPU
            (None: 64).
        gpu_memory_utilization: on a GPU, the share of its memory the engine may use in all: what the weights and
            the largest step's activations leave of it holds the slots (engine/state/sizing.py). None: exactly
            `max_sessions` slots.
        max_context: tokens of context per session for models with full attention (sizes the KV cache).
        prefill_chunk: tokens per engine step, decode tokens included (bounds activation memory for long prompts,
            and how long a step, so every running sequence's next token, may take while prompts are fed). 8192 by
            measurement: `LLM.generate` of 256 prompts of 512 tokens on an H100 gives 11.0K output tok/s at 4096,
            14.2K at 8192, 14.7K at 16384 (docs/bench/offline-chunk-*.json); 8192 keeps a step's activations small.
        config_overrides: config values to replace at load, by dotted key, e.g. `{"gka.num_iter": 10}`.
        enforce_eager: on a GPU, run without CUDA graphs (by default each decode batch size up to `max_sessions`
            replays a graph captured at start-up, and prefill steps of all-Mamba-2 models replay one per token bucket).
        tensor_parallel_size: N > 1 splits every layer's heads among N processes, one per GPU (cuda:0 .. cuda:N-1;
            on the CPU, N processes joined by gloo): this process is rank 0 and starts the others
            (engine/parallel/ranks.py, docs/design/tensor-parallel.md). `close()` ends them.
        kv_cache_dtype: "auto" (the activation dtype) or "fp8": attention layers keep their KV cache in e4m3 with a
            scale per session and KV head, half a bf16 cache's bytes (engine/model/layers/attention.py).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        max_sessions: int | None = None,
        max_context: int = 4096,
        prefill_chunk: int = 8192,
        config_overrides: dict[str, Any] | None = None,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float | None = 0.9,
    ) -> None:
        self.runtime = start_runtime(
            model, device=device, dtype=dtype, max_sessions=max_sessions, max_context=max_context,
            config_overrides=config_overrides, enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype,
            gpu_memory_utilization=gpu_memory_utilization, step_tokens=prefill_chunk,
        )  # fmt: skip
        runtime = self.runtime
        self.path = runtime.path  # the checkpoint directory
        self.runner, self.model, self.pool = runtime.runner, runtime.model, runtime.pool
        self.tokenizer, self.grammars = runtime.tokenizer, runtime.grammars
        self.prefill_chunk = prefill_chunk
        self._stepper: Stepper | None = None
        self._ids = itertools.count()
        self.last_sequence: Sequence | None = None

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint (engine/state/snapshot.py), computed once: at start-up under tensor parallelism."""
        return self.runtime.fingerprint

    def close(self) -> None:
        """End the other tensor-parallel ranks (nothing to do on one); the LLM is unusable afterwards."""
        self.runtime.close()

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

    def _request(self, prompt: Prompt, params: SamplingParams) -> Request:
        """A checked scheduler request."""
        ids = self.encode(prompt)
        if self.pool.bytes_per_token() and len(ids) + params.max_tokens > self.pool.max_context:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds this model's "
                f"max_context of {self.pool.max_context} tokens"
            )
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # a GrammarError (ValueError) now, not an output later
        return Request(f"llm-{next(self._ids)}", ids, params)

    @property
    def engine(self) -> Stepper:
        """The same engine step and continuous-batching scheduler the server uses, over this LLM's pool (created
        on first use, so a server, which builds its own over the same pool, never makes this one)."""
        if self._stepper is None:
            # Offline requests hold slots only while they run: no session tiers, no snapshots.
            sessions = SessionManager(self.pool, fingerprint="offline", max_host_sessions=0)
            scheduler = Scheduler(
                sessions, self.tokenizer, max_waiting=sys.maxsize, max_batch_tokens=self.prefill_chunk,
                grammars=self.grammars,
            )
            self._stepper = Stepper(scheduler, self.runner)
        return self._stepper

    def _drive(self, requests: list[Request], outputs: list[list[RequestOutput]]) -> Iterator[None]:
        """Step the engine until `requests` are done, appending each one's outputs to its list in `outputs` and
        yielding after each step (so callers can stream). If the caller stops early or a step fails, the requests
        are aborted and their slots freed."""
        engine = self.engine
        lists = {req.request_id: out for req, out in zip(requests, outputs, strict=True)}
        for req in requests:
            engine.scheduler.add(req)
        try:
            while engine.has_work:
                for request_id, out in engine.step():
                    lists[request_id].append(out)
                yield
        except Exception:
            engine.discard_in_flight()  # a failed step's tokens are not coming
            raise
        finally:
            if engine.has_work:
                for req in requests:
                    engine.scheduler.abort(req.request_id)
                while engine.has_work:  # aborted sequences only need their slots freed
                    engine.step()

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
        requests = [self._request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        outputs: list[list[RequestOutput]] = [[] for _ in requests]
        for _ in self._drive(requests, outputs):
            pass
        return [_completion(req, outs) for req, outs in zip(requests, outputs, strict=True)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Complete one prompt, yielding text as it is produced. `last_sequence` holds the record afterwards."""
        outputs: list[RequestOutput] = []
        req = self._request(prompt, params or SamplingParams())
        for _ in self._drive([req], [outputs]):
            self.last_sequence = req.sequences[0] if req.sequences else None
            while outputs:
                delta = outputs.pop(0).text
                if delta:
                    yield delta


def _completion(req: Request, outputs: list[RequestOutput]) -> CompletionOutput:
    """Assemble one request's streamed outputs into its result."""
    return CompletionOutput(
        prompt_token_ids=req.prompt_token_ids,
        token_ids=[t for out in outputs for t in out.token_ids],
        text="".join(out.text for out in outputs),
        finish_reason=next((o.finish_reason for o in reversed(outputs) if o.finish_reason), "length"),
        logprobs=[lp for out in outputs for lp in out.logprobs] if req.params.logprobs is not None else None,
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
    )
