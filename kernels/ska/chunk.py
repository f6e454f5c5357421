"""Triton SKA prefill over packed variable-length sequences, each continuing its session's state in place in the pool.

Each sequence is cut on its session's ABSOLUTE chunk grid (docs/design/ska.md §3.3): with front = pos % S, its
local chunk j holds the tokens [j S - front, (j + 1) S - front) of the sequence. The grid is read from pos on the
device: the host sizes the launches for the worst case, ceil((len + S - 1) / S) chunks, and a program whose chunk
does not exist exits, so the prefill reads no state to the host. Three launches, then a fourth in mode P:

1. `_ska_stats_kernel`, per (chunk, head), all in parallel: the chunk's sums Gc = sum z z^T, Mc = sum z z_prev^T,
   Cc = sum v z^T and its largest key norm, into a scratch buffer. In an fp64 state they are rank-1 steps in fp64
   (exact products of the fp32 keys, as the reference's fp64 einsums: the point of fp64 accumulators, ska.md §5);
   in an fp32 state, tensor-core dots ("tf32x3", about fp32 accuracy). Chunk 0 also saves the session's pos and J
   for the later launches, which must not read the pool rows that launches 2 and 3 overwrite.
2. `_ska_prefix_kernel`, per (sequence x head, row tile of the stacked [G; M; C] rows): the one sequential pass. It
   walks the sequence's chunks, replacing each chunk's sums by the totals of everything before it (stored state +
   earlier chunks) and writes the final totals to the pool. Tile 0 also turns the chunk norms into each chunk's
   key max-norm m (running max, or the paper's frozen rule) and writes m and pos.
3. `_ska_readout_kernel`, per (chunk, head), all in parallel: the operator chunk j reads (`rebuild.build_readout`
   from the totals before it; chunk 0 of a continued partial chunk keeps the stored J; chunk 0 of a new session
   reads J = 0), then y = Q J^T for the chunk's queries (one dot), and, in the last chunk, the pool's J and z_prev.
   Every operator depends only on the prefix totals, so the O(r^3) builds run in parallel, not one after another.

Mode P (the paper's prefix mode, §3.4): launches 1 and 2 on the local grid (front = 0; only the totals matter), then
`fused_recurrent._ska_rebuild_kernel` builds one operator per sequence from the new totals into the pool, and
launch 3 reads every chunk's queries through it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..dispatch import chunk_metadata, host_cu_seqlens
from ..launcher import launch_kernel
from ..masks import block_mask
from .fused_recurrent import check_state, rebuild_launch, sizes
from .rebuild import build_readout, fallback_counter, param, split_eps, tensor_core_products
from .reference import MODES, SKAState

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _chunk_span(i_c, chunk_indices, cu_seqlens, posbuf, S: tl.constexpr, LOCAL: tl.constexpr):
    """Global chunk i_c -> (sequence n, local chunk j, first token, length, front = pos % S, number of chunks).
    posbuf holds each sequence's pos (written by launch 1's chunk 0); LOCAL: the grid starts at the sequence."""
    n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    length = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
    front = length * 0 if LOCAL else tl.load(posbuf + n) % S
    return n, j, bos, length, front, (front + length + S - 1) // S


@triton.jit
def _ska_stats_kernel(
    z,
    v,
    zp,
    J,
    pos,
    state_indices,
    cu_seqlens,
    chunk_indices,
    sbuf,
    mbuf,
    posbuf,
    jbuf,
    stride_zt,
    stride_zh,
    stride_vt,
    stride_vh,
    stride_ps,
    stride_ph,
    stride_js,
    stride_jh,
    stride_jr,
    H: tl.constexpr,
    r: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    PB: tl.constexpr,
    S: tl.constexpr,
    BS: tl.constexpr,
    LOCAL: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREC: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    slot = tl.load(state_indices + n).to(tl.int64)
    p0 = tl.load(pos + slot)
    rr = tl.arange(0, R)
    pp = tl.arange(0, PB)
    m_r = rr < r
    m_p = pp < P
    if j == 0:  # save what launches 2 and 3 read of the pool row before they overwrite it
        if i_h == 0:
            tl.store(posbuf + n, p0)
        p_j = J + slot * stride_js + i_h * stride_jh + pp[:, None] * stride_jr + rr[None, :]
        m_pr = m_p[:, None] & m_r[None, :]
        tl.store(jbuf + (n * H + i_h) * P * r + pp[:, None] * r + rr[None, :], tl.load(p_j, mask=m_pr), mask=m_pr)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    length = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
    front = length * 0 if LOCAL else p0 % S
    if j < (front + length + S - 1) // S:
        t0 = j * S - front  # the chunk's first token within the sequence (negative: the grid's part before it)
        p_zprev = zp + slot * stride_ps + i_h * stride_ph + rr
        W: tl.constexpr = 2 * r + P
        base = sbuf + (i_c * H + i_h).to(tl.int64) * W * r
        if USE_DOT:  # the chunk's tokens as `[BS, R]` tiles (in the accumulator dtype), the sums as dots
            acc = sbuf.dtype.element_ty
            ii = tl.arange(0, BS)
            t = t0 + ii
            real = (ii < S) & (t >= 0) & (t < length)
            z32 = tl.load(z + (bos + t)[:, None] * stride_zt + i_h * stride_zh + rr[None, :],
                          mask=real[:, None] & m_r[None, :], other=0.0).to(tl.float32)  # fmt: skip
            zt = z32.to(acc)  # fp32 keys: their products are exact in fp64
            lag = tl.load(z + (bos + t - 1)[:, None] * stride_zt + i_h * stride_zh + rr[None, :],
                          mask=(real & (t >= 1))[:, None] & m_r[None, :], other=0.0).to(tl.float32).to(acc)  # fmt: skip
            zprev = tl.load(p_zprev, mask=m_r, other=0.0).to(acc)
            lag = tl.where((real & (t == 0))[:, None], zprev[None, :], lag)
            vt = tl.load(v + (bos + t)[:, None] * stride_vt + i_h * stride_vh + pp[None, :],
                         mask=real[:, None] & m_p[None, :], other=0.0).to(tl.float32).to(acc)  # fmt: skip
            ztt = tl.trans(zt)
            g = tl.dot(ztt, zt, input_precision=PREC)
            mm = tl.dot(ztt, lag, input_precision=PREC)
            c = tl.dot(tl.trans(vt), zt, input_precision=PREC)
            nmax = tl.max(tl.sqrt(tl.sum(z32 * z32, axis=1)), axis=0)
        else:  # one rank-1 step per token, in the accumulator dtype
            acc = sbuf.dtype.element_ty
            g = tl.zeros((R, R), dtype=acc)
            mm = tl.zeros((R, R), dtype=acc)
            c = tl.zeros((PB, R), dtype=acc)
            nmax = tl.zeros((), dtype=tl.float32)
            for i in range(S):
                t = t0 + i
                real = (t >= 0) & (t < length)
                zt = tl.load(z + (bos + t) * stride_zt + i_h * stride_zh + rr, mask=m_r & block_mask(real, rr),
                             other=0.0).to(tl.float32)  # fmt: skip
                lag = tl.load(z + (bos + t - 1) * stride_zt + i_h * stride_zh + rr,
                              mask=m_r & block_mask(real & (t >= 1), rr), other=0.0).to(tl.float32)  # fmt: skip
                lag += tl.load(p_zprev, mask=m_r & block_mask(real & (t == 0), rr), other=0.0)
                vt = tl.load(v + (bos + t) * stride_vt + i_h * stride_vh + pp, mask=m_p & block_mask(real, pp),
                             other=0.0)  # fmt: skip
                za = zt.to(acc)
                g += za[:, None] * za[None, :]
                mm += za[:, None] * lag.to(acc)[None, :]
                c += vt.to(acc)[:, None] * za[None, :]
                nmax = tl.maximum(nmax, tl.sqrt(tl.sum(zt * zt, axis=0)))
        m_rr = m_r[:, None] & m_r[None, :]
        tl.store(base + rr[:, None] * r + rr[None, :], g, mask=m_rr)
        tl.store(base + r * r + rr[:, None] * r + rr[None, :], mm, mask=m_rr)
        tl.store(base + 2 * r * r + pp[:, None] * r + rr[None, :], c, mask=m_p[:, None] & m_r[None, :])
        tl.store(mbuf + i_c * H + i_h, nmax)


@triton.jit
def _ska_prefix_kernel(
    G,
    M,
    C,
    m,
    pos,
    state_indices,
    cu_seqlens,
    chunk_offsets,
    sbuf,
    mbuf,
    posbuf,
    stride_gs,
    stride_gh,
    stride_gr,
    stride_cs,
    stride_ch,
    stride_cr,
    stride_ms,
    stride_mh,
    H: tl.constexpr,
    r: tl.constexpr,
    P: tl.constexpr,
    RC: tl.constexpr,
    BR: tl.constexpr,
    S: tl.constexpr,
    LOCAL: tl.constexpr,
    FROZEN: tl.constexpr,
):
    i_nh, i_t = tl.program_id(0), tl.program_id(1)
    n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    length = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
    if length > 0:  # an empty sequence has no chunks, and launch 1 saved nothing for it
        slot = tl.load(state_indices + n).to(tl.int64)
        p0 = tl.load(posbuf + n)
        front = length * 0 if LOCAL else p0 % S
        nc = (front + length + S - 1) // S
        c0 = tl.load(chunk_offsets + n).to(tl.int64)
        W: tl.constexpr = 2 * r + P
        # This tile's rows of the stacked [G; M; C] (W rows of r), in the pool and in the chunk buffer.
        row = i_t * BR + tl.arange(0, BR)
        col = tl.arange(0, RC)
        mask = (row[:, None] < W) & (col[None, :] < r)
        p_g = G + slot * stride_gs + i_h * stride_gh + row[:, None] * stride_gr + col[None, :]
        p_m = M + slot * stride_gs + i_h * stride_gh + (row - r)[:, None] * stride_gr + col[None, :]
        p_c = C + slot * stride_cs + i_h * stride_ch + (row - 2 * r)[:, None] * stride_cr + col[None, :]
        p_pool = tl.where(row[:, None] < r, p_g, tl.where(row[:, None] < 2 * r, p_m, p_c))
        total = tl.load(p_pool, mask=mask, other=0.0)
        p_buf = sbuf + ((c0 * H + i_h) * W + row[:, None]) * r + col[None, :]
        jj = 0
        while jj < nc:  # (a while loop: the interpreter cannot take range() of a loaded bound)
            part = tl.load(p_buf, mask=mask, other=0.0)
            tl.store(p_buf, total, mask=mask)  # the chunk now holds the totals of everything before it
            total += part
            p_buf += H * W * r
            jj += 1
        tl.store(p_pool, total, mask=mask)

        if i_t == 0:  # the key max-norm: per chunk (mbuf, in place of the chunk's norm) and the new m
            p_m0 = m + slot * stride_ms + i_h * stride_mh
            m0 = tl.load(p_m0)
            run = m0
            seg = m0 * 0.0
            p_n = mbuf + c0 * H + i_h
            jj = 0
            while jj < nc:
                cmax = tl.load(p_n)
                tl.store(p_n, run)  # causal: the max over the tokens before the chunk
                run = tl.maximum(run, cmax)
                seg = tl.maximum(seg, cmax)
                p_n += H
                jj += 1
            if FROZEN:  # the paper's m: the first segment's max (its every chunk reads it), then frozen
                tl.store(p_m0, tl.where(p0 == 0, seg, m0))
            else:
                tl.store(p_m0, run)
            if i_h == 0:
                tl.store(pos + slot, p0 + length)


@triton.jit
def _ska_readout_kernel(
    z,
    q,
    y,
    zp,
    J,
    m,
    state_indices,
    cu_seqlens,
    chunk_indices,
    sbuf,
    mbuf,
    posbuf,
    jbuf,
    counter,
    eta,
    gamma,
    stride_zt,
    stride_zh,
    stride_qt,
    stride_qh,
    stride_ps,
    stride_ph,
    stride_js,
    stride_jh,
    stride_jr,
    stride_ms,
    stride_mh,
    eps_hi,
    eps_lo,
    H: tl.constexpr,
    r: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    PB: tl.constexpr,
    S: tl.constexpr,
    BS: tl.constexpr,
    ORDER: tl.constexpr,
    ITERS: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREC: tl.constexpr,
    MODE_P: tl.constexpr,
    FROZEN: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    n, j, bos, length, front, nc = _chunk_span(i_c, chunk_indices, cu_seqlens, posbuf, S, MODE_P)
    if j < nc:
        slot = tl.load(state_indices + n).to(tl.int64)
        p0 = tl.load(posbuf + n)
        rr = tl.arange(0, R)
        pp = tl.arange(0, PB)
        m_r = rr < r
        m_p = pp < P
        m_pr = m_p[:, None] & m_r[None, :]
        p_jpool = J + slot * stride_js + i_h * stride_jh + pp[:, None] * stride_jr + rr[None, :]
        if MODE_P:  # one operator per sequence, already built into the pool
            Jt = tl.load(p_jpool, mask=m_pr, other=0.0)
        elif (j > 0) | ((front == 0) & (p0 > 0)):  # the operator of all tokens before the chunk
            W: tl.constexpr = 2 * r + P
            base = sbuf + (i_c * H + i_h).to(tl.int64) * W * r
            # frozen: the session's m, which launch 2 wrote; causal: the max over the tokens before the chunk
            mv = tl.load(m + slot * stride_ms + i_h * stride_mh) if FROZEN else tl.load(mbuf + i_c * H + i_h)
            Jt = build_readout(base, base + r * r, base + 2 * r * r, r, r, r, mv, eps_hi, eps_lo, tl.load(eta),
                               tl.load(gamma), counter, r, P, R, PB, ORDER, ITERS, USE_DOT).to(tl.float32)  # fmt: skip
        elif front > 0:  # a continued, partial chunk: the stored J
            Jt = tl.load(jbuf + (n * H + i_h) * P * r + pp[:, None] * r + rr[None, :], mask=m_pr, other=0.0)
        else:  # chunk 0 of a new session: empty statistics
            Jt = tl.zeros((PB, R), dtype=tl.float32)

        ii = tl.arange(0, BS)
        t = j * S - front + ii
        real = (ii < S) & (t >= 0) & (t < length)
        qt = tl.load(q + (bos + t)[:, None] * stride_qt + i_h * stride_qh + rr[None, :],
                     mask=real[:, None] & m_r[None, :], other=0.0).to(tl.float32)  # fmt: skip
        out = tl.dot(qt, tl.trans(Jt), input_precision=PREC)  # [BS, PB]
        tl.store(y + ((bos + t)[:, None] * H + i_h) * P + pp[None, :], out, mask=real[:, None] & m_p[None, :])
        if j == nc - 1:  # the session's new J (the operator its last token read) and z_prev
            if not MODE_P:
                tl.store(p_jpool, Jt, mask=m_pr)
            zl = tl.load(z + (bos + length - 1) * stride_zt + i_h * stride_zh + rr, mask=m_r)
            tl.store(zp + slot * stride_ps + i_h * stride_ph + rr, zl.to(tl.float32), mask=m_r)


def _grid_cu(cu: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """Boundaries whose lengths are len + S - 1 (0 stays 0): `chunk_metadata` of these gives each sequence the
    most chunks it can span on any absolute grid, ceil((len + S - 1) / S)."""
    out = [0]
    for a, b in zip(cu, cu[1:], strict=False):
        out.append(out[-1] + (b - a + chunk - 1 if b > a else 0))
    return tuple(out)


def launch(
    z: torch.Tensor, q: torch.Tensor, v: torch.Tensor, state: SKAState, state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor, chunk_size: int, eps: float, eta: torch.Tensor | float, gamma: torch.Tensor | float,
    order: int, power_iters: int, key_norm: str = "causal", mode: str = "C", *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None, use_dot: bool | None = None, stats_dot: bool | None = None,
    precision: str | None = None, block_rows: int = 16, num_warps: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`chunk_ska` with the kernels' choices open (for the device sweep): `use_dot`, the rebuild's product path;
    `stats_dot`, tensor-core chunk sums (default: in an fp32 state); `precision` of the fp32 dots; `block_rows`, the
    row tile of the sequential pass; `num_warps` of the readout launch."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    check_state(z, v, state)
    G, M, C, zp, m, J, pos = state
    T, H, r = z.shape
    P = v.shape[-1]
    R, PB = sizes(r, P)
    S = int(chunk_size)
    BS = max(16, common.next_power_of_2(S))
    dev = z.device
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    nseq = len(cu) - 1
    y = common.output_buffer((T, H, P), torch.float32, dev)
    local = mode == "P"
    chunk_indices, chunk_offsets, NC = chunk_metadata(cu if local else _grid_cu(cu, S), S, dev)
    if NC == 0:
        return y
    acc = G.dtype
    # The interpreter's dots are fp32 whatever it is told; fp64 operands take exact fp64 MMA ("ieee").
    prec = "ieee" if INTERPRET or acc == torch.float64 else (precision or "tf32x3")
    if stats_dot is None:  # fp64 sums stay rank-1 FMA steps: an fp64 dot of converted bf16 keys failed to compile
        stats_dot = acc == torch.float32
    if use_dot is None:
        use_dot = tensor_core_products(acc, dev)
    W = 2 * r + P
    sbuf = common.output_buffer((NC, H, W, r), acc, dev)
    mbuf = common.output_buffer((NC, H), torch.float32, dev)
    posbuf = common.output_buffer((nseq,), torch.int64, dev)
    jbuf = common.output_buffer((nseq, H, P, r), torch.float32, dev)
    eta_t, gamma_t = param(eta, acc, dev), param(gamma, acc, dev)
    eps_hi, eps_lo = split_eps(eps)
    frozen = key_norm == "frozen"

    launch_kernel(_ska_stats_kernel, (NC, H),
        z, v, zp, J, pos, state_indices, cu_seqlens, chunk_indices, sbuf, mbuf, posbuf, jbuf,
        z.stride(0), z.stride(1), v.stride(0), v.stride(1), zp.stride(0), zp.stride(1), J.stride(0), J.stride(1),
        J.stride(2),
        H=H, r=r, P=P, R=R, PB=PB, S=S, BS=BS, LOCAL=local, USE_DOT=bool(stats_dot), PREC=prec, num_warps=4,
    )  # fmt: skip
    BR = block_rows
    launch_kernel(_ska_prefix_kernel, (nseq * H, common.cdiv(W, BR)),
        G, M, C, m, pos, state_indices, cu_seqlens, chunk_offsets, sbuf, mbuf, posbuf,
        G.stride(0), G.stride(1), G.stride(2), C.stride(0), C.stride(1), C.stride(2), m.stride(0), m.stride(1),
        H=H, r=r, P=P, RC=R, BR=BR, S=S, LOCAL=local, FROZEN=frozen, num_warps=4,
    )  # fmt: skip
    kw = dict(eps=eps, eta=eta_t, gamma=gamma_t, order=order, power_iters=power_iters)
    if local:  # mode P: one operator per sequence from its new totals, into the pool
        rebuild_launch(state, state_indices, chunk_size=S, always=True, cu_seqlens=cu_seqlens, use_dot=use_dot, **kw)
    if num_warps is None:
        num_warps = 8 if R * R * G.element_size() > 16384 else 4
    launch_kernel(_ska_readout_kernel, (NC, H),
        z, q, y, zp, J, m, state_indices, cu_seqlens, chunk_indices, sbuf, mbuf, posbuf, jbuf, fallback_counter(dev),
        eta_t, gamma_t,
        z.stride(0), z.stride(1), q.stride(0), q.stride(1), zp.stride(0), zp.stride(1), J.stride(0), J.stride(1),
        J.stride(2), m.stride(0), m.stride(1), eps_hi, eps_lo,
        H=H, r=r, P=P, R=R, PB=PB, S=S, BS=BS, ORDER=int(order), ITERS=int(power_iters), USE_DOT=bool(use_dot),
        PREC=prec, MODE_P=local, FROZEN=frozen, num_warps=num_warps,
    )  # fmt: skip
    return y


def chunk_ska(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    mode: str = "C",
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.ska.chunk_ska` (same arguments and result; see its docstring).

    z, q, v `[T, H, r|P]` (fp32 or bf16/fp16) may have any strides but a contiguous last dimension; y is contiguous.
    Unlike the reference it reads no session position to the host (only `cu_seqlens_cpu`, copied from the device
    when not given). Where a Cholesky fails even with jitter 1e-2 m^2 that chunk's J is NaN (the reference raises).
    """
    return launch(
        z, q, v, state, state_indices, cu_seqlens, chunk_size, eps, eta, gamma, order, power_iters, key_norm, mode,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
