"""Pieces every op's reference shares."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
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


def work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """A reference's state-math dtype: fp32, or fp64 when any of `tensors` is fp64 (the tests' float64 runs)."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def to_chunks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """`[B, T, H, *rest]` -> `[B, H, nc, chunk, *rest]`, zero-padding T up to a multiple of `chunk`."""
    B, T = x.shape[:2]
    pad = (-T) % chunk
    x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.view(B, (T + pad) // chunk, chunk, *x.shape[2:]).movedim(3, 1)


def cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` of ints, as `triton.cdiv`, in plain Python: Triton's is a constexpr function whose call from the
    host costs a few microseconds (its arguments unwrapped), a third of a small op's host work when a wrapper makes
    three such calls."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as `triton.next_power_of_2`, in plain Python (see `cdiv`)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (asked once per device: decode ops size their grids by it every layer of every
    step); 8 off CUDA (the interpreter), so that grid heuristics still take a path."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def output_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate an output or scratch buffer of a Triton op (uninitialised: the kernel writes every element).

    Every Triton wrapper allocates through this one function, called as `common.output_buffer`, so that a test can
    replace it and poison every allocation with NaN, proving that nothing is read before it is written.
    """
    return torch.empty(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Within this block every buffer a Triton op allocates starts as NaN (integer buffers as their minimum), so an
    element a kernel forgot to write shows up in the result (the device scripts' correctness checks)."""
    global output_buffer
    saved = output_buffer

    def nan_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min  # integers: a value no op writes
        return torch.full(shape, fill, dtype=dtype, device=device)

    output_buffer = nan_buffer
    try:
        yield
    finally:
        output_buffer = saved
