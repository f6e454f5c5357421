"""RMS norm kernels (plain, fused residual add, gated): Triton (under the interpreter on the CPU) against the float64
reference, the reference against the layers' historical math bit for bit, and the dispatch (KVFREE_KERNELS, autograd).

Every check draws fresh random inputs, reads strided rows (column slices of one wider projection, as the layers split
them), uses widths that are not powers of two and row counts that leave a partial block, and poisons every buffer the
Triton functions allocate (NaN), so an unwritten element fails the check.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.norm as norm_ops  # noqa: E402
from kvfree.engine.model.layers.norms import GatedRMSNorm, RMSNorm  # noqa: E402
from kvfree.kernels.norm import fused  # noqa: E402
from kvfree.kernels.norm import reference as ref  # noqa: E402
from tests.kernel_checks import DEVICE, rel, seed  # noqa: E402

f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
EPS = 1e-5


def tol(*dtypes: torch.dtype) -> float:
    """METHOD.md: fp32 arithmetic far under 1e-5; any bf16/fp16 operand or output up to 1e-2."""
    return 1e-5 if all(d == f32 for d in dtypes) else 1e-2


def strided(g: torch.Generator, lead: tuple[int, ...], D: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`[*lead, D]` random values as a column slice of a wider `[*lead, D + 13]` tensor: rows strided, not copied."""
    return wide_and_slice(g, lead, D, dtype, scale)[1]


def wide_and_slice(
    g: torch.Generator, lead: tuple[int, ...], D: int, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    wide = (scale * torch.randn(*lead, D + 13, generator=g)).to(dtype).to(DEVICE)
    return wide, wide[..., 5 : 5 + D]


def weight(g: torch.Generator, D: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.5 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)


def up(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.to(f64) for t in ts]


# -- rms_norm --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lead, D, x_dtype, w_dtype",
    [
        ((37,), 200, f32, f32),  # 200 -> a 256 block; 8 rows a program, the last block partial
        ((37,), 200, bf16, bf16),
        ((2, 9), 96, bf16, f32),  # 3-D input; fp32 weight: fp32 output of a bf16 input
        ((5,), 1000, f16, f16),
        ((3,), 5000, f32, bf16),  # a wide row: one 8192 block
        ((1,), 64, bf16, bf16),  # decode: one row
    ],
)
def test_rms_norm_matches_float64(poison, lead, D, x_dtype, w_dtype):
    g = seed("rms", lead, D, x_dtype, w_dtype)
    x, w = strided(g, lead, D, x_dtype, scale=3.0), weight(g, D, w_dtype)
    y = fused.rms_norm(x, w, EPS)
    assert y.dtype == w_dtype and y.shape == x.shape and y.is_contiguous()
    assert rel(y, ref.rms_norm(*up(x, w), EPS)) <= tol(x_dtype, w_dtype)


def test_rms_norm_rounds_like_the_reference(poison):
    """bf16 weight: the kernel rounds x/rms(x) to bf16 before the product, as the reference does, so nearly every
    element equals the reference path's (only the fp32 sum's order differs). One rounding of the fp32 product would
    differ in a large fraction of them."""
    g = seed("rounding")
    x, w = strided(g, (24,), 384, bf16), weight(g, 384, bf16)
    y, y_ref = fused.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS)
    assert (y == y_ref).float().mean().item() >= 0.99
    assert rel(y, y_ref) <= 2e-3


@pytest.mark.parametrize("block_n, num_warps", [(1, 1), (4, 2), (16, 8)])
def test_launch_overrides_agree(poison, block_n, num_warps):
    g = seed("launch", block_n, num_warps)
    x, w = strided(g, (21,), 72, f32), weight(g, 72, f32)
    assert rel(fused.rms_norm(x, w, EPS, block_n=block_n, num_warps=num_warps), ref.rms_norm(*up(x, w), EPS)) <= 1e-5


