"""StateMover: session state in and out of pool slots on side CUDA streams, so that the steps never wait on a copy.

The engine's steps run on the compute stream (the current one). Evicting a session to host memory is a gather of its
slot's rows (one launch, ~50 µs for a 49 MiB state on an H100) and one copy to pinned host memory (milliseconds);
loading one back is one copy from pinned memory and a scatter. Run on the compute stream, the copies would sit
between two steps and every decoding stream would wait for them. Here they run on two side streams, one each way
(an H100 has separate copy engines for the two directions), ordered against the steps by events only:

- a side stream first waits for the steps already launched (they may still write the slot it reads or overwrites);
- the compute stream waits for the gather of an evicted slot (which may be handed to another session at once) and
  for the scatter of a loaded one (the next step reads it), never for a copy to or from the host;
- the host never waits: an evicted state's bytes are read (written to a file, say) after `PackedState.wait()`.

On the CPU every call is synchronous and the streams are absent.
"""

from __future__ import annotations

import weakref

import torch

from kvfree.engine.state.packed import PackedState
from kvfree.engine.state.pool import StagedState, StatePool

SPARE_BUFFERS = 2  # evicted states' buffers kept for reuse on the CPU


class StateMover:
    """Moves states between `pool`'s slots and packed host buffers (see the module docstring)."""

    def __init__(self, pool: StatePool) -> None:
        self.pool = pool
        cuda = pool.device.type == "cuda"
        self._out = torch.cuda.Stream(pool.device) if cuda else None
        self._in = torch.cuda.Stream(pool.device) if cuda else None
        # The last gather out of each slot: a load into the slot waits for it (the slot's old state is read first).
        self._read: dict[int, torch.cuda.Event] = {}
        # On the CPU, the buffers of evicted states once they are loaded again, for the next evictions: a new 52 MB
        # buffer costs 12,600 page faults (~20 ms on the development VM). (On a GPU, PyTorch's pinned-memory cache
        # does this.) `_evicted` knows this mover's buffers by id, weakly: only those are ever reused.
        self._spare: list[torch.Tensor] = []
        self._evicted: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    @property
    def loading_stream(self) -> torch.cuda.Stream | None:
        """The stream loads run on (None on the CPU): work on a `stage`d state belongs there."""
        return self._in

    def evict(self, slot: int) -> PackedState:
        """The state of `slot`, packed in (pinned) host memory, its copy possibly still running (`PackedState.ready`).
        The slot may be freed and reused at once."""
        if self._out is None:
            packed = self.pool.export_packed(slot, out=self._spare.pop() if self._spare else None)
            self._evicted[id(packed.data)] = packed.data
            return packed
        compute = torch.cuda.current_stream(self.pool.device)
        self._out.wait_stream(compute)
        with torch.cuda.stream(self._out):
            packed = self.pool.export_packed(slot)
        compute.wait_event(packed.rows_read)  # a step writing the slot again (a new owner) runs after the gather
        self._read[slot] = packed.rows_read
        return packed

    def stage(self, packed: PackedState) -> StagedState:
        """`packed` checked and on its way to the device, on the loading stream (needs no slot: call it early)."""
        if self._in is None:
            return self.pool.stage(packed)
        with torch.cuda.stream(self._in):
            return self.pool.stage(packed)

    def load(self, slot: int, state: PackedState | StagedState, keep: bool = False) -> None:
        """`state` into `slot` (staged first when it is still a packed host buffer); the next step reads it.
        `keep`: the host copy stays in use (a checkpoint's), so its buffer is never taken back for reuse."""
        staged = state if isinstance(state, StagedState) else self.stage(state)
        if self._in is None:
            self.pool.import_staged(slot, staged)
            data = staged.packed.data
            if not keep and self._evicted.get(id(data)) is data and len(self._spare) < SPARE_BUFFERS:
                del self._evicted[id(data)]
                self._spare.append(data)  # (its state now lives in the slot; the caller drops its host copy)
            return
        compute = torch.cuda.current_stream(self.pool.device)
        self._in.wait_stream(compute)  # steps in flight may still write the slot (a request that just ended)
        read = self._read.pop(slot, None)
        if read is not None:
            self._in.wait_event(read)
        with torch.cuda.stream(self._in):
            self.pool.import_staged(slot, staged)
            # The staged device buffer was allocated on this stream: the allocator reuses it only after the scatter.
            loaded = torch.cuda.Event()
            loaded.record()
        compute.wait_event(loaded)
