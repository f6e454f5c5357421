"""Triton Gated DeltaNet chunked prefill (WY form) over packed variable-length sequences, states in place in a pool.

Chunks of L tokens (64 by default) never cross a sequence boundary; a sequence's last chunk may be short, and its
missing tokens act as padding (k = v = q = 0, beta = 0, g = 0: they change nothing). Within a chunk, with G the
cumulative log decay, A[i, j] = beta_i exp(G_i - G_j) k_i . k_j (j < i) and T = (I + A)^-1, the reference's
W = T (beta exp(G) K) and U = T (beta V) give the delta rule's writes U' = U - W S0. Three launches:

1. `_gdn_wy_kernel`, per (chunk, head), all in parallel: G, the Gram matrix K K^T (one tensor-core dot), A, T, and
   then W and U (two dots), stored in the inputs' dtype. T is built from 16 x 16 blocks: the diagonal blocks
   (I + A_bb)^-1 by forward substitution, all blocks at once on a `[L/16, 16, 16]` tile (15 row steps of two small
   reductions), then the off-diagonal blocks by the block Neumann series T = sum_m (-N)^m Tdiag with
   N = Tdiag A_offdiag, exact after L/16 - 1 terms since N is strictly block lower (four `[L, L]` dots at L = 64).
2. `_gdn_pass_kernel`, per (sequence x head x block of BV value columns): the only sequential part. It loads the
   sequence's initial `[D, BV]` state block from its pool row and walks the sequence's chunks in order with the block
   in fp32 registers: store it as the chunk's start state, U' = U - W S (written over U), and
   S <- exp(G_L) S + K^T (exp(G_L - G) U') (the decay on U', so that K stays an exact operand). Two dependent dots a
   chunk: W and U come precomputed, so the chain a long prompt waits on is as short as it gets. The loop's loads do
   not depend on the state, so the compiler's pipelining (num_stages=2) issues chunk j + 1's during chunk j. The final
   block goes straight back to the pool row. Empty sequences return at once (rows untouched).
3. `_gdn_out_kernel`, per (chunk x block of value columns, head), all in parallel:
   O = scale ((exp(G) Q) S0 + (exp(G_i - G_j) q_i . k_j)_{j <= i} U').

All state math and accumulation are fp32. With bf16/fp16 inputs the dot operands are in the inputs' dtype (the
carried state, T, W, U', and the decayed scores rounded to it inside the dots, as fla's kernels do): about 1e-3 of
relative error on a long prompt's final state. fp32 inputs take fp32 operands and buffers throughout ("tf32x3": three
tensor-core passes, about fp32 accuracy).
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

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b in fp32. UPCAST (the interpreter, whose bf16 dot is wrong in triton 3.6) takes the same operands
    in fp32, which gives the tensor cores' result: products of bf16 values are exact in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    return tl.dot(a, b, acc=acc, input_precision=PREC)


@triton.jit
def _chunk_cumsum(g, t, m_t, i_h, stride_gt, stride_gh, L: tl.constexpr):
    """A chunk's cumulative log decay G `[L]` in fp32 (padding tokens add 0, so they keep the last real G) and G at
    its last token."""
    gv = tl.load(g + t * stride_gt + i_h * stride_gh, mask=m_t, other=0.0).to(tl.float32)
    G = tl.cumsum(gv, 0)
    g_last = tl.sum(tl.where(tl.arange(0, L) == L - 1, G, 0.0), 0)
    return G, g_last


@triton.jit
def _gdn_wy_kernel(
    k,
    v,
    g,
    beta,
    wbuf,
    ubuf,
    cu_seqlens,
    chunk_indices,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    L: tl.constexpr,
    BD: tl.constexpr,
    BDV: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    NB: tl.constexpr = L // 16  # 16 x 16 diagonal blocks
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    # int64 token offsets: a token index times the row stride passes 2^31 near a million packed tokens.
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t = tl.load(cu_seqlens + i_n).to(tl.int64) + j * L + tl.arange(0, L)
    m_t = t < eos
    d = tl.arange(0, BD)
    m_d = d < D
    kk = tl.load(k + t[:, None] * stride_kt + i_h * stride_kh + d[None, :], mask=m_t[:, None] & m_d[None, :],
                 other=0.0)  # fmt: skip
    bv = tl.load(beta + t * stride_bt + i_h * stride_bh, mask=m_t, other=0.0).to(tl.float32)
    G, _ = _chunk_cumsum(g, t, m_t, i_h, stride_gt, stride_gh, L)
    dt = wbuf.dtype.element_ty

    ii = tl.arange(0, L)
    lower = ii[:, None] > ii[None, :]
    gram = _dot(kk, tl.trans(kk), tl.zeros([L, L], tl.float32), PREC, INTERP)
    # The exponent is masked before exp: above the diagonal G_i - G_j >= 0 may overflow.
    a = bv[:, None] * tl.exp(tl.where(lower, G[:, None] - G[None, :], float("-inf"))) * gram  # strictly lower

    # The diagonal blocks, negated, as one [NB, 16, 16] tile; forward substitution turns them into (I + A_bb)^-1 - I
    # row by row (row r = -a_r - sum_{j<r} a_rj row j; rows not yet reached still hold -a, which row r's
    # coefficients, zero from column r on, never read), every block at once.
    bi = tl.arange(0, NB)[:, None, None, None]
    bj = tl.arange(0, NB)[None, None, :, None]
    same = bi == bj
    x3 = -tl.sum(tl.where(same, tl.reshape(a, (NB, 16, NB, 16)), 0.0), axis=2)
    r3 = tl.arange(0, 16)[None, :, None]
    for r in tl.static_range(1, 16):
        row = tl.sum(tl.where(r3 == r, x3, 0.0), axis=1)  # [NB, 16]: -a_r of each block
        row = row + tl.sum(row[:, :, None] * x3, axis=1)
        x3 = tl.where(r3 == r, row[:, None, :], x3)
    eye = tl.where(ii[:, None] == ii[None, :], 1.0, 0.0)
    tinv = tl.reshape(tl.where(same, x3[:, :, None, :], 0.0), (L, L)) + eye  # block diagonal: the blocks' inverses
    if NB > 1:
        # (Dg + Y)^-1 = (I + N)^-1 Tdiag with N = Tdiag Y strictly block lower, so (-N)^NB = 0.
        y = tl.where((ii[:, None] // 16) > (ii[None, :] // 16), a, 0.0)
        n = _dot(tinv, y, tl.zeros([L, L], tl.float32), PREC, INTERP)
        p = tinv
        for _ in tl.static_range(NB - 1):
            p = -_dot(n, p, tl.zeros([L, L], tl.float32), PREC, INTERP)
            tinv += p

    # W = T (beta exp(G) K) and U = T (beta V), with T and the right-hand sides in the dot dtype (fla's precision
    # with bf16 inputs; fp32 at PREC with fp32 ones).
    tt = tinv.to(dt)
    w = _dot(tt, (kk.to(tl.float32) * (bv * tl.exp(G))[:, None]).to(dt), tl.zeros([L, BD], tl.float32), PREC, INTERP)
    tl.store(wbuf + t[:, None] * (H * D) + i_h * D + d[None, :], w.to(dt), mask=m_t[:, None] & m_d[None, :])
    c = tl.arange(0, BDV)
    m_c = c < DV
    vv = tl.load(v + t[:, None] * stride_vt + i_h * stride_vh + c[None, :], mask=m_t[:, None] & m_c[None, :],
                 other=0.0).to(tl.float32)  # fmt: skip
    u = _dot(tt, (vv * bv[:, None]).to(dt), tl.zeros([L, BDV], tl.float32), PREC, INTERP)
    tl.store(ubuf + t[:, None] * (H * DV) + i_h * DV + c[None, :], u.to(dt), mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _pass_step(st, j, t0, eos, c0, k, g, wbuf, hbuf, ubuf, i_h, d, cols, m_d, m_c, stride_kt, stride_kh, stride_gt,
               stride_gh, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, L: tl.constexpr, BV: tl.constexpr,
               PREC: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Chunk j: store the state block as the chunk's start state, U' = U - W S over U, return the end state."""
    f32 = tl.float32
    dt = hbuf.dtype.element_ty
    t = t0 + j * L + tl.arange(0, L)
    m_t = t < eos
    kk = tl.load(k + t[:, None] * stride_kt + i_h * stride_kh + d[None, :], mask=m_t[:, None] & m_d[None, :],
                 other=0.0)  # fmt: skip
    ww = tl.load(wbuf + t[:, None] * (H * D) + i_h * D + d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
    p_u = ubuf + t[:, None] * (H * DV) + i_h * DV + cols[None, :]
    uu = tl.load(p_u, mask=m_t[:, None] & m_c[None, :], other=0.0).to(f32)
    G, g_last = _chunk_cumsum(g, t, m_t, i_h, stride_gt, stride_gh, L)

    s0 = st.to(dt)
    tl.store(hbuf + ((c0 + j) * H + i_h) * D * DV + d[:, None] * DV + cols[None, :], s0,
             mask=m_d[:, None] & m_c[None, :])  # fmt: skip
    uf = uu - _dot(ww, s0, tl.zeros([L, BV], f32), PREC, INTERP)  # U', row t is u_t
    tl.store(p_u, uf.to(dt), mask=m_t[:, None] & m_c[None, :])
    # (exp(G_L - G) K)^T U' = K^T (exp(G_L - G) U'): the decay goes on U', so that K stays an exact operand.
    to_end = tl.exp(g_last - G)[:, None]  # each token's decay to the chunk's end
    return _dot(tl.trans(kk), (uf * to_end).to(dt), st * tl.exp(g_last), PREC, INTERP)


@triton.jit
def _gdn_pass_kernel(
    k,
    g,
    wbuf,
    state,
    state_indices,
    cu_seqlens,
    chunk_offsets,
    hbuf,
    ubuf,
    stride_kt,
    stride_kh,
    stride_gt,
    stride_gh,
    stride_ss,
    stride_sh,
    stride_sr,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    L: tl.constexpr,
    BD: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    # Column blocks fastest: the programs of one (sequence, head) read the same keys and W at about the same time.
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_nh, i_v = tl.program_id(0) // NV, tl.program_id(0) % NV
    i_n, i_h = i_nh // H, i_nh % H
    t0 = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if eos == t0:  # an empty sequence: no chunk, and its pool row is left untouched
        return
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    d = tl.arange(0, BD)
    cols = i_v * BV + tl.arange(0, BV)
    m_d = d < D
    m_c = cols < DV
    p_s = state + slot * stride_ss + i_h * stride_sh + d[:, None] * stride_sr + cols[None, :]
    st = tl.load(p_s, mask=m_d[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    n_chunks = tl.cdiv(eos - t0, L)
    if INTERP:  # the interpreter (triton 3.6, numpy >= 2.4) cannot take range() of a loaded scalar
        j = 0
        while j < n_chunks:
            st = _pass_step(st, j, t0, eos, c0, k, g, wbuf, hbuf, ubuf, i_h, d, cols, m_d, m_c, stride_kt, stride_kh,
                            stride_gt, stride_gh, H, D, DV, L, BV, PREC, INTERP)  # fmt: skip
            j += 1
    else:
        # The loop's loads do not depend on the state: num_stages > 1 lets the compiler issue chunk j + 1's while
        # chunk j computes.
        for j in range(n_chunks):
            st = _pass_step(st, j, t0, eos, c0, k, g, wbuf, hbuf, ubuf, i_h, d, cols, m_d, m_c, stride_kt, stride_kh,
                            stride_gt, stride_gh, H, D, DV, L, BV, PREC, INTERP)  # fmt: skip
    tl.store(p_s, st.to(state.dtype.element_ty), mask=m_d[:, None] & m_c[None, :])


@triton.jit
def _gdn_out_kernel(
    q,
    k,
    g,
    hbuf,
    ubuf,
    o,
    cu_seqlens,
    chunk_indices,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_gt,
    stride_gh,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    L: tl.constexpr,
    BD: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    NV: tl.constexpr = (DV + BV - 1) // BV
    i_c, i_v = tl.program_id(0) // NV, tl.program_id(0) % NV
    i_h = tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    j = tl.load(chunk_indices + 2 * i_c + 1)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t = tl.load(cu_seqlens + i_n).to(tl.int64) + j * L + tl.arange(0, L)
    m_t = t < eos
    d = tl.arange(0, BD)
    cols = i_v * BV + tl.arange(0, BV)
    m_d = d < D
    m_c = cols < DV
    dt = hbuf.dtype.element_ty

    qq = tl.load(q + t[:, None] * stride_qt + i_h * stride_qh + d[None, :], mask=m_t[:, None] & m_d[None, :],
                 other=0.0)  # fmt: skip
    kk = tl.load(k + t[:, None] * stride_kt + i_h * stride_kh + d[None, :], mask=m_t[:, None] & m_d[None, :],
                 other=0.0)  # fmt: skip
    s0 = tl.load(hbuf + (i_c * H + i_h).to(tl.int64) * D * DV + d[:, None] * DV + cols[None, :],
                 mask=m_d[:, None] & m_c[None, :], other=0.0)  # fmt: skip
    u = tl.load(ubuf + t[:, None] * (H * DV) + i_h * DV + cols[None, :], mask=m_t[:, None] & m_c[None, :],
                other=0.0)  # fmt: skip
    G, _ = _chunk_cumsum(g, t, m_t, i_h, stride_gt, stride_gh, L)

    ii = tl.arange(0, L)
    qk = _dot(qq, tl.trans(kk), tl.zeros([L, L], tl.float32), PREC, INTERP)
    causal = ii[:, None] >= ii[None, :]
    qk = qk * tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    qg = qq.to(tl.float32) * tl.exp(G)[:, None]
    # The decayed queries and scores in the dot dtype beside bf16 inputs (fla's precision), fp32 beside fp32 ones.
    acc = _dot(qg.to(dt), s0, tl.zeros([L, BV], tl.float32), PREC, INTERP)
    acc = _dot(qk.to(dt), u, acc, PREC, INTERP)
    p_o = o + t[:, None] * (H * DV) + i_h * DV + cols[None, :]
    tl.store(p_o, (scale * acc).to(o.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


def _pass_block_v(sequence_heads: int, Dv: int, device: torch.device) -> int:
    """The state pass's value columns per program: 64 when (sequence, head) pairs fill the chip twice over at that
    width (fewer, larger programs load each key and W block fewer times), else 32 (more programs for few prompts)."""
    return 64 if sequence_heads * common.cdiv(Dv, 64) >= 2 * common.sm_count(device) else 32


def _chunk_len(chunk_size: int) -> int:
    """The kernels' chunk length: chunk_size as a power of two in [16, 64] (the result does not depend on it beyond
    rounding; T is built from 16 x 16 blocks, and 64 is the largest whose `[L, L]` tiles stay cheap)."""
    return min(64, max(16, common.next_power_of_2(int(chunk_size))))


def launch(
    q, k, v, g, beta, state, state_indices, cu_seqlens, scale, chunk_size=64, *, cu_seqlens_cpu=None,
    block_v: int | None = None, warps_pass: int | None = None, block_o: int | None = None,
    warps_out: int | None = None, warps_wy: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`chunk_gdn` with the block shapes, warps and pipelining open (for the device sweep).

    block_v, warps_pass: the state pass's value columns per program and warps; block_o, warps_out: the output
    launch's; warps_wy: the W/U launch's; num_stages: the state pass's software pipelining of its loads."""
    check_shapes(q, k, v, g, beta, state)
    T, H, D = q.shape
    Dv = v.shape[-1]
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    nseq = len(cu) - 1
    L = _chunk_len(chunk_size)
    chunk_indices, chunk_offsets, NC = chunk_metadata(cu, L, q.device)
    dev = q.device
    o = common.output_buffer((T, H, Dv), q.dtype, dev)
    if NC == 0:
        return o
    low = q.dtype in (torch.bfloat16, torch.float16)
    dt = q.dtype if low else torch.float32  # the dot operands', W's, U''s and the chunk-start states' dtype
    # Dots on fp32 operands: tf32 beside bf16 inputs (whose own rounding is coarser), about fp32 ("tf32x3") for fp32
    # inputs; bf16 operands ignore it. The interpreter computes every dot in fp32 whatever it is told.
    prec = "ieee" if INTERPRET else ("tf32" if low else "tf32x3")
    if k.dtype != dt or v.dtype != dt:
        k, v = k.to(dt), v.to(dt)  # one dtype for the dots (q, k, v differ only in unusual callers)
    BD = max(16, common.next_power_of_2(D))
    BDV = max(16, common.next_power_of_2(Dv))

    wbuf = common.output_buffer((T, H, D), dt, dev)
    ubuf = common.output_buffer((T, H, Dv), dt, dev)  # U, then U' written over it by the pass
    # W's and U's dots are `[L, L] @ [L, 32+]`: with 16 columns of bf16, Triton 3.6's Hopper dot reads past its shared
    # memory tile (compute-sanitizer, D = 16), so narrow heads are padded (masked) to 32 here.
    launch_kernel(_gdn_wy_kernel, (NC, H),
        k, v, g, beta, wbuf, ubuf, cu_seqlens, chunk_indices,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        H=H, D=D, DV=Dv, L=L, BD=max(32, BD), BDV=max(32, BDV), PREC=prec, INTERP=INTERPRET,
        num_warps=warps_wy or 4,
    )  # fmt: skip

    hbuf = common.output_buffer((NC, H, D, Dv), dt, dev)
    BV = min(BDV, block_v or (16 if INTERPRET else _pass_block_v(nseq * H, Dv, dev)))
    # (H200 sweep, docs/bench/gdn/: 32 columns over three stages for one long prompt, 64 over two for many.)
    num_stages = num_stages or (3 if BV <= 32 else 2)
    launch_kernel(_gdn_pass_kernel, (nseq * H * common.cdiv(Dv, BV),),
        k, g, wbuf, state, state_indices, cu_seqlens, chunk_offsets, hbuf, ubuf,
        k.stride(0), k.stride(1), g.stride(0), g.stride(1), state.stride(0), state.stride(1), state.stride(2),
        H=H, D=D, DV=Dv, L=L, BD=BD, BV=BV, PREC=prec, INTERP=INTERPRET, num_warps=warps_pass or 4,
        num_stages=num_stages,
    )  # fmt: skip

    BO = min(BDV, block_o or (16 if INTERPRET else 64 if low else 32))  # fp32: 64 columns spill (ptxas)
    launch_kernel(_gdn_out_kernel, (NC * common.cdiv(Dv, BO), H),
        q, k, g, hbuf, ubuf, o, cu_seqlens, chunk_indices,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1), float(scale),
        H=H, D=D, DV=Dv, L=L, BD=BD, BV=BO, PREC=prec, INTERP=INTERPRET, num_warps=warps_out or 4,
    )  # fmt: skip
    return o


def chunk_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.gdn.chunk_gdn` (same arguments and result; see its docstring).

    q, k, v may have any strides but a contiguous last dimension; o is contiguous. `chunk_size` is rounded to a power
    of two in [16, 64].
    """
    return launch(
        q, k, v, g, beta, state, state_indices, cu_seqlens, scale, chunk_size, cu_seqlens_cpu=cu_seqlens_cpu
    )  # fmt: skip
