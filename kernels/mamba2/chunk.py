"""Triton Mamba-2 (SSD) chunked prefill over packed variable-length sequences, states in place in a pool.

Chunks of L tokens never cross a sequence boundary (the last chunk of a sequence may be short). Three launches:

1. `_chunk_dt_kernel`, per (chunk, head block): dt = clamp(softplus(dt + dt_bias)) and the chunk-local cumulative
   log-decay a_t = sum_{s <= t in chunk} dt_s A, both stored `[H, T]` fp32 (8 bytes per token and head).
2. `_chunk_state_kernel`, per (sequence × head, P block, N block): the inter-chunk pass. It loads the sequence's
   initial state from its pool row and walks the sequence's chunks in order, holding its `[BP, BN]` state tile in
   fp32 registers: store the chunk's start state (in the dot dtype), then
   S <- exp(a_last) S + (x · dt · exp(a_last - a))^T B, one tensor-core dot per chunk. The final state goes to a
   `[N_seq, H, P, N]` fp32 buffer.
3. `_chunk_out_kernel`, per (chunk × row block, P block, head), all in parallel:
   y = (C S_start^T) · exp(a) + [(C B^T) ∘ exp(a_i - a_j) ∘ (i >= j) ∘ dt_j] x + D x, looping over the key blocks
   up to the diagonal. The program of each sequence's last chunk (first row block) also copies the final state from
   the buffer into the pool row; doing it here rather than in launch 2 keeps launch 2 free of side effects on the pool,
   so its autotuning cannot corrupt the initial states it reads.

All accumulation is fp32; dot operands are in x's dtype (bf16/fp16 on tensor cores, fp32 with IEEE precision).

The chunk metadata comes from the host (`chunk_metadata`, cached per boundaries: no device work) on an eager step, or,
for a step captured in a CUDA graph, from the device (`device_chunks`): launches 1 and 3 are then sized by a bound
on the chunk count and their programs past the real count return at once. The host path stays for eager steps because
the device one costs a dozen small launches per step. Empty sequences (a padded step's sentinels) have no chunk, and
their state programs return before reading anything, so their pool rows are left untouched.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..autotune import AUTOTUNE_OPTIONS
from ..dispatch import DeviceChunks, chunk_metadata, host_cu_seqlens
from ..launcher import launch_kernel
from .fused_recurrent import softplus

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit(do_not_specialize=["T"])
def _chunk_dt_kernel(
    dt,
    dt_bias,
    A,
    dt_out,
    acs_out,
    cu_seqlens,
    chunk_indices,
    T,
    stride_dt,
    stride_dh,
    dt_lo,
    dt_hi,
    H: tl.constexpr,
    L: tl.constexpr,
    BH: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
):
    i_c, i_hb = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + 2 * i_c)
    if i_n < 0:  # past the real chunk count (a grid sized by a bound: device metadata)
        return
    j = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t = bos + j * L + tl.arange(0, L)
    m_t = t < eos
    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < H
    m = m_t[:, None] & m_h[None, :]
    raw = tl.load(dt + t[:, None] * stride_dt + o_h[None, :] * stride_dh, mask=m, other=0.0).to(tl.float32)
    d = softplus(raw + tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :])
    if HAS_LIMIT:
        d = tl.minimum(tl.maximum(d, dt_lo), dt_hi)
    d = tl.where(m, d, 0.0)  # padding rows: no input, no decay
    a = tl.cumsum(d * tl.load(A + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :], axis=0)
    off = o_h[None, :].to(tl.int64) * T + t[:, None]
    tl.store(dt_out + off, d, mask=m)
    tl.store(acs_out + off, a, mask=m)


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b. UPCAST (the interpreter, whose bf16 dot is wrong in triton 3.6) takes the same bf16-rounded
    operands in fp32, which gives the tensor cores' result: products of bf16 values are exact in fp32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc=acc, input_precision="ieee")
    return tl.dot(a, b, acc=acc, input_precision=PREC)


@triton.jit
def _state_step(h, j, c0, bos, eos, hbuf, tile, m_pn, m_p, m_n, p_x, p_b, p_a, p_d, i_h, stride_xt, stride_bt,
                H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, PREC: tl.constexpr,
                UPCAST: tl.constexpr):
    """Chunk j of a sequence: store its start state, return its end state."""
    tl.store(hbuf + ((c0 + j) * H + i_h) * P * N + tile, h.to(hbuf.dtype.element_ty), mask=m_pn)
    t = bos + j * L + tl.arange(0, L)
    m_t = t < eos
    xv = tl.load(p_x + t[:, None] * stride_xt, mask=m_t[:, None] & m_p[None, :], other=0.0)
    bv = tl.load(p_b + t[:, None] * stride_bt, mask=m_t[:, None] & m_n[None, :], other=0.0)
    a = tl.load(p_a + t, mask=m_t, other=0.0)
    d = tl.load(p_d + t, mask=m_t, other=0.0)
    a_last = tl.load(p_a + tl.minimum(bos + (j + 1) * L, eos) - 1)
    w = d * tl.exp(a_last - a)  # dt_s times the decay from token s to the chunk's end; 0 on padding rows
    xw = (xv.to(tl.float32) * w[:, None]).to(xv.dtype)
    return _dot(tl.trans(xw), bv.to(xv.dtype), h * tl.exp(a_last), PREC, UPCAST)


def _state_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BP": 16, "BN": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BP": bp, "BN": bn}, num_warps=w, num_stages=s)
        for bp, bn, w, s in [(64, 64, 4, 2), (32, 64, 4, 3), (64, 32, 4, 3), (32, 32, 4, 2)]
    ]


def _prune_state(configs, nargs, **kwargs):
    P, N = kwargs["P"], kwargs["N"]
    most = 2048 if nargs["x"].dtype == torch.float32 else 4096  # fp32 FMA dots spill on 64 x 64 tiles
    keep = [
        c for c in configs
        if c.kwargs["BP"] <= max(16, P) and c.kwargs["BN"] <= max(16, N) and c.kwargs["BP"] * c.kwargs["BN"] <= most
    ]
    return keep or configs[-1:]  # the smallest


@triton.autotune(
    configs=_state_configs(),
    key=["H", "HG", "P", "N", "L", "PAR"],
    prune_configs_by={"early_config_prune": _prune_state},
    **AUTOTUNE_OPTIONS,
)
@triton.jit(do_not_specialize=["T", "PAR"])
def _chunk_state_kernel(
    x,
    B,
    dtv,
    acs,
    state,
    state_indices,
    cu_seqlens,
    chunk_offsets,
    hbuf,
    final,
    T,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_bt,
    stride_bg,
    stride_bn,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_sn,
    PAR,
    H: tl.constexpr,
    HG: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    L: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
):
    i_nh, i_p, i_nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    i_g = i_h // HG
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if eos == bos:  # an empty sequence (a padded step's sentinel): no chunk, no final state, its row untouched
        return
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    slot = tl.load(state_indices + i_n).to(tl.int64)

    o_p = i_p * BP + tl.arange(0, BP)
    o_n = i_nb * BN + tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    p_s = state + slot * stride_ss + i_h * stride_sh + o_p[:, None] * stride_sp + o_n[None, :] * stride_sn
    h = tl.load(p_s, mask=m_pn, other=0.0).to(tl.float32)
    tile = o_p[:, None] * N + o_n[None, :]
    p_x = x + i_h * stride_xh + o_p[None, :] * stride_xp
    p_b = B + i_g * stride_bg + o_n[None, :] * stride_bn
    p_a = acs + i_h * T
    p_d = dtv + i_h * T

    n_chunks = tl.cdiv(eos - bos, L)
    # INTERP: the interpreter (triton 3.6 with numpy >= 2.4) cannot take range() of a loaded scalar, and gets bf16
    # dots wrong (see _dot).
    if INTERP:
        j = 0
        while j < n_chunks:
            h = _state_step(h, j, c0, bos, eos, hbuf, tile, m_pn, m_p, m_n, p_x, p_b, p_a, p_d, i_h, stride_xt,
                            stride_bt, H, P, N, L, PREC, INTERP)
            j += 1
    else:
        for j in range(n_chunks):
            h = _state_step(h, j, c0, bos, eos, hbuf, tile, m_pn, m_p, m_n, p_x, p_b, p_a, p_d, i_h, stride_xt,
                            stride_bt, H, P, N, L, PREC, INTERP)

    tl.store(final + (i_n * H + i_h) * P * N + tile, h, mask=m_pn)


@triton.jit
def _out_block(acc, k0, cv, a_m, o_m, tok0, eos, B, p_x, dtv, p_a, i_g, i_h, T, stride_bt, stride_bg, stride_bn,
               stride_xt, o_n, m_n, m_p, N: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
               UPCAST: tl.constexpr):
    """Add key block k0 of the chunk to the rows o_m: [(C B^T) ∘ exp(a_i - a_j) ∘ (i >= j) ∘ dt_j] x."""
    o_k = k0 + tl.arange(0, BM)
    t_k = tok0 + o_k
    m_k = t_k < eos
    bv = tl.load(B + t_k[:, None] * stride_bt + i_g * stride_bg + o_n[None, :] * stride_bn,
                 mask=m_k[:, None] & m_n[None, :], other=0.0)
    xv = tl.load(p_x + t_k[:, None] * stride_xt, mask=m_k[:, None] & m_p[None, :], other=0.0)
    a_k = tl.load(p_a + t_k, mask=m_k, other=0.0)
    d_k = tl.load(dtv + i_h * T + t_k, mask=m_k, other=0.0)
    s = _dot(cv, tl.trans(bv.to(cv.dtype)), tl.zeros([BM, BM], tl.float32), PREC, UPCAST)  # C_i · B_j
    # i >= j on rows inside the sequence (then j is too); rows past its end would otherwise see exp(0 - a_j) > 1.
    causal = (o_m[:, None] >= o_k[None, :]) & (tok0 + o_m < eos)[:, None]
    s = s * tl.exp(tl.where(causal, a_m[:, None] - a_k[None, :], float("-inf"))) * d_k[None, :]
    return _dot(s.to(xv.dtype), xv, acc, PREC, UPCAST)


def _out_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BP": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BP": bp}, num_warps=w, num_stages=s)
        for bp, w, s in [(64, 4, 2), (128, 8, 2), (64, 8, 2), (32, 4, 2)]
    ]


def _prune_out(configs, nargs, **kwargs):
    big = 64 if nargs["x"].dtype == torch.float32 else 128  # fp32 operands take twice the registers
    keep = [c for c in configs if c.kwargs["BP"] <= min(big, max(16, kwargs["P"]))]
    return keep or configs[-1:]  # the smallest


@triton.autotune(
    configs=_out_configs(),
    key=["H", "HG", "P", "N", "L", "BM"],
    prune_configs_by={"early_config_prune": _prune_out},
    **AUTOTUNE_OPTIONS,
)
@triton.jit(do_not_specialize=["T"])
def _chunk_out_kernel(
    x,
    B,
    C,
    dtv,
    acs,
    hbuf,
    final,
    state,
    state_indices,
    D,
    y,
    cu_seqlens,
    chunk_indices,
    T,
    stride_xt,
    stride_xh,
    stride_xp,
    stride_bt,
    stride_bg,
    stride_bn,
    stride_ct,
    stride_cg,
    stride_cn,
    stride_ss,
    stride_sh,
    stride_sp,
    stride_sn,
    H: tl.constexpr,
    HG: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    L: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
    BP: tl.constexpr,
):
    i_cm, i_p, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_m = i_cm // (L // BM), i_cm % (L // BM)
    i_n = tl.load(chunk_indices + 2 * i_c)
    if i_n < 0:  # past the real chunk count
        return
    j = tl.load(chunk_indices + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    tok0 = bos + j * L
    i_g = i_h // HG

    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    tile = o_p[:, None] * N + o_n[None, :]
    p_a = acs + i_h * T
    p_x = x + i_h * stride_xh + o_p[None, :] * stride_xp

    o_m = i_m * BM + tl.arange(0, BM)  # rows of this block, as positions in the chunk
    t_m = tok0 + o_m
    m_m = t_m < eos
    cv = tl.load(C + t_m[:, None] * stride_ct + i_g * stride_cg + o_n[None, :] * stride_cn,
                 mask=m_m[:, None] & m_n[None, :], other=0.0)
    a_m = tl.load(p_a + t_m, mask=m_m, other=0.0)
    hv = tl.load(hbuf + (i_c * H + i_h).to(tl.int64) * P * N + tile, mask=m_p[:, None] & m_n[None, :], other=0.0)
    # The carried state's part: C_t · S_start decayed from the chunk's start to t.
    acc = _dot(cv, tl.trans(hv.to(cv.dtype)), tl.zeros([BM, BP], tl.float32), PREC, INTERP)
    acc = acc * tl.exp(a_m)[:, None]

    # The chunk's own part: a masked, decayed quadratic form over the key blocks up to the diagonal.
    if INTERP:  # see _chunk_state_kernel
        k0 = 0
        while k0 <= i_m * BM:
            acc = _out_block(acc, k0, cv, a_m, o_m, tok0, eos, B, p_x, dtv, p_a, i_g, i_h, T, stride_bt, stride_bg,
                             stride_bn, stride_xt, o_n, m_n, m_p, N, BM, PREC, INTERP)
            k0 += BM
    else:
        for k0 in range(0, i_m * BM + BM, BM):
            acc = _out_block(acc, k0, cv, a_m, o_m, tok0, eos, B, p_x, dtv, p_a, i_g, i_h, T, stride_bt, stride_bg,
                             stride_bn, stride_xt, o_n, m_n, m_p, N, BM, PREC, INTERP)

    xm = tl.load(p_x + t_m[:, None] * stride_xt, mask=m_m[:, None] & m_p[None, :], other=0.0)
    acc += tl.load(D + i_h).to(tl.float32) * xm.to(tl.float32)
    tl.store(y + (t_m[:, None] * H + i_h) * P + o_p[None, :], acc.to(y.dtype.element_ty),
             mask=m_m[:, None] & m_p[None, :])

    if (tok0 + L >= eos) & (i_m == 0):
        # The sequence's last chunk: publish its final state (written by the state pass) to the pool row.
        slot = tl.load(state_indices + i_n).to(tl.int64)
        m_pn = m_p[:, None] & m_n[None, :]
        fin = tl.load(final + (i_n * H + i_h).to(tl.int64) * P * N + tile, mask=m_pn, other=0.0)
        p_s = state + slot * stride_ss + i_h * stride_sh + o_p[:, None] * stride_sp + o_n[None, :] * stride_sn
        tl.store(p_s, fin.to(state.dtype.element_ty), mask=m_pn)


def _par_bucket(nseq: int) -> int:
    """The autotuning key for how many sequences run side by side in the state pass (1, 2-3, 4-7, ... 32+)."""
    return min(nseq, 32).bit_length()


def _chunk_len(chunk_size: int) -> int:
    """The kernels' chunk length: chunk_size as a power of two in [16, 256] (the output does not depend on it)."""
    return min(256, max(16, common.next_power_of_2(int(chunk_size))))


