"""Triton Gated DeltaNet decode step: one kernel, each session's state updated in place in its pool, addressed by slot.

One program per (session, head, block of BV value columns), on a flat grid with the column blocks fastest, so that
neighbouring programs stream one contiguous `[D, Dv]` state. A program loads its `[D, BV]` fp32 block of the state
once, and in registers decays it, forms the delta rule's write u = beta (v - S^T k) for its columns (each column of u
needs only the whole key and that column of S, so the blocks are independent), adds k u^T, stores the block back to
the same pool row and emits o = scale S^T q for its columns. The state is read once and written once, the op's memory
floor; the arithmetic (three D x BV multiply-adds and two reductions over D) hides under the loads once enough
programs are in flight. At D = Dv = 128 a program holds a `[128, 32]` block (16 KB), at 2 warps (measured faster
than 4); small batches take BV = 16 to spread over every multiprocessor. No host sync, no value-dependent allocation:
graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel


@triton.jit
def _gdn_step_kernel(
    q,
    k,
    v,
    g,
    beta,
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
    stride_bb,
    stride_bh,
    stride_ss,
    stride_sh,
    stride_sr,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BD: tl.constexpr,
    BV: tl.constexpr,
):
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_bh, i_v = tl.program_id(0) // NV, tl.program_id(0) % NV
    i_b, i_h = i_bh // H, i_bh % H
    slot = tl.load(state_indices + i_b).to(tl.int64)  # int64: slot times the row stride passes 2^31 in a big pool

    r = tl.arange(0, BD)  # the key dimension (rows of S)
    c = i_v * BV + tl.arange(0, BV)  # this program's value columns
    m_r = r < D
    m_c = c < DV
    m = m_r[:, None] & m_c[None, :]
    p_s = s + slot * stride_ss + i_h * stride_sh + r[:, None] * stride_sr + c[None, :]
    st = tl.load(p_s, mask=m, other=0.0).to(tl.float32)  # issued first: everything else waits on it anyway

    kv = tl.load(k + i_b * stride_kb + i_h * stride_kh + r, mask=m_r, other=0.0).to(tl.float32)
    qv = tl.load(q + i_b * stride_qb + i_h * stride_qh + r, mask=m_r, other=0.0).to(tl.float32)
    vv = tl.load(v + i_b * stride_vb + i_h * stride_vh + c, mask=m_c, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g + i_b * stride_gb + i_h * stride_gh).to(tl.float32))
    b = tl.load(beta + i_b * stride_bb + i_h * stride_bh).to(tl.float32)

    st = st * decay
    u = b * (vv - tl.sum(st * kv[:, None], axis=0))  # [BV]: what the decayed state does not yet predict
    st = st + kv[:, None] * u[None, :]
    tl.store(p_s, st.to(s.dtype.element_ty), mask=m)
    out = scale * tl.sum(st * qv[:, None], axis=0)
    tl.store(o + i_bh.to(tl.int64) * DV + c, out.to(o.dtype.element_ty), mask=m_c)


def check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> None:
    """Both GDN kernels' argument check: q, k `[N, H, D]`, v `[N, H, Dv]`, g, beta `[N, H]` (N tokens or sessions),
    an fp32 pool `[S, H, D, Dv]`, last dimensions contiguous. Raises ValueError."""
    N, H, D = q.shape
    Dv = v.shape[-1]
    ok = (
        k.shape == q.shape
        and v.shape[:2] == (N, H)
        and g.shape == (N, H)
        and beta.shape == (N, H)
        and state.dim() == 4
        and tuple(state.shape[1:]) == (H, D, Dv)
        and state.dtype == torch.float32
        and state.stride(-1) == 1
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    )
    if not ok:
        raise ValueError(
            f"shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} beta "
            f"{tuple(beta.shape)} state {tuple(state.shape)} {state.dtype} (an fp32 pool; the last dimension of q, k, "
            "v and the pool contiguous)"
        )


def _block_v(B: int, H: int, Dv: int, device: torch.device) -> int:
    """Value columns per program: 32 (a 16 KB block of fp32 state at D=128) when that fills the chip several times
    over, else fewer, so that a small batch still spreads over every multiprocessor."""
    want = 4 * common.sm_count(device)
    bv = min(32, max(16, common.next_power_of_2(Dv)))
    while bv > 16 and B * H * common.cdiv(Dv, bv) < want:
        bv //= 2
    return bv


def launch(
    q, k, v, g, beta, state, state_indices, scale, block_v: int | None = None, num_warps: int | None = None
) -> torch.Tensor:  # fmt: skip
    """`fused_recurrent_gdn` with the block shape open (for the device sweep)."""
    check_shapes(q, k, v, g, beta, state)
    B, H, D = q.shape
    Dv = v.shape[-1]
    out = common.output_buffer((B, H, Dv), q.dtype, q.device)
    if B == 0:
        return out
    BD = max(16, common.next_power_of_2(D))
    BV = min(max(16, common.next_power_of_2(Dv)), block_v or _block_v(B, H, Dv, q.device))
    if num_warps is None:
        # 2 warps up to a [128, 32] block: the H200 sweep (docs/bench/gdn/) puts BV = 32 at 2 warps at 1.16x the floor
        # at B = 256 against 1.24x at 4, and ahead at B = 64 too; wider blocks want 4.
        num_warps = 2 if BD * BV <= 4096 else 4
    launch_kernel(_gdn_step_kernel, (B * H * common.cdiv(Dv, BV),),
        q, k, v, g, beta, state, state_indices, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), state.stride(0), state.stride(1), state.stride(2), float(scale),
        H=H, D=D, DV=Dv, BD=BD, BV=BV, num_warps=num_warps,
    )  # fmt: skip
    return out


def fused_recurrent_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton `kvfree.kernels.gdn.fused_recurrent_gdn` (same arguments and result; see its docstring).

    q, k, v may have any strides but a contiguous last dimension. No host sync: graph-capturable.
    """
    return launch(q, k, v, g, beta, state, state_indices, scale)
