"""CUDA graphs: decode steps captured per batch bucket, prefill steps per (token, sequence) bucket, replayed padded.

A decode step of a 48-layer model is a few hundred small kernels; launched one by one from Python their overhead
is most of the step. Captured once at start-up in a graph, a step is one launch (nano-vllm's `capture_cudagraph`,
vLLM's cudagraph buckets). Each graph covers embedding to logits for a fixed batch size; a batch of B sessions
replays the smallest bucket >= B, with the rows beyond B pointed at the pool's scratch slot, whose state is
scratch by definition. The only input is the slots: each row's token is looked up inside the graph (the runner
keeps the last sampled token of every slot on the device). Graphs share one memory pool and are captured largest
first, so the smaller ones reuse the larger one's memory. Sampling stays outside the graph.

A prefill step costs the host tens of milliseconds of launches too (an eager op call is 50-400 µs of Python),
while the GPU work of a 512-token step is a few ms. `PrefillGraphs` captures the model's own prefill per bucket of
tokens and sequences, the step padded with sentinel sequences on the scratch slot (engine/model/step_batch.py,
`pad_prefill`) and its ops' chunk metadata computed on the device (`StepBatch.device_chunks`), so that one graph
serves every step of its bucket (sglang's prefill graphs per token bucket; fla's RFC #1155 on capturable varlen).
"""

from __future__ import annotations

import gc
import logging
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvfree.engine.model.host_copy import upload, upload_into
from kvfree.engine.model.step_batch import StepBatch, pad_prefill

log = logging.getLogger("kvfree.engine")

# Graphs above this batch size cost capture time and memory for little gain: such steps are long enough that
# launch overhead is a small part of them (vLLM stops at 512 too).
MAX_GRAPH_BATCH = 512

Decode = Callable[[StepBatch], torch.Tensor]  # batch of B slots -> logits [B, V]
Prefill = Callable[[torch.Tensor, StepBatch], torch.Tensor]  # token ids [T], batch of N sequences -> logits [N, V]

# Sequence buckets of a prefill graph: a step of N sequences needs N + 1 (one more for the padding tokens). Steps of
# more sequences than the largest run eagerly: each sentinel costs every layer's state pass a program.
PREFILL_SEQ_SIZES = (2, 4, 8, 16, 32, 64)
# Token buckets: a few powers of two for short steps, then multiples of this, the scheduler's budget alignment
# (engine/core/scheduler.py PREFILL_ALIGN), so full steps fill their bucket exactly.
PREFILL_TOKEN_STEP = 256


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


def prefill_token_sizes(max_tokens: int) -> list[int]:
    """The prefill token buckets: 64, 128, then every 256 up to `max_tokens` (rounded up to a multiple of 256).

    A step of T tokens pads to the next: by at most 63 tokens up to 128, 255 above (under a quarter past 1,024).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    top = -(-max_tokens // PREFILL_TOKEN_STEP) * PREFILL_TOKEN_STEP
    return [64, 128, *range(PREFILL_TOKEN_STEP, top + 1, PREFILL_TOKEN_STEP)]


def prefill_bucket(
    tokens: int, seqs: int, token_sizes: list[int], seq_sizes: Sequence[int] = PREFILL_SEQ_SIZES
) -> tuple[int, int] | None:
    """The (token, sequence) bucket of a prefill of `seqs` sequences and `tokens` tokens: the smallest sizes holding
    `tokens` and `seqs + 1` (the padding sequence), or None when either exceeds every size."""
    t, n = bucket_for(tokens, token_sizes), bucket_for(seqs + 1, list(seq_sizes))
    return None if t is None or n is None else (t, n)


def capture(
    step: Callable[[], torch.Tensor], pool: tuple, device: torch.device
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `step()` into a new graph in the memory `pool` -> (the graph, its output tensor).

    The caller has run the same shapes eagerly just before, so that every Triton kernel is compiled and autotuned
    (a benchmark cannot run inside a capture) and every cached constant (Mamba-2's A) exists. Capture records
    kernels without running them: it writes no pool row. `thread_local`: another thread's CUDA calls (a server's)
    do not invalidate it. The garbage collector is off meanwhile: a collection inside the capture that frees an
    unreferenced graph (a dropped engine's) destroys it, which a capturing stream does not permit, and the capture
    fails (seen on an H100 with prefill graphs captured lazily after other engines were dropped).
    """
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = step()
    finally:
        if collecting:
            gc.enable()
    return graph, out


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
            self.graphs[size], self.logits[size] = capture(lambda b=batch: decode(b), pool, device)
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
        upload_into(self.state_indices[:size], padded_slots(slots, size, self.scratch_slot))
        self.graphs[size].replay()
        return self.logits[size][:n]


@dataclass
class _PrefillGraph:
    """One bucket's static input (`PrefillLayout.host_buffer`'s layout) and, once captured, its graph and logits."""

    inputs: torch.Tensor  # [tokens + 3 seqs + 1] int32
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # [seqs, V]


