"""Lattice (orthogonal-update memory slots): exact recurrent prefill and single-step decode."""

from kvfree.kernels.lattice.reference import (
    VARIANTS,
    lattice_recurrent,
    lattice_step,
    lattice_unnormalised_update,
    orthonormal_columns,
)

__all__ = ["VARIANTS", "lattice_recurrent", "lattice_step", "lattice_unnormalised_update", "orthonormal_columns"]
