"""Triton Lattice prefill over packed variable-length sequences, states in place in the pool (the exact recurrence).

The recurrence has no chunked form (kernels/lattice/fused_recurrent.py says why), so prefill is the same kernel as
decode, launched once over (sequence, head) programs that each walk their sequence's tokens with the state on chip.
"""

from __future__ import annotations

import torch

from ..dispatch import host_cu_seqlens
from .fused_recurrent import scan, scan_gated


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
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.lattice.chunk_lattice_gated` (same arguments and result; see its docstring): the
    convs, the q/k norm and the gates run inside the recurrence kernel, so the layer's prefill is one launch."""
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, p.shape[0])
    conv = (q_weight, q_bias, k_weight, k_bias)
    return scan_gated(p, v, step, conv_state, state, state_indices, cu_seqlens, len(cu) - 1, conv, variant, qk_l2,
                      mu_min, num_warps)  # fmt: skip
