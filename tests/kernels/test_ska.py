"""SKA Triton kernels (interpreted on the CPU, compiled on a GPU) against the PyTorch reference with fp64 statistics.

The reference here is `kvfree.kernels.ska.reference` with fp64 accumulators on the same inputs (bf16 inputs upcast):
the highest precision SKA's state layout has (its readout J q is fp32 by design, docs/design/ska.md §5). Every check
draws fresh random inputs, uses pool rows at assorted positions (new sessions, mid-chunk, exactly at a chunk
boundary, several chunks in), packs sequences of lengths 0, 1, one short of a chunk, a chunk, one past it and several
chunks, poisons every buffer the Triton functions allocate, and checks the rows not named bit-for-bit unchanged.
Tolerances (relative, outputs and every state field): 1e-4 with fp32 inputs, 1e-2 with bf16 inputs, for fp64
accumulators (what SKA ships with) and fp32 ones (the MQAR checkpoints'). The shipped MQAR checkpoint with SKA layers
must score the same through both paths.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.ska as ska_ops  # noqa: E402
from kvfree.engine.model.layers.ska import SKAMixer  # noqa: E402
from kvfree.kernels.ska import chunk as ska_chunk  # noqa: E402
from kvfree.kernels.ska import fused_recurrent as ska_step  # noqa: E402
from kvfree.kernels.ska import reference as ska_ref  # noqa: E402
from kvfree.kernels.ska.rebuild import device_fallback_count  # noqa: E402
from kvfree.kernels.ska.reference import SKAState  # noqa: E402
from tests.kernel_checks import DEVICE, assert_mqar_scores_the_same, cu_of, rel, seed, untouched  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
f64 = torch.float64
S = 8  # chunk size
OP = {"chunk_size": S, "eps": 1e-3, "eta": 1.3, "gamma": 1.2, "order": 2, "power_iters": 6}
POSITIONS = [0, 16, 3, 8, 11, 29, 0, 5, 24]  # tokens each pool row has consumed (16, 8, 24: at a chunk boundary)


def inputs(g: torch.Generator, n: int, H: int, r: int, P: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Raw keys, queries and values as the layer's projections give them (fp32, or `dtype` for the op checks)."""
    return [torch.randn(n, H, d, generator=g).to(dtype).to(DEVICE) for d in (r, r, P)]


def make_pool(g: torch.Generator, H: int, r: int, P: int, acc: torch.dtype, key_norm: str) -> SKAState:
    """A pool of len(POSITIONS) rows, row i having consumed POSITIONS[i] random tokens (through the reference)."""
    rows = []
    for n in POSITIONS:
        row = ska_ref.ska_empty_state(1, H, r, P, acc)
        if n:
            _, row = ska_ref.ska_chunked(*(t[None].cpu() for t in inputs(g, n, H, r, P)), row, 0, key_norm=key_norm,
                                         **OP)  # fmt: skip
        rows.append(row)
    return SKAState(*(torch.cat(fields).to(DEVICE) for fields in zip(*rows, strict=True)))


def with_f64_stats(pool: SKAState) -> SKAState:
    """A copy of the pool for the reference: the same state with fp64 accumulators."""
    return SKAState(
        *(t.to(f64, copy=True) if name in "GMC" else t.clone() for name, t in zip(SKAState._fields, pool, strict=True))
    )


def check_pools(got: SKAState, want: SKAState, before: SKAState, idx: torch.Tensor, tol: float) -> None:
    """Named rows within tol (pos exact), the others bit-identical to `before`."""
    i = idx.long()
    for name, a, b, old in zip(SKAState._fields, got, want, before, strict=True):
        if name == "pos":
            assert torch.equal(a[i], b[i])
        else:
            assert rel(a[i], b[i]) <= tol, name
        assert torch.equal(untouched(a, idx), untouched(old, idx)), name


