"""The one place that picks an op's implementation (PyTorch reference or Triton), plus host-side varlen metadata.

`KVFREE_KERNELS` chooses: `reference` (always the PyTorch reference), `triton` (always Triton; on the CPU only under
the Triton interpreter, `TRITON_INTERPRET=1`), or `auto` (the default: Triton on CUDA devices when it imports).
Triton is imported lazily, so kvfree imports and runs where it is not installed.
"""

from __future__ import annotations

import functools
import os

import torch

MODES = ("reference", "triton", "auto")


@functools.cache
def triton_available() -> bool:
    """Whether `import triton` works here (checked once)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else at import
        return False
    return True


def kernel_mode() -> str:
    """The `KVFREE_KERNELS` setting, validated; unset or empty means `auto`."""
    mode = os.environ.get("KVFREE_KERNELS", "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"KVFREE_KERNELS={os.environ['KVFREE_KERNELS']!r}: expected one of {', '.join(MODES)}")
    return mode


def use_triton(device: torch.device) -> bool:
    """Whether ops on tensors of `device` should run their Triton kernels (True) or the PyTorch reference (False).

    Raises ValueError for an unknown `KVFREE_KERNELS`, and RuntimeError when `KVFREE_KERNELS=triton` asks for Triton
    on a non-CUDA device without the interpreter, or where triton does not import.
    """
    mode = kernel_mode()
    if mode == "reference":
        return False
    device = torch.device(device)
    if mode == "auto":
        return device.type == "cuda" and triton_available()
    if not triton_available():
        raise RuntimeError("KVFREE_KERNELS=triton but triton does not import; install it or use KVFREE_KERNELS=auto")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise RuntimeError(
            f"KVFREE_KERNELS=triton on a {device.type} device needs the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is imported (or use KVFREE_KERNELS=auto/reference)"
        )
    return True


def host_cu_seqlens(
    cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | list[int] | None, total: int
) -> tuple[int, ...]:
    """The sequence boundaries as a host tuple, checked to start at 0, never decrease and end at `total` tokens.

    Copies `cu_seqlens` to the host (a device sync) only when no host copy is given.
    """
    src = cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu
    cu = tuple(src.detach().to("cpu", torch.int64).tolist()) if isinstance(src, torch.Tensor) else tuple(map(int, src))
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={total} over N+1 >= 2 entries, got {list(cu)[:8]}...")
    return cu


@functools.lru_cache(maxsize=64)
def _chunk_metadata(cu: tuple[int, ...], chunk: int, device: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    counts = [-(-n // chunk) for n in lens]
    pairs = [(i, j) for i, c in enumerate(counts) for j in range(c)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    host = torch.tensor([v for p in pairs for v in p] + offsets, dtype=torch.int32)
    on_gpu = torch.device(device).type == "cuda"
    # Pinned and asynchronous on a GPU: no wait for the work already queued on the stream.
    dev = host.pin_memory().to(device, non_blocking=True) if on_gpu else host.to(device)
    return dev[: 2 * len(pairs)].view(-1, 2), dev[2 * len(pairs) :], len(pairs)


def chunk_metadata(cu: tuple[int, ...], chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Varlen chunk indices that never cross a sequence boundary (cached per boundaries, chunk size and device).

    Returns (`indices` `[NC, 2]` int32: (sequence, chunk within it) per global chunk, `offsets` `[N+1]` int32: the
    global index of each sequence's first chunk, `NC`). An empty sequence has no chunks.
    """
    return _chunk_metadata(cu, int(chunk), str(torch.device(device)))


def varlen_positions(
    cu: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """For the references: each packed token's sequence and position in it, and the sequences' lengths.

    Returns (`seq` `[T]` int64, `pos` `[T]` int64, `lens` `[N]` int64, longest length), so that a right-padded
    batch `[N, Tmax, ...]` is filled by `padded[seq, pos] = packed` and read back by `padded[seq, pos]`.
    """
    lens = torch.tensor([cu[i + 1] - cu[i] for i in range(len(cu) - 1)], dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
    pos = torch.arange(cu[-1]) - torch.tensor(cu[:-1], dtype=torch.int64)[seq]
    longest = int(lens.max()) if len(lens) else 0
    return seq.to(device), pos.to(device), lens.to(device), longest
