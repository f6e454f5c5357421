"""RMS norms shared by every layer kind."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled by a learned weight: x / rms(x) * w."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[..., dim]` -> `[..., dim]` in the weight's dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(self.weight.dtype)


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
        xf, gf = x.float(), F.silu(gate.float())
        if not self.norm_before_gate:
            xf = xf * gf
        grouped = xf.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight.float() * grouped.flatten(-2)
        if self.norm_before_gate:
            out = out * gf
        return out.to(self.weight.dtype)
