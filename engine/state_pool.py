"""StatePool: every session's recurrent state, preallocated on the model's device (docs/design/architecture.md §4).

For each layer and each state tensor the pool holds one tensor of `capacity + 2` rows (per-token tensors, the
attention KV caches: `capacity + 1`). A session owns one slot (row index); prefill and decode read and write rows in
place. Nothing is allocated per request or per step. Two rows belong to no session: `scratch_slot` (= capacity),
with which CUDA-graph decode pads its batches (engine/cuda_graphs.py), and `template_slot` (= capacity + 1), which
holds a new session's state and is never written after construction.

Resets are deferred: `alloc` and `reset` only note the slot, and the first use of the pool's rows afterwards copies
the template row onto every noted slot, all layers' tensors at once, in one launch (`kvfree.kernels.rows`). Forks
(`copy`, `copy_many`) are one launch too.
"""

from __future__ import annotations

import torch

from kvfree.engine.host_copy import upload
from kvfree.engine.layers import StateSpec
from kvfree.engine.model import HybridLM, State
from kvfree.kernels.rows import RowTable, copy_rows


class PoolFullError(RuntimeError):
    """Every slot is taken."""


class SnapshotMismatchError(ValueError):
    """Exported state tensors that do not fit this pool's model (wrong names, shapes or dtypes)."""


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

    # -- export / import (the basis of snapshots) ---------------------------------------------------------------
    def _used(self, layer: int, slot: int) -> int:
        return int(self.tensors[layer]["length"][slot])

    def export(self, slot: int) -> dict[str, torch.Tensor]:
        """The session's state as CPU tensors named `layers.{i}.{name}`; per-token caches are cut to their length."""
        out = {}
        for i, (specs, state) in enumerate(zip(self.specs, self.tensors, strict=True)):
            for name, spec in specs.items():
                row = state[name][slot]
                if spec.per_token:
                    row = row[: self._used(i, slot)]
                out[f"layers.{i}.{name}"] = row.detach().to("cpu", copy=True).contiguous()
        return out

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise SnapshotMismatchError unless `tensors` (an `export()`) fit this pool: names, dtypes, shapes, and
        per-token caches whose entry count agrees with their layer's `length`."""
        expected = {f"layers.{i}.{name}": (i, name, spec) for i, s in enumerate(self.specs) for name, spec in s.items()}
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise SnapshotMismatchError(
                f"state tensors do not match this model: missing {missing}, unexpected {unexpected}"
            )
        for key, (i, name, spec) in expected.items():
            t, dtype = tensors[key], self._tensors[i][name].dtype  # (no flush: metadata only)
            if t.dtype != dtype:
                raise SnapshotMismatchError(
                    f"{key}: dtype {t.dtype}, this model keeps it as {dtype} (a state from the same model run at "
                    "another dtype: load the model with the same dtype)"
                )
            shape = tuple(t.shape)
            if spec.per_token:
                if shape[1:] != spec.shape[1:] or shape[0] > spec.shape[0]:
                    raise SnapshotMismatchError(f"{key}: shape {shape} does not fit the pool's {spec.shape}")
                length = tensors.get(f"layers.{i}.length")
                if length is not None and (length.numel() != 1 or int(length) != shape[0]):
                    raise SnapshotMismatchError(
                        f"{key}: {shape[0]} entries, but the layer's length says {length.tolist()}"
                    )
            elif shape != spec.shape:
                raise SnapshotMismatchError(f"{key}: shape {shape}, this model needs {spec.shape}")

    def import_(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Load an `export()`ed state into `slot`, checking it first (all or nothing)."""
        self.check(tensors)
        self._stale.discard(slot)  # every tensor of the slot is overwritten below
        for i, specs in enumerate(self.specs):
            for name, spec in specs.items():
                t = tensors[f"layers.{i}.{name}"].to(self.model.device)
                if spec.per_token:
                    self.tensors[i][name][slot].zero_()
                    self.tensors[i][name][slot, : t.shape[0]].copy_(t)
                else:
                    self.tensors[i][name][slot].copy_(t)

    # -- memory accounting --------------------------------------------------------------------------------------
    def _spec_bytes(self, spec: StateSpec, per_token_entries: int | None) -> int:
        n = 1
        for d in spec.shape[1:] if spec.per_token else spec.shape:
            n *= d
        if spec.per_token:
            n *= spec.shape[0] if per_token_entries is None else per_token_entries
        return n * (spec.dtype or self.model.dtype).itemsize

    def bytes_per_session(self, context_tokens: int | None = None) -> int:
        """State bytes of one session holding `context_tokens` of context.

        For recurrent mixers this is the same for every context length. The `attention` baseline's KV cache grows
        by `bytes_per_token()` per token; with `context_tokens=None` it is counted at its reserved `max_context`.
        """
        entries = None if context_tokens is None else min(context_tokens, self.max_context)
        return sum(self._spec_bytes(spec, entries) for specs in self.specs for spec in specs.values())

    def bytes_per_token(self) -> int:
        """How much a session's state grows per token of context (0 unless the model has full attention)."""
        return self.bytes_per_session(1) - self.bytes_per_session(0)

    def session_bytes(self, slot: int) -> int:
        """Bytes of state the session in `slot` actually holds (what `export(slot)` returns)."""
        return sum(t.numel() * t.element_size() for t in self.export(slot).values())

    def reserved_bytes(self) -> int:
        """Device bytes the whole pool occupies (the scratch and template rows included)."""
        return sum(t.numel() * t.element_size() for state in self.tensors for t in state.values())
