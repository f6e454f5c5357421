"""Triton prefill attention: packed variable-length prompts over each session's KV cache rows, read in place by slot.

`chunk_attention` is the op's Triton implementation (its spec is the reference's, reference.py): the step planned and
the cache written by the reference's own code (`plan_prefill`, `store_prefill`); the tokens rotated by `rotate`, one
pass that gives the reference's rotation bit for bit; and the attention itself by `prefill_attention`, a
flash-attention kernel in place of the reference's masked `scaled_dot_product_attention` over a gathered copy of the
cache (an explicit mask keeps PyTorch off its flash kernel, and the gather and the `[T, S]` mask are whole passes of
their own).

Design. One program per (query block of BLOCK_M rows of one sequence, query head); the query blocks of all sequences
are listed once per step on the host (`dispatch.chunk_metadata`, cached by boundaries) and walked last block first,
so the programs with the most keys start first and the short ones fill the tail. A program keeps its `[BLOCK_M, D]`
queries on chip and folds keys in BLOCK_N at a time into an fp32 online softmax (running max and sum, exp2 with
log2(e) folded into the score scale): first the session's cached past, read from its pool row where it lies (a full
cache: position p at entry p; a ring: p % window; an fp8 cache widened in registers, the session's k_scale folded
into the score scale and v_scale applied to the past's sum), then the new keys from the packed projections. The key
ranges are cut in the program from the session's length and the block's place, so that no block is loaded that every
query of the program masks out (causality; with a window, keys older than the window of the block's first query),
and only blocks that straddle a boundary (the window's edge, the diagonal, the end of the past) evaluate a mask: the
bulk of the work is plain `q k^T` and `p v` tensor-core dots (bf16/fp16 operands, fp32 accumulation) in `for` loops
that the compiler software-pipelines (the next blocks' loads in flight under this one's dots: online_softmax.py's
`key_range`, which B'MOJO-F's prefill shares). Query heads sharing a KV head (grouped-query) re-read its blocks from
L2. Nothing is read on the host beyond what the reference reads (the sessions' lengths, for the capacity check).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..dispatch import chunk_metadata
from ..launcher import launch_kernel
from .online_softmax import LOG2E, key_range, prefill_config
from .reference import PrefillPlan, check_fp8_scales, plan_prefill, rope_cos_sin, store_prefill

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _prefill_kernel(
    q, k, v, k_cache, v_cache, o, past, slots, cu_seqlens, blocks, k_scale, v_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kc_s, stride_kc_t, stride_kc_h, stride_vc_s, stride_vc_t, stride_vc_h, stride_sc,
    qk_scale, window, n_blocks,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr, FP8: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    i_c = n_blocks - 1 - tl.program_id(0)  # last blocks first: they see the most keys
    i_h = tl.program_id(1)
    i_kh = i_h // G
    i_n = tl.load(blocks + 2 * i_c)
    i_b = tl.load(blocks + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n)
    t_n = tl.load(cu_seqlens + i_n + 1) - bos
    n = tl.load(past + i_n).to(tl.int32)  # tokens the session had seen: the new ones sit at positions n, n+1, ...
    slot = tl.load(slots + i_n).to(tl.int64)
    DPAD: tl.constexpr = BLOCK_D != D

    j0 = i_b * BLOCK_M
    rows = j0 + tl.arange(0, BLOCK_M)
    m_rows = rows < t_n
    cols = tl.arange(0, BLOCK_D)
    m_cols = cols < D
    tok = bos.to(tl.int64) + rows
    qv = tl.load(q + tok[:, None] * stride_qt + i_h * stride_qh + cols[None, :],
                 mask=m_rows[:, None] & m_cols[None, :], other=0.0)  # fmt: skip
    if INTERP:
        qv = qv.to(tl.float32)
    qp = n + rows
    # A running max below any real score but finite: a row whose keys are all masked so far rescales by
    # exp2(m - m) = 1, where -inf - -inf would be NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # The cached past, positions [lo, n): with a window, from the first query's oldest visible key. Keys before
    # `edge` fall outside the window of some later query of the block, and the last partial block runs past n: those
    # blocks are masked, the ones between are not.
    kc = k_cache + slot * stride_kc_s + i_kh * stride_kc_h
    vc = v_cache + slot * stride_vc_s + i_kh * stride_vc_h
    past_scale = qk_scale
    if FP8:  # the cache holds k / k_scale: q . k = k_scale (q . k8)
        past_scale = qk_scale * tl.load(k_scale + slot * stride_sc + i_kh)
    if WINDOW:
        lo = tl.minimum(tl.maximum(n + j0 - window + 1, 0), n)  # (kept in [0, n]: no negative division below)
        edge = tl.minimum(tl.maximum(n + j0 + BLOCK_M - window, lo), n)
        mid = lo + tl.cdiv(edge - lo, BLOCK_N) * BLOCK_N
        acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, kc, vc, stride_kc_t, stride_vc_t, lo, mid, 0, n, window,
                                  window, 0, past_scale, cols, m_cols, BLOCK_N, True, True, True, DPAD, FP8, PREC,
                                  INTERP, WIDE)  # fmt: skip
    else:
        mid = 0
    full = mid + tl.maximum(n - mid, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, kc, vc, stride_kc_t, stride_vc_t, mid, full, 0, n, window,
                              window, 0, past_scale, cols, m_cols, BLOCK_N, WINDOW, False, WINDOW, DPAD, FP8, PREC,
                              INTERP, WIDE)  # fmt: skip
    acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, kc, vc, stride_kc_t, stride_vc_t, full, n, 0, n, window,
                              window, 0, past_scale, cols, m_cols, BLOCK_N, WINDOW, True, WINDOW, DPAD, FP8, PREC,
                              INTERP, WIDE)  # fmt: skip
    if FP8:  # and v: the past's weighted sum of v8, times v_scale, before the new (unquantized) values join it
        acc = acc * tl.load(v_scale + slot * stride_sc + i_kh)

    # The new keys, positions [lo2, n + min(j0 + BLOCK_M, t_n)), block-aligned within the sequence: [lo2, mid2) at
    # the window's edge (masked), [mid2, diag) wholly visible, [diag, hi) the diagonal (masked by causality).
    diag = n + j0
    kn = k + bos.to(tl.int64) * stride_kt + i_kh * stride_kh
    vn = v + bos.to(tl.int64) * stride_vt + i_kh * stride_vh
    kend = n + t_n
    if WINDOW:
        lo2 = n + tl.maximum(j0 - window + 1, 0) // BLOCK_N * BLOCK_N
        edge2 = tl.minimum(tl.maximum(n + j0 + BLOCK_M - window, lo2), diag)
        mid2 = lo2 + tl.cdiv(edge2 - lo2, BLOCK_N) * BLOCK_N
        acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, kn, vn, stride_kt, stride_vt, lo2, mid2, n, kend, 1,
                                  window, 0, qk_scale, cols, m_cols, BLOCK_N, False, True, True, DPAD, False, PREC,
                                  INTERP, WIDE)  # fmt: skip
    else:
        mid2 = n
    hi = n + tl.minimum(j0 + BLOCK_M, t_n)
    acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, kn, vn, stride_kt, stride_vt, mid2, diag, n, kend, 1, window,
                              0, qk_scale, cols, m_cols, BLOCK_N, False, False, WINDOW, DPAD, False, PREC,
                              INTERP, WIDE)  # fmt: skip
    acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, kn, vn, stride_kt, stride_vt, diag, hi, n, kend, 1, window,
                              0, qk_scale, cols, m_cols, BLOCK_N, False, True, WINDOW, DPAD, False, PREC,
                              INTERP, WIDE)  # fmt: skip

    # Every real query sees itself, so l > 0 on its row; rows past the sequence's end are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o + tok[:, None] * stride_ot + i_h * stride_oh + cols[None, :], out.to(o.dtype.element_ty),
             mask=m_rows[:, None] & m_cols[None, :])  # fmt: skip


@triton.jit
def _rope_kernel(
    x, out, cos, sin, T, stride_xt, stride_xh, stride_ot, stride_oh,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_T: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """One head of BLOCK_T tokens rotated "rotate half" style: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.arange(0, BLOCK_HALF)
    m = (t < T)[:, None] & (c < HALF)[None, :]
    t64 = t.to(tl.int64)[:, None]
    p_x = x + t64 * stride_xt + i_h * stride_xh + c[None, :]
    x1 = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p_x + HALF, mask=m, other=0.0).to(tl.float32)
    cs = tl.load(cos + t64 * HALF + c[None, :], mask=m, other=0.0)
    sn = tl.load(sin + t64 * HALF + c[None, :], mask=m, other=0.0)
    # Each product rounded, then the sum: apply_rope's sequence of tensor ops, bit for bit (launched without fp
    # fusion, so that no FMA merges a product into the sum).
    p_o = out + t64 * stride_ot + i_h * stride_oh + c[None, :]
    tl.store(p_o, _round(x1 * cs - x2 * sn, out.dtype.element_ty, INTERP), mask=m)
    tl.store(p_o + HALF, _round(x2 * cs + x1 * sn, out.dtype.element_ty, INTERP), mask=m)


