"""The one place that picks an op's implementation (PyTorch reference or Triton), plus varlen chunk metadata.

`KVFREE_KERNELS` chooses: `reference` (always the PyTorch reference), `triton` (always Triton; on the CPU only under
the Triton interpreter, `TRITON_INTERPRET=1`), or `auto` (the default: Triton on CUDA devices when it imports).
Triton is imported lazily, so kvfree imports and runs where it is not installed.

An op is written once: its PyTorch reference is the spec (signature, docstring, shapes), and `Op` makes the public
function from it, naming the Triton implementation beside it and the inputs that kernel takes.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    return _parse_mode(os.environ.get("KVFREE_KERNELS", ""))


@functools.lru_cache(maxsize=8)
def _parse_mode(raw: str) -> str:
    # Cached by the raw value: every op asks on every call, and the variable may change between calls (tests).
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"KVFREE_KERNELS={raw!r}: expected one of {', '.join(MODES)}")
    return mode


def use_triton(device: torch.device) -> bool:
    """Whether ops on tensors of `device` should run their Triton kernels (True) or the PyTorch reference (False).

    Raises ValueError for an unknown `KVFREE_KERNELS`, and RuntimeError when `KVFREE_KERNELS=triton` asks for Triton
    on a non-CUDA device without the interpreter, or where triton does not import.
    """
    mode = kernel_mode()
    if mode == "reference":
        return False
    if not isinstance(device, torch.device):
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


class Op:
    """An op: its PyTorch `reference` (the spec: the public signature and docstring are the reference's), and the
    Triton implementation that runs in its place where `use_triton` says so for the device of the op's first argument
    and `takes(*args, **kwargs)` accepts the inputs (a dtype or shape the kernel has no form for runs the reference).

    `triton` names the implementation, `"module:function"` relative to `kvfree.kernels` (imported on the first call
    that runs it: Triton may be absent). Both are looked up in their modules on every call (two attribute reads), so
    that a test may replace either; `device_check` (default `use_triton`) may be replaced to force one op's kernel on.
    `op.runs_triton(*args, **kwargs)` says which one a call would run. Before any call, an op package's
    `decode_graph_safe` answers the same for a decode step (its Triton path reads nothing on the host, so the step can
    be captured in a CUDA graph); it asks the op's `device_check`, so a forced kernel counts there too.
    """

    def __init__(self, reference: Callable[..., Any], triton: str, takes: Callable[..., bool] | None = None) -> None:
        functools.update_wrapper(self, reference)
        self._reference_module = importlib.import_module(reference.__module__)
        self._triton_module_name, self._name = triton.split(":")
        self._reference_name = reference.__name__
        self._takes = takes
        self._triton_module: Any = None
        self.device_check: Callable[[torch.device], bool] = use_triton

    @property
    def reference(self) -> Callable[..., Any]:
        """The PyTorch reference."""
        return getattr(self._reference_module, self._reference_name)

    @property
    def triton(self) -> Callable[..., Any]:
        """The Triton implementation (its module imported on first use)."""
        if self._triton_module is None:
            self._triton_module = importlib.import_module(f"kvfree.kernels.{self._triton_module_name}")
        return getattr(self._triton_module, self._name)

    def runs_triton(self, *args: Any, **kwargs: Any) -> bool:
        """Whether a call with these arguments runs the Triton implementation."""
        return self.device_check(args[0].device) and (self._takes is None or self._takes(*args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        impl = self.triton if self.runs_triton(*args, **kwargs) else self.reference
        return impl(*args, **kwargs)


def host_cu_seqlens(
    cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...] | None, total: int
) -> tuple[int, ...]:
    """The sequence boundaries as a host tuple, checked to start at 0, never decrease and end at `total` tokens.

    Copies `cu_seqlens` to the host (a device sync) only when no host copy is given. A tuple of ints (what
    `StepBatch.cu_seqlens_cpu` holds) is checked once and then served from a cache: every layer of a step asks.
    """
    if type(cu_seqlens_cpu) is tuple:
        return _checked_cu_seqlens(cu_seqlens_cpu, total)
    src = cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu
    cu = tuple(src.detach().to("cpu", torch.int64).tolist()) if isinstance(src, torch.Tensor) else tuple(map(int, src))
    return _checked_cu_seqlens(cu, total)


@functools.lru_cache(maxsize=64)
def _checked_cu_seqlens(cu: tuple[int, ...], total: int) -> tuple[int, ...]:
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={total} over N+1 >= 2 entries, got {list(cu)[:8]}...")
    if any(type(c) is not int for c in cu):
        cu = tuple(map(int, cu))
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


def device_chunk_metadata(
    cu_seqlens: torch.Tensor, chunk: int, total: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`chunk_metadata` computed on the device from `cu_seqlens`, never read back to the host (capturable in a CUDA
    graph), its size bounded by what the host knows: T tokens and N sequences give at most
    `NC_max = (T + N (chunk - 1)) // chunk` chunks (each sequence wastes less than one chunk; empty ones none).

    Args:
        cu_seqlens: `[N+1]` int32 on the device, rising from 0 to `total` (not checked: that would need a sync).
        chunk: tokens per chunk.  total: T.

    Returns:
        (`indices` `[NC_max, 2]` int32: (sequence, chunk within it) per global chunk, `(-1, 0)` past the real count,
        which kernels skip; `offsets` `[N+1]` int32: each sequence's first global chunk, `offsets[N]` the real
        count; `NC_max`).
    """
    n = cu_seqlens.shape[0] - 1
    bound = (total + n * (chunk - 1)) // chunk
    counts = (cu_seqlens[1:] - cu_seqlens[:-1] + (chunk - 1)) // chunk
    ends = torch.cumsum(counts, 0, dtype=torch.int32)  # [N] one past each sequence's last chunk
    offsets = torch.nn.functional.pad(ends, (1, 0))
    c = torch.arange(bound, dtype=torch.int32, device=cu_seqlens.device)
    # The sequence that holds chunk c: the first whose end is past c (empty sequences end where they start). Chunks
    # past the real count find none (N).
    seq = torch.searchsorted(ends, c, right=True, out_int32=True)
    real = seq < n
    local = c - offsets[seq.clamp(max=n - 1)]
    indices = torch.stack([torch.where(real, seq, -1), torch.where(real, local, 0)], dim=1)
    return indices, offsets, bound


class DeviceChunks:
    """The boundaries of a step's sequences as the device knows them, for ops that must not read them on the host
    (a prefill step captured in a CUDA graph replays with new boundaries each time).

    Each op asks `get(chunk)` with its own chunk size; the metadata is computed on the device on the first request
    for a size and shared by every later one (every layer of the step asks with the same sizes). One instance per
    step (or per capture): cached tensors computed in one graph are not recomputed by another.

    Args:
        cu_seqlens: `[N+1]` int32 on the device.  total: T, the packed token count (`x.shape[0]` of the ops).
    """

    def __init__(self, cu_seqlens: torch.Tensor, total: int) -> None:
        self.cu_seqlens = cu_seqlens
        self.total = total
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def get(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`device_chunk_metadata(cu_seqlens, chunk, total)`, computed once per chunk size."""
        meta = self._cache.get(chunk)
        if meta is None:
            meta = self._cache[chunk] = device_chunk_metadata(self.cu_seqlens, chunk, self.total)
        return meta

    def check(self, cu_seqlens: torch.Tensor, total: int) -> None:
        """Raise ValueError unless these are the boundaries (same tensor) and token count this object describes."""
        same = cu_seqlens.data_ptr() == self.cu_seqlens.data_ptr() and cu_seqlens.shape == self.cu_seqlens.shape
        if not same or total != self.total:
            raise ValueError(
                f"device_chunks describe {self.total} tokens over cu_seqlens {tuple(self.cu_seqlens.shape)} at "
                f"{self.cu_seqlens.data_ptr():#x}, the op got {total} over {tuple(cu_seqlens.shape)} at "
                f"{cu_seqlens.data_ptr():#x}"
            )


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


@dataclass(frozen=True)
class PaddedGroup:
    """Sequences of a packed batch that one right-padded `[n, longest, ...]` call of a reference op serves.

    seqs: `[n]` which sequences (indices into `cu_seqlens`' sequences, e.g. rows of `state_indices`).
    tokens: `[t]` their tokens' indices on the packed axis; seq, pos: `[t]` each token's row and position in the
    padded batch; lens: `[n]` their lengths; longest: the padded length; span: `(start, end)` on the packed axis
    when the members are consecutive and of equal length, so that padding is a free view.
    """

    seqs: torch.Tensor
    tokens: torch.Tensor
    seq: torch.Tensor
    pos: torch.Tensor
    lens: torch.Tensor
    longest: int
    span: tuple[int, int] | None

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` packed -> `[n, longest, ...]`, zeros after each sequence's end."""
        if self.span is not None:
            return packed[self.span[0] : self.span[1]].unflatten(0, (len(self.seqs), self.longest))
        out = packed.new_zeros(len(self.seqs), self.longest, *packed.shape[1:])
        out[self.seq, self.pos] = packed[self.tokens]
        return out

    def scatter(self, padded: torch.Tensor, packed: torch.Tensor) -> None:
        """Write the real rows of `padded` `[n, longest, ...]` back into `packed` `[T, ...]`."""
        if self.span is not None:
            packed[self.span[0] : self.span[1]] = padded.flatten(0, 1)
        else:
            packed[self.tokens] = padded[self.seq, self.pos].to(packed.dtype)


def padded_groups(
    cu: tuple[int, ...], device: torch.device, max_waste: float = 1.25, slack: int = 64
) -> list[PaddedGroup]:
    """Group the sequences of a packed batch for batched reference calls of an op whose cost is linear in tokens.

    Longest first, a group grows while its padded size (members x longest) stays within `max_waste` times its real
    tokens plus `slack`: equal lengths always share a call, and one long prompt beside short ones does not make
    every short one pay its length (the CPU path would then be slower than one call per sequence). Sequences of
    length 0 are left out.
    """
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    groups: list[list[int]] = []
    for i in sorted((i for i in range(len(lens)) if lens[i]), key=lambda i: -lens[i]):
        if groups:
            group = groups[-1]
            padded = (len(group) + 1) * lens[group[0]]
            if padded <= max_waste * (sum(lens[j] for j in group) + lens[i]) + slack:
                group.append(i)
                continue
        groups.append([i])
    out = []
    for group in groups:
        group = sorted(group) if all(lens[i] == lens[group[0]] for i in group) else group
        consecutive = group == list(range(group[0], group[0] + len(group)))
        # Equal lengths in packed order: the padded batch is a view of the packed tensor.
        span = (cu[group[0]], cu[group[-1] + 1]) if consecutive and lens[group[0]] == lens[group[-1]] else None
        glens = torch.tensor([lens[i] for i in group], dtype=torch.int64)
        seq = torch.repeat_interleave(torch.arange(len(group)), glens)
        starts = torch.tensor([cu[i] for i in group], dtype=torch.int64)
        pos = torch.arange(int(glens.sum())) - (torch.cumsum(glens, 0) - glens)[seq]
        out.append(
            PaddedGroup(
                seqs=torch.tensor(group, device=device),
                tokens=(starts[seq] + pos).to(device),
                seq=seq.to(device),
                pos=pos.to(device),
                lens=glens.to(device),
                longest=max(lens[i] for i in group),
                span=span,
            )
        )
    return out
