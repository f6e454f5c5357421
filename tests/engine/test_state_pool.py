"""StatePool: session isolation, slot reuse, resets and forks (one row copy each), export/import (also across
processes), memory accounting."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.protocol import SnapshotMismatchError
from kvfree.engine.state import pool as state_pool
from kvfree.engine.state.pool import StatePool
from tests.conftest import greedy, make_model, model_prefill, output_tol, random_ids, rel_err

# Every mixer kind, alone or in a hybrid.
MODELS = [
    ["mamba2", "mamba2"],
    ["attention"],
    ["swa", "mamba2"],
    ["mamba2", "attention", "swa"],
    ["mamba2", "ska"],
    ["gka"],
    ["lattice", "mamba2"],
    ["bmojo"],
]


@pytest.mark.parametrize("layers", MODELS)
def test_interleaved_sessions_match_each_alone(layers) -> None:
    model = make_model(layers, mlp=True)
    prompts = [random_ids(13, 1), random_ids(30, 2)]
    pool = StatePool(model, capacity=3, max_context=128)
    firsts = [int(model_prefill(model, pool, slot, p).argmax()) for slot, p in zip([2, 0], prompts, strict=True)]
    together, logits_together = greedy(model, pool, [2, 0], firsts, 12)
    for row, prompt in enumerate(prompts):
        alone_pool = StatePool(model, capacity=1, max_context=128)
        first = int(model_prefill(model, alone_pool, 0, prompt).argmax())
        alone, logits_alone = greedy(model, alone_pool, [0], [first], 12)
        assert together[row] == alone[0]
        # BLAS picks other paths per batch size, so not bit-identical: fp32 rounding, amplified by GKA's solve.
        assert rel_err(logits_together[row], logits_alone[0]) <= output_tol(layers)


@pytest.mark.parametrize("layers", MODELS)
def test_freed_slot_keeps_nothing_of_the_old_session(layers) -> None:
    model = make_model(layers)
    pool = StatePool(model, capacity=2, max_context=128)
    fresh = {k: v.clone() for k, v in pool.export(0).items()}
    slot = pool.alloc()
    model_prefill(model, pool, slot, random_ids(40, 3))
    used = pool.export(slot)
    assert any(not torch.equal(used[k], fresh[k]) for k in fresh if used[k].shape == fresh[k].shape)  # it was used
    pool.free(slot)
    again = pool.alloc()
    assert again == slot
    for key, tensor in pool.export(again).items():
        assert torch.equal(tensor, fresh[key]), key
    # And the reused slot continues exactly like a brand-new pool.
    new_pool = StatePool(model, capacity=1, max_context=128)
    prompt = random_ids(9, 4)
    assert torch.equal(model_prefill(model, pool, again, prompt), model_prefill(model, new_pool, 0, prompt))


def test_alloc_and_free_errors() -> None:
    model = make_model(["mamba2"])
    pool = StatePool(model, capacity=1)
    slot = pool.alloc()
    with pytest.raises(RuntimeError, match="in use"):
        pool.alloc()
    pool.free(slot)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(slot)


@pytest.mark.parametrize("layers", MODELS)
def test_export_import_continues_bit_identically(layers) -> None:
    model = make_model(layers, seed=7)
    pool = StatePool(model, capacity=2, max_context=128)
    first = int(model_prefill(model, pool, 1, random_ids(25, 5)).argmax())
    warm, _ = greedy(model, pool, [1], [first], 5)
    snapshot = pool.export(1)
    expected, _ = greedy(model, pool, [1], [warm[0][-1]], 15)

    other = StatePool(model, capacity=3, max_context=128)
    other.import_(2, snapshot)
    got, _ = greedy(model, other, [2], [warm[0][-1]], 15)
    assert got == expected


def test_export_import_across_processes(tmp_path) -> None:
    """A state saved to a file in this process continues identically in a new Python process."""
    from kvfree.engine.model.loader import load_model
    from kvfree.engine.model.presets import init_checkpoint

    ckpt = init_checkpoint("tiny-hybrid", tmp_path / "ckpt", seed=3)
    model = load_model(ckpt, device="cpu")
    pool = StatePool(model, capacity=1, max_context=256)
    first = int(model_prefill(model, pool, 0, random_ids(40, 6)).argmax())
    save_file(pool.export(0), tmp_path / "state.safetensors")
    expected, _ = greedy(model, pool, [0], [first], 20)

    script = textwrap.dedent(f"""
        import torch
        from safetensors.torch import load_file
        from kvfree.engine.model.loader import load_model
        from kvfree.engine.state.pool import StatePool
        from kvfree.engine.model.step_batch import StepBatch
        model = load_model({str(ckpt)!r}, device="cpu")
        pool = StatePool(model, capacity=4, max_context=256)
        pool.import_(3, load_file({str(tmp_path / "state.safetensors")!r}))
        ids, out = torch.tensor([{first}]), []
        with torch.inference_mode():
            for _ in range(20):
                ids = model.decode(ids, pool.tensors, StepBatch.decode([3])).argmax(-1)
                out.append(int(ids))
        print(out)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(expected[0])


