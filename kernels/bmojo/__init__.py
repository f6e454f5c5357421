"""B'MOJO memory (docs/design/bmojo.md §3): innovation score, bounded eidetic top-m store, chunked memory attention,
and the serving ops over the memory state in a pool. The fading-memory SSM itself is kernels/mamba2.

`chunk_bmojo` (packed variable-length prefill) and `fused_recurrent_bmojo` (one decode token per session) read and
write the `MemoryState` tensors in place in pool rows addressed by slot. They have no Triton kernel yet (planned,
bmojo.md §9), so the PyTorch references serve every device. `bmojo_chunked` is the differentiable math on a batch of
sequences with explicit states (the training forward).
"""

from kvfree.kernels.bmojo.reference import (
    FadingKV,
    MemoryState,
    bmojo_chunked,
    chunk_bmojo,
    chunked_memory_attention,
    eidetic_update,
    fused_recurrent_bmojo,
    innovation,
    topm_index,
)

__all__ = [
    "FadingKV",
    "MemoryState",
    "bmojo_chunked",
    "chunk_bmojo",
    "chunked_memory_attention",
    "eidetic_update",
    "fused_recurrent_bmojo",
    "innovation",
    "topm_index",
]
