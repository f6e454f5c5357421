"""Gated KalmaNet Triton kernels (interpreted on the CPU, compiled on a GPU) against the float64 PyTorch reference.

Every check draws fresh random inputs, packs sequences of unequal lengths (1, one short of a chunk, one chunk, one
past it, several chunks, and an empty one), uses random rows of a larger pool (some fresh, some continuing a state),
poisons every buffer the Triton functions allocate, and checks that the rows not named stay bit-for-bit unchanged.
Tolerances (relative, on outputs and states): 1e-4 with fp32 inputs, 1e-2 with bf16 inputs. At the model level, the
1e-3 output tolerance of tests/engine/test_gka.py (its docstring says why it is not 1e-5), and the shipped MQAR
checkpoint must score the same through both paths.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.gka as gka_ops  # noqa: E402
from kvfree.kernels.gka import chunk as gka_chunk  # noqa: E402
from kvfree.kernels.gka import fused_recurrent as gka_step  # noqa: E402
from kvfree.kernels.gka import reference as gka_ref  # noqa: E402
from tests import kernel_checks  # noqa: E402
from tests.engine.test_gka import OUT_TOL, make_model  # noqa: E402
from tests.kernel_checks import DEVICE, assert_mqar_scores_the_same, cu_of, rel, run_layers, seed, untouched  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
LENS = [1, 63, 64, 0, 65, 200]  # 1 token; one short of a chunk; a chunk; empty; one past it; several chunks
RIDGE, ITERS = 0.02, 30
f64 = torch.float64


def op_inputs(g, n: int, He: int, D: int, Dv: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """As the layer hands them over: unit queries, keys of norm beta in (0, 1), values times beta (q, k, v in
    `dtype`), fp32 log decays with a few dozen tokens of memory and alpha in (0, 1)."""
    beta = torch.rand(n, He, 1, generator=g)
    q = F.normalize(torch.randn(n, He, D, generator=g), dim=-1)
    k = F.normalize(torch.randn(n, He, D, generator=g), dim=-1) * beta
    v = torch.randn(n, He, Dv, generator=g) * beta
    decay = -0.2 * torch.rand(n, He, generator=g)
    alpha = torch.rand(n, He, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)] + [decay.to(DEVICE), alpha.to(DEVICE)]


def make_pools(g, S: int, He: int, D: int, Dv: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 pools of S rows, H rows PSD (as a running sum of k k^T is), and n distinct random rows of them; every
    third from the second is reset to zeros (a fresh session)."""
    root = torch.randn(S, He, D, D, generator=g) / D
    h = root @ root.transpose(-1, -2) * 4
    s = torch.randn(S, He, D, Dv, generator=g)
    idx = torch.randperm(S, generator=g)[:n]
    h[idx[1::3]] = 0
    s[idx[1::3]] = 0
    return h.to(DEVICE), s.to(DEVICE), idx.to(torch.int32).to(DEVICE)


# -- prefill ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, He, D, Dv, chunk, block_r, decay_h",
    [
        (torch.float32, 2, 16, 16, 64, None, True),
        (torch.float32, 2, 8, 6, 16, None, True),  # D, Dv below a block (masked), Dv != D catches transposes
        (torch.float32, 1, 32, 16, 32, 16, True),  # two row tiles of the states in the chunk-state pass
        (torch.bfloat16, 2, 16, 32, 32, None, True),  # Dv > D: S has more column blocks than H
        (torch.float32, 1, 32, 16, 32, 16, False),  # H undecayed (use_forgetting_gate_kk = false), S decayed
    ],
)
def test_chunk_gka_matches_reference(poison, dtype, He, D, Dv, chunk, block_r, decay_h):
    g = seed("chunk", dtype, He, D, Dv, chunk)
    inp = op_inputs(g, sum(LENS), He, D, Dv, dtype)
    h, s, idx = make_pools(g, 9, He, D, Dv, len(LENS))
    h_ref, s_ref = h.to(f64), s.to(f64)
    rest_h, rest_s = untouched(h, idx), untouched(s, idx)
    cu = cu_of(LENS)

    o = gka_chunk.launch(*inp, h, s, idx, cu, RIDGE, ITERS, D**-0.5, chunk, cu_seqlens_cpu=cu.cpu(), block_r=block_r,
                         decay_h=decay_h)  # fmt: skip
    o_ref = gka_ref.chunk_gka(*(t.to(f64) for t in inp), h_ref, s_ref, idx, cu, RIDGE, ITERS, D**-0.5, 64,
                              decay_h=decay_h)  # fmt: skip

    i = idx.long()
    assert o.dtype == dtype and o.shape == (sum(LENS), He, Dv)
    assert rel(o, o_ref) <= TOL[dtype]
    assert rel(h[i], h_ref[i]) <= TOL[dtype] and rel(s[i], s_ref[i]) <= TOL[dtype]
    assert torch.equal(untouched(h, idx), rest_h) and torch.equal(untouched(s, idx), rest_s)


