"""RowTable: the pool tensors that `copy_rows` copies rows of, and the device tables its one Triton launch reads.

Built once per set of pool tensors (a StatePool builds two: every state tensor, for forks; the fixed-size ones, for
resets). The Triton kernel reaches every tensor through its base address, so a launch takes the same few arguments
whether the table holds 2 tensors or 200.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

WORDS = (16, 8, 4, 2, 1)  # bytes the kernel may move at a time, widest first
BLOCK_BYTES = 16384  # bytes of one row that one program copies (16 KB: 16 vectors of 16 B per thread at 4 warps)


class RowTable:
    """Pool tensors whose rows are copied together, and what the Triton kernel needs to find them.

    Args:
        tensors: each `[rows, ...]`, contiguous, any dtype, all on one device; row counts may differ (indices given
            to `copy_rows` must be below `rows`, the smallest). The table keeps them, so their memory stays where
            its addresses point: never resize them (`resize_`, `set_`) while the table lives.

    Attributes:
        tensors: the tensors, in the order given.  device: their device.  rows: the smallest row count.
        word: the widest of 16, 8, 4, 2, 1 bytes that divides every tensor's base address and row size; the kernel
            moves `min(word, 8)`-byte integers (Triton's widest) and is told of the `word`-byte alignment, so that it
            can use 16-byte vector loads and stores.
        block: elements of one row that one program copies.
        bases, row_len: `[N]` int64 on the device, each tensor's base address and row length in `min(word, 8)`-byte
            elements (rows of 0 bytes are left out of the kernel's tables, which is why N may be below
            `len(tensors)`).
        work_tensor: `[W]` int32, work_start: `[W]` int64 on the device: the W pieces of one row copy, as (index into
            bases, first element); a launch runs one program per piece per (src, dst) pair.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = tuple(tensors)
        devices = {t.device for t in self.tensors}
        if len(devices) > 1:
            raise ValueError(f"the tensors of a RowTable must share one device, got {sorted(map(str, devices))}")
        for i, t in enumerate(self.tensors):
            if t.dim() == 0 or not t.is_contiguous():
                raise ValueError(f"tensor {i} ({tuple(t.shape)}) must be contiguous with a leading row axis")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.rows = min((t.shape[0] for t in self.tensors), default=0)
        sizes = [math.prod(t.shape[1:]) * t.element_size() for t in self.tensors]
        copied = [(t, n) for t, n in zip(self.tensors, sizes, strict=True) if n > 0] if self.rows else []
        self.word = next(w for w in WORDS if all(n % w == 0 and t.data_ptr() % w == 0 for t, n in copied))
        elem = min(self.word, 8)
        self.block = BLOCK_BYTES // elem
        lengths = [n // elem for _, n in copied]
        pieces = [(i, start) for i, n in enumerate(lengths) for start in range(0, n, self.block)]
        host = torch.tensor([t.data_ptr() for t, _ in copied] + lengths + [p[1] for p in pieces], dtype=torch.int64)
        on_device, n = host.to(self.device), len(copied)
        self.bases, self.row_len, self.work_start = on_device[:n], on_device[n : 2 * n], on_device[2 * n :]
        self.work_tensor = torch.tensor([p[0] for p in pieces], dtype=torch.int32).to(self.device)

    @property
    def pieces(self) -> int:
        """W: programs that one (src, dst) pair takes."""
        return self.work_start.shape[0]

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return f"RowTable({len(self.tensors)} tensors, {self.rows} rows, {self.word}-byte words, on {self.device})"
