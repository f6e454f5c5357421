"""Triton row copy across every tensor of a RowTable in one launch: `t[dst[k]] = t[src[k]]` for all t and k.

The tensors have different dtypes and shapes, so the kernel does not see them as tensors: it reads each one's base
address and row length from the table (device int64), casts the address to a pointer to `min(word, 8)`-byte integers
and copies raw words (for a tensor the table marks `zero_fill`, it stores zeros and reads nothing). A row is cut into
pieces of `table.block` elements (the table's work list); the 1-D grid runs one program per (pair, piece), so
programs are equal in size whatever the mix of tiny and huge rows, and a pair's pieces are neighbours in launch
order.

The alignment hints (`tl.multiple_of`) are true by construction: `word` divides every base address and row size,
and pieces start at multiples of the block. With 16-byte words the compiler then moves 16-byte vectors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launcher import launch_kernel
from ..masks import block_mask
from .table import RowTable

_INT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_MAX_GRID = 2**31 - 1


@triton.jit
def _copy_rows_kernel(
    bases, row_len, zeroed, work_tensor, work_start, src, dst, W,
    DTYPE: tl.constexpr, ALIGN: tl.constexpr, ELEM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i_k = pid // W
    i_w = pid % W
    i_t = tl.load(work_tensor + i_w)
    start = tl.multiple_of(tl.load(work_start + i_w), BLOCK)
    n = tl.multiple_of(tl.load(row_len + i_t), ALIGN // ELEM)  # row length in elements
    # The tensor's base address (an int64 in the table) as a typed pointer: ALIGN-byte aligned by construction.
    base = tl.multiple_of(tl.load(bases + i_t).to(tl.pointer_type(DTYPE)), ALIGN)
    row_src = tl.load(src + i_k).to(tl.int64)
    row_dst = tl.load(dst + i_k).to(tl.int64)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    copy = tl.load(zeroed + i_t) == 0  # else the tensor's dst rows are zero-filled: its src row is not read
    words = tl.load(base + row_src * n + offs, mask=mask & block_mask(copy, offs), other=0)
    tl.store(base + row_dst * n + offs, words, mask=mask)


def copy_rows(table: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Triton `kvfree.kernels.rows.copy_rows` (same arguments and effect; see its docstring). One launch, no host
    sync, no allocation: capturable in a CUDA graph."""
    K, W = src.shape[0], table.pieces
    if K == 0 or W == 0:
        return
    if K * W > _MAX_GRID:
        raise ValueError(f"{K} row pairs x {W} pieces a row exceed one launch's {_MAX_GRID} programs")
    elem = min(table.word, 8)
    src, dst = src.contiguous(), dst.contiguous()  # (no copy, hence no allocation, for the usual contiguous indices)
    launch_kernel(
        _copy_rows_kernel, (K * W,),
        table.bases, table.row_len, table.zeroed, table.work_tensor, table.work_start, src, dst, W,
        DTYPE=_INT[elem], ALIGN=table.word, ELEM=elem, BLOCK=table.block, num_warps=4,
    )  # fmt: skip
