"""The decode attention kernel (kernels/attention/fused_recurrent.py): Triton (under the interpreter on the CPU) against
the float64 reference, on pool rows addressed by slot: sessions of different lengths (splits partly and wholly
empty), grouped-query heads, a full cache and a wrapped ring, rows of other slots untouched; and the op end to end
(`fused_recurrent_attention` with `KVFREE_KERNELS=triton` against `reference`)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvfree.kernels.attention import fused_recurrent_attention  # noqa: E402
from kvfree.kernels.attention.fused_recurrent import decode_attention  # noqa: E402
from kvfree.kernels.attention.reference import FP8, _attend_one, dequantize, quantize  # noqa: E402
from tests.kernel_checks import DEVICE, rel, seed  # noqa: E402


def _pool(g: torch.Generator, S: int, C: int, Hkv: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    k = torch.randn(S, C, Hkv, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(S, C, Hkv, D, generator=g).to(DEVICE, dtype)
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("Hq", "Hkv", "D"), [(4, 2, 16), (8, 8, 24), (6, 1, 32)])
def test_decode_attention_matches_float64_reference(dtype, Hq, Hkv, D):
    g = seed()
    S, C = 6, 700  # 700 keys: several splits of 256, the last partial
    k_cache, v_cache = _pool(g, S, C, Hkv, D, dtype)
    slots = torch.tensor([4, 1, 3], device=DEVICE)
    used = torch.tensor([700, 1, 300], device=DEVICE)  # full row, one key (every other split empty), partial
    q = torch.randn(3, Hq, D, generator=g).to(DEVICE, dtype)
    before = (k_cache.clone(), v_cache.clone())
    out = decode_attention(q, k_cache, v_cache, used, slots, max_used=700)
    mask = torch.arange(C, device=DEVICE)[None, :] < used[:, None]
    want = _attend_one(q.double(), k_cache[slots].double(), v_cache[slots].double(), mask)
    assert out.dtype == dtype
    assert rel(out, want) <= (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])  # read only, every slot


@pytest.mark.parametrize("window", [None, 5])
def test_fused_recurrent_attention_triton_equals_reference(window, monkeypatch):
    """The whole decode op (rotate, append, attend, length += 1) through the kernel and the reference, from the same
    pools, over several steps: a ring that wraps, sessions of different lengths, an untouched slot."""
    g = seed()
    S, C, Hq, Hkv, D = 4, (window or 40), 4, 2, 16
    k0, v0 = _pool(g, S, C, Hkv, D, torch.float32)
    length0 = torch.tensor([0, 7, 3, 11], device=DEVICE) % (C if window is None else 10**6)
    slots = torch.tensor([2, 0, 1], device=DEVICE, dtype=torch.int32)
    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVFREE_KERNELS", mode)
        k_cache, v_cache, length = k0.clone(), v0.clone(), length0.clone()
        outs = []
        for step in range(8):
            q = torch.randn(3, Hq, D, generator=torch.Generator().manual_seed(step)).to(DEVICE)
            k = torch.randn(3, Hkv, D, generator=torch.Generator().manual_seed(100 + step)).to(DEVICE)
            v = torch.randn(3, Hkv, D, generator=torch.Generator().manual_seed(200 + step)).to(DEVICE)
            outs.append(fused_recurrent_attention(q, k, v, k_cache, v_cache, length, slots, window=window))
        results[mode] = (torch.stack(outs), k_cache, v_cache, length)
    (o_r, k_r, v_r, n_r), (o_t, k_t, v_t, n_t) = results["reference"], results["triton"]
    assert rel(o_t, o_r) <= 1e-5
    assert torch.equal(k_t, k_r) and torch.equal(v_t, v_r) and torch.equal(n_t, n_r)
    assert torch.equal(k_t[3], k0[3]) and n_t[3] == length0[3]  # slot 3 was not in the batch


# -- an fp8 (e4m3) cache with a scale per session and KV head ------------------------------------------------------
def _fp8_pool(g: torch.Generator, S: int, C: int, Hkv: int, D: int) -> tuple[torch.Tensor, ...]:
    """fp8 caches of values as the op stores them (random keys and values over random positive scales, varying by
    session and head), and the scale pools."""
    k, v = _pool(g, S, C, Hkv, D, torch.float32)
    k_scale = (torch.rand(S, Hkv, generator=g) * 2 + 0.25).to(DEVICE)
    v_scale = (torch.rand(S, Hkv, generator=g) * 2 + 0.25).to(DEVICE)
    return quantize(k, FP8, k_scale[:, None]), quantize(v, FP8, v_scale[:, None]), k_scale, v_scale


@pytest.mark.parametrize(("Hq", "Hkv", "D"), [(4, 2, 16), (6, 1, 32)])
def test_decode_attention_over_an_fp8_cache_matches_the_dequantized_float64_reference(Hq, Hkv, D):
    """The kernel reads e4m3 entries and each session's head scales: the float64 attention over the dequantized
    cache (k8 * k_scale, v8 * v_scale) is what it computes, to bf16 rounding; the cache and scales are only read."""
    g = seed("fp8", Hq, Hkv, D)
    S, C = 5, 600
    k8, v8, k_scale, v_scale = _fp8_pool(g, S, C, Hkv, D)
    slots = torch.tensor([3, 0, 4], device=DEVICE)
    used = torch.tensor([600, 1, 257], device=DEVICE)
    q = torch.randn(3, Hq, D, generator=g).to(DEVICE, torch.bfloat16)
    before = (k8.clone(), v8.clone(), k_scale.clone())
    out = decode_attention(q, k8, v8, used, slots, 600, k_scale, v_scale)
    mask = torch.arange(C, device=DEVICE)[None, :] < used[:, None]
    keys = dequantize(k8[slots], torch.float64, k_scale[slots][:, None].double())
    values = dequantize(v8[slots], torch.float64, v_scale[slots][:, None].double())
    want = _attend_one(q.double(), keys, values, mask)
    assert out.dtype == torch.bfloat16 and rel(out, want) <= 1e-2
    assert torch.equal(k8.view(torch.uint8), before[0].view(torch.uint8)) and torch.equal(k_scale, before[2])
    assert torch.equal(v8.view(torch.uint8), before[1].view(torch.uint8))


@pytest.mark.parametrize("window", [None, 5])
def test_an_fp8_cache_decodes_and_prefills_close_to_an_unquantized_one(window, monkeypatch):
    """A packed varlen prefill (continuing sessions' caches) then decode steps, through the Triton decode kernel and
    the reference, into an fp8 cache with per-session scales and into an fp32 cache, from the same start: the two
    kernels agree on the fp8 cache bit for bit in what they write and to 1e-5 in what they return; the fp8 outputs
    stay within e4m3's rounding (3 mantissa bits) of the fp32 ones; a slot outside the batch keeps its bytes."""
    from kvfree.kernels.attention import chunk_attention

    g = seed("fp8-op", window)
    S, C, Hq, Hkv, D = 4, (window or 48), 4, 2, 16
    k8, v8, k_scale, v_scale = _fp8_pool(g, S, C, Hkv, D)
    length0 = torch.tensor([0, 7, 3, 2], device=DEVICE)
    slots = torch.tensor([2, 0, 1], device=DEVICE, dtype=torch.int32)
    cu = torch.tensor([0, 5, 8, 14], device=DEVICE, dtype=torch.int32)
    qp, kp, vp = (torch.randn(14, h, D, generator=g).to(DEVICE) for h in (Hq, Hkv, Hkv))
    steps = [tuple(torch.randn(3, h, D, generator=g).to(DEVICE) for h in (Hq, Hkv, Hkv)) for _ in range(6)]
    results = {}
    runs = (("reference", "reference", True), ("triton", "triton", True), ("fp32", "reference", False))
    for name, mode, fp8 in runs:
        monkeypatch.setenv("KVFREE_KERNELS", mode)
        if fp8:
            k_cache, v_cache, scales = k8.clone(), v8.clone(), {"k_scale": k_scale, "v_scale": v_scale}
        else:
            k_cache = dequantize(k8, torch.float32, k_scale[:, None])
            v_cache = dequantize(v8, torch.float32, v_scale[:, None])
            scales = {}
        length = length0.clone()
        outs = [chunk_attention(qp, kp, vp, k_cache, v_cache, length, slots, cu, window=window,
                                cu_seqlens_cpu=[0, 5, 8, 14], **scales)]  # fmt: skip
        for q, k, v in steps:
            outs.append(fused_recurrent_attention(q, k, v, k_cache, v_cache, length, slots, window=window, **scales))
        results[name] = (torch.cat(outs), k_cache, v_cache, length)
    (o_r, k_r, v_r, n_r), (o_t, k_t, v_t, n_t) = results["reference"], results["triton"]
    o_f, n_f = results["fp32"][0], results["fp32"][3]
    assert rel(o_t, o_r) <= 1e-5
    assert torch.equal(k_t.view(torch.uint8), k_r.view(torch.uint8))
    assert torch.equal(v_t.view(torch.uint8), v_r.view(torch.uint8))
    assert torch.equal(n_t, n_r) and torch.equal(n_r, n_f) and n_r[2].item() == 3 + 5 + 6
    assert 1e-4 < rel(o_r, o_f) <= 0.06  # quantized (not equal), within e4m3's rounding
    assert torch.equal(k_t[3].view(torch.uint8), k8[3].view(torch.uint8))  # slot 3 was not in the batch
