"""Tensor parallelism's arithmetic (engine/tensor_parallel.py) on two CPU processes joined by gloo: a SwiGLU MLP split
column/row with one all-reduce, and a vocab-parallel embedding and LM head, equal the unsplit layers; a split that
does not divide is refused with the layer's name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from kvfree.engine.tensor_parallel import TensorParallel, column_shard, embed, lm_logits, row_shard

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
        gate_up = column_shard(w["gate_up"], tp, "mlp.gate_up", parts=[INTER, INTER])
        down = row_shard(w["down"], tp, "mlp.down")
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
    assert torch.equal(column_shard(w["gate_up"], one, "mlp"), w["gate_up"])
    torch.testing.assert_close(embed(w["ids"], w["embedding"], one), w["embedding"][w["ids"]])
    two = TensorParallel(rank=1, size=2)
    assert two.block(8, "heads") == slice(4, 8)
    with pytest.raises(ValueError, match=r"layers.3.mixer heads: 5 does not divide among 2"):
        two.block(5, "layers.3.mixer heads")
    with pytest.raises(ValueError, match=r"mlp.gate_up \(part 1\): 3 does not divide"):
        column_shard(torch.zeros(7, 2), two, "mlp.gate_up", parts=[4, 3])
    with pytest.raises(ValueError, match="do not add up"):
        column_shard(torch.zeros(7, 2), two, "mlp.gate_up", parts=[4, 4])
    with pytest.raises(ValueError, match="rank 2 is not one of 2"):
        TensorParallel.start(2, 2, "unused")
