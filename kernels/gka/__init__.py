"""Gated KalmaNet: chunk-wise Chebyshev prefill and single-step decode (docs/design/gka.md).

`chunk_gka` (packed variable-length prefill) and `fused_recurrent_gka` (one decode step) read and write the
per-session states H and S in place in their pools, addressed by slot. `gka_chunked` and `gka_step` are the plain math
on batches of equal-length sequences. The Triton kernels (and their `use_triton` dispatch) come in a later issue;
until then the public ops are the PyTorch references.
"""

from kvfree.kernels.gka.reference import (
    chebyshev_solve,
    chunk_gka,
    fused_recurrent_gka,
    gka_chunked,
    gka_step,
    omega_schedule,
)

__all__ = ["chebyshev_solve", "chunk_gka", "fused_recurrent_gka", "gka_chunked", "gka_step", "omega_schedule"]
