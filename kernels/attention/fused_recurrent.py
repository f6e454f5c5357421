"""Triton decode attention: one query token per session against its KV cache rows in the pool, read in place.

`fused_recurrent_attention` is the op's Triton implementation (its spec is the reference's, reference.py): the
token rotated and appended as the reference does, then `decode_attention`, with no read on the host.

The PyTorch reference (`reference._attend_one`) gathers every session's keys and values into a new tensor and copies
them to fp32 before the scores: several passes over the cache per step. This kernel reads each session's cache rows
where they lie in the pool (`[S, C, Hkv, D]`, addressed by slot) once: one program per (session, KV head, split of
the keys) takes the query heads that share the KV head (grouped-query), folds the keys into an online softmax in fp32
with the prefill's inner loop (`online_softmax.key_range`: whole blocks unmasked, their loads pipelined), and writes
its partial result; `decode_attention` merges the splits by their log-sum-exps (flash-decoding). The split count
grows when there are few sessions, so that a long context still spreads over the GPU.

The session's entries are the first `min(length, C)` of its row (a full cache: positions 0..n; a ring: every entry
once wrapped, in any order, since RoPE already encodes the positions).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel
from .online_softmax import LOG2E, key_range
from .reference import _check_capacity, _entries, append_token, check_fp8_scales

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _decode_attention_kernel(
    q, k_cache, v_cache, used, slots, o_part, m_part, l_part, k_scale, v_scale,
    stride_qb, stride_qh, stride_kc_s, stride_kc_t, stride_kc_h, stride_vc_s, stride_vc_t, stride_vc_h,
    stride_ob, stride_oh, stride_os, stride_mb, stride_mh, stride_sc,
    qk_scale, split_len,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr, INTERP: tl.constexpr, FP8: tl.constexpr, F16: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    i_b, i_kh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + i_b).to(tl.int64)
    n = tl.load(used + i_b).to(tl.int32)
    start = i_s * split_len
    end = tl.minimum(start + split_len, n)  # below start when the split lies past the session's entries: no keys
    full = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    DPAD: tl.constexpr = BLOCK_D != D
    rows = tl.arange(0, BLOCK_G)
    cols = tl.arange(0, BLOCK_D)
    m_g, m_cols = rows < G, cols < D
    heads = i_kh * G + rows
    qv = tl.load(q + i_b * stride_qb + heads[:, None] * stride_qh + cols[None, :],
                 mask=m_g[:, None] & m_cols[None, :], other=0.0)  # fmt: skip
    if INTERP:
        qv = qv.to(tl.float32)
    elif F16:  # e4m3 widens to fp16 in one instruction a pair (cvt.rn.f16x2.e4m3x2), to bf16 in several: the dots
        # run in fp16 (fp32 accumulation), the query clamped to fp16's range (real queries are far inside it)
        qv = tl.clamp(qv.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    qp = tl.zeros([BLOCK_G], tl.int32) + end - 1  # the prefill's causal mask, every query at the last key: kp < end
    scale = qk_scale
    if FP8:  # an fp8 cache holds k / k_scale and v / v_scale (per session and KV head): q . k = k_scale (q . k_8)
        scale = qk_scale * tl.load(k_scale + slot * stride_sc + i_kh)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: an empty split weighs exp2(-1e30 - m) = 0 in the merge
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    kc = k_cache + slot * stride_kc_s + i_kh * stride_kc_h
    vc = v_cache + slot * stride_vc_s + i_kh * stride_vc_h
    # Whole blocks unmasked (pipelined loads), then the split's last partial block masked.
    acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, kc, vc, stride_kc_t, stride_vc_t, start, full, 0, end, 1, 0, 0,
                              scale, cols, m_cols, BLOCK_N, False, False, False, DPAD, FP8, PREC, INTERP,
                              WIDE)  # fmt: skip
    acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, kc, vc, stride_kc_t, stride_vc_t, full, end, 0, end, 1, 0, 0,
                              scale, cols, m_cols, BLOCK_N, False, True, False, DPAD, FP8, PREC, INTERP,
                              WIDE)  # fmt: skip
    if FP8:  # sum_t p_t v_t = v_scale sum_t p_t v8_t
        acc = acc * tl.load(v_scale + slot * stride_sc + i_kh)
    out = o_part + i_b * stride_ob + heads[:, None] * stride_oh + i_s * stride_os + cols[None, :]
    tl.store(out, acc, mask=m_g[:, None] & m_cols[None, :])
    tl.store(m_part + i_b * stride_mb + heads * stride_mh + i_s, m_i, mask=m_g)
    tl.store(l_part + i_b * stride_mb + heads * stride_mh + i_s, l_i, mask=m_g)


@dataclass(frozen=True)
class DecodeConfig:
    """The decode kernel's launch: keys per block, warps, pipeline stages, and how a session's keys are split."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int  # split the keys until there are about this many programs per multiprocessor ...
    min_split: int  # ... with no split shorter than this many keys


