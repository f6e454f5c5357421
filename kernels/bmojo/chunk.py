"""Triton B'MOJO prefill over packed variable-length sequences: chunk semantics C, the chunk's attention in one kernel.

`chunk_bmojo` computes `reference.chunk_bmojo` (docs/design/bmojo.md §3.10) for every sequence at once, with no loop
over chunks or sequence groups. Sequence i (n_i > 0 new tokens from position t0_i, read on the host: they plan the
chunk grid, as in the reference) is laid on its grid of chunks starting at s0 = t0 - t0 % w; every chunk of every
sequence is one "chunk row". Steps:

1. Fading K/V: `fading_kv(y_{s-m_f} .. y_{s-1})` for every chunk row that publishes (s > 0, s >= t0), in one call;
   rows before t0 come from y_buf, read before step 2 overwrites it.
2. Innovation: the fixed filter as a depthwise causal conv over [y_buf | y] (`kernels/conv`'s varlen op, which also
   leaves the last L outputs in y_buf), eps = mean of the squared error.
3. Eidetic stores of all chunks at once. The store of the chunk starting at s is TopM(state store ∪ positions
   [e0, s)), where e0 is the first position the state's store has not seen (the start of t0's chunk, or of the chunk
   before when t0 is a boundary that has not published yet): TopM is decomposable, so the per-boundary merges of the
   reference compose to this. Computed in two fixed-shape levels with the reference's `topm_index` (same key, same
   ties): the top m_e of each finished w-token chunk, then for every chunk row the top m_e of the state store and
   the tops of the chunks before it. Cost: argsorts over [rows, w] and [rows, m_e (1 + chunks)], tiny next to the
   attention. The selected K/V are gathered from the store, the ring or the new tokens into a per-chunk-row memory
   buffer `[rows, m_f + m_e, Hkv, dh]` with its fading part (published or the state's).
4. `_prefill_attn_kernel`, one program per (chunk row x block of BM queries, query head): flash attention of the
   block's real queries over their causal sliding window of w keys (positions before t0 read in place from the
   ring, the rest from the packed k, v) and the chunk row's memory block, masked by its valid counts. Online softmax
   in fp32; the dots take the input dtype (fp32 inputs as tf32x3, about fp32 accuracy).
5. Hand-over (torch, fixed shapes): the ring keeps the last w positions, t advances, the active memory becomes
   that of each sequence's last chunk row.

The step-3 selection and the gathers are fixed-shape torch; only t0 and cu_seqlens are read on the host.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .. import common
from ..conv import chunk_causal_conv1d
from ..dispatch import host_cu_seqlens
from ..launcher import launch_kernel
from .fused_recurrent import LOG2E, FadingKV, check_pools
from .reference import innovation_weight, topm_index

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _flash_block(qt, kt, vt, valid, m_i, l_i, acc, qk_scale, PREC: tl.constexpr, INTERP: tl.constexpr):
    """Online-softmax update of a `[BM]` query block with one `[BN]` key block (valid `[BM, BN]`), log2 units."""
    V_DTYPE: tl.constexpr = vt.dtype
    if INTERP:  # the interpreter multiplies bf16 tiles as raw integers: fp32 operands, same roundings of p below
        qt, kt, vt = qt.to(tl.float32), kt.to(tl.float32), vt.to(tl.float32)
    s = tl.dot(qt, tl.trans(kt), input_precision=PREC) * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no valid key yet stay at zero
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    pv = p.to(V_DTYPE).to(tl.float32) if INTERP else p.to(vt.dtype)  # P in the value dtype, as on a GPU
    acc = acc * alpha[:, None] + tl.dot(pv, vt, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _window_block(kb, qt, p, real, k, v, ring_k, ring_v, bos, t0, slot, h, p_hi, d, d_ok, m_i, l_i, acc, qk_scale,
                  stride_kt, stride_kh, stride_vt, stride_vh, HKV: tl.constexpr, DH: tl.constexpr, W: tl.constexpr,
                  BN: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Keys at positions kb .. kb+BN-1 (<= p_hi): from the packed k, v at and after t0, else from the ring."""
    kp = kb + tl.arange(0, BN)
    ok = (kp >= 0) & (kp <= p_hi)
    new = kp >= t0
    m_new = (ok & new)[:, None] & d_ok[None, :]
    m_old = (ok & ~new)[:, None] & d_ok[None, :]
    tok = bos + kp - t0
    ring_row = ((slot * W + kp % W) * HKV + h) * DH
    kt = tl.load(k + tok[:, None] * stride_kt + h * stride_kh + d[None, :], mask=m_new, other=0.0) + tl.load(
        ring_k + ring_row[:, None] + d[None, :], mask=m_old, other=0.0
    )
    vt = tl.load(v + tok[:, None] * stride_vt + h * stride_vh + d[None, :], mask=m_new, other=0.0) + tl.load(
        ring_v + ring_row[:, None] + d[None, :], mask=m_old, other=0.0
    )
    # The causal sliding window: p - w < kp <= p.
    valid = real[:, None] & ok[None, :] & (kp[None, :] <= p[:, None]) & (kp[None, :] > p[:, None] - W)
    return _flash_block(qt, kt.to(qt.dtype), vt.to(qt.dtype), valid, m_i, l_i, acc, qk_scale, PREC, INTERP)


