"""RMS norms (plain, fused residual add, gated): one Triton kernel each on a GPU, the PyTorch reference elsewhere.

`rms_norm`, `add_rms_norm` and `gated_rms_norm` are their PyTorch references (reference.py, the spec), running the
Triton kernels of `fused.py` instead (`kvfree.kernels.dispatch.Op`) when `KVFREE_KERNELS` says so, the tensors are
fp32/bf16/fp16, the row (group) fits one block (`fused.MAX_D`), and no gradient is needed: the kernels have no backward,
so training (autograd on, a tensor requiring grad) always takes the reference of `reference.py`, whose numbers are those
the layers always had.
"""

from __future__ import annotations

import torch

from ..dispatch import Op
from . import reference

__all__ = ["add_rms_norm", "gated_rms_norm", "rms_norm"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fused.DTYPES, without importing triton here
_MAX_D = 8192  # fused.MAX_D


def _fits(width: int, *tensors: torch.Tensor | None) -> bool:
    """Whether the Triton kernels take these tensors: no autograd (the kernels have no backward), a row (group) of at
    most _MAX_D, fp32/bf16/fp16."""
    ts = [t for t in tensors if t is not None]
    if torch.is_grad_enabled() and any(t.requires_grad for t in ts):
        return False
    return width <= _MAX_D and all(t.dtype in _KERNEL_DTYPES for t in ts)


rms_norm = Op(reference.rms_norm, "norm.fused:rms_norm", takes=lambda x, weight, eps: _fits(x.shape[-1], x, weight))
add_rms_norm = Op(
    reference.add_rms_norm, "norm.fused:add_rms_norm",
    takes=lambda x, residual, weight, eps, **kw: _fits(x.shape[-1], x, residual, weight),
)  # fmt: skip
gated_rms_norm = Op(
    reference.gated_rms_norm, "norm.fused:gated_rms_norm",
    takes=lambda x, gate, weight, group_size, *a, **kw: gate.shape == x.shape and _fits(group_size, x, gate, weight),
)  # fmt: skip
