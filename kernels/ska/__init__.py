"""Spectral Koopman Attention (Echo): chunk-causal / prefix-mode extend and the single-token decode step."""

from kvfree.kernels.ska.reference import (
    SKAState,
    cholesky_fallback_count,
    power_iteration_sigma,
    robust_cholesky,
    ska_chunked,
    ska_empty_state,
    ska_prefix,
    ska_readout,
    ska_step,
)

__all__ = [
    "SKAState",
    "cholesky_fallback_count",
    "power_iteration_sigma",
    "robust_cholesky",
    "ska_chunked",
    "ska_empty_state",
    "ska_prefix",
    "ska_readout",
    "ska_step",
]
