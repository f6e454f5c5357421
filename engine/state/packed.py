"""PackedState: one session's state as one contiguous byte buffer in host memory, and the table naming its tensors.

A session's state is a few tensors per layer (about 150 for a 48-layer model). Moved tensor by tensor, a state pays
150 synchronous copies each way; packed, it is one copy: the pool gathers a slot's rows into one device buffer
(`kvfree.kernels.rows.gather_rows`), the buffer crosses to pinned host memory in one DMA, and the same bytes are a
snapshot's payload as they are (engine/state/snapshot.py writes them after a small header, and reads a file straight
into
such a buffer). The host tier keeps sessions in this form.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StateEntry:
    """One state tensor inside a packed buffer: its name (`layers.{i}.{name}`), dtype, shape and byte offset."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def entries_for(tensors: dict[str, torch.Tensor]) -> tuple[StateEntry, ...]:
    """The entries of `tensors` packed back to back in the dict's order."""
    out, offset = [], 0
    for name, t in tensors.items():
        entry = StateEntry(name, t.dtype, tuple(t.shape), offset)
        out.append(entry)
        offset += entry.nbytes
    return tuple(out)


@dataclass(eq=False)
class PackedState:
    """A session's state tensors, back to back in one byte buffer.

    data: `[nbytes]` uint8 on the CPU (pinned when it came from, or goes to, a GPU), the entries' bytes back to back
        from offset 0 in their order, with no gaps.
    entries: what the bytes are, in buffer order.
    ready: the CUDA event of the device-to-host copy that fills `data` when it may still run (None: complete); read
        the bytes only after `wait()`.
    rows_read: when exported from a pool slot on a GPU, the event after which the slot's rows have been read (before
        the copy to the host has run): from then on the slot may be written again.
    """

    data: torch.Tensor
    entries: tuple[StateEntry, ...]
    ready: torch.cuda.Event | None = field(default=None, repr=False)
    rows_read: torch.cuda.Event | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def wait(self) -> PackedState:
        """Block until the copy filling `data` has run (at once when it has); returns self."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> tensor: views of the buffer (no copy), after `wait()`."""
        self.wait()
        return {e.name: view_as(self.data, e) for e in self.entries}

    def clone(self) -> PackedState:
        """An independent copy (in pageable memory)."""
        return PackedState(self.wait().data.clone(), self.entries)

    @classmethod
    def empty(cls) -> PackedState:
        """No state: a snapshot's metadata read without its tensors."""
        return cls(torch.empty(0, dtype=torch.uint8), ())

    @staticmethod
    def buffer(nbytes: int, pin: bool) -> torch.Tensor:
        """A new `[nbytes]` uint8 host buffer, pinned when `pin` (it is copied to or from a GPU)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    @classmethod
    def pack(cls, tensors: dict[str, torch.Tensor], pin: bool = False) -> PackedState:
        """`tensors` (any devices) copied into one new buffer, in the dict's order."""
        entries = entries_for(tensors)
        total = entries[-1].end if entries else 0
        data = cls.buffer(total, pin)
        for e, t in zip(entries, tensors.values(), strict=True):
            data[e.offset : e.offset + e.nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
        return cls(data, entries)


def view_as(data: torch.Tensor, entry: StateEntry) -> torch.Tensor:
    """`entry`'s tensor in the uint8 buffer `data` (any device): a view, or a copy where its bytes do not start at a
    multiple of its item size (a tensor can only view bytes there)."""
    raw = data[entry.offset : entry.end]
    if (data.storage_offset() + entry.offset) % entry.dtype.itemsize:
        raw = raw.clone()
    return raw.view(entry.dtype).view(entry.shape)


def byte_view(buffer: torch.Tensor) -> memoryview:
    """The bytes of a CPU uint8 tensor as a writable memoryview, without a copy."""
    return memoryview(buffer.numpy()) if buffer.numel() else memoryview(bytearray())


def read_file_into(path: str | os.PathLike, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The whole file at `path` in `alloc(size)` (a CPU uint8 buffer `[size]`, pinned when it goes to a GPU): one
    unbuffered read(2) from the page cache into it, no bytes object between. A file that shrinks while it is read
    gives the bytes read (whoever decodes them refuses a short snapshot). FileNotFoundError/OSError as `open`."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size  # of the file opened: a rename over it since does not matter
        buffer = alloc(size)
        view, done = byte_view(buffer), 0
        while done < size:  # one pass, unless the kernel caps a read (Linux: at 2 GiB)
            n = f.readinto(view[done:])
            if not n:
                break
            done += n
    return buffer[:done]
