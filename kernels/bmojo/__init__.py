"""B'MOJO memory (docs/design/bmojo.md §3): innovation score, bounded eidetic top-m store, chunked memory attention,
and the serving ops over the memory state in a pool. The fading-memory SSM itself is kernels/mamba2.

`chunk_bmojo` (packed variable-length prefill) and `fused_recurrent_bmojo` (one decode token per session) read and
write the `MemoryState` tensors in place in pool rows addressed by slot; each is its PyTorch reference (reference.py,
the spec) dispatched to the Triton kernels beside it (`chunk.py`, `fused_recurrent.py`) by `kvfree.kernels.dispatch.Op`
(`KVFREE_KERNELS`). Float64 inputs or K/V pools always take the reference: the kernels compute in fp32. The Triton
decode has no host sync (graph-capturable); the reference decode finds chunk boundaries with `nonzero()`.
`bmojo_chunked` is the differentiable math on a batch of sequences with explicit states (the training forward).
"""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch import Op
from . import reference
from .reference import (
    FadingKV,
    MemoryState,
    bmojo_chunked,
    chunked_memory_attention,
    eidetic_update,
    innovation,
    topm_index,
)

__all__ = [
    "FadingKV",
    "MemoryState",
    "bmojo_chunked",
    "chunk_bmojo",
    "chunked_memory_attention",
    "decode_graph_safe",
    "eidetic_update",
    "fused_recurrent_bmojo",
    "innovation",
    "topm_index",
]


def decode_graph_safe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fused_recurrent_bmojo` on activations of `dtype` on `device` runs without a host sync (the Triton
    path), so that a decode step may be captured in a CUDA graph."""
    return dtype != torch.float64 and fused_recurrent_bmojo.device_check(device)


def _below_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor, t: torch.Tensor,
                y_buf: torch.Tensor, ring_k: torch.Tensor, *args: Any, **kwargs: Any) -> bool:  # fmt: skip
    """The kernels take inputs and K/V pools below fp64 (fp64 runs are the reference's: the oracle)."""
    return q.dtype != torch.float64 and ring_k.dtype != torch.float64


chunk_bmojo = Op(reference.chunk_bmojo, "bmojo.chunk:chunk_bmojo", takes=_below_fp64)
fused_recurrent_bmojo = Op(reference.fused_recurrent_bmojo, "bmojo.fused_recurrent:fused_recurrent_bmojo",
                           takes=_below_fp64)  # fmt: skip
