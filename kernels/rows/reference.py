"""Row copies in PyTorch, one `index_copy_` per tensor: the CPU path, and the oracle of the Triton kernel (copy.py)."""

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
