"""Tensor parallelism's arithmetic (engine/model/tensor_parallel.py) on two CPU processes joined by gloo: a SwiGLU MLP
split
column/row with one all-reduce, and a vocab-parallel embedding and LM head, equal the unsplit layers; a split that
does not divide is refused with the layer's name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from kvfree.engine.model.tensor_parallel import (
    ROW,
    Split,
    TensorParallel,
    embed,
    lm_logits,
    rank_shape,
    shard,
    split_among,
    unshard,
    whole_shape,
)  # fmt: skip
from tests.paths import TINY_CHECKPOINT

HIDDEN, INTER, VOCAB = 16, 32, 10


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "gate_up": torch.randn(2 * INTER, HIDDEN, generator=g, dtype=torch.float64),
        "down": torch.randn(HIDDEN, INTER, generator=g, dtype=torch.float64),
        "embedding": torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64),
        "x": torch.randn(5, HIDDEN, generator=g, dtype=torch.float64),
        "ids": torch.tensor([[0, 4, 5, 9], [3, 7, 1, 6]]),
    }


def _mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.t()


def _rank(rank: int, size: int, init: str, out: str) -> None:
    tp = TensorParallel.start(rank, size, init, backend="gloo")
    try:
        w = _weights()
        gate_up = shard(w["gate_up"], Split(parts=(INTER // 2, INTER // 2)), tp)  # gate and up, each split
        down = shard(w["down"], ROW, tp)
        vocab = w["embedding"][tp.block(VOCAB, "embedding")]
        result = {
            "mlp": tp.all_reduce(_mlp(w["x"], gate_up, down)),
            "embed": embed(w["ids"], vocab, tp),
            "logits": lm_logits(w["x"], vocab, tp),
            "shapes": torch.tensor([*gate_up.shape, *down.shape, *vocab.shape]),
        }
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_compute_what_one_does(tmp_path):
    """Each rank holds half of every weight (the MLP's gate and up split on their own), and after one all-reduce (or
    gather) both ranks hold the unsplit layer's output."""
    out = str(tmp_path / "result")
    mp.start_processes(_rank, args=(2, f"file://{tmp_path / 'init'}", out), nprocs=2, start_method="spawn")
    w = _weights()
    want = {"mlp": _mlp(w["x"], w["gate_up"], w["down"]), "embed": w["embedding"][w["ids"]],
            "logits": w["x"] @ w["embedding"].t()}  # fmt: skip
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=f"rank {rank}: {name}")
        assert got["shapes"].tolist() == [INTER, HIDDEN, HIDDEN, INTER // 2, VOCAB // 2, HIDDEN]


def test_one_rank_is_the_identity_and_a_split_that_does_not_divide_is_refused():
    one = TensorParallel.start(0, 1, "unused")
    x = torch.randn(3, 4)
    assert one.all_reduce(x) is x and one.gather_last(x) is x and one.block(7, "any") == slice(0, 7)
    w = _weights()
    assert shard(w["gate_up"], Split(), one) is w["gate_up"]
    torch.testing.assert_close(embed(w["ids"], w["embedding"], one), w["embedding"][w["ids"]])
    two = TensorParallel(rank=1, size=2)
    assert two.block(8, "heads") == slice(4, 8)
    with pytest.raises(ValueError, match=r"layers.3.mixer heads: 5 does not divide among 2"):
        two.block(5, "layers.3.mixer heads")
    with pytest.raises(ValueError, match=r"mlp.gate_up: 7 does not split into pieces \[2, 1\] on 2 ranks"):
        rank_shape((7, 2), Split(parts=(2, 1)), 2, "mlp.gate_up")
    with pytest.raises(ValueError, match=r"layers.3 heads: 5 does not divide among 2"):
        rank_shape((5, 3), Split(), 2, "layers.3 heads")
    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        TensorParallel.start(2, 2, "unused")


@pytest.mark.parametrize(
    ("shape", "split"),
    [
        ((6, 8, 3), Split(axis=1, parts=(1, 1))),  # two fused pieces along axis 1, 4 rows each
        ((9, 5), Split(parts=(1, 2), replicas=(4, 1))),  # one row held by all 4 ranks, then 8 rows split
        ((9, 3), Split(length=9)),  # a vocabulary of 9 rows: padded to 12, 3 rows a rank
    ],
)
def test_a_split_puts_back_together_exactly_what_it_cut(shape, split):
    """Every rank's part (`split_among`) has the shape `rank_shape` gives, and `unshard` of the parts, in rank order,
    is the whole tensor again, its padding cut; `whole_shape` inverts `rank_shape`."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    parts = split_among(x, split, 4)
    assert {tuple(p.shape) for p in parts} == {rank_shape(shape, split, 4, "x")}
    assert whole_shape(parts[0].shape, split, 4) == shape
    assert torch.equal(unshard(parts, split), x)
    assert not torch.equal(parts[0], parts[-1])  # (the ranks hold different blocks)


# -- a whole hybrid at TP=2 ------------------------------------------------------------------------------------------
# Attention's one KV head and GKA's one v head are each held whole by both ranks (fewer heads than ranks); the other
# heads split. The byte vocabulary's 261 rows do not divide by 2: the second rank's block ends with a zero row.
HYBRID = {
    "vocab_size": 261, "hidden_size": 32, "layers": ["attention", "mamba2", "gka", "swa"], "tie_word_embeddings": False,
    "eos_token_id": 256, "mlp": {"intermediate_size": 64},
    "attention": {"num_heads": 4, "num_kv_heads": 1, "head_dim": 8, "qk_norm": True, "use_bias": True},
    "swa": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "window": 6},
    "mamba2": {"num_heads": 4, "head_dim": 8, "state_size": 16, "n_groups": 2, "chunk_size": 8, "use_bias": True},
    "gka": {"num_heads": 4, "head_dim": 8, "num_k_heads": 2, "num_v_heads": 1, "chunk_size": 8, "num_iter": 30},
}  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 250, 8, 8, 41, 7, 12, 130], [77, 2, 61]]


def hybrid_checkpoint(path, config: dict | None = None) -> str:
    """A random checkpoint of `config` (default HYBRID; every parameter random, norms and biases too) at `path`."""
    from kvfree.checkpoints import write_checkpoint
    from kvfree.engine.model.config import ModelConfig
    from kvfree.engine.model.hybrid_lm import HybridLM

    config = ModelConfig.from_dict(config or HYBRID)
    model = HybridLM(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "A_log" in name else 0.0) + torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        # Printable ASCII replies (the byte tokenizer's 32..126), so that a chat history re-encodes to the tokens a
        # session holds: every other token's logit is 0, below the best of 95 logits made three times larger.
        head = model.embed.weight if model.lm_head is None else model.lm_head.weight
        head[:32] = 0
        head[127:] = 0
        head[32:127] *= 3
    write_checkpoint(path, config.to_dict(), model.state_dict(), TINY_CHECKPOINT)
    return str(path)


def run_hybrid(path: str, tp: TensorParallel, kv_cache_dtype: str = "auto") -> dict[str, torch.Tensor]:
    """Prefill PROMPTS into two sessions (one packed step), then 4 greedy decode steps: every step's logits, and
    the sessions' states put back whole (`unshard` of every rank's rows)."""
    from kvfree.engine.model.loader import load_model
    from kvfree.engine.model.step_batch import StepBatch
    from kvfree.engine.model.tensor_parallel import unshard
    from kvfree.engine.state.pool import StatePool

    model = load_model(path, device="cpu", dtype="float32", tp=tp)
    model.set_kv_cache_dtype(kv_cache_dtype)
    pool = StatePool(model, 4, max_context=32)
    slots = [pool.alloc(), pool.alloc()]
    ids = torch.tensor([t for p in PROMPTS for t in p])
    logits = [model.prefill(ids, pool.tensors, StepBatch.prefill(slots, [len(p) for p in PROMPTS], model.device))]
    for _ in range(4):
        logits.append(model.decode(logits[-1].argmax(-1), pool.tensors, StepBatch.decode(slots, model.device)))
    out = {f"logits.{i}": x for i, x in enumerate(logits)}
    for i, (specs, state) in enumerate(zip(pool.specs, pool.tensors, strict=True)):
        for name, spec in specs.items():
            rows = state[name][slots].contiguous()
            raw = rows.view(torch.uint8) if rows.dtype == torch.float8_e4m3fn else rows  # (gloo has no fp8)
            parts = [torch.empty_like(raw) for _ in range(tp.size)]
            if tp.size > 1:
                dist.all_gather(parts, raw)
            else:
                parts = [raw]
            parts = [part.view(rows.dtype) for part in parts]
            split = None if spec.split is None else dataclasses.replace(spec.split, axis=spec.split.axis + 1)
            whole = unshard(parts, split)
            # (fp8 compared by value: assert_close has no fp8 arithmetic)
            out[f"state.{i}.{name}"] = whole.float() if whole.dtype == torch.float8_e4m3fn else whole
    return out


def _hybrid_rank(rank: int, size: int, init: str, path: str, out: str, kv_cache_dtype: str) -> None:
    tp = TensorParallel.start(rank, size, init, backend="gloo")
    try:
        torch.save(run_hybrid(path, tp, kv_cache_dtype), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def assert_two_ranks_match_one(
    tmp_path, config: dict | None = None, rtol: float = 2e-4, atol: float = 2e-5, kv_cache_dtype: str = "auto"
) -> None:
    """A random checkpoint of `config` run at TP=2 (two gloo processes) and at TP=1 (`run_hybrid`): the same logits
    on both ranks, and every state tensor put back together from the ranks' parts equal to the one-rank state."""
    path = hybrid_checkpoint(tmp_path / "ckpt", config)
    out = str(tmp_path / "result")
    mp.start_processes(_hybrid_rank, args=(2, f"file://{tmp_path / 'init'}", path, out, kv_cache_dtype), nprocs=2,
                       start_method="spawn")  # fmt: skip
    want = run_hybrid(path, TensorParallel(), kv_cache_dtype)
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=f"rank {rank}: {name}")


