"""Gated KalmaNet: chunk-wise Chebyshev prefill and single-step decode (docs/design/gka.md).

`chunk_gka` (packed variable-length prefill) and `fused_recurrent_gka` (one decode step) read and write the
per-session states H and S in place in their pools, addressed by slot; each is its PyTorch reference (reference.py,
the spec) dispatched to the Triton kernel beside it (`kvfree.kernels.dispatch.Op`, set by `KVFREE_KERNELS`). Float64
inputs or pools always take the reference: the kernels compute in fp32. `gka_chunked` and `gka_step` are the plain
math on batches of equal-length sequences.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch import Op
from . import reference
from .reference import chebyshev_solve, gka_chunked, gka_step, omega_schedule

__all__ = ["chebyshev_solve", "chunk_gka", "fused_recurrent_gka", "gka_chunked", "gka_step", "omega_schedule"]


def _fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, alpha: torch.Tensor, h: torch.Tensor,
          *args: Any, **kwargs: Any) -> bool:  # fmt: skip
    """The kernels compute in fp32: fp32 pools and inputs below fp64."""
    return q.dtype != torch.float64 and h.dtype == torch.float32


chunk_gka = Op(reference.chunk_gka, "gka.chunk:chunk_gka", takes=_fp32)
fused_recurrent_gka = Op(reference.fused_recurrent_gka, "gka.fused_recurrent:fused_recurrent_gka", takes=_fp32)