@triton.jit
def _round(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 x in `dtype`, rounded to nearest even as torch's `.to` does. (The interpreter truncates to bf16 (triton
    3.6): there the rounding is done on the bits.)"""
    if INTERP and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


# The last step's rotation tables: every layer of a prefill step rotates at the same positions.
_tables: dict[str, tuple] = {}


def rotate(q: torch.Tensor, k: torch.Tensor, plan: PrefillPlan, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, Hq, D]` and k `[T, Hkv, D]` rotated at the plan's positions, bit for bit what `reference._rotate` gives
    (the same cos/sin tables, the same rounding), in one read and one write of each instead of its dozen fp32
    passes over the pair (a few hundred microseconds a layer at 16K tokens)."""
    T, _, D = q.shape
    key = (plan.cu, tuple(plan.past_h), D, theta, str(q.device))
    hit = _tables.get("last")
    if hit is None or hit[0] != key:
        hit = _tables["last"] = (key, rope_cos_sin(plan.pos, D, theta))
    cos, sin = hit[1]
    outs = []
    for x in (q, k):
        out = common.output_buffer(tuple(x.shape), x.dtype, x.device)
        if T:
            block_t = 16 if _INTERPRET else 64
            launch_kernel(_rope_kernel, (common.cdiv(T, block_t), x.shape[1]),
                x, out, cos, sin, T, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                HALF=D // 2, BLOCK_HALF=common.next_power_of_2(D // 2), BLOCK_T=block_t, INTERP=_INTERPRET, num_warps=4,
                enable_fp_fusion=False,
            )  # fmt: skip
        outs.append(out)
    return outs[0], outs[1]


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    past: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu: tuple[int, ...],
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention of packed new tokens over their sessions' cached past and themselves; writes nothing.

    Args:
        q: `[T, Hq, D]` rotated queries (bf16/fp16/fp32).  k, v: `[T, Hkv, D]` rotated new keys and values, Hkv
            dividing Hq (query head h reads KV head h // (Hq / Hkv)).
        k_cache, v_cache: `[S, C, Hkv, D]` pools in q's dtype or float8_e4m3fn (then with `k_scale`, `v_scale`:
            `[S, Hkv]` fp32 pools, the cache holding k / k_scale); session i's past position p at entry p, or p %
            window of a ring (C = window).
        past: `[N]` int, tokens each session had seen (its new tokens are at positions past .. past + T_i - 1).
        slots: `[N]` int, each session's pool row.  cu_seqlens: `[N+1]` int32 on the device; cu: the same on the host.
        window: None for full causal attention; else a query at p sees keys at positions > p - window.
        block_m, block_n, num_warps, num_stages: override the launch configuration (block_n divides block_m).

    Returns:
        `[T, Hq, D]` in q's dtype (scores, softmax and sums in fp32).
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    bm, bn, warps, stages = prefill_config(q.dtype, D, block_m, block_n, num_warps, num_stages)
    out = common.output_buffer((T, Hq, D), q.dtype, q.device)
    blocks, _, n_blocks = chunk_metadata(cu, bm, q.device)
    if n_blocks == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    fp8 = check_fp8_scales(k_scale, v_scale)
    # The largest row offset the key loads compute: an entry of a pool row, or a token of the packed chunk.
    wide = max(k_cache.shape[1] * max(k_cache.stride(1), v_cache.stride(1)), T * max(k.stride(0), v.stride(0))) >= 2**31
    launch_kernel(_prefill_kernel, (n_blocks, Hq),
        q, k, v, k_cache, v_cache, out, past, slots, cu_seqlens, blocks, k_scale if fp8 else q, v_scale if fp8 else q,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), k_scale.stride(0) if fp8 else 0,
        D**-0.5 * LOG2E, window or 0, n_blocks,
        G=Hq // Hkv, D=D, BLOCK_D=max(16, common.next_power_of_2(D)), BLOCK_M=bm, BLOCK_N=bn,
        WINDOW=window is not None, FP8=fp8, WIDE=wide,
        # fp32 queries: IEEE fp32 dots, not tf32. The interpreter is always told "ieee" (it mishandles "tf32").
        PREC="ieee" if q.dtype == torch.float32 or _INTERPRET else "tf32", INTERP=_INTERPRET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rope_theta: float = 10000.0,
    window: int | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.attention.chunk_attention` (same arguments and result; see its docstring)."""
    plan = plan_prefill(q, length, state_indices, cu_seqlens, cu_seqlens_cpu, k_cache, window)
    q, k = rotate(q, k, plan, rope_theta)
    cu_dev = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = prefill_attention(q, k, v, k_cache, v_cache, plan.past, plan.idx, cu_dev, plan.cu, window, k_scale, v_scale)
    store_prefill(plan, k, v, k_cache, v_cache, length, window, k_scale, v_scale)
    return out
