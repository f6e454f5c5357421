"""StepBatch: the description of one forward call's sessions, built once per step and read by every layer.

Every mixer gets the same object instead of rebuilding offsets or slot tensors itself (docs/design/architecture.md
§3-§4). Ops receive `state_indices` and `cu_seqlens` and update the pool rows in place, so no layer gathers or
scatters state rows around an op.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfree.engine.host_copy import upload


@dataclass(frozen=True)
class StepBatch:
    """B sessions in one call: prefill (a packed chunk of each) or decode (one token each).

    state_indices: `[B]` int32, on the model's device: each session's pool row.
    cu_seqlens: `[B+1]` int32, on the device: session i's tokens are `cu_seqlens[i]:cu_seqlens[i+1]` of the packed
        token axis (decode: 0, 1, ..., B).
    cu_seqlens_cpu: the same on the host as a tuple of ints, for kernels that plan their grid from it and for
        Python-side offsets (a tuple: ops check it once per step, not once per layer; kernels/dispatch.py).
    last_token_indices: `[B]` int64, on the device: where each session's last token sits on the packed axis.
    is_decode: one token per session (the CUDA-graph path), rather than a prefill chunk.
    """

    state_indices: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: tuple[int, ...]
    last_token_indices: torch.Tensor
    is_decode: bool

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