# -- decode ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "acc, mode, key_norm, dtype, r, P",
    [
        (f64, "C", "causal", torch.float32, 12, 10),  # r, P below a tile (masked), P != r catches transposes
        (f64, "C", "frozen", torch.float32, 16, 16),
        (f64, "P", "causal", torch.float32, 12, 20),
        (torch.float32, "C", "causal", torch.float32, 12, 10),
        (torch.float32, "P", "frozen", torch.float32, 16, 8),
        (f64, "C", "causal", torch.bfloat16, 12, 10),
    ],
)
def test_fused_recurrent_ska_matches_reference(poison, acc, mode, key_norm, dtype, r, P):
    g = seed("step", acc, mode, key_norm, dtype, r, P)
    H = 2
    pool = make_pool(g, H, r, P, acc, key_norm)
    want, before = with_f64_stats(pool), SKAState(*(t.clone() for t in pool))
    idx = torch.tensor([5, 1, 0, 4, 2, 8], dtype=torch.int32, device=DEVICE)  # 29, 16 and 24 enter, 0 is new
    # Mode C: the second step leaves row 5 at 31, the third takes it across a boundary. Mode P rebuilds every step.
    for step in range(3 if mode == "C" else 1):
        z, q, v = inputs(g, len(idx), H, r, P, dtype)
        y = ska_step.fused_recurrent_ska(z, q, v, pool, idx, **OP, key_norm=key_norm, mode=mode)
        y_ref = ska_ref.fused_recurrent_ska(z.float(), q.float(), v.float(), want, idx, **OP, key_norm=key_norm,
                                            mode=mode)  # fmt: skip
        assert y.shape == (len(idx), H, P) and y.dtype == torch.float32
        assert rel(y, y_ref) <= TOL[dtype], step
    check_pools(pool, want, before, idx, TOL[dtype])


def test_fallback_jitter_and_failure_on_the_device(poison):
    """A Gram that is not positive definite at a chunk boundary is factorised with jitter on the device, as the
    reference does, and counted; non-finite statistics give J = NaN (the reference raises) and count a failure."""
    g = seed("fallback")
    H, r, P = 2, 8, 8
    pool = make_pool(g, H, r, P, f64, "causal")
    row = 3  # pos 8: enters chunk 1
    pool.G[row, 0] = -torch.eye(r, dtype=f64, device=DEVICE) * 1e-3 * pool.m[row, 0].double() ** 2 * 1.05
    pool.G[row, 1, 2, 2] = float("nan")
    want = with_f64_stats(pool)
    idx = torch.tensor([row], dtype=torch.int32, device=DEVICE)
    z, q, v = inputs(g, 1, H, r, P)
    before = ska_ops.cholesky_fallback_count()
    fails = device_fallback_count()[1]
    y = ska_step.fused_recurrent_ska(z, q, v, pool, idx, **OP)
    assert ska_ops.cholesky_fallback_count() - before == 1 + 3  # head 0: one retry; head 1: all three
    assert device_fallback_count()[1] - fails == 1
    assert pool.J[row, 1].isnan().all() and y[0, 1].isnan().all()
    J_ref = ska_ref.ska_readout(want.G[row, :1], want.M[row, :1], want.C[row, :1], want.m[row, :1], eps=OP["eps"],
                                eta=OP["eta"], gamma=OP["gamma"], order=2, power_iters=6).float()  # fmt: skip
    assert rel(pool.J[row, :1], J_ref) <= 1e-4


# -- prefill ---------------------------------------------------------------------------------------------------------
SEQS = [(3, 7), (0, 5), (5, 12), (1, 19), (2, 4), (4, 9), (6, 0), (7, 1), (8, 17)]  # (pool row, new tokens)


@pytest.mark.parametrize(
    "acc, mode, key_norm, dtype, r, P",
    [
        (f64, "C", "causal", torch.float32, 12, 10),
        (f64, "C", "frozen", torch.float32, 16, 16),
        (f64, "P", "causal", torch.float32, 12, 20),
        (torch.float32, "C", "causal", torch.float32, 12, 10),  # tensor-core chunk sums, dot products in the build
        (torch.float32, "P", "frozen", torch.float32, 16, 8),
        (f64, "C", "causal", torch.bfloat16, 12, 10),
    ],
)
def test_chunk_ska_matches_reference(poison, acc, mode, key_norm, dtype, r, P):
    """Packed sequences continuing rows at every kind of position: lengths 0, 1, across chunk boundaries (one short
    of a chunk from a mid-chunk start, exactly to a boundary, several chunks)."""
    g = seed("chunk", acc, mode, key_norm, dtype, r, P)
    H = 2
    pool = make_pool(g, H, r, P, acc, key_norm)
    want, before = with_f64_stats(pool), SKAState(*(t.clone() for t in pool))
    lens = [n for _, n in SEQS]
    idx = torch.tensor([row for row, _ in SEQS], dtype=torch.int32, device=DEVICE)
    cu = cu_of(lens)
    z, q, v = inputs(g, sum(lens), H, r, P, dtype)
    y = ska_chunk.chunk_ska(z, q, v, pool, idx, cu, **OP, key_norm=key_norm, mode=mode, cu_seqlens_cpu=cu.cpu())
    y_ref = ska_ref.chunk_ska(z.float(), q.float(), v.float(), want, idx, cu, **OP, key_norm=key_norm, mode=mode)
    assert y.shape == (sum(lens), H, P) and y.dtype == torch.float32
    assert rel(y, y_ref) <= TOL[dtype]
    check_pools(pool, want, before, idx, TOL[dtype])


