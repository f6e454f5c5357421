"""The Gated DeltaNet mixer split by head over two gloo ranks computes what one rank does."""

from __future__ import annotations

from tests.engine.test_tensor_parallel import assert_two_ranks_match_one

# Four state heads reading two key heads and one value head: the value head is held whole by both ranks, the key
# heads split one a rank; a split confusing the q, k and v widths of the conv or the projections shows.
GDN = {
    "vocab_size": 261, "hidden_size": 32, "layers": ["gdn", "attention"], "tie_word_embeddings": False,
    "eos_token_id": 256, "mlp": {"intermediate_size": 64},
    "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8},
    "gdn": {"num_heads": 4, "head_dim": 8, "num_k_heads": 2, "num_v_heads": 1, "chunk_size": 8,
            "allow_neg_eigval": True},
}  # fmt: skip


def test_gdn_split_over_two_ranks_gives_the_logits_and_states_of_one(tmp_path):
    """A GDN layer, each rank holding two of its four heads (their q rows, the k and v heads they read, the conv
    channels, the gates and the norm's output-gate rows): a packed prefill and four decode steps give one rank's
    logits on both ranks, and the state and conv tail, put back together from the halves, are the one-rank states."""
    assert_two_ranks_match_one(tmp_path, GDN)
