"""Spectral Koopman Attention (Echo): chunk-causal / prefix-mode extend and the single-token decode step.

`chunk_ska` (packed variable-length prefill, mode C or P) and `fused_recurrent_ska` (one decode step) read and write the
per-session states in place in a pool, addressed by slot; each is its PyTorch reference (reference.py, the spec)
dispatched to the Triton kernels beside it (`kvfree.kernels.dispatch.Op`, set by `KVFREE_KERNELS`). The kernels cover
both modes, both key-norm rules and fp32 or fp64 accumulators; float64 inputs always take the reference (the kernels
read keys, queries and values as fp32, the reference's precision for them). `ska_chunked`, `ska_prefix` and `ska_step`
are the plain math on batches of sessions.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..dispatch import Op
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
    "decode_graph_safe",
    "chunk_ska",
    "fused_recurrent_ska",
    "power_iteration_sigma",
    "robust_cholesky",
    "ska_chunked",
    "ska_empty_state",
    "ska_prefix",
    "ska_readout",
    "ska_step",
]


def decode_graph_safe(device: torch.device, dtype: torch.dtype, acc_dtype: torch.dtype) -> bool:
    """Whether `fused_recurrent_ska` on `dtype` inputs with `acc_dtype` accumulators on `device` runs without a host
    sync (its Triton implementation), so that a decode step may be captured in a CUDA graph."""
    return fused_recurrent_ska.device_check(device) and _kernel_dtypes(dtype, acc_dtype)


def cholesky_fallback_count() -> int:
    """Cholesky factorisations that needed the jitter fallback since the process started (a diagnostic): the
    reference's count plus the retries the kernels counted on the device (reading those is a device sync)."""
    n = reference.cholesky_fallback_count()
    kernels = sys.modules.get(f"{__name__}.rebuild")  # only where a kernel ran (and triton imported)
    return n + (kernels.device_fallback_count()[0] if kernels is not None else 0)


def _kernel_dtypes(dtype: torch.dtype, acc_dtype: torch.dtype) -> bool:
    """The kernels read z, q, v as fp32 (fp64 inputs take the reference) and keep fp32 or fp64 accumulators."""
    return dtype != torch.float64 and acc_dtype in (torch.float32, torch.float64)


def _kernels_take(z: torch.Tensor, q: torch.Tensor, v: torch.Tensor, state: SKAState, *args: Any, **kw: Any) -> bool:
    return _kernel_dtypes(z.dtype, state.G.dtype)


# The Triton path reads no session position to the host (chunk_ska) and has no host sync (fused_recurrent_ska:
# graph-capturable); the reference groups sessions by their chunk grid on the host and branches there at chunk
# boundaries and in its Cholesky retries.
chunk_ska = Op(reference.chunk_ska, "ska.chunk:chunk_ska", takes=_kernels_take)
fused_recurrent_ska = Op(reference.fused_recurrent_ska, "ska.fused_recurrent:fused_recurrent_ska", takes=_kernels_take)
