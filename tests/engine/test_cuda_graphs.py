"""CUDA-graph decode logic that a CPU can check: buckets, padding with the scratch slot, and when to stay eager.

The graphs themselves need a GPU; the device run compares tokens with and without them (BENCHMARKS.md).
"""

from __future__ import annotations

import pytest
import torch

from kvfree.engine.core.cuda_graphs import MAX_GRAPH_BATCH, bucket_for, graph_batch_sizes, padded_slots
from kvfree.engine.core.model_runner import ModelRunner, graph_blockers
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from tests.conftest import make_model, output_tol, rel_err


def test_bucket_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256
    assert sizes == sorted(set(sizes))
    # From 16 sessions on, the next bucket is at most 1.5x the previous one (padding wastes at most a third).
    assert all(b <= 1.5 * a for a, b in zip(sizes[4:], sizes[5:], strict=False))
    assert graph_batch_sizes(MAX_GRAPH_BATCH)[-1] == MAX_GRAPH_BATCH
    assert graph_batch_sizes(100)[-1] == 100 and 96 in graph_batch_sizes(100)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_bucket_choice_and_padding():
    sizes = graph_batch_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [1, 2, 4, 8, 8, 16, 24, 64]
    assert bucket_for(65, sizes) is None
    assert padded_slots([5, 2, 7], 4, scratch_slot=9) == [5, 2, 7, 9]
    assert padded_slots([1], 1, scratch_slot=9) == [1]
    with pytest.raises(ValueError):
        padded_slots([1, 2, 3], 2, scratch_slot=9)


def test_pool_has_a_scratch_slot_no_session_gets():
    pool = StatePool(make_model(["mamba2"]), capacity=3)
    assert (pool.scratch_slot, pool.template_slot) == (3, 4)
    assert all(t.shape[0] == 5 for state in pool.tensors for t in state.values())  # slots, scratch, template
    assert sorted(pool.alloc() for _ in range(3)) == [0, 1, 2]
    assert pool.free_slots == 0  # the scratch and template rows are never handed out


@pytest.mark.parametrize("kind", ["mamba2", "gka", "lattice"])
def test_padding_rows_change_nothing_but_the_scratch_slot(kind):
    """A padded decode (what a graph replay runs) gives the real rows the same logits and state as an unpadded one."""
    torch.manual_seed(0)
    model = make_model([kind, kind])
    pool = StatePool(model, capacity=4)
    for slot in range(4):
        for state in pool.tensors:  # every row a different, non-zero state
            for t in state.values():
                if t.is_floating_point():
                    t[slot].copy_(torch.randn_like(t[slot]))
    before = [{k: t.clone() for k, t in state.items()} for state in pool.tensors]
    ids = torch.tensor([3, 11])
    with torch.inference_mode():
        plain = model.decode(ids, pool.tensors, StepBatch.decode([2, 0]))
        after_plain = [{k: t.clone() for k, t in state.items()} for state in pool.tensors]
        for state, saved in zip(pool.tensors, before, strict=True):
            for k, t in state.items():
                t.copy_(saved[k])
        padded_ids = torch.tensor([3, 11, 5, 5])
        padded = model.decode(padded_ids, pool.tensors, StepBatch.decode(padded_slots([2, 0], 4, pool.scratch_slot)))
    # The real rows agree to rounding (a matmul over 4 rows may block differently from one over 2).
    assert rel_err(padded[:2], plain) <= output_tol(kind, 1e-6)
    for state, expect in zip(pool.tensors, after_plain, strict=True):
        for k, t in state.items():
            assert torch.equal(t[[1, 3]], expect[k][[1, 3]]), k  # sessions outside the batch: untouched
            assert rel_err(t[[0, 2]], expect[k][[0, 2]]) <= output_tol(kind, 1e-6), k


def test_models_that_cannot_be_captured_say_why(monkeypatch):
    """SKA, B'MOJO and attention decode capture where their Triton ops run (decided on the device); on the PyTorch
    reference they sync on the host and say so. B'MOJO-F's decode reads nothing on the host: it captures either way."""
    assert graph_blockers(make_model(["mamba2", "gka", "lattice", "gdn"])) == []
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    blockers = graph_blockers(make_model(["mamba2", "ska", "ska", "attention"]))
    assert [b.split(":")[0] for b in blockers] == ["ska", "attention"]
    assert "bmojo" in graph_blockers(make_model(["bmojo"]))[0]
    monkeypatch.setenv("KVFREE_KERNELS", "triton")  # without a GPU, under the interpreter (conftest)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    assert graph_blockers(make_model(["mamba2", "ska", "bmojo", "attention", "swa"]).to(dev)) == []


def test_cpu_runner_stays_eager():
    model = make_model(["mamba2"])
    runner = ModelRunner(model, StatePool(model, capacity=2))
    assert runner.graphs is None