def test_chunk_gka_splits_like_one_prefill(poison):
    """A prompt prefilled in two calls (the second continuing the states the first left in the pool) gives the
    outputs and states of one call; so does a different chunk length."""
    g = seed("split")
    He, D, Dv = 2, 16, 16
    lens = [70, 33]
    inp = op_inputs(g, sum(lens), He, D, Dv, torch.float32)
    h, s, idx = make_pools(g, 5, He, D, Dv, 2)
    h2, s2 = h.clone(), s.clone()
    o_one = gka_chunk.chunk_gka(*inp, h, s, idx, cu_of(lens), RIDGE, ITERS, D**-0.5, 32)
    cut = [40, 20]  # 40 tokens of the first sequence, 20 of the second, then the rest
    first = torch.cat([torch.arange(0, 40), torch.arange(70, 90)])
    second = torch.cat([torch.arange(40, 70), torch.arange(90, 103)])
    o_a = gka_chunk.chunk_gka(*(t[first] for t in inp), h2, s2, idx, cu_of(cut), RIDGE, ITERS, D**-0.5, 16)
    o_b = gka_chunk.chunk_gka(*(t[second] for t in inp), h2, s2, idx, cu_of([30, 13]), RIDGE, ITERS, D**-0.5, 64)
    o_two = torch.empty_like(o_one)
    o_two[first], o_two[second] = o_a, o_b
    assert rel(o_two, o_one) <= 1e-5
    assert rel(h2, h) <= 1e-6 and rel(s2, s) <= 1e-6


# -- decode ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, He, D, Dv, block_v, decay_h",
    [
        (torch.float32, 2, 16, 16, None, True),  # one S block, loaded before the solve
        (torch.float32, 3, 8, 6, None, True),
        (torch.float32, 2, 16, 48, 16, True),  # S streamed in three column blocks after the solve (the last masked)
        (torch.bfloat16, 2, 32, 16, None, True),
        (torch.float32, 2, 16, 48, 16, False),  # H undecayed (use_forgetting_gate_kk = false), S decayed
    ],
)
def test_fused_recurrent_gka_matches_reference(poison, dtype, He, D, Dv, block_v, decay_h):
    g = seed("step", dtype, He, D, Dv, block_v)
    B = 5
    inp = op_inputs(g, B, He, D, Dv, dtype)
    h, s, idx = make_pools(g, 11, He, D, Dv, B)
    h_ref, s_ref = h.to(f64), s.to(f64)
    rest_h, rest_s = untouched(h, idx), untouched(s, idx)

    o = gka_step.launch(*inp, h, s, idx, RIDGE, ITERS, D**-0.5, block_v=block_v, decay_h=decay_h)
    o_ref = gka_ref.fused_recurrent_gka(*(t.to(f64) for t in inp), h_ref, s_ref, idx, RIDGE, ITERS, D**-0.5,
                                        decay_h=decay_h)  # fmt: skip

    i = idx.long()
    assert o.dtype == dtype and o.shape == (B, He, Dv)
    assert rel(o, o_ref) <= TOL[dtype]
    assert rel(h[i], h_ref[i]) <= TOL[dtype] and rel(s[i], s_ref[i]) <= TOL[dtype]
    assert torch.equal(untouched(h, idx), rest_h) and torch.equal(untouched(s, idx), rest_s)


