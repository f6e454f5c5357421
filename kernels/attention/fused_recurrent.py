"""Triton decode attention: one query token per session against its KV cache rows in the pool, read in place.

`fused_recurrent_attention` is the op's Triton implementation (its spec is the reference's, reference.py): the
token rotated and appended as the reference does, then `decode_attention`, with no read on the host.

The PyTorch reference (`reference._attend_one`) gathers every session's keys and values into a new tensor and copies
them to fp32 before the scores: several passes over the cache per step. This kernel reads each session's cache rows
where they lie in the pool (`[S, C, Hkv, D]`, addressed by slot) once: one program per (session, KV head, split of
the keys) takes the query heads that share the KV head (grouped-query), keeps an online softmax in fp32, and writes
its partial result; `decode_attention` merges the splits by their log-sum-exps (flash-decoding). The split count
grows when there are few sessions, so that a long context still spreads over the GPU.

The session's entries are the first `min(length, C)` of its row (a full cache: positions 0..n; a ring: every entry
once wrapped, in any order, since RoPE already encodes the positions).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel
from .reference import _check_capacity, _entries, append_token, check_fp8_scales

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _decode_attention_kernel(
    q, k_cache, v_cache, used, slots, o_part, m_part, l_part, k_scale, v_scale,
    stride_qb, stride_qh, stride_kc_s, stride_kc_t, stride_kc_h, stride_vc_s, stride_vc_t, stride_vc_h,
    stride_ob, stride_oh, stride_os, stride_mb, stride_mh, stride_sc,
    scale, split_len,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, INTERP: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    i_b, i_kh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + i_b).to(tl.int64)
    n = tl.load(used + i_b)
    start = i_s * split_len
    end = tl.minimum(start + split_len, n)
    rows = tl.arange(0, BLOCK_G)
    cols = tl.arange(0, BLOCK_D)
    m_g, m_d = rows < G, cols < D
    heads = i_kh * G + rows
    qv = tl.load(q + i_b * stride_qb + heads[:, None] * stride_qh + cols[None, :], mask=m_g[:, None] & m_d[None, :])
    qv = qv.to(tl.float32) * scale
    if FP8:  # an fp8 cache holds k / k_scale and v / v_scale (per session and KV head): q . k = k_scale (q . k_8)
        qv = qv * tl.load(k_scale + slot * stride_sc + i_kh)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = k_cache + slot * stride_kc_s + i_kh * stride_kc_h
    v_base = v_cache + slot * stride_vc_s + i_kh * stride_vc_h
    t0 = start
    while t0 < end:  # (a while loop: the interpreter cannot take range() of a runtime bound)
        t = t0 + tl.arange(0, BLOCK_N)
        m_t = t < end
        kv_mask = m_t[:, None] & m_d[None, :]
        kb = tl.load(k_base + t[:, None] * stride_kc_t + cols[None, :], mask=kv_mask, other=0.0)
        if INTERP:  # the interpreter's bf16 dots are wrong (triton 3.6): give it fp32 operands
            kb = kb.to(tl.float32)
        elif FP8:  # e4m3 widens exactly to the query's dtype, in registers
            kb = kb.to(q.dtype.element_ty)
        s = tl.dot(qv.to(kb.dtype), tl.trans(kb), input_precision=PREC)  # [BLOCK_G, BLOCK_N], fp32 accumulation
        s = tl.where(m_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        vb = tl.load(v_base + t[:, None] * stride_vc_t + cols[None, :], mask=kv_mask, other=0.0)
        if INTERP:
            vb = vb.to(tl.float32)
        elif FP8:
            vb = vb.to(q.dtype.element_ty)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        t0 += BLOCK_N
    if FP8:  # sum_t p_t v_t = v_scale sum_t p_t v8_t
        acc = acc * tl.load(v_scale + slot * stride_sc + i_kh)
    out = o_part + i_b * stride_ob + heads[:, None] * stride_oh + i_s * stride_os + cols[None, :]
    tl.store(out, acc, mask=m_g[:, None] & m_d[None, :])
    tl.store(m_part + i_b * stride_mb + heads * stride_mh + i_s, m_i, mask=m_g)
    tl.store(l_part + i_b * stride_mb + heads * stride_mh + i_s, l_i, mask=m_g)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, used: torch.Tensor, slots: torch.Tensor,
    max_used: int, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Softmax attention of one query per session over its first `used` cache entries, read in place.

    Args:
        q: `[B, Hq, D]` rotated queries.  k_cache, v_cache: `[S, C, Hkv, D]` pools (Hkv divides Hq), in q's dtype
            or float8_e4m3fn (then with `k_scale`, `v_scale`: `[S, Hkv]` fp32 pools, the cache holding k / k_scale).
        used: `[B]` int, entries of each session's row to attend (1..C).  slots: `[B]` int, each session's pool row.
        max_used: an upper bound of `used` (host int: it sizes the key splits).

    Returns:
        `[B, Hq, D]` in q's dtype (scores, softmax and sums in fp32).
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    BLOCK_N = 64
    # Enough programs to fill the GPU (~4 per SM) when sessions are few; each split at least 256 keys.
    sms = common.sm_count(q.device) if q.is_cuda else 4
    splits = max(1, min(common.cdiv(max_used, 256), common.cdiv(4 * sms, B * Hkv)))
    split_len = common.cdiv(common.cdiv(max(max_used, 1), splits), BLOCK_N) * BLOCK_N
    splits = common.cdiv(max(max_used, 1), split_len)
    o_part = common.output_buffer((B, Hq, splits, D), torch.float32, q.device)
    m_part = common.output_buffer((B, Hq, splits), torch.float32, q.device)
    l_part = common.output_buffer((B, Hq, splits), torch.float32, q.device)
    q = q.contiguous()
    fp8 = check_fp8_scales(k_scale, v_scale)
    launch_kernel(_decode_attention_kernel, (B, Hkv, splits),
        q, k_cache, v_cache, used, slots, o_part, m_part, l_part, k_scale if fp8 else q, v_scale if fp8 else q,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0), m_part.stride(1),
        k_scale.stride(0) if fp8 else 0, D**-0.5, split_len,
        G=G, BLOCK_G=max(16, common.next_power_of_2(G)), D=D, BLOCK_D=max(16, common.next_power_of_2(D)),
        # fp32 caches: IEEE fp32 dots, not tf32. The interpreter is always told "ieee" (it mishandles "tf32").
        BLOCK_N=BLOCK_N, PREC="ieee" if q.dtype == torch.float32 or _INTERPRET else "tf32", INTERP=_INTERPRET,
        FP8=fp8,
    )  # fmt: skip
    # Merge the splits: a split with no keys has m = -inf and l = 0, and weighs nothing.
    m = m_part.amax(-1, keepdim=True)
    w = torch.exp(m_part - m).nan_to_num(0.0)
    out = (o_part * w[..., None]).sum(2) / (l_part * w).sum(-1, keepdim=True)
    return out.to(q.dtype)


def fused_recurrent_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    state_indices: torch.Tensor,
    rope_theta: float = 10000.0,
    window: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.attention.fused_recurrent_attention` (same arguments and result; see its docstring).
    The key splits are sized by the capacity C, so nothing is read on the host and a full cache is not checked."""
    idx = state_indices.to(torch.int64)
    n = length.index_select(0, idx)
    C = k_cache.shape[1]
    _check_capacity(k_cache, C, window)  # only a ring of the wrong size can fail here
    entry = n.clamp(max=C - 1) if window is None else _entries(n, window)
    q = append_token(q, k, v, k_cache, v_cache, idx, n, entry, rope_theta, k_scale, v_scale)
    after = n + 1
    out = decode_attention(q, k_cache, v_cache, after.clamp(max=C), idx, C, k_scale, v_scale)
    length.index_copy_(0, idx, after)
    return out
