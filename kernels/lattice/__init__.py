"""Lattice (orthogonal-update memory slots): exact recurrent prefill and single-step decode on a state pool.

`chunk_lattice` (packed variable-length prefill) and `fused_recurrent_lattice` (one decode token per session) read
and write the per-session states in place in a pool, addressed by slot; `chunk_lattice_qk_conv` and
`fused_recurrent_lattice_qk_conv` run the layer's two short convs from the one shared conv tail. They are the PyTorch
references for now (the convs inside dispatch through `kvfree.kernels.conv`); the Triton recurrence comes in a later
issue and will be chosen here by `kvfree.kernels.dispatch.use_triton`, as the other ops do. `lattice_recurrent` and
`lattice_step` are the plain math on batches of equal-length sequences.
"""

from kvfree.kernels.lattice.reference import (
    VARIANTS,
    chunk_lattice,
    chunk_lattice_qk_conv,
    fused_recurrent_lattice,
    fused_recurrent_lattice_qk_conv,
    lattice_recurrent,
    lattice_step,
    lattice_unnormalised_update,
    orthonormal_columns,
)

__all__ = [
    "VARIANTS",
    "chunk_lattice",
    "chunk_lattice_qk_conv",
    "fused_recurrent_lattice",
    "fused_recurrent_lattice_qk_conv",
    "lattice_recurrent",
    "lattice_step",
    "lattice_unnormalised_update",
    "orthonormal_columns",
]
