"""Triton Lattice recurrence: one kernel walks each (sequence, head) through its tokens with the state on chip.

The update (kernels/lattice/reference.py, spec §4.2) of one token, per head, on S `[d, m]` with unit columns:

    dec: h = S k - v, c = -gamma k        enc: h = v, c = -gamma (S^T v - k)        sim: h = v, c = gamma k
    b = S^T h;  f = mu - c * b;  S~ = S diag(f) + h c^T;  S = S~ / ||S~ columns||;  y = S q

It is not associative (the column normalisation), so there is no chunked form: prefill is the exact token loop.
The "dec" variant also couples every slot of a head through h = S k - v, and every row through b = S^T h and the
column norms, so the whole `[d, m]` state of a head lives in one program: at d = m = 64 that is 16 KB of fp32 in
registers (32 per thread at 4 warps). The program loads S from its pool row once, runs all of its sequence's
tokens (each step ~6 d m flops and four reductions on chip, the next token's inputs loaded while the current one
computes), and writes S back once. Decode is the same kernel with one token per session.

Per token the work is latency-bound (a chain of dependent reductions); throughput comes from many (sequence, head)
programs in flight. No host sync, no value-dependent allocation: graph-capturable.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from .reference import _NORM_FLOOR, VARIANTS

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _token_inputs(q, k, v, gamma, mu, t, bos, i_h, slot, cm, cd, m_m, m_d, valid, stride_qt, stride_qh, stride_kt,
                  stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_ut, stride_uh, tail, wq, bq, wk, bk,
                  stride_cs, stride_cr, mu_min, H: tl.constexpr, M: tl.constexpr, K: tl.constexpr,
                  HAS_MU: tl.constexpr, GATED: tl.constexpr, QK_L2: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Token t's q, k `[BM]`, v `[BD]`, gamma and mu, fp32 (zeros and a no-op step when not `valid`).

    GATED: q and k are the layer's two short convs of its projection p (here `q`, `[T, H*M]`), each tap read from p
    at positions >= bos or from the session's conv tail before them, L2-normalised when QK_L2; gamma and mu come
    from the raw step logits (here `gamma`, `[T, H]` or `[T, 2H]`): gamma = sigmoid(s_h), mu = max(sigmoid(s_{H+h}),
    mu_min), folded into gamma / mu (the same recurrence as (gamma, mu), spec §4.4), so mu is 1.
    """
    t = t.to(tl.int64)
    vv = tl.load(v + t * stride_vt + i_h * stride_vh + cd, mask=m_d & valid, other=0.0).to(tl.float32)
    if GATED:
        ch = i_h * M + cm
        qv = tl.zeros_like(cm).to(tl.float32)
        kv = tl.zeros_like(cm).to(tl.float32)
        if HAS_BIAS:
            qv += tl.load(bq + ch, mask=m_m, other=0.0).to(tl.float32)
            kv += tl.load(bk + ch, mask=m_m, other=0.0).to(tl.float32)
        for j in tl.static_range(K):  # tap j multiplies the input K-1-j tokens back
            tp = t - (K - 1) + j
            xp = tl.load(q + tp * stride_qt + ch, mask=m_m & valid & (tp >= bos), other=0.0).to(tl.float32)
            xt = tl.load(tail + slot * stride_cs + (tp - bos + K - 1) * stride_cr + ch, mask=m_m & valid & (tp < bos),
                         other=0.0).to(tl.float32)  # fmt: skip
            x = xp + xt  # one of the two loads is masked to 0
            qv += tl.load(wq + ch * K + j, mask=m_m, other=0.0).to(tl.float32) * x
            kv += tl.load(wk + ch * K + j, mask=m_m, other=0.0).to(tl.float32) * x
        if QK_L2:  # F.normalize(eps=1e-6): x / max(||x||, 1e-6)
            qv = qv / tl.maximum(tl.sqrt(tl.sum(qv * qv, axis=0)), 1e-6)
            kv = kv / tl.maximum(tl.sqrt(tl.sum(kv * kv, axis=0)), 1e-6)
        gv = tl.sigmoid(tl.load(gamma + t * stride_gt + i_h, mask=valid, other=0.0).to(tl.float32))
        if HAS_MU:
            mv = tl.sigmoid(tl.load(gamma + t * stride_gt + H + i_h, mask=valid, other=0.0).to(tl.float32))
            gv = gv / tl.maximum(mv, mu_min)
        uv = 1.0
    else:
        qv = tl.load(q + t * stride_qt + i_h * stride_qh + cm, mask=m_m & valid, other=0.0).to(tl.float32)
        kv = tl.load(k + t * stride_kt + i_h * stride_kh + cm, mask=m_m & valid, other=0.0).to(tl.float32)
        gv = tl.load(gamma + t * stride_gt + i_h * stride_gh, mask=valid, other=0.0).to(tl.float32)
        uv = tl.load(mu + t * stride_ut + i_h * stride_uh, mask=valid, other=1.0).to(tl.float32) if HAS_MU else 1.0
    return qv, kv, vv, gv, uv


