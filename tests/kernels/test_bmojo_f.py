"""B'MOJO-F Triton kernels (interpreted on the CPU, compiled on a GPU) against the float64 PyTorch reference, and the
reference against the per-session math the layer ran before (the old `BMojoFMixer._session`, kept here as the
oracle).

Every kernel check draws fresh random inputs, uses random rows of a larger pool whose rings hold stale random data
(a fresh session must not read them), packs sequences of unequal lengths (1 token, fewer than W, more than 2W, an
empty one), continues sessions whose rings are partly filled, wrapped once (past W) and fully wrapped (past 2W),
poisons every buffer the Triton functions allocate, and checks that the rows not named stay bit-for-bit unchanged.
Tolerances (relative, on outputs): 1e-5 with fp32 inputs, 1e-2 with bf16 inputs; the rings and lengths written are
the reference's bit for bit. Shapes are tiny (W <= 8, D <= 24): the interpreter runs every program one by one.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.bmojo_f as ops  # noqa: E402
from kvfree.kernels.bmojo_f import chunk as bmf_chunk  # noqa: E402
from kvfree.kernels.bmojo_f import fused_recurrent as bmf_step  # noqa: E402
from kvfree.kernels.bmojo_f import reference as bmf_ref  # noqa: E402
from tests.kernel_checks import DEVICE, cu_of, rel, seed, untouched  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
f64 = torch.float64
RINGS = ("k_ctx", "v_ctx", "k_fade", "v_fade")
BLOCK_EDGES = 16 if DEVICE.type == "cuda" else 8
EDGES = {"block_m": BLOCK_EDGES, "block_n": BLOCK_EDGES, "edges": True}


def make_case(g: torch.Generator, T: int, Hq: int, Hkv: int, D: int, W: int, S: int, past: list[int],
              dtype: torch.dtype) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """T tokens' q, k, v, qf, kf, vf (unit-scale, in `dtype`), pools of S rows (rings of stale random data in
    `dtype`, lengths random) and len(past) distinct random slots whose lengths are `past`."""
    inp = [torch.randn(T, h, D, generator=g).to(DEVICE, dtype) for h in (Hq, Hkv, Hkv, Hq, Hkv, Hkv)]
    pools = {name: torch.randn(S, size, Hkv, D, generator=g).to(DEVICE, dtype)
             for name, size in zip(RINGS, (W, W, 2 * W, 2 * W), strict=True)}  # fmt: skip
    idx = torch.randperm(S, generator=g)[: len(past)].to(DEVICE, torch.int32)
    pools["length"] = torch.randint(0, 50, (S,), generator=g).to(DEVICE)
    pools["length"][idx.long()] = torch.tensor(past, device=DEVICE)
    return inp, pools, idx


def as_f64(pools: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float64 copy of the pools (lengths copied as they are)."""
    return {name: t.to(f64, copy=True) if t.is_floating_point() else t.clone() for name, t in pools.items()}


def assert_pools_match(pools: dict, ref: dict, before: dict, idx: torch.Tensor) -> None:
    """The named rows as the reference wrote them (the rings cast back to their dtype: bit for bit), the rest
    untouched."""
    for name, t in pools.items():
        assert torch.equal(t, ref[name].to(t.dtype)), name
        assert torch.equal(untouched(t, idx), before[name]), name


