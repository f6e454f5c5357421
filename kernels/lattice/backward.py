"""Triton Lattice recurrence for training: a forward that keeps checkpoints and a backward that recomputes from them.

`lattice_scan_train(S0, q, k, v, gamma, variant)` is `reference.lattice_recurrent` with mu = 1 (the folded form: the
layer passes gamma / mu, which is the same function, spec §4.4, and autograd takes the division's gradient) on
batches of equal-length sequences, differentiable in all five inputs.

Forward, one program per (sequence, head): the token loop of `fused_recurrent.py` with S in registers, storing S
every C tokens (the segment checkpoints, `[B, H, NC, d, m]` fp32) and y. Backward, one program per (sequence, head),
segments from the last: recompute the segment's pre-update states from its checkpoint into a scratch buffer
(`[B, H, C, d, m]`, per program), then walk its tokens backwards with dS in registers. Per token, with
S~ = S diag(f) + h c^T, n = column norms of S~, S' = S~ diag(1/n), y = S' q:

    dS' += dy q^T;  dq = S'^T dy
    dS~ = (dS' - S' diag(colsum(S' * dS'))) diag(1/n)
    dS  = dS~ diag(f);  df = colsum(S * dS~);  dh = dS~ c;  dc = dS~^T h - df * b;  db = -df * c
    dec (h = S k - v, b = S^T h, c = -g k):      db -> dS += h db^T, dh += S db;  dS += dh k^T;
                                                  dk = S^T dh - g dc;  dv = -dh;  dg = -k . dc
    enc (h = v, b = S^T v, c = -g (b - k)):       db -= g dc;  dS += v db^T;  dv = dh + S db;  dk = g dc;
                                                  dg = -(b - k) . dc
    sim (h = v, b = S^T v, c = g k):              dS += v db^T;  dv = dh + S db;  dk = g dc;  dg = k . dc

(the norm floor never binds on valid states, so its clamp has no gradient here, as in autograd's). Activation memory:
the checkpoints, T/C states per head, instead of T states; the backward's scratch is C states per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel
from .fused_recurrent import _lattice_update, tile_blocks
from .reference import _NORM_FLOOR, VARIANTS

SEGMENT = 64  # tokens between checkpoints (the backward's scratch holds one segment's states per program)


@triton.jit
def _train_inputs(q, k, v, gamma, b, t, i_h, cm, cd, m_m, m_d, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                  M: tl.constexpr):  # fmt: skip
    """Token t of sequence b: q, k `[BM]`, v `[BD]`, gamma, fp32 (contiguous `[B, T, H, *]` inputs)."""
    row = (b * T + t) * H + i_h
    qv = tl.load(q + row * M + cm, mask=m_m, other=0.0).to(tl.float32)
    kv = tl.load(k + row * M + cm, mask=m_m, other=0.0).to(tl.float32)
    vv = tl.load(v + row * D + cd, mask=m_d, other=0.0).to(tl.float32)
    gv = tl.load(gamma + row).to(tl.float32)
    return qv, kv, vv, gv


@triton.jit
def _train_fwd_kernel(
    s0, q, k, v, gamma, y, s_out, ckpt, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, C: tl.constexpr, NC: tl.constexpr, VARIANT: tl.constexpr,
    NORM_FLOOR_SQ: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, head h): S from s0 through T tokens; y `[B, T, H, D]`, the final S, and S before every
    C-th token in ckpt `[B, H, NC, D, M]`."""
    b, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cd = tl.arange(0, BD)
    cm = tl.arange(0, BM)
    m_d = cd < D
    m_m = cm < M
    m_s = m_d[:, None] & m_m[None, :]
    tile = cd[:, None] * M + cm[None, :]
    st = tl.load(s0 + (b * H + i_h) * D * M + tile, mask=m_s, other=0.0)
    p_ck = ckpt + (b * H + i_h) * NC * D * M
    for t in range(T):
        if t % C == 0:
            tl.store(p_ck + (t // C) * D * M + tile, st, mask=m_s)
        qv, kv, vv, gv = _train_inputs(q, k, v, gamma, b, t, i_h, cm, cd, m_m, m_d, T, H, D, M)
        st, yv = _lattice_update(st, qv, kv, vv, gv, 1.0, VARIANT, NORM_FLOOR_SQ)
        tl.store(y + ((b * T + t) * H + i_h) * D + cd, yv, mask=m_d)
    tl.store(s_out + (b * H + i_h) * D * M + tile, st, mask=m_s)


@triton.jit
def _train_bwd_kernel(
    q, k, v, gamma, dy, ds_final, ckpt, scratch, dq, dk, dv, dgamma, ds0, T: tl.constexpr, H: tl.constexpr,
    D: tl.constexpr, M: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, C: tl.constexpr, NC: tl.constexpr,
    VARIANT: tl.constexpr, NORM_FLOOR_SQ: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, head h): the gradients of its tokens' inputs and of its initial state (module docstring),
    segment by segment from the last, each recomputed from its checkpoint into this program's scratch `[C, D, M]`."""
    b, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cd = tl.arange(0, BD)
    cm = tl.arange(0, BM)
    m_d = cd < D
    m_m = cm < M
    m_s = m_d[:, None] & m_m[None, :]
    tile = cd[:, None] * M + cm[None, :]
    bh = b * H + i_h
    ds = tl.load(ds_final + bh * D * M + tile, mask=m_s, other=0.0)
    p_scr = scratch + bh * C * D * M
    for jj in range(NC):
        j = NC - 1 - jj
        t0 = j * C
        # Recompute the segment's pre-update states (the same arithmetic as the forward, so the same values). The
        # last segment may be short: its missing tokens are skipped (a fixed trip count keeps the interpreter happy).
        st = tl.load(ckpt + (bh * NC + j) * D * M + tile, mask=m_s, other=0.0)
        for i in range(C):
            if t0 + i < T:
                tl.store(p_scr + i * D * M + tile, st, mask=m_s)
                qv, kv, vv, gv = _train_inputs(q, k, v, gamma, b, t0 + i, i_h, cm, cd, m_m, m_d, T, H, D, M)
                st, _ = _lattice_update(st, qv, kv, vv, gv, 1.0, VARIANT, NORM_FLOOR_SQ)
        tl.debug_barrier()  # the scratch rows were written by other threads than may read them below
        for ii in range(C):
            i = C - 1 - ii
            t = t0 + i
            if t < T:
                ds = _token_backward(q, k, v, gamma, dy, dq, dk, dv, dgamma, p_scr + i * D * M + tile, ds, b, t, i_h,
                                     cm, cd, m_m, m_d, m_s, T, H, D, M, VARIANT, NORM_FLOOR_SQ)  # fmt: skip
        tl.debug_barrier()  # the next segment overwrites the scratch
    tl.store(ds0 + bh * D * M + tile, ds, mask=m_s)


@triton.jit
def _token_backward(q, k, v, gamma, dy, dq, dk, dv, dgamma, p_s, ds, b, t, i_h, cm, cd, m_m, m_d, m_s,
                    T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, M: tl.constexpr, VARIANT: tl.constexpr,
                    NORM_FLOOR_SQ: tl.constexpr):  # fmt: skip
    """One token backwards: its pre-update state from p_s, dS (the gradient of its post-update state) in; its inputs'
    gradients stored; returns the gradient of its pre-update state."""
    s = tl.load(p_s, mask=m_s, other=0.0)
    qv, kv, vv, gv = _train_inputs(q, k, v, gamma, b, t, i_h, cm, cd, m_m, m_d, T, H, D, M)
    row = (b * T + t) * H + i_h
    dyv = tl.load(dy + row * D + cd, mask=m_d, other=0.0).to(tl.float32)
    # Forward quantities of this token.
    if VARIANT == 0:
        h = tl.sum(s * kv[None, :], axis=1) - vv
        c = -gv * kv
        bb = tl.sum(s * h[:, None], axis=0)
    else:
        h = vv
        bb = tl.sum(s * h[:, None], axis=0)
        c = -gv * (bb - kv) if VARIANT == 1 else gv * kv
    f = 1.0 - c * bb
    s_til = s * f[None, :] + h[:, None] * c[None, :]
    inv_n = 1.0 / tl.sqrt(tl.maximum(tl.sum(s_til * s_til, axis=0), NORM_FLOOR_SQ))
    s_new = s_til * inv_n[None, :]
    # Backward through y = S' q and the column normalisation.
    tl.store(dq + row * M + cm, tl.sum(s_new * dyv[:, None], axis=0), mask=m_m)
    ds = ds + dyv[:, None] * qv[None, :]
    ds_til = (ds - s_new * tl.sum(s_new * ds, axis=0)[None, :]) * inv_n[None, :]
    # Through S~ = S diag(f) + h c^T and f = 1 - c * b.
    ds_prev = ds_til * f[None, :]
    df = tl.sum(s * ds_til, axis=0)
    dh = tl.sum(ds_til * c[None, :], axis=1)
    dc = tl.sum(ds_til * h[:, None], axis=0) - df * bb
    db = -df * c
    if VARIANT == 1:
        db -= gv * dc  # c = -g (b - k)
    # Through b = S^T h.
    ds_prev += h[:, None] * db[None, :]
    dh += tl.sum(s * db[None, :], axis=1)
    if VARIANT == 0:  # h = S k - v, c = -g k
        ds_prev += dh[:, None] * kv[None, :]
        dkv = tl.sum(s * dh[:, None], axis=0) - gv * dc
        dvv = -dh
        dgv = -tl.sum(kv * dc, axis=0)
    else:  # h = v
        dvv = dh
        dkv = gv * dc
        dgv = tl.sum((kv - bb) * dc, axis=0) if VARIANT == 1 else tl.sum(kv * dc, axis=0)
    tl.store(dk + row * M + cm, dkv, mask=m_m)
    tl.store(dv + row * D + cd, dvv, mask=m_d)
    tl.store(dgamma + row, dgv)
    return ds_prev


class LatticeScan(torch.autograd.Function):
    """The differentiable Triton recurrence (module docstring). Inputs contiguous `[B, T, H, *]` fp32 (v may be
    bf16), S0 `[B, H, d, m]` fp32; outputs y `[B, T, H, d]` and the final S, fp32."""

    @staticmethod
    def forward(ctx, S0, q, k, v, gamma, variant: str):  # type: ignore[override]
        B, T, H, m = q.shape
        d = v.shape[-1]
        BD, BM, warps = tile_blocks(d, m)
        NC = common.cdiv(T, SEGMENT)
        dev = q.device
        y = common.output_buffer((B, T, H, d), torch.float32, dev)
        s_out = common.output_buffer((B, H, d, m), torch.float32, dev)
        ckpt = common.output_buffer((B, H, NC, d, m), torch.float32, dev)
        launch_kernel(_train_fwd_kernel, (B, H),
            S0, q, k, v, gamma, y, s_out, ckpt, T=T, H=H, D=d, M=m, BD=BD, BM=BM, C=SEGMENT, NC=NC,
            VARIANT=VARIANTS.index(variant), NORM_FLOOR_SQ=_NORM_FLOOR**2, num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, gamma, ckpt)
        ctx.variant = variant
        ctx.v_dtype = v.dtype
        return y, s_out

    @staticmethod
    def backward(ctx, dy, ds_final):  # type: ignore[override]
        q, k, v, gamma, ckpt = ctx.saved_tensors
        B, T, H, m = q.shape
        d = v.shape[-1]
        BD, BM, warps = tile_blocks(d, m)
        NC = ckpt.shape[2]
        dev = q.device
        dy = torch.zeros(B, T, H, d, device=dev) if dy is None else dy.float().contiguous()
        ds_final = torch.zeros(B, H, d, m, device=dev) if ds_final is None else ds_final.float().contiguous()
        f32 = torch.float32
        scratch = common.output_buffer((B, H, SEGMENT, d, m), f32, dev)
        dq = common.output_buffer((B, T, H, m), f32, dev)
        dk = common.output_buffer((B, T, H, m), f32, dev)
        dv = common.output_buffer((B, T, H, d), f32, dev)
        dgamma = common.output_buffer((B, T, H), f32, dev)
        ds0 = common.output_buffer((B, H, d, m), f32, dev)
        launch_kernel(_train_bwd_kernel, (B, H),
            q, k, v, gamma, dy, ds_final, ckpt, scratch, dq, dk, dv, dgamma, ds0, T=T, H=H, D=d, M=m, BD=BD, BM=BM,
            C=SEGMENT, NC=NC, VARIANT=VARIANTS.index(ctx.variant), NORM_FLOOR_SQ=_NORM_FLOOR**2, num_warps=warps,
        )  # fmt: skip
        return ds0, dq, dk, dv.to(ctx.v_dtype), dgamma, None


def lattice_scan_train(
    S0: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, variant: str = "dec"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable recurrence of B equal-length sequences from states S0 (mu = 1: pass the folded gamma / mu).

    Args:
        S0: `[B, H, d, m]` initial states with unit columns.  q, k: `[B, T, H, m]`.  v: `[B, T, H, d]`.
        gamma: `[B, T, H]` step sizes.  variant: "dec", "enc" or "sim".

    Returns:
        y: `[B, T, H, d]` and the final state `[B, H, d, m]`, fp32 (as `reference.lattice_recurrent`).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown Lattice variant {variant!r}; known: {VARIANTS}")
    f32 = torch.float32
    return LatticeScan.apply(
        S0.to(f32).contiguous(), q.to(f32).contiguous(), k.to(f32).contiguous(), v.contiguous(),
        gamma.to(f32).contiguous(), variant,
    )  # fmt: skip
