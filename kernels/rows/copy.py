"""Triton row moves across every tensor of a RowTable in one launch: row to row (`t[dst[k]] = t[src[k]]`), rows to
a flat buffer (`flat[k]` = the bytes of `t[rows[k]]` for every t, concatenated) and back.

The tensors have different dtypes and shapes, so the kernel does not see them as tensors: it reads each one's base
address and row length from the table (device int64), casts the address to a pointer to `min(word, 8)`-byte integers
and copies raw words (for a tensor the table marks `zero_fill`, a row copy stores zeros and reads nothing). A row is
cut into pieces of `table.block` elements (the table's work list); the 1-D grid runs one program per (k, piece), so
programs are equal in size whatever the mix of tiny and huge rows, and the pieces of one k are neighbours in launch
order. The three moves are one kernel whose constexpr MODE picks where a piece is read and where it is written: the
flat buffer's side of a piece is `flat[k]` from the tensor's offset in a flat row (`table.flat_start`) on.

The alignment hints (`tl.multiple_of`) are true by construction: `word` divides every base address and row size
(hence every offset in a flat row and the flat row's size), pieces start at multiples of the block, and the callers
refuse a flat buffer whose address `word` does not divide. With 16-byte words the compiler then moves 16-byte
vectors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..launcher import launch_kernel
from ..masks import block_mask
from .table import RowTable

_INT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_TORCH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_GRID = 2**31 - 1

ROW_TO_ROW = tl.constexpr(0)  # copy_rows: tensor rows src[k] -> tensor rows dst[k]
ROW_TO_FLAT = tl.constexpr(1)  # gather_rows: tensor rows src[k] -> flat[k]
FLAT_TO_ROW = tl.constexpr(2)  # scatter_rows: flat[k] -> tensor rows dst[k]


@triton.jit
def _rows_kernel(
    bases, row_len, zeroed, flat_start, work_tensor, work_start, src, dst, flat, flat_len, W,
    MODE: tl.constexpr, DTYPE: tl.constexpr, ALIGN: tl.constexpr, ELEM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i_k = pid // W
    i_w = pid % W
    i_t = tl.load(work_tensor + i_w)
    start = tl.multiple_of(tl.load(work_start + i_w), BLOCK)
    n = tl.multiple_of(tl.load(row_len + i_t), ALIGN // ELEM)  # row length in elements
    # The tensor's base address (an int64 in the table) as a typed pointer: ALIGN-byte aligned by construction.
    base = tl.multiple_of(tl.load(bases + i_t).to(tl.pointer_type(DTYPE)), ALIGN)
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    if MODE == ROW_TO_ROW:
        row_src = tl.load(src + i_k).to(tl.int64)
        row_dst = tl.load(dst + i_k).to(tl.int64)
        copy = tl.load(zeroed + i_t) == 0  # else the tensor's dst rows are zero-filled: its src row is not read
        words = tl.load(base + row_src * n + offs, mask=mask & block_mask(copy, offs), other=0)
        tl.store(base + row_dst * n + offs, words, mask=mask)
    else:
        # flat[k]'s words of this tensor (zero_fill does not apply: a flat row holds every tensor's bytes). int64:
        # K flat rows may pass 2**31 elements.
        at = tl.multiple_of(i_k.to(tl.int64) * flat_len + tl.load(flat_start + i_t), ALIGN // ELEM)
        flat_row = tl.multiple_of(flat, ALIGN) + at
        if MODE == ROW_TO_FLAT:
            row = tl.load(src + i_k).to(tl.int64)
            tl.store(flat_row + offs, tl.load(base + row * n + offs, mask=mask), mask=mask)
        else:
            row = tl.load(dst + i_k).to(tl.int64)
            tl.store(base + row * n + offs, tl.load(flat_row + offs, mask=mask), mask=mask)


def _launch(table: RowTable, src: torch.Tensor, dst: torch.Tensor, flat: torch.Tensor | None, mode: int) -> None:
    """One launch of K x pieces programs (src, dst: `[K]`; a move to or from `flat` reads only one of them) in
    `mode` (ROW_TO_ROW, ...); `flat` is None for a row copy."""
    K, W = src.shape[0], table.pieces
    if K == 0 or W == 0:
        return
    if K * W > _MAX_GRID:
        raise ValueError(f"{K} rows x {W} pieces a row exceed one launch's {_MAX_GRID} programs")
    elem = min(table.word, 8)
    # The flat buffer as elem-byte integers (a view: no copy; 1-D first, as a [1, n] buffer's row stride may be any);
    # a row copy passes any pointer, never read.
    flat_words = table.bases if flat is None else flat.view(-1).view(_TORCH_INT[elem])
    flat_len = table.row_bytes // elem
    launch_kernel(
        _rows_kernel, (K * W,),
        table.bases, table.row_len, table.zeroed, table.flat_start, table.work_tensor, table.work_start, src, dst,
        flat_words, flat_len, W,
        MODE=mode, DTYPE=_INT[elem], ALIGN=table.word, ELEM=elem, BLOCK=table.block, num_warps=4,
    )  # fmt: skip


def copy_rows(table: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Triton `kvfree.kernels.rows.copy_rows` (same arguments and effect; see its docstring). One launch, no host
    sync, no allocation: capturable in a CUDA graph."""
    src, dst = src.contiguous(), dst.contiguous()  # (no copy, hence no allocation, for the usual contiguous indices)
    _launch(table, src, dst, None, ROW_TO_ROW.value)


def gather_rows(table: RowTable, rows: torch.Tensor, flat: torch.Tensor) -> None:
    """Triton `kvfree.kernels.rows.gather_rows` (same arguments and effect; see its docstring). One launch, no host
    sync, no allocation: capturable in a CUDA graph."""
    rows = rows.contiguous()
    _launch(table, rows, rows, flat, ROW_TO_FLAT.value)


def scatter_rows(table: RowTable, flat: torch.Tensor, rows: torch.Tensor) -> None:
    """Triton `kvfree.kernels.rows.scatter_rows` (same arguments and effect; see its docstring). One launch, no host
    sync, no allocation: capturable in a CUDA graph."""
    rows = rows.contiguous()
    _launch(table, rows, rows, flat, FLAT_TO_ROW.value)
