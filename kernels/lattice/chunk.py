"""Triton Lattice prefill over packed variable-length sequences, states in place in the pool (the exact recurrence).

The recurrence has no chunked form (kernels/lattice/fused_recurrent.py says why), so prefill is the same kernel as
decode, launched once over (sequence, head) programs that each walk their sequence's tokens with the state on chip.
"""

from __future__ import annotations

import itertools

import torch

from ..dispatch import host_cu_seqlens
from .fused_recurrent import GatedArgs, check_gated_shapes, gates_pass, scan, scan_launch


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
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.lattice.chunk_lattice` (same arguments and result; see its docstring).

    q, k, v may have any strides but a contiguous last dimension. The host copy of cu_seqlens is only checked (the
    kernel reads the device copy), so no sync when it is given. `num_warps` is open for the device sweep.
    """
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.shape[0])
    return scan(q, k, v, gamma, mu, state, state_indices, cu_seqlens, len(cu) - 1, variant, num_warps)


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
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.lattice.chunk_lattice_gated` (same arguments and result; see its docstring).

    Two launches: a token-parallel pass computes every token's q, k and gamma from the projections (convs, q/k norm,
    gates), then the scan runs the recurrence, advances the conv tails and applies the post-gate. Doing the gated
    inputs inside the scan instead would put their work on the sequential walk (measured 1.6x slower).
    """
    gated = GatedArgs(p, step, conv_state, (q_weight, q_bias, k_weight, k_bias), qk_l2, mu_min, gate, norm_weight, eps)
    check_gated_shapes(v, state, gated, variant)
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, p.shape[0])
    lens = [b - a for a, b in itertools.pairwise(cu)]
    H, m = v.shape[1], state.shape[-1]
    q, k, gamma = gates_pass(gated, state_indices, cu_seqlens, lens, H, m)
    return scan_launch(len(lens), cu_seqlens, v, state, state_indices, variant, explicit=(q, k, gamma, None),
                        gated=gated, num_warps=num_warps)  # fmt: skip
