"""Triton Gated KalmaNet decode step: one kernel, states H and S updated in place in their pools, addressed by slot.

One program per (session, head). It loads the session's `[D, D]` key covariance H once and keeps it in registers
for the whole step: H <- exp(g) H + k k^T (stored back at once, so the write drains while the solve runs), the
Frobenius norm, all r Chebyshev steps of `(H + a ||H|| I) x = q` as register matvecs, and the alpha mix
q' = q + alpha (x - q). Then it streams S in `[D, BV]` column blocks: S <- exp(g) S + k v^T, stored, and
o = scale S^T q'. H and S are each read once and written once per step, which is the op's memory floor; the solve is
about 2 r D^2 flops per head on data already on chip. With `decay_h=False` (hmf's use_forgetting_gate_kk = false; a
compile-time flag, so the default kernel is unchanged) H <- H + k k^T instead.

With one S block (BV >= Dv) S is loaded before the solve, so its read overlaps the solve's arithmetic (more registers,
fewer programs per multiprocessor); with several blocks it is streamed after. `launch` leaves both open for the
device sweep; `fused_recurrent_gka` streams 64-column blocks. The solve, not memory, bounds the step: H takes 128 of a
thread's registers at 4 warps, two programs share a multiprocessor, and each Chebyshev step ends in a cross-warp
reduction and a layout exchange through shared memory (BENCHMARKS.md has the numbers). No host sync, no
value-dependent allocation: graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel
from .reference import _MIN_FRO_SQ


@triton.jit
def _gka_step_kernel(
    q,
    k,
    v,
    g,
    alpha,
    h,
    s,
    state_indices,
    o,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_gb,
    stride_gh,
    stride_ab,
    stride_ah,
    stride_hs,
    stride_hh,
    stride_hr,
    stride_ss,
    stride_sh,
    stride_sr,
    ridge,
    rho2_4,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BD: tl.constexpr,
    BV: tl.constexpr,
    NUM_ITER: tl.constexpr,
    MIN_FRO_SQ: tl.constexpr,
    DECAY_H: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_indices + i_b).to(tl.int64)

    r = tl.arange(0, BD)  # rows of H and S (the key dimension)
    c = tl.arange(0, BD)  # columns of H
    m_r = r < D
    m_c = c < D
    p_h = h + slot * stride_hs + i_h * stride_hh + r[:, None] * stride_hr + c[None, :]
    m_h = m_r[:, None] & m_c[None, :]
    hm = tl.load(p_h, mask=m_h, other=0.0)
    ONE_V_BLOCK: tl.constexpr = BV >= DV
    if ONE_V_BLOCK:  # issued now, used after the solve: the read overlaps the arithmetic
        cv = tl.arange(0, BV)
        m_sv = m_r[:, None] & (cv < DV)[None, :]
        p_s = s + slot * stride_ss + i_h * stride_sh + r[:, None] * stride_sr + cv[None, :]
        sm = tl.load(p_s, mask=m_sv, other=0.0)

    q_off = i_b * stride_qb + i_h * stride_qh
    k_off = i_b * stride_kb + i_h * stride_kh
    qv = tl.load(q + q_off + c, mask=m_c, other=0.0).to(tl.float32)
    k_r = tl.load(k + k_off + r, mask=m_r, other=0.0).to(tl.float32)
    k_c = tl.load(k + k_off + c, mask=m_c, other=0.0).to(tl.float32)
    gamma = tl.exp(tl.load(g + i_b * stride_gb + i_h * stride_gh).to(tl.float32))
    a = tl.load(alpha + i_b * stride_ab + i_h * stride_ah).to(tl.float32)

    if DECAY_H:  # a compile-time flag; without it (hmf's use_forgetting_gate_kk = false) H never decays, S does
        hm = gamma * hm
    hm = hm + k_r[:, None] * k_c[None, :]
    tl.store(p_h, hm, mask=m_h)
    fro = tl.sqrt(tl.maximum(tl.sum(tl.sum(hm * hm, axis=1), axis=0), MIN_FRO_SQ))

    # Chebyshev iteration in the reference's code form; omega_0 = 2, omega_i = 1 / (1 - (rho^2/4) omega_{i-1}).
    lam = ridge * fro
    step = 2.0 / ((1.0 + 2.0 * ridge) * fro)
    x = step * qv
    x_prev = tl.zeros_like(x)
    w = 2.0
    for _ in range(NUM_ITER):
        w = 1.0 / (1.0 - rho2_4 * w)
        # H is symmetric, so H x is also the column sums of H * x[:, None]: reducing over rows keeps the sum inside
        # each thread (a thread holds many rows of few columns) instead of shuffling across the warp for every row.
        hx = tl.sum(hm * x[:, None], axis=0)
        t = (step * w) * (hx + lam * x - qv) + (w - 1.0) * x_prev
        x_prev = x
        x = w * x - t
    qp = qv + a * (x - qv)

    v_off = i_b * stride_vb + i_h * stride_vh
    o_off = i_bh * DV
    if ONE_V_BLOCK:
        vv = tl.load(v + v_off + cv, mask=cv < DV, other=0.0).to(tl.float32)
        sm = gamma * sm + k_r[:, None] * vv[None, :]
        tl.store(p_s, sm, mask=m_sv)
        tl.store(o + o_off + cv, (scale * tl.sum(sm * qp[:, None], axis=0)).to(o.dtype.element_ty), mask=cv < DV)
    else:
        for v0 in range(0, DV, BV):
            cv = v0 + tl.arange(0, BV)
            m_sv = m_r[:, None] & (cv < DV)[None, :]
            p_s = s + slot * stride_ss + i_h * stride_sh + r[:, None] * stride_sr + cv[None, :]
            sm = tl.load(p_s, mask=m_sv, other=0.0)
            vv = tl.load(v + v_off + cv, mask=cv < DV, other=0.0).to(tl.float32)
            sm = gamma * sm + k_r[:, None] * vv[None, :]
            tl.store(p_s, sm, mask=m_sv)
            out = scale * tl.sum(sm * qp[:, None], axis=0)
            tl.store(o + o_off + cv, out.to(o.dtype.element_ty), mask=cv < DV)


def check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, alpha: torch.Tensor, h: torch.Tensor,
    s: torch.Tensor,
) -> None:
    """Both GKA kernels' argument check: q, k `[N, He, D]`, v `[N, He, Dv]`, g, alpha `[N, He]` (N tokens or
    sessions), fp32 pools h `[S, He, D, D]` and s `[S, He, D, Dv]`, last dimensions contiguous. Raises ValueError."""
    N, He, D = q.shape
    Dv = v.shape[-1]
    ok = (
        k.shape == q.shape
        and v.shape[:2] == (N, He)
        and g.shape == (N, He)
        and alpha.shape == (N, He)
        and tuple(h.shape[1:]) == (He, D, D)
        and tuple(s.shape[1:]) == (He, D, Dv)
        and h.dtype == s.dtype == torch.float32
        and h.stride(-1) == s.stride(-1) == 1
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    )
    if not ok:
        raise ValueError(
            f"shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} alpha "
            f"{tuple(alpha.shape)} h {tuple(h.shape)} {h.dtype} s {tuple(s.shape)} {s.dtype} (fp32 pools; the last "
            "dimension of q, k, v, h, s contiguous)"
        )


def launch(
    q, k, v, g, alpha, h, s, state_indices, ridge, num_iter, scale, block_v: int | None = None,
    num_warps: int | None = None, decay_h: bool = True,
) -> torch.Tensor:  # fmt: skip
    """`fused_recurrent_gka` with the block shape open (for the device sweep)."""
    check_shapes(q, k, v, g, alpha, h, s)
    B, He, D = q.shape
    Dv = v.shape[-1]
    out = common.output_buffer((B, He, Dv), q.dtype, q.device)
    if B == 0:
        return out
    BD = max(16, common.next_power_of_2(D))
    BVmax = max(16, common.next_power_of_2(Dv))
    # 64-column S blocks after the solve and 4 warps: the fastest at B = 64 and 256 in the H100 sweep (BENCHMARKS.md).
    # S whole before the solve needs more registers (spills); 8 warps fit one program per multiprocessor, 2x slower.
    BV = min(BVmax, block_v or 64)
    if num_warps is None:
        num_warps = 4
    rho2_4 = (0.5 / (1.0 + 2.0 * ridge)) ** 2
    launch_kernel(_gka_step_kernel, (B * He,),
        q, k, v, g, alpha, h, s, state_indices, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        alpha.stride(0), alpha.stride(1), h.stride(0), h.stride(1), h.stride(2), s.stride(0), s.stride(1),
        s.stride(2), float(ridge), rho2_4, float(scale),
        H=He, D=D, DV=Dv, BD=BD, BV=BV, NUM_ITER=int(num_iter), MIN_FRO_SQ=_MIN_FRO_SQ, DECAY_H=bool(decay_h),
        num_warps=num_warps,
    )  # fmt: skip
    return out


def fused_recurrent_gka(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    state_indices: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
    *,
    decay_h: bool = True,
) -> torch.Tensor:
    """Triton `kvfree.kernels.gka.fused_recurrent_gka` (same arguments and result; see its docstring).

    q, k, v may have any strides but a contiguous last dimension. No host sync: graph-capturable.
    """
    return launch(q, k, v, g, alpha, h, s, state_indices, ridge, num_iter, scale, decay_h=decay_h)
