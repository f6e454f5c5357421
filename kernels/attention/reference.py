"""Reference attention: RoPE and masked grouped-query attention over explicit key positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfree.kernels.common import state_math


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate `x` by its absolute positions (the "rotate half" layout of Llama / HF).

    x: `[..., T, H, D]` with D even; positions: `[T]` int. Returns a tensor like x.
    """
    D = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., : D // 2], xf[..., D // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


@state_math
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention with a boolean mask, grouped-query aware.

    Runs through `F.scaled_dot_product_attention`, so on a GPU the T x S score matrix is never materialised
    (a 128K-token prefill chunk would otherwise need gigabytes of fp32 scores); softmax accumulates in fp32.

    Args:
        q: `[B, T, Hq, D]`;  k, v: `[B, S, Hkv, D]` with Hkv dividing Hq;
        mask: `[B, T, S]` True where query t may attend key s (every row must allow at least one key).

    Returns:
        `[B, T, Hq, D]` in q's dtype.
    """
    Hq, Hkv = q.shape[2], k.shape[2]
    dtype = q.dtype
    k, v = k.to(dtype), v.to(dtype)
    if Hq != Hkv:  # grouped-query: each KV head serves Hq / Hkv query heads (no copy when they are equal)
        k, v = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
    )
    return out.transpose(1, 2)
