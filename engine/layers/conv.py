"""Short causal depthwise convolution whose tail lives in the session state."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvfree.kernels.conv import causal_conv1d


class ShortConv(nn.Module):
    """Depthwise causal conv1d over channels with a kernel of K taps; the last K-1 inputs are session state."""

    def __init__(self, channels: int, kernel: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.kernel = kernel
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.kernel)  # nn.Conv1d's default for a depthwise filter
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: `[B, T, C]`, tail: `[B, K-1, C]` -> (y `[B, T, C]`, new tail `[B, K-1, C]`)."""
        return causal_conv1d(x, self.weight, self.bias, tail)
