"""ShardedStatePool: rank 0's state pool under tensor parallelism, which moves whole sessions.

Every rank's `StatePool` holds its part of each session's state (a block of every layer's heads, `StateSpec.split`).
Rank 0's pool is this subclass: the same slots, and every operation that changes a slot's rows (a reset, a fork, a
state loaded into it) is sent to the other ranks too (engine/parallel/ranks.py). A session's state leaves the pool
whole: an
export gathers each rank's packed part to rank 0 and puts every tensor back together along its split axis, so that a
snapshot, the host tier and the store hold the bytes a one-rank pool would (a session saved at TP=2 restores at
TP=1 or 4); an import cuts a whole state into the ranks' parts and hands each its own.

Moves are synchronous here (the gather and scatter run on a gloo group on the host): the PackedStates this pool
returns are complete, their events already passed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.tensor_parallel import Split, split_among, unshard
from kvfree.engine.state.packed import PackedState, StateEntry
from kvfree.engine.state.pool import StagedState, StatePool

if TYPE_CHECKING:  # (a type only: the ranks sit above the runner and the pool)
    from kvfree.engine.parallel.ranks import Workers


class ShardedStatePool(StatePool):
    """Rank 0's `StatePool` (its own part of every session), exporting and importing whole sessions."""

    def __init__(self, model: HybridLM, capacity: int, max_context: int, workers: Workers) -> None:
        super().__init__(model, capacity, max_context)
        self.workers = workers
        self._splits: dict[str, Split | None] = {
            f"layers.{i}.{name}": spec.split for i, specs in enumerate(self.specs) for name, spec in specs.items()
        }

    # -- what changes rows on every rank -----------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        super().reset(slot)
        self.workers.defer(("reset", slot))  # (needed only before the ranks' next use of their rows)

    def copy_many(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_many(pairs)
        if pairs:
            self.workers.send(("copy", pairs))

    # -- whole sessions out and in -------------------------------------------------------------------------------
    def export_packed(self, slot: int, out: torch.Tensor | None = None) -> PackedState:
        """The whole session's state, packed in host memory as a one-rank pool's (`out` is not used: the whole
        state is assembled from the ranks' parts)."""
        self.workers.send(("export", slot))
        mine = super().export_packed(slot).wait()
        parts = self.workers.gather(mine.data)
        whole = {}
        for e in mine.entries:
            pieces = [data[e.offset : e.end].view(e.dtype).view(e.shape) for data in parts]
            whole[e.name] = unshard(pieces, self._splits[e.name])
        packed = PackedState.pack(whole, pin=self.device.type == "cuda")
        if self.device.type == "cuda":  # (complete already: the events say so to a caller that waits on them)
            packed.rows_read = torch.cuda.Event()
            packed.rows_read.record()
        return packed

    def stage(self, packed: PackedState) -> StagedState:
        """Check a whole state against this model; it stays on the host until `import_staged` cuts it up."""
        self.check_packed(packed)
        return StagedState(packed.wait().data[:0], packed)

    def check_packed(self, packed: PackedState) -> None:
        """`StatePool.check_packed` against the whole session's specs (there is no fast path: this pool's own
        layout is its part's)."""
        by_name = {e.name: e for e in packed.entries}

        def value(key: str) -> torch.Tensor | None:
            e = by_name.get(key)
            return None if e is None else packed.wait().data[e.offset : e.end].view(e.dtype).view(e.shape)

        self.check_entries({e.name: (e.dtype, e.shape) for e in packed.entries}, value)

    def import_staged(self, slot: int, staged: StagedState) -> None:
        """Each rank's part of the staged whole state into `slot` (rank 0's own through `StatePool.import_part`)."""
        tensors = staged.packed.tensors()
        order = [e.name for e in self.layout] + [key for key, _, _ in self._per_token]
        size = self.model.tp.size
        by_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
        for key in order:
            split = self._splits[key]
            pieces = [tensors[key]] * size if split is None else split_among(tensors[key], split, size)
            for rank, piece in enumerate(pieces):
                by_rank[rank][key] = piece
        packed = [PackedState.pack(parts) for parts in by_rank]
        entries: tuple[StateEntry, ...] = packed[0].entries
        self.workers.send(("import", slot, entries, packed[0].nbytes))
        mine = self.workers.scatter([p.data for p in packed])
        self._stale.discard(slot)
        self.import_part(slot, PackedState(mine, entries))