@triton.jit
def _memory_block(mb, qt, real, mem_k, mem_v, g, h, nf, ne, d, d_ok, m_i, l_i, acc, qk_scale, HKV: tl.constexpr,
                  DH: tl.constexpr, M: tl.constexpr, M_F: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                  INTERP: tl.constexpr):  # fmt: skip
    """Memory slots mb .. mb+BN-1 of chunk row g: fading slots below nf, eidetic slots below M_F + ne."""
    j = mb + tl.arange(0, BN)
    ok = (j < nf) | ((j >= M_F) & (j < M_F + ne))
    row = ((g * M + j) * HKV + h) * DH
    msk = ok[:, None] & d_ok[None, :]
    kt = tl.load(mem_k + row[:, None] + d[None, :], mask=msk, other=0.0)
    vt = tl.load(mem_v + row[:, None] + d[None, :], mask=msk, other=0.0)
    return _flash_block(qt, kt.to(qt.dtype), vt.to(qt.dtype), real[:, None] & ok[None, :], m_i, l_i, acc, qk_scale,
                        PREC, INTERP)  # fmt: skip


@triton.jit
def _prefill_attn_kernel(
    q,
    k,
    v,
    ring_k,
    ring_v,
    mem_k,
    mem_v,
    rows,
    o,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    qk_scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    DH: tl.constexpr,
    W: tl.constexpr,
    M: tl.constexpr,
    M_F: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    QB: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
):
    i_gq, hq = tl.program_id(0), tl.program_id(1)
    g, qb = i_gq // QB, i_gq % QB
    h = hq // (HQ // HKV)
    # Chunk row metadata: packed offset of the sequence, its t0 and length, pool row, chunk start, memory counts.
    meta = rows + g.to(tl.int64) * 8
    bos = tl.load(meta)
    t0 = tl.load(meta + 1)
    n = tl.load(meta + 2)
    slot = tl.load(meta + 3)
    s = tl.load(meta + 4)
    nf = tl.load(meta + 5)
    ne = tl.load(meta + 6)
    r = qb * BM + tl.arange(0, BM)
    p = s + r
    real = (r < W) & (p >= t0) & (p < t0 + n)
    p_lo = tl.maximum(s + qb * BM, t0)
    p_hi = tl.minimum(tl.minimum(s + qb * BM + BM, s + W), t0 + n) - 1
    if p_lo <= p_hi:
        d = tl.arange(0, BD)
        d_ok = d < DH
        tok = bos + p - t0
        qt = tl.load(q + tok[:, None] * stride_qt + hq * stride_qh + d[None, :], mask=real[:, None] & d_ok[None, :],
                     other=0.0)  # fmt: skip
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        kp_lo = tl.maximum(p_lo - W + 1, 0)
        if INTERP:  # the interpreter (triton 3.6) cannot take range() of loaded bounds
            kb = kp_lo
            while kb <= p_hi:
                m_i, l_i, acc = _window_block(kb, qt, p, real, k, v, ring_k, ring_v, bos, t0, slot, h, p_hi, d, d_ok,
                                              m_i, l_i, acc, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                                              HKV, DH, W, BN, PREC, INTERP)  # fmt: skip
                kb += BN
        else:
            for kb in range(kp_lo, p_hi + 1, BN):
                m_i, l_i, acc = _window_block(kb, qt, p, real, k, v, ring_k, ring_v, bos, t0, slot, h, p_hi, d, d_ok,
                                              m_i, l_i, acc, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh,
                                              HKV, DH, W, BN, PREC, INTERP)  # fmt: skip
        for mb in range(0, M, BN):
            m_i, l_i, acc = _memory_block(mb, qt, real, mem_k, mem_v, g, h, nf, ne, d, d_ok, m_i, l_i, acc, qk_scale,
                                          HKV, DH, M, M_F, BN, PREC, INTERP)  # fmt: skip
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows past the sequence have no keys (not stored)
        tl.store(o + (tok[:, None] * HQ + hq) * DH + d[None, :], out.to(o.dtype.element_ty),
                 mask=real[:, None] & d_ok[None, :])  # fmt: skip


