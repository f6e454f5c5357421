"""Causal (grouped-query, optionally sliding-window) attention with rotary position embeddings."""

from kvfree.kernels.attention.reference import apply_rope, attend

__all__ = ["apply_rope", "attend"]
