"""CUDA graphs for decode: one captured decode step per batch bucket, replayed with the batch padded to its bucket.

A decode step of a 48-layer model is a few hundred small kernels; launched one by one from Python their overhead
is most of the step. Captured once at start-up in a graph, a step is one launch (nano-vllm's `capture_cudagraph`,
vLLM's cudagraph buckets). Each graph covers embedding to logits for a fixed batch size; a batch of B sessions
replays the smallest bucket >= B, with the rows beyond B pointed at the pool's scratch slot, whose state is
scratch by definition. The only input is the slots: each row's token is looked up inside the graph (the runner
keeps the last sampled token of every slot on the device). Graphs share one memory pool and are captured largest
first, so the smaller ones reuse the larger one's memory. Sampling stays outside the graph.
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable

import torch

from kvfree.engine.step_batch import StepBatch

log = logging.getLogger("kvfree.engine")

# Graphs above this batch size cost capture time and memory for little gain: such steps are long enough that
# launch overhead is a small part of them (vLLM stops at 512 too).
MAX_GRAPH_BATCH = 512

Decode = Callable[[StepBatch], torch.Tensor]  # batch of B slots -> logits [B, V]


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 after; `max_batch` last.

    Padding wastes at most 1/8 of a step beyond 8 sessions (decode cost is about linear in the batch).
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16), *range(288, MAX_GRAPH_BATCH + 1, 32)]
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds `batch` sessions, or None when it is larger than every bucket."""
    i = bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


def padded_slots(slots: list[int], bucket: int, scratch_slot: int) -> list[int]:
    """`slots` followed by the scratch slot up to `bucket` rows."""
    if len(slots) > bucket:
        raise ValueError(f"{len(slots)} sessions do not fit a bucket of {bucket}")
    return [*slots, *[scratch_slot] * (bucket - len(slots))]


class DecodeGraphs:
    """Captured decode steps for the buckets of `graph_batch_sizes(max_batch)`, and their static inputs.

    Args:
        decode: the eager decode step to capture, `StepBatch of B slots -> logits [B, V]`.
        max_batch: the largest batch to capture (at most `MAX_GRAPH_BATCH`).
        scratch_slot: a pool row no session owns; padding rows write their state there.
        device: a CUDA device.
        sizes: capture exactly these batch sizes instead of the buckets (benchmarks).
    """

    def __init__(
        self, decode: Decode, max_batch: int, scratch_slot: int, device: torch.device, sizes: list[int] | None = None
    ) -> None:
        self.sizes = sorted(sizes) if sizes else graph_batch_sizes(min(max_batch, MAX_GRAPH_BATCH))
        self.scratch_slot = scratch_slot
        largest = self.sizes[-1]
        # The static input every graph reads: replay copies this step's slots into it first.
        self.state_indices = torch.full((largest,), scratch_slot, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory
            batch = self._batch(size)
            decode(batch)  # warm-up: compiles Triton kernels, sets up cuBLAS workspaces
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = decode(batch)
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def _batch(self, size: int) -> StepBatch:
        return StepBatch(
            state_indices=self.state_indices[:size],
            cu_seqlens=self.cu_seqlens[: size + 1],
            cu_seqlens_cpu=tuple(range(size + 1)),
            last_token_indices=self.cu_seqlens[1 : size + 1].long() - 1,
            is_decode=True,
        )

    def bucket(self, batch: int) -> int | None:
        return bucket_for(batch, self.sizes)

    def replay(self, slots: list[int]) -> torch.Tensor:
        """Run the captured step for the sessions in `slots` -> logits `[B, V]` (a view, valid until the next
        replay)."""
        n = len(slots)
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"{n} sessions exceed the largest captured batch {self.sizes[-1]}")
        host = torch.tensor(padded_slots(slots, size, self.scratch_slot), dtype=torch.int32, pin_memory=True)
        self.state_indices[:size].copy_(host, non_blocking=True)  # pinned: a true asynchronous copy
        self.graphs[size].replay()
        return self.logits[size][:n]
