"""Causal (grouped-query, optionally sliding-window) attention with rotary position embeddings.

`chunk_attention` (packed variable-length prefill) and `fused_recurrent_attention` (one decode token per session)
read and write each session's KV cache and length in place in a pool, addressed by slot; `window` turns the cache
into a ring and the attention into a sliding window. `apply_rope` and `attend` are the plain math. Each op is its
PyTorch reference (reference.py, the spec) and runs its Triton implementation on a GPU, dispatched by
`kvfree.kernels.dispatch.Op`: decode in fused_recurrent.py (the cache rows read in place, flash-decoding splits, no
read on the host), prefill in chunk.py (flash attention over the cached past read in place, then the new tokens),
whose loop over key blocks (online_softmax.py) B'MOJO-F's banded prefill shares.
"""

import torch

from kvfree.kernels.attention import reference
from kvfree.kernels.attention.reference import FP8, KVCacheFull, apply_rope, attend
from kvfree.kernels.dispatch import Op

__all__ = [
    "FP8", "KVCacheFull", "apply_rope", "attend", "chunk_attention", "decode_graph_safe", "fused_recurrent_attention",
]  # fmt: skip

def _kernel_dtype(dtype: torch.dtype) -> bool:
    """fp64 runs are the reference's (the oracle); the kernel takes every other activation dtype."""
    return dtype != torch.float64


def _prefill_takes(q: torch.Tensor, *args, **kwargs) -> bool:
    """The prefill kernel reads a cache in the activations' dtype or in fp8 (the two the engine makes)."""
    k_cache = args[2] if len(args) > 2 else kwargs["k_cache"]
    return _kernel_dtype(q.dtype) and k_cache.dtype in (q.dtype, FP8)


chunk_attention = Op(reference.chunk_attention, "attention.chunk:chunk_attention", takes=_prefill_takes)

fused_recurrent_attention = Op(
    reference.fused_recurrent_attention, "attention.fused_recurrent:fused_recurrent_attention",
    takes=lambda q, *args, **kwargs: _kernel_dtype(q.dtype),
)  # fmt: skip


def decode_graph_safe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `fused_recurrent_attention` on `dtype` activations on `device` runs without a host sync (its Triton
    implementation), so that a decode step may be captured in a CUDA graph."""
    return fused_recurrent_attention.device_check(device) and _kernel_dtype(dtype)
