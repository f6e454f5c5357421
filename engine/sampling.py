"""Sampling: per-request parameters and one batched sampler that runs on the logits' device.

Order of operations (as vLLM): penalties -> greedy argmax or (temperature -> min-p -> top-k -> top-p -> draw).
The draw is an exponential race (`argmax(p / E)`, E ~ Exp(1)), so a request with a `seed` draws its noise from
its own generator and gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request. Invalid values raise ValueError naming the field.

    temperature 0 means greedy. top_k <= 0, top_p = 1 and min_p = 0 disable those filters. Penalties follow the
    OpenAI API (presence, frequency: over generated tokens) and HF/vLLM (repetition: over prompt and generated
    tokens; 1 disables). `logprobs`: None for none, 0 for the sampled token's, k for the k most likely as well.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class SampleOutput:
    """One step's picks for a batch of B rows.

    token_ids: `[B]`.  logprobs: `[B]` log-probability of each pick under the model's distribution (before
    penalties and filters), or None when no row asked.  top_ids / top_logprobs: `[B, k]` the k most likely tokens,
    k the largest `logprobs` asked in the batch.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def apply_penalties(
    logits: torch.Tensor, params: list[SamplingParams], counts: torch.Tensor, prompt_mask: torch.Tensor
) -> torch.Tensor:
    """Repetition / presence / frequency penalties.

    logits: `[B, V]` fp32.  counts: `[B, V]` how often each token was generated.  prompt_mask: `[B, V]` tokens
    in the prompt. Returns new logits.
    """
    rep = _column([p.repetition_penalty for p in params], logits)
    seen = prompt_mask | (counts > 0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - _column([p.frequency_penalty for p in params], logits) * counts
    return logits - _column([p.presence_penalty for p in params], logits) * (counts > 0)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p: logits `[B, V]` -> logits with rejected tokens at -inf."""
    temps = _column([p.temperature if p.temperature > 0 else 1.0 for p in params], logits)
    logits = logits / temps
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(-1)
        floor = _column([p.min_p for p in params], logits) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    V = logits.shape[-1]
    need_k = any(0 < p.top_k < V for p in params)
    need_p = any(p.top_p < 1 for p in params)
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        reject = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=logits.device)
            reject |= torch.arange(V, device=logits.device)[None, :] >= k[:, None]
        if need_p:
            probs = sorted_logits.masked_fill(reject, float("-inf")).softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p: a token goes if the mass before it already does.
            mass_before = probs.cumsum(-1) - probs
            reject |= mass_before >= _column([p.top_p for p in params], logits)
        reject[:, 0] = False
        logits = logits.masked_fill(reject.scatter(1, order, reject), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
) -> SampleOutput:
    """Pick one token per row.

    logits: `[B, V]` fp32 from the model.  generators: per row, a seeded generator on the logits' device or None
    (global RNG).  counts / prompt_mask: `[B, V]`, needed when a row uses penalties.
    """
    raw = logits
    if any(p.uses_penalties for p in params):
        if counts is None or prompt_mask is None:
            raise ValueError("penalties need counts and prompt_mask")
        logits = apply_penalties(logits, params, counts, prompt_mask)
    greedy_ids = logits.argmax(-1)
    token_ids = greedy_ids
    if not all(p.greedy for p in params):
        probs = filter_logits(logits, params).softmax(-1)
        noise = torch.empty_like(probs)
        for row, gen in enumerate(generators):
            if gen is not None:
                noise[row].exponential_(generator=gen)
        unseeded = [row for row, gen in enumerate(generators) if gen is None]
        if unseeded:
            noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_()
        sampled = (probs / noise).argmax(-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        token_ids = torch.where(is_greedy, greedy_ids, sampled)
    out = SampleOutput(token_ids=token_ids)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if wanted:
        logprobs = raw.log_softmax(-1)
        out.logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
        k = max(wanted)
        if k > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(k, dim=-1)
    return out