@triton.jit
def _lattice_update(st, qv, kv, vv, gv, uv, VARIANT: tl.constexpr, NORM_FLOOR_SQ: tl.constexpr):
    """One token on the state tile st `[BD, BM]` (rows: d, columns: slots) -> (new tile, y = S q `[BD]`).

    Padding rows and columns are zero and stay zero (their h, c and norms are zero; the norm floor keeps 0 / 0 out).
    """
    if VARIANT == 0:  # dec
        h = tl.sum(st * kv[None, :], axis=1) - vv
        c = -gv * kv
        b = tl.sum(st * h[:, None], axis=0)
    else:  # enc, sim: h = v
        h = vv
        b = tl.sum(st * h[:, None], axis=0)
        c = -gv * (b - kv) if VARIANT == 1 else gv * kv  # enc: -gamma (S^T v - k); sim: gamma k
    f = uv - c * b
    st = st * f[None, :] + h[:, None] * c[None, :]
    norm_sq = tl.maximum(tl.sum(st * st, axis=0), NORM_FLOOR_SQ)
    st = st * (1.0 / tl.sqrt(norm_sq))[None, :]
    return st, tl.sum(st * qv[None, :], axis=1)


@triton.jit
def _lattice_token(st, t, bos, eos, y, i_h, slot, cm, cd, m_m, m_d, qv, kv, vv, gv, uv, q, k, v, gamma, mu,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_ut,
                   stride_uh, stride_yt, stride_yh, tail, wq, bq, wk, bk, stride_cs, stride_cr, mu_min,
                   H: tl.constexpr, M: tl.constexpr, K: tl.constexpr, HAS_MU: tl.constexpr, GATED: tl.constexpr,
                   QK_L2: tl.constexpr, HAS_BIAS: tl.constexpr, VARIANT: tl.constexpr,
                   NORM_FLOOR_SQ: tl.constexpr):  # fmt: skip
    """Token t (inputs already loaded): load token t + 1's inputs, update, store y_t. Returns the tile and t + 1's
    inputs; the loads are issued first so that their latency hides behind this token's reductions."""
    nq, nk, nv, ng, nu = _token_inputs(q, k, v, gamma, mu, t + 1, bos, i_h, slot, cm, cd, m_m, m_d, t + 1 < eos,
                                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                                       stride_gh, stride_ut, stride_uh, tail, wq, bq, wk, bk, stride_cs, stride_cr,
                                       mu_min, H, M, K, HAS_MU, GATED, QK_L2, HAS_BIAS)  # fmt: skip
    st, yv = _lattice_update(st, qv, kv, vv, gv, uv, VARIANT, NORM_FLOOR_SQ)
    tl.store(y + t.to(tl.int64) * stride_yt + i_h * stride_yh + cd, yv, mask=m_d)
    return st, nq, nk, nv, ng, nu


