"""Triton Mamba-2 (SSD) decode step, states updated in place in a pool addressed by slot.

One program per (session, head, P block), on a flat grid. It reads the `[BP, N]` slice of the session's fp32 state
(rows of N contiguous floats, 16-byte loads), applies `S = exp(dt*A) S + dt x ⊗ B` with
dt = clamp(softplus(dt + dt_bias)), writes it back to the same pool row and emits `y = S · C + D x` for its BP
outputs. The state is read once and written once, so the op runs at the state-traffic floor when enough programs are
in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel


@triton.jit
def softplus(x):
    """torch's softplus (threshold 20) in fp32, with log1p done exactly (Goldberg's trick) for very negative x."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _ssd_step_kernel(
    x,
    dt,
    B,
    C,
    state,
    state_indices,
    A,
    D,
    dt_bias,
    y,
    stride_xb,
    stride_xh,
    stride_xp,
    stride_db,
    stride_dh,
    stride_bb,
    stride_bg,
    stride_bn,
    stride_cb,
    stride_cg,
    stride_cn,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_sn,
    dt_lo,
    dt_hi,
    H: tl.constexpr,
    HG: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
):
    # One flat grid (no 65535 cap), P blocks fastest: neighbouring programs stream one contiguous [P, N] state.
    NP: tl.constexpr = (P + BP - 1) // BP
    i_bh, i_p = tl.program_id(0) // NP, tl.program_id(0) % NP
    i_b, i_h = i_bh // H, i_bh % H
    i_g = i_h // HG
    slot = tl.load(state_indices + i_b).to(tl.int64)

    d = tl.load(dt + i_b * stride_db + i_h * stride_dh).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    d = softplus(d)
    if HAS_LIMIT:
        d = tl.minimum(tl.maximum(d, dt_lo), dt_hi)
    decay = tl.exp(d * tl.load(A + i_h).to(tl.float32))

    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m = m_p[:, None] & m_n[None, :]
    p_s = state + slot * stride_ss + i_h * stride_sh + o_p[:, None] * stride_sp + o_n[None, :] * stride_sn
    s = tl.load(p_s, mask=m, other=0.0).to(tl.float32)
    xv = tl.load(x + i_b * stride_xb + i_h * stride_xh + o_p * stride_xp, mask=m_p, other=0.0).to(tl.float32)
    bv = tl.load(B + i_b * stride_bb + i_g * stride_bg + o_n * stride_bn, mask=m_n, other=0.0).to(tl.float32)
    cv = tl.load(C + i_b * stride_cb + i_g * stride_cg + o_n * stride_cn, mask=m_n, other=0.0).to(tl.float32)

    s = s * decay + (d * xv)[:, None] * bv[None, :]
    tl.store(p_s, s.to(state.dtype.element_ty), mask=m)
    out = tl.sum(s * cv[None, :], axis=1) + tl.load(D + i_h).to(tl.float32) * xv
    tl.store(y + i_bh * P + o_p, out.to(y.dtype.element_ty), mask=m_p)


def _block_p(Bs: int, H: int, P: int, N: int, device: torch.device) -> int:
    """P rows per program: 16 (8 KB of fp32 state at N=128) when that fills the chip several times over, else fewer,
    so that a small batch still spreads over every multiprocessor."""
    want = 4 * common.sm_count(device)
    bp = min(16, common.next_power_of_2(P))
    while bp > 4 and Bs * H * common.cdiv(P, bp) < want:
        bp //= 2
    return bp


def launch(
    x, dt, B, C, state, state_indices, A, D, dt_bias, dt_limit, block_p: int | None = None, num_warps: int | None = None
) -> torch.Tensor:
    """`fused_recurrent_mamba2` with the block shape open (for the device check's sweep)."""
    Bs, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G or tuple(state.shape[1:]) != (H, P, N) or dt.shape != (Bs, H) or C.shape != B.shape:
        raise ValueError(f"shapes: x {tuple(x.shape)} dt {tuple(dt.shape)} B {tuple(B.shape)} C {tuple(C.shape)} "
                         f"state {tuple(state.shape)}")
    y = common.output_buffer((Bs, H, P), x.dtype, x.device)
    if Bs == 0:
        return y
    BN = max(16, common.next_power_of_2(N))
    BP = block_p or _block_p(Bs, H, P, N, x.device)
    if num_warps is None:
        num_warps = 4 if BP * BN >= 2048 else 2
    lo, hi = (float(dt_limit[0]), float(dt_limit[1])) if dt_limit is not None else (0.0, 0.0)
    launch_kernel(_ssd_step_kernel, (Bs * H * common.cdiv(P, BP),),
        x, dt, B, C, state, state_indices, A, D, dt_bias, y,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), lo, hi,
        H=H, HG=H // G, P=P, N=N, BP=BP, BN=BN, HAS_LIMIT=dt_limit is not None, num_warps=num_warps,
    )
    return y


def fused_recurrent_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.mamba2.fused_recurrent_mamba2` (same arguments and result; see its docstring).

    x may have any strides. No host sync and no allocation that depends on values: graph-capturable.
    """
    return launch(x, dt, B, C, state, state_indices, A, D, dt_bias, dt_limit)
