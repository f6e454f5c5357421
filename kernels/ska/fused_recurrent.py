"""Triton SKA decode step: rank-1 statistics updates, the readout, and the chunk-boundary rebuild, all on the device.

Two launches, each one program per (session, head), the state addressed in place by `state_indices`:

- `_ska_rebuild_kernel`: rebuilds J from the session's statistics (`rebuild.build_readout`: Cholesky with the jitter
  fallback, power iteration, the K power-filter products) where that session needs a new operator, decided on the
  device: mode C (docs/design/ska.md §3.3) when the session enters a chunk (pos % S == 0 and pos > 0; every other
  program exits after a few loads), mode P (§3.4) every step. No host branch and no data-dependent shape, so the step
  is graph-capturable (the reference's `bool(enter.any())` is gone).
- `_ska_update_kernel`: the readout y = J q (mode C) and the rank-1 updates G += z z^T, M += z z_prev^T,
  C += v z^T in the accumulator dtype (fp64 or fp32), z_prev, the key max-norm m, pos. G, M, C are each read once
  and written once: the step's memory floor.

Order: mode C rebuilds first (the operator of the tokens before pos), then reads out and updates; mode P updates
first, then rebuilds from the new statistics and reads out in the rebuild kernel.

`pos` is one value per session shared by its H head programs, so only the head-0 program advances it, and no program
of the same launch reads it after that: in mode C the rebuild launch copies each session's pos into a per-call buffer
that the update launch reads (its head 0 then writes pos + 1); in mode P the update launch reads pos (key_norm
"frozen" needs pos == 0) and the rebuild launch, which does not read it otherwise, advances it.

Duplicate slots (a CUDA graph pads its batch with the pool's scratch slot) race only on that slot's row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel
from .rebuild import build_readout, fallback_counter, param, split_eps, tensor_core_products
from .reference import MODES, SKAState


@triton.jit
def _ska_rebuild_kernel(
    G,
    M,
    C,
    J,
    m,
    pos,
    q,
    y,
    state_indices,
    posbuf,
    cu_seqlens,
    counter,
    eta,
    gamma,
    stride_gs,
    stride_gh,
    stride_gr,
    stride_cs,
    stride_ch,
    stride_cr,
    stride_js,
    stride_jh,
    stride_jr,
    stride_ms,
    stride_mh,
    stride_qb,
    stride_qh,
    eps_hi,
    eps_lo,
    H: tl.constexpr,
    r: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    PB: tl.constexpr,
    S: tl.constexpr,
    ORDER: tl.constexpr,
    ITERS: tl.constexpr,
    USE_DOT: tl.constexpr,
    ALWAYS: tl.constexpr,
    READOUT: tl.constexpr,
    SAVE_POS: tl.constexpr,
    ADVANCE_POS: tl.constexpr,
    HAS_CU: tl.constexpr,
):
    """ALWAYS: rebuild every call (mode P); else only where pos % S == 0 and pos > 0 (mode C). READOUT: y = J q.
    SAVE_POS: head 0 copies pos into posbuf (mode C). ADVANCE_POS: head 0 adds 1 to pos (mode P decode).
    HAS_CU: skip sequences of length 0 (`cu_seqlens`; the prefill's mode-P operator build)."""
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    if ALWAYS:
        go = tl.full((), 1, tl.int1)
        if HAS_CU:
            go = tl.load(cu_seqlens + i_b + 1) > tl.load(cu_seqlens + i_b)
    else:
        p = tl.load(pos + slot)
        if SAVE_POS and i_h == 0:
            tl.store(posbuf + i_b, p)
        go = (p % S == 0) & (p > 0)
    if go:
        off_g = slot * stride_gs + i_h * stride_gh
        off_c = slot * stride_cs + i_h * stride_ch
        mv = tl.load(m + slot * stride_ms + i_h * stride_mh)
        Jt = build_readout(G + off_g, M + off_g, C + off_c, stride_gr, stride_gr, stride_cr, mv, eps_hi, eps_lo,
                           tl.load(eta), tl.load(gamma), counter, r, P, R, PB, ORDER, ITERS,
                           USE_DOT).to(tl.float32)  # fmt: skip
        rows = tl.arange(0, PB)
        cols = tl.arange(0, R)
        p_j = J + slot * stride_js + i_h * stride_jh + rows[:, None] * stride_jr + cols[None, :]
        tl.store(p_j, Jt, mask=(rows[:, None] < P) & (cols[None, :] < r))
        if READOUT:
            qv = tl.load(q + i_b * stride_qb + i_h * stride_qh + cols, mask=cols < r, other=0.0).to(tl.float32)
            tl.store(y + (i_b * H + i_h) * P + rows, tl.sum(Jt * qv[None, :], axis=1), mask=rows < P)
    if ADVANCE_POS and i_h == 0:
        tl.store(pos + slot, tl.load(pos + slot) + 1)


@triton.jit
def _ska_update_kernel(
    z,
    q,
    v,
    G,
    M,
    C,
    zp,
    m,
    J,
    pos,
    posbuf,
    state_indices,
    y,
    stride_zb,
    stride_zh,
    stride_qb,
    stride_qh,
    stride_vb,
    stride_vh,
    stride_gs,
    stride_gh,
    stride_gr,
    stride_cs,
    stride_ch,
    stride_cr,
    stride_js,
    stride_jh,
    stride_jr,
    stride_ps,
    stride_ph,
    stride_ms,
    stride_mh,
    H: tl.constexpr,
    r: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    PB: tl.constexpr,
    FROZEN: tl.constexpr,
    READOUT: tl.constexpr,
    POS_FROM_BUF: tl.constexpr,
    ADVANCE_POS: tl.constexpr,
):
    """READOUT: y = J q with the stored J (mode C). POS_FROM_BUF: the session's pos from posbuf, written by the
    rebuild launch (mode C), else from the pool. ADVANCE_POS: head 0 writes pos + 1 (mode C)."""
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    p = tl.load(posbuf + i_b) if POS_FROM_BUF else tl.load(pos + slot)
    rr = tl.arange(0, R)
    pp = tl.arange(0, PB)
    m_r = rr < r
    m_p = pp < P
    zv = tl.load(z + i_b * stride_zb + i_h * stride_zh + rr, mask=m_r, other=0.0).to(tl.float32)
    vv = tl.load(v + i_b * stride_vb + i_h * stride_vh + pp, mask=m_p, other=0.0).to(tl.float32)
    p_zp = zp + slot * stride_ps + i_h * stride_ph + rr
    zpv = tl.load(p_zp, mask=m_r, other=0.0)
    if READOUT:  # y = J q, with J as the rebuild launch left it
        qv = tl.load(q + i_b * stride_qb + i_h * stride_qh + rr, mask=m_r, other=0.0).to(tl.float32)
        p_j = J + slot * stride_js + i_h * stride_jh + pp[:, None] * stride_jr + rr[None, :]
        Jt = tl.load(p_j, mask=m_p[:, None] & m_r[None, :], other=0.0)
        tl.store(y + (i_b * H + i_h) * P + pp, tl.sum(Jt * qv[None, :], axis=1), mask=m_p)

    # Rank-1 updates, one matrix at a time (each read once, written once). Products in the accumulator dtype: in
    # fp64 they are exact for fp32 keys, as the reference's.
    m_rr = m_r[:, None] & m_r[None, :]
    off_g = slot * stride_gs + i_h * stride_gh + rr[:, None] * stride_gr + rr[None, :]
    p_g = G + off_g
    g = tl.load(p_g, mask=m_rr, other=0.0)
    acc = g.dtype
    za = zv.to(acc)
    tl.store(p_g, g + za[:, None] * za[None, :], mask=m_rr)
    p_m = M + off_g
    tl.store(p_m, tl.load(p_m, mask=m_rr, other=0.0) + za[:, None] * zpv.to(acc)[None, :], mask=m_rr)
    m_pr = m_p[:, None] & m_r[None, :]
    p_c = C + slot * stride_cs + i_h * stride_ch + pp[:, None] * stride_cr + rr[None, :]
    tl.store(p_c, tl.load(p_c, mask=m_pr, other=0.0) + vv.to(acc)[:, None] * za[None, :], mask=m_pr)
    tl.store(p_zp, zv, mask=m_r)

    p_m0 = m + slot * stride_ms + i_h * stride_mh
    norm = tl.sqrt(tl.sum(zv * zv, axis=0))
    m0 = tl.load(p_m0)
    if FROZEN:  # the paper's m: the first segment's max, then frozen (a decode token is a segment of its own)
        tl.store(p_m0, tl.where(p == 0, norm, m0))
    else:
        tl.store(p_m0, tl.maximum(m0, norm))
    if ADVANCE_POS and i_h == 0:
        tl.store(pos + slot, p + 1)


def sizes(r: int, P: int) -> tuple[int, int]:
    """The register tile sizes (R, PB): r and P padded to powers of two >= 16 (`tl.dot`'s smallest)."""
    return max(16, common.next_power_of_2(r)), max(16, common.next_power_of_2(P))


def check_state(z: torch.Tensor, v: torch.Tensor, state: SKAState) -> None:
    """Both SKA kernels' argument check: z (and q) `[N, H, r]`, v `[N, H, P]`, pools G, M `[S, H, r, r]`,
    C `[S, H, P, r]` of one accumulator dtype (fp32 or fp64), z_prev `[S, H, r]`, m `[S, H]`, J `[S, H, P, r]` fp32,
    pos `[S]` int64; last dimensions contiguous (G, M, C, z_prev, J). Raises ValueError."""
    N, H, r = z.shape
    P = v.shape[-1]
    G, M, C, zp, m, J, pos = state
    ok = (
        v.shape[:2] == (N, H)
        and tuple(G.shape[1:]) == tuple(M.shape[1:]) == (H, r, r)
        and tuple(C.shape[1:]) == (H, P, r)
        and tuple(zp.shape[1:]) == (H, r)
        and tuple(m.shape[1:]) == (H,)
        and tuple(J.shape[1:]) == (H, P, r)
        and pos.dim() == 1
        and G.dtype == M.dtype == C.dtype
        and G.dtype in (torch.float32, torch.float64)
        and zp.dtype == m.dtype == J.dtype == torch.float32
        and pos.dtype == torch.int64
        and G.stride(-1) == M.stride(-1) == C.stride(-1) == zp.stride(-1) == J.stride(-1) == 1
        and G.stride() == M.stride()
        and z.stride(-1) == v.stride(-1) == 1
        and r <= 128
        and P <= 256
    )
    if not ok:
        raise ValueError(
            f"shapes: z {tuple(z.shape)} v {tuple(v.shape)} pools "
            + ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in zip(SKAState._fields, state, strict=True))
            + " (G, M, C one accumulator dtype, fp32 or fp64, G and M alike; z_prev, m, J fp32; pos int64; last "
            "dimensions contiguous; r <= 128, P <= 256)"
        )


