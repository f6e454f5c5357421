"""Gated DeltaNet: the gated delta rule's chunked (WY form) prefill and single-step decode.

`chunk_gdn` (packed variable-length prefill) and `fused_recurrent_gdn` (one decode step) read and write each
session's state in place in its pool, addressed by slot; each is its PyTorch reference (reference.py, the spec)
dispatched to the Triton kernel beside it (`kvfree.kernels.dispatch.Op`, set by `KVFREE_KERNELS`). Float64 inputs or
pools always take the reference: the kernels compute in fp32. `gdn_chunked`, `gdn_recurrent` and `gdn_step` are the
plain math on batches of equal-length sequences.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch import Op
from . import reference
from .reference import gdn_chunked, gdn_recurrent, gdn_step

__all__ = ["chunk_gdn", "fused_recurrent_gdn", "gdn_chunked", "gdn_recurrent", "gdn_step"]


def _fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
          state: torch.Tensor, *args: Any, **kwargs: Any) -> bool:  # fmt: skip
    """The kernels compute in fp32: an fp32 pool and inputs below fp64."""
    return q.dtype != torch.float64 and state.dtype == torch.float32


chunk_gdn = Op(reference.chunk_gdn, "gdn.chunk:chunk_gdn", takes=_fp32)
fused_recurrent_gdn = Op(reference.fused_recurrent_gdn, "gdn.fused_recurrent:fused_recurrent_gdn", takes=_fp32)
