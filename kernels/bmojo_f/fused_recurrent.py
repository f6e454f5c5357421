"""Triton B'MOJO-F decode: one token per session against its in-context and fading rings, read in place by slot.

`fused_recurrent_bmojo_f_attention` is the op's Triton implementation (its spec is the reference's, reference.py).

Design. The token at position n sees its in-context keys at positions n-W+1 .. n-1 (ring `k_ctx`, entry p % W) and
itself, and its fading keys at n-2W+1 .. n-W (ring `k_fade`, entry p % 2W): 2W - 1 ring entries, read where they lie
in the pool. One program per (session, KV head, split of the keys) takes the query heads that share the KV head
(grouped-query: one `[G, D]` tile, padded to 16 rows for the tensor-core dot) and streams its share of a fixed key
axis u = 0 .. 2W-2 (u < W-1: in-context position n-W+1+u; else fading position n-3W+2+u) BLOCK_N rows at a time into
an fp32 online softmax (exp2, log2(e) folded into the scale), in-context blocks scored by q and fading ones by qf.
Only existing positions (>= 0) are loaded: a short session's programs skip the empty blocks, and a program whose
share holds none only writes an empty partial. The program of split 0 starts its softmax from the token itself (its
own key and value, never in a ring read) and writes the token's k, v, kf, vf into the rings at n % W and n % 2W: those
entries hold positions n-W and n-2W, outside the token's bands, so no program of the launch reads what is written.
`length` grows from a copy of the sessions' lengths taken before the launch (programs of a session read it in any
order).

With few sessions (B * Hkv programs would not fill the GPU) the keys are split and a second small kernel merges the
splits by their running maxima and sums (flash-decoding); with many, one split writes the output directly. Every
shape is fixed by the batch and the window and nothing is read on the host: the step can be captured in a CUDA graph.

Bytes per step and session (the floor, `decode_bytes`): the 2W - 1 ring rows read, k and v of each (2 (2W-1) Hkv D
elements), plus the four rows written and the queries and outputs; the rest of the rings is not touched.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..attention.online_softmax import LOG2E
from ..launcher import launch_kernel
from .chunk import ring_strides, sessions
from .reference import check_rings

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _ring_block(
    acc, m_i, l_i, qv, k_base, v_base, stride_k, stride_v, u0, u_end, first, ring, scale, cols, m_cols,
    BLOCK_N: tl.constexpr, DPAD: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Ring keys at key-axis entries u0 .. u0+BLOCK_N-1 (below u_end), position `first + u`, entry position % ring,
    folded into the online softmax of the queries `qv` `[BLOCK_G, BLOCK_D]`."""
    u = u0 + tl.arange(0, BLOCK_N)
    m_u = u < u_end
    row = (first + u) % ring
    ld = m_u[:, None] & m_cols[None, :] if DPAD else m_u[:, None]
    kb = tl.load(k_base + row[:, None] * stride_k + cols[None, :], mask=ld, other=0.0)
    vb = tl.load(v_base + row[:, None] * stride_v + cols[None, :], mask=ld, other=0.0)
    if INTERP:  # the interpreter's bf16 dots are wrong (triton 3.6): fp32 operands
        kb = kb.to(tl.float32)
        vb = vb.to(tl.float32)
    else:
        kb = kb.to(qv.dtype)
        vb = vb.to(qv.dtype)
    s = tl.dot(qv, tl.trans(kb), input_precision=PREC)  # [BLOCK_G, BLOCK_N], fp32
    s = tl.where(m_u[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(vb.dtype), vb, acc * alpha[:, None], input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _ring_range(
    acc, m_i, l_i, qv, k_base, v_base, stride_k, stride_v, lo, hi, first, ring, scale, cols, m_cols,
    BLOCK_N: tl.constexpr, DPAD: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """`_ring_block` for the blocks starting at lo, lo + BLOCK_N, ... below hi."""
    if INTERP:  # the interpreter (triton 3.6, numpy >= 2.4) cannot take range() of a loaded scalar
        u0 = lo
        while u0 < hi:
            acc, m_i, l_i = _ring_block(acc, m_i, l_i, qv, k_base, v_base, stride_k, stride_v, u0, hi, first, ring,
                                        scale, cols, m_cols, BLOCK_N, DPAD, PREC, INTERP)  # fmt: skip
            u0 += BLOCK_N
    else:  # a `for` loop, so that the compiler pipelines the next blocks' loads under this one's dots
        for u0 in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _ring_block(acc, m_i, l_i, qv, k_base, v_base, stride_k, stride_v, u0, hi, first, ring,
                                        scale, cols, m_cols, BLOCK_N, DPAD, PREC, INTERP)  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q, k, v, qf, kf, vf, k_ctx, v_ctx, k_fade, v_fade, past, slots, length, o, o_part, m_part, l_part,
    stride_qb, stride_qh, stride_qfb, stride_qfh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_kfb, stride_kfh, stride_vfb, stride_vfh,
    stride_kc_s, stride_kc_t, stride_kc_h, stride_vc_s, stride_vc_t, stride_vc_h,
    stride_kf_s, stride_kf_t, stride_kf_h, stride_vf_s, stride_vf_t, stride_vf_h,
    stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
    qk_scale, window, split_len,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    i_b, i_kh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + i_b).to(tl.int64)
    n64 = tl.load(past + i_b)  # the token's position
    n = n64.to(tl.int32)
    W = window
    DPAD: tl.constexpr = BLOCK_D != D
    rows = tl.arange(0, BLOCK_G)
    cols = tl.arange(0, BLOCK_D)
    m_g, m_cols = rows < G, cols < D
    m_gd = m_g[:, None] & m_cols[None, :]
    heads = i_kh * G + rows

    # This split's share [lo, hi) of the key axis: in-context entries [W-1-n, W-1) exist (positions >= 0), fading
    # entries [max(W-1, 3W-2-n), 2W-1).
    lo = i_s * split_len
    hi = tl.minimum(lo + split_len, 2 * W - 1)
    c_lo = tl.maximum(lo, tl.maximum(W - 1 - n, 0))
    c_hi = tl.minimum(hi, W - 1)
    f_lo = tl.maximum(lo, tl.maximum(W - 1, 3 * W - 2 - n))
    f_hi = hi

    # The token's own key and value (read by every program: D elements; split 0 uses them).
    kt = tl.load(k + i_b * stride_kb + i_kh * stride_kh + cols, mask=m_cols, other=0.0)
    vt = tl.load(v + i_b * stride_vb + i_kh * stride_vh + cols, mask=m_cols, other=0.0)
    qv = tl.load(q + i_b * stride_qb + heads[:, None] * stride_qh + cols[None, :], mask=m_gd, other=0.0)
    if INTERP:
        qv = qv.to(tl.float32)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: an all-masked row rescales by exp2(0), not NaN
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if i_s == 0:  # the token itself starts the softmax (l >= 1 on every row)
        m_i = tl.sum(qv.to(tl.float32) * kt.to(tl.float32)[None, :], 1) * qk_scale
        l_i = tl.full([BLOCK_G], 1.0, tl.float32)
        acc = acc + vt.to(tl.float32)[None, :]
    kc = k_ctx + slot * stride_kc_s + i_kh * stride_kc_h
    vc = v_ctx + slot * stride_vc_s + i_kh * stride_vc_h
    acc, m_i, l_i = _ring_range(acc, m_i, l_i, qv, kc, vc, stride_kc_t, stride_vc_t, c_lo, c_hi, n - W + 1, W,
                                qk_scale, cols, m_cols, BLOCK_N, DPAD, PREC, INTERP)  # fmt: skip

    qfv = tl.load(qf + i_b * stride_qfb + heads[:, None] * stride_qfh + cols[None, :], mask=m_gd, other=0.0)
    if INTERP:
        qfv = qfv.to(tl.float32)
    kfr = k_fade + slot * stride_kf_s + i_kh * stride_kf_h
    vfr = v_fade + slot * stride_vf_s + i_kh * stride_vf_h
    acc, m_i, l_i = _ring_range(acc, m_i, l_i, qfv, kfr, vfr, stride_kf_t, stride_vf_t, f_lo, f_hi, n - 3 * W + 2,
                                2 * W, qk_scale, cols, m_cols, BLOCK_N, DPAD, PREC, INTERP)  # fmt: skip

    if SPLIT:  # a partial (running max, sum and unnormalised sum of values), merged by `_merge_kernel`
        part = i_b * stride_pb + heads * stride_ph + i_s * stride_ps
        tl.store(o_part + part[:, None] * D + cols[None, :], acc, mask=m_gd)
        tl.store(m_part + part, m_i, mask=m_g)
        tl.store(l_part + part, l_i, mask=m_g)
    else:
        out = acc / l_i[:, None]
        tl.store(o + i_b * stride_ob + heads[:, None] * stride_oh + cols[None, :], out.to(o.dtype.element_ty),
                 mask=m_gd)  # fmt: skip

    if i_s == 0:  # the token into the rings, at entries no program of this launch reads
        e_c = n % W
        e_f = n % (2 * W)
        kft = tl.load(kf + i_b * stride_kfb + i_kh * stride_kfh + cols, mask=m_cols)
        vft = tl.load(vf + i_b * stride_vfb + i_kh * stride_vfh + cols, mask=m_cols)
        tl.store(kc + e_c * stride_kc_t + cols, kt.to(k_ctx.dtype.element_ty), mask=m_cols)
        tl.store(vc + e_c * stride_vc_t + cols, vt.to(v_ctx.dtype.element_ty), mask=m_cols)
        tl.store(kfr + e_f * stride_kf_t + cols, kft.to(k_fade.dtype.element_ty), mask=m_cols)
        tl.store(vfr + e_f * stride_vf_t + cols, vft.to(v_fade.dtype.element_ty), mask=m_cols)
        if i_kh == 0:
            tl.store(length + slot, n64 + 1)


@triton.jit
def _merge_kernel(
    o, o_part, m_part, l_part, splits, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """One (session, query head): its splits' partials merged by their maxima (an empty split weighs nothing)."""
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    m_s, m_cols = s < splits, cols < D
    part = i_b * stride_pb + i_h * stride_ph + s * stride_ps
    m = tl.load(m_part + part, mask=m_s, other=-float("inf"))
    l = tl.load(l_part + part, mask=m_s, other=0.0)
    acc = tl.load(o_part + part[:, None] * D + cols[None, :], mask=m_s[:, None] & m_cols[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(o + i_b * stride_ob + i_h * stride_oh + cols, out.to(o.dtype.element_ty), mask=m_cols)


def decode_bytes(B: int, Hq: int, Hkv: int, D: int, window: int, elem: int) -> int:
    """The bytes one decode step must move (its HBM floor): the 2W - 1 ring rows of k and v read, the token's four
    rows written, q and qf read and the output written, at `elem` bytes per element."""
    return B * elem * D * (2 * (2 * window - 1) * Hkv + 4 * Hkv + 3 * Hq)


def _splits(B: int, Hkv: int, window: int, device: torch.device, block_n: int) -> tuple[int, int]:
    """(splits, keys per split): enough programs to fill the GPU (about 2 per SM) when sessions are few, each split
    at least 256 keys of the 2W - 1."""
    keys = 2 * window - 1
    sms = common.sm_count(device) if device.type == "cuda" else 2  # (interpreted: one split unless asked)
    splits = max(1, min(common.cdiv(keys, 256), common.cdiv(2 * sms, B * Hkv)))
    split_len = common.cdiv(common.cdiv(keys, splits), block_n) * block_n
    return common.cdiv(keys, split_len), split_len


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    vf: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_fade: torch.Tensor,
    v_fade: torch.Tensor,
    length: torch.Tensor,
    state_indices: torch.Tensor,
    window: int,
    scale: float,
    *,
    splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.bmojo_f.fused_recurrent_bmojo_f_attention` (same arguments and result; see its
    docstring), with the launch configuration open (the bench's sweep): `splits` of the key axis (None: by the batch
    and the GPU), BLOCK_N, warps and pipeline stages."""
    B, Hq, D = q.shape
    Hkv, W = k.shape[1], window
    check_rings(k_ctx, k_fade, W)
    dev = q.device
    bn = block_n or (16 if _INTERPRET else 64)
    n_splits, split_len = _splits(B, Hkv, W, dev, bn)
    if splits is not None:
        split_len = common.cdiv(common.cdiv(2 * W - 1, splits), bn) * bn
        n_splits = common.cdiv(2 * W - 1, split_len)
    out = common.output_buffer((B, Hq, D), q.dtype, dev)
    if B == 0:
        return out
    idx, past = sessions(length, state_indices)  # past: read by every program; `length` is written in the launch
    split = n_splits > 1
    if split:
        o_part = common.output_buffer((B, Hq, n_splits, D), torch.float32, dev)
        m_part = common.output_buffer((B, Hq, n_splits), torch.float32, dev)
        l_part = common.output_buffer((B, Hq, n_splits), torch.float32, dev)
        pb, ph, ps = m_part.stride()
    else:
        o_part = m_part = l_part = out
        pb = ph = ps = 0
    q, k, v, qf, kf, vf = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, qf, kf, vf))
    # Few programs a multiprocessor (B=64 at Hkv=8 on an H200: 4): 8 warps keep more loads in flight (265 us
    # against 305 with 4); many (B=256: 16): 4 (990 us against 1011).
    few = B * Hkv * n_splits <= 4 * (common.sm_count(dev) if dev.type == "cuda" else 8)
    warps = num_warps or (8 if few else 4)
    stages = num_stages or 3
    launch_kernel(_decode_kernel, (B, Hkv, n_splits),
        q, k, v, qf, kf, vf, k_ctx, v_ctx, k_fade, v_fade, past, idx, length, out, o_part, m_part, l_part,
        q.stride(0), q.stride(1), qf.stride(0), qf.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
        *ring_strides(k_ctx, v_ctx, k_fade, v_fade), out.stride(0), out.stride(1), pb, ph, ps,
        scale * LOG2E, W, split_len,
        G=Hq // Hkv, BLOCK_G=max(16, common.next_power_of_2(Hq // Hkv)), D=D,
        BLOCK_D=max(16, common.next_power_of_2(D)), BLOCK_N=bn, SPLIT=split,
        # fp32 inputs: IEEE fp32 dots, not tf32. The interpreter is always told "ieee" (it mishandles "tf32").
        PREC="ieee" if q.dtype == torch.float32 or _INTERPRET else "tf32", INTERP=_INTERPRET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split:
        launch_kernel(_merge_kernel, (B, Hq),
            out, o_part, m_part, l_part, n_splits, out.stride(0), out.stride(1), pb, ph, ps,
            D=D, BLOCK_D=max(16, common.next_power_of_2(D)), BLOCK_S=max(2, common.next_power_of_2(n_splits)),
        )  # fmt: skip
    return out


# The op (the reference's arguments and result) is `launch` at its default configuration.
fused_recurrent_bmojo_f_attention = launch