# -- add_rms_norm ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lead, D, x_dtype, w_dtype, has_res, inplace",
    [
        ((37,), 200, f32, f32, True, False),
        ((37,), 200, bf16, bf16, True, False),
        ((37,), 200, bf16, bf16, True, True),  # strided residual rows written in place
        ((2, 9), 96, bf16, bf16, True, True),  # 3-D residual, a column slice whose rows still merge into one stride
        ((37,), 200, bf16, bf16, False, False),
        ((6,), 72, f32, f32, False, True),  # inplace ignored without a residual
        ((1,), 1000, bf16, bf16, True, True),  # decode
    ],
)
def test_add_rms_norm_matches_float64(poison, lead, D, x_dtype, w_dtype, has_res, inplace):
    g = seed("add", lead, D, x_dtype, w_dtype, has_res, inplace)
    x, w = strided(g, lead, D, x_dtype), weight(g, D, w_dtype)
    wide, res = wide_and_slice(g, lead, D, f32, scale=4.0) if has_res else (None, None)
    want_y, want_r = ref.add_rms_norm(*up(x, res, w), EPS)
    res_before = None if res is None else res.clone()
    wide_before = None if wide is None else wide.clone()
    y, r = fused.add_rms_norm(x, res, w, EPS, inplace=inplace)
    assert y.dtype == w_dtype and y.shape == x.shape and r.dtype == f32 and r.shape == x.shape
    assert rel(y, want_y) <= tol(x_dtype, w_dtype)
    assert rel(r, want_r) <= 1e-6  # one fp32 add
    assert r.data_ptr() != x.data_ptr()
    if res is not None and inplace:
        assert r is res
        wide_after = wide.clone()
        wide_after[..., 5 : 5 + D] = wide_before[..., 5 : 5 + D]
        assert torch.equal(wide_after, wide_before), "inplace wrote outside the residual's columns"
    elif res is not None:
        assert torch.equal(res, res_before) and r.is_contiguous()


@pytest.mark.parametrize("inplace", [False, True])
def test_leading_dims_that_do_not_merge(poison, inplace):
    """Rows not addressable by one stride (a slice of a middle dim): inputs are copied, an in-place residual is
    computed aside and copied back; the results are the same."""
    g = seed("unmerged", inplace)
    D = 40
    x = torch.randn(3, 9, D + 6, generator=g).to(DEVICE)[:, 1:8, 2 : 2 + D]
    gate = torch.randn(3, 9, D + 6, generator=g).to(DEVICE)[:, 2:9, :D]
    wide = torch.randn(3, 9, D + 6, generator=g).to(DEVICE)
    res, w = wide[:, :7, 6:], weight(g, D, f32)
    with pytest.raises(RuntimeError):
        res.view(-1, D)  # the case under test
    want_y, want_r = ref.add_rms_norm(*up(x, res, w), EPS)
    before = wide.clone()
    y, r = fused.add_rms_norm(x, res, w, EPS, inplace=inplace)
    assert rel(y, want_y) <= 1e-5 and rel(r, want_r) <= 1e-6
    assert (r is res) == inplace
    touched = torch.zeros_like(wide, dtype=torch.bool)
    touched[:, :7, 6:] = inplace
    assert torch.equal(wide[~touched], before[~touched])
    for nbg in (False, True):
        want = ref.gated_rms_norm(*up(x, gate, w), 8, EPS, nbg)
        assert rel(fused.gated_rms_norm(x, gate, w, 8, EPS, nbg), want) <= 1e-5


def test_add_rms_norm_inplace_needs_fp32_residual():
    x = torch.randn(2, 8, device=DEVICE)
    for impl in (fused.add_rms_norm, ref.add_rms_norm):
        with pytest.raises(ValueError, match="residual"):
            impl(x, x.bfloat16(), torch.ones(8, device=DEVICE), EPS, inplace=True)


