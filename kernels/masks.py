"""The one Triton helper for masks the kernels share.

Every `mask=` of a load or store and every `tl.where` condition in kernels/ is a boolean tensor made by comparisons.
A scalar condition (a token index inside its sequence, a per-row flag) meets a block only through `block_mask`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_mask(pred, like):
    """The scalar condition `pred` (a comparison, int1) as a boolean block of `like`'s shape.

    Why not `mask & pred`: Triton 3.9's interpreter broadcasts a scalar comparison in its operands' integer dtype, so
    `mask & pred` (or `tl.where(pred, block, ...)`) holds an int32 block, which its loads and stores refuse ("mask has
    unsupported dtype"; 3.6's accepted it). Broadcasting the 0/1 value, then comparing it, gives a boolean block under
    every version; compiled, it is the same predicate.
    """
    return tl.broadcast_to(pred.to(tl.int32), like.shape) != 0
