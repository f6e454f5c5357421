"""RMS norms (plain, fused residual add, gated): one Triton kernel each on a GPU, the PyTorch reference elsewhere.

`rms_norm`, `add_rms_norm` and `gated_rms_norm` run the Triton kernels of `fused.py` when
`kvfree.kernels.dispatch.use_triton` says so (`KVFREE_KERNELS`), the tensors are fp32/bf16/fp16, the row (group) fits
one block (`fused.MAX_D`), and no gradient is needed: the kernels have no backward, so training (autograd on, a
tensor requiring grad) always takes the reference of `reference.py`, whose numbers are those the layers always had.
"""

from __future__ import annotations

import torch

from ..dispatch import use_triton
from . import reference

__all__ = ["add_rms_norm", "gated_rms_norm", "rms_norm"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fused.DTYPES, without importing triton here
_MAX_D = 8192  # fused.MAX_D


def _fast(width: int, *tensors: torch.Tensor | None) -> bool:
    """Whether the Triton kernels take these tensors (checked without importing triton on the reference path)."""
    ts = [t for t in tensors if t is not None]
    if not use_triton(ts[0].device):  # first, so a bad KVFREE_KERNELS raises whatever the inputs
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False  # no backward in the kernels
    return width <= _MAX_D and all(t.dtype in _KERNEL_DTYPES for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: `(x / rms(x)).to(weight.dtype) * weight`, fp32 math.

    Args:
        x: `[..., D]` bf16/fp16/fp32 (rows may be strided).  weight: `[D]`.  eps: added to the mean square.

    Returns:
        y: `[..., D]` in weight's dtype.
    """
    if _fast(x.shape[-1], x, weight):
        from .fused import rms_norm as impl

        return impl(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *, inplace: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step (vLLM's `fused_add_rms_norm`): `r = residual + x.float()`, `y = rms_norm(r)`.

    Args:
        x: `[..., D]` bf16/fp16/fp32, the previous block's output (or the embedding, when residual is None).
        residual: `[..., D]` fp32 residual stream, or None (then `r = x.float()`, never x itself).
        weight: `[D]`.  eps: added to the mean square.
        inplace: write r into `residual` (fp32) and return it, instead of a new tensor; ignored when residual is None.

    Returns:
        (y `[..., D]` in weight's dtype, r `[..., D]` fp32).
    """
    if _fast(x.shape[-1], x, residual, weight):
        from .fused import add_rms_norm as impl

        return impl(x, residual, weight, eps, inplace=inplace)
    return reference.add_rms_norm(x, residual, weight, eps, inplace=inplace)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Gated RMSNorm over groups of `group_size` channels, fp32 math.

    norm_before_gate=False (Mamba-2): `rmsnorm_g(x * silu(gate)) * w`; True (GKA): `rmsnorm_g(x) * w * silu(gate)`.

    Args:
        x, gate: `[..., D]` bf16/fp16/fp32 (rows may be strided), D a multiple of group_size.
        weight: `[D]`.  eps: added to the mean square.

    Returns:
        y: `[..., D]` in weight's dtype.
    """
    if gate.shape == x.shape and _fast(group_size, x, gate, weight):
        from .fused import gated_rms_norm as impl

        return impl(x, gate, weight, group_size, eps, norm_before_gate)
    return reference.gated_rms_norm(x, gate, weight, group_size, eps, norm_before_gate)
