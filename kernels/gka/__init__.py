"""Gated KalmaNet: chunk-wise Chebyshev prefill and single-step decode (docs/design/gka.md)."""

from kvfree.kernels.gka.reference import chebyshev_solve, gka_chunked, gka_step, omega_schedule

__all__ = ["chebyshev_solve", "gka_chunked", "gka_step", "omega_schedule"]