class PrefillGraphs:
    """Prefill steps captured per (token bucket, sequence bucket), replayed with the step padded to its bucket.

    A graph is the model's own prefill (`prefill(ids, batch)`, the same Python path as an eager step) over a
    `StepBatch.padded` view of its bucket's static input buffer, so the ops take their chunk metadata from the
    device and the graph serves every step of the bucket. Replay is one upload of the padded step's ids, slots,
    boundaries and last-token indices from pinned memory into that buffer, then `graph.replay()`.

    Buckets are captured lazily, on their first step, which runs eagerly through the very same buffers and ops
    (computing the step, and meeting every kernel shape the graph will launch) before the capture: a bucket's first
    step costs about twice an eager step plus a device sync, and every sequence decoding beside it waits that long.
    Offline (`LLM.generate`) that is a one-off cost; a server calls `capture_up_to` its step budget at start-up
    instead (60 graphs for 2,048 tokens), largest first, so no request meets a capture.

    The graphs share one memory pool (not the decode graphs', so a replay never overwrites decode logits still to be
    sampled). In lazy order a larger bucket may not fit the blocks a smaller one freed, so the pool can grow towards
    the sum of the captured buckets' activation peaks (each about one layer's activations of its tokens) rather than
    the largest one's. `capture` forces a bucket early.

    Args:
        prefill: the eager prefill to capture, `(token ids [T], StepBatch of N sequences) -> logits [N, V]` for each
            sequence's last token.
        max_tokens: the largest step to replay (its token bucket is the largest); larger steps run eagerly.
        scratch_slot: a pool row no session owns; the padding sequences write their state there.
        device: a CUDA device.
        seq_sizes: the sequence buckets.
    """

    def __init__(
        self,
        prefill: Prefill,
        max_tokens: int,
        scratch_slot: int,
        device: torch.device,
        seq_sizes: Sequence[int] = PREFILL_SEQ_SIZES,
    ) -> None:
        self.prefill = prefill
        self.token_sizes = prefill_token_sizes(max_tokens)
        self.seq_sizes = sorted(seq_sizes)
        self.scratch_slot = scratch_slot
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _PrefillGraph] = {}

    def bucket(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """The (tokens, sequences) bucket a prefill of `seqs` sequences and `tokens` tokens replays, or None."""
        return prefill_bucket(tokens, seqs, self.token_sizes, self.seq_sizes)

    def capture_up_to(self, max_tokens: int) -> int:
        """Capture every bucket a step of at most `max_tokens` tokens can replay (every sequence bucket of each token
        bucket up to the one holding `max_tokens`), largest first so the smaller ones reuse its memory. A server
        does this before its first request: a bucket captured on its first step stalls every stream of that step
        for the capture (about a tenth of a second). Returns how many were captured now."""
        top = bucket_for(min(max_tokens, self.token_sizes[-1]), self.token_sizes)
        keys = [(t, n) for t in self.token_sizes if t <= top for n in self.seq_sizes]
        new = [key for key in sorted(keys, reverse=True) if not self.captured(key)]
        for key in new:
            self.capture(*key)
        return len(new)

    def captured(self, key: tuple[int, int]) -> bool:
        """Whether bucket `key` has its graph (its next step is a replay, not an eager step and a capture)."""
        entry = self.graphs.get(key)
        return entry is not None and entry.graph is not None

    def replay(self, slots: list[int], chunks: list[list[int]]) -> torch.Tensor | None:
        """Feed `chunks[i]` into pool row `slots[i]` -> logits `[N, V]` of each chunk's last token (a view, valid until
        the next prefill replay), or None, doing nothing, when no bucket holds the step. Captures the bucket first if
        it is new (see the class docstring)."""
        lens = [len(c) for c in chunks]
        key = self.bucket(sum(lens), len(lens))
        if key is None:
            return None
        layout = pad_prefill(slots, lens, *key, self.scratch_slot)
        buffer = layout.host_buffer([t for c in chunks for t in c])
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = _PrefillGraph(torch.empty(len(buffer), dtype=torch.int32, device=self.device))
        upload_into(entry.inputs, buffer)
        if entry.graph is None:
            logits = self.prefill(*self._step(entry, key))  # this step, eagerly, through the graph's own buffers
            self._capture(entry, key)
            return logits[: len(lens)]
        entry.graph.replay()
        return entry.logits[: len(lens)]

    def capture(self, tokens: int, seqs: int) -> None:
        """Capture bucket (`tokens`, `seqs`) now, after an eager warm-up of its shapes on the scratch slot only (one
        padding sequence of every token, sentinels after it)."""
        key = (tokens, seqs)
        if key not in self.graphs:
            layout = pad_prefill([self.scratch_slot], [tokens], tokens, seqs, self.scratch_slot)
            inputs = upload(layout.host_buffer([0] * tokens), torch.int32, self.device)
            entry = self.graphs[key] = _PrefillGraph(inputs)
            self.prefill(*self._step(entry, key))
        if self.graphs[key].graph is None:
            self._capture(self.graphs[key], key)

    def _step(self, entry: _PrefillGraph, key: tuple[int, int]) -> tuple[torch.Tensor, StepBatch]:
        # No host boundaries: what the graph records must hold for every step of the bucket.
        return StepBatch.padded(entry.inputs, *key)

    def _capture(self, entry: _PrefillGraph, key: tuple[int, int]) -> None:
        entry.graph, entry.logits = capture(lambda: self.prefill(*self._step(entry, key)), self.pool, self.device)
        log.info("captured a CUDA graph for prefill steps of %d tokens, %d sequences", *key)
