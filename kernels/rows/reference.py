"""Row moves in PyTorch, a few calls per tensor: the CPU path, and the oracle of the Triton kernel (copy.py)."""

from __future__ import annotations

import torch

from .table import RowTable


def copy_rows(table: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The PyTorch reference of `kvfree.kernels.rows.copy_rows` (same arguments and effect; see its docstring)."""
    src, dst = src.to(torch.int64), dst.to(torch.int64)
    for t, zero in zip(table.tensors, table.zero_fill, strict=True):
        if zero:
            t.index_fill_(0, dst, 0)  # zero bits, in every dtype
        else:
            t.index_copy_(0, dst, t.index_select(0, src))


def gather_rows(table: RowTable, rows: torch.Tensor, flat: torch.Tensor) -> None:
    """The PyTorch reference of `kvfree.kernels.rows.gather_rows` (same arguments and effect; see its docstring)."""
    rows = rows.to(torch.int64)
    for t, (lo, hi) in zip(table.tensors, _spans(table), strict=True):
        if hi > lo:
            flat[:, lo:hi] = _row_bytes(t.index_select(0, rows))


def scatter_rows(table: RowTable, flat: torch.Tensor, rows: torch.Tensor) -> None:
    """The PyTorch reference of `kvfree.kernels.rows.scatter_rows` (same arguments and effect; see its docstring)."""
    rows = rows.to(torch.int64)
    for t, (lo, hi) in zip(table.tensors, _spans(table), strict=True):
        if hi > lo:
            # The bytes reinterpreted as t's dtype, from a contiguous copy: `view(dtype)` needs strides and an address
            # that t's element size divides, which flat's columns do not always have.
            piece = flat[:, lo:hi].clone(memory_format=torch.contiguous_format)
            t.index_copy_(0, rows, piece.view(t.dtype).view(-1, *t.shape[1:]))


def _spans(table: RowTable) -> list[tuple[int, int]]:
    """Each tensor's [first, last) byte in a flat row, in table order."""
    bounds = [*table.offsets, table.row_bytes]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _row_bytes(rows: torch.Tensor) -> torch.Tensor:
    """Contiguous `[K, ...]` rows as `[K, bytes]` uint8, a view (rows of one element get the axis `view` needs)."""
    return rows.reshape(rows.shape[0], -1).view(torch.uint8)
