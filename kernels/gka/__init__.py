"""Gated KalmaNet: chunk-wise Chebyshev prefill and single-step decode (docs/design/gka.md).

`chunk_gka` (packed variable-length prefill) and `fused_recurrent_gka` (one decode step) read and write the
per-session states H and S in place in their pools, addressed by slot; each dispatches to the Triton kernel or the
PyTorch reference (`kvfree.kernels.dispatch.use_triton`, set by `KVFREE_KERNELS`). Float64 inputs or pools always take
the reference: the kernels compute in fp32. `gka_chunked` and `gka_step` are the plain math on batches of
equal-length sequences.
"""

from __future__ import annotations

import torch

from ..dispatch import use_triton
from . import reference
from .reference import chebyshev_solve, gka_chunked, gka_step, omega_schedule

__all__ = ["chebyshev_solve", "chunk_gka", "fused_recurrent_gka", "gka_chunked", "gka_step", "omega_schedule"]


def _triton(q: torch.Tensor, h: torch.Tensor) -> bool:
    """Whether this call runs the Triton kernels: fp32 pools, inputs below fp64, and the dispatch says so."""
    return q.dtype != torch.float64 and h.dtype == torch.float32 and use_triton(q.device)


def chunk_gka(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """Chunked GKA prefill over packed variable-length sequences, states (h, s) in place in their pools.

    Args:
        q: `[T, He, D]` L2-normalised queries of N sequences concatenated (bf16/fp16/fp32).
        k: `[T, He, D]` L2-normalised keys times (beta + 1e-6).  v: `[T, He, Dv]` values times (beta + 1e-6).
        g: `[T, He]` log forget gates (<= 0).  alpha: `[T, He]` alpha-connection gates.
        h: `[S, He, D, D]` fp32 key-covariance pool.  s: `[S, He, D, Dv]` fp32 key-value pool. Rows `state_indices`
            hold the initial states and receive the final ones; other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence.
        cu_seqlens: `[N+1]` int32, sequence boundaries in q (device), from 0 to T.
        ridge: a.  num_iter: r (Chebyshev steps).  scale: output scale (D^-1/2).
        chunk_size: tokens per chunk; chunks never cross a sequence boundary. The result does not depend on it
            beyond rounding.
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.

    Returns:
        o: `[T, He, Dv]` in q's dtype (state math in fp32).
    """
    if _triton(q, h):
        from .chunk import chunk_gka as impl
    else:
        impl = reference.chunk_gka
    return impl(
        q, k, v, g, alpha, h, s, state_indices, cu_seqlens, ridge, num_iter, scale, chunk_size,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip


def fused_recurrent_gka(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    state_indices: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
) -> torch.Tensor:
    """One GKA decode step per session, its states (h, s) updated in place in their pools.

    Args:
        q: `[B, He, D]` L2-normalised queries.  k: `[B, He, D]` L2-normalised keys times (beta + 1e-6).
        v: `[B, He, Dv]` values times (beta + 1e-6).  g: `[B, He]` log forget gates (<= 0).  alpha: `[B, He]`.
        h: `[S, He, D, D]` fp32 pool; rows `state_indices` become `exp(g) h + k k^T`.
        s: `[S, He, D, Dv]` fp32 pool; rows `state_indices` become `exp(g) s + k v^T`. Other rows are left untouched.
        state_indices: `[B]` int32, the pool row of each session.
        ridge: a.  num_iter: r (Chebyshev steps).  scale: output scale (D^-1/2).

    Returns:
        o: `[B, He, Dv]` in q's dtype, `scale * S^T q'` with the new S.
    """
    if _triton(q, h):
        from .fused_recurrent import fused_recurrent_gka as impl
    else:
        impl = reference.fused_recurrent_gka
    return impl(q, k, v, g, alpha, h, s, state_indices, ridge, num_iter, scale)
