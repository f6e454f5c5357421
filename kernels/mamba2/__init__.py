"""Mamba-2 state-space duality (SSD): chunked prefill and single-step decode.

`chunk_mamba2` (packed variable-length prefill) and `fused_recurrent_mamba2` (one decode step) read and write the
per-session states in place in a pool, addressed by slot; each dispatches to the Triton kernel or the PyTorch
reference (`kvfree.kernels.dispatch.use_triton`, set by `KVFREE_KERNELS`). `ssd_chunked` and `ssd_step` are the
plain math on batches of equal-length sequences.
"""

from __future__ import annotations

import torch

from ..dispatch import DeviceChunks, use_triton
from . import reference
from .reference import ssd_chunked, ssd_step

__all__ = ["chunk_mamba2", "fused_recurrent_mamba2", "ssd_chunked", "ssd_step"]


def chunk_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] | None = None,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    device_chunks: DeviceChunks | None = None,
) -> torch.Tensor:
    """Chunked SSD prefill over packed variable-length sequences, states in place in a pool.

    Args:
        x: `[T, H, P]` bf16/fp16/fp32, the tokens of N sequences concatenated.
        dt: `[T, H]` raw step sizes; the op applies `softplus(dt + dt_bias)`, then clamps to `dt_limit`.
        B, C: `[T, G, N]` with G dividing H; head h uses group `h // (H // G)`.
        state: `[S, H, P, N]` fp32 pool; rows `state_indices` hold the initial states and receive the final ones.
            Other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence (padding names a scratch row, never -1).
        cu_seqlens: `[N+1]` int32, sequence boundaries in x (device), from 0 to T.
        A: `[H]` fp32, negative (`-exp(A_log)`).  D: `[H]` skip.  dt_bias: `[H]`.
        dt_limit: `(lo, hi)` or None.
        chunk_size: tokens per chunk; chunks never cross a sequence boundary. The result does not depend on it
            beyond rounding.
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor, list or tuple); copied from the device (a sync) when None
            and `device_chunks` is not given.
        device_chunks: for a step captured in a CUDA graph, `DeviceChunks(cu_seqlens, T)`
            (`kvfree.kernels.dispatch`): the Triton kernels then take their chunk metadata from the device, sized by
            the bound `T // L + N` chunks, and never read `cu_seqlens` on the host. Sequences may be empty (a padded
            step's sentinels): they output nothing and leave their pool rows untouched. The reference ignores it.

    Returns:
        y: `[T, H, P]` in x's dtype, the SSD output plus `D * x`.
    """
    if use_triton(x.device):
        from .chunk import chunk_mamba2 as impl
    else:
        impl = reference.chunk_mamba2
    return impl(
        x, dt, B, C, state, state_indices, cu_seqlens, A, D, dt_bias, dt_limit, chunk_size,
        cu_seqlens_cpu=cu_seqlens_cpu, device_chunks=device_chunks,
    )


def fused_recurrent_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    """One SSD decode step per session, its state updated in place in the pool.

    Args:
        x: `[Bs, H, P]` bf16/fp16/fp32.  dt: `[Bs, H]` raw (softplus of `dt + dt_bias`, clamped to `dt_limit`).
        B, C: `[Bs, G, N]`, G dividing H.
        state: `[S, H, P, N]` fp32 pool; rows `state_indices` become `exp(dt*A) * state + dt * x ⊗ B`.
        state_indices: `[Bs]` int32, the pool row of each session.
        A: `[H]` fp32 negative.  D: `[H]`.  dt_bias: `[H]`.  dt_limit: `(lo, hi)` or None.

    Returns:
        y: `[Bs, H, P]` in x's dtype, `new_state · C + D * x`.
    """
    if use_triton(x.device):
        from .fused_recurrent import fused_recurrent_mamba2 as impl
    else:
        impl = reference.fused_recurrent_mamba2
    return impl(x, dt, B, C, state, state_indices, A, D, dt_bias, dt_limit)
