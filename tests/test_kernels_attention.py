"""The decode attention kernel (kernels/attention/decode.py): Triton (under the interpreter on the CPU) against the
float64 reference, on pool rows addressed by slot: sessions of different lengths (splits partly and wholly empty),
grouped-query heads, a full cache and a wrapped ring, rows of other slots untouched; and the op end to end
(`fused_recurrent_attention` with `KVFREE_KERNELS=triton` against `reference`)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvfree.kernels.attention import fused_recurrent_attention  # noqa: E402
from kvfree.kernels.attention.decode import decode_attention  # noqa: E402
from kvfree.kernels.attention.reference import _attend_one  # noqa: E402
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