def test_a_hybrid_split_over_two_ranks_gives_the_logits_and_states_of_one(tmp_path):
    """Attention (one KV head, held by both ranks), sliding-window attention, Mamba-2 (two groups) and GKA (its one v
    head held by both), each with a SwiGLU MLP, under a vocab-parallel embedding and LM head: a packed prefill of two
    prompts and four decode steps give one rank's logits on both ranks, and the sessions' states, put back together
    from the two ranks' halves, are the one-rank states."""
    assert_two_ranks_match_one(tmp_path)


def test_a_layer_whose_heads_do_not_divide_is_refused_by_name(tmp_path):
    """Three query heads on two ranks: the model is refused at build time with the layer, its kind and the count."""
    from kvfree.engine.model.config import ModelConfig
    from kvfree.engine.model.hybrid_lm import HybridLM

    config = dict(HYBRID, attention={"num_heads": 3, "num_kv_heads": 1, "head_dim": 8})
    with pytest.raises(ValueError, match=r"layers.0 \(attention\) num_heads: 3 does not divide among 2"):
        HybridLM(ModelConfig.from_dict(config), TensorParallel(rank=0, size=2))
    with pytest.raises(ValueError, match=r"layers.1 \(mamba2\) n_groups"):
        HybridLM(ModelConfig.from_dict(dict(HYBRID, mamba2=dict(HYBRID["mamba2"], n_groups=1))),
                 TensorParallel(rank=1, size=2))  # fmt: skip
    low_rank = dict(HYBRID["gka"], kv_proj_rank=4)
    with pytest.raises(ValueError, match=r"layers.2 \(gka\): the low-rank k/v expansion \(kv_proj_rank\) reads every"):
        HybridLM(ModelConfig.from_dict(dict(HYBRID, gka=low_rank)), TensorParallel(rank=0, size=2))


