"""Lattice (orthogonal-update memory slots): exact recurrent prefill and single-step decode on a state pool.

`chunk_lattice` (packed variable-length prefill) and `fused_recurrent_lattice` (one decode token per session) read
and write the per-session states in place in a pool, addressed by slot; `chunk_lattice_qk_conv` and
`fused_recurrent_lattice_qk_conv` run the layer's two short convs from the one shared conv tail.
`chunk_lattice_gated` and `fused_recurrent_lattice_gated` are what the layer serves with: the convs, the q/k norm and
the gates folded into the recurrence, from the layer's projections (one kernel launch per layer). The recurrence ops
dispatch to the Triton kernel (one program per sequence and head walking its tokens with the state on chip) or the
PyTorch reference by `kvfree.kernels.dispatch.use_triton` (`KVFREE_KERNELS`); float64 inputs or pools always take
the reference, since the kernel computes in fp32. The convs dispatch inside `kvfree.kernels.conv`.
`lattice_recurrent` and `lattice_step` are the plain math on batches of equal-length sequences; `lattice_forward` is
the training path, differentiable: the Triton forward and backward (`backward.py`) or `lattice_recurrent`.
"""

from __future__ import annotations

import torch

from kvfree.kernels.dispatch import use_triton
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


def _triton(q: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether this call runs the Triton kernel: an fp32 pool, inputs below fp64, and the dispatch says so."""
    return q.dtype != torch.float64 and state.dtype == torch.float32 and use_triton(q.device)


def chunk_lattice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    variant: str = "dec",
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """Exact recurrent prefill over packed variable-length sequences, states in place in a pool (spec §5.2, §5.5).

    Args:
        q, k: `[T, H, m]` (fp32 after the layer's L2 norm, or the activation dtype), the tokens of N sequences
            concatenated.  v: `[T, H, d]`.  gamma: `[T, H]` step sizes.  mu: `[T, H]` forget gate, or None (mu = 1,
            the folded serving form).
        state: `[S, H, d, m]` fp32 pool (fp64 allowed for tests) of states with unit columns; rows `state_indices`
            hold the initial states and receive the final ones. Other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence (padding names a scratch row, never -1).
        cu_seqlens: `[N+1]` int32, sequence boundaries on the token axis (device), from 0 to T. A sequence may be
            empty (its state is kept).
        variant: "dec", "enc" or "sim".
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.

    Returns:
        y: `[T, H, d]` in the state's compute dtype (fp32, or fp64 for an fp64 state): the read-outs `S_t q_t`.
    """
    if _triton(q, state):
        from kvfree.kernels.lattice.chunk import chunk_lattice as impl
    else:
        impl = reference.chunk_lattice
    return impl(q, k, v, gamma, mu, state, state_indices, cu_seqlens, variant, cu_seqlens_cpu=cu_seqlens_cpu)


def fused_recurrent_lattice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    variant: str = "dec",
) -> torch.Tensor:
    """One decode token per session, its state updated in place in the pool (the arithmetic of one prefill step).

    Args:
        q, k: `[B, H, m]`.  v: `[B, H, d]`.  gamma: `[B, H]`.  mu: `[B, H]` or None (mu = 1).
        state: `[S, H, d, m]` fp32 pool; rows `state_indices` advance by one token. Other rows are left untouched.
        state_indices: `[B]` int32, the pool row of each session.
        variant: "dec", "enc" or "sim".

    Returns:
        y: `[B, H, d]` in the state's compute dtype.
    """
    if _triton(q, state):
        from kvfree.kernels.lattice.fused_recurrent import fused_recurrent_lattice as impl
    else:
        impl = reference.fused_recurrent_lattice
    return impl(q, k, v, gamma, mu, state, state_indices, variant)


def chunk_lattice_gated(
    p: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    q_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    variant: str = "dec",
    qk_l2: bool = True,
    mu_min: float = 1e-4,
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """The layer's prefill from its projections: the two short convs (one shared tail), q/k L2 norm, the gates
    (`lattice_gates`), then the exact recurrence; conv tails and states advance in place in their pools.

    Args:
        p: `[T, H*m]` the shared q/k projection of N sequences' tokens, concatenated.  v: `[T, H, d]` values.
        step: `[T, H]` step logits, or `[T, 2H]` step and forget-gate logits.
        conv_state: `[S, K-1, H*m]` pool of conv tails; state: `[S, H, d, m]` fp32 pool of states (fp64 allowed
            for tests). Rows `state_indices` are continued and advanced; other rows are left untouched.
        state_indices: `[N]` int32.  cu_seqlens: `[N+1]` int32 (device), from 0 to T.
        q_weight, k_weight: `[H*m, K]` the depthwise conv filters; q_bias, k_bias: `[H*m]` or None.
        variant: "dec", "enc" or "sim".  qk_l2: L2-normalise q and k per head.  mu_min: the forget-gate clamp.
        gate: `[T, H*d]` the post-gate projection, or None.  norm_weight: `[d]` the head RMSNorm's weight, or None
            (no norm).  eps: its epsilon.
        cu_seqlens_cpu: a host copy of cu_seqlens; copied from the device (a sync) when None.

    Returns:
        Without a gate, y: `[T, H, d]` fp32 (fp64 with an fp64 state); with one, gelu_tanh(gate) * rms_norm(y) * w
        per head (`lattice_post_gate`): `[T, H*d]` in gate's dtype.
    """
    if _triton(v, state):
        from kvfree.kernels.lattice.chunk import chunk_lattice_gated as impl
    else:
        impl = reference.chunk_lattice_gated
    return impl(
        p, v, step, conv_state, state, state_indices, cu_seqlens, q_weight, q_bias, k_weight, k_bias, variant,
        qk_l2, mu_min, gate, norm_weight, eps, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip


def fused_recurrent_lattice_gated(
    p: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    q_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    variant: str = "dec",
    qk_l2: bool = True,
    mu_min: float = 1e-4,
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """One decode token per session from the layer's projections (`chunk_lattice_gated` with one token each:
    p `[B, H*m]`, v `[B, H, d]`, step `[B, H or 2H]`, gate `[B, H*d]`) -> y `[B, H, d]` fp32, or `[B, H*d]` in
    gate's dtype with a gate; tails and states advance in place."""
    if _triton(v, state):
        from kvfree.kernels.lattice.fused_recurrent import fused_recurrent_lattice_gated as impl
    else:
        impl = reference.fused_recurrent_lattice_gated
    return impl(p, v, step, conv_state, state, state_indices, q_weight, q_bias, k_weight, k_bias, variant, qk_l2,
                mu_min, gate, norm_weight, eps)  # fmt: skip


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
    if _triton(q, S0):
        from kvfree.kernels.lattice.backward import lattice_scan_train

        return lattice_scan_train(S0, q, k, v, gamma if mu is None else gamma / mu, variant)
    return lattice_recurrent(S0, q, k, v, gamma, mu, variant, checkpoint_tokens=checkpoint_tokens)