def test_import_rejects_mismatched_state() -> None:
    model = make_model(["mamba2", "attention"])
    pool = StatePool(model, capacity=1, max_context=32)
    good = pool.export(0)
    missing = {k: v for k, v in good.items() if k != "layers.0.ssm"}
    with pytest.raises(SnapshotMismatchError, match="layers.0.ssm"):
        pool.import_(0, missing)
    wrong_shape = dict(good, **{"layers.0.ssm": torch.zeros(3, 3)})
    with pytest.raises(SnapshotMismatchError, match="layers.0.ssm"):
        pool.import_(0, wrong_shape)
    wrong_dtype = dict(good, **{"layers.0.ssm": good["layers.0.ssm"].double()})
    with pytest.raises(SnapshotMismatchError, match="dtype"):
        pool.import_(0, wrong_dtype)
    too_long = dict(good, **{"layers.1.k": torch.zeros(33, 2, 8)})
    with pytest.raises(SnapshotMismatchError, match="layers.1.k"):
        pool.import_(0, too_long)


def test_bytes_per_session_constant_for_mamba2() -> None:
    model = make_model(["mamba2", "mamba2"])
    pool = StatePool(model, capacity=2, max_context=64)
    model_prefill(model, pool, 0, random_ids(100, 8))
    model_prefill(model, pool, 1, random_ids(10_000, 9))
    assert pool.session_bytes(0) == pool.session_bytes(1) == pool.bytes_per_session(100)
    assert pool.bytes_per_session(100) == pool.bytes_per_session(10_000) == pool.bytes_per_session()
    assert pool.bytes_per_token() == 0
    # The formula: per layer, the conv tail (K-1) x conv_dim and the SSM state H x P x N, fp32.
    cfg = model.config.mamba2
    conv_dim = cfg.num_heads * cfg.head_dim + 2 * cfg.n_groups * cfg.state_size
    per_layer = ((cfg.conv_kernel - 1) * conv_dim + cfg.num_heads * cfg.head_dim * cfg.state_size) * 4
    assert pool.bytes_per_session() == 2 * per_layer
    assert pool.reserved_bytes() == (2 + 2) * pool.bytes_per_session()  # two slots, the scratch and template rows
    # The state survives 10k tokens with finite values.
    assert all(torch.isfinite(t).all() for t in pool.export(1).values())


def test_bytes_per_session_grows_linearly_for_attention() -> None:
    model = make_model(["attention", "attention"])
    pool = StatePool(model, capacity=3, max_context=10_000)
    for slot, n in enumerate([100, 5_000, 10_000]):
        model_prefill(model, pool, slot, random_ids(n, 10 + slot), chunk=1024)
    sizes = [pool.session_bytes(slot) for slot in range(3)]
    cfg = model.config.attention
    per_token = 2 * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # layers x (k, v) x heads x dim x fp32
    assert pool.bytes_per_token() == per_token
    assert sizes[1] - sizes[0] == 4_900 * per_token
    assert sizes[2] - sizes[0] == 9_900 * per_token
    assert sizes == [pool.bytes_per_session(n) for n in (100, 5_000, 10_000)]
    # Reserved memory is sized by max_context, whatever the sessions hold. The KV caches have no template row (resets
    # only zero their length): three slots and the scratch row, plus a template row of the fixed-size state.
    assert pool.bytes_per_session() == pool.bytes_per_session(10_000)
    assert pool.reserved_bytes() == (3 + 1) * pool.bytes_per_session() + pool.bytes_per_session(0)


