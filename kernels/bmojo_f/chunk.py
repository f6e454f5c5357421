"""Triton B'MOJO-F prefill: packed variable-length prompts attending over two bands, each session's rings read in place.

`chunk_bmojo_f_attention` is the op's Triton implementation (its spec is the reference's, reference.py): the banded
attention by `_prefill_kernel`, then the rings and lengths written by `_ring_write_kernel`. Nothing is read on the
host beyond the boundaries (for the grid); the sessions' lengths stay on the device.

Design. One program per (query block of BLOCK_M rows of one sequence, query head); the query blocks of all sequences
are listed once per step on the host (`dispatch.chunk_metadata`, cached by boundaries), walked last block first, the
heads of one block side by side (the query heads of a KV head read the same key blocks, through L2). A program keeps
an fp32 online softmax (running max and sum, exp2 with log2(e) folded into the score scale) over its two bands: the
in-context band (keys i-W+1 .. i of query i, scored by the block's q) and then the fading band (keys i-2W+1 .. i-W,
scored by its qf, loaded only then). Each band's keys come first from the session's ring for positions before the
chunk (`k_ctx` entry p % W, `k_fade` entry p % 2W, read where they lie in the pool) and then from the chunk's own
packed keys. Key ranges are cut so that no block is loaded that every query of the program masks out (the band of
the block's first query to that of its last, positions >= 0), and only the blocks at a band's two edges and at the
ring/chunk seam evaluate a mask: the bulk is plain `q k^T` and `p v` tensor-core dots (bf16/fp16 operands, fp32
accumulation) on pipelined `for` loops (attention's, `kvfree.kernels.attention.online_softmax.key_range`, given the
band). No score matrix is built: a query's work is its 2W keys, whatever T is.

The rings are written after every program has read them (a ring entry the chunk overwrites may still be in an earlier
query's band): `_ring_write_kernel`, one program per (query block, KV head), stores each sequence's last W in-context
and last 2W fading keys and values at their entries (each entry written once) and sets the session's length from a
copy taken before the launches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..attention.online_softmax import LOG2E, key_range, prefill_config
from ..dispatch import chunk_metadata, host_cu_seqlens
from ..launcher import launch_kernel
from .reference import check_rings

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _source(
    acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, a, b, f0, f1, shift, ring, lo_off, hi_off, scale,
    cols, m_cols, BLOCK_N: tl.constexpr, RING: tl.constexpr, EDGES: tl.constexpr, DPAD: tl.constexpr,
    PREC: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """Keys at positions [a, b) of one source (a ring or the chunk). EDGES: blocks wholly inside [f0, f1) (keys every
    query of the program sees) unmasked, the edges masked; else every block masked (the interpreter's choice: each
    call of a jitted helper and each scalar op cost it a millisecond, and the tests' bands are a block or two)."""
    if EDGES:
        b = tl.maximum(a, b)
        ua = tl.maximum(f0, a)
        ub = tl.minimum(f1, b)
        mid = tl.minimum(a + tl.cdiv(tl.maximum(ua - a, 0), BLOCK_N) * BLOCK_N, b)
        full = mid + tl.maximum(ub - mid, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, a, mid, shift, b, ring,
                                  lo_off, hi_off, scale, cols, m_cols, BLOCK_N, RING, True, True, DPAD, True, PREC,
                                  INTERP, False)  # fmt: skip
        acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, mid, full, shift, b,
                                  ring, lo_off, hi_off, scale, cols, m_cols, BLOCK_N, RING, False, True, DPAD, True,
                                  PREC, INTERP, False)  # fmt: skip
        acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, full, b, shift, b,
                                  ring, lo_off, hi_off, scale, cols, m_cols, BLOCK_N, RING, True, True, DPAD, True,
                                  PREC, INTERP, False)  # fmt: skip
    else:
        acc, m_i, l_i = key_range(acc, m_i, l_i, qv, qp, k_base, v_base, stride_k, stride_v, a, b, shift, b, ring,
                                  lo_off, hi_off, scale, cols, m_cols, BLOCK_N, RING, True, True, DPAD, True, PREC,
                                  INTERP, False)  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _band(
    acc, m_i, l_i, qv, qp, qs, qe, n, t_n, r_k, r_v, stride_rk, stride_rv, ring, c_k, c_v, stride_ck, stride_cv,
    lo_off, hi_off, scale, cols, m_cols, BLOCK_N: tl.constexpr, EDGES: tl.constexpr, DPAD: tl.constexpr,
    PREC: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    """One band (query i sees keys i - lo_off + 1 .. i - hi_off: `key_block`'s band (i - lo_off, i - hi_off]) for the
    queries at positions qs .. qe: keys before the chunk (positions [0, n)) from the ring, then the chunk's own
    (positions [n, n + t_n))."""
    u0 = qs - lo_off + 1  # the keys some query sees: [u0, u1)
    u1 = qe - hi_off + 1
    f0 = qe - lo_off + 1  # the keys every query sees: [f0, f1)
    f1 = qs - hi_off + 1
    acc, m_i, l_i = _source(acc, m_i, l_i, qv, qp, r_k, r_v, stride_rk, stride_rv, tl.maximum(u0, 0),
                            tl.minimum(u1, n), f0, f1, 0, ring, lo_off, hi_off, scale, cols, m_cols, BLOCK_N, True,
                            EDGES, DPAD, PREC, INTERP)  # fmt: skip
    acc, m_i, l_i = _source(acc, m_i, l_i, qv, qp, c_k, c_v, stride_ck, stride_cv, tl.maximum(u0, n),
                            tl.minimum(u1, n + t_n), f0, f1, n, 1, lo_off, hi_off, scale, cols, m_cols, BLOCK_N, False,
                            EDGES, DPAD, PREC, INTERP)  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q, k, v, qf, kf, vf, k_ctx, v_ctx, k_fade, v_fade, o, past, slots, cu_seqlens, blocks,
    stride_qt, stride_qh, stride_qft, stride_qfh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kft, stride_kfh, stride_vft, stride_vfh, stride_ot, stride_oh,
    stride_kc_s, stride_kc_t, stride_kc_h, stride_vc_s, stride_vc_t, stride_vc_h,
    stride_kf_s, stride_kf_t, stride_kf_h, stride_vf_s, stride_vf_t, stride_vf_h,
    qk_scale, window, n_blocks,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, EDGES: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i_h = pid % HQ  # the heads of one query block side by side
    i_c = n_blocks - 1 - pid // HQ  # last blocks first: a fresh sequence's first blocks see fewer keys
    i_kh = i_h // G
    i_n = tl.load(blocks + 2 * i_c)
    i_b = tl.load(blocks + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n)
    t_n = tl.load(cu_seqlens + i_n + 1) - bos
    n = tl.load(past + i_n)  # tokens the session had seen: the new ones sit at positions n, n+1, ...
    slot = tl.load(slots + i_n).to(tl.int64)
    W = window
    if INTERP:  # int64 positions: the interpreter checks every narrower integer op for overflow (a third of its time)
        t_n = t_n.to(tl.int64)
        W = W.to(tl.int64)
    else:
        n = n.to(tl.int32)
    DPAD: tl.constexpr = BLOCK_D != D

    j0 = i_b * BLOCK_M
    rows = j0 + tl.arange(0, BLOCK_M)
    m_rows = rows < t_n
    cols = tl.arange(0, BLOCK_D)
    m_cols = cols < D
    m_q = m_rows[:, None] & m_cols[None, :]
    tok = bos.to(tl.int64) + rows
    qp = n + rows
    qs = n + j0
    qe = n + tl.minimum(j0 + BLOCK_M, t_n) - 1
    # A running max below any real score but finite: a row whose keys are all masked so far rescales by
    # exp2(m - m) = 1, where -inf - -inf would be NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # The in-context band, keys i-W+1 .. i, scored by q.
    qv = tl.load(q + tok[:, None] * stride_qt + i_h * stride_qh + cols[None, :], mask=m_q, other=0.0)
    if INTERP:
        qv = qv.to(tl.float32)
    acc, m_i, l_i = _band(acc, m_i, l_i, qv, qp, qs, qe, n, t_n,
                          k_ctx + slot * stride_kc_s + i_kh * stride_kc_h,
                          v_ctx + slot * stride_vc_s + i_kh * stride_vc_h, stride_kc_t, stride_vc_t, W,
                          k + bos.to(tl.int64) * stride_kt + i_kh * stride_kh,
                          v + bos.to(tl.int64) * stride_vt + i_kh * stride_vh, stride_kt, stride_vt,
                          W, 0, qk_scale, cols, m_cols, BLOCK_N, EDGES, DPAD, PREC, INTERP)  # fmt: skip
    # The fading band, keys i-2W+1 .. i-W, scored by qf (loaded now: one query tile in registers at a time).
    qfv = tl.load(qf + tok[:, None] * stride_qft + i_h * stride_qfh + cols[None, :], mask=m_q, other=0.0)
    if INTERP:
        qfv = qfv.to(tl.float32)
    acc, m_i, l_i = _band(acc, m_i, l_i, qfv, qp, qs, qe, n, t_n,
                          k_fade + slot * stride_kf_s + i_kh * stride_kf_h,
                          v_fade + slot * stride_vf_s + i_kh * stride_vf_h, stride_kf_t, stride_vf_t, 2 * W,
                          kf + bos.to(tl.int64) * stride_kft + i_kh * stride_kfh,
                          vf + bos.to(tl.int64) * stride_vft + i_kh * stride_vfh, stride_kft, stride_vft,
                          2 * W, W, qk_scale, cols, m_cols, BLOCK_N, EDGES, DPAD, PREC, INTERP)  # fmt: skip

    # Every real query sees itself, so l > 0 on its row; rows past the sequence's end are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o + tok[:, None] * stride_ot + i_h * stride_oh + cols[None, :], out.to(o.dtype.element_ty), mask=m_q)


@triton.jit
def _ring_write_kernel(
    k, v, kf, vf, k_ctx, v_ctx, k_fade, v_fade, past, slots, cu_seqlens, blocks, length,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kft, stride_kfh, stride_vft, stride_vfh,
    stride_kc_s, stride_kc_t, stride_kc_h, stride_vc_s, stride_vc_t, stride_vc_h,
    stride_kf_s, stride_kf_t, stride_kf_h, stride_vf_s, stride_vf_t, stride_vf_h,
    window,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """One (query block, KV head): its tokens among their sequence's last W (last 2W) into the in-context (fading)
    rings at entry (n + j) % W (% 2W); the sequence's first block on head 0 sets its length."""
    i_c, i_kh = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(blocks + 2 * i_c)
    i_b = tl.load(blocks + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + i_n)
    t_n = tl.load(cu_seqlens + i_n + 1) - bos
    n64 = tl.load(past + i_n)
    n = n64.to(tl.int32)
    slot = tl.load(slots + i_n).to(tl.int64)
    W = window
    j = i_b * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    m_cols = cols < D
    in_seq = j < t_n
    keep_c = (in_seq & (j >= t_n - W))[:, None] & m_cols[None, :]
    keep_f = (in_seq & (j >= t_n - 2 * W))[:, None] & m_cols[None, :]
    tok = (bos.to(tl.int64) + j)[:, None]
    e_c = ((n + j) % W)[:, None]
    e_f = ((n + j) % (2 * W))[:, None]
    base_c = slot * stride_kc_s + i_kh * stride_kc_h
    kt = tl.load(k + tok * stride_kt + i_kh * stride_kh + cols[None, :], mask=keep_c)
    tl.store(k_ctx + base_c + e_c * stride_kc_t + cols[None, :], kt.to(k_ctx.dtype.element_ty), mask=keep_c)
    vt = tl.load(v + tok * stride_vt + i_kh * stride_vh + cols[None, :], mask=keep_c)
    tl.store(v_ctx + slot * stride_vc_s + i_kh * stride_vc_h + e_c * stride_vc_t + cols[None, :],
             vt.to(v_ctx.dtype.element_ty), mask=keep_c)  # fmt: skip
    kft = tl.load(kf + tok * stride_kft + i_kh * stride_kfh + cols[None, :], mask=keep_f)
    tl.store(k_fade + slot * stride_kf_s + i_kh * stride_kf_h + e_f * stride_kf_t + cols[None, :],
             kft.to(k_fade.dtype.element_ty), mask=keep_f)  # fmt: skip
    vft = tl.load(vf + tok * stride_vft + i_kh * stride_vfh + cols[None, :], mask=keep_f)
    tl.store(v_fade + slot * stride_vf_s + i_kh * stride_vf_h + e_f * stride_vf_t + cols[None, :],
             vft.to(v_fade.dtype.element_ty), mask=keep_f)  # fmt: skip
    if (i_b == 0) & (i_kh == 0):
        tl.store(length + slot, n64 + t_n)


def ring_strides(*rings: torch.Tensor) -> tuple[int, ...]:
    """The ring pools' strides (session, entry, KV head), in the kernels' argument order (k_ctx, v_ctx, k_fade,
    v_fade)."""
    return tuple(s for ring in rings for s in ring.stride()[:3])


def sessions(length: torch.Tensor, state_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sessions' pool rows, int32 or int64 as given, else int64; their lengths before the step, a copy taken
    before the kernels that write `length`)."""
    idx = state_indices if state_indices.dtype in (torch.int32, torch.int64) else state_indices.to(torch.int64)
    return idx, length.index_select(0, idx)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    vf: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_fade: torch.Tensor,
    v_fade: torch.Tensor,
    length: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window: int,
    scale: float,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    edges: bool | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.bmojo_f.chunk_bmojo_f_attention` (same arguments and result; see its docstring), with
    the launch configuration open (the bench's sweep): BLOCK_M, BLOCK_N (dividing BLOCK_M), warps and pipeline stages
    of the attention kernel; `edges` (default: compiled, not interpreted) masks only the blocks at the bands' edges,
    else every block."""
    T, Hq, D = q.shape
    Hkv, W = k.shape[1], window
    check_rings(k_ctx, k_fade, W)
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    # fp32 queries: IEEE fp32 dots over (at most) 2W keys a query, 64-row query blocks at 4 warps.
    bm, bn, warps, stages = prefill_config(q.dtype, D, block_m, block_n, num_warps, num_stages, fp32=(64, 32, 4, 2))
    out = common.output_buffer((T, Hq, D), q.dtype, q.device)
    blocks, _, n_blocks = chunk_metadata(cu, bm, q.device)
    if n_blocks == 0:
        return out
    idx, past = sessions(length, state_indices)  # past: read by both launches; the second writes `length`
    cu_dev = cu_seqlens.to(device=q.device, dtype=torch.int32)
    q, k, v, qf, kf, vf = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, qf, kf, vf))
    block_d = max(16, common.next_power_of_2(D))
    rings = ring_strides(k_ctx, v_ctx, k_fade, v_fade)
    new_strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), kf.stride(0), kf.stride(1), vf.stride(0),
                   vf.stride(1))  # fmt: skip
    launch_kernel(_prefill_kernel, (n_blocks * Hq,),
        q, k, v, qf, kf, vf, k_ctx, v_ctx, k_fade, v_fade, out, past, idx, cu_dev, blocks,
        q.stride(0), q.stride(1), qf.stride(0), qf.stride(1), *new_strides, out.stride(0), out.stride(1),
        *rings, scale * LOG2E, W, n_blocks,
        HQ=Hq, G=Hq // Hkv, D=D, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn,
        EDGES=not _INTERPRET if edges is None else edges,
        # fp32 queries: IEEE fp32 dots, not tf32. The interpreter is always told "ieee" (it mishandles "tf32").
        PREC="ieee" if q.dtype == torch.float32 or _INTERPRET else "tf32", INTERP=_INTERPRET,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    launch_kernel(_ring_write_kernel, (n_blocks, Hkv),
        k, v, kf, vf, k_ctx, v_ctx, k_fade, v_fade, past, idx, cu_dev, blocks, length, *new_strides,
        *rings, W, D=D, BLOCK_D=block_d, BLOCK_M=bm,
    )  # fmt: skip
    return out


# The op (the reference's arguments and result) is `launch` at its default configuration.
chunk_bmojo_f_attention = launch