def _plan(cu: tuple[int, ...], t0s: list[int], w: int) -> dict[str, list]:
    """Host plan of the chunk rows: per sequence with tokens its chunk rows (start, publishes, candidate chunks
    before it) and its finished candidate chunks; see the module docstring."""
    plan: dict[str, list] = {"seq": [], "rows": [], "row_seq": [], "row_k": [], "pub": [], "cand": [], "last": []}
    for i, t0 in enumerate(t0s):
        n = cu[i + 1] - cu[i]
        if not n:
            continue
        j = len(plan["seq"])
        s0 = t0 - t0 % w
        e0 = ((t0 - 1) // w) * w if t0 > 0 else 0  # the state's store holds TopM of positions < e0
        n_chunks = -(-(t0 % w + n) // w)
        plan["seq"].append((i, cu[i], t0, n, e0, len(plan["cand"])))
        for c in range(n_chunks):
            s = s0 + c * w
            plan["row_seq"].append(j)
            plan["rows"].append((cu[i], t0, n, s))
            plan["row_k"].append((s - e0) // w)
            plan["pub"].append(s > 0 and s >= t0)
        plan["cand"].extend((j, start) for start in range(e0, s0 + (n_chunks - 1) * w, w))
        plan["last"].append(len(plan["rows"]) - 1)
    return plan


def _select(eps: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, m: int):
    """Top m by (eps desc, pos asc): (indices `[R, m]`, their eps, their positions, count `[R]`)."""
    idx, count = topm_index(eps, pos, valid, m)
    return idx, eps.gather(1, idx), pos.gather(1, idx), count


def launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, y: torch.Tensor, t: torch.Tensor, y_buf: torch.Tensor,
    ring_k: torch.Tensor, ring_v: torch.Tensor, ring_eps: torch.Tensor, fad_k: torch.Tensor, fad_v: torch.Tensor,
    fad_n: torch.Tensor, eid_k: torch.Tensor, eid_v: torch.Tensor, eid_eps: torch.Tensor, eid_pos: torch.Tensor,
    eid_n: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, fading_kv: FadingKV,
    predictor_taps: int = 4, *, cu_seqlens_cpu: torch.Tensor | list[int] | None = None, block_m: int | None = None,
    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`chunk_bmojo` with the query block, key block, warps and pipeline stages open (tests, device sweep)."""
    pools = dict(t=t, y_buf=y_buf, ring_k=ring_k, ring_v=ring_v, ring_eps=ring_eps, fad_k=fad_k, fad_v=fad_v,
                 fad_n=fad_n, eid_k=eid_k, eid_v=eid_v, eid_eps=eid_eps, eid_pos=eid_pos, eid_n=eid_n)  # fmt: skip
    w, m_f, m_e, L, D = check_pools(pools, q)
    T, Hq, dh = q.shape
    Hkv = ring_k.shape[2]
    if k.shape != (T, Hkv, dh) or v.shape != (T, Hkv, dh) or y.shape != (T, D):
        raise ValueError(f"shapes: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} y {tuple(y.shape)}")
    if not 1 <= predictor_taps <= L:
        raise ValueError(f"predictor_taps={predictor_taps} must be in [1, {L}] (the length of y_buf)")
    for x in (q, k, v):
        if x.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dimension")
    dev = q.device
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    o = common.output_buffer((T, Hq, dh), q.dtype, dev)
    idx = state_indices.to(torch.int64)
    plan = _plan(cu, t.index_select(0, idx).tolist(), w)  # host: plans the chunk grids and the publish schedules
    if not plan["rows"]:
        return o
    M = m_f + m_e

    def dev_tensor(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64).to(dev, non_blocking=True)

    seq = dev_tensor([s[:4] for s in plan["seq"]])  # [N, 4]: index, bos, t0, n
    s_slot = idx[seq[:, 0]]
    s_bos, s_t0, s_n = seq[:, 1], seq[:, 2], seq[:, 3]
    row_seq = dev_tensor(plan["row_seq"])
    r_start = dev_tensor([r[3] for r in plan["rows"]])
    r_slot, r_bos, r_t0 = s_slot[row_seq], s_bos[row_seq], s_t0[row_seq]
    pub_rows = [g for g, pub in enumerate(plan["pub"]) if pub]
    G = len(plan["rows"])

    # 1. Fading K/V of the publishing chunk rows, from y_buf (before step 2 rolls it) or the new tokens' y.
    mem_k = common.output_buffer((G, M, Hkv, dh), ring_k.dtype, dev)
    mem_v = common.output_buffer((G, M, Hkv, dh), ring_v.dtype, dev)
    mem_n = torch.stack([fad_n[r_slot], eid_n[r_slot]], 1)  # [G, 2] (fading, eidetic) counts, updated below
    pub = dev_tensor(plan["pub"]).bool()
    if m_f:
        mem_k[:, :m_f] = fad_k[r_slot]
        mem_v[:, :m_f] = fad_v[r_slot]
        if pub_rows:
            rp = dev_tensor(pub_rows)
            pf = r_start[rp, None] - m_f + torch.arange(m_f, device=dev)  # [P, m_f] positions s-m_f .. s-1
            off = pf - r_t0[rp, None]
            y_new = y.index_select(0, (r_bos[rp, None] + off).clamp(0, T - 1).flatten()).view(*pf.shape, D)
            y_old = y_buf[r_slot[rp, None], (L + off).clamp(0, L - 1)]
            fk, fv = fading_kv(torch.where((off >= 0)[..., None], y_new.float(), y_old).to(y.dtype))
            mem_k[rp, :m_f] = fk.to(mem_k.dtype)
            mem_v[rp, :m_f] = fv.to(mem_v.dtype)
    mem_n[:, 0] = torch.where(pub, m_f, mem_n[:, 0])

    # 2. Innovation scores; y_buf rows take each sequence's last L outputs.
    weight = innovation_weight(D, L, predictor_taps, dev)
    err = chunk_causal_conv1d(y.float(), y_buf, state_indices, cu_seqlens, weight, None, None, cu_seqlens_cpu=cu)
    eps = err.pow(2).mean(-1)  # [T] fp32

    def key_src(pos: torch.Tensor, rs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For positions `pos` of sequences `rs` (same shape): whether they are new, their packed token (clamped)
        and their ring entry."""
        new = pos >= s_t0[rs]
        return new, (s_bos[rs] + pos - s_t0[rs]).clamp(0, max(T - 1, 0)), pos % w

    # 3. Eidetic stores of every chunk row.
    if m_e:
        K = max(plan["row_k"])
        row_k = dev_tensor(plan["row_k"])
        slots = torch.arange(m_e, device=dev)
        eps2 = [eid_eps[r_slot]]
        pos2 = [eid_pos[r_slot]]
        valid2 = [slots[None, :] < eid_n[r_slot][:, None]]
        if K:  # level 1: the top m_e of every finished chunk, then gathered per chunk row
            cand = dev_tensor([c for c in plan["cand"]])  # [R1, 2]: sequence, start
            p1 = cand[:, 1:2] + torch.arange(w, device=dev)  # [R1, w]
            c_seq = cand[:, :1].expand_as(p1)
            new, tok, ent = key_src(p1, c_seq)
            e1 = torch.where(new, eps[tok], ring_eps[s_slot[c_seq], ent])
            _, e1, p1, _ = _select(e1, p1, torch.ones_like(new), m_e)
            first = dev_tensor([s[5] for s in plan["seq"]])[row_seq]  # each row's sequence's first candidate chunk
            kk = torch.arange(K, device=dev)
            take = (first[:, None] + kk).clamp(max=cand.shape[0] - 1)  # [G, K]
            eps2.append(e1[take].flatten(1))
            pos2.append(p1[take].flatten(1))
            valid2.append((kk[None, :] < row_k[:, None]).repeat_interleave(m_e, 1))
        sel, e_sel, p_sel, count = _select(torch.cat(eps2, 1), torch.cat(pos2, 1), torch.cat(valid2, 1), m_e)
        keep = slots[None, :] < count[:, None]
        from_store = sel < m_e
        rs = row_seq[:, None].expand_as(sel)
        new, tok, ent = key_src(p_sel, rs)
        old = r_slot[:, None].expand_as(sel)

        def gather(store: torch.Tensor, ring: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
            x = torch.where(new[..., None, None], packed[tok].to(ring.dtype), ring[old, ent])
            x = torch.where(from_store[..., None, None], store[old, sel.clamp(max=m_e - 1)], x)
            return x * keep[..., None, None].to(x.dtype)

        mem_k[:, m_f:] = gather(eid_k, ring_k, k)
        mem_v[:, m_f:] = gather(eid_v, ring_v, v)
        mem_n[:, 1] = count
        e_sel, p_sel = e_sel * keep, p_sel * keep

    # 4. The attention of every chunk row's queries.
    rows = torch.cat([r_bos[:, None], r_t0[:, None], seq[row_seq, 3:4], r_slot[:, None], r_start[:, None], mem_n,
                      torch.zeros_like(mem_n[:, :1])], 1).contiguous()  # fmt: skip
    BM = block_m or min(64, max(16, common.next_power_of_2(w)))
    # 32-key blocks: in the H100 sweep (BENCHMARKS.md) 5.95 M tokens/s for 8 x 4,096 and 3.17 M for one 16K prompt,
    # against 5.21 M / 3.08 M with 64.
    BN = block_n or 32
    QB = -(-w // BM)
    fp32 = q.dtype == torch.float32
    prec = "tf32x3" if fp32 else "tf32"  # tf32x3: about fp32 accuracy; bf16/fp16 tiles multiply natively
    # fp32 tiles split three ways need 128 KiB of shared memory per stage set at BM = BN = 64 (sm_90 compile): one
    # stage fits, the default three (384 KiB) do not.
    stages = num_stages or (1 if fp32 else 3)
    launch_kernel(_prefill_attn_kernel, (G * QB, Hq),
        q, k, v, ring_k, ring_v, mem_k, mem_v, rows, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), LOG2E / math.sqrt(dh),
        HQ=Hq, HKV=Hkv, DH=dh, W=w, M=M, M_F=m_f, BD=max(16, common.next_power_of_2(dh)), BM=BM, BN=BN, QB=QB,
        PREC=prec, INTERP=INTERPRET, num_warps=num_warps or 4, num_stages=stages,
    )  # fmt: skip

    # 5. Hand-over: the ring keeps the last w positions, the memory is that of each sequence's last chunk row.
    last_pos = (s_t0 + s_n - 1)[:, None]
    e = torch.arange(w, device=dev)[None, :]
    ring_pos = last_pos - (last_pos - e) % w  # [N, w] the last position of each ring entry
    new, tok, _ = key_src(ring_pos, torch.arange(len(plan["seq"]), device=dev)[:, None].expand_as(ring_pos))
    rows_w = s_slot[:, None].expand_as(ring_pos)
    for ring, packed in ((ring_k, k), (ring_v, v), (ring_eps, eps)):
        upd = torch.where(new.view(*new.shape, *[1] * (ring.dim() - 2)), packed[tok].to(ring.dtype), ring[rows_w, e])
        ring[rows_w, e] = upd
    last = dev_tensor(plan["last"])
    t[s_slot] = s_t0 + s_n
    fad_k[s_slot] = mem_k[last, :m_f]
    fad_v[s_slot] = mem_v[last, :m_f]
    fad_n[s_slot] = mem_n[last, 0]
    if m_e:
        eid_k[s_slot] = mem_k[last, m_f:]
        eid_v[s_slot] = mem_v[last, m_f:]
        eid_eps[s_slot] = e_sel[last]
        eid_pos[s_slot] = p_sel[last]
        eid_n[s_slot] = count[last]
    return o


def chunk_bmojo(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    y: torch.Tensor,
    t: torch.Tensor,
    y_buf: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_eps: torch.Tensor,
    fad_k: torch.Tensor,
    fad_v: torch.Tensor,
    fad_n: torch.Tensor,
    eid_k: torch.Tensor,
    eid_v: torch.Tensor,
    eid_eps: torch.Tensor,
    eid_pos: torch.Tensor,
    eid_n: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    fading_kv: FadingKV,
    predictor_taps: int = 4,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.bmojo.chunk_bmojo` (same arguments and result; see its docstring).

    q `[T, Hq, dh]`, k, v `[T, Hkv, dh]` with a contiguous last dimension, y `[T, D]`; contiguous pools. Reads the
    sessions' positions on the host (a sync), as the reference does.
    """
    return launch(q, k, v, y, t, y_buf, ring_k, ring_v, ring_eps, fad_k, fad_v, fad_n, eid_k, eid_v, eid_eps,
                  eid_pos, eid_n, state_indices, cu_seqlens, fading_kv, predictor_taps,
                  cu_seqlens_cpu=cu_seqlens_cpu)  # fmt: skip
