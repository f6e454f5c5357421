"""Sampling: per-request parameters, and one batched sampler whose every parameter is a tensor row.

Order of operations (as vLLM): penalties -> logit bias -> grammar masks -> greedy argmax or (temperature -> min-p
-> top-k -> top-p -> draw).
A step samples its whole batch with the same few tensor ops whatever the batch holds: no Python loop over rows,
no host sync. The draw is by inverse CDF from one uniform number per row, and that number is a counter-based
hash of (the row's seed, how many tokens the row drew before), so a seeded request gets the same tokens whatever
else is in the batch, without a random generator per request. Requests without a seed get a random one.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvfree.engine.model.host_copy import upload, upload_tensor
from kvfree.engine.protocol import GREEDY_BELOW, SamplingParams
from kvfree.engine.text.grammar import bitmask_to_bool

# The columns of a batch's float parameter matrix, in this order.
PARAM_COLUMNS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def random_seed() -> int:
    """A seed for a request that gave none (63 bits, as `SamplingParams.seed` allows)."""
    return secrets.randbits(63)


def param_row(params: SamplingParams) -> list[float]:
    """One request's `PARAM_COLUMNS` values (temperature 0, greedy, is kept as 0)."""
    return [float(getattr(params, name)) for name in PARAM_COLUMNS]


@dataclass(frozen=True)
class BatchFlags:
    """What the rows of a batch ask for, known on the host, so the sampler skips unused work without a sync.

    logprobs: the largest `logprobs` asked (0: only the sampled token's), None when no row asks.
    """

    sampled: bool = False  # some row samples (temperature >= GREEDY_BELOW)
    min_p: bool = False
    top_k: bool = False
    top_p: bool = False
    penalties: bool = False
    logprobs: int | None = None
    logit_bias: bool = False

    @classmethod
    def of(cls, params: Iterable[SamplingParams], vocab_size: int) -> BatchFlags:
        sampled = min_p = top_k = top_p = penalties = logit_bias = False
        logprobs = None
        for p in params:
            logit_bias |= bool(p.logit_bias)
            if not p.greedy:
                sampled = True
                min_p |= p.min_p > 0
                top_k |= 0 < p.top_k < vocab_size
                top_p |= p.top_p < 1
            penalties |= p.uses_penalties
            if p.logprobs is not None:
                logprobs = max(logprobs or 0, p.logprobs)
        return cls(sampled, min_p, top_k, top_p, penalties, logprobs, logit_bias)


