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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel
from ..masks import block_mask
from .reference import _NORM_FLOOR, VARIANTS

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _gelu_tanh(x):
    """GELU, tanh approximation (the layer's post-gate); tanh(u) = 2 sigmoid(2u) - 1."""
    return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


@triton.jit
def _conv_qk_gates(p, step, tail, wq, bq, wk, bk, t, bos, i_h, slot, cm, m_m, valid, stride_pt, stride_st, stride_cs,
                   stride_cr, mu_min, H: tl.constexpr, M: tl.constexpr, K: tl.constexpr, HAS_MU: tl.constexpr,
                   QK_L2: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """Token t's q, k `[BM]` and folded gamma (fp32) from the layer's projections: the two short convs of p
    (`[T, H*M]`; each tap read from p at positions >= bos, from the session's conv tail before them), L2-normalised
    when QK_L2; gamma = sigmoid(s_h) / max(sigmoid(s_{H+h}), mu_min) from the step logits (`[T, H]` or `[T, 2H]`),
    which is the recurrence of (gamma, mu) with mu = 1 (spec §4.4). Zeros where not `valid`."""
    ch = i_h * M + cm
    qv = tl.zeros_like(cm).to(tl.float32)
    kv = tl.zeros_like(cm).to(tl.float32)
    if HAS_BIAS:
        qv += tl.load(bq + ch, mask=m_m, other=0.0).to(tl.float32)
        kv += tl.load(bk + ch, mask=m_m, other=0.0).to(tl.float32)
    m_v = m_m & block_mask(valid, cm)
    for j in tl.static_range(K):  # tap j multiplies the input K-1-j tokens back
        tp = t - (K - 1) + j
        xp = tl.load(p + tp * stride_pt + ch, mask=m_v & block_mask(tp >= bos, cm), other=0.0).to(tl.float32)
        xt = tl.load(tail + slot * stride_cs + (tp - bos + K - 1) * stride_cr + ch,
                     mask=m_v & block_mask(tp < bos, cm), other=0.0).to(tl.float32)  # fmt: skip
        x = xp + xt  # one of the two loads is masked to 0
        qv += tl.load(wq + ch * K + j, mask=m_m, other=0.0).to(tl.float32) * x
        kv += tl.load(wk + ch * K + j, mask=m_m, other=0.0).to(tl.float32) * x
    if QK_L2:  # F.normalize(eps=1e-6): x / max(||x||, 1e-6)
        qv = qv / tl.maximum(tl.sqrt(tl.sum(qv * qv, axis=0)), 1e-6)
        kv = kv / tl.maximum(tl.sqrt(tl.sum(kv * kv, axis=0)), 1e-6)
    gv = tl.sigmoid(tl.load(step + t * stride_st + i_h, mask=valid, other=0.0).to(tl.float32))
    if HAS_MU:
        gv = gv / tl.maximum(tl.sigmoid(tl.load(step + t * stride_st + H + i_h, mask=valid, other=0.0).to(tl.float32)),
                             mu_min)  # fmt: skip
    return qv, kv, gv


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
def _token_inputs(q, k, v, gamma, mu, p, step, tail, wq, bq, wk, bk, t, bos, valid, i_h, slot, cm, cd, m_m, m_d,
                  mu_min, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh,
                  stride_ut, stride_uh, stride_pt, stride_st, stride_cs, stride_cr, H: tl.constexpr,
                  M: tl.constexpr, K: tl.constexpr, HAS_MU: tl.constexpr, GATED: tl.constexpr, QK_L2: tl.constexpr,
                  HAS_BIAS: tl.constexpr):  # fmt: skip
    """Token t's q, k `[BM]`, v `[BD]`, gamma and mu, fp32: as given, or GATED from the projections
    (`_conv_qk_gates`, mu = 1). Zeros and a no-op step where not `valid`."""
    if GATED:
        qv, kv, gv = _conv_qk_gates(p, step, tail, wq, bq, wk, bk, t, bos, i_h, slot, cm, m_m, valid, stride_pt,
                                    stride_st, stride_cs, stride_cr, mu_min, H, M, K, HAS_MU, QK_L2,
                                    HAS_BIAS)  # fmt: skip
        uv = 1.0
    else:
        m_v = m_m & block_mask(valid, cm)
        qv = tl.load(q + t * stride_qt + i_h * stride_qh + cm, mask=m_v, other=0.0).to(tl.float32)
        kv = tl.load(k + t * stride_kt + i_h * stride_kh + cm, mask=m_v, other=0.0).to(tl.float32)
        gv = tl.load(gamma + t * stride_gt + i_h * stride_gh, mask=valid, other=0.0).to(tl.float32)
        uv = tl.load(mu + t * stride_ut + i_h * stride_uh, mask=valid, other=1.0).to(tl.float32) if HAS_MU else 1.0
    vv = tl.load(v + t * stride_vt + i_h * stride_vh + cd, mask=m_d & block_mask(valid, cd), other=0.0).to(tl.float32)
    return qv, kv, vv, gv, uv


@triton.jit
def _scan_step(st, t, bos, eos, qv, kv, vv, gv, uv, wn, i_h, slot, cm, cd, m_m, m_d, q, k, v, gamma, mu, p, step, tail,
               wq, bq, wk, bk, gate, y, mu_min, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_gt, stride_gh, stride_ut, stride_uh, stride_pt, stride_st, stride_cs, stride_cr, stride_ot,
               H: tl.constexpr, D: tl.constexpr, M: tl.constexpr, K: tl.constexpr, VARIANT: tl.constexpr,
               HAS_MU: tl.constexpr, GATED: tl.constexpr, QK_L2: tl.constexpr, HAS_BIAS: tl.constexpr,
               OUT_GATE: tl.constexpr, NORM_FLOOR_SQ: tl.constexpr):  # fmt: skip
    """Token t of the scan, its inputs (qv, kv, vv, gv, uv) already loaded: load token t + 1's inputs first, so that
    their latency hides behind this token's chain of reductions, update the tile, store the output. Returns the tile
    and t + 1's inputs."""
    tn = t + 1
    nq, nk, nv, ng, nu = _token_inputs(q, k, v, gamma, mu, p, step, tail, wq, bq, wk, bk, tn, bos, tn < eos, i_h, slot,
                                       cm, cd, m_m, m_d, mu_min, stride_qt, stride_qh, stride_kt, stride_kh,
                                       stride_vt, stride_vh, stride_gt, stride_gh, stride_ut, stride_uh, stride_pt,
                                       stride_st, stride_cs, stride_cr, H, M, K, HAS_MU, GATED, QK_L2,
                                       HAS_BIAS)  # fmt: skip
    if OUT_GATE > 0:
        gt = tl.load(gate + t * stride_ot + i_h * D + cd, mask=m_d, other=0.0).to(tl.float32)
    st, yv = _lattice_update(st, qv, kv, vv, gv, uv, VARIANT, NORM_FLOOR_SQ)
    if OUT_GATE == 2:
        yv = yv * (1.0 / tl.sqrt(tl.sum(yv * yv, axis=0) / D + eps)) * wn
    if OUT_GATE > 0:
        yv = _gelu_tanh(gt) * yv
    tl.store(y + t * (H * D) + i_h * D + cd, yv.to(y.dtype.element_ty), mask=m_d)
    return st, nq, nk, nv, ng, nu


@triton.jit
def _lattice_scan_kernel(
    q, k, v, gamma, mu, p, step, tail, wq, bq, wk, bk, gate, norm_w, y, state, state_indices, cu_seqlens, mu_min,
    eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_ut,
    stride_uh, stride_pt, stride_st, stride_cs, stride_cr, stride_ot, stride_ss, stride_sh, stride_sd,
    H: tl.constexpr, D: tl.constexpr, M: tl.constexpr, K: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr,
    BK: tl.constexpr, VARIANT: tl.constexpr, HAS_MU: tl.constexpr, GATED: tl.constexpr, QK_L2: tl.constexpr,
    HAS_BIAS: tl.constexpr, UPDATE_TAIL: tl.constexpr, OUT_GATE: tl.constexpr, VARLEN: tl.constexpr,
    NORM_FLOOR_SQ: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Program (sequence n, head h): tokens [bos, eos) of the packed axis from S in pool row state_indices[n].

    VARLEN: the bounds come from cu_seqlens; otherwise sequence n is token n alone (decode).
    Inputs: q, k `[T, H, M]`, gamma (mu) `[T, H]` as given, or, GATED, computed from the projections by
    `_conv_qk_gates` (mu = 1). UPDATE_TAIL: the program owns its head's channels of the session's conv tail and
    advances it over p. Output (contiguous `[T, H, D]`): OUT_GATE 0: y = S q in fp32; 1: gelu_tanh(gate) * y; 2:
    gelu_tanh(gate) * rms_norm(y) * norm_w over the head, both in y's dtype (the layer's post-gate).
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
        wn = tl.load(norm_w + cd, mask=m_d, other=0.0).to(tl.float32) if OUT_GATE == 2 else 1.0
        t = bos
        qv, kv, vv, gv, uv = _token_inputs(q, k, v, gamma, mu, p, step, tail, wq, bq, wk, bk, t, bos, t < eos, i_h,
                                           slot, cm, cd, m_m, m_d, mu_min, stride_qt, stride_qh, stride_kt, stride_kh,
                                           stride_vt, stride_vh, stride_gt, stride_gh, stride_ut, stride_uh,
                                           stride_pt, stride_st, stride_cs, stride_cr, H, M, K, HAS_MU, GATED, QK_L2,
                                           HAS_BIAS)  # fmt: skip
        if INTERP:  # the interpreter (triton 3.6, numpy >= 2.4) cannot take range() of a loaded scalar
            while t < eos:
                st, qv, kv, vv, gv, uv = _scan_step(
                    st, t, bos, eos, qv, kv, vv, gv, uv, wn, i_h, slot, cm, cd, m_m, m_d, q, k, v, gamma, mu, p, step,
                    tail, wq, bq, wk, bk, gate, y, mu_min, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                    stride_vh, stride_gt, stride_gh, stride_ut, stride_uh, stride_pt, stride_st, stride_cs, stride_cr,
                    stride_ot, H, D, M, K, VARIANT, HAS_MU, GATED, QK_L2, HAS_BIAS, OUT_GATE, NORM_FLOOR_SQ,
                )  # fmt: skip
                t += 1
        else:  # a `for` loop: the same body under `while` compiled 20% slower on an H100
            for t in range(bos, eos):
                st, qv, kv, vv, gv, uv = _scan_step(
                    st, t, bos, eos, qv, kv, vv, gv, uv, wn, i_h, slot, cm, cd, m_m, m_d, q, k, v, gamma, mu, p, step,
                    tail, wq, bq, wk, bk, gate, y, mu_min, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                    stride_vh, stride_gt, stride_gh, stride_ut, stride_uh, stride_pt, stride_st, stride_cs, stride_cr,
                    stride_ot, H, D, M, K, VARIANT, HAS_MU, GATED, QK_L2, HAS_BIAS, OUT_GATE, NORM_FLOOR_SQ,
                )  # fmt: skip
        tl.store(p_s, st, mask=m_s)
        if UPDATE_TAIL:
            # The new tail: the last K-1 inputs, from p where they are this call's tokens, else from the old tail
            # (a sequence shorter than K-1). All are loaded before any is stored: row i takes old row i + (eos - bos).
            r = tl.arange(0, BK)
            tp = eos - (K - 1) + r
            ch = i_h * M + cm
            m_r = (r < K - 1)[:, None] & m_m[None, :]
            from_p = tl.load(p + tp[:, None] * stride_pt + ch[None, :], mask=m_r & (tp >= bos)[:, None], other=0.0)
            p_tail = tail + slot * stride_cs + ch[None, :]
            old = tl.load(p_tail + (tp - bos + K - 1)[:, None] * stride_cr, mask=m_r & (tp < bos)[:, None], other=0.0)
            new = from_p.to(tail.dtype.element_ty) + old
            tl.debug_barrier()
            tl.store(p_tail + r[:, None] * stride_cr, new, mask=m_r)


@triton.jit
def _lattice_gates_kernel(
    p, step, tail, wq, bq, wk, bk, q, k, gamma, cu_seqlens, mu_min, stride_pt, stride_st, stride_cs, stride_cr,
    state_indices, H: tl.constexpr, M: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr,
    HAS_MU: tl.constexpr, QK_L2: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Program (sequence n, block of BT tokens, head h): the gated inputs of each token (`_conv_qk_gates`) to q, k
    `[T, H, M]` and gamma `[T, H]` fp32. Prefill runs this token-parallel pass first, so that the sequential scan
    does only the recurrence; it reads the conv tails, which the scan then advances."""
    i_n, i_b, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if bos + i_b * BT < eos:
        slot = tl.load(state_indices + i_n).to(tl.int64)
        cm = tl.arange(0, BM)
        m_m = cm < M
        for i in tl.static_range(BT):
            t = bos + i_b * BT + i
            ok = t < eos
            qv, kv, gv = _conv_qk_gates(p, step, tail, wq, bq, wk, bk, t, bos, i_h, slot, cm, m_m, ok, stride_pt,
                                        stride_st, stride_cs, stride_cr, mu_min, H, M, K, HAS_MU, QK_L2,
                                        HAS_BIAS)  # fmt: skip
            m_ok = m_m & block_mask(ok, cm)
            tl.store(q + (t * H + i_h) * M + cm, qv, mask=m_ok)
            tl.store(k + (t * H + i_h) * M + cm, kv, mask=m_ok)
            tl.store(gamma + t * H + i_h, gv, mask=ok)


@dataclass(frozen=True)
class GatedArgs:
    """The layer-form inputs of the kernel: p `[N, H*m]` (the shared q/k projection), step logits `[N, H or 2H]`,
    the conv tail pool `[S, K-1, H*m]`, conv (q weight, q bias, k weight, k bias), the q/k L2 norm flag, the
    forget-gate clamp, and the optional post-gate: gate `[N, H*d]` and the head RMSNorm's weight `[d]` and eps."""

    p: torch.Tensor
    step: torch.Tensor
    tail: torch.Tensor
    conv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]
    qk_l2: bool
    mu_min: float
    gate: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    eps: float = 1e-5


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


def check_gated_shapes(v: torch.Tensor, state: torch.Tensor, gated: GatedArgs, variant: str) -> None:
    """The gated ops' argument check: v `[N, H, d]`, an fp32 pool `[S, H, d, m]`, p `[N, H*m]`, step `[N, H]` or
    `[N, 2H]`, a conv tail pool `[S, K-1, H*m]`, conv weights `[H*m, K]` (biases `[H*m]` or None), gate `[N, H*d]` and
    norm weight `[d]` (or None); last dimensions contiguous. Raises ValueError."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Lattice variant {variant!r}; known: {VARIANTS}")
    N, H, d = v.shape
    m = state.shape[-1]
    wq, bq, wk, bk = gated.conv
    K = wq.shape[-1]
    gate, w = gated.gate, gated.norm_weight
    ok = (
        gated.p.shape == (N, H * m)
        and gated.step.shape in ((N, H), (N, 2 * H))
        and tuple(state.shape[1:]) == (H, d, m)
        and state.dtype == torch.float32
        and tuple(gated.tail.shape[1:]) == (K - 1, H * m)
        and wq.shape == wk.shape == (H * m, K)
        and wq.is_contiguous() and wk.is_contiguous()
        and all(b is None or (b.shape == (H * m,) and b.is_contiguous()) for b in (bq, bk))
        and (gate is None or (gate.shape == (N, H * d) and gate.stride(-1) == 1))
        and (w is None or (gate is not None and w.shape == (d,) and w.is_contiguous()))
        and state.stride(-1) == gated.tail.stride(-1) == 1
        and gated.p.stride(-1) == v.stride(-1) == gated.step.stride(-1) == 1
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"shapes: p {tuple(gated.p.shape)} v {tuple(v.shape)} step {tuple(gated.step.shape)} conv_state "
            f"{tuple(gated.tail.shape)} conv weights {tuple(wq.shape)} {tuple(wk.shape)} state {tuple(state.shape)} "
            f"{state.dtype} gate {None if gate is None else tuple(gate.shape)} norm weight "
            f"{None if w is None else tuple(w.shape)} (p [N, H*m], step [N, H or 2H], tails [S, K-1, H*m], an fp32 "
            "pool [S, H, d, m], gate [N, H*d], norm weight [d] only with a gate; last dimensions contiguous)"
        )


def tile_blocks(d: int, m: int) -> tuple[int, int, int]:
    """(BD, BM, warps): the state tile and 4 warps for it (32 registers per thread at 64 x 64; in the H100 sweep
    2 warps were 15% slower for prefill and 8 warps 1.6x slower)."""
    BD, BM = max(16, common.next_power_of_2(d)), max(16, common.next_power_of_2(m))
    return BD, BM, 4 if BD * BM <= 64 * 64 else 8


def conv_pointers(gated: GatedArgs) -> tuple[torch.Tensor, ...]:
    """(tail, wq, bq, wk, bk) as kernel arguments: an absent bias (HAS_BIAS is then False) and a K = 1 conv's
    zero-size tail pool are never read, so stand-ins of a valid pointer take their place."""
    wq, bq, wk, bk = gated.conv
    tail = gated.tail if gated.tail.numel() else gated.p
    return tail, wq, wq if bq is None else bq, wk, wk if bk is None else bk


def scan_launch(
    nseq: int, cu_seqlens: torch.Tensor | None, v: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
    variant: str, *, explicit: tuple | None = None, gated: GatedArgs | None = None, gates_inside: bool = False,
    num_warps: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Launch the scan over `nseq` sequences (packed by `cu_seqlens`, or one token each when it is None).

    explicit: the (q, k, gamma, mu) inputs, or None when `gated` computes them inside (`gates_inside`). gated: the
    layer form: its conv tail is advanced over p and, with a gate, the post-gate applied (output `[N, H*d]` in the
    gate's dtype; else y `[N, H, d]` fp32).
    """
    N, H, d = v.shape
    m = state.shape[-1]
    BD, BM, warps = tile_blocks(d, m)
    out_gate = 0 if gated is None or gated.gate is None else (2 if gated.norm_weight is not None else 1)
    y = common.output_buffer((N, H, d), torch.float32 if out_gate == 0 else gated.gate.dtype, v.device)
    if N == 0 or nseq == 0:
        return y if out_gate == 0 else y.view(N, H * d)
    q, k, gamma, mu = explicit if explicit is not None else (v, v, v, None)  # unread when the gates are inside
    mu_arg = gamma if mu is None else mu
    g = gated if gated is not None else GatedArgs(v, v, state, (v, None, v, None), False, 1.0)  # unread when None
    wq, bq, _, _ = g.conv
    K = wq.shape[-1] if gated is not None else 1
    gate = g.gate if g.gate is not None else v
    launch_kernel(_lattice_scan_kernel, (nseq, H),
        q, k, v, gamma, mu_arg, g.p, g.step, *conv_pointers(g), gate,
        g.norm_weight if g.norm_weight is not None else v, y, state,
        state_indices, cu_seqlens if cu_seqlens is not None else state_indices, float(g.mu_min), float(g.eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), gamma.stride(0),
        gamma.stride(1), mu_arg.stride(0), mu_arg.stride(1), g.p.stride(0), g.step.stride(0), g.tail.stride(0),
        g.tail.stride(1), gate.stride(0), state.stride(0), state.stride(1), state.stride(2),
        H=H, D=d, M=m, K=K, BD=BD, BM=BM, BK=max(2, common.next_power_of_2(max(K - 1, 1))),
        VARIANT=VARIANTS.index(variant), HAS_MU=(g.step.shape[1] == 2 * H) if gates_inside else mu is not None,
        GATED=gates_inside, QK_L2=bool(g.qk_l2), HAS_BIAS=bq is not None, UPDATE_TAIL=gated is not None and K > 1,
        OUT_GATE=out_gate, VARLEN=cu_seqlens is not None, NORM_FLOOR_SQ=_NORM_FLOOR**2, INTERP=INTERPRET,
        num_warps=num_warps or warps,
    )  # fmt: skip
    return y if out_gate == 0 else y.view(N, H * d)


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
    return scan_launch(nseq, cu_seqlens, v, state, state_indices, variant, explicit=(q, k, gamma, mu),
                        num_warps=num_warps)  # fmt: skip


def gates_pass(
    gated: GatedArgs, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, lens: list[int], H: int, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The token-parallel prefill pass: q, k `[T, H, m]` and gamma `[T, H]` fp32 from the layer's projections (the
    conv tails are read, not advanced: the scan advances them after)."""
    T = gated.p.shape[0]
    dev = gated.p.device
    q = common.output_buffer((T, H, m), torch.float32, dev)
    k = common.output_buffer((T, H, m), torch.float32, dev)
    gamma = common.output_buffer((T, H), torch.float32, dev)
    if T == 0:
        return q, k, gamma
    wq, bq, _, _ = gated.conv
    BT = 16
    launch_kernel(_lattice_gates_kernel, (len(lens), common.cdiv(max(lens), BT), H),
        gated.p, gated.step, *conv_pointers(gated), q, k, gamma, cu_seqlens, float(gated.mu_min), gated.p.stride(0),
        gated.step.stride(0), gated.tail.stride(0), gated.tail.stride(1), state_indices, H=H, M=m, K=wq.shape[-1],
        BM=max(16, common.next_power_of_2(m)), BT=BT, HAS_MU=gated.step.shape[1] == 2 * H, QK_L2=bool(gated.qk_l2),
        HAS_BIAS=bq is not None, num_warps=2,
    )  # fmt: skip
    return q, k, gamma


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
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Triton `kvfree.kernels.lattice.fused_recurrent_lattice_gated` (same arguments and result; see its docstring):
    the convs, q/k norm, gates, recurrence, conv-tail shift and post-gate in one launch. No host sync:
    graph-capturable."""
    gated = GatedArgs(p, step, conv_state, (q_weight, q_bias, k_weight, k_bias), qk_l2, mu_min, gate, norm_weight, eps)
    check_gated_shapes(v, state, gated, variant)
    return scan_launch(v.shape[0], None, v, state, state_indices, variant, gated=gated, gates_inside=True)
