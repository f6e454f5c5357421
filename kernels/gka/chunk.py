"""Triton Gated KalmaNet chunked prefill over packed variable-length sequences, states H and S in place in their pools.

Chunks of L tokens never cross a sequence boundary (a sequence's last chunk may be short; its missing tokens act as
padding: k = v = q = 0 and g = 0, which changes nothing). Two launches (docs/design/gka.md §6):

1. `_gka_state_kernel`, per (sequence x head, `[BR, BN]` tile of H or of S): the inter-chunk pass. It loads the
   sequence's initial tile from its pool row and walks the sequence's chunks in order, holding the tile in fp32
   registers: store it as the chunk's start state, then
   H <- zeta_end H + (K * to_end)^T K   (S <- zeta_end S + (K * to_end)^T V), one tensor-core dot per chunk, where
   to_end[j] is the decay from token j to the chunk's end. Tiles are small so that even one prompt has hundreds of
   programs in flight: each step waits on its loads, so the pass is bound by latency, not bandwidth. The final tile
   goes straight back to the pool row: nothing after this launch reads the pools, and the launch is never autotuned
   (re-running it would read its own output).
2. `_gka_out_kernel`, per (chunk x row block, head), all in parallel. Each token c of the chunk solves against its own
   H_c = zeta_c H0 + sum_j Lam[c, j] k_j k_j^T without forming it: the three-term Frobenius norm (§6.1), then r
   Chebyshev steps on the `[BM, D]` block of queries at once, whose matvec is
   zeta * (X H0) + ((X K^T) * Lam) K (§6.2, three dots with H0 and K held on chip across the steps), the alpha mix,
   and the gated linear attention output scale * (zeta * (Q' S0) + ((Q' K^T) * Lam) V) (§6.3).

`decay_h=False` (hmf's use_forgetting_gate_kk = false: H never decays, S does) is a compile-time flag of both
launches: the pass reads H's log decays as 0, and the norm and the solve use zeta = 1 and Lam = 1 on and below the
diagonal, while the output keeps S's. The default (True) compiles exactly as without the flag.

All state math and accumulation is fp32. The dots take fp32 operands: with fp32 inputs they run as "tf32x3" (three
tensor-core passes, about fp32 accuracy), with bf16/fp16 inputs as tf32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..dispatch import chunk_metadata, host_cu_seqlens
from ..launcher import launch_kernel
from .fused_recurrent import check_shapes
from .reference import _MIN_FRO_SQ

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _chunk_inputs(j, k, val, g, bos, eos, i_h, r, cols, m_r, m_c, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_gt, stride_gh, L: tl.constexpr, DECAY: tl.constexpr):  # fmt: skip
    """Chunk j's keys `[L, BR]` (the tile's rows), values `[L, BN]` (its columns) and log decays `[L]`, fp32; zeros
    past the sequence's end (a chunk past the last one reads nothing). Without DECAY the log decays are 0."""
    t = bos + j * L + tl.arange(0, L)
    m_t = t < eos
    kk = tl.load(k + t[:, None] * stride_kt + i_h * stride_kh + r[None, :], mask=m_t[:, None] & m_r[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    vv = tl.load(val + t[:, None] * stride_vt + i_h * stride_vh + cols[None, :], mask=m_t[:, None] & m_c[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    if DECAY:
        gv = tl.load(g + t * stride_gt + i_h * stride_gh, mask=m_t, other=0.0).to(tl.float32)
    else:
        gv = tl.zeros([L], dtype=tl.float32)
    return kk, vv, gv


@triton.jit
def _pass_chunk(st, kk, vv, gv, PREC: tl.constexpr):
    """A chunk's end state from its start state: st * zeta_end + (K * to_end)^T V."""
    cum = tl.cumsum(gv, 0)
    total = tl.sum(gv, 0)
    to_end = tl.exp(total - cum)  # decay from token j to the chunk's end (1 on padding rows, whose k is 0)
    return tl.dot(tl.trans(kk * to_end[:, None]), vv, acc=st * tl.exp(total), input_precision=PREC)


@triton.jit
def _pass_step(st, p_buf, kk, vv, gv, j, k, val, g, bos, eos, i_h, r, cols, m_r, m_c, m_rc, stride_kt, stride_kh,
               stride_vt, stride_vh, stride_gt, stride_gh, H: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
               L: tl.constexpr, PREC: tl.constexpr, DECAY: tl.constexpr):  # fmt: skip
    """Chunk j: load chunk j + 1's inputs, store the tile as chunk j's start state, pass it through chunk j (whose
    inputs `kk, vv, gv` the previous step loaded). Returns the new tile, the next start-state pointer and inputs."""
    k_next, v_next, g_next = _chunk_inputs(j + 1, k, val, g, bos, eos, i_h, r, cols, m_r, m_c, stride_kt, stride_kh,
                                           stride_vt, stride_vh, stride_gt, stride_gh, L, DECAY)  # fmt: skip
    tl.store(p_buf, st, mask=m_rc)
    st = _pass_chunk(st, kk, vv, gv, PREC)
    return st, p_buf + H * D * W, k_next, v_next, g_next  # pointer arithmetic is 64-bit


@triton.jit
def _pass_tile(
    k,
    val,
    g,
    pool,
    buf,
    slot,
    bos,
    eos,
    c0,
    i_h,
    row0,
    col0,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_ps,
    stride_ph,
    stride_pr,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    L: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
    DECAY: tl.constexpr,
):
    """One `[BR, BN]` tile of a `[D, W]` state (H with val = k, W = D; or S with val = v, W = Dv) through the chunks
    of one sequence: each chunk's start tile to `buf` `[NC, He, D, W]`, the final tile to the pool row. Without
    DECAY (H under `decay_h=False`) the tile does not decay: its log decays are read as 0.

    Each step issues the next chunk's loads before it works on the current one, so their latency overlaps the dot
    and the store (a 30% shorter walk on an H100; loading two ahead gained nothing more)."""
    r = row0 + tl.arange(0, BR)
    cols = col0 + tl.arange(0, BN)
    m_r = r < D
    m_c = cols < W
    m_rc = m_r[:, None] & m_c[None, :]
    p_pool = pool + slot * stride_ps + i_h * stride_ph + r[:, None] * stride_pr + cols[None, :]
    st = tl.load(p_pool, mask=m_rc, other=0.0)
    p_buf = buf + (c0 * H + i_h).to(tl.int64) * D * W + r[:, None] * W + cols[None, :]
    n_chunks = tl.cdiv(eos - bos, L)
    kk, vv, gv = _chunk_inputs(0, k, val, g, bos, eos, i_h, r, cols, m_r, m_c, stride_kt, stride_kh, stride_vt,
                               stride_vh, stride_gt, stride_gh, L, DECAY)  # fmt: skip
    if INTERP:  # the interpreter (triton 3.6, numpy >= 2.4) cannot take range() of a loaded scalar
        j = 0
        while j < n_chunks:
            st, p_buf, kk, vv, gv = _pass_step(st, p_buf, kk, vv, gv, j, k, val, g, bos, eos, i_h, r, cols, m_r, m_c,
                                               m_rc, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                                               stride_gh, H, D, W, L, PREC, DECAY)  # fmt: skip
            j += 1
    else:
        for j in range(n_chunks):
            st, p_buf, kk, vv, gv = _pass_step(st, p_buf, kk, vv, gv, j, k, val, g, bos, eos, i_h, r, cols, m_r, m_c,
                                               m_rc, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                                               stride_gh, H, D, W, L, PREC, DECAY)  # fmt: skip
    tl.store(p_pool, st, mask=m_rc)


@triton.jit
def _gka_state_kernel(
    k,
    v,
    g,
    h,
    s,
    hbuf,
    sbuf,
    state_indices,
    cu_seqlens,
    chunk_offsets,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_hs,
    stride_hh,
    stride_hr,
    stride_ss,
    stride_sh,
    stride_sr,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    L: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
    DECAY_H: tl.constexpr,
):
    # Tiles of H first, then of S, all in one launch: a single long prompt still has rows x columns x heads programs
    # in flight, each walking the chunks one after another (the pass is latency-bound, not bandwidth-bound).
    NB_H: tl.constexpr = (D + BN - 1) // BN
    NB_COLS: tl.constexpr = NB_H + (DV + BN - 1) // BN
    i_nh, i_rc = tl.program_id(0), tl.program_id(1)
    row0, i_col = (i_rc // NB_COLS) * BR, i_rc % NB_COLS
    i_n, i_h = i_nh // H, i_nh % H
    # int64 token offsets: token index times the row stride passes 2^31 near a million packed tokens.
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    if i_col < NB_H:
        _pass_tile(k, k, g, h, hbuf, slot, bos, eos, c0, i_h, row0, i_col * BN, stride_kt, stride_kh, stride_kt,
                   stride_kh, stride_gt, stride_gh, stride_hs, stride_hh, stride_hr, H, D, D, L, BR, BN, PREC,
                   INTERP, DECAY_H)  # fmt: skip
    else:
        _pass_tile(k, v, g, s, sbuf, slot, bos, eos, c0, i_h, row0, (i_col - NB_H) * BN, stride_kt, stride_kh,
                   stride_vt, stride_vh, stride_gt, stride_gh, stride_ss, stride_sh, stride_sr, H, D, DV, L, BR, BN,
                   PREC, INTERP, True)  # fmt: skip


@triton.jit
def _gka_out_kernel(
    q,
    k,
    v,
    g,
    alpha,
    hbuf,
    sbuf,
    o,
    cu_seqlens,
    chunk_indices,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_at,
    stride_ah,
    ridge,
    rho2_4,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    L: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    NUM_ITER: tl.constexpr,
    MIN_FRO_SQ: tl.constexpr,
    PREC: tl.constexpr,
    DECAY_H: tl.constexpr,
):
    NRB: tl.constexpr = L // BM
    i_cr, i_h = tl.program_id(0), tl.program_id(1)
    i_c, i_r = i_cr // NRB, i_cr % NRB
    i_n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)  # int64 offsets, as in the state pass
    t0 = tl.load(cu_seqlens + i_n).to(tl.int64) + j * L

    jj = tl.arange(0, L)  # the chunk's tokens (keys)
    rr = i_r * BM + tl.arange(0, BM)  # this block's tokens (queries), within the chunk
    t_all = t0 + jj
    t_row = t0 + rr
    m_all = t_all < eos
    m_row = t_row < eos
    d = tl.arange(0, BD)
    dv = tl.arange(0, BDV)
    m_d = d < D
    m_dv = dv < DV

    gv = tl.load(g + t_all * stride_gt + i_h * stride_gh, mask=m_all, other=0.0).to(tl.float32)
    cum = tl.cumsum(gv, 0)  # [L]
    causal = jj[None, :] <= rr[:, None]  # [BM, L]
    cum_row = tl.sum(tl.where(causal, gv[None, :], 0.0), 1)  # [BM] the cumulative log-decay at each query
    zeta = tl.exp(cum_row)
    lam = tl.exp(tl.where(causal, cum_row[:, None] - cum[None, :], float("-inf")))  # [BM, L], 0 above the diagonal
    # H's decays: S's, or without DECAY_H (hmf's use_forgetting_gate_kk = false) those of g = 0. Only the norm and
    # the solve read them; the output reads S's.
    if DECAY_H:
        zeta_h = zeta
        lam_h = lam
    else:
        zeta_h = tl.full([BM], 1.0, dtype=tl.float32)
        lam_h = tl.where(causal, 1.0, 0.0)

    kk = tl.load(k + t_all[:, None] * stride_kt + i_h * stride_kh + d[None, :], mask=m_all[:, None] & m_d[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    qq = tl.load(q + t_row[:, None] * stride_qt + i_h * stride_qh + d[None, :], mask=m_row[:, None] & m_d[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    chunk_state = (i_c * H + i_h).to(tl.int64)
    h0 = tl.load(hbuf + chunk_state * D * D + d[:, None] * D + d[None, :], mask=m_d[:, None] & m_d[None, :],
                 other=0.0)  # fmt: skip
    kt = tl.trans(kk)

    # ||H_c||_F^2 = zeta_c^2 ||H0||^2 + 2 zeta_c sum_j Lam[c,j] k_j^T H0 k_j
    #             + sum_{j,j'} Lam[c,j] Lam[c,j'] (k_j . k_j')^2
    p = tl.sum(tl.dot(kk, h0, input_precision=PREC) * kk, 1)  # [L]
    gram = tl.dot(kk, kt, input_precision=PREC)  # [L, L]
    h0_sq = tl.sum(tl.sum(h0 * h0, 1), 0)
    fro_sq = (
        zeta_h * zeta_h * h0_sq
        + 2.0 * zeta_h * tl.sum(lam_h * p[None, :], 1)
        + tl.sum(tl.dot(lam_h, gram * gram, input_precision=PREC) * lam_h, 1)
    )
    fro = tl.sqrt(tl.maximum(fro_sq, MIN_FRO_SQ))

    # Chebyshev steps for every query of the block at once (the reference's code form, omega_0 = 2).
    lam_x = (ridge * fro)[:, None]
    step = (2.0 / ((1.0 + 2.0 * ridge) * fro))[:, None]
    x = step * qq
    x_prev = tl.zeros_like(x)
    w = 2.0
    for _ in range(NUM_ITER):
        w = 1.0 / (1.0 - rho2_4 * w)
        hx = zeta_h[:, None] * tl.dot(x, h0, input_precision=PREC)
        hx = tl.dot(tl.dot(x, kt, input_precision=PREC) * lam_h, kk, acc=hx, input_precision=PREC)
        t = (step * w) * (hx + lam_x * x - qq) + (w - 1.0) * x_prev
        x_prev = x
        x = w * x - t
    a = tl.load(alpha + t_row * stride_at + i_h * stride_ah, mask=m_row, other=0.0).to(tl.float32)
    qp = qq + a[:, None] * (x - qq)

    vv = tl.load(v + t_all[:, None] * stride_vt + i_h * stride_vh + dv[None, :], mask=m_all[:, None] & m_dv[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    s0 = tl.load(sbuf + chunk_state * D * DV + d[:, None] * DV + dv[None, :], mask=m_d[:, None] & m_dv[None, :],
                 other=0.0)  # fmt: skip
    out = zeta[:, None] * tl.dot(qp, s0, input_precision=PREC)
    out = tl.dot(tl.dot(qp, kt, input_precision=PREC) * lam, vv, acc=out, input_precision=PREC)
    p_o = o + t_row[:, None] * (H * DV) + i_h * DV + dv[None, :]
    tl.store(p_o, (scale * out).to(o.dtype.element_ty), mask=m_row[:, None] & m_dv[None, :])


def _chunk_len(chunk_size: int) -> int:
    """The kernels' chunk length: chunk_size as a power of two in [16, 32] (the output does not depend on it).

    32 rather than the layer's 64: per token and Chebyshev step the solve costs D^2 + 2 L D multiply-adds, so a
    shorter chunk does less work, and an H100 sweep (BENCHMARKS.md) found 32 fastest; 16 stores twice the chunk
    states."""
    return min(32, max(16, common.next_power_of_2(int(chunk_size))))


def launch(
    q, k, v, g, alpha, h, s, state_indices, cu_seqlens, ridge, num_iter, scale, chunk_size=64, *,
    cu_seqlens_cpu=None, block_m: int | None = None, block_r: int | None = None, block_n: int | None = None,
    warps_out: int | None = None,
    warps_state: int = 4, precision: str | None = None, chunk_len: int | None = None, decay_h: bool = True,
) -> torch.Tensor:  # fmt: skip
    """`chunk_gka` with the kernels' chunk length, block shapes and dot precision open (for the device sweep)."""
    check_shapes(q, k, v, g, alpha, h, s)
    T, He, D = q.shape
    Dv = v.shape[-1]
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    nseq = len(cu) - 1
    L = chunk_len or _chunk_len(chunk_size)
    chunk_indices, chunk_offsets, NC = chunk_metadata(cu, L, q.device)
    dev = q.device
    o = common.output_buffer((T, He, Dv), q.dtype, dev)
    if NC == 0:
        return o
    prec = precision or ("tf32x3" if q.dtype == torch.float32 else "tf32")
    if INTERPRET:
        prec = "ieee"  # the interpreter computes its dots in fp32 whatever it is told
    BD = max(16, common.next_power_of_2(D))
    BDV = max(16, common.next_power_of_2(Dv))
    f32 = torch.float32

    hbuf = common.output_buffer((NC, He, D, D), f32, dev)
    sbuf = common.output_buffer((NC, He, D, Dv), f32, dev)
    # 64 x 64 tiles: of the H100 sweep (BENCHMARKS.md), the best for packed prompts and within noise of the best
    # for one long prompt.
    BN = block_n or min(64, BD, BDV)
    BR = min(BD, block_r or 64)
    launch_kernel(_gka_state_kernel, (nseq * He, common.cdiv(D, BR) * (common.cdiv(D, BN) + common.cdiv(Dv, BN))),
        k, v, g, h, s, hbuf, sbuf, state_indices, cu_seqlens, chunk_offsets,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        h.stride(0), h.stride(1), h.stride(2), s.stride(0), s.stride(1), s.stride(2),
        H=He, D=D, DV=Dv, L=L, BR=BR, BN=BN, PREC=prec, INTERP=INTERPRET, DECAY_H=bool(decay_h),
        num_warps=warps_state,
    )  # fmt: skip

    BM = min(L, block_m or (16 if INTERPRET else 32))
    rho2_4 = (0.5 / (1.0 + 2.0 * ridge)) ** 2
    launch_kernel(_gka_out_kernel, (NC * (L // BM), He),
        q, k, v, g, alpha, hbuf, sbuf, o, cu_seqlens, chunk_indices,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        alpha.stride(0), alpha.stride(1), float(ridge), rho2_4, float(scale),
        H=He, D=D, DV=Dv, L=L, BM=BM, BD=BD, BDV=BDV, NUM_ITER=int(num_iter), MIN_FRO_SQ=_MIN_FRO_SQ, PREC=prec,
        DECAY_H=bool(decay_h), num_warps=warps_out or 4,
    )  # fmt: skip
    return o


def chunk_gka(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    decay_h: bool = True,
) -> torch.Tensor:
    """Triton `kvfree.kernels.gka.chunk_gka` (same arguments and result; see its docstring).

    q, k, v may have any strides but a contiguous last dimension; o is contiguous. `chunk_size` is rounded to a power
    of two in [16, 128].
    """
    return launch(
        q, k, v, g, alpha, h, s, state_indices, cu_seqlens, ridge, num_iter, scale, chunk_size,
        cu_seqlens_cpu=cu_seqlens_cpu, decay_h=decay_h,
    )  # fmt: skip