# -- the reference is the math the layer ran session by session ------------------------------------------------------
def session_oracle(q, k, v, qf, kf, vf, n: int, rings: dict[str, torch.Tensor], W: int, scale: float) -> torch.Tensor:
    """The old `BMojoFMixer._session` on already projected and rotated inputs of one session (float64): earlier keys
    from its rings in position order, the last W / 2W keys written back, one masked softmax over both key sets."""
    T, Hq, _ = q.shape
    pos = torch.arange(n, n + T, device=q.device)
    if n > 0:
        prev_c = torch.arange(max(0, n - W), n, device=q.device)
        prev_f = torch.arange(max(0, n - 2 * W), n, device=q.device)
        k, v = torch.cat([rings["k_ctx"][prev_c % W], k]), torch.cat([rings["v_ctx"][prev_c % W], v])
        kf, vf = torch.cat([rings["k_fade"][prev_f % (2 * W)], kf]), torch.cat([rings["v_fade"][prev_f % (2 * W)], vf])
        pos_c, pos_f = torch.cat([prev_c, pos]), torch.cat([prev_f, pos])
    else:
        pos_c = pos_f = pos
    keep_c, keep_f = pos[-W:], pos[-2 * W :]
    rings["k_ctx"][keep_c % W], rings["v_ctx"][keep_c % W] = k[-len(keep_c) :], v[-len(keep_c) :]
    rings["k_fade"][keep_f % (2 * W)], rings["v_fade"][keep_f % (2 * W)] = kf[-len(keep_f) :], vf[-len(keep_f) :]
    g = Hq // k.shape[1]
    s_c = torch.einsum("thd,shd->hts", q, k.repeat_interleave(g, 1)) * scale
    s_f = torch.einsum("thd,shd->hts", qf, kf.repeat_interleave(g, 1)) * scale
    i = pos[:, None]
    s_c = s_c.masked_fill(~((pos_c[None] <= i) & (pos_c[None] > i - W)), float("-inf"))
    s_f = s_f.masked_fill(~((pos_f[None] <= i - W) & (pos_f[None] > i - 2 * W)), float("-inf"))
    p = torch.softmax(torch.cat([s_c, s_f], dim=-1), dim=-1)
    return torch.einsum("hts,shd->thd", p, torch.cat([v, vf]).repeat_interleave(g, 1))


def test_the_reference_ops_compute_the_per_session_math_they_replace():
    """Packed prefill (lengths 1, < W, > 2W, empty; sessions fresh, partly filled, wrapped, fully wrapped), a decode
    step, and the training form: the oracle's outputs to 1e-12, its rings and lengths exactly."""
    g = seed("oracle")
    W, Hq, Hkv, D, S = 4, 4, 2, 16, 9
    lens, past = [1, 3, 11, 0, 6], [0, 2, 7, 13, 0]
    inp, pools, idx = make_case(g, sum(lens), Hq, Hkv, D, W, S, past, f64)
    want = as_f64(pools)
    o = bmf_ref.chunk_bmojo_f_attention(*inp, *(pools[n] for n in (*RINGS, "length")), idx, cu_of(lens), W, 0.25)
    cu, outs = cu_of(lens).tolist(), []
    for i, slot in enumerate(idx.tolist()):
        if lens[i]:
            rows = {name: want[name][slot] for name in RINGS}
            outs.append(session_oracle(*(t[cu[i] : cu[i + 1]] for t in inp), past[i], rows, W, 0.25))
        want["length"][slot] += lens[i]
    assert (o - torch.cat(outs)).abs().max() <= 1e-12
    assert all(torch.equal(pools[name], want[name]) for name in pools)

    B = 6  # decode: lengths 0, 1, W-1, W, 2W-1 and far past 2W
    inp, pools, idx = make_case(g, B, Hq, Hkv, D, W, S, [0, 1, W - 1, W, 2 * W - 1, 5 * W + 3], f64)
    want = as_f64(pools)
    o = bmf_ref.fused_recurrent_bmojo_f_attention(*inp, *(pools[n] for n in (*RINGS, "length")), idx, W, 0.25)
    outs = []
    for b, slot in enumerate(idx.tolist()):
        rows = {name: want[name][slot] for name in RINGS}
        outs.append(session_oracle(*(t[b : b + 1] for t in inp), int(want["length"][slot]), rows, W, 0.25))
        want["length"][slot] += 1
    assert (o - torch.cat(outs)).abs().max() <= 1e-12
    assert all(torch.equal(pools[name], want[name]) for name in pools)

    seqs = [torch.randn(2, 13, h, D, generator=g, dtype=f64) for h in (Hq, Hkv, Hkv, Hq, Hkv, Hkv)]
    o = bmf_ref.bmojo_f_attention(*seqs, W, 0.25)
    sizes = (W, W, 2 * W, 2 * W)
    want = torch.stack([
        session_oracle(*(t[b] for t in seqs), 0, {n: torch.zeros(size, Hkv, D, dtype=f64) for n, size in
                                                  zip(RINGS, sizes, strict=True)}, W, 0.25)
        for b in range(2)
    ])  # fmt: skip
    assert (o - want).abs().max() <= 1e-12