@triton.jit
def _lattice_scan_kernel(
    q,
    k,
    v,
    gamma,
    mu,
    state,
    state_indices,
    cu_seqlens,
    y,
    tail,
    wq,
    bq,
    wk,
    bk,
    mu_min,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_ut,
    stride_uh,
    stride_yt,
    stride_yh,
    stride_ss,
    stride_sh,
    stride_sd,
    stride_cs,
    stride_cr,
    H: tl.constexpr,
    D: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    VARIANT: tl.constexpr,
    HAS_MU: tl.constexpr,
    GATED: tl.constexpr,
    QK_L2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    VARLEN: tl.constexpr,
    NORM_FLOOR_SQ: tl.constexpr,
    INTERP: tl.constexpr,
):
    """Program (sequence n, head h): tokens [bos, eos) of the packed axis from S in pool row state_indices[n].

    VARLEN: the bounds come from cu_seqlens; otherwise sequence n is token n alone (decode). GATED: see
    `_token_inputs`; the program also owns its head's channels of the session's conv tail and advances them.
    """
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64)
        eos = bos + 1
    if eos > bos:  # an empty sequence keeps its state: nothing to load or store
        slot = tl.load(state_indices + i_n).to(tl.int64)
        cd = tl.arange(0, BD)
        cm = tl.arange(0, BM)
        m_d = cd < D
        m_m = cm < M
        p_s = state + slot * stride_ss + i_h * stride_sh + cd[:, None] * stride_sd + cm[None, :]
        m_s = m_d[:, None] & m_m[None, :]
        st = tl.load(p_s, mask=m_s, other=0.0)
        qv, kv, vv, gv, uv = _token_inputs(q, k, v, gamma, mu, bos, bos, i_h, slot, cm, cd, m_m, m_d, bos < eos,
                                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                           stride_gt, stride_gh, stride_ut, stride_uh, tail, wq, bq, wk, bk,
                                           stride_cs, stride_cr, mu_min, H, M, K, HAS_MU, GATED, QK_L2,
                                           HAS_BIAS)  # fmt: skip
        if INTERP:  # the interpreter (triton 3.6, numpy >= 2.4) cannot take range() of a loaded scalar
            t = bos
            while t < eos:
                st, qv, kv, vv, gv, uv = _lattice_token(
                    st, t, bos, eos, y, i_h, slot, cm, cd, m_m, m_d, qv, kv, vv, gv, uv, q, k, v, gamma, mu,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                    stride_ut, stride_uh, stride_yt, stride_yh, tail, wq, bq, wk, bk, stride_cs, stride_cr, mu_min,
                    H, M, K, HAS_MU, GATED, QK_L2, HAS_BIAS, VARIANT, NORM_FLOOR_SQ,
                )  # fmt: skip
                t += 1
        else:
            for t in range(bos, eos):
                st, qv, kv, vv, gv, uv = _lattice_token(
                    st, t, bos, eos, y, i_h, slot, cm, cd, m_m, m_d, qv, kv, vv, gv, uv, q, k, v, gamma, mu,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                    stride_ut, stride_uh, stride_yt, stride_yh, tail, wq, bq, wk, bk, stride_cs, stride_cr, mu_min,
                    H, M, K, HAS_MU, GATED, QK_L2, HAS_BIAS, VARIANT, NORM_FLOOR_SQ,
                )  # fmt: skip
        tl.store(p_s, st, mask=m_s)
        if GATED and K > 1:
            # The new tail: the last K-1 inputs, from p where they are this call's tokens, else from the old tail
            # (a sequence shorter than K-1). All are loaded before any is stored: row i takes old row i + (eos - bos).
            r = tl.arange(0, BK)
            tp = eos - (K - 1) + r
            ch = i_h * M + cm
            m_r = (r < K - 1)[:, None] & m_m[None, :]
            from_p = tl.load(q + tp[:, None] * stride_qt + ch[None, :], mask=m_r & (tp >= bos)[:, None], other=0.0)
            p_tail = tail + slot * stride_cs + ch[None, :]
            old = tl.load(p_tail + (tp - bos + K - 1)[:, None] * stride_cr, mask=m_r & (tp < bos)[:, None], other=0.0)
            new = from_p.to(tail.dtype.element_ty) + old
            tl.debug_barrier()
            tl.store(p_tail + r[:, None] * stride_cr, new, mask=m_r)


