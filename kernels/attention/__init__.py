"""Causal (grouped-query, optionally sliding-window) attention with rotary position embeddings.

`chunk_attention` (packed variable-length prefill) and `fused_recurrent_attention` (one decode token per session)
read and write each session's KV cache and length in place in a pool, addressed by slot; `window` turns the cache
into a ring and the attention into a sliding window. `apply_rope` and `attend` are the plain math. Decode attends
with a Triton kernel on a GPU (decode.py: the cache rows read in place, flash-decoding splits; the PyTorch reference
beside it in reference.py); the rest of both ops, and prefill, run their PyTorch references on every device.
"""

from kvfree.kernels.attention.reference import (
    KVCacheFull,
    apply_rope,
    attend,
    chunk_attention,
    fused_recurrent_attention,
)

__all__ = ["KVCacheFull", "apply_rope", "attend", "chunk_attention", "fused_recurrent_attention"]