def test_the_reference_decode_reads_nothing_on_the_host(monkeypatch):
    """What makes a decode step capturable in a CUDA graph on the reference path too: no `.item()`, `.tolist()`,
    `bool()`, `int()` of a tensor during the op."""
    g = seed("host")
    inp, pools, idx = make_case(g, 3, 4, 2, 16, 4, 6, [0, 5, 9], torch.float32)

    def refuse(*args, **kwargs):
        raise AssertionError("the decode read a tensor on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    bmf_ref.fused_recurrent_bmojo_f_attention(*inp, *(pools[n] for n in (*RINGS, "length")), idx, 4, 0.25)


# -- the kernels against the float64 reference -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, Hq, Hkv, D, W, lens, past, config",
    [
        # 1 token; fewer than W; empty; more than 2W; fresh, partly filled, wrapped once, fully wrapped
        (torch.float32, 4, 2, 16, 4, [1, 3, 0, 11, 6], [0, 2, 7, 13, 0], {}),
        (torch.bfloat16, 2, 1, 24, 5, [12, 1, 0, 4], [3, 0, 9, 23], {}),  # D below its block (masked columns)
        # blocks smaller than the bands: the unmasked middle blocks and the masked edges of the compiled path (blocks
        # of 8 interpreted; compiled, a dot needs 16 rows, and the bench checks the middle blocks at W=2048)
        (torch.float32, 2, 1, 16, 16, [20, 2], [0, 40], EDGES),
    ],
)
def test_chunk_kernel_matches_the_float64_reference(poison, dtype, Hq, Hkv, D, W, lens, past, config):
    g = seed("chunk", dtype, Hq, Hkv, D, W)
    inp, pools, idx = make_case(g, sum(lens), Hq, Hkv, D, W, 9, past, dtype)
    ref, before = as_f64(pools), {name: untouched(t, idx) for name, t in pools.items()}
    cu = cu_of(lens)
    o = bmf_chunk.launch(*inp, *(pools[n] for n in (*RINGS, "length")), idx, cu, W, D**-0.5,
                         cu_seqlens_cpu=cu.tolist(), **config)  # fmt: skip
    o_ref = bmf_ref.chunk_bmojo_f_attention(*(t.to(f64) for t in inp), *(ref[n] for n in (*RINGS, "length")), idx, cu,
                                            W, D**-0.5)  # fmt: skip
    assert o.dtype == dtype and o.shape == (sum(lens), Hq, D)
    assert rel(o, o_ref) <= TOL[dtype]
    assert_pools_match(pools, ref, before, idx)