def test_resets_are_deferred_and_batched(monkeypatch) -> None:
    """Admitting many sessions resets their rows with one row copy for all of them and every layer, before anything
    reads them."""
    model = make_model(["lattice", "mamba2"])  # Lattice's new state is S_0, not zeros
    pool = StatePool(model, capacity=6, max_context=64)
    fresh = [{k: t[0].clone() for k, t in state.items()} for state in pool.tensors]
    slots = [pool.alloc() for _ in range(6)]
    for state in pool.tensors:  # sessions that ran
        for t in state.values():
            t[: len(slots)] = 7
    for slot in slots:
        pool.free(slot)
    calls = []
    copy_rows = state_pool.copy_rows
    monkeypatch.setattr(
        state_pool, "copy_rows", lambda table, src, dst: (calls.append(dst.tolist()), copy_rows(table, src, dst))
    )
    again = [pool.alloc() for _ in range(4)]
    assert calls == []  # nothing yet: the resets wait for the rows' next use
    tensors = pool.tensors
    assert calls == [sorted(again)]  # then one copy of the template row, every layer's tensors at once
    for state, expect in zip(tensors, fresh, strict=True):
        for name, t in state.items():
            for slot in again:
                assert torch.equal(t[slot], expect[name]), (name, slot)
    saved = pool.export(again[1])
    pool.reset(again[0])
    pool.reset(again[2])
    pool.import_(again[0], saved)  # overwrites every row of again[0]: only again[2] still needs its reset
    assert calls == [sorted(again)]  # (an import flushes nothing: it may run on a side stream, apart from the steps)
    pool.flush_resets()
    assert calls == [sorted(again), [again[2]]]
    assert all(torch.equal(t, saved[k]) for k, t in pool.export(again[0]).items())


# Lattice (a new state is S0, not zeros), full attention (per-token KV caches, which resets leave alone), SKA (an int64
# position among fp32 tensors) and Mamba-2.
MIXED = ["lattice", "attention", "ska", "mamba2"]


@pytest.fixture(params=["reference", "triton"])
def row_copies(request, monkeypatch) -> str:
    """The pool's resets and forks through the PyTorch reference, or through the Triton kernel (interpreted)."""
    if request.param == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton row copy of a CPU pool runs under the interpreter only")
        import kvfree.kernels.rows as rows_ops

        monkeypatch.setattr(rows_ops, "use_triton", lambda device: True)
    return request.param


def fixed_size_rows(pool: StatePool, slot: int) -> list[dict[str, torch.Tensor]]:
    """Copies of one row of every state tensor but the per-token ones (which have no template row)."""
    return [
        {name: state[name][slot].clone() for name, spec in specs.items() if not spec.per_token}
        for specs, state in zip(pool.specs, pool.tensors, strict=True)
    ]


def test_a_reset_slot_holds_what_each_mixers_reset_state_gives(row_copies) -> None:
    model = make_model(MIXED)
    pool = StatePool(model, capacity=3, max_context=64)
    slots = [pool.alloc() for _ in range(3)]
    for slot in slots:
        model_prefill(model, pool, slot, random_ids(20 + slot, slot))
    pool.free(slots[2])
    pool.free(slots[0])
    again = [pool.alloc(), pool.alloc()]
    assert sorted(again) == [slots[0], slots[2]]
    for layer, specs, state in zip(model.layers, pool.specs, pool.tensors, strict=True):
        expect = {name: torch.zeros((1, *spec.shape), dtype=state[name].dtype) for name, spec in specs.items()}
        layer.mixer.reset_state(expect, torch.tensor([0]))
        for name, spec in specs.items():
            if not spec.per_token:  # a KV cache holds its layer's `length` entries: none
                assert all(torch.equal(state[name][slot], expect[name][0]) for slot in again), name
    assert pool.tensors[0]["S"][again[0]].abs().sum() > 0  # Lattice's S0
    new = StatePool(model, capacity=1, max_context=64).export(0)
    for slot in again:
        assert all(torch.equal(t, new[k]) for k, t in pool.export(slot).items())


