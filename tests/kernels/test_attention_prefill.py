"""The prefill attention kernel (kernels/attention/chunk.py): Triton (under the interpreter on the CPU) against the
float64 reference, on pool rows addressed by slot.

Packed prompts of lengths 1, one short of a block, a block, 0 and several blocks; fresh sessions and sessions that
continue a cache (read in place, a full cache and a ring that has wrapped); sliding windows shorter than the prompt
and than the past; grouped-query heads; fp32 and bf16 inputs; an fp8 cache with per-session scales; every buffer
the kernel allocates poisoned first, and the cache read only. The Triton rotation is the reference's bit for bit.
Then the op end to end (`chunk_attention` with `KVFREE_KERNELS=triton` against `reference`, two chunks in a row): the
same cache bytes and lengths written, rows of other slots untouched; an all-empty step; a full cache refused before
anything is written. Fresh random inputs per case; tolerances (relative): 1e-5 with fp32 inputs, 1e-2 with bf16.
Blocks of 16 rows and keys under the interpreter (the kernel's default there), 32 x 16 in one case.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from kvfree.kernels.attention import KVCacheFull, chunk_attention  # noqa: E402
from kvfree.kernels.attention.chunk import prefill_attention, rotate  # noqa: E402
from kvfree.kernels.attention.reference import (  # noqa: E402
    FP8,
    _attend_prefill,
    _rotate,
    dequantize,
    plan_prefill,
    quantize,
)
from tests.kernel_checks import DEVICE, cu_of, rel, seed, untouched  # noqa: E402

f64 = torch.float64
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
LENS = [1, 15, 16, 0, 40]  # one token; one short of a block; a block; empty; several blocks (blocks of 16)
S = 7  # pool rows


def _case(key, lens: list[int], past: list[int], Hq: int, Hkv: int, D: int, window: int | None,
          dtype: torch.dtype) -> dict:  # fmt: skip
    """Packed (already rotated) q, k, v in `dtype`, a pool of S rows (a full cache sized to the longest context plus
    a few entries, or a ring of `window`), distinct random slots whose lengths are `past`."""
    g = seed(*key)
    T, N = sum(lens), len(lens)
    C = window or max(n + t for n, t in zip(past, lens, strict=True)) + 5
    q, k, v = (torch.randn(T, h, D, generator=g).to(DEVICE, dtype) for h in (Hq, Hkv, Hkv))
    k_cache, v_cache = (torch.randn(S, C, Hkv, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    slots = torch.randperm(S, generator=g)[:N].to(DEVICE, torch.int32)
    length = torch.randint(0, 50, (S,), generator=g).to(DEVICE)
    length[slots.long()] = torch.tensor(past, device=DEVICE)
    cu = cu_of(lens)
    plan = plan_prefill(q, length, slots, cu, cu.tolist(), k_cache, window)
    return {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "plan": plan, "cu": cu, "g": g}


def _check(c: dict, window: int | None, dtype: torch.dtype, **blocks) -> None:
    """The kernel against the float64 reference attention of the same inputs; the cache left as it was."""
    plan = c["plan"]
    before = (c["k_cache"].clone(), c["v_cache"].clone())
    out = prefill_attention(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], plan.past, plan.idx, c["cu"], plan.cu,
                            window, **blocks)  # fmt: skip
    want = _attend_prefill(*(c[n].to(f64) for n in ("q", "k", "v", "k_cache", "v_cache")), plan, window, None, None)
    assert out.dtype == dtype and rel(out, want) <= TOL[dtype]
    assert torch.equal(c["k_cache"], before[0]) and torch.equal(c["v_cache"], before[1])  # read only, every slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_packed_prompts_of_every_length_match_the_float64_reference(poison, dtype):
    _check(_case(("fresh", dtype), LENS, [0] * 5, 4, 2, 16, None, dtype), None, dtype)


@pytest.mark.parametrize(("dtype", "Hq", "Hkv", "D"), [(torch.float32, 4, 2, 16), (torch.bfloat16, 3, 1, 32)])
def test_continued_sessions_attend_to_their_cached_past_read_in_place(poison, dtype, Hq, Hkv, D):
    """Sessions with 3, 17, 5 and 33 tokens cached (one a block and one, one two blocks and one) beside fresh ones."""
    past = [3, 0, 17, 5, 33]
    _check(_case(("continued", dtype, Hq), LENS, past, Hq, Hkv, D, None, dtype), None, dtype)


@pytest.mark.parametrize("window", [1, 7, 20])
def test_a_sliding_window_over_a_wrapped_ring_matches_the_float64_reference(poison, window):
    """Windows shorter than the long prompt (7: several blocks skipped; 20: a block boundary inside it) and than
    the sessions' pasts (their rings have wrapped), and a window of one token (each query sees itself)."""
    past = [3, 0, 17, 5, 33]
    _check(_case(("window", window), LENS, past, 4, 2, 16, window, torch.float32), window, torch.float32)


def test_query_blocks_spanning_several_key_blocks_and_a_head_dim_not_a_power_of_two(poison):
    """32-row query blocks over 16-key blocks (the diagonal crosses two), a window, and D = 24 (padded to 32)."""
    past = [3, 0, 17, 5, 33]
    c = _case(("blocks",), [1, 31, 32, 0, 70], past, 4, 2, 24, 20, torch.bfloat16)
    _check(c, 20, torch.bfloat16, block_m=32, block_n=16)


