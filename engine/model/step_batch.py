"""StepBatch: the description of one forward call's sessions, built once per step and read by every layer.

Every mixer gets the same object instead of rebuilding offsets or slot tensors itself (docs/design/architecture.md
§3-§4). Ops receive `state_indices` and `cu_seqlens` and update the pool rows in place, so no layer gathers or
scatters state rows around an op.

A prefill for a CUDA graph (engine/core/cuda_graphs.py, `PrefillGraphs`) is padded to a bucket of tokens and sequences
(`pad_prefill`) and carries `device_chunks`: its ops derive their chunk metadata from `cu_seqlens` on the device, so
the same step replays with other boundaries.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfree.engine.model.host_copy import upload
from kvfree.kernels.dispatch import DeviceChunks


@dataclass(frozen=True)
class StepBatch:
    """B sessions in one call: prefill (a packed chunk of each) or decode (one token each).

    state_indices: `[B]` int32, on the model's device: each session's pool row.
    cu_seqlens: `[B+1]` int32, on the device: session i's tokens are `cu_seqlens[i]:cu_seqlens[i+1]` of the packed
        token axis (decode: 0, 1, ..., B).
    cu_seqlens_cpu: the same on the host as a tuple of ints, for kernels that plan their grid from it and for
        Python-side offsets (a tuple: ops check it once per step, not once per layer; kernels/dispatch.py). None in
        a prefill captured in a CUDA graph, whose boundaries change from replay to replay.
    last_token_indices: `[B]` int64 (int32 in a padded prefill), on the device: where each session's last token
        sits on the packed axis.
    is_decode: one token per session (the CUDA-graph path), rather than a prefill chunk.
    device_chunks: set on a padded prefill (`StepBatch.padded`, and the prefill graphs): ops that chunk the packed
        axis take their chunk metadata from the device through it, sized by bounds the shapes give (T tokens, B
        sequences), instead of planning on `cu_seqlens_cpu` (`kvfree.kernels.dispatch.DeviceChunks`). Sequences of
        length 0 may then appear: they produce nothing and leave their rows untouched.
    """

    state_indices: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: tuple[int, ...] | None
    last_token_indices: torch.Tensor
    is_decode: bool
    device_chunks: DeviceChunks | None = None

    @classmethod
    def prefill(
        cls, slots: Sequence[int] | torch.Tensor, lens: Sequence[int], device: torch.device | str | None = None
    ) -> StepBatch:
        """A packed prefill of `lens[i]` tokens for the session in pool row `slots[i]` (lengths >= 1).

        `device` defaults to that of `slots` when it is a tensor, else the CPU.
        """
        if device is None:
            device = slots.device if isinstance(slots, torch.Tensor) else "cpu"
        slots = _host_ints(slots)
        if len(slots) != len(lens) or not lens or min(lens) < 1:
            raise ValueError(f"prefill needs one length >= 1 per slot, got slots {slots} and lengths {list(lens)}")
        return cls._build(slots, [0, *itertools.accumulate(lens)], device, is_decode=False)

    @classmethod
    def padded(
        cls, buffer: torch.Tensor, tokens: int, seqs: int, cu_seqlens_cpu: tuple[int, ...] | None = None
    ) -> tuple[torch.Tensor, StepBatch]:
        """A prefill padded to a bucket, from its input buffer on the device -> (token ids `[tokens]`, the step).

        buffer: `[tokens + 3 seqs + 1]` int32, laid out by `PrefillLayout.host_buffer` (a CUDA graph's static input,
        or one upload for an eager padded step). The step's ops take their chunk metadata from the device
        (`device_chunks`); `cu_seqlens_cpu`, when given, serves the ops that plan on the host (the references), and
        must be None for a step captured in a graph.
        """
        ids, slots, cu, last = buffer.split([tokens, seqs, seqs + 1, seqs])
        batch = cls(
            state_indices=slots,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_seqlens_cpu,
            last_token_indices=last,
            is_decode=False,
            device_chunks=DeviceChunks(cu, tokens),
        )
        return ids, batch

    @classmethod
    def decode(cls, slots: Sequence[int] | torch.Tensor, device: torch.device | str | None = None) -> StepBatch:
        """One token for each session in `slots` (a device tensor of slots keeps its device)."""
        if device is None:
            device = slots.device if isinstance(slots, torch.Tensor) else "cpu"
        host = _host_ints(slots)
        return cls._build(host, list(range(len(host) + 1)), device, is_decode=True)

    @classmethod
    def _build(cls, slots: list[int], cu: list[int], device: torch.device | str, is_decode: bool) -> StepBatch:
        # One host->device copy of one int buffer (pinned: no wait), then views: [slots | cu_seqlens] as int32.
        dev = upload(slots + cu, torch.int32, torch.device(device))
        n = len(slots)
        return cls(
            state_indices=dev[:n],
            cu_seqlens=dev[n:],
            cu_seqlens_cpu=tuple(cu),
            last_token_indices=(dev[n + 1 :] - 1).long(),
            is_decode=is_decode,
        )


def _host_ints(values: Sequence[int] | torch.Tensor) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]


@dataclass(frozen=True)
class PrefillLayout:
    """A prefill of `real` sequences laid out on a bucket of `tokens` tokens and `seqs` > `real` sequences.

    The real sequences come first, unchanged; then one sequence of the padding tokens (`tokens - T`, possibly 0) on
    the scratch slot; then sentinel sequences of length 0 on the scratch slot. Only the scratch row's state changes
    beyond the real sessions', so a padded step computes for the real sequences what the unpadded one does.

    slots: `[seqs]` pool rows.  cu_seqlens: `[seqs + 1]` boundaries, ending at `tokens`.
    last_token_indices: `[seqs]` each sequence's last token (a sentinel's: the token before it, or 0).
    """

    slots: tuple[int, ...]
    cu_seqlens: tuple[int, ...]
    last_token_indices: tuple[int, ...]
    real: int

    @property
    def tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def seqs(self) -> int:
        return len(self.slots)

    def host_buffer(self, token_ids: Sequence[int]) -> list[int]:
        """`[token ids, then 0 up to tokens | slots | cu_seqlens | last-token indices]`, `[tokens + 3 seqs + 1]`:
        what one upload copies into a padded step's input buffer (`StepBatch.padded`). Padding tokens are id 0."""
        if len(token_ids) != self.cu_seqlens[self.real]:
            raise ValueError(f"{len(token_ids)} token ids for {self.cu_seqlens[self.real]} real tokens")
        pad = [0] * (self.tokens - len(token_ids))
        return [*token_ids, *pad, *self.slots, *self.cu_seqlens, *self.last_token_indices]


def pad_prefill(
    slots: Sequence[int], lens: Sequence[int], tokens: int, seqs: int, scratch_slot: int
) -> PrefillLayout:
    """Lay out a prefill of `lens[i]` tokens (>= 1) into pool row `slots[i]` on a bucket of `tokens` >= sum(lens)
    tokens and `seqs` > len(lens) sequences, padded on `scratch_slot` (see `PrefillLayout`)."""
    n, total = len(lens), sum(lens)
    if len(slots) != n or not lens or min(lens) < 1:
        raise ValueError(f"prefill needs one length >= 1 per slot, got slots {list(slots)} and lengths {list(lens)}")
    if total > tokens or n >= seqs:
        raise ValueError(f"{n} sequences of {total} tokens do not fit a bucket of {tokens} tokens, {seqs} sequences")
    cu = [0, *itertools.accumulate(lens), *[tokens] * (seqs - n)]
    return PrefillLayout(
        slots=(*map(int, slots), *[scratch_slot] * (seqs - n)),
        cu_seqlens=tuple(cu),
        last_token_indices=tuple(max(c - 1, 0) for c in cu[1:]),
        real=n,
    )
