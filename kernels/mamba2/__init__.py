"""Mamba-2 state-space duality (SSD): chunked prefill and single-step decode."""

from kvfree.kernels.mamba2.reference import ssd_chunked, ssd_step

__all__ = ["ssd_chunked", "ssd_step"]