def rebuild_launch(
    state: SKAState, state_indices: torch.Tensor, eps: float, eta: torch.Tensor, gamma: torch.Tensor, order: int,
    power_iters: int, chunk_size: int, *, always: bool, q: torch.Tensor | None = None, y: torch.Tensor | None = None,
    posbuf: torch.Tensor | None = None, advance_pos: bool = False, cu_seqlens: torch.Tensor | None = None,
    use_dot: bool | None = None, num_warps: int | None = None,
) -> None:  # fmt: skip
    """Launch `_ska_rebuild_kernel` over (len(state_indices), H) programs (its flags as keyword arguments; the
    prefill's mode-P build uses it too)."""
    G, M, C, zp, m, J, pos = state
    H, P, r = J.shape[1:]
    R, PB = sizes(r, P)
    eps_hi, eps_lo = split_eps(eps)
    n = state_indices.shape[0]
    if use_dot is None:
        use_dot = tensor_core_products(G.dtype, G.device)
    if num_warps is None:  # R x R fp64 tiles: 8 warps keep the five live ones in registers at R = 64
        num_warps = 8 if R * R * G.element_size() > 16384 else 4
    dummy = state_indices
    launch_kernel(_ska_rebuild_kernel, (n, H),
        G, M, C, J, m, pos, dummy if q is None else q, dummy if y is None else y, state_indices,
        dummy if posbuf is None else posbuf, dummy if cu_seqlens is None else cu_seqlens, fallback_counter(G.device),
        eta, gamma,
        G.stride(0), G.stride(1), G.stride(2), C.stride(0), C.stride(1), C.stride(2), J.stride(0), J.stride(1),
        J.stride(2), m.stride(0), m.stride(1), 0 if q is None else q.stride(0), 0 if q is None else q.stride(1),
        eps_hi, eps_lo,
        H=H, r=r, P=P, R=R, PB=PB, S=int(chunk_size), ORDER=int(order), ITERS=int(power_iters), USE_DOT=bool(use_dot),
        ALWAYS=always, READOUT=y is not None, SAVE_POS=posbuf is not None, ADVANCE_POS=advance_pos,
        HAS_CU=cu_seqlens is not None, num_warps=num_warps,
    )  # fmt: skip


