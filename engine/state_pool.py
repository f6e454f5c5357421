"""StatePool: every session's recurrent state, preallocated on the model's device (docs/design/architecture.md §4).

For each layer and each state tensor the pool holds one `[capacity + 1, *shape]` tensor. A session owns one slot
(row index); prefill and decode read and write rows in place. Nothing is allocated per request or per step. The
last row, `scratch_slot`, belongs to no session: CUDA-graph decode pads its batches with it (engine/cuda_graphs.py).

Resets are deferred: `alloc` and `reset` only note the slot, and the first use of the pool's rows afterwards
resets every noted slot with one batched op per state tensor. Admitting 256 sessions in one step then costs a few
hundred device ops instead of a few hundred per session.
"""

from __future__ import annotations

import torch

from kvfree.engine.layers import StateSpec
from kvfree.engine.model import HybridLM, State


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
        self._tensors: State = [
            {
                name: torch.zeros((capacity + 1, *spec.shape), dtype=spec.dtype or model.dtype, device=model.device)
                for name, spec in specs.items()
            }
            for specs in self.specs
        ]
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        # Every row starts as a new session's state (not all mixers start from zeros: Lattice starts from S0).
        all_slots = torch.arange(capacity + 1, device=model.device)
        for layer, state in zip(model.layers, self._tensors, strict=True):
            layer.mixer.reset_state(state, all_slots)
        self._stale: set[int] = set()  # slots to reset before their rows are next read or written

    @property
    def tensors(self) -> State:
        """Per layer, name -> `[capacity + 1, *shape]` tensor, with every pending reset applied."""
        if self._stale:
            self.flush_resets()
        return self._tensors

    def flush_resets(self) -> None:
        """Give every slot noted by `alloc`/`reset` a new session's state now (one op per state tensor)."""
        if not self._stale:
            return
        slots = torch.tensor(sorted(self._stale), dtype=torch.int64).to(self.model.device, non_blocking=True)
        self._stale.clear()
        for layer, state in zip(self.model.layers, self._tensors, strict=True):
            layer.mixer.reset_state(state, slots)

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
        """Give `slot` a new session's state (applied before its rows are next used)."""
        self._stale.add(slot)

    def copy(self, src: int, dst: int) -> None:
        """Make `dst` an exact copy of `src` (forking a session: one fixed-size copy, no re-prefill)."""
        for state in self.tensors:
            for tensor in state.values():
                tensor[dst].copy_(tensor[src])

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
        """Device bytes the whole pool occupies (the scratch row included)."""
        return sum(t.numel() * t.element_size() for state in self.tensors for t in state.values())