def check_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: torch.Tensor, mu: torch.Tensor | None,
    state: torch.Tensor, variant: str,
) -> None:
    """Both Lattice ops' argument check: q, k `[N, H, m]`, v `[N, H, d]`, gamma (and mu) `[N, H]` (N tokens or
    sessions), an fp32 pool `[S, H, d, m]`, last dimensions contiguous. Raises ValueError."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Lattice variant {variant!r}; known: {VARIANTS}")
    N, H, m = q.shape
    ok = (
        k.shape == q.shape
        and v.shape[:2] == (N, H)
        and gamma.shape == (N, H)
        and (mu is None or mu.shape == (N, H))
        and tuple(state.shape[1:]) == (H, v.shape[-1], m)
        and state.dtype == torch.float32
        and state.stride(-1) == 1
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    )
    if not ok:
        raise ValueError(
            f"shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} gamma {tuple(gamma.shape)} mu "
            f"{None if mu is None else tuple(mu.shape)} state {tuple(state.shape)} {state.dtype} (an fp32 pool "
            "[S, H, d, m]; the last dimension of q, k, v and the pool contiguous)"
        )


def check_gated_shapes(
    p: torch.Tensor, v: torch.Tensor, step: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
    conv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None], variant: str,
) -> None:
    """The gated ops' argument check: p `[N, H*m]`, v `[N, H, d]`, step `[N, H]` or `[N, 2H]`, a conv tail pool
    `[S, K-1, H*m]`, conv weights `[H*m, K]` (biases `[H*m]` or None) and an fp32 pool `[S, H, d, m]`, last
    dimensions contiguous. Raises ValueError."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Lattice variant {variant!r}; known: {VARIANTS}")
    N, H, d = v.shape
    m = state.shape[-1]
    wq, bq, wk, bk = conv
    K = wq.shape[-1]
    ok = (
        p.shape == (N, H * m)
        and step.shape in ((N, H), (N, 2 * H))
        and tuple(state.shape[1:]) == (H, d, m)
        and state.dtype == torch.float32
        and tuple(conv_state.shape[1:]) == (K - 1, H * m)
        and wq.shape == wk.shape == (H * m, K)
        and wq.is_contiguous() and wk.is_contiguous()
        and all(b is None or (b.shape == (H * m,) and b.is_contiguous()) for b in (bq, bk))
        and state.stride(-1) == conv_state.stride(-1) == 1
        and p.stride(-1) == v.stride(-1) == step.stride(-1) == 1
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"shapes: p {tuple(p.shape)} v {tuple(v.shape)} step {tuple(step.shape)} conv_state "
            f"{tuple(conv_state.shape)} conv weights {tuple(wq.shape)} {tuple(wk.shape)} state {tuple(state.shape)} "
            f"{state.dtype} (p [N, H*m], step [N, H or 2H], tails [S, K-1, H*m], an fp32 pool [S, H, d, m]; last "
            "dimensions contiguous)"
        )


