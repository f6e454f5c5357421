"""Tensor parallelism's arithmetic: the ranks' process group and Megatron's split of a layer's weights.

`--tensor-parallel-size N` (docs/design/tensor-parallel.md): each of N processes holds a contiguous block of every
layer's heads. A projection into heads is column-parallel (a rank keeps its rows of the weight and computes its
heads), the projection out is row-parallel (a rank keeps its columns and computes a partial sum, which one
`all_reduce` completes). The embedding and the LM head split the vocabulary. How each weight and each state tensor
splits is declared once, as a `Split`, by the module that owns it; the loader cuts a checkpoint's tensors with it and
the snapshot path puts a session's shards back together with it, so a snapshot's format does not depend on N.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Split:
    """How one tensor (a weight, or a session's state tensor without its slot axis) is divided among the ranks.

    axis: the axis cut into blocks. parts: this rank's sizes of the pieces fused along `axis` (Mamba-2's in_proj holds
    z, x, B, C and dt back to back; each is cut on its own, a rank keeping its block of every piece, in order); empty
    means one piece, the whole axis. replicas: per piece, how many consecutive ranks hold the same block (1: split;
    k > 1: fewer heads than ranks, each head held by k ranks, as grouped-query attention's KV heads at TP > Hkv);
    empty means 1 for every piece. first_rank_only: the tensor is whole on rank 0 and zero elsewhere (the bias of a
    row-parallel projection, which the all-reduce would otherwise add N times). length: the whole axis's length when
    it need not divide among the ranks (the vocabulary): it is padded with zero rows up to a multiple of them, and the
    padding is cut off again when the tensor is put back together.
    """

    axis: int = 0
    parts: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()
    first_rank_only: bool = False
    length: int | None = None

    def pieces(self, rank_size: int) -> list[tuple[int, int]]:
        """(this rank's size, replicas) of each piece, given this rank's size of the axis."""
        parts = self.parts or (rank_size,)
        replicas = self.replicas or (1,) * len(parts)
        if sum(parts) != rank_size or len(replicas) != len(parts):
            raise ValueError(f"split {self} does not describe an axis of {rank_size}")
        return list(zip(parts, replicas, strict=True))


ROW = Split(axis=1)  # a row-parallel projection's weight `[out, in]`: this rank's columns
ROW_BIAS = Split(first_rank_only=True)  # a row-parallel projection's bias: added once, by rank 0


@dataclass(frozen=True)
class TensorParallel:
    """This process's place among `size` ranks. With size 1 there is no group and every collective is the identity."""

    rank: int = 0
    size: int = 1

    @classmethod
    def start(cls, rank: int, size: int, init_method: str, backend: str | None = None,
              timeout: timedelta | None = None) -> TensorParallel:  # fmt: skip
        """Join the group of `size` ranks at `init_method` (e.g. `file:///tmp/tp-init` or `tcp://127.0.0.1:29500`):
        NCCL when CUDA is there, gloo otherwise (CI's CPUs). NVLink multicast stays off (`NCCL_NVLS_ENABLE=0`,
        `TORCH_SYMM_MEM_DISABLE_MULTICAST=1`): on a shared host it can take the GPUs out of service."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not one of {size} tensor-parallel ranks")
        if size == 1:
            return cls()
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        return cls(rank, size)

    def block(self, n: int, what: str) -> slice:
        """This rank's contiguous block of `n` heads (or rows, channels) of `what`.

        Raises ValueError naming `what` when `n` does not divide among the ranks (refused at start-up, not rounded).
        """
        if n % self.size:
            raise ValueError(f"{what}: {n} does not divide among {self.size} tensor-parallel ranks")
        per = n // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def heads(self, n: int, what: str, replicate: bool = False) -> tuple[int, int]:
        """(heads per rank, ranks per head) for `n` heads of `what`: (n / size, 1) when they divide; with
        `replicate`, fewer heads than ranks are each held whole by size / n consecutive ranks, (1, size / n) (KV heads
        of grouped-query attention, as vLLM's). Raises ValueError naming `what` otherwise."""
        if n % self.size == 0:
            return n // self.size, 1
        if replicate and self.size % n == 0:
            return 1, self.size // n
        how = " (nor is it a divisor of the ranks, to replicate)" if replicate else ""
        raise ValueError(f"{what}: {n} does not divide among {self.size} tensor-parallel ranks{how}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (any shape), in place; `x` itself with one rank."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place (the decode step's input tokens, which rank 0 samples)."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` `[..., n]` side by side in rank order: `[..., size * n]`."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


ONE_RANK = TensorParallel()  # no tensor parallelism: every collective is the identity


def rank_shape(full: Sequence[int], split: Split | None, size: int, what: str) -> tuple[int, ...]:
    """The shape one rank holds of a tensor of shape `full` under `split` (refused, naming `what`, when it does not
    divide)."""
    if split is None or split.first_rank_only or size == 1:
        return tuple(full)
    if split.length is not None:
        if full[split.axis] != split.length:
            raise ValueError(f"{what}: {full[split.axis]} rows, not {split.length}")
        shape = list(full)
        shape[split.axis] = -(-split.length // size)
        return tuple(shape)
    total, rank = full[split.axis], 0
    parts = split.parts or (None,)
    replicas = split.replicas or (1,) * len(parts)
    if split.parts:
        # The full pieces are the rank pieces times size / replicas; they must add up to the full axis.
        full_sum = sum(p * size // r for p, r in zip(parts, replicas, strict=True))
        if full_sum != total:
            raise ValueError(f"{what}: {total} does not split into pieces {list(parts)} on {size} ranks")
        rank = sum(parts)
    else:
        blocks = size // replicas[0]
        if total % blocks:
            raise ValueError(f"{what}: {total} does not divide among {size} tensor-parallel ranks")
        rank = total // blocks
    shape = list(full)
    shape[split.axis] = rank
    return tuple(shape)


def whole_shape(shape: Sequence[int], split: Split | None, size: int) -> tuple[int, ...]:
    """The whole tensor's shape, from the shape one rank holds under `split` (the inverse of `rank_shape`)."""
    if split is None or split.first_rank_only or size == 1:
        return tuple(shape)
    out = list(shape)
    out[split.axis] = split.length or sum(p * size // r for p, r in split.pieces(shape[split.axis]))
    return tuple(out)


def shard(full: torch.Tensor, split: Split | None, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of the whole tensor `full` (a checkpoint's weight, or a session's state tensor)."""
    if split is None or tp.size == 1:
        return full
    if split.first_rank_only:
        return full if tp.rank == 0 else torch.zeros_like(full)
    return split_among(full, split, tp.size)[tp.rank]


def split_among(full: torch.Tensor, split: Split, size: int) -> list[torch.Tensor]:
    """Every rank's part of `full`, in rank order (rank parts are contiguous copies)."""
    rank_len = rank_shape(full.shape, split, size, "tensor")[split.axis]
    moved = full.movedim(split.axis, 0)
    if split.length is not None and rank_len * size > split.length:  # zero rows up to a multiple of the ranks
        moved = torch.cat([moved, moved.new_zeros(rank_len * size - split.length, *moved.shape[1:])])
    out: list[list[torch.Tensor]] = [[] for _ in range(size)]
    start = 0
    for part, replicas in split.pieces(rank_len):
        blocks = size // replicas
        for rank in range(size):
            b = rank // replicas
            out[rank].append(moved[start + b * part : start + (b + 1) * part])
        start += part * blocks
    return [torch.cat(p, dim=0).movedim(0, split.axis).contiguous() for p in out]


def unshard(parts: Sequence[torch.Tensor], split: Split | None) -> torch.Tensor:
    """The whole tensor from every rank's part (in rank order): the inverse of `split_among`. A replicated tensor
    (`split` None) is rank 0's."""
    if split is None or split.first_rank_only or len(parts) == 1:
        return parts[0]
    size = len(parts)
    moved = [p.movedim(split.axis, 0) for p in parts]
    pieces, start = [], 0
    for part, replicas in split.pieces(moved[0].shape[0]):
        pieces += [moved[rank][start : start + part] for rank in range(0, size, replicas)]
        start += part
    whole = torch.cat(pieces, dim=0)[: split.length]  # (the padding of a `length` split cut off)
    return whole.movedim(0, split.axis).contiguous()


def embed(ids: torch.Tensor, vocab_rows: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A vocab-parallel embedding: ids `[...]` -> `[..., d]`, from this rank's rows `[V / size, d]` (its block of
    the vocabulary); an id of another rank's block looks up zeros here, and the all-reduce adds the one real row."""
    start = tp.rank * vocab_rows.shape[0]
    local = ids - start
    mine = (local >= 0) & (local < vocab_rows.shape[0])
    out = vocab_rows[local.clamp(0, vocab_rows.shape[0] - 1)] * mine.unsqueeze(-1).to(vocab_rows.dtype)
    return tp.all_reduce(out)


def lm_logits(h: torch.Tensor, vocab_rows: torch.Tensor, tp: TensorParallel, vocab: int | None = None) -> torch.Tensor:
    """A vocab-parallel LM head: h `[..., d]` -> logits `[..., V]`, each rank's block `[..., V / size]` gathered in
    rank order (sampling needs whole rows); `vocab`: the real V when the rows were padded (the padding is cut)."""
    return tp.gather_last(h @ vocab_rows.t())[..., :vocab]
