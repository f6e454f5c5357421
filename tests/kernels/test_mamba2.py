"""Mamba-2 SSD and causal-conv kernels on a slot-indexed state pool: Triton (under the interpreter on the CPU) against
the float64 PyTorch reference, the varlen references against the per-sequence math, and the KVFREE_KERNELS dispatch.

Every check draws fresh random inputs, packs sequences of unequal lengths (1, shorter than the conv tail, empty, not a
multiple of the chunk, longer than one chunk), uses random pool rows of a larger pool (some fresh, some continued),
poisons every buffer the Triton functions allocate, and checks that the rows not named stay bit-for-bit unchanged.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.conv as conv_ops  # noqa: E402
import kvfree.kernels.mamba2 as mamba2_ops  # noqa: E402
from kvfree.kernels import dispatch  # noqa: E402
from kvfree.kernels.conv import chunk as conv_chunk  # noqa: E402
from kvfree.kernels.conv import fused_recurrent as conv_step  # noqa: E402
from kvfree.kernels.conv import reference as conv_ref  # noqa: E402
from kvfree.kernels.mamba2 import chunk as m2_chunk  # noqa: E402
from kvfree.kernels.mamba2 import fused_recurrent as m2_step  # noqa: E402
from kvfree.kernels.mamba2 import reference as m2_ref  # noqa: E402
from tests.kernel_checks import DEVICE, cu_of, rel, seed, untouched  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
# 1 token; shorter than the conv tail; empty; not a multiple of the chunk; one chunk exactly; more than three chunks
LENS = [1, 37, 2, 0, 16, 5, 50]
f64 = torch.float64


def make_pool(g, S: int, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random pool of S rows and n distinct random rows of it; every third from the second is reset to zeros (a
    fresh session), so with LENS the short sequences continue a state and a long one starts fresh."""
    pool = torch.randn(S, *shape, generator=g).to(dtype)
    idx = torch.randperm(S, generator=g)[:n]
    pool[idx[1::3]] = 0
    return pool.to(DEVICE), idx.to(torch.int32).to(DEVICE)


