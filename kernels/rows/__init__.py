"""Row copies across many pool tensors at once: `t[dst[k]] = t[src[k]]` for every tensor of a table, in one launch.

A StatePool keeps a few state tensors per layer; giving new sessions a fresh state or forking one copies the same rows
of all of them. `copy_rows` does that for every tensor of a `RowTable` (built once from the pool's tensors) and every
(src, dst) pair in one Triton launch on a GPU (copy.py), or one `index_copy_` per tensor elsewhere (reference.py);
`kvfree.kernels.dispatch.use_triton` (`KVFREE_KERNELS`) chooses. A table may mark tensors whose dst rows are to be
zeroed rather than copied (a reset to a zero state: nothing read).
"""

from __future__ import annotations

import os

import torch

from ..dispatch import use_triton
from . import reference
from .table import RowTable

__all__ = ["RowTable", "copy_rows"]

_INDEX_DTYPES = (torch.int32, torch.int64)


def copy_rows(table: RowTable, src: torch.Tensor, dst: torch.Tensor) -> None:
    """For every tensor t of `table` and every k: `t[dst[k]] = t[src[k]]`, bit for bit (one kernel launch on a GPU);
    for a tensor the table marks `zero_fill`, `t[dst[k]] = 0` instead, without reading `t[src[k]]`.

    Args:
        table: the tensors, each `[rows, ...]` contiguous, any dtype (see `RowTable`).
        src, dst: `[K]` int32/int64 row indices on the table's device, each in `[0, table.rows)`. A row may be named
            as dst at most once, and never also as a src of the same call: the rows are copied in parallel, in no
            order. Indices on the CPU are checked here; on a GPU checking would wait for the device, so the caller
            must pass valid ones (an index out of range writes outside the tensor).

    Rows not named in `dst` are left untouched. No host sync and no allocation: capturable in a CUDA graph.
    """
    if src.dim() != 1 or src.shape != dst.shape or src.dtype not in _INDEX_DTYPES or dst.dtype not in _INDEX_DTYPES:
        raise ValueError(f"src and dst must be [K] int32/int64 tensors, got {src.shape} {src.dtype}, {dst.shape} "
                         f"{dst.dtype}")  # fmt: skip
    if src.device != table.device or dst.device != table.device:
        raise ValueError(f"row indices on {src.device}/{dst.device}, the table's tensors on {table.device}")
    if src.device.type == "cpu":
        _check_pairs(src.tolist(), dst.tolist(), table.rows)
    if src.shape[0] == 0 or not table.tensors:
        return
    if use_triton(table.device) and not _interpreted_on(table.device):
        from .copy import copy_rows as impl
    else:
        impl = reference.copy_rows
    impl(table, src, dst)


def _check_pairs(src: list[int], dst: list[int], rows: int) -> None:
    """Raise ValueError unless every index is a row, no dst repeats and no dst is also a src."""
    bad = [i for i in src + dst if not 0 <= i < rows]
    if bad:
        raise ValueError(f"row indices {bad[:8]} out of range for tensors of {rows} rows")
    if len(set(dst)) != len(dst):
        raise ValueError(f"a dst row is named more than once: {dst[:16]}")
    both = set(src) & set(dst)
    if both:
        raise ValueError(f"rows {sorted(both)[:8]} are both a src and a dst of one copy (rows copy in no order)")


def _interpreted_on(device: torch.device) -> bool:
    """Whether Triton would run interpreted on a GPU's tensors: the interpreter moves a kernel's tensor arguments to
    the host, but the table's addresses point into device memory, which the host cannot read; the reference runs."""
    return device.type != "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")
