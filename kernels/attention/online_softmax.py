"""The flash-style inner loop, shared by the attention prefill (chunk.py) and decode (fused_recurrent.py) and the
B'MOJO-F prefill (bmojo_f/chunk.py) kernels.

`key_range` folds blocks of BLOCK_N keys into a program's fp32 online softmax (running max and sum, exp2 with log2(e)
folded into the score scale) over its `[BLOCK_M, D]` queries: each block's `q k^T` and `p v` are tensor-core dots,
and only a block that may hold a key outside some query's band (or past the source's end) evaluates a mask. A query
at position p sees the keys of the band (p - lo_off, p - hi_off]: attention's causal window is the band
(p - window, p], plain causal attention has no lower edge (LOWER off), and B'MOJO-F's in-context and fading bands
are (p - W, p] and (p - 2W, p - W]. A key's row is read from a ring (position % ring) or from a source starting at
position `shift` (a full cache, or the packed chunk).

`prefill_config` is the two kernels' launch configuration.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")
LOG2E = 1.4426950408889634


@triton.jit
def key_block(
    acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, start, shift, kend, ring, lo_off, hi_off, scale, cols,
    m_cols, BLOCK_N: tl.constexpr, RING: tl.constexpr, MASK: tl.constexpr, LOWER: tl.constexpr, DPAD: tl.constexpr,
    CAST: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """Keys at positions start .. start+BLOCK_N-1 folded into the online softmax of the queries at positions `qp`.

    A key's row is `p % ring` of a ring (RING) or `p - shift` (the cache's entry, or the packed token of the
    sequence). MASK: some key of the block may be at or past `kend`, or outside a query's band (p - lo_off, p - hi_off]
    (without LOWER: keys up to p - hi_off): evaluate it. (hi_off passed as a literal 0 is a constant: no subtraction.)
    CAST: keys and values in another dtype than the queries (an fp8 cache, B'MOJO-F's rings), converted in registers.
    WIDE: row offsets past 2**31 elements (a huge cache or chunk): 64-bit arithmetic, else 32-bit (cheaper).
    """
    kp = start + tl.arange(0, BLOCK_N)
    row = kp % ring if RING else kp - shift
    if WIDE:
        row = row.to(tl.int64)
    k_ptr = k_base + row[:, None] * stride_k + cols[None, :]
    v_ptr = v_base + row[:, None] * stride_v + cols[None, :]
    if MASK:
        m_k = kp < kend
        ld = m_k[:, None] & m_cols[None, :] if DPAD else m_k[:, None]
        kb = tl.load(k_ptr, mask=ld, other=0.0)
        vb = tl.load(v_ptr, mask=ld, other=0.0)
    elif DPAD:
        kb = tl.load(k_ptr, mask=m_cols[None, :], other=0.0)
        vb = tl.load(v_ptr, mask=m_cols[None, :], other=0.0)
    else:
        kb = tl.load(k_ptr)
        vb = tl.load(v_ptr)
    if INTERP:  # the interpreter's bf16 dots are wrong (triton 3.6): fp32 operands
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    elif CAST:  # e4m3 widens exactly to the queries' dtype; a ring in another dtype is widened or narrowed
        kb = kb.to(qv.dtype)
        vb = vb.to(qv.dtype)
    s = tl.dot(qv, tl.trans(kb), input_precision=PREC)  # [BLOCK_M, BLOCK_N], fp32
    if MASK:
        ok = (kp[None, :] <= qp[:, None] - hi_off) & m_k[None, :]
        if LOWER:
            ok = ok & (kp[None, :] > qp[:, None] - lo_off)
        s = tl.where(ok, s, float("-inf"))
    # scale > 0 (log2(e) / sqrt(D), times an fp8 cache's k_scale): max(s) * scale = max(s * scale), one multiply per
    # row.
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    p = tl.exp2(s * scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(vb.dtype), vb, acc * alpha[:, None], input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def key_range(
    acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, lo, hi, shift, kend, ring, lo_off, hi_off, scale, cols,
    m_cols, BLOCK_N: tl.constexpr, RING: tl.constexpr, MASK: tl.constexpr, LOWER: tl.constexpr, DPAD: tl.constexpr,
    CAST: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """`key_block` for the blocks starting at lo, lo + BLOCK_N, ... below hi."""
    if INTERP:  # the interpreter (triton 3.6, numpy >= 2.4) cannot take range() of a loaded scalar
        start = lo
        while start < hi:
            acc, m_i, l_i = key_block(acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, start, shift, kend,
                                      ring, lo_off, hi_off, scale, cols, m_cols, BLOCK_N, RING, MASK, LOWER, DPAD,
                                      CAST, PREC, INTERP, WIDE)  # fmt: skip
            start += BLOCK_N
    else:  # a `for` loop, so that the compiler pipelines the next blocks' loads under this one's dots
        for start in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = key_block(acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, start, shift, kend,
                                      ring, lo_off, hi_off, scale, cols, m_cols, BLOCK_N, RING, MASK, LOWER, DPAD,
                                      CAST, PREC, INTERP, WIDE)  # fmt: skip
    return acc, m_i, l_i


def prefill_config(
    dtype: torch.dtype,
    D: int,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    *,
    fp32: tuple[int, int, int, int] | None = None,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for queries of `dtype` and head dim D, each one given overriding its
    default (block_n must divide block_m). fp32: the default for fp32 queries, where not attention's."""
    if _INTERPRET:  # small blocks: the tests' short sequences (and windows) cross block boundaries
        default = 16, 16, 4, 1
    elif dtype == torch.float32:  # IEEE fp32 dots: no tensor cores to feed, registers are the limit
        default = fp32 or (32, 32, 4 if D <= 64 else 8, 2)
    else:
        # bf16/fp16 (sm_90, compiled ahead for these: no spills in the loops, K/V loads pipelined through cp.async):
        # 64 KB of shared memory a program at D=64, 128 KB at D=128. 8 warps at either: the H200 sweep
        # (docs/bench/issue32/attention.json) put 8 at 1.32 ms against 4's 1.48-1.50 for a 16K prompt at H16 D64.
        default = 128, 64, 8, 3
    given = (block_m, block_n, num_warps, num_stages)
    bm, bn, warps, stages = (g or d for g, d in zip(given, default, strict=True))
    if bm % bn:
        raise ValueError(f"block_n={bn} must divide block_m={bm}")
    return bm, bn, warps, stages
