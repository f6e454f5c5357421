"""Host values to the device without making the host wait: pinned staging and an asynchronous copy.

A copy from ordinary (pageable) host memory to the GPU, `torch.tensor(values).to("cuda", non_blocking=True)`, is not
asynchronous: the driver stages it through its own buffer and the host waits for the device's queue to reach it.
Between the launch of a step and the read of its tokens the host must never wait, or the next step's host work no
longer overlaps the device's (engine/core/stepper.py). A copy from pinned memory is a true DMA queued on the stream;
PyTorch's caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a `[len(values)]` tensor of `dtype` on `device`, copied asynchronously on a GPU."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def upload_into(dst: torch.Tensor, values: Sequence[int]) -> None:
    """Copy `values` into `dst` (`[len(values)]`, on any device; a CUDA graph's static input, say), asynchronously
    from pinned memory on a GPU."""
    host = torch.tensor(values, dtype=dst.dtype, pin_memory=dst.device.type == "cuda")
    dst.copy_(host, non_blocking=True)


def upload_tensor(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, through pinned memory on a GPU (the same tensor on the CPU)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
