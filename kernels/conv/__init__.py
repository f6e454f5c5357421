"""Causal depthwise short convolution with a carried tail (shared by Mamba-2, GKA and the other mixers).

`chunk_causal_conv1d` (packed variable-length prefill) and `fused_recurrent_causal_conv1d` (one decode token) read
and write the tails in place in a pool, addressed by slot; each is its PyTorch reference (reference.py, the spec)
dispatched to the Triton kernel beside it (`kvfree.kernels.dispatch.Op`, set by `KVFREE_KERNELS`). `causal_conv1d` is
the plain math.
"""

from __future__ import annotations

import torch

from ..dispatch import Op
from . import reference
from .reference import causal_conv1d

__all__ = ["causal_conv1d", "chunk_causal_conv1d", "fused_recurrent_causal_conv1d"]


def _has_tail(weight: torch.Tensor) -> bool:
    """A width-1 filter has no tail: the reference's one multiply, no kernel."""
    return weight.shape[1] >= 2


chunk_causal_conv1d = Op(
    reference.chunk_causal_conv1d, "conv.chunk:chunk_causal_conv1d",
    takes=lambda x, state, state_indices, cu_seqlens, weight, *a, **k: _has_tail(weight),
)  # fmt: skip
fused_recurrent_causal_conv1d = Op(
    reference.fused_recurrent_causal_conv1d, "conv.fused_recurrent:fused_recurrent_causal_conv1d",
    takes=lambda x, state, state_indices, weight, *a, **k: _has_tail(weight),
)  # fmt: skip
