"""Causal depthwise short convolution with a carried tail (shared by Mamba-2, GKA and the other mixers).

`chunk_causal_conv1d` (packed variable-length prefill) and `fused_recurrent_causal_conv1d` (one decode token) read
and write the tails in place in a pool, addressed by slot; each dispatches to the Triton kernel or the PyTorch
reference (`kvfree.kernels.dispatch.use_triton`, set by `KVFREE_KERNELS`). `causal_conv1d` is the plain math.
"""

from __future__ import annotations

import torch

from ..dispatch import DeviceChunks, use_triton
from . import reference
from .reference import causal_conv1d

__all__ = ["causal_conv1d", "chunk_causal_conv1d", "fused_recurrent_causal_conv1d"]


def chunk_causal_conv1d(
    x: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    device_chunks: DeviceChunks | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d over packed variable-length sequences, each continuing from its pool row's tail.

    Args:
        x: `[T, C]` bf16/fp16/fp32, the tokens of N sequences concatenated.
        state: `[S, K-1, C]` pool of tails (x's dtype or fp32); rows `state_indices` are read, then overwritten with
            each sequence's last `K-1` inputs (for a sequence shorter than `K-1`: the old tail shifted, then its
            tokens). Other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence (padding names a scratch row, never -1).
        cu_seqlens: `[N+1]` int32, sequence boundaries in x (device), from 0 to T.
        weight: `[C, K]`; `weight[:, -1]` multiplies the current token.  bias: `[C]` or None.
        activation: None or "silu".
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor, list or tuple); copied from the device (a sync) when None
            and `device_chunks` is not given.
        device_chunks: for a step captured in a CUDA graph, `DeviceChunks(cu_seqlens, T)`
            (`kvfree.kernels.dispatch`): the Triton kernel then takes its block metadata from the device, sized by a
            bound, and never reads `cu_seqlens` on the host. Sequences may be empty (a padded step's sentinels): they
            output nothing and leave their pool rows untouched. The reference (and a width-1 filter) ignores it.

    Returns:
        y: `[T, C]` in x's dtype.
    """
    if weight.shape[1] >= 2 and use_triton(x.device):  # a width-1 filter has no tail: the reference's one multiply
        from .chunk import chunk_causal_conv1d as impl
    else:
        impl = reference.chunk_causal_conv1d
    return impl(
        x, state, state_indices, cu_seqlens, weight, bias, activation,
        cu_seqlens_cpu=cu_seqlens_cpu, device_chunks=device_chunks,
    )  # fmt: skip


def fused_recurrent_causal_conv1d(
    x: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per session: causal depthwise conv1d continuing from, and updating, its pool row's tail.

    Args:
        x: `[B, C]` bf16/fp16/fp32, one token per session.
        state: `[S, K-1, C]` pool of tails (x's dtype or fp32); rows `state_indices` are shifted by one token in place.
        state_indices: `[B]` int32, the pool row of each session.
        weight: `[C, K]`; `weight[:, -1]` multiplies the current token.  bias: `[C]` or None.
        activation: None or "silu".

    Returns:
        y: `[B, C]` in x's dtype.
    """
    if weight.shape[1] >= 2 and use_triton(x.device):  # a width-1 filter has no tail: the reference's one multiply
        from .fused_recurrent import fused_recurrent_causal_conv1d as impl
    else:
        impl = reference.fused_recurrent_causal_conv1d
    return impl(x, state, state_indices, weight, bias, activation)
