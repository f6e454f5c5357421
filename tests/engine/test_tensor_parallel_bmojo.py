"""B'MOJO and B'MOJO-F at TP=2 (two gloo processes) give the logits and the states of one rank."""

from __future__ import annotations

import pytest

from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.tensor_parallel import TensorParallel
from tests.engine.test_tensor_parallel import assert_two_ranks_match_one

BASE = {"vocab_size": 262, "hidden_size": 32, "tie_word_embeddings": False, "eos_token_id": 256,
        "mlp": {"intermediate_size": 64}}  # fmt: skip
# Window 4 over the 11-token prompt and four decode steps: the memory is published at several chunk starts, the
# eidetic store fills and evicts, so every state tensor holds data.
BMOJO = {"num_heads": 4, "head_dim": 8, "ssm_num_heads": 4, "ssm_head_dim": 8, "ssm_state_size": 16, "ssm_n_groups": 2,
         "ssm_chunk_size": 8, "window": 4, "fading_tokens": 2, "eidetic_tokens": 3}  # fmt: skip
# Window 3: the fading keys (positions i-5..i-3) are read from the prompt on.
BMOJO_F = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "window": 3}
GKA = {"num_heads": 4, "head_dim": 8, "num_k_heads": 2, "num_v_heads": 1, "chunk_size": 8, "num_iter": 30}
MAMBA2 = {"num_heads": 4, "head_dim": 8, "state_size": 16, "n_groups": 2, "chunk_size": 8, "use_bias": True}


def test_bmojo_with_one_kv_head_held_by_both_ranks_matches_one_rank(tmp_path):
    """P2 B'MOJO with biases: the SSM's heads and groups split, the one KV head (and the ring, fading and eidetic
    K/V) held whole by both ranks, y all-reduced before the innovation score and RMSNorm(u + y), and added once."""
    bmojo = dict(BMOJO, num_kv_heads=1, use_bias=True)
    assert_two_ranks_match_one(tmp_path, dict(BASE, layers=["bmojo", "bmojo"], bmojo=bmojo))


def test_literal_bmojo_with_kv_heads_split_matches_one_rank(tmp_path):
    """P1 B'MOJO (q/k/v from u, y not added to the output) with its two KV heads split, one per rank."""
    bmojo = dict(BMOJO, num_kv_heads=2, wiring="P1")
    assert_two_ranks_match_one(tmp_path, dict(BASE, layers=["bmojo", "bmojo"], bmojo=bmojo))


def test_bmojo_f_over_gka_matches_one_rank(tmp_path):
    """B'MOJO-F whose fading tokens come from GKA (its one v head held by both ranks, as a `gka` layer's), the KV
    heads and the rings split, the fading tokens all-reduced before W_K and W_V."""
    bmojo_f = dict(BMOJO_F, fading_gka=GKA)
    # The fading keys are k_norm(W_K GKA(h)): GKA's fp32 output carries rounding of ~1e-3 of its size (its ridge
    # solve and alpha blend; OUTPUT_TOL in tests/conftest.py), which the per-head RMSNorm scales up to unit keys.
    # Summed in another order on two ranks (and projected for all packed tokens in one matmul, whose CPU blocking
    # depends on the columns each rank holds), layer 1's fading keys differ by up to 1.5e-4 (1.3e-4 beyond rtol); in
    # float64 the two runs agree to 1e-15.
    config = dict(BASE, layers=["bmojo_f", "bmojo_f"], bmojo_f=bmojo_f)
    assert_two_ranks_match_one(tmp_path, config, atol=2e-4)


def test_bmojo_f_over_mamba2_with_untied_paths_and_one_kv_head_matches_one_rank(tmp_path):
    """B'MOJO-F over Mamba-2 (with biases) and a fading path of its own projections, its one KV head held by both."""
    bmojo_f = dict(BMOJO_F, num_kv_heads=1, tie_attn_weights=False, fading_mamba2=MAMBA2)
    assert_two_ranks_match_one(tmp_path, dict(BASE, layers=["bmojo_f", "bmojo_f"], bmojo_f=bmojo_f))


def test_a_bmojo_whose_ssm_groups_do_not_divide_is_refused_by_name():
    """One B/C group on two ranks (Mamba-2's gated norm would need a collective), or three query heads: refused at
    build time, naming the layer and the part."""

    def build(**bmojo) -> None:
        HybridLM(ModelConfig.from_dict(dict(BASE, layers=["bmojo"], bmojo=dict(BMOJO, **bmojo))), TensorParallel(0, 2))

    with pytest.raises(ValueError, match=r"layers.0 \(bmojo\) fading-memory SSM \(mamba2\) n_groups"):
        build(ssm_n_groups=1)
    with pytest.raises(ValueError, match=r"layers.0 \(bmojo\) num_heads: 3 does not divide among 2"):
        build(num_heads=3, num_kv_heads=1)