def mamba_inputs(g, T: int, H: int, P: int, N: int, G: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Layer-like inputs: x, B, C as strided views of one projection (as the layer splits them), raw dt, and
    parameters with slow enough decay that the carried state matters over the whole sequence."""
    xbc = torch.randn(T, H * P + 2 * G * N + 3, generator=g).to(dtype)
    x, B, C, _ = xbc.split([H * P, G * N, G * N, 3], dim=-1)
    return {
        "x": x.unflatten(-1, (H, P)).to(DEVICE),
        "dt": (0.5 * torch.randn(T, H, generator=g)).to(DEVICE),
        "B": B.unflatten(-1, (G, N)).to(DEVICE),
        "C": C.unflatten(-1, (G, N)).to(DEVICE),
        "A": -(0.05 + 0.5 * torch.rand(H, generator=g)).to(DEVICE),
        "D": torch.randn(H, generator=g).to(DEVICE),
        "dt_bias": (torch.randn(H, generator=g) - 2.0).to(DEVICE),
    }


def as64(inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(f64) for k, v in inp.items()}


def ssd_args(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return inp["x"], inp["dt"], inp["B"], inp["C"]


def ssd_params(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return inp["A"], inp["D"], inp["dt_bias"]


# -- SSD prefill ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, H, P, N, G, chunk, dt_limit",
    [
        (torch.float32, 4, 16, 32, 1, 16, None),
        (torch.float32, 4, 32, 16, 2, 32, (0.05, 0.2)),  # two P blocks; two row blocks per chunk
        (torch.float32, 2, 8, 16, 2, 8, None),  # the test models' odd sizes (P=8 < a block, chunk 8 -> 16)
        (torch.bfloat16, 4, 16, 32, 1, 16, (0.0, math.inf)),
        (torch.bfloat16, 4, 16, 16, 4, 32, None),
    ],
)
def test_chunk_mamba2_matches_reference(poison, dtype, H, P, N, G, chunk, dt_limit):
    g = seed(dtype, H, P, N, G, chunk)
    inp = mamba_inputs(g, sum(LENS), H, P, N, G, dtype)
    pool, idx = make_pool(g, 13, (H, P, N), torch.float32, len(LENS))
    cu = cu_of(LENS)
    ref_pool = pool.to(f64)
    rest = untouched(pool, idx)

    y = m2_chunk.chunk_mamba2(*ssd_args(inp), pool, idx, cu, *ssd_params(inp), dt_limit, chunk)
    y_ref = m2_ref.chunk_mamba2(
        *ssd_args(as64(inp)), ref_pool, idx, cu, *ssd_params(as64(inp)), dt_limit, chunk, cu_seqlens_cpu=cu.cpu()
    )
    assert y.dtype == dtype and y.shape == inp["x"].shape
    assert rel(y, y_ref) <= TOL[dtype]
    assert rel(pool[idx.long()], ref_pool[idx.long()]) <= TOL[dtype]
    assert torch.equal(untouched(pool, idx), rest)


def test_chunk_then_decode_continues_the_sequence(poison):
    """Prefill in two calls, then three decode steps (Triton, in place) == one reference prefill over all tokens."""
    g = torch.Generator().manual_seed(7)
    H, P, N, G, n_dec = 2, 16, 16, 1, 3
    first, second = [20, 1, 9], [17, 3, 40]
    total = [a + b + n_dec for a, b in zip(first, second, strict=True)]
    inp = mamba_inputs(g, sum(total), H, P, N, G, torch.float32)
    pool, idx = make_pool(g, 7, (H, P, N), torch.float32, len(total))
    ref_pool = pool.to(f64)
    rest = untouched(pool, idx)
    y_ref = m2_ref.chunk_mamba2(*ssd_args(as64(inp)), ref_pool, idx, cu_of(total), *ssd_params(as64(inp)), None, 16)

    # Token t of sequence i sits at cu_of(total)[i] + t in the packed inputs.
    starts = cu_of(total).tolist()
    outs = {i: [] for i in range(len(total))}
    offset = [0] * len(total)
    for part in (first, second):
        rows = torch.cat([torch.arange(starts[i] + offset[i], starts[i] + offset[i] + n) for i, n in enumerate(part)])
        sub = {k: (v[rows.to(DEVICE)] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
        y = m2_chunk.chunk_mamba2(*ssd_args(sub), pool, idx, cu_of(part), *ssd_params(sub), None, 16)
        for i, n in enumerate(part):
            a = sum(part[:i])
            outs[i].append(y[a : a + n])
            offset[i] += n
    for _ in range(n_dec):
        rows = torch.tensor([starts[i] + offset[i] for i in range(len(total))], device=DEVICE)
        sub = {k: (v[rows] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
        y = m2_step.fused_recurrent_mamba2(*ssd_args(sub), pool, idx, *ssd_params(sub), None)
        for i in range(len(total)):
            outs[i].append(y[i : i + 1])
            offset[i] += 1
    y = torch.cat([torch.cat(outs[i]) for i in range(len(total))])
    assert rel(y, y_ref) <= 1e-4
    assert rel(pool[idx.long()], ref_pool[idx.long()]) <= 1e-4
    assert torch.equal(untouched(pool, idx), rest)


# -- SSD decode ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, H, P, N, G, dt_limit",
    [
        (torch.float32, 4, 16, 32, 1, None),
        (torch.float32, 4, 24, 16, 2, (0.05, 0.2)),
        (torch.bfloat16, 4, 16, 32, 4, None),
        (torch.bfloat16, 2, 8, 16, 1, (0.0, math.inf)),
    ],
)
def test_fused_recurrent_mamba2_matches_reference(poison, dtype, H, P, N, G, dt_limit):
    g = seed(dtype, H, P, N, G)
    Bs = 5
    inp = mamba_inputs(g, Bs, H, P, N, G, dtype)
    pool, idx = make_pool(g, 11, (H, P, N), torch.float32, Bs)
    ref_pool = pool.to(f64)
    rest = untouched(pool, idx)
    y = m2_step.fused_recurrent_mamba2(*ssd_args(inp), pool, idx, *ssd_params(inp), dt_limit)
    y_ref = m2_ref.fused_recurrent_mamba2(*ssd_args(as64(inp)), ref_pool, idx, *ssd_params(as64(inp)), dt_limit)
    assert y.dtype == dtype and y.shape == inp["x"].shape
    assert rel(y, y_ref) <= TOL[dtype]
    assert rel(pool[idx.long()], ref_pool[idx.long()]) <= TOL[dtype]
    assert torch.equal(untouched(pool, idx), rest)


# -- causal conv ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, state_dtype, C, K, bias, activation",
    [
        (torch.float32, torch.float32, 40, 4, True, "silu"),
        (torch.bfloat16, torch.bfloat16, 24, 4, False, None),
        (torch.bfloat16, torch.float32, 150, 3, True, "silu"),  # two channel blocks
        (torch.float32, torch.float32, 16, 2, True, None),
    ],
)
def test_conv_matches_reference(poison, dtype, state_dtype, C, K, bias, activation):
    g = seed(dtype, state_dtype, C, K)
    cu = cu_of(LENS)
    x = torch.randn(sum(LENS), C + 5, generator=g).to(dtype)[:, 2 : C + 2].to(DEVICE)  # a strided view
    w = torch.randn(C, K, generator=g).to(DEVICE)
    b = torch.randn(C, generator=g).to(DEVICE) if bias else None
    pool, idx = make_pool(g, 9, (K - 1, C), state_dtype, len(LENS))
    ref_pool = pool.to(f64)
    rest = untouched(pool, idx)

    y = conv_chunk.chunk_causal_conv1d(x, pool, idx, cu, w, b, activation, cu_seqlens_cpu=cu.cpu().tolist())
    y_ref = conv_ref.chunk_causal_conv1d(
        x.to(f64), ref_pool, idx, cu, w.to(f64), None if b is None else b.to(f64), activation
    )
    assert y.dtype == dtype and y.shape == x.shape
    assert rel(y, y_ref) <= TOL[dtype]
    assert torch.equal(pool[idx.long()].to(f64), ref_pool[idx.long()])  # the tails are copies, exact
    assert torch.equal(untouched(pool, idx), rest)

    xd = torch.randn(len(LENS), C, generator=g).to(dtype).to(DEVICE)
    y = conv_step.fused_recurrent_causal_conv1d(xd, pool, idx, w, b, activation)
    y_ref = conv_ref.fused_recurrent_causal_conv1d(
        xd.to(f64), ref_pool, idx, w.to(f64), None if b is None else b.to(f64), activation
    )
    assert y.dtype == dtype and y.shape == xd.shape
    assert rel(y, y_ref) <= TOL[dtype]
    assert torch.equal(pool[idx.long()].to(f64), ref_pool[idx.long()])
    assert torch.equal(untouched(pool, idx), rest)


# -- the varlen references against the per-sequence math -----------------------------------------------------------
def test_reference_chunk_mamba2_equals_ssd_chunked_per_sequence():
    g = torch.Generator().manual_seed(3)
    H, P, N, G, chunk, lim = 4, 8, 16, 2, 8, (0.01, 0.5)
    inp = as64(mamba_inputs(g, sum(LENS), H, P, N, G, torch.float32))
    pool, idx = make_pool(g, 10, (H, P, N), f64, len(LENS))
    before = pool.clone()
    y = m2_ref.chunk_mamba2(*ssd_args(inp), pool, idx, cu_of(LENS), *ssd_params(inp), lim, chunk)
    dts = m2_ref.softplus_dt(inp["dt"], inp["dt_bias"], lim, f64)
    for i, (s, e) in enumerate(itertools.pairwise(cu_of(LENS).tolist())):
        yi, hi = m2_ref.ssd_chunked(
            inp["x"][None, s:e], dts[None, s:e], inp["A"], inp["B"][None, s:e], inp["C"][None, s:e], inp["D"],
            before[idx[i].long()][None], chunk,
        )
        torch.testing.assert_close(y[s:e], yi[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pool[idx[i].long()], hi[0], rtol=1e-12, atol=1e-12)

    # decode: the same against ssd_step
    xd = {k: v[: len(LENS)] if k in ("x", "dt", "B", "C") else v for k, v in inp.items()}
    before = pool.clone()
    y = m2_ref.fused_recurrent_mamba2(*ssd_args(xd), pool, idx, *ssd_params(xd), lim)
    y1, h1 = m2_ref.ssd_step(
        xd["x"], m2_ref.softplus_dt(xd["dt"], xd["dt_bias"], lim, f64), xd["A"], xd["B"], xd["C"], xd["D"],
        before[idx.long()],
    )
    torch.testing.assert_close(y, y1, rtol=0, atol=0)
    torch.testing.assert_close(pool[idx.long()], h1, rtol=0, atol=0)


def test_reference_chunk_conv_equals_causal_conv1d_per_sequence():
    g = torch.Generator().manual_seed(4)
    C, K = 12, 4
    x = torch.randn(sum(LENS), C, generator=g, dtype=f64)
    w, b = torch.randn(C, K, generator=g, dtype=f64), torch.randn(C, generator=g, dtype=f64)
    pool, idx = make_pool(g, 8, (K - 1, C), f64, len(LENS))
    before = pool.clone()
    y = conv_ref.chunk_causal_conv1d(x.to(DEVICE), pool, idx, cu_of(LENS), w.to(DEVICE), b.to(DEVICE), "silu")
    for i, (s, e) in enumerate(itertools.pairwise(cu_of(LENS).tolist())):
        if s == e:  # an empty sequence keeps its tail (causal_conv1d cannot take zero tokens)
            assert torch.equal(pool[idx[i].long()], before[idx[i].long()])
            continue
        yi, tail = conv_ref.causal_conv1d(x[None, s:e], w, b, before[idx[i].long()][None].cpu())
        torch.testing.assert_close(y[s:e].cpu(), torch.nn.functional.silu(yi[0]), rtol=1e-12, atol=1e-12)
        assert torch.equal(pool[idx[i].long()].cpu(), tail[0])


# -- dispatch ------------------------------------------------------------------------------------------------------
def test_dispatch_modes(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("KVFREE_KERNELS", raising=False)
    assert dispatch.use_triton(cpu) is False  # auto on the CPU: the reference
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    assert dispatch.use_triton(cpu) is False
    monkeypatch.setenv("KVFREE_KERNELS", "auto")
    assert dispatch.use_triton(cpu) is False
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.use_triton(cpu) is True
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.use_triton(cpu)
    monkeypatch.setenv("KVFREE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="reference, triton, auto"):
        dispatch.use_triton(cpu)


@pytest.mark.parametrize("mode, want", [("reference", "reference"), ("auto", "reference"), ("triton", "triton")])
def test_ops_dispatch_to_what_the_mode_says(monkeypatch, mode, want):
    if DEVICE.type == "cuda" and mode == "auto":
        want = "triton"
    monkeypatch.setenv("KVFREE_KERNELS", mode)
    called = []
    for name, mods in {
        "chunk_mamba2": (m2_ref, m2_chunk),
        "fused_recurrent_mamba2": (m2_ref, m2_step),
        "chunk_causal_conv1d": (conv_ref, conv_chunk),
        "fused_recurrent_causal_conv1d": (conv_ref, conv_step),
    }.items():
        for kind, mod in zip(("reference", "triton"), mods, strict=True):
            monkeypatch.setattr(mod, name, lambda *a, _k=kind, _n=name, **kw: called.append((_n, _k)))
    t = torch.zeros(1, device=DEVICE)
    w = torch.zeros(1, 4, device=DEVICE)  # a conv filter of width 4 (width 1 always takes the reference)
    mamba2_ops.chunk_mamba2(t, t, t, t, t, t, t, t, t, t)
    mamba2_ops.fused_recurrent_mamba2(t, t, t, t, t, t, t, t, t)
    conv_ops.chunk_causal_conv1d(t, t, t, t, w)
    conv_ops.fused_recurrent_causal_conv1d(t, t, t, w)
    assert called == [
        ("chunk_mamba2", want),
        ("fused_recurrent_mamba2", want),
        ("chunk_causal_conv1d", want),
        ("fused_recurrent_causal_conv1d", want),
    ]


def test_dispatched_triton_on_cpu_runs_the_interpreter(monkeypatch):
    """KVFREE_KERNELS=triton on the CPU really runs the Triton decode (under the interpreter) and agrees."""
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    g = torch.Generator().manual_seed(11)
    inp = mamba_inputs(g, 3, 2, 16, 16, 1, torch.float32)
    pool, idx = make_pool(g, 5, (2, 16, 16), torch.float32, 3)
    ref_pool = pool.to(f64)
    y = mamba2_ops.fused_recurrent_mamba2(*ssd_args(inp), pool, idx, *ssd_params(inp))
    y_ref = m2_ref.fused_recurrent_mamba2(*ssd_args(as64(inp)), ref_pool, idx, *ssd_params(as64(inp)))
    assert rel(y, y_ref) <= 1e-4 and rel(pool, ref_pool) <= 1e-4
