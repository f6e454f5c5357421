"""Lattice (orthogonal-update memory slots): exact recurrent prefill and single-step decode on a state pool.

`chunk_lattice` (packed variable-length prefill) and `fused_recurrent_lattice` (one decode token per session) read and
write the per-session states in place in a pool, addressed by slot; `chunk_lattice_qk_conv` and
`fused_recurrent_lattice_qk_conv` run the layer's two short convs from the one shared conv tail. `chunk_lattice_gated`
and `fused_recurrent_lattice_gated` are what the layer serves with: the convs, the q/k norm and the gates folded into
the recurrence, from the layer's projections (one kernel launch per layer). Each serving op is its PyTorch reference
(reference.py, the spec) dispatched to the Triton kernel beside it (one program per sequence and head walking its tokens
with the state on chip) by `kvfree.kernels.dispatch.Op` (`KVFREE_KERNELS`); float64 inputs or pools always take the
reference, since the kernel computes in fp32. The convs dispatch inside `kvfree.kernels.conv`. `lattice_recurrent` and
`lattice_step` are the plain math on batches of equal-length sequences; `lattice_forward` is the training path,
differentiable: the Triton forward and backward (`backward.py`) or `lattice_recurrent`.
"""

from __future__ import annotations

import torch

from kvfree.kernels.dispatch import Op, use_triton
from kvfree.kernels.lattice import reference
from kvfree.kernels.lattice.reference import (
    VARIANTS,
    chunk_lattice_qk_conv,
    fused_recurrent_lattice_qk_conv,
    lattice_gates,
    lattice_post_gate,
    lattice_recurrent,
    lattice_step,
    lattice_unnormalised_update,
    orthonormal_columns,
)

__all__ = [
    "VARIANTS",
    "chunk_lattice",
    "chunk_lattice_gated",
    "chunk_lattice_qk_conv",
    "fused_recurrent_lattice",
    "fused_recurrent_lattice_gated",
    "fused_recurrent_lattice_qk_conv",
    "lattice_forward",
    "lattice_gates",
    "lattice_post_gate",
    "lattice_recurrent",
    "lattice_step",
    "lattice_unnormalised_update",
    "orthonormal_columns",
]


def _fp32(x: torch.Tensor, state: torch.Tensor) -> bool:
    """The kernels compute in fp32: an fp32 state pool and inputs below fp64."""
    return x.dtype != torch.float64 and state.dtype == torch.float32


chunk_lattice = Op(reference.chunk_lattice, "lattice.chunk:chunk_lattice",
                   takes=lambda q, k, v, gamma, mu, state, *a, **kw: _fp32(q, state))  # fmt: skip
fused_recurrent_lattice = Op(reference.fused_recurrent_lattice, "lattice.fused_recurrent:fused_recurrent_lattice",
                             takes=lambda q, k, v, gamma, mu, state, *a, **kw: _fp32(q, state))  # fmt: skip
chunk_lattice_gated = Op(reference.chunk_lattice_gated, "lattice.chunk:chunk_lattice_gated",
                         takes=lambda p, v, step, conv_state, state, *a, **kw: _fp32(v, state))  # fmt: skip
fused_recurrent_lattice_gated = Op(
    reference.fused_recurrent_lattice_gated, "lattice.fused_recurrent:fused_recurrent_lattice_gated",
    takes=lambda p, v, step, conv_state, state, *a, **kw: _fp32(v, state),
)  # fmt: skip


def lattice_forward(
    S0: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    variant: str = "dec",
    checkpoint_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The differentiable recurrence of B equal-length sequences (training), as `lattice_recurrent` computes it.

    Args:
        S0: `[B, H, d, m]` initial states with unit columns.  q, k: `[B, T, H, m]`.  v: `[B, T, H, d]`.
        gamma: `[B, T, H]` step sizes.  mu: `[B, T, H]` forget gate or None (mu = 1).  variant: "dec", "enc", "sim".
        checkpoint_tokens: the reference's recompute segment (the Triton path always checkpoints every 64 tokens).

    Returns:
        y: `[B, T, H, d]` and the final state `[B, H, d, m]`, in the state's compute dtype.

    The Triton path runs the folded form (gamma / mu, mu = 1: the same function, spec §4.4; autograd differentiates
    the division), forward and backward in one program per (sequence, head) each.
    """
    if _fp32(q, S0) and use_triton(q.device):
        from kvfree.kernels.lattice.backward import lattice_scan_train

        return lattice_scan_train(S0, q, k, v, gamma if mu is None else gamma / mu, variant)
    return lattice_recurrent(S0, q, k, v, gamma, mu, variant, checkpoint_tokens=checkpoint_tokens)
