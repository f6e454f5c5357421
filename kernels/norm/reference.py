"""RMS norms in PyTorch: the CPU path, the autograd path, and the oracle of the Triton kernels in `fused.py`.

The math is exactly that of `engine/model/layers/norms.py` before the kernels existed (same ops, same order, same
casts), so
the reference path gives the same numbers bit for bit. Inputs are upcast to fp32 (`.float()`), except float64, which
stays float64: called with float64 tensors, these functions are the float64 oracle of the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _up(t: torch.Tensor) -> torch.Tensor:
    """`t.float()`, except that float64 stays float64 (the oracle); identical to `.float()` for every other dtype."""
    return t if t.dtype == torch.float64 else t.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: `(x / rms(x)).to(weight.dtype) * weight`.

    Args:
        x: `[..., D]` any float dtype; normalised in fp32.
        weight: `[D]`.
        eps: added to the mean square.

    Returns:
        y: `[..., D]` in weight's dtype. The normalised value is cast to weight's dtype *before* the multiplication
        (so with bf16 weights the product is a bf16 product), as the layer always did.
    """
    xf = _up(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step (vLLM's `fused_add_rms_norm`): `r = residual + x`, then `rms_norm(r)`.

    Args:
        x: `[..., D]` bf16/fp16/fp32, the block's output delta (or the embedding, when residual is None).
        residual: `[..., D]` fp32 residual stream, or None (then `r = x.float()`).
        weight: `[D]`.  eps: added to the mean square.
        inplace: write `r` into `residual` (which must then have r's dtype) and return it; ignored when residual is
            None. Either way `r` is never `x` itself.

    Returns:
        (y `[..., D]` in weight's dtype, r `[..., D]` fp32 — float64 for float64 inputs).
    """
    if residual is None:
        r = _up(x)
        if r is x:  # fp32 x: `.float()` would return x itself; the residual stream must not alias the input
            r = x.clone()
    elif inplace:
        if residual.dtype != torch.promote_types(residual.dtype, _up(x).dtype):
            raise ValueError(f"inplace add into a {residual.dtype} residual would round the fp32 sum")
        r = residual.add_(_up(x))
    else:
        r = residual + _up(x)
    return rms_norm(r, weight, eps), r


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Gated RMSNorm over groups of `group_size` channels, computed in fp32.

    norm_before_gate=False (Mamba-2): `rmsnorm_g(x * silu(gate)) * w`.
    norm_before_gate=True (GKA, FLA's FusedRMSNormGated): `rmsnorm_g(x) * w * silu(gate)`.

    Args:
        x, gate: `[..., D]` any float dtypes, D a multiple of group_size.
        weight: `[D]`.  group_size: channels normalised together.  eps: added to the mean square.

    Returns:
        y: `[..., D]` in weight's dtype (cast once, at the end).
    """
    xf, gf = _up(x), F.silu(_up(gate))
    if not norm_before_gate:
        xf = xf * gf
    grouped = xf.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = _up(weight) * grouped.flatten(-2)
    if norm_before_gate:
        out = out * gf
    return out.to(weight.dtype)
