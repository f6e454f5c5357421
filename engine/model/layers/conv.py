"""Short causal depthwise convolution whose tail lives in the session state."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvfree.engine.model.step_batch import StepBatch
from kvfree.kernels.conv import causal_conv1d, chunk_causal_conv1d, fused_recurrent_causal_conv1d


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
        """Training / whole sequences: x `[B, T, C]`, tail `[B, K-1, C]` -> (y `[B, T, C]`, new tail), no activation."""
        return causal_conv1d(x, self.weight, self.bias, tail)

    def prefill(self, x: torch.Tensor, tails: torch.Tensor, batch: StepBatch, activation: str | None) -> torch.Tensor:
        """Packed tokens x `[T, C]` of `batch`'s sessions -> `[T, C]`; their tails in the pool `[S, K-1, C]` move on."""
        return chunk_causal_conv1d(
            x, tails, batch.state_indices, batch.cu_seqlens, self.weight, self.bias, activation,
            cu_seqlens_cpu=batch.cu_seqlens_cpu, device_chunks=batch.device_chunks,
        )  # fmt: skip

    def decode(self, x: torch.Tensor, tails: torch.Tensor, batch: StepBatch, activation: str | None) -> torch.Tensor:
        """One token per session x `[B, C]` -> `[B, C]`; each session's tail shifts by one token in place."""
        return fused_recurrent_causal_conv1d(x, tails, batch.state_indices, self.weight, self.bias, activation)
