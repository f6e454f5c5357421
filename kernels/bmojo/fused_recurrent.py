"""Triton B'MOJO decode step: publish, score, ring write and attention over ring ∪ fading ∪ eidetic, no host sync.

`fused_recurrent_bmojo` computes `reference.fused_recurrent_bmojo` (docs/design/bmojo.md §3.9) in two launches plus,
for small batches, a combine; every shape is fixed by the batch and the config and no value is read on the host, so
the step is graph-capturable. Whether a session sits at a chunk boundary (t > 0, t % w == 0) is decided on the device
by every program that needs it.

1. The fading candidates: `fading_kv(y_buf[:, L-m_f:])` for **every** session of the batch (torch, fixed shape), since
   whether a session publishes is only known on the device. Cost: B*m_f rows through the attention pre-norm and
   W_K, W_V, i.e. W_K and W_V read once more per step (2*d*Hkv*dh*b bytes: 16 MiB for bmojo-1.4b in bf16, about
   5 us at 3 TB/s, about 4% of the B=256 state floor) and 4*B*m_f*d*Hkv*dh flops. Projecting only the sessions at a
   boundary would need their count on the host (the sync this op removes); fusing these rows into the layer's own
   K/V GEMM would save the weight read but changes the layer's interface (left for later).
2. `_publish_kernel`, one program per (session, KV head). A session not at a boundary writes its step metadata and
   returns. One at a boundary merges the eidetic store with the ring (which then holds exactly the finished chunk):
   the rank of each of the m_e + w candidates under the key (eps desc, pos asc) is the number of valid candidates
   with a smaller key, counted by blocked pairwise comparison (~(m_e + w)^2 = 330K compares for bmojo-1.4b, a few
   microseconds once per w steps, no sort network, no scratch); candidate i with rank r < m_e goes to slot r, and
   that one-hot match also yields each slot's source, score and position. Each program gathers its head's `[m_e,
   dh]` K/V tiles from the old store or the ring into registers, then (after a barrier, since the store is permuted
   in place) writes them back in key order, and writes its head's fading K/V. Scores, positions and the counts go
   to per-step scratch (other programs of this launch still read the old ones) and land in the pool in step 3.
3. `_decode_attn_kernel`, one program per (session, query head, key split): flash-decoding over the fixed buffer
   [ring (w) | fading (m_f) | eidetic (m_e)], validity from the step metadata (ring slots <= t, the t % w slot
   replaced by the token itself, fading < fad_n, eidetic < eid_n), fp32 online softmax. With one split it writes the
   output; with several (small B * Hq: too few programs to fill the GPU) each writes (max, sum, acc) and
   `_combine_kernel` merges them. The split-0 program of each KV head writes the token's K/V into the ring; the
   split-0 program of query head 0 scores the token (innovation over y_buf), rolls y_buf, writes ring_eps, t, the
   counts and the merged scores: no program of this launch reads what those write.

Bytes per step and session: the ring, fading and eidetic K/V are read once (2*Hkv*dh*(w + m_f + m_e)*b) plus y_buf
(4*L*d) and the token's row written; a publish adds one read and write of the eidetic K/V.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel
from ..masks import block_mask

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")
LOG2E = 1.4426950408889634
FadingKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@triton.jit
def _candidates(c, slot, pos, ne, eid_eps, eid_pos, ring_eps, W: tl.constexpr, M_E: tl.constexpr):
    """Keys of merge candidates `c` `[BC]`: c < M_E are the store's entries (valid below ne), then the ring entries
    e = c - M_E at positions pos - W + e. Returns (eps fp32, position int64, valid)."""
    in_eid = c < M_E
    in_ring = (c >= M_E) & (c < M_E + W)
    e = c - M_E
    eps = tl.where(
        in_eid,
        tl.load(eid_eps + slot * M_E + c, mask=in_eid, other=0.0),
        tl.load(ring_eps + slot * W + e, mask=in_ring, other=0.0),
    )
    p = tl.where(in_eid, tl.load(eid_pos + slot * M_E + c, mask=in_eid, other=0), pos - W + e)
    return eps, p, (in_eid & (c < ne)) | in_ring


@triton.jit
def _merge_tile(eid, ring, slot, h, src, keep, row_ok, d, HKV: tl.constexpr, DH: tl.constexpr, W: tl.constexpr,
                M_E: tl.constexpr):  # fmt: skip
    """Rewrite one head's `[M_E, DH]` eidetic tile in key order: row j takes candidate src[j] (old store row or ring
    entry), zeros where not kept. All loads precede all stores (barrier): the store is permuted in place."""
    d_ok = d < DH
    from_eid = src < M_E
    p_eid = eid + ((slot * M_E + src) * HKV + h) * DH
    p_ring = ring + ((slot * W + (src - M_E)) * HKV + h) * DH
    m_e = (keep & from_eid)[:, None] & d_ok[None, :]
    m_r = (keep & ~from_eid)[:, None] & d_ok[None, :]
    x = tl.load(p_eid[:, None] + d[None, :], mask=m_e, other=0.0) + tl.load(
        p_ring[:, None] + d[None, :], mask=m_r, other=0.0
    )
    tl.debug_barrier()
    j = tl.arange(0, src.shape[0])
    p_out = eid + ((slot * M_E + j) * HKV + h) * DH
    tl.store(p_out[:, None] + d[None, :], x, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _publish_kernel(
    t,
    fad_n,
    eid_n,
    ring_k,
    ring_v,
    ring_eps,
    fad_k,
    fad_v,
    eid_k,
    eid_v,
    eid_eps,
    eid_pos,
    fk,
    fv,
    state_indices,
    meta,
    new_eps,
    new_pos,
    stride_fb,
    stride_fm,
    stride_fh,
    HKV: tl.constexpr,
    DH: tl.constexpr,
    W: tl.constexpr,
    M_F: tl.constexpr,
    M_E: tl.constexpr,
    BD: tl.constexpr,
    BC: tl.constexpr,
    BME: tl.constexpr,
    BMF: tl.constexpr,
):
    b, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + b).to(tl.int64)
    pos = tl.load(t + slot)
    nf = tl.load(fad_n + slot)
    ne = tl.load(eid_n + slot)
    boundary = (pos > 0) & (pos % W == 0)
    count = tl.minimum(ne + W, M_E)  # the merged store's size (M_E, since W >= M_E, unless M_E == 0)
    if h == 0:  # the step's metadata, as the attention launch must see it (after any publish)
        tl.store(meta + b * 4, pos)
        tl.store(meta + b * 4 + 1, tl.where(boundary, M_F, nf))
        tl.store(meta + b * 4 + 2, tl.where(boundary, count, ne))
        tl.store(meta + b * 4 + 3, boundary.to(tl.int64))
    if boundary:
        d = tl.arange(0, BD)
        d_ok = d < DH
        if M_F > 0:  # the projected candidates y_{t-m_f} .. y_{t-1} become the fading K/V
            f = tl.arange(0, BMF)
            m_f = (f < M_F)[:, None] & d_ok[None, :]
            p_in = b * stride_fb + f[:, None] * stride_fm + h * stride_fh + d[None, :]
            p_out = ((slot * M_F + f[:, None]) * HKV + h) * DH + d[None, :]
            tl.store(fad_k + p_out, tl.load(fk + p_in, mask=m_f).to(fad_k.dtype.element_ty), mask=m_f)
            tl.store(fad_v + p_out, tl.load(fv + p_in, mask=m_f).to(fad_v.dtype.element_ty), mask=m_f)
        if M_E > 0:
            j = tl.arange(0, BME)
            src = tl.zeros([BME], dtype=tl.int64)
            sel_eps = tl.zeros([BME], dtype=tl.float32)
            sel_pos = tl.zeros([BME], dtype=tl.int64)
            NCB: tl.constexpr = (M_E + W + BC - 1) // BC
            for ib in range(NCB):
                ci = ib * BC + tl.arange(0, BC)
                ei, pi, vi = _candidates(ci, slot, pos, ne, eid_eps, eid_pos, ring_eps, W, M_E)
                rank = tl.zeros([BC], dtype=tl.int32)
                for jb in range(NCB):
                    cj = jb * BC + tl.arange(0, BC)
                    ej, pj, vj = _candidates(cj, slot, pos, ne, eid_eps, eid_pos, ring_eps, W, M_E)
                    better = (ej[None, :] > ei[:, None]) | ((ej[None, :] == ei[:, None]) & (pj[None, :] < pi[:, None]))
                    rank += tl.sum((better & vj[None, :]).to(tl.int32), axis=1)
                match = (vi & (rank < M_E))[None, :] & (rank[None, :] == j[:, None])  # [BME, BC]: slot j <- cand
                src += tl.sum(tl.where(match, ci[None, :].to(tl.int64), 0), axis=1)
                sel_eps += tl.sum(tl.where(match, ei[None, :], 0.0), axis=1)
                sel_pos += tl.sum(tl.where(match, pi[None, :], 0), axis=1)
            keep = j < count
            row_ok = j < M_E
            _merge_tile(eid_k, ring_k, slot, h, src, keep, row_ok, d, HKV, DH, W, M_E)
            _merge_tile(eid_v, ring_v, slot, h, src, keep, row_ok, d, HKV, DH, W, M_E)
            if h == 0:
                tl.store(new_eps + b * M_E + j, sel_eps, mask=row_ok)
                tl.store(new_pos + b * M_E + j, sel_pos, mask=row_ok)


@triton.jit
def _attend_block(qs, p_k, p_v, valid, d, d_ok, m_i, l_i, acc):
    """Online-softmax update with one block of keys/values at row pointers p_k, p_v `[BN]` (valid ones only);
    scores are in log2 units (qs carries scale * log2 e)."""
    msk = valid[:, None] & d_ok[None, :]
    kk = tl.load(p_k[:, None] + d[None, :], mask=msk, other=0.0).to(tl.float32)
    s = tl.where(valid, tl.sum(kk * qs[None, :], axis=1), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # an all-masked block so far: keep everything at zero
    p = tl.exp2(s - m_safe)
    alpha = tl.exp2(m_i - m_safe)
    vv = tl.load(p_v[:, None] + d[None, :], mask=msk, other=0.0).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p[:, None] * vv, axis=0)


@triton.jit
def _ring_block(blk, qs, ring_k, ring_v, slot, h, pos, cur, d, d_ok, m_i, l_i, acc, HKV: tl.constexpr,
                DH: tl.constexpr, W: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    r = blk * BN + tl.arange(0, BN)
    row = ((slot * W + r) * HKV + h) * DH
    valid = (r < W) & (r <= pos) & (r != cur)  # slot cur is the token itself, attended from its inputs
    return _attend_block(qs, ring_k + row, ring_v + row, valid, d, d_ok, m_i, l_i, acc)


@triton.jit
def _mem_block(blk, qs, mem_k, mem_v, slot, h, n, d, d_ok, m_i, l_i, acc, HKV: tl.constexpr, DH: tl.constexpr,
               M: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    r = blk * BN + tl.arange(0, BN)
    row = ((slot * M + r) * HKV + h) * DH
    return _attend_block(qs, mem_k + row, mem_v + row, r < n, d, d_ok, m_i, l_i, acc)


@triton.jit
def _decode_attn_kernel(
    q,
    k,
    v,
    y,
    t,
    y_buf,
    ring_k,
    ring_v,
    ring_eps,
    fad_k,
    fad_v,
    fad_n,
    eid_k,
    eid_v,
    eid_eps,
    eid_pos,
    eid_n,
    state_indices,
    meta,
    new_eps,
    new_pos,
    o,
    part_o,
    part_ml,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_yb,
    qk_scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    DH: tl.constexpr,
    W: tl.constexpr,
    M_F: tl.constexpr,
    M_E: tl.constexpr,
    L: tl.constexpr,
    TAPS: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BME: tl.constexpr,
    BN: tl.constexpr,
    BL: tl.constexpr,
    BY: tl.constexpr,
    NS: tl.constexpr,
    BPS: tl.constexpr,
    INTERP: tl.constexpr,
):
    i_bh, split = tl.program_id(0), tl.program_id(1)
    b, hq = i_bh // HQ, i_bh % HQ
    h = hq // (HQ // HKV)
    slot = tl.load(state_indices + b).to(tl.int64)
    pos = tl.load(meta + b * 4)
    nf = tl.load(meta + b * 4 + 1)
    ne = tl.load(meta + b * 4 + 2)
    cur = pos % W
    d = tl.arange(0, BD)
    d_ok = d < DH
    qs = tl.load(q + b * stride_qb + hq * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32) * qk_scale
    k_cur = tl.load(k + b * stride_kb + h * stride_kh + d, mask=d_ok, other=0.0)
    v_cur = tl.load(v + b * stride_vb + h * stride_vh + d, mask=d_ok, other=0.0)

    # The token itself is a key of split 0 (it is always valid, so the combined softmax is never empty).
    first = split == 0
    s_cur = tl.sum(k_cur.to(tl.float32) * qs, axis=0)
    m_i = tl.where(first, s_cur, float("-inf"))
    l_i = tl.where(first, 1.0, 0.0)
    acc = tl.where(block_mask(first, d), v_cur.to(tl.float32), 0.0)

    NB_R: tl.constexpr = (W + BN - 1) // BN
    NB_F: tl.constexpr = (M_F + BN - 1) // BN
    NB: tl.constexpr = NB_R + NB_F + (M_E + BN - 1) // BN
    lo = split * BPS
    hi = tl.minimum(lo + BPS, NB)
    if INTERP:  # the interpreter (triton 3.6) cannot take range() of program-dependent bounds
        blk = lo
        while blk < hi:
            if blk < NB_R:
                m_i, l_i, acc = _ring_block(blk, qs, ring_k, ring_v, slot, h, pos, cur, d, d_ok, m_i, l_i, acc,
                                            HKV, DH, W, BN)  # fmt: skip
            elif blk < NB_R + NB_F:
                m_i, l_i, acc = _mem_block(blk - NB_R, qs, fad_k, fad_v, slot, h, nf, d, d_ok, m_i, l_i, acc, HKV,
                                           DH, M_F, BN)  # fmt: skip
            else:
                m_i, l_i, acc = _mem_block(blk - NB_R - NB_F, qs, eid_k, eid_v, slot, h, ne, d, d_ok, m_i, l_i, acc,
                                           HKV, DH, M_E, BN)  # fmt: skip
            blk += 1
    else:  # one loop per segment over this split's share of its blocks: no branch inside a loop
        for blk in range(lo, tl.minimum(hi, NB_R)):
            m_i, l_i, acc = _ring_block(blk, qs, ring_k, ring_v, slot, h, pos, cur, d, d_ok, m_i, l_i, acc, HKV, DH,
                                        W, BN)  # fmt: skip
        for blk in range(tl.maximum(lo, NB_R), tl.minimum(hi, NB_R + NB_F)):
            m_i, l_i, acc = _mem_block(blk - NB_R, qs, fad_k, fad_v, slot, h, nf, d, d_ok, m_i, l_i, acc, HKV, DH,
                                       M_F, BN)  # fmt: skip
        for blk in range(tl.maximum(lo, NB_R + NB_F), hi):
            m_i, l_i, acc = _mem_block(blk - NB_R - NB_F, qs, eid_k, eid_v, slot, h, ne, d, d_ok, m_i, l_i, acc, HKV,
                                       DH, M_E, BN)  # fmt: skip

    if NS == 1:
        tl.store(o + i_bh * DH + d, (acc / l_i).to(o.dtype.element_ty), mask=d_ok)
    else:
        tl.store(part_o + (i_bh * NS + split) * DH + d, acc, mask=d_ok)
        tl.store(part_ml + (i_bh * NS + split) * 2, m_i)
        tl.store(part_ml + (i_bh * NS + split) * 2 + 1, l_i)

    # State writes. Nothing in this launch reads what they write: ring slot cur is masked above, and t, the counts,
    # the scores and y_buf are read from the metadata or by this program only.
    if first & (hq % (HQ // HKV) == 0):
        row = ((slot * W + cur) * HKV + h) * DH + d
        tl.store(ring_k + row, k_cur.to(ring_k.dtype.element_ty), mask=d_ok)
        tl.store(ring_v + row, v_cur.to(ring_v.dtype.element_ty), mask=d_ok)
    if first & (hq == 0):
        # Innovation eps = mean_c (y_c - mean(y_buf[L-TAPS:, c]))^2, and y_buf <- [y_buf[1:] | y], by column blocks.
        rows = tl.arange(0, BL)
        sq = tl.zeros([BY], dtype=tl.float32)
        for c0 in range(0, D, BY):
            c = c0 + tl.arange(0, BY)
            c_ok = c < D
            yv = tl.load(y + b * stride_yb + c, mask=c_ok, other=0.0).to(tl.float32)
            p_buf = y_buf + (slot * L + rows[:, None]) * D + c[None, :]
            hist = tl.load(p_buf, mask=(rows < L)[:, None] & c_ok[None, :], other=0.0)
            pred = tl.sum(tl.where((rows >= L - TAPS)[:, None], hist, 0.0), axis=0) / TAPS
            err = yv - pred
            sq += err * err
            nxt = tl.load(p_buf + D, mask=(rows < L - 1)[:, None] & c_ok[None, :], other=0.0)
            nxt = tl.where((rows == L - 1)[:, None], yv[None, :], nxt)
            tl.debug_barrier()  # every read of this column block before the shifted rows land
            tl.store(p_buf, nxt, mask=(rows < L)[:, None] & c_ok[None, :])
        tl.store(ring_eps + slot * W + cur, tl.sum(sq, axis=0) / D)
        tl.store(t + slot, pos + 1)
        tl.store(fad_n + slot, nf)
        tl.store(eid_n + slot, ne)
        if M_E > 0:  # noqa: SIM102 (a compile-time guard around a run-time branch: no store row when M_E == 0)
            if tl.load(meta + b * 4 + 3) != 0:
                j = tl.arange(0, BME)
                j_ok = j < M_E
                tl.store(eid_eps + slot * M_E + j, tl.load(new_eps + b * M_E + j, mask=j_ok), mask=j_ok)
                tl.store(eid_pos + slot * M_E + j, tl.load(new_pos + b * M_E + j, mask=j_ok), mask=j_ok)


@triton.jit
def _combine_kernel(o, part_o, part_ml, DH: tl.constexpr, NS: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    i_bh = tl.program_id(0)
    s = tl.arange(0, BS)
    s_ok = s < NS
    d = tl.arange(0, BD)
    d_ok = d < DH
    m = tl.load(part_ml + (i_bh * NS + s) * 2, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_ml + (i_bh * NS + s) * 2 + 1, mask=s_ok, other=0.0)
    acc = tl.load(part_o + (i_bh * NS + s[:, None]) * DH + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_all = tl.max(m, axis=0)  # finite: split 0 holds the token itself
    scale = tl.where(s_ok, tl.exp2(m - m_all), 0.0)
    out = tl.sum(acc * scale[:, None], axis=0) / tl.sum(l_s * scale, axis=0)
    tl.store(o + i_bh * DH + d, out.to(o.dtype.element_ty), mask=d_ok)


POOL_DTYPES = {"t": torch.int64, "fad_n": torch.int64, "eid_n": torch.int64, "y_buf": torch.float32,
               "ring_eps": torch.float32, "eid_eps": torch.float32, "eid_pos": torch.int64}  # fmt: skip


def check_pools(pools: dict[str, torch.Tensor], q: torch.Tensor) -> tuple[int, int, int, int, int]:
    """The memory-state pools both B'MOJO kernels take (`MemoryState` field -> tensor): contiguous, consistent shapes
    and dtypes, K/V `[S, n, Hkv, dh]` with dh = q's. Returns (w, m_f, m_e, L, D). Raises ValueError."""
    ring_k = pools["ring_k"]
    S, w, Hkv, dh = ring_k.shape
    m_f, m_e = pools["fad_k"].shape[1], pools["eid_k"].shape[1]
    L, D = pools["y_buf"].shape[1:]
    kv, mf, me = (S, w, Hkv, dh), (S, m_f, Hkv, dh), (S, m_e, Hkv, dh)
    want = {"t": (S,), "fad_n": (S,), "eid_n": (S,), "y_buf": (S, L, D), "ring_k": kv, "ring_v": kv,
            "ring_eps": (S, w), "fad_k": mf, "fad_v": mf, "eid_k": me, "eid_v": me, "eid_eps": (S, m_e),
            "eid_pos": (S, m_e)}  # fmt: skip
    bad = [
        name
        for name, shape in want.items()
        if tuple(pools[name].shape) != shape
        or not pools[name].is_contiguous()
        or pools[name].dtype != POOL_DTYPES.get(name, pools[name].dtype)
    ]
    if bad or q.shape[-1] != dh or q.shape[-2] % Hkv or m_e > w or m_f > w:
        raise ValueError(
            f"B'MOJO pools: {bad or 'shapes'} (want contiguous pools of MemoryState's shapes and dtypes, head dim "
            f"{q.shape[-1]}, Hkv dividing Hq, m_f, m_e <= w); got "
            + ", ".join(f"{n} {tuple(p.shape)} {p.dtype}" for n, p in pools.items())
        )
    return w, m_f, m_e, L, D


def launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor, t: torch.Tensor, y_buf: torch.Tensor,
    ring_k: torch.Tensor, ring_v: torch.Tensor, ring_eps: torch.Tensor, fad_k: torch.Tensor, fad_v: torch.Tensor,
    fad_n: torch.Tensor, eid_k: torch.Tensor, eid_v: torch.Tensor, eid_eps: torch.Tensor, eid_pos: torch.Tensor,
    eid_n: torch.Tensor, state_indices: torch.Tensor, fading_kv: FadingKV, predictor_taps: int = 4, *,
    block_n: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`fused_recurrent_bmojo` with the key block, the number of key splits and the warps open (tests, device sweep).

    num_splits=None picks enough splits for about two programs per multiprocessor (1 at large B * Hq)."""
    pools = dict(t=t, y_buf=y_buf, ring_k=ring_k, ring_v=ring_v, ring_eps=ring_eps, fad_k=fad_k, fad_v=fad_v,
                 fad_n=fad_n, eid_k=eid_k, eid_v=eid_v, eid_eps=eid_eps, eid_pos=eid_pos, eid_n=eid_n)  # fmt: skip
    w, m_f, m_e, L, D = check_pools(pools, q)
    B, Hq, dh = q.shape
    Hkv = ring_k.shape[2]
    if k.shape != (B, Hkv, dh) or v.shape != (B, Hkv, dh) or y.shape != (B, D) or state_indices.shape != (B,):
        raise ValueError(f"shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} y {tuple(y.shape)}")
    if not 1 <= predictor_taps <= L:
        raise ValueError(f"predictor_taps={predictor_taps} must be in [1, {L}] (the length of y_buf)")
    for x in (q, k, v, y):
        if x.stride(-1) != 1:
            raise ValueError("q, k, v, y need a contiguous last dimension")
    dev = q.device
    o = common.output_buffer((B, Hq, dh), q.dtype, dev)
    if B == 0:
        return o
    meta = common.output_buffer((B, 4), torch.int64, dev)
    new_eps = common.output_buffer((B, max(m_e, 1)), torch.float32, dev)
    new_pos = common.output_buffer((B, max(m_e, 1)), torch.int64, dev)
    if m_f:
        fk, fv = fading_kv(y_buf[:, L - m_f :].index_select(0, state_indices.to(torch.int64)))
        if fk.stride(-1) != 1 or fv.stride(-1) != 1 or fk.stride() != fv.stride():
            fk, fv = fk.contiguous(), fv.contiguous()
        f_strides = fk.stride()[:3]
    else:
        fk = fv = fad_k
        f_strides = (0, 0, 0)
    BD = max(16, common.next_power_of_2(dh))
    bme = max(16, common.next_power_of_2(max(m_e, 1)))
    bc = min(64, max(16, common.next_power_of_2(m_e + w)))  # candidates per block of the pairwise rank count
    launch_kernel(_publish_kernel, (B, Hkv),
        t, fad_n, eid_n, ring_k, ring_v, ring_eps, fad_k, fad_v, eid_k, eid_v, eid_eps, eid_pos, fk, fv,
        state_indices, meta, new_eps, new_pos, *f_strides,
        HKV=Hkv, DH=dh, W=w, M_F=m_f, M_E=m_e, BD=BD, BC=bc, BME=bme, BMF=max(16, common.next_power_of_2(max(m_f, 1))),
        num_warps=4,
    )  # fmt: skip

    BN = block_n or 64
    n_blocks = -(-w // BN) + -(-m_f // BN) + -(-m_e // BN)
    if num_splits is None:
        num_splits = max(1, min(n_blocks, -(-2 * common.sm_count(dev) // (B * Hq))))
    bps = -(-n_blocks // max(1, min(num_splits, n_blocks)))
    ns = -(-n_blocks // bps)
    part_o = common.output_buffer((B, Hq, ns, dh), torch.float32, dev) if ns > 1 else o
    part_ml = common.output_buffer((B, Hq, ns, 2), torch.float32, dev) if ns > 1 else o
    launch_kernel(_decode_attn_kernel, (B * Hq, ns),
        q, k, v, y, t, y_buf, ring_k, ring_v, ring_eps, fad_k, fad_v, fad_n, eid_k, eid_v, eid_eps, eid_pos, eid_n,
        state_indices, meta, new_eps, new_pos, o, part_o, part_ml,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), y.stride(0),
        LOG2E / math.sqrt(dh),
        HQ=Hq, HKV=Hkv, DH=dh, W=w, M_F=m_f, M_E=m_e, L=L, TAPS=int(predictor_taps), D=D, BD=BD, BME=bme, BN=BN,
        BL=max(2, common.next_power_of_2(L)), BY=min(1024, max(16, common.next_power_of_2(D))), NS=ns, BPS=bps,
        INTERP=INTERPRET, num_warps=num_warps or 4,
    )  # fmt: skip
    if ns > 1:
        BS = max(2, common.next_power_of_2(ns))
        launch_kernel(_combine_kernel, (B * Hq,), o, part_o, part_ml, DH=dh, NS=ns, BD=BD, BS=BS)
    return o


def fused_recurrent_bmojo(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    y: torch.Tensor,
    t: torch.Tensor,
    y_buf: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_eps: torch.Tensor,
    fad_k: torch.Tensor,
    fad_v: torch.Tensor,
    fad_n: torch.Tensor,
    eid_k: torch.Tensor,
    eid_v: torch.Tensor,
    eid_eps: torch.Tensor,
    eid_pos: torch.Tensor,
    eid_n: torch.Tensor,
    state_indices: torch.Tensor,
    fading_kv: FadingKV,
    predictor_taps: int = 4,
) -> torch.Tensor:
    """Triton `kvfree.kernels.bmojo.fused_recurrent_bmojo` (same arguments and result; see its docstring).

    q `[B, Hq, dh]`, k, v `[B, Hkv, dh]`, y `[B, D]` with a contiguous last dimension; contiguous pools. No host sync
    and no value-dependent shape: graph-capturable (provided `fading_kv` is).
    """
    return launch(q, k, v, y, t, y_buf, ring_k, ring_v, ring_eps, fad_k, fad_v, fad_n, eid_k, eid_v, eid_eps,
                  eid_pos, eid_n, state_indices, fading_kv, predictor_taps)  # fmt: skip