def _launch(q, k, v, gamma, mu, state, state_indices, cu_seqlens, nseq, variant, num_warps, m, conv=None,
            qk_l2=False, mu_min=1.0) -> torch.Tensor:  # fmt: skip
    """Launch the kernel over `nseq` sequences (packed by `cu_seqlens`, or one token each when it is None); `conv`:
    None, or (tail pool, wq, bq, wk, bk) for the gated form, where q is the projection p. Returns y fp32."""
    N, H = v.shape[:2]
    d = v.shape[-1]
    y = common.output_buffer((N, H, d), torch.float32, v.device)
    if N == 0 or nseq == 0:
        return y
    BD = max(16, triton.next_power_of_2(d))
    BM = max(16, triton.next_power_of_2(m))
    gated = conv is not None
    tail, wq, bq, wk, bk = conv if gated else (state, state, None, state, None)  # unread when not gated
    K = wq.shape[1] if gated else 1
    has_mu = gamma.shape[1] == 2 * H if gated else mu is not None
    mu_arg = gamma if mu is None else mu  # never read when HAS_MU is False or in the gated form
    # 4 warps hold a 64 x 64 tile in 32 registers per thread (the H100 sweep: 2 and 8 warps are slower).
    warps = num_warps or (4 if BD * BM <= 64 * 64 else 8)
    _lattice_scan_kernel[(nseq, H)](
        q, k, v, gamma, mu_arg, state, state_indices, cu_seqlens if cu_seqlens is not None else state_indices, y,
        tail, wq, bq if bq is not None else wq, wk, bk if bk is not None else wk, float(mu_min),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), gamma.stride(0),
        gamma.stride(1), mu_arg.stride(0), mu_arg.stride(1), y.stride(0), y.stride(1),
        state.stride(0), state.stride(1), state.stride(2), tail.stride(0), tail.stride(1),
        H=H, D=d, M=m, K=K, BD=BD, BM=BM, BK=max(2, triton.next_power_of_2(max(K - 1, 1))),
        VARIANT=VARIANTS.index(variant), HAS_MU=has_mu, GATED=gated, QK_L2=bool(qk_l2),
        HAS_BIAS=gated and bq is not None, VARLEN=cu_seqlens is not None, NORM_FLOOR_SQ=_NORM_FLOOR**2,
        INTERP=INTERPRET, num_warps=warps,
    )  # fmt: skip
    return y


def scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    nseq: int,
    variant: str,
    num_warps: int | None = None,
) -> torch.Tensor:
    """The kernel on explicit q, k, v, gamma, mu over `nseq` sequences (packed by `cu_seqlens`, or one token each
    when it is None) -> y `[N, H, d]` fp32. `num_warps` is open for the device sweep."""
    check_shapes(q, k, v, gamma, mu, state, variant)
    return _launch(q, k, v, gamma, mu, state, state_indices, cu_seqlens, nseq, variant, num_warps, q.shape[-1])


def scan_gated(
    p: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    nseq: int,
    conv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None],
    variant: str,
    qk_l2: bool,
    mu_min: float,
    num_warps: int | None = None,
) -> torch.Tensor:
    """The kernel in its gated form (the layer's convs, L2 norm and gates inside it; see `chunk_lattice_gated` in
    kernels/lattice/reference.py for the arguments) -> y `[N, H, d]` fp32."""
    check_gated_shapes(p, v, step, conv_state, state, conv, variant)
    m = state.shape[-1]
    return _launch(p, p, v, step, None, state, state_indices, cu_seqlens, nseq, variant, num_warps, m,
                   (conv_state, *conv), qk_l2, mu_min)  # fmt: skip


def fused_recurrent_lattice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    variant: str = "dec",
) -> torch.Tensor:
    """Triton `kvfree.kernels.lattice.fused_recurrent_lattice` (same arguments and result; see its docstring).

    q, k, v may have any strides but a contiguous last dimension. No host sync: graph-capturable.
    """
    return scan(q, k, v, gamma, mu, state, state_indices, None, q.shape[0], variant)


def fused_recurrent_lattice_gated(
    p: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    q_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    variant: str = "dec",
    qk_l2: bool = True,
    mu_min: float = 1e-4,
) -> torch.Tensor:
    """Triton `kvfree.kernels.lattice.fused_recurrent_lattice_gated` (same arguments and result; see its docstring).

    No host sync: graph-capturable.
    """
    conv = (q_weight, q_bias, k_weight, k_bias)
    return scan_gated(p, v, step, conv_state, state, state_indices, None, v.shape[0], conv, variant, qk_l2, mu_min)
