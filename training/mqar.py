"""MQAR (multi-query associative recall): the task of docs/design/ska.md §7.3, and Zoology's (`make_zoology_mqar`).

ska.md's: one sequence for (M pairs, gap), vocabulary V = 128 (keys in [0, 64), values in [64, 128)):

    x = [k1 v1 ... kM vM]  +  gap filler tokens drawn from the key range  +  [k_p1 v_p1 ... k_pM v_pM]

Every key is queried once, in a random order, each followed by its value. The model is scored at each query key:
its next-token prediction, restricted to the MQAR vocabulary, must be the key's value. Training draws fresh
sequences from one seed stream; evaluation uses a disjoint, fixed held-out stream per cell. A `Task` names a grid
of cells (pairs by gap, or by length for Zoology's) and its held-out batches; `TASKS` holds both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

VOCAB = 128
HALF = VOCAB // 2
HELD_OUT_SEED = 1_000_003  # evaluation streams start here; training seeds stay below it
IGNORE = -100


@dataclass(frozen=True)
class MQARBatch:
    """input_ids `[B, T]`; targets `[B, T]`: at each query key the value that follows it, elsewhere IGNORE.

    prefix_len: 2M + gap, the tokens before the query block (what a server would prefill as the prompt).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    prefix_len: int

    @property
    def query_positions(self) -> torch.Tensor:
        """`[M]` positions of the query keys (identical for every row)."""
        return (self.targets[0] != IGNORE).nonzero()[:, 0]


