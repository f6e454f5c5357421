"""RMS norms shared by every layer kind: thin modules over `kvfree.kernels.norm` (fused Triton on a GPU)."""

from __future__ import annotations

import torch
from torch import nn

from kvfree.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled by a learned weight: x / rms(x) * w."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[..., dim]` -> `[..., dim]` in the weight's dtype."""
        return rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, *, inplace: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add folded into the norm: `r = residual + x.float()` (`x.float()` when residual is None).

        x: `[..., dim]` (model dtype), residual: `[..., dim]` fp32 or None -> (`forward(r)` in the weight's dtype,
        r fp32). inplace=True writes r into `residual` and returns it (ignored when residual is None).
        """
        return add_rms_norm(x, residual, self.weight, self.eps, inplace=inplace)


class GatedRMSNorm(nn.Module):
    """Gated RMSNorm over groups of `group_size` channels.

    norm_before_gate=False (Mamba-2): rmsnorm(x * silu(gate)) * w.
    norm_before_gate=True (GKA, FLA's FusedRMSNormGated): rmsnorm(x) * w * silu(gate).
    """

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5, norm_before_gate: bool = False) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"group_size {group_size} must divide dim {dim}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: `[..., dim]` -> `[..., dim]` in the weight's dtype."""
        return gated_rms_norm(x, gate, self.weight, self.group_size, self.eps, self.norm_before_gate)
