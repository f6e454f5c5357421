"""MQAR (multi-query associative recall), as specified in docs/design/ska.md §7.3.

One sequence for (M pairs, gap), vocabulary V = 128 (keys in [0, 64), values in [64, 128)):

    x = [k1 v1 ... kM vM]  +  gap filler tokens drawn from the key range  +  [k_p1 v_p1 ... k_pM v_pM]

Every key is queried once, in a random order, each followed by its value. The model is scored at each query key:
its next-token prediction, restricted to the MQAR vocabulary, must be the key's value. Training draws fresh
sequences from one seed stream; evaluation uses a disjoint, fixed held-out stream per cell.
"""

from __future__ import annotations

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
