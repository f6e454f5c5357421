"""StatePool: every session's recurrent state, preallocated on the model's device (docs/design/architecture.md §4).

For each layer and each state tensor the pool holds one tensor of `capacity + 2` rows (per-token tensors, the
attention KV caches: `capacity + 1`). A session owns one slot (row index); prefill and decode read and write rows in
place. Nothing is allocated per request or per step. Two rows belong to no session: `scratch_slot` (= capacity),
with which CUDA-graph decode pads its batches (engine/core/cuda_graphs.py), and `template_slot` (= capacity + 1), which
holds a new session's state and is never written after construction.

Resets are deferred: `alloc` and `reset` only note the slot, and the first use of the pool's rows afterwards copies
the template row onto every noted slot, all layers' tensors at once, in one launch (`kvfree.kernels.rows`). Forks
(`copy`, `copy_many`) are one launch too.

A session's state leaves and enters the pool packed (`export_packed`, `stage` + `import_staged`): every fixed-size
tensor's row gathered into one buffer by one launch, crossing between device and host in one copy
(engine/state/packed.py). Those calls run on the current CUDA stream, so a caller can run them on a side stream;
ordering them against the steps is the caller's (engine/state/mover.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvfree.engine.model.host_copy import upload
from kvfree.engine.model.hybrid_lm import HybridLM, State
from kvfree.engine.model.layers import StateSpec
from kvfree.engine.model.tensor_parallel import whole_shape
from kvfree.engine.protocol import SnapshotMismatchError
from kvfree.engine.state.packed import PackedState, StateEntry, view_as
from kvfree.kernels.rows import RowTable, copy_rows, gather_rows, scatter_rows


class PoolFullError(RuntimeError):
    """Every slot is taken."""



@dataclass(eq=False)
class StagedState:
    """A packed state on its way into a slot: its fixed-size bytes already on the pool's device (`[1, row_bytes]`
    uint8, copied there by `StatePool.stage`, possibly still in flight on the stream that staged it), and the packed
    state itself for its per-token tensors."""

    fixed: torch.Tensor
    packed: PackedState


def staged_tensors(staged: StagedState) -> dict[str, torch.Tensor]:
    """name -> tensor: the staged state's tensors, views of its device bytes (per-token ones from host memory)."""
    fixed = staged.fixed.view(-1)
    out = {e.name: view_as(fixed, e) for e in staged.packed.entries if e.end <= fixed.numel()}
    host = staged.packed.tensors()
    out.update({name: t for name, t in host.items() if name not in out})
    return out