@pytest.mark.parametrize("window", [None, 6])
def test_an_fp8_cache_is_read_with_each_sessions_scales(poison, window):
    """e4m3 entries times each session's per-KV-head scales: what the kernel computes is the float64 attention over
    the dequantized cache (the new tokens unquantized), to bf16 rounding."""
    past = [3, 0, 17, 5, 33]
    c = _case(("fp8", window), LENS, past, 4, 2, 16, window, torch.bfloat16)
    g = c["g"]
    k_scale, v_scale = ((torch.rand(S, 2, generator=g) * 2 + 0.25).to(DEVICE) for _ in range(2))
    k8 = quantize(c["k_cache"].float(), FP8, k_scale[:, None])
    v8 = quantize(c["v_cache"].float(), FP8, v_scale[:, None])
    plan = c["plan"]
    before = (k8.view(torch.uint8).clone(), v8.view(torch.uint8).clone())
    out = prefill_attention(c["q"], c["k"], c["v"], k8, v8, plan.past, plan.idx, c["cu"], plan.cu, window, k_scale,
                            v_scale)  # fmt: skip
    keys, values = dequantize(k8, f64, k_scale[:, None].double()), dequantize(v8, f64, v_scale[:, None].double())
    want = _attend_prefill(*(c[n].to(f64) for n in ("q", "k", "v")), keys, values, plan, window, None, None)
    assert out.dtype == torch.bfloat16 and rel(out, want) <= 1e-2
    assert torch.equal(k8.view(torch.uint8), before[0]) and torch.equal(v8.view(torch.uint8), before[1])


@pytest.mark.parametrize(("window", "dtype"), [(None, torch.float32), (6, torch.bfloat16)])
def test_the_op_through_the_kernel_writes_what_the_reference_writes(poison, window, dtype, monkeypatch):
    """`chunk_attention` (rotate, attend, write, length += T) through Triton and the reference from the same pools,
    two chunks in a row (the second continues the first; with a window, a prompt longer than the ring): outputs to
    rounding, the same cache entries (the rotation is the reference's bit for bit) and lengths, rows of slots
    outside the batch untouched."""
    g = seed("op", window)
    Hq, Hkv, D = 4, 2, 16
    C = window or 64
    k0, v0 = (torch.randn(S, C, Hkv, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    length0 = torch.tensor([0, 7, 3, 11, 2, 0, 5], device=DEVICE)
    slots = torch.tensor([2, 0, 5], device=DEVICE, dtype=torch.int32)
    chunks = []
    for lens in ([9, 1, 17], [4, 0, 16]):
        T = sum(lens)
        chunks.append((lens, *(torch.randn(T, h, D, generator=g).to(DEVICE, dtype) for h in (Hq, Hkv, Hkv))))
    results = {}
    for mode in ("reference", "triton"):
        monkeypatch.setenv("KVFREE_KERNELS", mode)
        k_cache, v_cache, length = k0.clone(), v0.clone(), length0.clone()
        outs = [chunk_attention(q, k, v, k_cache, v_cache, length, slots, cu_of(lens), window=window,
                                cu_seqlens_cpu=cu_of(lens).tolist()) for lens, q, k, v in chunks]  # fmt: skip
        results[mode] = (torch.cat(outs), k_cache, v_cache, length)
    (o_r, k_r, v_r, n_r), (o_t, k_t, v_t, n_t) = results["reference"], results["triton"]
    assert rel(o_t, o_r) <= TOL[dtype]
    assert torch.equal(k_t, k_r) and torch.equal(v_t, v_r) and torch.equal(n_t, n_r)
    assert torch.equal(untouched(k_t, slots), untouched(k0, slots)) and torch.equal(untouched(v_t, slots),
                                                                                    untouched(v0, slots))  # fmt: skip
    assert torch.equal(untouched(n_t, slots), untouched(length0, slots))
    assert n_t[2].item() == 3 + 9 + 4 and n_t[5].item() == 0 + 17 + 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotation_is_the_references_bit_for_bit(poison, dtype):
    """The Triton RoPE (one pass) gives exactly `reference._rotate`'s q and k (the cache stores the keys), at
    positions continuing sessions' pasts, on q and k that are views of one projection (strided)."""
    c = _case(("rope", dtype), LENS, [3, 0, 17, 5, 1000], 4, 2, 24, None, dtype)
    qk = torch.randn(sum(LENS), 6, 24, generator=c["g"]).to(DEVICE, dtype) * 4
    q, k = qk[:, :4], qk[:, 4:]
    want = _rotate(q, k, c["plan"].pos, 500000.0)
    got = rotate(q, k, c["plan"], 500000.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_an_all_empty_step_and_a_full_cache_through_the_kernel(monkeypatch):
    """No tokens at all: an empty output, nothing written. A context past a full cache's capacity: `KVCacheFull`
    before anything is written, as the reference raises it."""
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    g = seed("edges")
    k_cache, v_cache = (torch.randn(S, 8, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    length = torch.tensor([0, 5, 0, 0, 0, 0, 0], device=DEVICE)
    before = (k_cache.clone(), v_cache.clone(), length.clone())
    slots = torch.tensor([1, 3], device=DEVICE, dtype=torch.int32)
    empty = [torch.zeros(0, h, 16, device=DEVICE) for h in (4, 2, 2)]
    out = chunk_attention(*empty, k_cache, v_cache, length, slots, cu_of([0, 0]), cu_seqlens_cpu=[0, 0, 0])
    assert out.shape == (0, 4, 16)
    q, k, v = (torch.randn(4, h, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    with pytest.raises(KVCacheFull):
        chunk_attention(q, k, v, k_cache, v_cache, length, slots, cu_of([4, 0]), cu_seqlens_cpu=[0, 4, 4])
    assert all(torch.equal(a, b) for a, b in zip((k_cache, v_cache, length), before, strict=True))
