"""Row moves in PyTorch, a few calls per tensor: the CPU path, and the oracle of the Triton kernel (copy.py)."""

from __future__ import annotations

import torch

from .table import RowTable


def copy_rows(table: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The PyTorch reference of `kvfree.kernels.rows.copy_rows` (same arguments and effect; see its docstring)."""
    src, dst = src.to(torch.int64), dst.to(torch.int64)
    for t, zero in zip(table.tensors, table.zero_fill, strict=True):
        if zero:
            zero_rows(t, dst)
        else:
            t.index_copy_(0, dst, t.index_select(0, src))


def zero_rows(t: torch.Tensor, rows: torch.Tensor) -> None:
    """`t[rows] = 0` (zero bits, in every dtype: fp8 has no `index_fill_` on the CPU, so 1-byte floats are filled
    through their bytes)."""
    target = t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
    target.index_fill_(0, rows.to(torch.int64), 0)


def gather_rows(table: RowTable, rows: torch.Tensor, flat: torch.Tensor) -> None:
    """The PyTorch reference of `kvfree.kernels.rows.gather_rows` (same arguments and effect; see its docstring)."""
    for k, row in enumerate(rows.tolist()):
        for t, (lo, hi) in zip(table.tensors, _spans(table), strict=True):
            if hi > lo:  # one copy, row to bytes (an index_select first would copy twice: 85 ms for 52 MB on a CPU)
                flat[k, lo:hi].copy_(_bytes(t[row]))


def scatter_rows(table: RowTable, flat: torch.Tensor, rows: torch.Tensor) -> None:
    """The PyTorch reference of `kvfree.kernels.rows.scatter_rows` (same arguments and effect; see its docstring)."""
    for k, row in enumerate(rows.tolist()):
        for t, (lo, hi) in zip(table.tensors, _spans(table), strict=True):
            if hi > lo:  # the row's own bytes are written: no view of flat as t's dtype, whatever its alignment
                _bytes(t[row]).copy_(flat[k, lo:hi])


def _spans(table: RowTable) -> list[tuple[int, int]]:
    """Each tensor's [first, last) byte in a flat row, in table order."""
    bounds = [*table.offsets, table.row_bytes]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _bytes(row: torch.Tensor) -> torch.Tensor:
    """A contiguous row's bytes, `[bytes]` uint8, a view (a 0-d row gets the axis `view` needs)."""
    return row.reshape(-1).view(torch.uint8)