@pytest.mark.parametrize(
    "dtype, Hq, Hkv, D, W, splits",
    [
        (torch.float32, 4, 2, 16, 4, None),
        (torch.bfloat16, 4, 1, 24, 5, 3),  # the keys in three splits (merged by the second kernel), one KV head
        (torch.float32, 6, 2, 16, 8, 2),  # three query heads a KV head
    ],
)
def test_decode_kernel_matches_the_float64_reference(poison, dtype, Hq, Hkv, D, W, splits):
    g = seed("decode", dtype, Hq, Hkv, D, W)
    past = [0, 1, W - 1, W, 2 * W - 1, 2 * W, 5 * W + 3]  # fresh, partly filled, wrapped, fully wrapped
    inp, pools, idx = make_case(g, len(past), Hq, Hkv, D, W, 10, past, dtype)
    ref, before = as_f64(pools), {name: untouched(t, idx) for name, t in pools.items()}
    o = bmf_step.launch(*inp, *(pools[n] for n in (*RINGS, "length")), idx, W, D**-0.5, splits=splits)
    o_ref = bmf_ref.fused_recurrent_bmojo_f_attention(*(t.to(f64) for t in inp), *(ref[n] for n in (*RINGS, "length")),
                                                      idx, W, D**-0.5)  # fmt: skip
    assert o.dtype == dtype and o.shape == (len(past), Hq, D)
    assert rel(o, o_ref) <= TOL[dtype]
    assert_pools_match(pools, ref, before, idx)


def test_prefill_decode_and_a_continued_prefill_through_the_ops_match_the_reference(poison, monkeypatch):
    """The dispatched ops with KVFREE_KERNELS=triton and =reference from the same pools: a packed prefill, two decode
    steps, then a second prefill continuing the sessions (its rings now wrapped): outputs to fp32 rounding, rings and
    lengths bit for bit; fp64 inputs take the reference whatever the mode."""
    g = seed("sequence")
    W, Hq, Hkv, D = 4, 4, 2, 16
    first, second = [9, 2, 5], [3, 10, 0]
    prompt, pools0, idx = make_case(g, sum(first), Hq, Hkv, D, W, 5, [0, 0, 6], torch.float32)
    steps = [[torch.randn(3, h, D, generator=g).to(DEVICE) for h in (Hq, Hkv, Hkv, Hq, Hkv, Hkv)] for _ in range(2)]
    more = [torch.randn(sum(second), h, D, generator=g).to(DEVICE) for h in (Hq, Hkv, Hkv, Hq, Hkv, Hkv)]
    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVFREE_KERNELS", mode)
        pools = {name: t.clone() for name, t in pools0.items()}
        state = [pools[n] for n in (*RINGS, "length")]
        outs = [ops.chunk_bmojo_f_attention(*prompt, *state, idx, cu_of(first), W, 0.25)]
        outs += [ops.fused_recurrent_bmojo_f_attention(*step, *state, idx, W, 0.25) for step in steps]
        outs.append(ops.chunk_bmojo_f_attention(*more, *state, idx, cu_of(second), W, 0.25,
                                                cu_seqlens_cpu=(0, 3, 13, 13)))  # fmt: skip
        results[mode] = (torch.cat(outs), pools)
    (o_r, p_r), (o_t, p_t) = results["reference"], results["triton"]
    assert rel(o_t, o_r) <= 1e-5
    assert all(torch.equal(p_t[name], p_r[name]) for name in p_r)
    assert p_t["length"][idx.long()].tolist() == [9 + 2 + 3, 2 + 2 + 10, 6 + 5 + 2]
    calls = []
    monkeypatch.setattr(bmf_ref, "fused_recurrent_bmojo_f_attention", lambda *a, **k: calls.append("reference"))
    ops.fused_recurrent_bmojo_f_attention(*(t.double() for t in steps[0]), *state, idx, W, 0.25)
    assert calls == ["reference"]


def test_rings_of_the_wrong_size_are_refused():
    g = seed("sizes")
    inp, pools, idx = make_case(g, 2, 2, 1, 16, 4, 3, [0, 1], torch.float32)
    state = [pools[n] for n in (*RINGS, "length")]
    with pytest.raises(ValueError, match="rings must hold 5 and 10"):
        bmf_step.fused_recurrent_bmojo_f_attention(*inp, *state, idx, 5, 0.25)
    with pytest.raises(ValueError, match="rings must hold 5 and 10"):
        bmf_ref.chunk_bmojo_f_attention(*inp, *state, idx, cu_of([1, 1]), 5, 0.25)
