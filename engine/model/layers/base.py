"""The mixer interface every sequence layer implements (docs/design/architecture.md §3).

A mixer owns no per-session memory itself. It declares the state one session needs (`state_specs`), and its two
serving entry points read and write that state in pool tensors of shape `[capacity, *shape]`, addressed by slot:

- `prefill(x, state, batch)`: a packed chunk of tokens of one or more sessions, continuing from their states;
- `decode(x, state, batch)`: one token for each of B sessions.

`batch` is the step's `StepBatch` (engine/model/step_batch.py): pool rows (`state_indices`) and sequence boundaries
(`cu_seqlens`), built once per step. A mixer projects, calls one op with them, and projects out; the op updates the
pool rows in place.

`forward(x)` is the training path: whole `[B, T, D]` sequences from a fresh state, differentiable.

Under tensor parallelism (engine/model/tensor_parallel.py) a rank's mixer is the same class built from `shard_config`'s
smaller config (its block of the heads); `weight_splits` and each `StateSpec.split` say how the whole layer's
tensors divide, and the block all-reduces the mixer's output (its out projection is row-parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.strict_config import StrictConfig
from kvfree.engine.model.tensor_parallel import ONE_RANK, Split, TensorParallel
from kvfree.kernels.rows.reference import zero_rows


@dataclass(frozen=True)
class StateSpec:
    """One named tensor of a session's state.

    shape: per-session shape (the pool adds a leading capacity axis).
    dtype: fixed dtype (recurrent matrices are fp32), or None for the model's activation dtype.
    per_token: axis 0 indexes context positions (the attention baseline's KV cache); only the first
        `length` entries of such a tensor hold data, where `length` is the layer's int64 `length` state.
    split: how the whole tensor divides among tensor-parallel ranks (axes of `shape`); None: every rank holds it
        whole (a position counter).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype | None = torch.float32
    per_token: bool = False
    split: Split | None = None


class ContextOverflowError(ValueError):
    """A session would exceed the context its state was sized for (only the attention baseline has a limit)."""


class Mixer(nn.Module):
    """Base class of sequence mixers. Subclasses set `kind` and implement the methods below."""

    kind: str = ""  # the name in config.json's `layers` list and the key of its sub-config
    config_class: type[StrictConfig]  # the sub-config's schema, defined beside the mixer
    # Why `decode` cannot be captured in a CUDA graph (a host sync or data-dependent shape), or "" when it can.
    # A model with any such mixer decodes eagerly, and says so once in the log.
    graph_blocker: str = ""
    # Why `prefill` cannot be captured in a CUDA graph padded to a bucket, or "" when it can: it must then take its
    # chunk metadata from the device (`batch.device_chunks`), never read `cu_seqlens` on the host, accept sequences
    # of length 0 and touch only the rows it is given. A model with any such mixer prefills eagerly.
    prefill_graph_blocker: str = "its prefill plans on the host boundaries (no device-metadata path)"
    # Under tensor parallelism: the ranks, and the whole layer's config (this mixer was built from `shard_config`'s).
    tp: TensorParallel = ONE_RANK
    whole_cfg: StrictConfig | None = None

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        """The state one session needs. `max_context` only sizes per-token (KV-cache) states."""
        raise NotImplementedError

    @classmethod
    def shard_config(cls, cfg: StrictConfig, tp: TensorParallel, what: str) -> StrictConfig:
        """The config of one rank's block of this layer (`cfg` with its head counts divided among `tp`'s ranks).

        Raises ValueError naming `what` (e.g. "layers.3 (gka) num_heads") when the heads do not divide, or when the
        kind has no tensor-parallel form.
        """
        if tp.size == 1:
            return cfg
        raise ValueError(f"{what}: {cls.kind} layers have no tensor-parallel form yet; serve this model on one GPU")

    def weight_splits(self) -> dict[str, Split]:
        """Parameter name (within the mixer) -> how the whole layer's tensor divides among ranks; a parameter not
        named is held whole by every rank."""
        return {}

    def reset_state(self, state: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        """Give `slots` the state of a new session (zeros unless the mixer overrides it)."""
        for tensor in state.values():
            zero_rows(tensor, slots)

    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        """x: `[T, D]` packed tokens of `batch`'s sessions -> `[T, D]`; updates their state rows in place."""
        raise NotImplementedError

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        """x: `[B, D]` one token per session of `batch` -> `[B, D]`; updates their state rows in place."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Training forward: x `[B, T, D]` -> `[B, T, D]` for B whole sequences from a new session's state.

        Differentiable and batched; computes the same function as `prefill` (tested), without a state pool.
        """
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Random initialisation for a new checkpoint (projections are initialised by the model)."""

    def on_load(self) -> None:
        """Called once after checkpoint weights are loaded (e.g. to fold a gate into a parameter for serving)."""
