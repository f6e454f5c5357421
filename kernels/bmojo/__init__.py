"""B'MOJO memory math (docs/design/bmojo.md §3): innovation score, bounded eidetic top-m store, chunked
memory attention for prefill/forward. The fading-memory SSM itself is kernels/mamba2."""

from kvfree.kernels.bmojo.reference import chunked_memory_attention, eidetic_update, innovation, topm_index

__all__ = ["chunked_memory_attention", "eidetic_update", "innovation", "topm_index"]
