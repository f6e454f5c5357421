"""Reference B'MOJO memory math in pure PyTorch (docs/design/bmojo.md §3.3-§3.10, "semantics C").

For the token at absolute position t (chunk c = t // w, chunk start s = c*w) the attention keys are

    window   : positions max(0, t-w+1) .. t                     (raw tokens, the current one included)
    fading   : m_f SSM outputs y_{s-m_f} .. y_{s-1}            (c >= 1)
    eidetic  : TopM_{m_e} of positions 0 .. s-1 by key (innovation eps desc, position asc)   (c >= 1)

so the memory changes once per chunk. The functions here are the pieces the B'MOJO layer composes:

- `innovation`: eps_t = mean_d (y_t - mean(y_{t-1..t-k}))^2, a fixed depthwise causal conv (kernels/conv) whose tail
  (the last outputs of the session) is carried in the state;
- `topm_index` / `eidetic_update`: the bounded eidetic store, merged once per chunk boundary;
- `chunked_memory_attention`: the per-chunk block form of the paper's interleaved sliding window (spec §3.10);
- `bmojo_chunked`: the whole memory part of a layer for sequences continuing from given states (the chunk grid, ring
  extension, publish schedule and eidetic merges), differentiable: the training forward and the prefill's core;
- `chunk_bmojo` (packed variable-length prefill) and `fused_recurrent_bmojo` (one decode token per session): the
  serving ops, reading and writing the memory state in place in pool rows addressed by `state_indices`.

The memory state of a session is the tuple `MemoryState` (the pool tensors of the same names, in that order): the
position `t`, the last SSM outputs `y_buf`, the ring of the last w K/V with their scores, the active fading K/V and
the active eidetic store (spec §3.8). The ops take the queries, keys and values of the new tokens (projected by the
layer) and their SSM outputs y. The fading tokens are projected by the layer's `fading_kv`, which the ops call only
on the m_f outputs before each chunk start that publishes: the layer cannot project them beforehand (at a boundary
they may sit in `y_buf`, which only the op reads), and projecting every token's y would double the K/V GEMMs.

All selection arithmetic is fp32 (scores) and int64 (positions), whatever the activation dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvfree.kernels.attention import attend
from kvfree.kernels.common import state_math
from kvfree.kernels.conv import causal_conv1d
from kvfree.kernels.dispatch import host_cu_seqlens

FadingKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MemoryState(NamedTuple):
    """A session's B'MOJO memory state, one tensor per field with a leading batch (or pool row) axis.

    t `[]` int64 position of the next token; y_buf `[L, D]` fp32 the last L = max(k, m_f) SSM outputs, oldest first;
    ring_k, ring_v `[w, Hkv, dh]` K/V of the last w positions (position p at p % w); ring_eps `[w]` fp32 their
    scores; fad_k, fad_v `[m_f, Hkv, dh]` the active fading K/V; fad_n `[]` int64 valid fading entries; eid_k, eid_v
    `[m_e, Hkv, dh]`, eid_eps `[m_e]` fp32, eid_pos `[m_e]` int64 the active eidetic store in key order; eid_n `[]`
    int64 its valid entries. All zeros is a new session.
    """

    t: torch.Tensor
    y_buf: torch.Tensor
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    ring_eps: torch.Tensor
    fad_k: torch.Tensor
    fad_v: torch.Tensor
    fad_n: torch.Tensor
    eid_k: torch.Tensor
    eid_v: torch.Tensor
    eid_eps: torch.Tensor
    eid_pos: torch.Tensor
    eid_n: torch.Tensor


@state_math
def innovation(y: torch.Tensor, y_buf: torch.Tensor, taps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Innovation scores of new SSM outputs, continuing from the session's last outputs.

    The predictor is the fixed running average yhat_t = (1/k) sum_{i=1..k} y_{t-i} (spec §3.4; zeros before the
    session start); the score is eps_t = mean over channels of (y_t - yhat_t)^2, in fp32.

    Args:
        y: `[B, T, D]` new SSM outputs.
        y_buf: `[B, L, D]` the L >= taps previous outputs, oldest first (zeros for a new session).
        taps: k.

    Returns:
        eps: `[B, T]` fp32; new_buf: `[B, L, D]` fp32, the last L outputs (oldest first).
    """
    weight = innovation_weight(y.shape[-1], y_buf.shape[1], taps, y.device)
    err, new_buf = causal_conv1d(y.float(), weight, None, y_buf.float())
    return err.pow(2).mean(-1), new_buf


