"""Spectral Koopman Attention (Echo): chunk-causal / prefix-mode extend and the single-token decode step.

`chunk_ska` (packed variable-length prefill, mode C or P) and `fused_recurrent_ska` (one decode step) read and write
the per-session states in place in a pool, addressed by slot; each dispatches to the Triton kernels or the PyTorch
reference (`kvfree.kernels.dispatch.use_triton`, set by `KVFREE_KERNELS`). The kernels cover both modes, both
key-norm rules and fp32 or fp64 accumulators; float64 inputs always take the reference (the kernels read keys,
queries and values as fp32, the reference's precision for them). `ska_chunked`, `ska_prefix` and `ska_step` are the
plain math on batches of sessions.
"""

from __future__ import annotations

import sys

import torch

from ..dispatch import use_triton
from . import reference
from .reference import (
    MODES,
    SKAState,
    power_iteration_sigma,
    robust_cholesky,
    ska_chunked,
    ska_empty_state,
    ska_prefix,
    ska_readout,
    ska_step,
)

__all__ = [
    "MODES",
    "SKAState",
    "cholesky_fallback_count",
    "chunk_ska",
    "fused_recurrent_ska",
    "power_iteration_sigma",
    "robust_cholesky",
    "ska_chunked",
    "ska_empty_state",
    "ska_prefix",
    "ska_readout",
    "ska_step",
    "uses_triton",
]


def uses_triton(z: torch.Tensor | None, acc_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an SKA op runs the Triton kernels: inputs below fp64 (z None: the layer's own fp32 projections), an
    fp32 or fp64 state, and the dispatch says so for `device`."""
    if z is not None and z.dtype == torch.float64:
        return False
    return acc_dtype in (torch.float32, torch.float64) and use_triton(device)


def cholesky_fallback_count() -> int:
    """Cholesky factorisations that needed the jitter fallback since the process started (a diagnostic): the
    reference's count plus the retries the kernels counted on the device (reading those is a device sync)."""
    n = reference.cholesky_fallback_count()
    kernels = sys.modules.get(f"{__name__}.rebuild")  # only where a kernel ran (and triton imported)
    return n + (kernels.device_fallback_count()[0] if kernels is not None else 0)


def chunk_ska(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    mode: str = "C",
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """SKA prefill over packed variable-length sequences, states in place in the pool.

    Arguments and result as `kvfree.kernels.ska.reference.chunk_ska` (z, q `[T, H, r]`, v `[T, H, P]`, the pool
    `SKAState`, state_indices `[N]` int32, cu_seqlens `[N+1]` int32 -> y `[T, H, P]` fp32). The Triton path reads no
    session position to the host; the reference does (it groups sessions by their chunk grid).
    """
    reference._check_mode(mode)
    if uses_triton(z, state.G.dtype, z.device):
        from .chunk import chunk_ska as impl
    else:
        impl = reference.chunk_ska
    return impl(
        z, q, v, state, state_indices, cu_seqlens, chunk_size, eps, eta, gamma, order, power_iters, key_norm, mode,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip


def fused_recurrent_ska(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    state_indices: torch.Tensor,
    chunk_size: int,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    mode: str = "C",
) -> torch.Tensor:
    """One SKA decode token per session, its state updated in place in the pool.

    Arguments and result as `kvfree.kernels.ska.reference.fused_recurrent_ska` (z, q `[B, H, r]`, v `[B, H, P]`,
    state_indices `[B]` int32 -> y `[B, H, P]` fp32). The Triton path has no host sync (graph-capturable); the
    reference branches on the host at chunk boundaries and in its Cholesky retries.
    """
    reference._check_mode(mode)
    if uses_triton(z, state.G.dtype, z.device):
        from .fused_recurrent import fused_recurrent_ska as impl
    else:
        impl = reference.fused_recurrent_ska
    return impl(z, q, v, state, state_indices, chunk_size, eps, eta, gamma, order, power_iters, key_norm, mode)