def launch(
    z: torch.Tensor, q: torch.Tensor, v: torch.Tensor, state: SKAState, state_indices: torch.Tensor, chunk_size: int,
    eps: float, eta: torch.Tensor | float, gamma: torch.Tensor | float, order: int, power_iters: int,
    key_norm: str = "causal", mode: str = "C", *, use_dot: bool | None = None, num_warps: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`fused_recurrent_ska` with the rebuild's product path and warps open (for the device sweep)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")
    check_state(z, v, state)
    G, M, C, zp, m, J, pos = state
    B, H, r = z.shape
    P = v.shape[-1]
    R, PB = sizes(r, P)
    dev = z.device
    y = common.output_buffer((B, H, P), torch.float32, dev)
    if B == 0:
        return y
    eta_t, gamma_t = param(eta, G.dtype, dev), param(gamma, G.dtype, dev)
    mode_c = mode == "C"
    posbuf = common.output_buffer((B,), torch.int64, dev) if mode_c else None
    rebuild = dict(eps=eps, eta=eta_t, gamma=gamma_t, order=order, power_iters=power_iters, chunk_size=chunk_size,
                   use_dot=use_dot, num_warps=num_warps)  # fmt: skip
    if mode_c:
        rebuild_launch(state, state_indices, always=False, posbuf=posbuf, **rebuild)
    launch_kernel(_ska_update_kernel, (B, H),
        z, q, v, G, M, C, zp, m, J, pos, state_indices if posbuf is None else posbuf, state_indices, y,
        z.stride(0), z.stride(1), q.stride(0), q.stride(1), v.stride(0), v.stride(1),
        G.stride(0), G.stride(1), G.stride(2), C.stride(0), C.stride(1), C.stride(2), J.stride(0), J.stride(1),
        J.stride(2), zp.stride(0), zp.stride(1), m.stride(0), m.stride(1),
        H=H, r=r, P=P, R=R, PB=PB, FROZEN=key_norm == "frozen", READOUT=mode_c, POS_FROM_BUF=mode_c,
        ADVANCE_POS=mode_c, num_warps=4,
    )  # fmt: skip
    if not mode_c:
        rebuild_launch(state, state_indices, always=True, q=q, y=y, advance_pos=True, **rebuild)
    return y


def fused_recurrent_ska(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    state_indices: torch.Tensor,
    chunk_size: int,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    mode: str = "C",
) -> torch.Tensor:
    """Triton `kvfree.kernels.ska.fused_recurrent_ska` (same arguments and result; see its docstring).

    z, q, v `[B, H, r|P]` (fp32 or bf16/fp16) may have any strides but a contiguous last dimension. eta and gamma may
    be one-element device tensors (the mixer's; never read on the host). No host sync: graph-capturable. Where
    the Cholesky fails even with jitter 1e-2 m^2 the session's J becomes NaN (the reference raises instead).
    """
    return launch(z, q, v, state, state_indices, chunk_size, eps, eta, gamma, order, power_iters, key_norm, mode)
