"""Every mixer: prefill of T tokens == T decode steps, any split of a prefill == one prefill, packed == separate."""

from __future__ import annotations

import pytest
import torch

from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from tests.conftest import assert_states_close, make_model, mixer_prefill, output_tol, rel_err, state_rows

KINDS = ["mamba2", "attention", "swa", "ska", "gka", "gdn", "lattice", "bmojo"]
TOL = 1e-5


def _mixer_and_pool(kind: str, seed: int = 0, capacity: int = 4):
    model = make_model([kind], seed=seed)
    pool = StatePool(model, capacity=capacity, max_context=256)
    return model.layers[0].mixer, pool.tensors[0], pool


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 7, 37])
def test_prefill_equals_decode_steps(kind: str, T: int) -> None:
    torch.manual_seed(T)
    mixer, state, _ = _mixer_and_pool(kind)
    D = 32
    prefix, x = torch.randn(11, D), torch.randn(T, D)
    # Start both sessions from the same non-trivial state.
    for slot in (0, 1):
        mixer_prefill(mixer, state, slot, prefix)
    y_prefill = mixer_prefill(mixer, state, 0, x)
    y_decode = torch.cat([mixer.decode(x[t : t + 1], state, StepBatch.decode([1])) for t in range(T)])
    assert y_prefill.shape == (T, D)
    assert rel_err(y_prefill, y_decode) <= output_tol(kind)
    assert_states_close(state_rows(state, 0), state_rows(state, 1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_prefill_equals_one_prefill(kind: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mixer, state, _ = _mixer_and_pool(kind, seed=seed)
    T = 45
    x = torch.randn(T, 32, generator=gen)
    whole = mixer_prefill(mixer, state, 0, x)
    cuts = sorted(torch.randperm(T - 1, generator=gen)[:4].add(1).tolist())
    pieces = [mixer_prefill(mixer, state, 1, x[a:b]) for a, b in zip([0, *cuts], [*cuts, T], strict=True)]
    assert rel_err(torch.cat(pieces), whole) <= output_tol(kind)
    assert_states_close(state_rows(state, 1), state_rows(state, 0))


@pytest.mark.parametrize("kind", KINDS)
def test_packed_prefill_equals_separate(kind: str) -> None:
    """Several sessions of different lengths in one packed prefill call give what each gives alone."""
    torch.manual_seed(3)
    mixer, state, _ = _mixer_and_pool(kind)
    lens = [5, 19, 1]
    xs = [torch.randn(n, 32) for n in lens]
    for slot in (0, 1, 2):  # distinct non-trivial starting states
        mixer_prefill(mixer, state, slot, torch.randn(4 + slot, 32))
    alone = []
    saved = {k: v.clone() for k, v in state.items()}
    for slot, x in enumerate(xs):
        alone.append(mixer_prefill(mixer, state, slot, x))
    after_alone = {k: v.clone() for k, v in state.items()}
    for k in state:
        state[k].copy_(saved[k])
    packed = mixer.prefill(torch.cat(xs), state, StepBatch.prefill([0, 1, 2], lens))
    assert rel_err(packed, torch.cat(alone)) <= output_tol(kind)
    for slot in range(3):
        assert_states_close(state_rows(state, slot), {k: v[slot] for k, v in after_alone.items()})


@pytest.mark.parametrize("kind", KINDS)
def test_batched_decode_rows_are_independent(kind: str) -> None:
    """Decoding sessions together in one batch gives what each gives decoded alone."""
    torch.manual_seed(4)
    mixer, state, _ = _mixer_and_pool(kind, capacity=4)
    for slot in range(4):
        mixer_prefill(mixer, state, slot, torch.randn(3 + 2 * slot, 32))
    saved = {k: v.clone() for k, v in state.items()}
    xs = torch.randn(9, 3, 32)
    together = torch.stack([mixer.decode(xs[t], state, StepBatch.decode([2, 0, 3])) for t in range(9)])
    for k in state:
        state[k].copy_(saved[k])
    for row, slot in enumerate([2, 0, 3]):
        alone = torch.cat([mixer.decode(xs[t, row : row + 1], state, StepBatch.decode([slot])) for t in range(9)])
        assert rel_err(together[:, row], alone) <= output_tol(kind, 1e-6)
    # The untouched slot kept its state exactly.
    for k in state:
        assert torch.equal(state[k][1], saved[k][1])


def test_sliding_window_limits_what_is_seen() -> None:
    """A token past the window no longer influences the output: change it and nothing after the window moves."""
    torch.manual_seed(5)
    mixer, state, _ = _mixer_and_pool("swa")
    W = mixer.window
    x = torch.randn(20, 32)
    y1 = mixer_prefill(mixer, state, 0, x)
    x2 = x.clone()
    x2[3] += 5.0
    y2 = mixer_prefill(mixer, state, 1, x2)
    assert not torch.allclose(y1[3 : 3 + W], y2[3 : 3 + W])
    assert torch.equal(y1[3 + W :], y2[3 + W :])
    assert state["k"].shape[1] == W


def test_attention_reports_context_overflow() -> None:
    from kvfree.engine.model.layers import ContextOverflowError

    model = make_model(["attention"])
    pool = StatePool(model, capacity=1, max_context=16)
    mixer, state = model.layers[0].mixer, pool.tensors[0]
    mixer_prefill(mixer, state, 0, torch.randn(16, 32))
    with pytest.raises(ContextOverflowError, match="max_context"):
        mixer.decode(torch.randn(1, 32), state, StepBatch.decode([0]))
    with pytest.raises(ContextOverflowError, match="max_context"):
        mixer_prefill(mixer, state, 0, torch.randn(2, 32))


@pytest.mark.parametrize("layers", [["mamba2"], ["attention"], ["swa"], ["mamba2", "attention", "swa"]])
def test_training_forward_equals_prefill(layers) -> None:
    """HybridLM.forward (batched, differentiable) computes what prefill computes, sequence by sequence."""
    torch.manual_seed(6)
    model = make_model(layers, mlp=True)
    ids = torch.randint(0, 256, (3, 29))
    batched = model(ids)
    pool = StatePool(model, capacity=3, max_context=64)
    packed = model.prefill(ids.flatten(), pool.tensors, StepBatch.prefill([0, 1, 2], [29] * 3), all_logits=True)
    assert batched.shape == (3, 29, model.config.vocab_size)
    assert rel_err(batched.flatten(0, 1), packed) <= TOL


def test_training_forward_is_differentiable() -> None:
    with torch.inference_mode(False), torch.enable_grad():
        model = make_model(["mamba2", "attention"])
        ids = torch.randint(0, 256, (2, 17))
        loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.layers[0].mixer.A_log.grad.abs().sum() > 0
