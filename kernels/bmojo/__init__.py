"""B'MOJO memory (docs/design/bmojo.md §3): innovation score, bounded eidetic top-m store, chunked memory attention,
and the serving ops over the memory state in a pool. The fading-memory SSM itself is kernels/mamba2.

`chunk_bmojo` (packed variable-length prefill) and `fused_recurrent_bmojo` (one decode token per session) read and
write the `MemoryState` tensors in place in pool rows addressed by slot; each dispatches to the Triton kernels
(`chunk.py`, `fused_recurrent.py`) or the PyTorch reference (`kvfree.kernels.dispatch.use_triton`, set by
`KVFREE_KERNELS`). Float64 inputs or K/V pools always take the reference: the kernels compute in fp32. The Triton
decode has no host sync (graph-capturable); the reference decode finds chunk boundaries with `nonzero()`.
`bmojo_chunked` is the differentiable math on a batch of sequences with explicit states (the training forward).
"""

from __future__ import annotations

import torch

from ..dispatch import use_triton
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


def _triton(q: torch.Tensor, kv_pool: torch.Tensor) -> bool:
    """Whether this call runs the Triton kernels: inputs and K/V pools below fp64, and the dispatch says so."""
    return q.dtype != torch.float64 and kv_pool.dtype != torch.float64 and use_triton(q.device)


def decode_graph_safe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fused_recurrent_bmojo` on activations of `dtype` on `device` runs without a host sync (the Triton
    path), so that a decode step may be captured in a CUDA graph."""
    return dtype != torch.float64 and use_triton(device)


def chunk_bmojo(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    y: torch.Tensor,
    t: torch.Tensor,
    y_buf: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_eps: torch.Tensor,
    fad_k: torch.Tensor,
    fad_v: torch.Tensor,
    fad_n: torch.Tensor,
    eid_k: torch.Tensor,
    eid_v: torch.Tensor,
    eid_eps: torch.Tensor,
    eid_pos: torch.Tensor,
    eid_n: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    fading_kv: FadingKV,
    predictor_taps: int = 4,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """B'MOJO memory attention over packed variable-length sequences, each continuing its session's memory state.

    Args:
        q: `[T, Hq, dh]` bf16/fp16/fp32, the new tokens of N sequences concatenated.  k, v: `[T, Hkv, dh]`.
        y: `[T, D]` the tokens' SSM outputs.
        t .. eid_n: the `MemoryState` pool tensors `[S, ...]` (shapes in `reference.MemoryState`); rows
            `state_indices` are advanced by their sequence's tokens, other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence (distinct).
        cu_seqlens: `[N+1]` int32, sequence boundaries in q (device), from 0 to T.
        fading_kv: SSM outputs `[..., D]` -> fading (keys, values) `[..., Hkv, dh]`.
        predictor_taps: k of the innovation predictor (<= L, the length of y_buf).
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.

    Both paths read the sessions' positions t on the host (they plan the chunk grid): a sync.

    Returns:
        o: `[T, Hq, dh]` in q's dtype, the attention output (before W_O).
    """
    if _triton(q, ring_k):
        from .chunk import chunk_bmojo as impl
    else:
        impl = reference.chunk_bmojo
    return impl(
        q, k, v, y, t, y_buf, ring_k, ring_v, ring_eps, fad_k, fad_v, fad_n, eid_k, eid_v, eid_eps, eid_pos, eid_n,
        state_indices, cu_seqlens, fading_kv, predictor_taps, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip


def fused_recurrent_bmojo(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    y: torch.Tensor,
    t: torch.Tensor,
    y_buf: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_eps: torch.Tensor,
    fad_k: torch.Tensor,
    fad_v: torch.Tensor,
    fad_n: torch.Tensor,
    eid_k: torch.Tensor,
    eid_v: torch.Tensor,
    eid_eps: torch.Tensor,
    eid_pos: torch.Tensor,
    eid_n: torch.Tensor,
    state_indices: torch.Tensor,
    fading_kv: FadingKV,
    predictor_taps: int = 4,
) -> torch.Tensor:
    """One B'MOJO decode token per session (spec §3.9): publish at a chunk start, score, write the ring, attend.

    Args:
        q: `[B, Hq, dh]` bf16/fp16/fp32.  k, v: `[B, Hkv, dh]`.  y: `[B, D]` the tokens' SSM outputs.
        t .. eid_n: the `MemoryState` pool tensors `[S, ...]`; rows `state_indices` advance by one token, other rows
            are left untouched.
        state_indices: `[B]` int32, the pool row of each session (distinct).
        fading_kv: SSM outputs `[..., D]` -> fading (keys, values) `[..., Hkv, dh]`. The Triton path calls it on
            every session's last m_f outputs each step (fixed shapes) and keeps the rows of the sessions at a
            boundary; the reference only on those sessions' rows.
        predictor_taps: k of the innovation predictor.

    Returns:
        o: `[B, Hq, dh]` in q's dtype, the attention output (before W_O).
    """
    if _triton(q, ring_k):
        from .fused_recurrent import fused_recurrent_bmojo as impl
    else:
        impl = reference.fused_recurrent_bmojo
    return impl(
        q, k, v, y, t, y_buf, ring_k, ring_v, ring_eps, fad_k, fad_v, fad_n, eid_k, eid_v, eid_eps, eid_pos, eid_n,
        state_indices, fading_kv, predictor_taps,
    )  # fmt: skip