def chunk_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] | None = None,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    device_chunks: DeviceChunks | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.mamba2.chunk_mamba2` (same arguments and result; see its docstring).

    x may have any strides; y is contiguous. `chunk_size` is rounded to a power of two in [16, 256].
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G or tuple(state.shape[1:]) != (H, P, N) or dt.shape != (T, H) or C.shape != B.shape or B.shape[0] != T:
        raise ValueError(f"shapes: x {tuple(x.shape)} dt {tuple(dt.shape)} B {tuple(B.shape)} C {tuple(C.shape)} "
                         f"state {tuple(state.shape)}")
    L = _chunk_len(chunk_size)
    nseq = cu_seqlens.shape[0] - 1
    if device_chunks is not None:  # NC is a bound; the kernels skip the chunks past the real count
        device_chunks.check(cu_seqlens, T)
        chunk_indices, chunk_offsets, NC = device_chunks.get(L)
    else:
        chunk_indices, chunk_offsets, NC = chunk_metadata(host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T), L, x.device)
    dev = x.device
    y = common.output_buffer((T, H, P), x.dtype, dev)
    if NC == 0:
        return y
    f32 = torch.float32
    # fp32 inputs stay fp32 (IEEE FMA dots, on smaller tiles): tf32 would miss the fp32 accuracy (~3e-4).
    prec = "ieee" if x.dtype == f32 else "tf32"
    lo, hi = (float(dt_limit[0]), float(dt_limit[1])) if dt_limit is not None else (0.0, 0.0)

    dtv = common.output_buffer((H, T), f32, dev)
    acs = common.output_buffer((H, T), f32, dev)
    BH = min(32, common.next_power_of_2(H))
    launch_kernel(_chunk_dt_kernel, (NC, common.cdiv(H, BH)),
        dt, dt_bias, A, dtv, acs, cu_seqlens, chunk_indices, T, dt.stride(0), dt.stride(1), lo, hi,
        H=H, L=L, BH=BH, HAS_LIMIT=dt_limit is not None, num_warps=4,
    )

    hbuf = common.output_buffer((NC, H, P, N), x.dtype if x.dtype in (torch.bfloat16, torch.float16) else f32, dev)
    final = common.output_buffer((nseq, H, P, N), f32, dev)
    launch_kernel(_chunk_state_kernel, lambda meta: (nseq * H, common.cdiv(P, meta["BP"]), common.cdiv(N, meta["BN"])),
        x, B, dtv, acs, state, state_indices, cu_seqlens, chunk_offsets, hbuf, final, T,
        x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), _par_bucket(nseq),
        H=H, HG=H // G, P=P, N=N, L=L, PREC=prec, INTERP=INTERPRET,
    )

    BM = min(L, 16 if INTERPRET else (32 if x.dtype == f32 else 64))
    launch_kernel(_chunk_out_kernel, lambda meta: (NC * (L // BM), common.cdiv(P, meta["BP"]), H),
        x, B, C, dtv, acs, hbuf, final, state, state_indices, D, y, cu_seqlens, chunk_indices, T,
        x.stride(0), x.stride(1), x.stride(2), B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1),
        C.stride(2), state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        H=H, HG=H // G, P=P, N=N, L=L, BM=BM, BN=max(16, common.next_power_of_2(N)), PREC=prec,
        INTERP=INTERPRET,
    )
    return y
