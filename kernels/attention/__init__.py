"""Causal (grouped-query, optionally sliding-window) attention with rotary position embeddings.

`chunk_attention` (packed variable-length prefill) and `fused_recurrent_attention` (one decode token per session)
read and write each session's KV cache and length in place in a pool, addressed by slot; `window` turns the cache
into a ring and the attention into a sliding window. `apply_rope` and `attend` are the plain math. The ops have no
Triton kernel yet (planned, docs/design/architecture.md §3), so the PyTorch references serve every device.
"""

from kvfree.kernels.attention.reference import (
    KVCacheFull,
    apply_rope,
    attend,
    chunk_attention,
    fused_recurrent_attention,
)

__all__ = ["KVCacheFull", "apply_rope", "attend", "chunk_attention", "fused_recurrent_attention"]