def _distinct(batch: int, m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """`[batch, m]` distinct integers from [0, n) per row."""
    return torch.rand(batch, n, generator=gen).argsort(dim=1)[:, :m]


def make_mqar(num_pairs: int, gap: int, batch: int, gen: torch.Generator) -> MQARBatch:
    """A batch of MQAR sequences of length 4·num_pairs + gap (on the CPU; move to the device as needed)."""
    if not 1 <= num_pairs <= HALF:
        raise ValueError(f"num_pairs must be in [1, {HALF}], got {num_pairs}")
    if gap < 0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    M = num_pairs
    keys = _distinct(batch, M, HALF, gen)
    values = HALF + _distinct(batch, M, VOCAB - HALF, gen)
    kv = torch.stack([keys, values], dim=2).flatten(1)  # [B, 2M]: k1 v1 k2 v2 ...
    filler = torch.randint(0, HALF, (batch, gap), generator=gen)
    order = torch.rand(batch, M, generator=gen).argsort(dim=1)
    queries = torch.stack([keys.gather(1, order), values.gather(1, order)], dim=2).flatten(1)
    input_ids = torch.cat([kv, filler, queries], dim=1)
    targets = torch.full_like(input_ids, IGNORE)
    prefix = 2 * M + gap
    key_pos = prefix + 2 * torch.arange(M)
    targets[:, key_pos] = input_ids[:, key_pos + 1]
    return MQARBatch(input_ids=input_ids, targets=targets, prefix_len=prefix)


def held_out(num_pairs: int, gap: int, batch: int, index: int = 0) -> MQARBatch:
    """The fixed evaluation batch number `index` of cell (num_pairs, gap), disjoint from training streams."""
    seed = HELD_OUT_SEED + 7919 * num_pairs + 104_729 * gap + index
    return make_mqar(num_pairs, gap, batch, torch.Generator().manual_seed(seed))


# -- Zoology's MQAR: a large vocabulary, many pairs, queries spread over the rest of the sequence -------------------

ZOOLOGY_VOCAB = 8192
ZOOLOGY_HELD_OUT_SEED = 2_000_003
POWER_A = 0.01  # Zoology's default: query positions drawn with p(i) ∝ i^(POWER_A - 1), mostly early


def make_zoology_mqar(
    num_pairs: int, seq_len: int, batch: int, gen: torch.Generator, vocab: int = ZOOLOGY_VOCAB
) -> MQARBatch:
    """A batch of Zoology's multi-query associative recall (Arora et al. 2023, "Zoology", `multiquery_ar`).

    Each row of length `seq_len`: first the M = `num_pairs` pairs `k1 v1 ... kM vM` (keys distinct, from
    [1, vocab/2); values distinct, from [vocab/2, vocab)), then seq_len - 2M tokens in which each key appears once
    more, at an even offset 2i of that part, with the i drawn without replacement with p(i) ∝ i^(POWER_A - 1) (near
    the pairs more often than far). Every other token of that part is drawn uniformly from the whole vocabulary. The
    model is scored at each repeated key: its prediction must be the key's value, which is never shown after it (the
    next token is random), so every answer is a recall of the pairs. prefix_len is 2M, the pairs.
    """
    M, T = num_pairs, seq_len
    if M < 1 or 4 * M > T:
        raise ValueError(f"num_pairs must be in [1, seq_len / 4] = [1, {T // 4}], got {M}")
    if vocab // 2 - 1 < M:
        raise ValueError(f"vocab {vocab} has {vocab // 2 - 1} keys, fewer than num_pairs = {M}")
    space = (T - 2 * M) // 2  # even offsets of the query part where a key can go
    keys = 1 + _distinct(batch, M, vocab // 2 - 1, gen)
    values = vocab // 2 + _distinct(batch, M, vocab - vocab // 2, gen)
    weights = torch.arange(1, space + 1, dtype=torch.float64) ** (POWER_A - 1)
    offsets = 2 * torch.multinomial(weights.expand(batch, space), M, replacement=False, generator=gen)
    rest = torch.randint(0, vocab, (batch, T - 2 * M), generator=gen)
    rest.scatter_(1, offsets, keys)
    kv = torch.stack([keys, values], dim=2).flatten(1)
    targets = torch.full((batch, T), IGNORE, dtype=torch.long)
    targets[:, 2 * M :].scatter_(1, offsets, values)
    return MQARBatch(input_ids=torch.cat([kv, rest], dim=1), targets=targets, prefix_len=2 * M)


def zoology_held_out(num_pairs: int, seq_len: int, batch: int, index: int = 0, vocab: int = ZOOLOGY_VOCAB) -> MQARBatch:
    """The fixed evaluation batch number `index` of Zoology cell (num_pairs, seq_len), disjoint from training."""
    seed = ZOOLOGY_HELD_OUT_SEED + 7919 * num_pairs + 104_729 * seq_len + index
    return make_zoology_mqar(num_pairs, seq_len, batch, torch.Generator().manual_seed(seed), vocab)


@dataclass(frozen=True)
class Task:
    """An MQAR task's grid of cells (pairs M, x), where x is the gap (`make_mqar`) or the length (Zoology's)."""

    name: str
    about: str  # what a model trained on it learned, for its config's notes
    axis: str  # what x is: "gap" or "T"
    vocab: int  # token ids the task uses, [0, vocab); scored over these
    held_out: Callable[[int, int, int, int], MQARBatch]  # (pairs, x, batch, index) -> the fixed evaluation batch
    tokens_per_pair: int = 0  # a cell needs x >= tokens_per_pair * M (Zoology: the pairs fill at most half)

    def fits(self, num_pairs: int, x: int) -> bool:
        return x >= self.tokens_per_pair * num_pairs

    def key(self, num_pairs: int, x: int) -> str:
        """The cell's name in reports (`cell_key`)."""
        return cell_key(num_pairs, self.axis, x)


def cell_key(num_pairs: int, axis: str, x: int) -> str:
    """A cell's name in reports, e.g. "M=4,gap=64" or "M=64,T=512"; `parse_cell` reads it back."""
    return f"M={num_pairs},{axis}={x}"


def parse_cell(key: str) -> tuple[int, str, int]:
    """A report's cell name "M=4,gap=64" -> (4, "gap", 64)."""
    pairs, axis = key.split(",")
    name, _, x = axis.partition("=")
    return int(pairs.removeprefix("M=")), name, int(x)


TASKS = {
    "mqar": Task("mqar", "MQAR (docs/design/ska.md §7.3): token ids 0..127", "gap", VOCAB, held_out),
    "zoology": Task(
        "zoology", "Zoology's MQAR (kvfree.training.mqar.make_zoology_mqar): token ids 0..8191", "T", ZOOLOGY_VOCAB,
        zoology_held_out, tokens_per_pair=4,
    ),  # fmt: skip
}
