"""Causal depthwise conv1d over a token stream that continues from a saved tail.

The tail holds the last `K - 1` inputs a session has seen, so a prompt can be fed in any number of pieces
(prefill chunks or single decode tokens) and give the same result as feeding it whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tail: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of `x` continuing from `tail`.

    Args:
        x: `[B, T, C]` new inputs.
        weight: `[C, K]` one filter per channel; `weight[:, -1]` multiplies the current token.
        bias: `[C]` or None.
        tail: `[B, K-1, C]` the previous `K-1` inputs (zeros for a new session).

    Returns:
        y: `[B, T, C]` the convolution (no activation), in x's dtype.
        new_tail: `[B, K-1, C]` the last `K-1` inputs, to pass to the next call.
    """
    B, T, C = x.shape
    K = weight.shape[1]
    full = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, T+K-1, C]
    y = F.conv1d(full.transpose(1, 2), weight.to(x.dtype).unsqueeze(1), bias, groups=C)  # [B, C, T]
    new_tail = full[:, full.shape[1] - (K - 1) :] if K > 1 else full[:, :0]
    return y.transpose(1, 2), new_tail