@pytest.mark.parametrize("shape", ["hmf_8b_gka", "hmf_32b_gka"])
def test_hmf_shapes_split_among_eight_ranks_each_holding_an_eighth(shape: str) -> None:
    """What a TP=8 run of `kvfree bench context` builds (issue 34's shapes), checked without GPUs: every layer's heads
    divide among 8 ranks, and each rank holds an eighth of the weights and of every session's state (8 KV heads: one
    each)."""
    from pathlib import Path

    from kvfree.bench.context import SHAPES, random_model
    from kvfree.checkpoints.hf_hmf import convert_config
    from kvfree.engine.model.config import ModelConfig

    label, hf_config = SHAPES[shape]
    config = ModelConfig.from_dict(convert_config(hf_config, Path(label)))
    meta = torch.device("meta")  # shapes without memory: the 32B model's weights would be 68 GB

    def weights_and_state(tp: TensorParallel) -> tuple[int, int]:
        model = random_model(config, meta, torch.bfloat16, tp)
        specs = [spec for layer in model.layers for spec in layer.mixer.state_specs(16384).values()]
        split = sum(torch.Size(spec.shape).numel() for spec in specs if spec.split is not None)  # not the counters
        return sum(p.numel() for p in model.parameters()), split

    whole_weights, whole_state = weights_and_state(TensorParallel())
    for rank in (0, 7):
        weights, state = weights_and_state(TensorParallel(rank=rank, size=8))
        assert state * 8 == whole_state
        # Norm weights are held whole by every rank: a little over an eighth, never more than 0.1% over.
        assert whole_weights / 8 <= weights < 1.001 * whole_weights / 8
