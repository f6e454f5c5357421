"""Spectral Koopman Attention (Echo): chunk-causal / prefix-mode extend and the single-token decode step.

`chunk_ska` (packed variable-length prefill, mode C or P) and `fused_recurrent_ska` (one decode step) read and write
the per-session states in place in a pool, addressed by slot. They are the PyTorch references for now: the Triton
kernels (and their `kvfree.kernels.dispatch.use_triton` switch) come with SKA's kernel issue. `ska_chunked`,
`ska_prefix` and `ska_step` are the plain math on batches of sessions.
"""

from kvfree.kernels.ska.reference import (
    MODES,
    SKAState,
    cholesky_fallback_count,
    chunk_ska,
    fused_recurrent_ska,
    power_iteration_sigma,
    robust_cholesky,
    ska_chunked,
    ska_empty_state,
    ska_prefix,
    ska_readout,
    ska_step,
)

__all__ = [
    "MODES",
    "SKAState",
    "cholesky_fallback_count",
    "chunk_ska",
    "fused_recurrent_ska",
    "power_iteration_sigma",
    "robust_cholesky",
    "ska_chunked",
    "ska_empty_state",
    "ska_prefix",
    "ska_readout",
    "ska_step",
]