# -- gated_rms_norm --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "lead, D, group, x_dtype, w_dtype",
    [
        ((13,), 120, 40, bf16, bf16),  # 3 groups of 40 (a 64 block each)
        ((13,), 120, 120, f32, f32),
        ((2, 5), 192, 48, f32, f32),
        ((1,), 256, 64, bf16, bf16),  # decode
        ((9,), 96, 96, f32, bf16),  # fp32 SSD output, bf16 weight
    ],
)
@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_gated_rms_norm_matches_float64(poison, lead, D, group, x_dtype, w_dtype, norm_before_gate):
    g = seed("gated", lead, D, group, x_dtype, w_dtype, norm_before_gate)
    # x and gate: column slices of one projection output, as the Mamba-2 layer splits in_proj(x)
    proj = torch.randn(*lead, 2 * D + 7, generator=g).to(x_dtype).to(DEVICE)
    gate, x = proj[..., 3 : 3 + D], proj[..., 3 + D : 3 + 2 * D]
    w = weight(g, D, w_dtype)
    y = fused.gated_rms_norm(x, gate, w, group, EPS, norm_before_gate)
    assert y.dtype == w_dtype and y.shape == x.shape
    want = ref.gated_rms_norm(*up(x, gate, w), group, EPS, norm_before_gate)
    assert rel(y, want) <= tol(x_dtype, w_dtype)


def test_empty_inputs():
    w = torch.ones(16, device=DEVICE)
    x = torch.randn(0, 16, device=DEVICE)
    assert fused.rms_norm(x, w, EPS).shape == (0, 16)
    y, r = fused.add_rms_norm(x, x, w, EPS)
    assert y.shape == r.shape == (0, 16)
    assert fused.gated_rms_norm(x, x, w, 8, EPS).shape == (0, 16)


# -- the reference is the layers' historical math, bit for bit ---------------------------------------------------------
def legacy_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward before the kernels existed."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(w.dtype)


def legacy_gated(x, gate, w, group_size, eps, norm_before_gate):
    """GatedRMSNorm.forward before the kernels existed."""
    xf, gf = x.float(), F.silu(gate.float())
    if not norm_before_gate:
        xf = xf * gf
    grouped = xf.unflatten(-1, (-1, group_size))
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out = w.float() * grouped.flatten(-2)
    if norm_before_gate:
        out = out * gf
    return out.to(w.dtype)


@pytest.mark.parametrize("x_dtype, w_dtype", [(f32, f32), (bf16, bf16), (f32, bf16), (bf16, f32)])
def test_modules_on_the_reference_path_are_unchanged(monkeypatch, x_dtype, w_dtype):
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    g = seed("legacy", x_dtype, w_dtype)
    x, gate = strided(g, (4, 6), 96, x_dtype), strided(g, (4, 6), 96, x_dtype)
    res = strided(g, (4, 6), 96, f32)
    norm, gated = RMSNorm(96).to(DEVICE, w_dtype), GatedRMSNorm(96, 32).to(DEVICE, w_dtype)
    gated_before = GatedRMSNorm(96, 32, norm_before_gate=True).to(DEVICE, w_dtype)
    with torch.no_grad():
        for m in (norm, gated, gated_before):
            m.weight.copy_(weight(g, 96, w_dtype))
    assert torch.equal(norm(x), legacy_rms(x, norm.weight, norm.eps))
    assert torch.equal(gated(x, gate), legacy_gated(x, gate, gated.weight, 32, gated.eps, False))
    assert torch.equal(gated_before(x, gate), legacy_gated(x, gate, gated_before.weight, 32, gated.eps, True))
    y, r = norm.add_forward(x, res)
    assert torch.equal(r, res + x.float()) and torch.equal(y, legacy_rms(res + x.float(), norm.weight, norm.eps))
    y, r = norm.add_forward(x, None)
    assert torch.equal(r, x.float()) and torch.equal(y, legacy_rms(x, norm.weight, norm.eps))
    # and the gradients (training takes this path)
    with torch.inference_mode(False), torch.enable_grad():
        xg, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        w = norm.weight.detach().clone().requires_grad_()
        rms_g = norm_ops.rms_norm(xg, w, EPS).float().square().sum()
        legacy_g = legacy_rms(want_x, w, EPS).float().square().sum()
        assert torch.equal(rms_g, legacy_g)
        rms_g.backward()
        legacy_g.backward()
    assert torch.equal(xg.grad, want_x.grad)


