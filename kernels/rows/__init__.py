"""Row moves across many pool tensors at once: `t[dst[k]] = t[src[k]]` for every tensor of a table, in one launch,
and the same rows to or from one contiguous byte buffer.

A StatePool keeps a few state tensors per layer; giving new sessions a fresh state or forking one copies the same rows
of all of them. `copy_rows` does that for every tensor of a `RowTable` (built once from the pool's tensors) and every
(src, dst) pair in one Triton launch on a GPU (copy.py), or one `index_copy_` per tensor elsewhere (reference.py);
`kvfree.kernels.dispatch.use_triton` (`KVFREE_KERNELS`) chooses. A table may mark tensors whose dst rows are to be
zeroed rather than copied (a reset to a zero state: nothing read).

`gather_rows` packs rows of every tensor into one `[K, table.row_bytes]` uint8 buffer (a session's whole state as
one buffer, which crosses to host memory in one copy) and `scatter_rows` unpacks such a buffer into rows, by the same
kernel in one launch each.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..dispatch import use_triton
from . import reference
from .table import RowTable

__all__ = ["RowTable", "copy_rows", "gather_rows", "scatter_rows"]

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
    _impl(table.device, "copy_rows")(table, src, dst)


def gather_rows(table: RowTable, rows: torch.Tensor, flat: torch.Tensor) -> None:
    """For every k: `flat[k]` = the bytes of row `rows[k]` of every tensor of `table`, concatenated in table order
    (tensor i's at `table.offsets[i]`; a tensor of 0-byte rows contributes none), bit for bit. The table's
    `zero_fill` flags do not apply: every tensor's bytes are copied. One kernel launch on a GPU.

    Args:
        table: the tensors (see `RowTable`).
        rows: `[K]` int32/int64 row indices on the table's device, each in `[0, table.rows)`; a row may repeat.
            Indices on the CPU are checked here; on a GPU the caller must pass valid ones (see `copy_rows`).
        flat: `[K, table.row_bytes]` uint8, contiguous, on the table's device, its address a multiple of
            `table.word` (as any fresh allocation is); overwritten. It must not overlap the table's tensors.

    The tensors are not written. No host sync and no allocation: capturable in a CUDA graph.
    """
    if _flat_call_has_work(table, rows, flat, unique=False):
        _impl(table.device, "gather_rows")(table, rows, flat)


def scatter_rows(table: RowTable, flat: torch.Tensor, rows: torch.Tensor) -> None:
    """The inverse of `gather_rows`: for every tensor t of `table` and every k, `t[rows[k]]` = its bytes in `flat[k]`
    (at `table.offsets[i]` for tensor i), bit for bit. The table's `zero_fill` flags do not apply. One kernel launch
    on a GPU.

    Args:
        table: the tensors (see `RowTable`).
        flat: `[K, table.row_bytes]` uint8, contiguous, on the table's device, its address a multiple of
            `table.word`; not written. It must not overlap the table's tensors.
        rows: `[K]` int32/int64 row indices on the table's device, each in `[0, table.rows)`, none named twice (the
            rows are written in parallel, in no order). Indices on the CPU are checked here; on a GPU the caller
            must pass valid ones (see `copy_rows`).

    Rows not named in `rows` are left untouched. No host sync and no allocation: capturable in a CUDA graph.
    """
    if _flat_call_has_work(table, rows, flat, unique=True):
        _impl(table.device, "scatter_rows")(table, flat, rows)


def _flat_call_has_work(table: RowTable, rows: torch.Tensor, flat: torch.Tensor, unique: bool) -> bool:
    """Check a gather's or scatter's arguments (ValueError); whether there is anything to move."""
    _check_indices(rows, table, "rows")
    _check_flat(flat, table, rows.shape[0])
    if rows.device.type == "cpu":
        _check_rows(rows.tolist(), table.rows, "rows", unique=unique)
    return rows.shape[0] > 0 and bool(table.tensors)


def _impl(device: torch.device, name: str) -> Callable[..., None]:
    """The op `name` of copy.py (Triton) or reference.py, as `use_triton` chooses for tensors of `device`."""
    if use_triton(device) and not _interpreted_on(device):
        from . import copy as triton_rows

        return getattr(triton_rows, name)
    return getattr(reference, name)


def _check_indices(rows: torch.Tensor, table: RowTable, name: str) -> None:
    """Raise ValueError unless `rows` is a `[K]` int32/int64 tensor on the table's device."""
    if rows.dim() != 1 or rows.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be a [K] int32/int64 tensor, got {tuple(rows.shape)} {rows.dtype}")
    if rows.device != table.device:
        raise ValueError(f"{name} on {rows.device}, the table's tensors on {table.device}")


def _check_flat(flat: torch.Tensor, table: RowTable, k: int) -> None:
    """Raise ValueError unless `flat` is the `[k, table.row_bytes]` uint8 buffer the kernel may read and write as
    `table.word`-aligned words: it assumes (`tl.multiple_of`) that `word` divides its address."""
    if flat.dtype != torch.uint8 or tuple(flat.shape) != (k, table.row_bytes):
        raise ValueError(f"flat must be [{k}, {table.row_bytes}] uint8, got {tuple(flat.shape)} {flat.dtype}")
    if flat.device != table.device:
        raise ValueError(f"flat on {flat.device}, the table's tensors on {table.device}")
    if not flat.is_contiguous():
        raise ValueError("flat must be contiguous")
    if flat.data_ptr() % table.word:
        raise ValueError(f"flat's address must be a multiple of the table's {table.word}-byte word")


def _check_pairs(src: list[int], dst: list[int], rows: int) -> None:
    """Raise ValueError unless every index is a row, no dst repeats and no dst is also a src."""
    _check_rows(src, rows, "src", unique=False)
    _check_rows(dst, rows, "dst", unique=True)
    both = set(src) & set(dst)
    if both:
        raise ValueError(f"rows {sorted(both)[:8]} are both a src and a dst of one copy (rows copy in no order)")


def _check_rows(indices: list[int], rows: int, name: str, unique: bool) -> None:
    """Raise ValueError unless every index is a row and, if `unique` (the rows written), none repeats."""
    bad = [i for i in indices if not 0 <= i < rows]
    if bad:
        raise ValueError(f"row indices {bad[:8]} out of range for tensors of {rows} rows")
    if unique and len(set(indices)) != len(indices):
        raise ValueError(f"{name} names a row more than once: {indices[:16]}")


def _interpreted_on(device: torch.device) -> bool:
    """Whether Triton would run interpreted on a GPU's tensors: the interpreter moves a kernel's tensor arguments to
    the host, but the table's addresses point into device memory, which the host cannot read; the reference runs."""
    return device.type != "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")
