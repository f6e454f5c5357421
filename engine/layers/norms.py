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
    """RMSNorm of `x * silu(gate)`, normalised over groups of `group_size` channels (Mamba-2's output norm)."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"group_size {group_size} must divide dim {dim}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: `[..., dim]` -> `[..., dim]` in the weight's dtype."""
        xf = x.float() * F.silu(gate.float())
        grouped = xf.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.flatten(-2).to(self.weight.dtype)
