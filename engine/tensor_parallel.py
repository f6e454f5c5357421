"""Tensor parallelism's arithmetic: the ranks' process group and Megatron's split of a layer's weights.

The first piece of `--tensor-parallel-size N` (docs/design/tensor-parallel.md, issue 31): each of N processes holds
a contiguous block of every layer's heads. A projection into heads is column-parallel (a rank keeps its rows of the
weight and computes its heads), the projection out is row-parallel (a rank keeps its columns and computes a partial
sum, which one `all_reduce` completes). The embedding and the LM head split the vocabulary. Nothing in the serving
path uses this module yet; the engine's ranks are the next step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among `size` ranks. With size 1 there is no group and every collective is the identity."""

    rank: int = 0
    size: int = 1

    @classmethod
    def start(cls, rank: int, size: int, init_method: str, backend: str | None = None) -> TensorParallel:
        """Join the group of `size` ranks at `init_method` (e.g. `file:///tmp/tp-init` or `tcp://127.0.0.1:29500`):
        NCCL when CUDA is there, gloo otherwise (CI's CPUs). NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`): on a
        shared host it can take the GPUs out of service."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not one of {size} tensor-parallel ranks")
        if size == 1:
            return cls()
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        return cls(rank, size)

    def block(self, n: int, what: str) -> slice:
        """This rank's contiguous block of `n` heads (or rows, channels) of `what`.

        Raises ValueError naming `what` when `n` does not divide among the ranks (refused at start-up, not rounded).
        """
        if n % self.size:
            raise ValueError(f"{what}: {n} does not divide among {self.size} tensor-parallel ranks")
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (any shape), in place; `x` itself with one rank."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` `[..., n]` side by side in rank order: `[..., size * n]`."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def column_shard(weight: torch.Tensor, tp: TensorParallel, what: str,
                 parts: Sequence[int] | None = None) -> torch.Tensor:  # fmt: skip
    """A projection into heads, `weight` `[out, in]` -> this rank's rows `[out / size, in]`.

    `parts`: the sizes of projections fused along `out` (SwiGLU's gate and up, Mamba-2's z, x, B, C, dt): each is
    split on its own, so a rank keeps its block of every part, in order. Default: one part.
    """
    parts = list(parts) if parts is not None else [weight.shape[0]]
    if sum(parts) != weight.shape[0]:
        raise ValueError(f"{what}: parts {parts} do not add up to its {weight.shape[0]} rows")
    pieces, start = [], 0
    for i, n in enumerate(parts):
        block = tp.block(n, f"{what} (part {i})" if len(parts) > 1 else what)
        pieces.append(weight[start + block.start : start + block.stop])
        start += n
    return torch.cat(pieces, dim=0).contiguous()


def row_shard(weight: torch.Tensor, tp: TensorParallel, what: str) -> torch.Tensor:
    """A projection out of heads, `weight` `[out, in]` -> this rank's columns `[out, in / size]`; its products are
    partial sums for `TensorParallel.all_reduce`."""
    return weight[:, tp.block(weight.shape[1], what)].contiguous()


def embed(ids: torch.Tensor, vocab_rows: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A vocab-parallel embedding: ids `[...]` -> `[..., d]`, from this rank's rows `[V / size, d]` (its block of
    the vocabulary); an id of another rank's block looks up zeros here, and the all-reduce adds the one real row."""
    start = tp.rank * vocab_rows.shape[0]
    local = ids - start
    mine = (local >= 0) & (local < vocab_rows.shape[0])
    out = vocab_rows[local.clamp(0, vocab_rows.shape[0] - 1)] * mine.unsqueeze(-1).to(vocab_rows.dtype)
    return tp.all_reduce(out)


def lm_logits(h: torch.Tensor, vocab_rows: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A vocab-parallel LM head: h `[..., d]` -> logits `[..., V]`, each rank's block `[..., V / size]` gathered in
    rank order (sampling needs whole rows)."""
    return tp.gather_last(h @ vocab_rows.t())
