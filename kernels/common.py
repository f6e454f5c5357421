"""Pieces every op's reference shares."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def state_math(fn: F) -> F:
    """Run an op with autocast off, so its fp32 state math stays fp32 under bf16 autocast (GPU training).

    CUDA autocast runs every matmul and einsum in bf16, fp32 inputs included; recurrent states then drift (GKA's H,
    Lattice's S) or mixed-dtype solves fail (SKA's Cholesky). Ops cast their inputs to fp32 themselves.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        with torch.autocast(device, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
