"""The Lattice mixer split by head over two gloo ranks computes what one rank does; what cannot split is refused."""

from __future__ import annotations

import pytest

from kvfree.engine.model.tensor_parallel import TensorParallel
from tests.engine.test_tensor_parallel import assert_two_ranks_match_one

# m = 4 slots of d = 8 per head, so that a split confusing the q/k width (H*m) with the v width (H*d) shows.
LATTICE = {
    "vocab_size": 262, "hidden_size": 32, "layers": ["lattice", "lattice"], "tie_word_embeddings": False,
    "eos_token_id": 256, "mlp": {"intermediate_size": 64},
    "lattice": {"num_heads": 4, "head_dim": 8, "num_slots": 4, "conv_kernel": 3},
}  # fmt: skip


@pytest.mark.parametrize(
    "lattice",
    [
        {},  # the paper's DEC with a forget gate (step_proj holds gamma's and mu's rows) and a fixed S0
        {"variant": "enc", "forget_gate": False, "learn_s0": True, "output_norm": "none"},  # S0 orthonormalised at load
    ],
    ids=["dec-forget-gate", "enc-learned-s0"],
)
def test_lattice_split_over_two_ranks_gives_the_logits_and_states_of_one(tmp_path, lattice):
    """Two Lattice layers, each rank holding two of the four heads (their q/k and v rows, conv channels, gates,
    post-gate and S0): a packed prefill and four decode steps give one rank's logits on both ranks, and S and the
    conv tails, put back together from the halves, are the one-rank states."""
    config = dict(LATTICE, lattice=dict(LATTICE["lattice"], **lattice))
    assert_two_ranks_match_one(tmp_path, config)


def test_a_lattice_layer_that_cannot_split_is_refused_by_name():
    """Three heads on two ranks, or an output norm over all heads at once: refused at build time, naming the layer."""
    from kvfree.engine.model.config import ModelConfig
    from kvfree.engine.model.hybrid_lm import HybridLM

    odd = dict(LATTICE, lattice=dict(LATTICE["lattice"], num_heads=3))
    with pytest.raises(ValueError, match=r"layers.0 \(lattice\) num_heads: 3 does not divide among 2"):
        HybridLM(ModelConfig.from_dict(odd), TensorParallel(rank=0, size=2))
    whole_norm = dict(LATTICE, lattice=dict(LATTICE["lattice"], output_norm="rms"))
    with pytest.raises(ValueError, match=r"layers.0 \(lattice\): output_norm 'rms'"):
        HybridLM(ModelConfig.from_dict(whole_norm), TensorParallel(rank=1, size=2))
