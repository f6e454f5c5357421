"""Mamba-2 state-space duality (SSD): chunked prefill and single-step decode.

`chunk_mamba2` (packed variable-length prefill) and `fused_recurrent_mamba2` (one decode step) read and write the
per-session states in place in a pool, addressed by slot; each is its PyTorch reference (reference.py, the spec)
dispatched to the Triton kernel beside it (`kvfree.kernels.dispatch.Op`, set by `KVFREE_KERNELS`). `ssd_chunked` and
`ssd_step` are the plain math on batches of equal-length sequences.
"""

from __future__ import annotations

from ..dispatch import Op
from . import reference
from .reference import ssd_chunked, ssd_step

__all__ = ["chunk_mamba2", "fused_recurrent_mamba2", "ssd_chunked", "ssd_step"]

chunk_mamba2 = Op(reference.chunk_mamba2, "mamba2.chunk:chunk_mamba2")
fused_recurrent_mamba2 = Op(reference.fused_recurrent_mamba2, "mamba2.fused_recurrent:fused_recurrent_mamba2")