def test_forks_are_exact_copies_and_leave_every_other_row_alone(row_copies) -> None:
    model = make_model(MIXED, seed=2)
    pool = StatePool(model, capacity=6, max_context=64)
    slots = [pool.alloc() for _ in range(6)]
    for slot in slots[:3]:
        model_prefill(model, pool, slot, random_ids(10 + 7 * slot, 40 + slot))
    pool.reset(3)  # a dst waiting for its reset: the fork overwrites it anyway
    pool.reset(1)  # a src waiting for its reset: its copy is a new session's state
    before = [{name: t.clone() for name, t in state.items()} for state in pool._tensors]
    fresh = fixed_size_rows(pool, pool.template_slot)
    pool.copy_many([(0, 3), (2, 4), (1, 5)])
    for state, old, new in zip(pool.tensors, before, fresh, strict=True):
        for name, t in state.items():
            assert torch.equal(t[3], old[name][0]) and torch.equal(t[4], old[name][2]), name  # KV caches whole
            if name in new:
                assert torch.equal(t[5], new[name]) and torch.equal(t[1], new[name]), name
            keep = [row for row in range(t.shape[0]) if row not in (1, 3, 4, 5)]
            assert torch.equal(t[keep], old[name][keep]), name
    # A fork continues exactly like its source.
    tokens, _ = greedy(model, pool, [0, 3], [7, 7], 6)
    assert tokens[0] == tokens[1]


def test_the_template_row_never_changes_and_is_never_handed_out(row_copies) -> None:
    model = make_model(MIXED, seed=3)
    pool = StatePool(model, capacity=4, max_context=512)
    template = fixed_size_rows(pool, pool.template_slot)
    rng, live = random.Random(3), []
    for step in range(60):
        action = rng.choice(["alloc", "free", "reset", "fork", "prefill", "decode", "scratch"])
        if action == "alloc" and pool.free_slots:
            live.append(pool.alloc())
        elif action == "free" and live:
            pool.free(live.pop(rng.randrange(len(live))))
        elif action == "reset" and live:
            pool.reset(rng.choice(live))
        elif action == "fork" and live and pool.free_slots:
            src, dst = rng.choice(live), pool.alloc()
            pool.copy(src, dst)
            live.append(dst)
        elif action == "prefill" and live:
            model_prefill(model, pool, rng.choice(live), random_ids(rng.randint(1, 9), step))
        elif action == "decode" and live:
            model.decode(torch.randint(0, 256, (len(live),)), pool.tensors, StepBatch.decode(live))
        elif action == "scratch":  # what the runner's prefill warm-up does with the scratch slot
            pool.reset(pool.scratch_slot)
            model_prefill(model, pool, pool.scratch_slot, random_ids(5, step))
        assert all(0 <= slot < pool.capacity for slot in live)
        for rows, expect in zip(fixed_size_rows(pool, pool.template_slot), template, strict=True):
            assert all(torch.equal(rows[name], expect[name]) for name in expect), (step, action)


def test_a_prefill_after_reset_matches_a_brand_new_pool(row_copies) -> None:
    """A reset slot whose KV cache still holds an earlier session's entries (here NaN: anything at all) prefills and
    decodes, batched beside a longer session, bit for bit as a new pool's slot does."""
    model = make_model(MIXED, seed=4)
    history, prompt = random_ids(30, 50), random_ids(12, 51)

    def run(pool: StatePool, slot: int, other: int) -> torch.Tensor:
        ids = torch.tensor(prompt + history[:5])
        logits = model.prefill(ids, pool.tensors, StepBatch.prefill([slot, other], [12, 5]), all_logits=True)
        _, decoded = greedy(model, pool, [slot, other], logits[[11, 16]].argmax(-1).tolist(), 5)
        return torch.cat([logits.flatten(), decoded.flatten()])

    used = StatePool(model, capacity=2, max_context=64)
    slot, other = used.alloc(), used.alloc()
    model_prefill(model, used, slot, random_ids(60, 52))  # an earlier session fills the slot's KV cache
    model_prefill(model, used, other, history)
    used.free(slot)
    assert used.alloc() == slot
    for specs, state in zip(used.specs, used.tensors, strict=True):
        for name, spec in specs.items():
            if spec.per_token:
                state[name][slot] = float("nan")
    new = StatePool(model, capacity=2, max_context=64)
    model_prefill(model, new, other, history)
    assert torch.equal(run(used, slot, other), run(new, slot, other))


def test_forks_and_resets_refuse_the_template_row_and_overlapping_pairs() -> None:
    pool = StatePool(make_model(["mamba2"]), capacity=3)
    with pytest.raises(ValueError, match="not a session slot"):
        pool.reset(pool.template_slot)
    with pytest.raises(ValueError, match="not session slots"):
        pool.copy(pool.template_slot, 0)
    with pytest.raises(ValueError, match="also a src"):
        pool.copy_many([(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="named twice"):
        pool.copy_many([(0, 2), (1, 2)])
    assert sorted(pool.alloc() for _ in range(3)) == [0, 1, 2]
