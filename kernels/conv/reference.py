"""Causal depthwise conv1d over a token stream that continues from a saved tail.

The tail holds the last `K - 1` inputs a session has seen, so a prompt can be fed in any number of pieces
(prefill chunks or single decode tokens) and give the same result as feeding it whole.

`causal_conv1d` is the math on a batch of equal-length sequences with explicit tails. `chunk_causal_conv1d` (packed
variable-length prefill) and `fused_recurrent_causal_conv1d` (one decode token per session) are the slot-indexed
references of the Triton kernels in `chunk.py` and `fused_recurrent.py`: same signatures, tails read from and written
back to rows of a preallocated pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dispatch import DeviceChunks, host_cu_seqlens, padded_groups

ACTIVATIONS = (None, "silu")


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tail: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of `x` continuing from `tail`.

    Args:
        x: `[B, T, C]` new inputs.
        weight: `[C, K]` one filter per channel; `weight[:, -1]` multiplies the current token.
        bias: `[C]` or None.
        tail: `[B, K-1, C]` the previous `K-1` inputs (zeros for a new session).

    Returns:
        y: `[B, T, C]` the convolution (no activation), in x's dtype.
        new_tail: `[B, K-1, C]` the last `K-1` inputs, to pass to the next call.
    """
    B, T, C = x.shape
    K = weight.shape[1]
    full = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, T+K-1, C]
    y = F.conv1d(full.transpose(1, 2), weight.to(x.dtype).unsqueeze(1), bias, groups=C)  # [B, C, T]
    new_tail = full[:, full.shape[1] - (K - 1) :] if K > 1 else full[:, :0]
    return y.transpose(1, 2), new_tail


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {ACTIVATIONS}")
    return F.silu(y) if activation == "silu" else y


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

    The reference runs one batched `causal_conv1d` per group of similar lengths, planned on the host: it does not use
    `device_chunks` (without `cu_seqlens_cpu` the boundaries are copied from the device).
    """
    _activate(x[:0], activation)
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, x.shape[0])
    K = weight.shape[1]
    y = x.new_empty(x.shape)
    for g in padded_groups(cu, x.device):  # one batched conv per group of similar lengths
        idx = state_indices[g.seqs].to(torch.int64)
        tail = state.index_select(0, idx)  # [n, K-1, C]
        xp = g.pad(x)
        yg, _ = causal_conv1d(xp, weight, None if bias is None else bias.to(x.dtype), tail)
        # The new tail of sequence i is full[i, len_i : len_i + K-1], built in the state's dtype so a shifted fp32
        # tail stays exact.
        full = torch.cat([tail, xp.to(state.dtype)], dim=1)  # [n, K-1+longest, C]
        rows = (g.lens[:, None] + torch.arange(K - 1, device=x.device))[..., None].expand(-1, -1, x.shape[1])
        state.index_copy_(0, idx, full.gather(1, rows))
        g.scatter(yg, y)
    return _activate(y, activation)


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
    _activate(x[:0], activation)
    idx = state_indices.to(torch.int64)
    window = torch.cat([state.index_select(0, idx), x[:, None].to(state.dtype)], dim=1)  # [B, K, C]
    state.index_copy_(0, idx, window[:, 1:])
    # One output per channel is a K-term dot product: cheaper as a multiply-sum than as a conv1d launch.
    y = (window.to(x.dtype) * weight.t().to(x.dtype)).sum(1)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return _activate(y, activation)