def test_prefill_in_pieces_then_decode_is_one_sequence(poison):
    """Two sessions: a prompt prefilled in two calls (the second continuing mid-chunk), then decode steps across a
    boundary, through the kernels == the reference over the whole sequence (mode C, fp64 statistics)."""
    g = seed("continue")
    H, r, P = 2, 12, 10
    pool = SKAState(*(t.to(DEVICE) for t in ska_ref.ska_empty_state(3, H, r, P, f64)))
    want = SKAState(*(t.clone() for t in pool))
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    outs, refs = [], []
    for lens in ([11, 3], [6, 13]):
        z, q, v = inputs(g, sum(lens), H, r, P)
        outs.append(ska_chunk.chunk_ska(z, q, v, pool, idx, cu_of(lens), **OP))
        refs.append(ska_ref.chunk_ska(z, q, v, want, idx, cu_of(lens), **OP))
    for _ in range(8):  # positions 17 and 16 -> 25 and 24: both cross a boundary
        z, q, v = inputs(g, 2, H, r, P)
        outs.append(ska_step.fused_recurrent_ska(z, q, v, pool, idx, **OP))
        refs.append(ska_ref.fused_recurrent_ska(z, q, v, want, idx, **OP))
    assert rel(torch.cat(outs), torch.cat(refs)) <= 1e-5
    for name, a, b in zip(SKAState._fields, pool, want, strict=True):
        assert torch.equal(a, b) if name == "pos" else rel(a, b) <= 1e-5, name


def test_bad_shapes_are_refused():
    g = seed("shapes")
    H, r, P = 2, 8, 8
    pool = make_pool(g, H, r, P, f64, "causal")
    z, q, v = inputs(g, 2, H, r, P)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="shapes"):
        ska_step.fused_recurrent_ska(z, q, v, pool._replace(J=pool.J.double()), idx, **OP)
    with pytest.raises(ValueError, match="shapes"):
        ska_chunk.chunk_ska(z[:, :1], q, v, pool, idx, cu_of([1, 1]), **OP)
    with pytest.raises(ValueError, match="mode"):
        ska_step.fused_recurrent_ska(z, q, v, pool, idx, **OP, mode="X")


# -- dispatch --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernels, want", [("reference", "reference"), ("triton", "triton")])
def test_ops_dispatch_to_what_the_mode_says(monkeypatch, kernels, want):
    """KVFREE_KERNELS picks the implementation; float64 inputs always take the reference. The mixer declares no
    graph blocker exactly where its decode runs the kernels."""
    calls = []
    monkeypatch.setenv("KVFREE_KERNELS", kernels)
    monkeypatch.setattr(ska_ref, "fused_recurrent_ska", lambda *a, **k: calls.append("reference"))
    monkeypatch.setattr(ska_step, "fused_recurrent_ska", lambda *a, **k: calls.append("triton"))
    g = seed("dispatch")
    pool = make_pool(g, 2, 8, 8, f64, "causal")
    z, q, v = inputs(g, 2, 2, 8, 8)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    ska_ops.fused_recurrent_ska(z, q, v, pool, idx, **OP)
    ska_ops.fused_recurrent_ska(z.double(), q.double(), v.double(), pool, idx, **OP)
    assert calls == [want, "reference"]
    mixer = SKAMixer(16, SKAMixer.config_class(num_heads=2, rank=8, head_dim=8)).to(DEVICE)
    assert (mixer.graph_blocker == "") == (want == "triton")


# -- whole models ----------------------------------------------------------------------------------------------------
def test_shipped_mqar_ska_checkpoint_scores_the_same_through_triton(monkeypatch):
    """checkpoints/trained/mqar-mamba2-ska (fp32 accumulators, mode C) on held-out MQAR sequences (M=8, gap=64:
    prefill, then teacher-forced decode across a chunk boundary) through the SKA Triton kernels scores what the
    reference scores, and what its report says. Its Mamba-2 layers stay on the reference (a shorter interpreted run)."""
    assert_mqar_scores_the_same("mqar-mamba2-ska", ska_ops, monkeypatch)