class StatePool:
    """Fixed-capacity session state for one model.

    Args:
        model: the model whose mixers declare the state.
        capacity: number of sessions that can be resident at once.
        max_context: only sizes per-token states (the `attention` baseline's KV cache); recurrent mixers ignore it.
    """

    def __init__(self, model: HybridLM, capacity: int, max_context: int = 4096) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.model = model
        self.capacity = capacity
        self.max_context = max_context
        self.specs: list[dict[str, StateSpec]] = [layer.mixer.state_specs(max_context) for layer in model.layers]
        # A whole session's specs: under tensor parallelism `specs` are this rank's part
        # (engine/parallel/sharded_pool.py
        # exports and imports whole sessions); the same as `specs` on one rank.
        size = model.tp.size
        self.whole_specs: list[dict[str, StateSpec]] = [
            {name: dataclasses.replace(spec, shape=whole_shape(spec.shape, spec.split, size))
             for name, spec in specs.items()}
            for specs in self.specs
        ]  # fmt: skip
        self.scratch_slot = capacity
        self.template_slot = capacity + 1
        # Every row starts as a new session's state (`contiguous` copies the expanded row). Per-token tensors get no
        # template row: resets leave them alone.
        self._tensors: State = [
            {name: row.expand(capacity + (1 if spec.per_token else 2), *spec.shape).contiguous()
             for (name, spec), row in zip(specs.items(), fresh.values(), strict=True)}
            for specs, fresh in zip(self.specs, self._new_session_state(), strict=True)
        ]  # fmt: skip
        every = [(spec, t) for specs, state in zip(self.specs, self._tensors, strict=True)
                 for spec, t in zip(specs.values(), state.values(), strict=True)]  # fmt: skip
        self._fork_table = RowTable([t for _, t in every])
        # Resets zero-fill the tensors whose new-session row is all zero bits (all but Lattice's S): no read of the
        # template row, half the memory traffic. (One host read of the template, here at construction.)
        fixed = [t for spec, t in every if not spec.per_token]
        nonzero = [t[self.template_slot].view(-1).view(torch.uint8).any() for t in fixed]
        zero = [not z for z in torch.stack(nonzero).tolist()] if fixed else []
        self._reset_table = RowTable(fixed, zero_fill=zero)
        # Moves in and out of the pool: the fixed-size tensors' rows, packed back to back in table order.
        self._move_table = RowTable(fixed)
        names = [(f"layers.{i}.{name}", spec) for i, specs in enumerate(self.specs) for name, spec in specs.items()]
        fixed_names = [(key, spec) for key, spec in names if not spec.per_token]
        self._per_token = [(f"layers.{i}.{name}", i, name) for i, specs in enumerate(self.specs)
                           for name, spec in specs.items() if spec.per_token]  # fmt: skip
        self.layout: tuple[StateEntry, ...] = tuple(
            StateEntry(key, t.dtype, spec.shape, offset)
            for (key, spec), t, offset in zip(fixed_names, fixed, self._move_table.offsets, strict=True)
        )
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self._stale: set[int] = set()  # slots to reset before their rows are next read or written
        # The src of every reset: the template row, K of them sliced off (no upload per flush).
        self._templates = torch.full((capacity + 1,), self.template_slot, dtype=torch.int32, device=model.device)

    def _new_session_state(self) -> State:
        """Per layer, name -> `[1, *shape]`: a new session's state, as each mixer's `reset_state` gives it (not zeros
        for every mixer: Lattice starts from its S0)."""
        fresh: State = [
            {name: torch.zeros((1, *spec.shape), dtype=spec.dtype or self.model.dtype, device=self.model.device)
             for name, spec in specs.items()}
            for specs in self.specs
        ]  # fmt: skip
        row = torch.zeros(1, dtype=torch.int64, device=self.model.device)
        for layer, state in zip(self.model.layers, fresh, strict=True):
            layer.mixer.reset_state(state, row)
        return fresh

    @property
    def tensors(self) -> State:
        """Per layer, name -> `[capacity + 2, *shape]` tensor (per-token ones `[capacity + 1, *shape]`), with every
        pending reset applied. Rows `0 .. capacity - 1` are the sessions' slots, then `scratch_slot` and
        `template_slot`; a step must never name the template row."""
        if self._stale:
            self.flush_resets()
        return self._tensors

    def flush_resets(self) -> None:
        """Give every slot noted by `alloc`/`reset` a new session's state now: the template row onto all of them,
        every layer's tensors in one launch (tensors whose new state is all zeros are zero-filled: nothing is read).

        Per-token tensors (full attention KV caches, by far the largest state) are left as they are: their layer's
        `length`, a fixed-size tensor, returns to 0, and no reader depends on an entry past `length`. The Triton
        decode kernel and `export` read only the first `length` entries; the PyTorch attention references gather a
        padded span but zero the entries past each session's length first (kernels/attention/reference.py: a masked
        weight of 0 times a NaN left there would be NaN); prefill and decode write entries from `length` on.
        """
        if not self._stale:
            return
        slots = sorted(self._stale)
        self._stale.clear()
        # Uploaded from pinned memory: a pageable host-to-device copy makes the host wait for the device's queue.
        copy_rows(self._reset_table, self._templates[: len(slots)], upload(slots, torch.int32, self.model.device))

    # -- slots --------------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self) -> int:
        """Take a free slot and give it a new session's initial state."""
        if not self._free:
            raise PoolFullError(f"all {self.capacity} state slots are in use")
        slot = self._free.pop()
        self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give `slot` back. Its rows are reset on the next alloc, so nothing of the old session leaks."""
        if not 0 <= slot < self.capacity or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated")
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Give `slot` (a session's, or the scratch slot) a new session's state (applied before its rows are next
        used)."""
        if not 0 <= slot <= self.scratch_slot:
            raise ValueError(f"slot {slot} is not a session slot or the scratch slot")
        self._stale.add(slot)

    def copy(self, src: int, dst: int) -> None:
        """Make `dst` an exact copy of `src` (forking a session: one fixed-size copy, no re-prefill)."""
        self.copy_many([(src, dst)])

    def copy_many(self, pairs: list[tuple[int, int]]) -> None:
        """Make each `dst` an exact copy of its `src`, every state tensor of every pair in one launch (several forks).

        A slot may be a dst once, and not also a src of the same call (the copies run in parallel); ValueError
        otherwise, or for a slot that is not a session's or the scratch slot.
        """
        if not pairs:
            return
        srcs, dsts = [p[0] for p in pairs], [p[1] for p in pairs]
        bad = [s for s in srcs + dsts if not 0 <= s <= self.scratch_slot]
        if bad:
            raise ValueError(f"slots {bad} are not session slots or the scratch slot")
        if len(set(dsts)) != len(dsts) or set(srcs) & set(dsts):
            raise ValueError(f"forks {pairs}: a dst named twice, or also a src (copies run in parallel, in no order)")
        self._stale.difference_update(dsts)  # every tensor of a dst is overwritten
        self.flush_resets()  # a src noted for reset must be copied as a new session's state
        rows = upload(srcs + dsts, torch.int32, self.model.device)
        copy_rows(self._fork_table, rows[: len(pairs)], rows[len(pairs) :])

    # -- export / import (the basis of snapshots and of the host tier) -----------------------------------------
    def _used(self, layer: int, slot: int) -> int:
        return int(self.tensors[layer]["length"][slot])

    @property
    def device(self) -> torch.device:
        return self.model.device

    def export_packed(self, slot: int, out: torch.Tensor | None = None) -> PackedState:
        """The session's state packed in host memory (`layout`, then per-token caches cut to their length), in `out`
        (a uint8 host buffer, used when large enough) or a new buffer.

        On a GPU: one gather launch into a device buffer, then one copy to pinned memory, both on the current stream
        and asynchronous (the result's `ready` event says when the bytes are there); a model with per-token caches
        (the attention baseline) reads their lengths first, which waits for the device. Reads the slot as the
        current stream finds it: a caller on a side stream makes it wait for the steps that wrote the slot first.
        """
        cuda = self.device.type == "cuda"
        # A slot noted for reset holds a new session's state: export the template row (no flush on this stream).
        stale = slot in self._stale
        row = self.template_slot if stale else slot
        # (`_tensors`, not `tensors`: no flush of other slots' resets on what may be a side stream.)
        cut = [(key, self._tensors[i][name][slot][: 0 if stale else int(self._tensors[i]["length"][slot])])
               for key, i, name in self._per_token]  # fmt: skip
        entries = list(self.layout)
        offset = self._move_table.row_bytes
        for key, t in cut:
            entries.append(StateEntry(key, t.dtype, tuple(t.shape), offset))
            offset += entries[-1].nbytes
        host = out[:offset] if out is not None and out.numel() >= offset else PackedState.buffer(offset, pin=cuda)
        fixed = self._move_table.row_bytes
        rows = upload([row], torch.int32, self.device)
        if not cuda:
            gather_rows(self._move_table, rows, host[:fixed].view(1, fixed))
            for e, (_, t) in zip(entries[len(self.layout) :], cut, strict=True):
                host[e.offset : e.end].copy_(t.contiguous().view(-1).view(torch.uint8))
            return PackedState(host, tuple(entries))
        staging = torch.empty(offset, dtype=torch.uint8, device=self.device)
        gather_rows(self._move_table, rows, staging[:fixed].view(1, fixed))
        for e, (_, t) in zip(entries[len(self.layout) :], cut, strict=True):
            staging[e.offset : e.end].copy_(t.contiguous().view(-1).view(torch.uint8))
        rows_read = torch.cuda.Event()
        rows_read.record()
        host.copy_(staging, non_blocking=True)  # one DMA; `staging` returns to this stream's cache, reused after it
        ready = torch.cuda.Event()
        ready.record()
        return PackedState(host, tuple(entries), ready, rows_read)

    def export_initial(self) -> PackedState:
        """A new session's state (not zeros for every mixer: Lattice starts from its S0), packed and complete."""
        self.reset(self.scratch_slot)  # (a reset slot exports the template row; the scratch slot is nobody's)
        return self.export_packed(self.scratch_slot).wait()

    def export(self, slot: int) -> dict[str, torch.Tensor]:
        """The session's state as CPU tensors named `layers.{i}.{name}`; per-token caches are cut to their length."""
        return self.export_packed(slot).tensors()

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise SnapshotMismatchError unless `tensors` (an `export()`) fit this pool: names, dtypes, shapes, and
        per-token caches whose entry count agrees with their layer's `length`."""
        self.check_entries(
            {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()},
            lambda key: tensors.get(key),
        )

    def check_packed(self, packed: PackedState) -> None:
        """`check` for a packed state: when its fixed-size part is laid out as this pool's (`layout`), only the
        per-token entries are checked one by one."""
        if not self._per_token and packed.entries == self.layout:
            return
        by_name = {e.name: e for e in packed.entries}
        views: dict[str, torch.Tensor] = {}

        def value(key: str) -> torch.Tensor | None:
            e = by_name.get(key)
            if e is None:
                return None
            if key not in views:
                views[key] = packed.wait().data[e.offset : e.end].view(e.dtype).view(e.shape)
            return views[key]

        self.check_entries({e.name: (e.dtype, e.shape) for e in packed.entries}, value)

    def check_entries(self, given: dict[str, tuple[torch.dtype, tuple[int, ...]]], value) -> None:
        """The checks of `check` over names -> (dtype, shape); `value(name)` gives a `length` tensor's value."""
        expected = {f"layers.{i}.{name}": (i, name, spec)
                    for i, s in enumerate(self.whole_specs) for name, spec in s.items()}  # fmt: skip
        missing = sorted(set(expected) - set(given))
        unexpected = sorted(set(given) - set(expected))
        scales_missing = any(key.endswith(".k_scale") for key in missing)  # (only an fp8 KV cache has scales)
        if scales_missing or any(key.endswith(".k_scale") for key in unexpected):
            here, there = ("fp8", "auto") if scales_missing else ("auto", "fp8")
            raise SnapshotMismatchError(
                f"this state's KV cache was kept with --kv-cache-dtype {there}, this server keeps it with "
                f"--kv-cache-dtype {here}: restore it into a server of the same setting (converting would change the "
                "session's numbers)"
            )
        if missing or unexpected:
            raise SnapshotMismatchError(
                f"state tensors do not match this model: missing {missing}, unexpected {unexpected}"
            )
        for key, (i, name, spec) in expected.items():
            (dtype_given, shape), dtype = given[key], self._tensors[i][name].dtype  # (no flush: metadata only)
            if dtype_given != dtype:
                raise SnapshotMismatchError(
                    f"{key}: dtype {dtype_given}, this model keeps it as {dtype} (a state from the same model run at "
                    "another dtype: load the model with the same dtype)"
                )
            if spec.per_token:
                if shape[1:] != spec.shape[1:] or shape[0] > spec.shape[0]:
                    raise SnapshotMismatchError(f"{key}: shape {shape} does not fit the pool's {spec.shape}")
                length = value(f"layers.{i}.length")
                if length is not None and (length.numel() != 1 or int(length) != shape[0]):
                    raise SnapshotMismatchError(
                        f"{key}: {shape[0]} entries, but the layer's length says {length.tolist()}"
                    )
            elif shape != spec.shape:
                raise SnapshotMismatchError(f"{key}: shape {shape}, this model needs {spec.shape}")

    def _in_layout(self, packed: PackedState) -> PackedState:
        """`packed` with its fixed-size part laid out as `layout` (repacked when it is not: an old snapshot's order)."""
        if packed.entries[: len(self.layout)] == self.layout:
            return packed
        tensors = packed.tensors()
        order = [e.name for e in self.layout] + [key for key, _, _ in self._per_token]
        return PackedState.pack({key: tensors[key] for key in order})

    def stage(self, packed: PackedState) -> StagedState:
        """Check `packed` against this pool and copy its fixed-size bytes to the device (on the current stream,
        asynchronous from pinned memory): the first half of an import, which needs no slot."""
        self.check_packed(packed)
        packed = self._in_layout(packed)
        fixed = packed.data[: self._move_table.row_bytes].view(1, -1)
        if self.device.type != "cuda":
            return StagedState(fixed, packed.wait())
        if packed.ready is not None:  # still being copied from the device (just evicted): the stream waits, not us
            torch.cuda.current_stream(self.device).wait_event(packed.ready)
        return StagedState(fixed.to(self.device, non_blocking=fixed.is_pinned()), packed)

    def import_staged(self, slot: int, staged: StagedState) -> None:
        """The second half of an import: the staged bytes into `slot`'s rows (one launch, on the current stream)."""
        self._stale.discard(slot)  # every tensor of the slot is overwritten below
        scatter_rows(self._move_table, staged.fixed, upload([slot], torch.int32, self.device))
        entries = staged.packed.entries[len(self.layout) :]
        for e, (_, i, name) in zip(entries, self._per_token, strict=True):
            t = staged.packed.data[e.offset : e.end].view(e.dtype).view(e.shape)
            self._tensors[i][name][slot].zero_()
            self._tensors[i][name][slot, : t.shape[0]].copy_(t, non_blocking=True)

    def import_part(self, slot: int, packed: PackedState) -> None:
        """Load this rank's part of a state into `slot`, laid out as its `layout` then its per-token caches,
        without checks: under tensor parallelism rank 0 checks the whole state before cutting it
        (engine/parallel/sharded_pool.py)."""
        fixed = packed.data[: self._move_table.row_bytes].view(1, -1)
        staged = StagedState(fixed.to(self.device, non_blocking=fixed.is_pinned()), packed)
        StatePool.import_staged(self, slot, staged)  # (this rank's rows only, whatever a subclass does)

    def import_packed(self, slot: int, packed: PackedState) -> None:
        """Load a packed state into `slot`, checking it first (all or nothing)."""
        self.import_staged(slot, self.stage(packed))

    def import_(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Load an `export()`ed state into `slot`, checking it first (all or nothing)."""
        self.check(tensors)
        order = [e.name for e in self.layout] + [key for key, _, _ in self._per_token]
        self.import_packed(slot, PackedState.pack({key: tensors[key] for key in order}))

    # -- memory accounting --------------------------------------------------------------------------------------
    def _spec_bytes(self, spec: StateSpec, per_token_entries: int | None) -> int:
        n = 1
        for d in spec.shape[1:] if spec.per_token else spec.shape:
            n *= d
        if spec.per_token:
            n *= spec.shape[0] if per_token_entries is None else per_token_entries
        return n * (spec.dtype or self.model.dtype).itemsize

    def bytes_per_session(self, context_tokens: int | None = None, part: bool = False) -> int:
        """State bytes of one session holding `context_tokens` of context: all of it, or with `part` this rank's
        (under tensor parallelism each rank holds its part of every session; the same on one rank).

        For recurrent mixers this is the same for every context length. The `attention` baseline's KV cache grows
        by `bytes_per_token()` per token; with `context_tokens=None` it is counted at its reserved `max_context`.
        """
        entries = None if context_tokens is None else min(context_tokens, self.max_context)
        every = self.specs if part else self.whole_specs
        return sum(self._spec_bytes(spec, entries) for specs in every for spec in specs.values())

    def bytes_per_token(self) -> int:
        """How much a session's state grows per token of context (0 unless the model has full attention)."""
        return self.bytes_per_session(1) - self.bytes_per_session(0)

    def session_bytes(self, slot: int) -> int:
        """Bytes of state the session in `slot` actually holds (what `export(slot)` returns)."""
        return self.export_packed(slot).nbytes

    def reserved_bytes(self) -> int:
        """Device bytes the whole pool occupies (the scratch and template rows included); under tensor parallelism,
        this rank's part."""
        return sum(t.numel() * t.element_size() for state in self.tensors for t in state.values())