# -- dispatch --------------------------------------------------------------------------------------------------------
@pytest.fixture
def spy(monkeypatch):
    """Records which implementation (reference or triton) each public function calls, still computing the result."""
    calls: list[tuple[str, str]] = []
    for kind, mod in (("reference", ref), ("triton", fused)):
        for name in ("rms_norm", "add_rms_norm", "gated_rms_norm"):
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, lambda *a, _r=real, _k=kind, _n=name, **kw: calls.append((_n, _k))
                                or _r(*a, **kw))
    return calls


def call_all(x: torch.Tensor, w: torch.Tensor, res: torch.Tensor | None = None) -> list[torch.Tensor]:
    return [
        norm_ops.rms_norm(x, w, EPS),
        *norm_ops.add_rms_norm(x, res, w, EPS),
        norm_ops.gated_rms_norm(x, x.detach().flip(-1), w, x.shape[-1] // 2, EPS),
    ]


@pytest.mark.parametrize("mode", ["reference", "auto", "triton"])
def test_dispatch_follows_kvfree_kernels(monkeypatch, spy, mode):
    monkeypatch.setenv("KVFREE_KERNELS", mode)
    want = "triton" if mode == "triton" or (mode == "auto" and DEVICE.type == "cuda") else "reference"
    x, w = torch.randn(3, 16, device=DEVICE), torch.randn(16, device=DEVICE)
    call_all(x, w, torch.randn(3, 16, device=DEVICE))
    # (the reference add_rms_norm calls the reference rms_norm inside: compare sets)
    assert set(spy) == {("rms_norm", want), ("add_rms_norm", want), ("gated_rms_norm", want)}


def test_autograd_takes_the_reference_and_gradients_flow(monkeypatch, spy):
    """Training (grad mode on, a tensor that needs grad) takes the reference; inference takes the kernels."""
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    g = seed("grad")
    with torch.inference_mode(False), torch.enable_grad():  # conftest runs every test in inference mode
        x = torch.randn(3, 16, generator=g).to(DEVICE).requires_grad_()
        w = torch.randn(16, generator=g).to(DEVICE).requires_grad_()
        res = torch.randn(3, 16, generator=g).to(DEVICE)
        outs = call_all(x, w, res)
        assert {k for _, k in spy} == {"reference"}
        sum(o.square().sum() for o in outs).backward()
        assert x.grad is not None and w.grad is not None and x.grad.isfinite().all() and w.grad.abs().sum() > 0
        spy.clear()
        call_all(x.detach(), w)  # a weight that needs grad is enough
        assert {k for _, k in spy} == {"reference"}
        spy.clear()
        with torch.no_grad():
            call_all(x, w)
    with torch.inference_mode():
        call_all(x, w)
    assert {k for _, k in spy} == {"triton"}


def test_dispatch_falls_back_where_the_kernels_do_not_apply(monkeypatch, spy):
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    call_all(torch.randn(2, 8, dtype=f64, device=DEVICE), torch.randn(8, dtype=f64, device=DEVICE))  # float64
    wide = fused.MAX_D + 2
    norm_ops.rms_norm(torch.randn(1, wide, device=DEVICE), torch.ones(wide, device=DEVICE), EPS)  # too wide
    assert {k for _, k in spy} == {"reference"}


def test_dispatched_triton_agrees_with_the_reference_path(monkeypatch):
    """KVFREE_KERNELS=triton on the CPU really runs the kernels (under the interpreter) and agrees with the modules'
    reference path."""
    g = seed("modules")
    x, gate = strided(g, (5,), 64, bf16), strided(g, (5,), 64, bf16)
    res = strided(g, (5,), 64, f32)
    norm, gated = RMSNorm(64).to(DEVICE, bf16), GatedRMSNorm(64, 16).to(DEVICE, bf16)
    outs = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVFREE_KERNELS", mode)
        with torch.no_grad():
            outs[mode] = [norm(x), gated(x, gate), *norm.add_forward(x, res)]
    for a, b in zip(outs["triton"], outs["reference"], strict=True):
        assert a.dtype == b.dtype and rel(a, b) <= 5e-3
