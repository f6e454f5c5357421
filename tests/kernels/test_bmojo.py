"""B'MOJO Triton kernels (interpreted on the CPU, compiled on a GPU) against the float64 PyTorch reference.

Every check draws fresh random inputs and random memory states (sessions mid-chunk, at a chunk boundary, new, with a
partly filled eidetic store), uses random rows of a larger pool, poisons every buffer the Triton functions allocate,
and checks the outputs and every state tensor of the rows named, and that the other rows stay bit-for-bit unchanged.
Tolerances (relative): 1e-4 with fp32 inputs, 1e-2 with bf16 inputs; positions and counts exactly. Prefill packs
sequences of lengths 0, 1, within a chunk, exactly to a boundary and across several chunks. At the model level the
shipped MQAR checkpoint with B'MOJO layers must score the same through both paths.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.bmojo as bmojo_ops  # noqa: E402
from kvfree.kernels.bmojo import chunk as bmojo_chunk  # noqa: E402
from kvfree.kernels.bmojo import fused_recurrent as bmojo_step  # noqa: E402
from kvfree.kernels.bmojo import reference as bmojo_ref  # noqa: E402
from kvfree.kernels.bmojo.reference import MemoryState  # noqa: E402
from tests import kernel_checks  # noqa: E402
from tests.kernel_checks import DEVICE, assert_mqar_scores_the_same, cu_of, rel, seed  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
f64 = torch.float64
EXACT = ("t", "fad_n", "eid_n", "eid_pos")  # integer state: equal, not close


class Fading:
    """A layer-like fading projection: RMS-normalise y `[..., D]`, then random W_K, W_V (in y's dtype family)."""

    def __init__(self, g: torch.Generator, D: int, Hkv: int, dh: int, dtype: torch.dtype) -> None:
        self.wk = torch.randn(D, Hkv * dh, generator=g) / D**0.5
        self.wv = torch.randn(D, Hkv * dh, generator=g) / D**0.5
        self.shape, self.dtype = (Hkv, dh), dtype

    def __call__(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = f64 if y.dtype == f64 else self.dtype
        a = (y / y.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()).to(dt)
        return (a @ self.wk.to(DEVICE, dt)).unflatten(-1, self.shape), (a @ self.wv.to(DEVICE, dt)).unflatten(
            -1, self.shape
        )


def make_pools(g, S: int, w: int, m_f: int, m_e: int, Hkv: int, dh: int, D: int, L: int, dtype, t_rows) -> dict:
    """Pools of S rows holding consistent random memory states: row r at position t_rows[r] (0 is a new session,
    zeros everywhere); the eidetic store in key order with distinct positions before the ring's, full once a
    chunk has finished (one row with a partly filled store); y_buf, the ring and its scores random."""
    p = {
        "t": torch.tensor(t_rows, dtype=torch.int64),
        "y_buf": torch.randn(S, L, D, generator=g),
        "ring_k": torch.randn(S, w, Hkv, dh, generator=g),
        "ring_v": torch.randn(S, w, Hkv, dh, generator=g),
        "ring_eps": torch.rand(S, w, generator=g) * 2,
        "fad_k": torch.randn(S, m_f, Hkv, dh, generator=g),
        "fad_v": torch.randn(S, m_f, Hkv, dh, generator=g),
        "fad_n": torch.zeros(S, dtype=torch.int64),
        "eid_k": torch.randn(S, m_e, Hkv, dh, generator=g),
        "eid_v": torch.randn(S, m_e, Hkv, dh, generator=g),
        "eid_eps": torch.zeros(S, m_e),
        "eid_pos": torch.zeros(S, m_e, dtype=torch.int64),
        "eid_n": torch.zeros(S, dtype=torch.int64),
    }
    for r, t in enumerate(t_rows):
        if t == 0:
            for name, x in p.items():
                if name != "t":
                    x[r] = 0
            continue
        store_end = ((t - 1) // w) * w  # positions < store_end are summarised by the store (the lazy rule)
        p["fad_n"][r] = m_f if store_end > 0 else 0
        n = min(m_e, store_end) - (r % 5 == 3)  # now and then a store with free slots (never after a real chunk)
        n = max(n, 0)
        eps = (torch.rand(n, generator=g) * 3).sort(descending=True).values
        p["eid_eps"][r, :n] = eps
        p["eid_pos"][r, :n] = torch.randperm(max(store_end, n), generator=g)[:n]
        p["eid_n"][r] = n
        p["eid_k"][r, n:] = 0
        p["eid_v"][r, n:] = 0
    for name in KV:
        p[name] = p[name].to(dtype)
    return {name: x.to(DEVICE) for name, x in p.items()}


KV = ("ring_k", "ring_v", "fad_k", "fad_v", "eid_k", "eid_v")


def pools_f64(p: dict) -> dict:
    """The reference's pools: K/V in float64; scores and y_buf stay fp32, as the reference computes them (all
    selection arithmetic is fp32, so that every path selects alike)."""
    return {n: x.to(f64) if n in KV else x.clone() for n, x in p.items()}


def others(p: dict, idx: torch.Tensor) -> dict:
    keep = torch.ones(p["t"].shape[0], dtype=torch.bool, device=DEVICE)
    keep[idx.long()] = False
    return {n: x[keep].clone() for n, x in p.items()}


def check_states(p: dict, ref: dict, idx: torch.Tensor, before: dict, tol: float) -> None:
    i = idx.long()
    for name in MemoryState._fields:
        out, want = p[name][i], ref[name][i]
        if name in EXACT:
            assert torch.equal(out, want), name
        elif want.numel():
            assert rel(out, want) <= tol, (name, rel(out, want))
    after = others(p, idx)
    for name, x in before.items():
        assert torch.equal(after[name], x), f"{name}: a row not named changed"


def fields(p: dict) -> list[torch.Tensor]:
    return [p[name] for name in MemoryState._fields]


# -- decode ----------------------------------------------------------------------------------------------------------
# (dtype, w, m_f, m_e, Hq, Hkv, dh, D, taps, block_n, num_splits)
DECODE = [
    (torch.float32, 8, 4, 4, 2, 2, 16, 24, 4, None, 1),  # one key block, one split
    (torch.float32, 8, 4, 4, 4, 2, 16, 24, 4, 4, 3),  # GQA; blocks of 4 keys over 4 splits, combined
    (torch.float32, 6, 1, 6, 2, 1, 8, 20, 2, 4, None),  # m_e = w, dh below a block, w not a power of two
    (torch.float32, 8, 0, 0, 2, 2, 16, 24, 3, 4, 2),  # no memory: the paper's "Hybrid"
    (torch.bfloat16, 8, 2, 4, 2, 2, 16, 24, 4, 4, 2),
]


@pytest.mark.parametrize("dtype, w, m_f, m_e, Hq, Hkv, dh, D, taps, block_n, splits", DECODE)
def test_fused_recurrent_bmojo_matches_reference(poison, dtype, w, m_f, m_e, Hq, Hkv, dh, D, taps, block_n, splits):
    g = seed("step", dtype, w, m_f, m_e, Hq, Hkv, block_n, splits)
    L = max(taps, m_f)
    # Sessions at: a boundary with a full store, the first boundary, mid-chunk, new, one before a boundary, a
    # boundary with a partly filled store.
    t_rows = [5 * w, w, 3 * w + 2, 0, 2 * w - 1, 4 * w, 7 * w + 3, 9, 2 * w + 1]
    S = len(t_rows)
    p = make_pools(g, S, w, m_f, m_e, Hkv, dh, D, L, dtype, t_rows)
    idx = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32, device=DEVICE)[torch.randperm(6, generator=g)]
    B = len(idx)
    q, k, v = (torch.randn(B, H, dh, generator=g).to(dtype).to(DEVICE) for H in (Hq, Hkv, Hkv))
    y = torch.randn(B, D, generator=g).to(DEVICE)
    fading = Fading(g, D, Hkv, dh, dtype)
    ref = pools_f64(p)
    before = others(p, idx)

    o = bmojo_step.launch(q, k, v, y, *fields(p), idx, fading, taps, block_n=block_n, num_splits=splits)
    o_ref = bmojo_ref.fused_recurrent_bmojo(*(x.to(f64) for x in (q, k, v, y)), *fields(ref), idx, fading, taps)

    assert o.dtype == dtype and o.shape == (B, Hq, dh)
    assert rel(o, o_ref) <= TOL[dtype]
    check_states(p, ref, idx, before, TOL[dtype])


def test_decode_steps_across_boundaries_continue_like_the_reference(poison):
    """Many decode steps through several chunk boundaries (three sessions at different phases, one new): outputs and
    every state field stay with the float64 reference, eidetic positions exactly."""
    g = seed("steps")
    w, m_f, m_e, Hq, Hkv, dh, D, taps = 4, 2, 3, 2, 1, 16, 16, 3
    p = make_pools(g, 5, w, m_f, m_e, Hkv, dh, D, taps, torch.float32, [0, 6, 3, 0, 9])
    ref = pools_f64(p)
    idx = torch.tensor([3, 1, 2], dtype=torch.int32, device=DEVICE)
    fading = Fading(g, D, Hkv, dh, torch.float32)
    before = others(p, idx)
    outs, refs = [], []
    for _ in range(10):
        q, k, v = (torch.randn(3, H, dh, generator=g).to(DEVICE) for H in (Hq, Hkv, Hkv))
        y = torch.randn(3, D, generator=g).to(DEVICE)
        outs.append(bmojo_step.fused_recurrent_bmojo(q, k, v, y, *fields(p), idx, fading, taps))
        refs.append(bmojo_ref.fused_recurrent_bmojo(*(x.to(f64) for x in (q, k, v, y)), *fields(ref), idx, fading,
                                                    taps))  # fmt: skip
    assert rel(torch.stack(outs), torch.stack(refs)) <= 1e-5
    check_states(p, ref, idx, before, 1e-5)


# -- prefill ---------------------------------------------------------------------------------------------------------
# (dtype, w, m_f, m_e, Hq, Hkv, dh, D, taps, block_m, block_n)
PREFILL = [
    (torch.float32, 8, 4, 4, 2, 2, 16, 24, 4, None, 16),
    (torch.float32, 8, 2, 8, 4, 2, 16, 24, 3, 16, 16),  # GQA, m_e = w
    (torch.float32, 6, 1, 3, 2, 1, 8, 20, 2, 16, 16),  # w not a power of two, dh below a block
    (torch.float32, 8, 0, 0, 2, 2, 16, 24, 4, None, 16),  # no memory
    (torch.bfloat16, 8, 2, 4, 2, 2, 16, 24, 4, None, 16),
]
# Sequences: empty, 1 token, within a chunk, exactly to the next boundary, across one and several boundaries; their
# states: fresh, mid-chunk, at a boundary not yet published, a chunk-aligned fresh start.
LENS = [1, 0, 5, 3, 17, 9, 26]


def starts(w: int) -> list[int]:
    """Each sequence's state position: fresh; mid-chunk (empty sequence); a boundary not yet published; three
    before a boundary (the sequence ends on it); early in chunk 0; the first boundary; mid-chunk far in."""
    return [0, w + 3, 2 * w, 3 * w - 3, 3, w, 5 * w + 1]


@pytest.mark.parametrize("dtype, w, m_f, m_e, Hq, Hkv, dh, D, taps, block_m, block_n", PREFILL)
def test_chunk_bmojo_matches_reference(poison, dtype, w, m_f, m_e, Hq, Hkv, dh, D, taps, block_m, block_n):
    g = seed("chunk", dtype, w, m_f, m_e, Hq, Hkv, block_m)
    L = max(taps, m_f)
    t_rows = [2 * w + 1] * 9
    order = torch.randperm(9, generator=g)[: len(LENS)]
    for r, t0 in zip(order.tolist(), starts(w), strict=True):
        t_rows[r] = t0
    p = make_pools(g, 9, w, m_f, m_e, Hkv, dh, D, L, dtype, t_rows)
    idx = order.to(torch.int32).to(DEVICE)
    n = sum(LENS)
    q, k, v = (torch.randn(n, H, dh, generator=g).to(dtype).to(DEVICE) for H in (Hq, Hkv, Hkv))
    y = torch.randn(n, D, generator=g).to(DEVICE)
    fading = Fading(g, D, Hkv, dh, dtype)
    ref = pools_f64(p)
    before = others(p, idx)
    cu = cu_of(LENS)

    o = bmojo_chunk.launch(q, k, v, y, *fields(p), idx, cu, fading, taps, cu_seqlens_cpu=cu.cpu(), block_m=block_m,
                           block_n=block_n)  # fmt: skip
    o_ref = bmojo_ref.chunk_bmojo(*(x.to(f64) for x in (q, k, v)), y, *fields(ref), idx, cu, fading, taps)

    assert o.dtype == dtype and o.shape == (n, Hq, dh)
    assert rel(o, o_ref) <= TOL[dtype]
    check_states(p, ref, idx, before, TOL[dtype])


def test_prefill_then_decode_continues_the_sequence(poison):
    """Prefill with the chunk kernels, then decode steps through a boundary with the step kernels: the same outputs
    and states as the reference over the whole sequence, for three sessions at different phases."""
    g = seed("continue")
    w, m_f, m_e, Hq, Hkv, dh, D, taps = 8, 2, 4, 2, 2, 16, 16, 4
    p = make_pools(g, 4, w, m_f, m_e, Hkv, dh, D, taps, torch.float32, [0, 11, 0, 16])
    ref = pools_f64(p)
    idx = torch.tensor([2, 1, 3], dtype=torch.int32, device=DEVICE)
    fading = Fading(g, D, Hkv, dh, torch.float32)
    lens = [13, 4, 8]
    q, k, v = (torch.randn(sum(lens), H, dh, generator=g).to(DEVICE) for H in (Hq, Hkv, Hkv))
    y = torch.randn(sum(lens), D, generator=g).to(DEVICE)
    outs = [bmojo_chunk.chunk_bmojo(q, k, v, y, *fields(p), idx, cu_of(lens), fading, taps)]
    refs = [bmojo_ref.chunk_bmojo(q.double(), k.double(), v.double(), y, *fields(ref), idx, cu_of(lens), fading, taps)]
    for _ in range(5):
        q, k, v = (torch.randn(3, H, dh, generator=g).to(DEVICE) for H in (Hq, Hkv, Hkv))
        y = torch.randn(3, D, generator=g).to(DEVICE)
        outs.append(bmojo_step.fused_recurrent_bmojo(q, k, v, y, *fields(p), idx, fading, taps))
        refs.append(bmojo_ref.fused_recurrent_bmojo(q.double(), k.double(), v.double(), y, *fields(ref), idx, fading,
                                                    taps))  # fmt: skip
    assert rel(torch.cat(outs), torch.cat(refs)) <= 1e-5
    check_states(p, ref, idx, {}, 1e-5)


def test_bad_shapes_are_refused():
    g = seed("shapes")
    p = make_pools(g, 3, 8, 2, 4, 2, 16, 16, 4, torch.float32, [0, 3, 9])
    q, k, v = (torch.randn(2, 2, 16, generator=g) for _ in range(3))
    idx = torch.tensor([0, 1], dtype=torch.int32)
    fading = Fading(g, 16, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="B'MOJO pools"):
        bmojo_step.fused_recurrent_bmojo(q, k, v, torch.randn(2, 16), *fields(p | {"ring_eps": p["ring_eps"].double()}),
                                         idx, fading)  # fmt: skip
    with pytest.raises(ValueError, match="predictor_taps"):
        bmojo_step.fused_recurrent_bmojo(q, k, v, torch.randn(2, 16), *fields(p), idx, fading, 5)


# -- dispatch --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, want", [("reference", "reference"), ("triton", "triton")])
def test_ops_dispatch_to_what_the_mode_says(monkeypatch, mode, want):
    """KVFREE_KERNELS picks the implementation; fp64 inputs or K/V pools always take the reference."""
    calls = kernel_checks.recorded_dispatch(
        monkeypatch, mode, (bmojo_ref, "fused_recurrent_bmojo", "reference"),
        (bmojo_step, "fused_recurrent_bmojo", "triton"), (bmojo_ref, "chunk_bmojo", "reference"),
        (bmojo_chunk, "chunk_bmojo", "triton"),
    )  # fmt: skip
    g = seed("dispatch")
    p = make_pools(g, 3, 8, 2, 4, 2, 16, 16, 4, torch.float32, [0, 3, 9])
    q = torch.randn(2, 2, 16, generator=g).to(DEVICE)
    idx = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    bmojo_ops.fused_recurrent_bmojo(q, q, q, q[:, 0], *fields(p), idx, None)
    bmojo_ops.fused_recurrent_bmojo(q.double(), q, q, q[:, 0], *fields(p), idx, None)
    bmojo_ops.fused_recurrent_bmojo(q, q, q, q[:, 0], *fields(pools_f64(p)), idx, None)
    bmojo_ops.chunk_bmojo(q, q, q, q[:, 0], *fields(p), idx, cu_of([1, 1]), None)
    assert calls == [want, "reference", "reference", want]
    assert bmojo_ops.decode_graph_safe(DEVICE, torch.float32) == (want == "triton")


# -- whole models ----------------------------------------------------------------------------------------------------
def test_bmojo_model_logits_agree_between_reference_and_triton(monkeypatch):
    """tests/engine/test_bmojo.py's small B'MOJO model (w=8, m_f=2, m_e=5, GQA) in fp32: logits of a prefill in two
    pieces and decode steps through chunk boundaries agree through either path."""
    from kvfree.engine.model.step_batch import StepBatch
    from kvfree.engine.state.pool import StatePool
    from tests.engine.test_bmojo import make_model

    model = make_model(["bmojo", "bmojo"], seed=3).to(DEVICE).eval()
    g = seed("model")
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (19, 6)]

    def run() -> torch.Tensor:
        pool = StatePool(model, capacity=4)
        slots, rows = [3, 1], []
        with torch.inference_mode():
            for lo, hi in [(0, 5), (5, None)]:
                pieces = [pr[lo:hi] for pr in prompts]
                ids = torch.tensor([x for pc in pieces for x in pc], device=DEVICE)
                batch = StepBatch.prefill(slots, [len(pc) for pc in pieces], DEVICE)
                rows.append(model.prefill(ids, pool.tensors, batch))
            ids = rows[-1].argmax(-1)
            for _ in range(6):
                rows.append(model.decode(ids, pool.tensors, StepBatch.decode(slots, DEVICE)))
                ids = rows[-1].argmax(-1)
        return torch.cat(rows)

    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    ref = run()
    for op in (bmojo_ops.chunk_bmojo, bmojo_ops.fused_recurrent_bmojo):  # the B'MOJO ops only: Mamba-2 stays reference
        monkeypatch.setattr(op, "device_check", lambda device: True)
    assert bmojo_ops.decode_graph_safe(DEVICE, torch.float32)
    out = run()
    assert rel(out, ref) <= 1e-4


def test_shipped_mqar_bmojo_checkpoint_scores_the_same_through_triton(monkeypatch):
    """checkpoints/trained/mqar-mamba2-bmojo on held-out MQAR sequences (M=8, gap=64: prefill, then teacher-forced
    decode) through the B'MOJO Triton kernels scores what the reference scores, and what its report says. Its
    Mamba-2 layers (and the B'MOJO layers' own SSM) stay on the reference, to keep the interpreted run short."""
    assert_mqar_scores_the_same("mqar-mamba2-bmojo", bmojo_ops, monkeypatch)
