"""Sampler graphs: a step's sampling captured in a CUDA graph per (batch bucket, what the rows ask), replayed padded.

The batched sampler (engine/core/sampling.py) is about 120 small tensor ops for a batch sampled at a temperature (the
counter-based random numbers are 89 of them; counted with the torch profiler): launched one by one from Python they
cost the host about 1.8 ms a step on an H100's host (docs/bench/structured-cuda-graphs-vs-eager-b.json: the
sampling call's median less its masks'), half a 370M model's decode step on the GPU. Captured once, a step's
sampling is one launch: gather the rows' parameters by slot, apply the grammar masks, sample, advance the rows'
counters and penalty counts, and keep the tokens on the device for the next decode (`next_tokens`), all from
static buffers.

That matters twice. Every step's host work shrinks. And a step with grammar-constrained rows, whose sampling can
only be launched once the previous step's tokens have advanced the grammars (engine/core/stepper.py), waits on the
host for the masks and one replay instead of the masks and 120 launches, so the device's forward pass hides it.

A graph is keyed by its bucket (`cuda_graphs.graph_batch_sizes`, the rows beyond the step's pointed at the pool's
scratch slot), its `BatchFlags` (which ops run) and whether masks apply. The common ones (greedy, or sampled at
a temperature, with or without masks) are captured at start-up, every other on the first step that needs it (a few
ms, once). Rows with `logit_bias` sample eagerly: their entries vary in number. The masks input
is a full `[bucket, ceil(V/32)]` bitmask, all bits set for free rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfree.engine.core.cuda_graphs import bucket_for, capture, graph_batch_sizes, padded_slots
from kvfree.engine.core.sampling import BatchFlags, SampleOutput, SamplingTable
from kvfree.engine.model.host_copy import upload_into
from kvfree.engine.text.grammar import mask_words


@dataclass
class _SamplerGraph:
    graph: torch.cuda.CUDAGraph
    out: SampleOutput  # static outputs, [bucket] rows


class SamplerGraphs:
    """Captured sampling for batches of up to `max_batch` rows over `table`'s slots.

    Args:
        table: the per-slot sampling parameters the graphs gather from (and advance).
        next_tokens: `[slots]` the runner's last sampled token per slot (written by the graphs).
        vocab_size: the logits' width.
        max_batch: the largest batch (the state pool's capacity).
        scratch_slot: the pool row padding rows read and write.
    """

    def __init__(
        self, table: SamplingTable, next_tokens: torch.Tensor, vocab_size: int, max_batch: int, scratch_slot: int
    ) -> None:
        self.table = table
        self.next_tokens = next_tokens
        self.sizes = graph_batch_sizes(max_batch)
        self.scratch_slot = scratch_slot
        device = table.device
        largest = self.sizes[-1]
        self.logits = torch.zeros(largest, vocab_size, dtype=torch.float32, device=device)
        self.slots = torch.full((largest,), scratch_slot, dtype=torch.int64, device=device)
        self.masks = torch.full((largest, mask_words(vocab_size)), -1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, BatchFlags, bool], _SamplerGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture_common(self) -> int:
        """Capture now, for every bucket, the batches most steps are: greedy, sampled at a temperature, either with
        grammar masks (the rest are captured when first met: a capture syncs the device, and on a server every
        stream waits for it). Largest bucket first, so the smaller ones reuse its memory. Returns the count."""
        kinds = [BatchFlags(), BatchFlags(sampled=True)]
        count = 0
        for size in reversed(self.sizes):
            for flags in kinds:
                for masked in (False, True):
                    if (size, flags, masked) not in self.graphs:
                        self.graphs[(size, flags, masked)] = self._capture(size, flags, masked)
                        count += 1
        return count

    def serves(self, batch: int, flags: BatchFlags) -> bool:
        """Whether a step of `batch` rows asking `flags` can replay a graph."""
        return not flags.logit_bias and bucket_for(batch, self.sizes) is not None

    def replay(
        self, logits: torch.Tensor, slots: list[int], flags: BatchFlags, masks: torch.Tensor | None
    ) -> SampleOutput:
        """Sample `logits` `[B, V]` for the rows of `slots` -> the tokens (views of static outputs, `[B]`, valid
        until the next replay); `masks`: `[B, ceil(V/32)]` int32 on the host, all bits set for free rows, or None.
        Like the eager path, the rows' counters advance and their tokens go to `next_tokens`."""
        n = len(slots)
        size = bucket_for(n, self.sizes)
        key = (size, flags, masks is not None)
        self.logits[:n].copy_(logits, non_blocking=True)
        upload_into(self.slots[:size], padded_slots(slots, size, self.scratch_slot))
        if masks is not None:  # (pinned by the caller: a true asynchronous copy)
            self.masks[:n].copy_(masks, non_blocking=True)
            self.masks[n:size].fill_(-1)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(size, flags, masks is not None)
        entry.graph.replay()
        out = entry.out
        return SampleOutput(
            token_ids=out.token_ids[:n],
            logprobs=None if out.logprobs is None else out.logprobs[:n],
            top_ids=None if out.top_ids is None else out.top_ids[:n],
            top_logprobs=None if out.top_logprobs is None else out.top_logprobs[:n],
        )

    def _step(self, size: int, flags: BatchFlags, masked: bool) -> SampleOutput:
        """The sampling of one bucket, as captured (and as run once eagerly before the capture)."""
        slots = self.slots[:size]
        out = self.table.sample(self.logits[:size], slots, flags, allowed=(None, self.masks[:size]) if masked else None)
        self.next_tokens.index_copy_(0, slots, out.token_ids)
        return out

    def _capture(self, size: int, flags: BatchFlags, masked: bool) -> _SamplerGraph:
        # The eager run first: the padding rows' slot is the scratch one, so what it advances is scratch too; the
        # real rows are sampled by the replay that follows, from the same inputs (the draw is a pure function of
        # each row's seed and counter, and the eager run's counter step is undone first).
        counters = self.table.counters.clone()
        counts = self.table.counts.clone() if flags.penalties and self.table.counts is not None else None
        next_tokens = self.next_tokens.clone()
        self._step(size, flags, masked)
        self.table.counters.copy_(counters)
        if counts is not None:
            self.table.counts.copy_(counts)
        self.next_tokens.copy_(next_tokens)
        graph, out = capture(lambda: self._step(size, flags, masked), self.pool, self.table.device)
        return _SamplerGraph(graph, out)