def innovation_weight(d: int, buf_len: int, taps: int, device: torch.device) -> torch.Tensor:
    """The innovation filter as depthwise causal-conv taps `[d, buf_len + 1]` fp32 (the last tap multiplies y_t).

    e_t = y_t - sum_i alpha_i y_{t-i} is a depthwise causal conv with L+1 taps; taps older than k are zero.
    """
    weight = torch.zeros(d, buf_len + 1, dtype=torch.float32, device=device)
    weight[:, buf_len - taps : buf_len] = -1.0 / taps
    weight[:, buf_len] = 1.0
    return weight


def topm_index(eps: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the top-m candidates by key (eps descending, then position ascending), invalid ones last.

    With this total order, a merge at each chunk boundary equals the streaming rule "admit iff eps > min of a full
    store, evict the minimum" of Algorithm 1 line 4 (spec §3.5), so both give TopM of every token seen.

    Args:
        eps: `[B, M]` scores.  pos: `[B, M]` int64 positions (distinct among valid entries).
        valid: `[B, M]` bool.  m: how many to keep.

    Returns:
        idx: `[B, m]` int64 candidate indices in key order (entries past `count` are invalid);
        count: `[B]` int64 number of valid selected entries, min(m, valid.sum()).
    """
    # Lexicographic sort by two stable sorts: positions first, then scores. Invalid entries sort last in both.
    big = torch.iinfo(torch.int64).max
    by_pos = torch.argsort(pos.masked_fill(~valid, big), dim=1, stable=True)
    neg = (-eps.float()).masked_fill(~valid, float("inf")).gather(1, by_pos)
    order = by_pos.gather(1, torch.argsort(neg, dim=1, stable=True))
    return order[:, :m], valid.sum(1).clamp(max=m)


@state_math
def eidetic_update(
    eid_k: torch.Tensor,
    eid_v: torch.Tensor,
    eid_eps: torch.Tensor,
    eid_pos: torch.Tensor,
    eid_n: torch.Tensor,
    cand_k: torch.Tensor,
    cand_v: torch.Tensor,
    cand_eps: torch.Tensor,
    cand_pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eidetic store after a chunk boundary: TopM_{m_e}(current store ∪ the chunk that just finished).

    Differentiable in the K/V it gathers (the selection itself is a hard, gradient-free top-m).

    Args:
        eid_k, eid_v: `[B, m_e, Hkv, dh]` current store.  eid_eps: `[B, m_e]` fp32.  eid_pos: `[B, m_e]` int64.
        eid_n: `[B]` int64 valid entries (the first eid_n rows).
        cand_k, cand_v: `[B, C, Hkv, dh]` candidates.  cand_eps: `[B, C]`.  cand_pos: `[B, C]` or `[C]` int64.

    Returns:
        New (eid_k, eid_v, eid_eps, eid_pos, eid_n) with the same shapes, in key order; invalid rows are zero.
    """
    B, m = eid_eps.shape
    dev = eid_eps.device
    C = cand_eps.shape[1]
    slots = torch.arange(m, device=dev)
    valid = torch.cat([slots[None, :] < eid_n[:, None], torch.ones(B, C, dtype=torch.bool, device=dev)], 1)
    eps = torch.cat([eid_eps.float(), cand_eps.float()], 1)
    pos = torch.cat([eid_pos, cand_pos.expand(B, C)], 1)
    idx, count = topm_index(eps, pos, valid, m)
    keep = slots[None, :] < count[:, None]  # [B, m]

    def pick(src: torch.Tensor) -> torch.Tensor:
        out = src.gather(1, idx.view(B, m, *([1] * (src.dim() - 2))).expand(B, m, *src.shape[2:]))
        return out * keep.view(B, m, *([1] * (src.dim() - 2))).to(out.dtype)

    return (
        pick(torch.cat([eid_k, cand_k.to(eid_k.dtype)], 1)),
        pick(torch.cat([eid_v, cand_v.to(eid_v.dtype)], 1)),
        pick(eps),
        pick(pos),
        count,
    )


@state_math
def chunked_memory_attention(
    q: torch.Tensor,
    k_ext: torch.Tensor,
    v_ext: torch.Tensor,
    mem_k: torch.Tensor,
    mem_v: torch.Tensor,
    mem_valid: torch.Tensor,
    first_chunk_start: int | torch.Tensor,
) -> torch.Tensor:
    """NoPE attention of whole chunks of queries over [previous chunk | chunk memory | current chunk] (spec §3.10).

    Query j of chunk c (position s+j, s = first_chunk_start + c*w) may see key i of its block iff
    j+1 <= i < w (the tail of chunk c-1, positions >= 0 only), or the i-th memory slot is valid, or i <= j within
    chunk c. This is exactly the paper's interleaved causal sliding window of K = w + m over
    [mem_0, chunk_0, mem_1, chunk_1, ...]: the window, the chunk's own memory and never an older memory block.

    Args:
        q: `[B, n*w, Hq, dh]` queries at positions first_chunk_start + (0 .. n*w-1).
        k_ext, v_ext: `[B, (n+1)*w, Hkv, dh]` keys/values at positions first_chunk_start - w + (0 .. (n+1)*w-1);
            entries at negative positions are masked, other entries a real query cannot reach may hold anything.
        mem_k, mem_v: `[B, n, m, Hkv, dh]` each chunk's memory tokens.  mem_valid: `[B, n, m]` bool.
        first_chunk_start: absolute position of the first query (a multiple of w): an int, or `[B]` int64 for
            sequences on grids of their own.

    Returns:
        `[B, n*w, Hq, dh]` in q's dtype.
    """
    B, TQ, Hq, dh = q.shape
    n, m = mem_k.shape[1], mem_k.shape[2]
    w = TQ // n
    Hkv = k_ext.shape[2]
    dev = q.device
    prev_k = k_ext[:, : n * w].reshape(B, n, w, Hkv, dh)
    cur_k = k_ext[:, w:].reshape(B, n, w, Hkv, dh)
    prev_v = v_ext[:, : n * w].reshape(B, n, w, Hkv, dh)
    cur_v = v_ext[:, w:].reshape(B, n, w, Hkv, dh)
    keys = torch.cat([prev_k, mem_k.to(prev_k.dtype), cur_k], 2).flatten(0, 1)  # [B*n, 2w+m, Hkv, dh]
    values = torch.cat([prev_v, mem_v.to(prev_v.dtype), cur_v], 2).flatten(0, 1)

    j = torch.arange(w, device=dev)
    start = torch.as_tensor(first_chunk_start, device=dev).reshape(-1, 1, 1)  # [B or 1, 1, 1]
    prev_pos = start - w + torch.arange(n, device=dev)[:, None] * w + j[None, :]  # [B or 1, n, w]
    prev_ok = (j[None, :] > j[:, None]) & (prev_pos >= 0)[..., None, :]  # [B or 1, n, w(query), w(key)]
    cur_ok = (j[None, :] <= j[:, None]).expand(n, w, w)
    mask = torch.cat(
        [
            prev_ok.expand(B, n, w, w),
            mem_valid[:, :, None, :].expand(B, n, w, m),
            cur_ok.expand(B, n, w, w),
        ],
        -1,
    ).flatten(0, 1)  # [B*n, w, 2w+m]
    out = attend(q.reshape(B * n, w, Hq, dh), keys, values, mask)
    return out.reshape(B, n * w, Hq, dh)


def _pick(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`src[b, index[b, g]]` for src `[B, S, ...]` and index `[B, G]` (clamped into range) -> `[B, G, ...]`."""
    index = index.clamp(0, src.shape[1] - 1)
    return src.gather(1, index.view(*index.shape, *([1] * (src.dim() - 2))).expand(*index.shape, *src.shape[2:]))


def _where(mask: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row b of `a` where `mask` `[B]` is True, else of `b`; all of `a` when mask is None."""
    return a if mask is None else torch.where(mask.view(-1, *([1] * (a.dim() - 1))), a, b)


def bmojo_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    y: torch.Tensor,
    state: MemoryState,
    t0: Sequence[int],
    lens: Sequence[int],
    fading_kv: FadingKV,
    predictor_taps: int,
) -> tuple[torch.Tensor, MemoryState]:
    """B'MOJO memory attention for B right-padded sequences, each continuing from its own state (spec §3.10).

    Sequence b holds `lens[b] >= 1` new tokens at positions `t0[b]` .. (`t0[b]` = `state.t[b]`, given on the host
    because it plans the grid). Each sequence is laid on its own chunk grid starting at s0 = (t0 // w) * w, padded
    to the longest grid of the batch; keys before t0 come from the ring, which holds positions [t0 - w, t0), and
    every real query at t >= t0 only reaches keys >= t - w + 1 > t0 - w, so the ring suffices. Every chunk start
    s > 0 with s >= t0 publishes a new memory in order (the boundary at t0 itself too, since no token of that chunk
    has run): eidetic store <- TopM(store ∪ chunk s-w .. s-1), fading K/V <- `fading_kv(y_{s-m_f} .. y_{s-1})`.
    Differentiable (selection aside); the state is only read.

    Args:
        q: `[B, Tmax, Hq, dh]`;  k, v: `[B, Tmax, Hkv, dh]` the new tokens' attention inputs (padding ignored).
        y: `[B, Tmax, D]` their SSM outputs (innovation and fading source).
        state: `MemoryState` of `[B, ...]` tensors (w, m_f, m_e and L are read from its shapes).
        t0, lens: host ints per sequence.
        fading_kv: SSM outputs `[..., D]` -> fading (keys, values) `[..., Hkv, dh]`.
        predictor_taps: k of the innovation predictor.

    Returns:
        (o `[B, Tmax, Hq, dh]` in q's dtype, padded positions arbitrary; the new `MemoryState`).
    """
    B, t_max = q.shape[:2]
    w, m_f, L = state.ring_k.shape[1], state.fad_k.shape[1], state.y_buf.shape[1]
    dev = q.device
    n_chunks = max(-(-(t % w + n) // w) for t, n in zip(t0, lens, strict=True))
    start = torch.tensor(t0, dtype=torch.int64, device=dev)
    count = torch.tensor(lens, dtype=torch.int64, device=dev)
    s0 = start - start % w
    eps, _ = innovation(y, state.y_buf, predictor_taps)  # [B, Tmax]; causal, so the padding changes nothing real

    # The key grid: index g holds position s0 - w + g, from the new tokens when p >= t0, else from the ring entry
    # p % w. Entries no real query reaches (p < t0 - w, or past the sequence) hold stale or clamped values; the
    # attention masks positions < 0, and candidates (chunks ending at a publishing start) are all real.
    pos = s0[:, None] - w + torch.arange((n_chunks + 1) * w, device=dev)[None, :]  # [B, (n+1)w]
    src = torch.where(pos >= start[:, None], w + pos - start[:, None], pos % w)  # index into [ring | new]

    def ext(new: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        return _pick(torch.cat([ring.to(new.dtype), new], 1), src)

    k_ext, v_ext, eps_ext = ext(k, state.ring_k), ext(v, state.ring_v), ext(eps, state.ring_eps)

    # The publish schedule (host) and every chunk's fading K/V in one projection (rows that do not publish are
    # clamped into range and never used).
    starts = [[t - t % w + c * w for c in range(n_chunks)] for t in t0]
    publish = [[s > 0 and t <= s < t + n for s in row] for row, t, n in zip(starts, t0, lens, strict=True)]
    publish_d = torch.tensor(publish, dtype=torch.bool, device=dev)  # [B, n]
    y_all = torch.cat([state.y_buf.float(), y.float()], 1)  # position p at index L + p - t0 (y_buf holds y exactly)
    if m_f:
        chunk_s = s0[:, None] + w * torch.arange(n_chunks, device=dev)[None, :]  # [B, n]
        rows = (L + chunk_s - start[:, None] - m_f)[..., None] + torch.arange(m_f, device=dev)  # [B, n, m_f]
        fk, fv = fading_kv(_pick(y_all, rows.flatten(1)).to(y.dtype))
        fk, fv = fk.unflatten(1, (n_chunks, m_f)), fv.unflatten(1, (n_chunks, m_f))

    fad_k, fad_v, fad_n = state.fad_k, state.fad_v, state.fad_n
    eid = (state.eid_k, state.eid_v, state.eid_eps, state.eid_pos, state.eid_n)
    fad_slots, eid_slots = torch.arange(m_f, device=dev), torch.arange(state.eid_k.shape[1], device=dev)
    mem_k, mem_v, mem_valid = [], [], []
    for c in range(n_chunks):
        now = [row[c] for row in publish]
        if any(now):
            mask = None if all(now) else publish_d[:, c]  # rows that do not publish here keep their memory
            cand = slice(c * w, (c + 1) * w)  # chunk c-1 of the grid: positions s-w .. s-1
            new_eid = eidetic_update(*eid, k_ext[:, cand], v_ext[:, cand], eps_ext[:, cand].detach(), pos[:, cand])
            eid = tuple(_where(mask, a, b) for a, b in zip(new_eid, eid, strict=True))
            if m_f:
                fad_k = _where(mask, fk[:, c].to(fad_k.dtype), fad_k)
                fad_v = _where(mask, fv[:, c].to(fad_v.dtype), fad_v)
            fad_n = _where(mask, torch.full_like(fad_n, m_f), fad_n)
        mem_k.append(torch.cat([fad_k, eid[0]], 1))
        mem_v.append(torch.cat([fad_v, eid[1]], 1))
        mem_valid.append(torch.cat([fad_slots[None, :] < fad_n[:, None], eid_slots[None, :] < eid[4][:, None]], 1))

    offset = start - s0  # grid index of the first new token; other grid queries are padding, dropped below
    grid = torch.arange(n_chunks * w, device=dev)[None, :] - offset[:, None]
    o = chunked_memory_attention(
        _pick(q, grid), k_ext, v_ext, torch.stack(mem_k, 1), torch.stack(mem_v, 1), torch.stack(mem_valid, 1), s0
    )
    o = _pick(o, offset[:, None] + torch.arange(t_max, device=dev)[None, :])

    # Hand over: ring entry e takes the last position p = e (mod w) before t0 + T when it is new; y_buf the last L
    # outputs; the memory stays that of the chunk of t0 + T - 1.
    last = (start + count - 1)[:, None]
    entry = torch.arange(w, device=dev)[None, :]
    ring_pos = last - (last - entry) % w  # [B, w]
    ring_src = torch.where(ring_pos >= start[:, None], w + ring_pos - start[:, None], entry)  # into [ring | new]

    def ring(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return _pick(torch.cat([old, new.to(old.dtype)], 1), ring_src)

    new = MemoryState(
        state.t + count,
        _pick(y_all, count[:, None] + torch.arange(L, device=dev)[None, :]),
        ring(k, state.ring_k),
        ring(v, state.ring_v),
        ring(eps, state.ring_eps),
        fad_k,
        fad_v,
        fad_n,
        *eid,
    )
    return o, new


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
    """B'MOJO memory attention over packed variable-length sequences, each continuing its session's memory state.

    Computes `bmojo_chunked` for every sequence from its pool rows and writes the new state back. Sequences that
    span the same number of chunks of their grid share one padded call, so no sequence pays for a longer one's grid.

    Args:
        q: `[T, Hq, dh]` bf16/fp16/fp32, the new tokens of N sequences concatenated.
        k, v: `[T, Hkv, dh]`; Hkv divides Hq.
        y: `[T, D]` the tokens' SSM outputs.
        t, y_buf, ring_k, ring_v, ring_eps, fad_k, fad_v, fad_n, eid_k, eid_v, eid_eps, eid_pos, eid_n: the pool
            tensors `[S, ...]` of `MemoryState` (shapes and dtypes there; K/V in the activation dtype). Rows
            `state_indices` are advanced by their sequence's tokens; other rows are left untouched. w, m_f, m_e are
            read from the shapes of ring_k, fad_k, eid_k.
        state_indices: `[N]` int32, the pool row of each sequence (distinct).
        cu_seqlens: `[N+1]` int32, sequence boundaries in q (device), from 0 to T.
        fading_kv: SSM outputs `[..., D]` -> fading (keys, values) `[..., Hkv, dh]` (the layer's attention pre-norm
            and W_K, W_V).
        predictor_taps: k of the innovation predictor (<= L, the length of y_buf).
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.

    The sessions' positions `t` are read on the host (they plan the chunk grid and the publish schedule): a sync.

    Returns:
        o: `[T, Hq, dh]` in q's dtype, the attention output (before W_O).
    """
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.shape[0])
    pool = MemoryState(t, y_buf, ring_k, ring_v, ring_eps, fad_k, fad_v, fad_n, eid_k, eid_v, eid_eps, eid_pos, eid_n)
    idx = state_indices.to(torch.int64)
    dev, w = q.device, ring_k.shape[1]
    t0 = t.index_select(0, idx).tolist()  # host: plans the chunk grids and the publish schedules
    lens = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    groups: dict[int, list[int]] = {}
    for i, (start, n) in enumerate(zip(t0, lens, strict=True)):
        if n:
            groups.setdefault(-(-(start % w + n) // w), []).append(i)
    out = q.new_empty(q.shape)
    for members in groups.values():
        g = torch.tensor(members, dtype=torch.int64, device=dev)
        rows = idx[g]
        t_max = max(lens[i] for i in members)
        tok = torch.tensor([cu[i] for i in members], device=dev)[:, None] + torch.arange(t_max, device=dev)[None, :]
        real = tok < torch.tensor([cu[i + 1] for i in members], device=dev)[:, None]
        tok = tok.clamp(max=q.shape[0] - 1)  # padding repeats a real token: after the real ones, results dropped
        o, new = bmojo_chunked(
            q[tok], k[tok], v[tok], y[tok], MemoryState(*(p.index_select(0, rows) for p in pool)),
            [t0[i] for i in members], [lens[i] for i in members], fading_kv, predictor_taps,
        )  # fmt: skip
        for dst, src in zip(pool, new, strict=True):
            dst.index_copy_(0, rows, src.to(dst.dtype))
        if len(groups) == 1:  # every sequence in one call, in packed order: the real rows are the packed tokens
            out = o[real]
        else:
            out[tok[real]] = o[real]
    return out


def fused_recurrent_bmojo(
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
    fading_kv: FadingKV,
    predictor_taps: int = 4,
) -> torch.Tensor:
    """One B'MOJO decode token per session (spec §3.9): publish at a chunk start, score, write the ring, attend.

    A session at position t > 0 with t % w == 0 first publishes (the ring then holds exactly positions t-w .. t-1):
    eidetic store <- TopM(store ∪ ring), fading K/V <- `fading_kv(y_buf[-m_f:])`. Then the token's innovation score
    is computed from y_buf, its K/V and score enter the ring at t % w, and q attends over the valid ring entries
    (slots <= t, all once t >= w-1), the fading and the eidetic entries (NoPE: key order is irrelevant).

    Args:
        q: `[B, Hq, dh]` bf16/fp16/fp32.  k, v: `[B, Hkv, dh]`.  y: `[B, D]` the tokens' SSM outputs.
        t .. eid_n: the `MemoryState` pool tensors `[S, ...]` as in `chunk_bmojo`; rows `state_indices` advance by
            one token, other rows are left untouched.
        state_indices: `[B]` int32, the pool row of each session (distinct).
        fading_kv: SSM outputs `[..., D]` -> fading (keys, values) `[..., Hkv, dh]`.
        predictor_taps: k of the innovation predictor.

    The sessions at a chunk boundary are found with `nonzero()`: a device sync.

    Returns:
        o: `[B, Hq, dh]` in q's dtype, the attention output (before W_O).
    """
    idx = state_indices.to(torch.int64)
    dev, w, m_f, m_e = q.device, ring_k.shape[1], fad_k.shape[1], eid_k.shape[1]
    pos = t.index_select(0, idx)  # [B] position of this token
    # Sessions at a chunk start publish first (the lazy rule: before their token is written to the ring).
    boundary = ((pos > 0) & (pos % w == 0)).nonzero().flatten()
    if boundary.numel():
        rows, s = idx[boundary], pos[boundary]
        eid = (eid_k, eid_v, eid_eps, eid_pos, eid_n)
        new = eidetic_update(
            *(x.index_select(0, rows) for x in (*eid, ring_k, ring_v, ring_eps)),
            s[:, None] - w + torch.arange(w, device=dev)[None, :],
        )
        for dst, src in zip(eid, new, strict=True):
            dst.index_copy_(0, rows, src.to(dst.dtype))
        if m_f:
            fk, fv = fading_kv(y_buf.index_select(0, rows)[:, y_buf.shape[1] - m_f :])  # y_{t-m_f} .. y_{t-1}
            fad_k.index_copy_(0, rows, fk.to(fad_k.dtype))
            fad_v.index_copy_(0, rows, fv.to(fad_v.dtype))
        fad_n.index_fill_(0, rows, m_f)
    eps, new_buf = innovation(y[:, None], y_buf.index_select(0, idx), predictor_taps)
    y_buf.index_copy_(0, idx, new_buf)
    entry = pos % w
    ring_k.index_put_((idx, entry), k.to(ring_k.dtype))
    ring_v.index_put_((idx, entry), v.to(ring_v.dtype))
    ring_eps.index_put_((idx, entry), eps[:, 0])
    keys = torch.cat([x.index_select(0, idx) for x in (ring_k, fad_k, eid_k)], 1)
    values = torch.cat([x.index_select(0, idx) for x in (ring_v, fad_v, eid_v)], 1)
    valid = torch.cat(
        [
            torch.arange(w, device=dev)[None, :] <= pos[:, None],
            torch.arange(m_f, device=dev)[None, :] < fad_n.index_select(0, idx)[:, None],
            torch.arange(m_e, device=dev)[None, :] < eid_n.index_select(0, idx)[:, None],
        ],
        1,
    )
    o = attend(q[:, None], keys, values, valid[:, None, :])[:, 0]
    t.index_copy_(0, idx, pos + 1)
    return o
