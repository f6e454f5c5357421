"""B'MOJO-F attention (engine/model/layers/bmojo_f.py): sliding-window attention joined with attention over fading
tokens.

`chunk_bmojo_f_attention` (packed variable-length prefill) and `fused_recurrent_bmojo_f_attention` (one decode token
per session) read and write each session's in-context and fading rings and its length in place in pools, addressed
by slot; each is its PyTorch reference (reference.py, the spec) dispatched to the Triton kernel beside it
(`kvfree.kernels.dispatch.Op`, set by `KVFREE_KERNELS`): the banded flash prefill in chunk.py, the decode over the
ring rows read in place in fused_recurrent.py. Float64 inputs or rings always take the reference (the oracle).
`bmojo_f_attention` is the plain math on whole sequences (the training forward). Both decode forms read nothing on
the host, so a decode step can be captured in a CUDA graph on either.
"""

from __future__ import annotations

from typing import Any

import torch

from ..dispatch import Op
from . import reference
from .reference import bmojo_f_attention

__all__ = ["bmojo_f_attention", "chunk_bmojo_f_attention", "fused_recurrent_bmojo_f_attention"]


def _below_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor,
                vf: torch.Tensor, k_ctx: torch.Tensor, *args: Any, **kwargs: Any) -> bool:  # fmt: skip
    """The kernels take inputs and rings below fp64 (fp64 runs are the reference's: the oracle)."""
    return q.dtype != torch.float64 and k_ctx.dtype != torch.float64


chunk_bmojo_f_attention = Op(reference.chunk_bmojo_f_attention, "bmojo_f.chunk:chunk_bmojo_f_attention",
                             takes=_below_fp64)  # fmt: skip
fused_recurrent_bmojo_f_attention = Op(
    reference.fused_recurrent_bmojo_f_attention, "bmojo_f.fused_recurrent:fused_recurrent_bmojo_f_attention",
    takes=_below_fp64,
)  # fmt: skip