@pytest.mark.parametrize("decay_h", [True, False])
def test_chunk_then_decode_continues_the_sequence(poison, decay_h):
    """Prefill with the chunk kernel, then decode steps with the step kernel: the same outputs and states as the
    reference over the whole sequence, for two sessions at once (also with H undecayed, `decay_h=False`)."""
    g = seed("continue")
    He, D, Dv = 2, 16, 16
    lens, steps = [37, 5], 3
    prompt = op_inputs(g, sum(lens), He, D, Dv, torch.float32)
    h, s, idx = make_pools(g, 6, He, D, Dv, 2)
    h_ref, s_ref = h.to(f64), s.to(f64)
    kw = {"decay_h": decay_h}
    outs = [gka_chunk.chunk_gka(*prompt, h, s, idx, cu_of(lens), RIDGE, ITERS, 0.25, **kw)]
    refs = [gka_ref.chunk_gka(*(t.to(f64) for t in prompt), h_ref, s_ref, idx, cu_of(lens), RIDGE, ITERS, 0.25, **kw)]
    for _ in range(steps):
        tok = op_inputs(g, 2, He, D, Dv, torch.float32)
        outs.append(gka_step.fused_recurrent_gka(*tok, h, s, idx, RIDGE, ITERS, 0.25, **kw))
        refs.append(gka_ref.fused_recurrent_gka(*(t.to(f64) for t in tok), h_ref, s_ref, idx, RIDGE, ITERS, 0.25, **kw))
    assert rel(torch.cat(outs), torch.cat(refs)) <= 1e-4
    assert rel(h, h_ref) <= 1e-5 and rel(s, s_ref) <= 1e-5


def test_bad_shapes_are_refused():
    g = seed("shapes")
    inp = op_inputs(g, 4, 2, 16, 16, torch.float32)
    h, s, idx = make_pools(g, 6, 2, 16, 16, 4)
    with pytest.raises(ValueError, match="fp32 pools"):
        gka_step.fused_recurrent_gka(*inp, h.double(), s, idx, RIDGE, ITERS, 0.25)
    with pytest.raises(ValueError, match="shapes"):
        gka_chunk.chunk_gka(*inp, h[:, :1], s, idx[:1], cu_of([4]), RIDGE, ITERS, 0.25)


# -- dispatch --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, want", [("reference", "reference"), ("triton", "triton")])
def test_ops_dispatch_to_what_the_mode_says(monkeypatch, mode, want):
    """KVFREE_KERNELS picks the implementation; fp64 inputs or pools always take the reference (the kernels are
    fp32)."""
    calls = kernel_checks.recorded_dispatch(
        monkeypatch, mode, (gka_ref, "fused_recurrent_gka", "reference"), (gka_step, "fused_recurrent_gka", "triton")
    )
    g = seed("dispatch")
    inp = op_inputs(g, 2, 2, 16, 16, torch.float32)
    h, s, idx = make_pools(g, 4, 2, 16, 16, 2)
    gka_ops.fused_recurrent_gka(*inp, h, s, idx, RIDGE, ITERS, 0.25)
    gka_ops.fused_recurrent_gka(*(t.double() for t in inp), h.double(), s.double(), idx, RIDGE, ITERS, 0.25)
    assert calls == [want, "reference"]


# -- whole models ----------------------------------------------------------------------------------------------------


def test_gka_model_logits_agree_between_reference_and_triton(monkeypatch):
    """tests/engine/test_gka.py's model (two GKA layers, D=8, Dv=6) in fp32: logits of a split prefill and decode steps
    agree within that file's OUT_TOL through either path."""
    model = make_model(["gka", "gka"], seed=3, mlp=True).to(DEVICE).eval()
    g = seed("model")
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (23, 14)]
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    ref = run_layers(model, prompts, steps=3)
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    out = run_layers(model, prompts, steps=3)
    assert rel(out, ref) <= OUT_TOL


def test_shipped_mqar_gka_checkpoint_scores_the_same_through_triton(monkeypatch):
    """checkpoints/trained/mqar-mamba2-gka on held-out MQAR sequences (M=8, gap=64: prefill, then teacher-forced
    decode) through the GKA Triton kernels scores what the reference scores, and what its report says. Its Mamba-2
    layers stay on the reference, to keep the interpreted run short."""
    assert_mqar_scores_the_same("mqar-mamba2-gka", gka_ops, monkeypatch)