def decode_config(**given: int | None) -> DecodeConfig:
    """The launch, each keyword given (not None) overriding its default."""
    # Interpreted: small blocks and splits, so that the tests' short rows cross block and split boundaries. Else the
    # H200 sweep at hmf's 8B shape, 16K keys a session (docs/bench/issue48/run2/attention_decode.json): 128 keys a
    # block, 3 stages and ~8 programs per SM were within 1.5% of the best of 27 launches at 60 bf16 and 116 e4m3
    # sessions; the old 64-key blocks with ~4 programs per SM were 6% slower in bf16.
    default = DecodeConfig(16, 4, 1, 4, 64) if _INTERPRET else DecodeConfig(128, 4, 3, 8, 256)
    return dataclasses.replace(default, **{k: v for k, v in given.items() if v is not None})


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, used: torch.Tensor, slots: torch.Tensor,
    max_used: int, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    programs_per_sm: int | None = None, min_split: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Softmax attention of one query per session over its first `used` cache entries, read in place.

    Args:
        q: `[B, Hq, D]` rotated queries.  k_cache, v_cache: `[S, C, Hkv, D]` pools (Hkv divides Hq), in q's dtype
            or float8_e4m3fn (then with `k_scale`, `v_scale`: `[S, Hkv]` fp32 pools, the cache holding k / k_scale).
        used: `[B]` int, entries of each session's row to attend (1..C).  slots: `[B]` int, each session's pool row.
        max_used: an upper bound of `used` (host int: it sizes the key splits).
        block_n, num_warps, num_stages, programs_per_sm, min_split: override the launch (`decode_config`).

    Returns:
        `[B, Hq, D]` in q's dtype (scores, softmax and sums in fp32).
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    cfg = decode_config(block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                        programs_per_sm=programs_per_sm, min_split=min_split)  # fmt: skip
    # Enough programs to fill the GPU when sessions are few, so that a long context still spreads over it.
    sms = common.sm_count(q.device) if q.is_cuda else 4
    keys = max(max_used, 1)
    splits = max(1, min(common.cdiv(keys, cfg.min_split), common.cdiv(cfg.programs_per_sm * sms, B * Hkv)))
    split_len = common.cdiv(common.cdiv(keys, splits), cfg.block_n) * cfg.block_n
    splits = common.cdiv(keys, split_len)
    o_part = common.output_buffer((B, Hq, splits, D), torch.float32, q.device)
    m_part = common.output_buffer((B, Hq, splits), torch.float32, q.device)
    l_part = common.output_buffer((B, Hq, splits), torch.float32, q.device)
    q = q.contiguous()
    fp8 = check_fp8_scales(k_scale, v_scale)
    wide = k_cache.shape[1] * max(k_cache.stride(1), v_cache.stride(1)) >= 2**31  # a row's offsets past int32
    launch_kernel(_decode_attention_kernel, (B, Hkv, splits),
        q, k_cache, v_cache, used, slots, o_part, m_part, l_part, k_scale if fp8 else q, v_scale if fp8 else q,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0), m_part.stride(1),
        k_scale.stride(0) if fp8 else 0, D**-0.5 * LOG2E, split_len,
        G=G, BLOCK_G=max(16, common.next_power_of_2(G)), D=D, BLOCK_D=max(16, common.next_power_of_2(D)),
        # fp32 caches: IEEE fp32 dots, not tf32. The interpreter is always told "ieee" (it mishandles "tf32").
        BLOCK_N=cfg.block_n, PREC="ieee" if q.dtype == torch.float32 or _INTERPRET else "tf32", INTERP=_INTERPRET,
        # An e4m3 cache under 16-bit queries: dots in fp16 (F16). fp32 queries keep fp32 dots (e4m3 widens exactly).
        FP8=fp8, F16=fp8 and q.dtype != torch.float32, WIDE=wide, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    # Merge the splits by their log2-sum-exps (the kernel's running max is in log2 units): an empty split has
    # m = -1e30 and l = 0, and weighs nothing.
    m = m_part.amax(-1, keepdim=True)
    w = torch.exp2(m_part - m)
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
