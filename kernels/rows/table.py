"""RowTable: the pool tensors whose rows `copy_rows`, `gather_rows` and `scatter_rows` move, and the device tables
their one Triton launch reads.

Built once per set of pool tensors (a StatePool builds two: every state tensor, for forks; the fixed-size ones, for
resets). The Triton kernel reaches every tensor through its base address, so a launch takes the same few arguments
whether the table holds 2 tensors or 200. One row of every tensor, concatenated in table order, is a table's flat
row (`row_bytes` bytes): the unit `gather_rows` and `scatter_rows` move to and from one contiguous buffer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

WORDS = (16, 8, 4, 2, 1)  # bytes the kernel may move at a time, widest first
BLOCK_BYTES = 16384  # bytes of one row that one program copies (at 4 warps, 8 vectors of 16 B per thread)


class RowTable:
    """Pool tensors whose rows are copied together, and what the Triton kernel needs to find them.

    Args:
        tensors: each `[rows, ...]`, contiguous, any dtype, all on one device; row counts may differ (indices given
            to `copy_rows` must be below `rows`, the smallest). The table keeps them, so their memory stays where
            its addresses point: never resize them (`resize_`, `set_`) while the table lives.
        zero_fill: per tensor, True to set its dst rows to zero bits instead of copying its src rows: a reset to a
            state known to be zero then reads nothing, half the memory traffic of a copy. None: copy every tensor.

    Attributes:
        tensors: the tensors, in the order given.  zero_fill: the flags, a tuple of bools.  device: their device.
        rows: the smallest row count.
        word: the widest of 16, 8, 4, 2, 1 bytes that divides every tensor's base address and row size; the kernel
            moves `min(word, 8)`-byte integers (Triton's widest) and is told of the `word`-byte alignment, so that it
            can use 16-byte vector loads and stores.
        block: elements of one row that one program copies.
        row_bytes: the bytes of one row of every tensor together: a flat row.
        offsets: per tensor, in table order (those of 0-byte rows included), the byte offset of its row inside a flat
            row: the running sum of the row sizes, hence multiples of `word` (when `rows` > 0).
        bases, row_len, zeroed, flat_start: `[N]` int64 on the device, each tensor's base address, row length in
            `min(word, 8)`-byte elements, zero_fill flag and offset inside a flat row in those elements (rows of 0
            bytes are left out of the kernel's tables, which is why N may be below `len(tensors)`).
        work_tensor: `[W]` int32, work_start: `[W]` int64 on the device: the W pieces of one row copy, as (index into
            bases, first element); a launch runs one program per piece per (src, dst) pair.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], zero_fill: Sequence[bool] | None = None) -> None:
        self.tensors = tuple(tensors)
        self.zero_fill = tuple(bool(z) for z in zero_fill) if zero_fill is not None else (False,) * len(self.tensors)
        if len(self.zero_fill) != len(self.tensors):
            raise ValueError(f"{len(self.zero_fill)} zero_fill flags for {len(self.tensors)} tensors")
        devices = {t.device for t in self.tensors}
        if len(devices) > 1:
            raise ValueError(f"the tensors of a RowTable must share one device, got {sorted(map(str, devices))}")
        for i, t in enumerate(self.tensors):
            if t.dim() == 0 or not t.is_contiguous():
                raise ValueError(f"tensor {i} ({tuple(t.shape)}) must be contiguous with a leading row axis")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.rows = min((t.shape[0] for t in self.tensors), default=0)
        sizes = [math.prod(t.shape[1:]) * t.element_size() for t in self.tensors]
        kept = [i for i, n in enumerate(sizes) if n > 0] if self.rows else []
        self.word = next(
            w for w in WORDS if all(sizes[i] % w == 0 and self.tensors[i].data_ptr() % w == 0 for i in kept)
        )
        elem = min(self.word, 8)
        self.block = BLOCK_BYTES // elem
        lengths = [sizes[i] // elem for i in kept]
        self.row_bytes = sum(sizes)
        self.offsets = tuple(itertools.accumulate(sizes[:-1], initial=0)) if sizes else ()
        flat_start = [self.offsets[i] // elem for i in kept]
        pieces = [(j, start) for j, n in enumerate(lengths) for start in range(0, n, self.block)]
        bases = [self.tensors[i].data_ptr() for i in kept]
        flags = [int(self.zero_fill[i]) for i in kept]
        host = torch.tensor(bases + lengths + flags + flat_start + [p[1] for p in pieces], dtype=torch.int64)
        self.bases, self.row_len, self.zeroed, self.flat_start, self.work_start = host.to(self.device).split(
            [len(kept)] * 4 + [len(pieces)]
        )
        self.work_tensor = torch.tensor([p[0] for p in pieces], dtype=torch.int32).to(self.device)

    @property
    def pieces(self) -> int:
        """W: programs that one (src, dst) pair takes."""
        return self.work_start.shape[0]

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return f"RowTable({len(self.tensors)} tensors, {self.rows} rows, {self.word}-byte words, on {self.device})"