@dataclass
class SamplingRows:
    """The sampling inputs of B rows, as tensors on the logits' device.

    params: `[B, len(PARAM_COLUMNS)]` fp32.  seeds: `[B]` int64 in [0, 2**63).  counters: `[B]` int64, how many
    tokens each row drew before this one (the position in the row's random stream).  counts / prompt_mask:
    `[B, V]` fp32 / bool, how often each token was generated and which the prompt holds (needed with penalties).
    bias: the rows' `logit_bias` entries as three `[N]` tensors (row, token id, value), or None when no row has one.
    allowed: grammar masks, `(rows, bitmasks)`: `[M]` row indices and their `[M, ceil(V/32)]` int32 bitmasks, or
        rows None and one bitmask per row (all bits set for free rows); None when no row is constrained.
    """

    params: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor
    flags: BatchFlags
    counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    allowed: tuple[torch.Tensor | None, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        counters: list[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
        counts: torch.Tensor | None = None,
        prompt_mask: torch.Tensor | None = None,
    ) -> SamplingRows:
        """Rows from Python values (tests, one-off calls); the engine gathers them from a `SamplingTable`."""
        return cls(
            params=torch.tensor([param_row(p) for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            counters=torch.tensor(counters, dtype=torch.int64, device=device),
            flags=BatchFlags.of(params, vocab_size),
            counts=counts,
            prompt_mask=prompt_mask,
            bias=logit_bias_rows(params, torch.device(device)),
        )

    def column(self, name: str) -> torch.Tensor:
        """`[B, 1]` values of one parameter."""
        i = PARAM_COLUMNS.index(name)
        return self.params[:, i : i + 1]


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


# -- counter-based random numbers ---------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), in two 16-bit halves of c so no product overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """A uniform number in (0, 1) per row, a pure function of (seed, counter): `[B]` int64 x2 -> `[B]` float64."""
    h = _fmix32((seeds >> 32) + 0x9E3779B9)
    h = _fmix32(h ^ (seeds & _M32))
    h = _fmix32(h + _mul32(counters & _M32, 0x9E3779B1))
    h = _fmix32(h ^ (counters >> 32))
    return (h.double() + 0.5) / 2.0**32


# -- the sampler --------------------------------------------------------------------------------------------------
def logit_bias_rows(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The `logit_bias` entries of a batch's rows as (row, token id, value) `[N]` tensors on `device`, uploaded
    without a sync; None when no row has one (the common case costs one pass over the params)."""
    if not any(p.logit_bias for p in params):
        return None
    rows = [b for b, p in enumerate(params) for _ in p.logit_bias]
    tokens = [t for p in params for t in p.logit_bias]
    values = [float(v) for p in params for v in p.logit_bias.values()]
    return upload(rows, torch.int64, device), upload(tokens, torch.int64, device), upload(values, torch.float32, device)


def apply_allowed(logits: torch.Tensor, rows: torch.Tensor | None, masks: torch.Tensor) -> torch.Tensor:
    """Grammar masks: logits `[B, V]`, row indices `[M]` (None: every row), bitmasks `[M, ceil(V/32)]` int32 -> new
    logits whose rows `rows` are -inf wherever their mask's bit is clear. The other rows are untouched."""
    allowed = bitmask_to_bool(masks, logits.shape[-1])
    if rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    constrained = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, constrained)


def apply_penalties(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Repetition / presence / frequency penalties: logits `[B, V]` fp32 -> new logits.

    Repetition (HF/vLLM) divides positive and multiplies negative logits of tokens seen in the prompt or output;
    presence and frequency (OpenAI) subtract per generated occurrence.
    """
    if rows.counts is None or rows.prompt_mask is None:
        raise ValueError("penalties need counts and prompt_mask")
    counts, rep = rows.counts, rows.column("repetition_penalty")
    seen = rows.prompt_mask | (counts > 0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - rows.column("frequency_penalty") * counts
    return logits - rows.column("presence_penalty") * (counts > 0)


def filter_logits(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p: logits `[B, V]` -> logits with rejected tokens at -inf.

    Greedy rows (temperature 0) are filtered as temperature 1; the sampler takes their argmax anyway.
    """
    temperature = rows.column("temperature")
    logits = logits / torch.where(temperature >= GREEDY_BELOW, temperature, 1.0)
    flags, V = rows.flags, logits.shape[-1]
    if flags.min_p:
        probs = logits.softmax(-1)
        floor = rows.column("min_p") * probs.amax(-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if flags.top_k or flags.top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device)[None, :]
        reject = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if flags.top_k:
            k = rows.column("top_k")
            reject |= rank >= torch.where((k > 0) & (k < V), k, V)
        if flags.top_p:
            probs = sorted_logits.masked_fill(reject, float("-inf")).softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p: a token goes if the mass before it already does.
            # Rows with top_p = 1 keep everything: their fp32 running sum can round up to 1 before the tail.
            top_p = rows.column("top_p")
            reject |= (probs.cumsum(-1) - probs >= top_p) & (top_p < 1)
        reject &= rank > 0  # the best token always stays
        logits = logits.masked_fill(reject.scatter(1, order, reject), float("-inf"))
    return logits


def draw(probs: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF: probs `[B, V]` (rows need not sum to 1) -> ids `[B]` int64.

    The pick is the first token whose cumulative mass exceeds u * total; a token of zero mass never is, since the
    cumulative sum does not rise there. A row without positive finite mass (NaN from extreme penalties) gets its
    most probable entry instead of an index past the vocabulary.
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = (uniform(seeds, counters)[:, None] * total.double()).to(cdf.dtype)
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rounding must not reach the total
    picks = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    valid = (total[:, 0] > 0) & torch.isfinite(total[:, 0])
    return torch.where(valid, picks, probs.nan_to_num(nan=-1.0).argmax(-1))


def sample(logits: torch.Tensor, rows: SamplingRows) -> SampleOutput:
    """Pick one token per row: logits `[B, V]` fp32 from the model -> SampleOutput.

    The same tensor ops run whatever the rows ask (flags only skip work no row needs), and nothing is read back
    to the host here.
    """
    raw, flags = logits, rows.flags
    if flags.penalties:
        logits = apply_penalties(logits, rows)
    if rows.bias is not None:
        logits = logits.index_put(rows.bias[:2], rows.bias[2], accumulate=True)  # (a new tensor: raw stays the model's)
    if rows.allowed is not None:
        logits = apply_allowed(logits, *rows.allowed)
    token_ids = logits.argmax(-1)
    if flags.sampled:
        probs = filter_logits(logits, rows).softmax(-1)
        sampled = draw(probs, rows.seeds, rows.counters)
        token_ids = torch.where(rows.column("temperature")[:, 0] >= GREEDY_BELOW, sampled, token_ids)
    out = SampleOutput(token_ids=token_ids)
    if flags.logprobs is not None:
        logprobs = raw.log_softmax(-1)
        out.logprobs = logprobs.gather(1, token_ids[:, None])[:, 0]
        if flags.logprobs > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(flags.logprobs, dim=-1)
    return out


class SamplingTable:
    """Every pool slot's sampling parameters, seed, draw counter and penalty counts, on the device.

    A sequence's row is written once when it is admitted (`admit`); each step gathers the rows of its batch by
    slot (`rows`) and advances them after the draw (`advance`), so a step sends no parameters to the device.
    The `[slots, V]` penalty tensors are allocated on the first request that uses a penalty.
    """

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.params = torch.zeros(num_slots, len(PARAM_COLUMNS), dtype=torch.float32, device=device)
        self.seeds = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.counters = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def admit(self, slots: list[int], params: list[SamplingParams], seeds: list[int], prompts: list[list[int]]) -> None:
        """Start the rows of new sequences: their parameters and seeds, counters at 0, penalty counts cleared."""
        index = upload(slots, torch.int64, self.device)
        host = torch.tensor([param_row(p) for p in params], dtype=torch.float32)
        self.params.index_copy_(0, index, upload_tensor(host, self.device))
        self.seeds.index_copy_(0, index, upload(seeds, torch.int64, self.device))
        self.counters.index_fill_(0, index, 0)
        if any(p.uses_penalties for p in params):
            if self.counts is None:
                rows = self.params.shape[0]
                self.counts = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=self.device)
                self.prompt_mask = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
            self.counts.index_fill_(0, index, 0)
            self.prompt_mask.index_fill_(0, index, False)
            rows_of = [i for i, prompt in enumerate(prompts) for _ in prompt]
            tokens = [t for prompt in prompts for t in prompt]
            at = (index[upload(rows_of, torch.int64, self.device)], upload(tokens, torch.int64, self.device))
            self.prompt_mask.index_put_(at, torch.ones(len(tokens), dtype=torch.bool, device=self.device))

    def rows(self, slots: torch.Tensor, flags: BatchFlags, params: list[SamplingParams] | None = None) -> SamplingRows:
        """The rows of `slots` (`[B]` int64 on the device), in that order; `params`: the rows' own (their logit
        biases are sent with the step: sparse, per request, not kept per slot)."""
        penalties = flags.penalties and self.counts is not None
        return SamplingRows(
            params=self.params.index_select(0, slots),
            seeds=self.seeds.index_select(0, slots),
            counters=self.counters.index_select(0, slots),
            flags=flags,
            counts=self.counts.index_select(0, slots) if penalties else None,
            prompt_mask=self.prompt_mask.index_select(0, slots) if penalties else None,
            bias=logit_bias_rows(params, self.device) if flags.logit_bias and params is not None else None,
        )

    def sample(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        flags: BatchFlags,
        params: list[SamplingParams] | None = None,
        allowed: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    ) -> SampleOutput:
        """Sample `logits` `[B, V]` for the rows of `slots` (`[B]` int64 on the device) and advance those rows: the
        step's whole sampling, launched op by op or captured in a graph (engine/core/sampler_graphs.py)."""
        rows = self.rows(slots, flags, params)
        rows.allowed = allowed
        out = sample(logits, rows)
        self.advance(slots, out.token_ids, flags)
        return out

    def advance(self, slots: torch.Tensor, token_ids: torch.Tensor, flags: BatchFlags) -> None:
        """After a draw: each row's counter moves on, and its penalty counts take the drawn token."""
        self.counters.index_add_(0, slots, torch.ones_like(slots))
        if flags.penalties and self.counts is not None:
            self.counts.index_put_((slots, token_ids), torch.ones_like(token_ids, dtype=torch.float32), accumulate=True)
