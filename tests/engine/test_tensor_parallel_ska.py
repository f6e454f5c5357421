"""SKA layers and the Koopman MLP (Echo's blocks) split among two CPU ranks compute what one rank does."""

from __future__ import annotations

import pytest

from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.tensor_parallel import TensorParallel
from tests.engine.test_tensor_parallel import assert_two_ranks_match_one

ECHO = {
    "vocab_size": 262, "hidden_size": 32, "layers": ["ska", "mamba2", "ska"], "tie_word_embeddings": True,
    "eos_token_id": 256, "mlp": {"intermediate_size": 64, "kind": "koopman", "gated": True},
    "ska": {"num_heads": 4, "rank": 8, "head_dim": 8, "chunk_size": 4},
    "mamba2": {"num_heads": 4, "head_dim": 8, "state_size": 16, "n_groups": 2, "chunk_size": 8},
}  # fmt: skip


def test_ska_layers_and_koopman_mlps_split_over_two_ranks_give_one_ranks_logits_and_states(tmp_path):
    """Two SKA layers (their statistics, key max-norms and readouts by head, chunk boundaries crossed by the prompt)
    around a Mamba-2 layer, each followed by a gated Koopman MLP split by channel pairs, with a tied embedding."""
    assert_two_ranks_match_one(tmp_path, ECHO)


def test_a_koopman_mlp_whose_share_would_split_a_pair_is_refused():
    config = dict(ECHO, mlp={"intermediate_size": 6, "kind": "koopman"})
    with pytest.raises(ValueError, match=r"layers.0 \(ska\) mlp intermediate_size: 6 gives each of 2 ranks an odd"):
        HybridLM(ModelConfig.from_dict(config), TensorParallel(rank=0, size=2))
    with pytest.raises(ValueError, match=r"layers.0 \(ska\) num_heads: 3 does not divide among 2"):
        HybridLM(ModelConfig.from_dict(dict(ECHO, ska=dict(ECHO["ska"], num_heads=3))), TensorParallel(rank=1, size=2))
