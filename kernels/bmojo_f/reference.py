"""Reference B'MOJO-F attention in pure PyTorch: sliding-window attention joined with attention over fading tokens.

For the token at position i of a session (docs/design/hmf.md, engine/model/layers/bmojo_f.py), with window W:

    in-context keys and values  k, v    at positions i-W+1 .. i        scored by q  . k  * scale
    fading keys and values      kf, vf  at positions i-2W+1 .. i-W     scored by qf . kf * scale
    o_i = softmax over both score sets (one softmax) applied to [v | vf]

Positions below 0 do not exist (a session's first tokens see fewer keys; position i always sees itself). Queries and
keys come in already normed and rotated at their own positions (the layer's `_qkv`); scores, softmax and sums run in
fp32 (fp64 for fp64 inputs).

`bmojo_f_attention` is the plain math on whole sequences from a fresh state (the training forward).
`chunk_bmojo_f_attention` (packed variable-length prefill) and `fused_recurrent_bmojo_f_attention` (one decode token
per session) serve the engine: each session's past lives in rows of pool tensors addressed by `state_indices`, its
last W in-context keys and values in the rings `k_ctx`, `v_ctx` `[S, W, Hkv, D]` and its last 2W fading keys and
values in `k_fade`, `v_fade` `[S, 2W, Hkv, D]` (position p at entry p % W, resp. p % 2W), with `length` `[S]` int64
its tokens seen. The ops attend, write the new keys and values into the rings (each sequence's last W, resp. 2W) and
grow `length`. The prefill reads the boundaries and the sessions' lengths on the host; the decode reads nothing on
the host (fixed shapes: it can be captured in a CUDA graph).
"""

from __future__ import annotations

import functools
import math

import torch

from kvfree.kernels.common import state_math, work_dtype
from kvfree.kernels.dispatch import host_cu_seqlens, padded_groups

# Queries per step of the banded attention: the score tensors of one step hold about this many elements (a 16K
# prompt at W=2048 and 32 heads would otherwise need 4 GB of scores per key set).
_SCORE_BUDGET = 1 << 26


def _attend_bands(
    q: torch.Tensor,
    qf: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    kf: torch.Tensor,
    vf: torch.Tensor,
    past: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """The banded attention of padded sequences whose keys are laid out relative to their queries.

    Args:
        q, qf: `[N, Tm, Hq, D]` queries of the two paths at offsets j = 0..Tm-1 (positions past + j).
        kc, vc: `[N, W + Tm, Hkv, D]` in-context keys and values, entry e at position past - W + e.
        kf, vf: `[N, 2W + Tm, Hkv, D]` fading keys and values, entry e at position past - 2W + e.
        past: `[N]` int64 tokens each sequence had seen before offset 0.

    Returns:
        `[N, Tm, Hq, D]` in the work dtype (fp32, or fp64 for fp64 inputs).

    Query j's in-context keys are entries j+1 .. j+W of kc and its fading keys entries j+1 .. j+W of kf: the same
    entries for every sequence, so a block of queries reads one slice of each for the whole batch; entries at
    positions below 0 are masked out.
    """
    N, Tm, Hq, D = q.shape
    Hkv = kc.shape[2]
    G, W, f = Hq // Hkv, window, work_dtype(q)
    # step queries read step + W - 1 entries of each set: step (step + W) 2 N Hq scores within the budget.
    cap = _SCORE_BUDGET // (2 * N * Hq)
    step = max(1, min(Tm, (math.isqrt(W * W + 4 * cap) - W) // 2))
    out = []
    for c0 in range(0, Tm, step):
        c1 = min(c0 + step, Tm)
        j = torch.arange(c0, c1, device=q.device)
        e = torch.arange(c0 + 1, c1 + W, device=q.device)  # the entries this block of queries reads, both sets
        rel = e[None, :] - j[:, None]  # [Qc, S]: in band where 1 <= rel <= W
        band = (rel >= 1) & (rel <= W)
        exists_c = past[:, None] - W + e[None, :] >= 0  # [N, S]
        exists_f = past[:, None] - 2 * W + e[None, :] >= 0
        qc = q[:, c0:c1].to(f).unflatten(2, (Hkv, G))
        qff = qf[:, c0:c1].to(f).unflatten(2, (Hkv, G))
        s_c = torch.einsum("nqhgd,nshd->nhgqs", qc, kc[:, c0 + 1 : c1 + W].to(f)) * scale
        s_f = torch.einsum("nqhgd,nshd->nhgqs", qff, kf[:, c0 + 1 : c1 + W].to(f)) * scale
        s_c = s_c.masked_fill(~(band[None] & exists_c[:, None, :])[:, None, None], float("-inf"))
        s_f = s_f.masked_fill(~(band[None] & exists_f[:, None, :])[:, None, None], float("-inf"))
        p = torch.softmax(torch.cat([s_c, s_f], dim=-1), dim=-1)  # one softmax over both key sets
        p_c, p_f = p.split([s_c.shape[-1], s_f.shape[-1]], dim=-1)
        o = torch.einsum("nhgqs,nshd->nqhgd", p_c, vc[:, c0 + 1 : c1 + W].to(f))
        o = o + torch.einsum("nhgqs,nshd->nqhgd", p_f, vf[:, c0 + 1 : c1 + W].to(f))
        out.append(o.flatten(2, 3))
    return torch.cat(out, dim=1)


@state_math
def bmojo_f_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qf: torch.Tensor,
    kf: torch.Tensor,
    vf: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """B'MOJO-F attention of whole sequences from a fresh state (differentiable: the training forward).

    Args:
        q, qf: `[B, T, Hq, D]` in-context and fading-path queries.  k, v, kf, vf: `[B, T, Hkv, D]` (Hkv divides Hq).
        window: W.  scale: the score scale (head_dim ** -0.5).

    Returns:
        `[B, T, Hq, D]` in q's dtype.
    """
    B, T, Hkv, D = k.shape
    W = window
    zeros = k.new_zeros(B, 2 * W, Hkv, D)  # positions before 0: masked out
    kc, vc = torch.cat([zeros[:, :W], k], 1), torch.cat([zeros[:, :W], v], 1)
    kff, vff = torch.cat([zeros.to(kf.dtype), kf], 1), torch.cat([zeros.to(vf.dtype), vf], 1)
    past = torch.zeros(B, dtype=torch.int64, device=q.device)
    return _attend_bands(q, qf, kc, vc, kff, vff, past, W, scale).to(q.dtype)


def check_rings(k_ctx: torch.Tensor, k_fade: torch.Tensor, window: int) -> None:
    """Raises ValueError unless the rings hold W in-context and 2W fading entries a session (the ops' check)."""
    W = window
    if k_ctx.shape[1] != W or k_fade.shape[1] != 2 * W:
        raise ValueError(f"window={W}: the rings must hold {W} and {2 * W} entries, got {k_ctx.shape[1]} and "
                         f"{k_fade.shape[1]}")  # fmt: skip


def _ring_keys(ring: torch.Tensor, rows: torch.Tensor, first: torch.Tensor, count: int) -> torch.Tensor:
    """`count` ring entries per session from position `first` `[N]` on, in position order -> `[N, count, Hkv, D]`;
    positions below 0 read as zeros (they hold nothing of the session's; a new session's ring may hold stale rows)."""
    p = first[:, None] + torch.arange(count, device=first.device)[None, :]
    got = ring[rows[:, None], p % ring.shape[1]]
    return torch.where((p >= 0)[..., None, None], got, torch.zeros((), dtype=got.dtype, device=got.device))


@functools.lru_cache(maxsize=64)
def _last_tokens(cu: tuple[int, ...], size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed tokens among the last `size` of each sequence (the ones a ring of `size` keeps), on the host:
    (`tokens` `[t]` int64 on the packed axis, `seq` `[t]` their sequences, `offset` `[t]` their offsets in it)."""
    tokens, seq, offset = [], [], []
    for i in range(len(cu) - 1):
        lo = max(cu[i], cu[i + 1] - size)
        tokens.extend(range(lo, cu[i + 1]))
        seq.extend([i] * (cu[i + 1] - lo))
        offset.extend(range(lo - cu[i], cu[i + 1] - cu[i]))
    return tuple(torch.tensor(x, dtype=torch.int64) for x in (tokens, seq, offset))  # type: ignore[return-value]


def write_rings(
    k: torch.Tensor,
    v: torch.Tensor,
    kf: torch.Tensor,
    vf: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_fade: torch.Tensor,
    v_fade: torch.Tensor,
    idx: torch.Tensor,
    past: torch.Tensor,
    cu: tuple[int, ...],
) -> None:
    """Each packed sequence's last W in-context and last 2W fading keys and values into its session's rings (entry
    (past + offset) % size), cast to the rings' dtype. Every destination is written once (no duplicate indices)."""
    for kk, vv, k_ring, v_ring in ((k, v, k_ctx, v_ctx), (kf, vf, k_fade, v_fade)):
        size = k_ring.shape[1]
        tokens, seq, offset = (t.to(k.device) for t in _last_tokens(cu, size))
        if tokens.numel() == 0:
            continue
        rows, entries = idx[seq], (past[seq] + offset) % size
        k_ring.index_put_((rows, entries), kk[tokens].to(k_ring.dtype))
        v_ring.index_put_((rows, entries), vv[tokens].to(v_ring.dtype))


@state_math
def chunk_bmojo_f_attention(
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
) -> torch.Tensor:
    """Packed variable-length B'MOJO-F prefill continuing each session from its rings; updates the rings and length.

    Args:
        q, qf: `[T, Hq, D]` in-context and fading-path queries, rotated at their positions.
        k, v: `[T, Hkv, D]` in-context keys (rotated) and values; kf, vf: `[T, Hkv, D]` fading keys (rotated) and
            values (Hkv divides Hq).
        k_ctx, v_ctx: `[S, W, Hkv, D]` pools of in-context rings; k_fade, v_fade: `[S, 2W, Hkv, D]` fading rings
            (position p at entry p % size, keys rotated).
        length: `[S]` int64 tokens seen per pool row.  state_indices: `[N]` int pool rows of the N sessions.
        cu_seqlens: `[N+1]` int32 boundaries of the sessions' tokens on the packed axis (a sequence may be empty);
            cu_seqlens_cpu: the same on the host, to save a device read.
        window: W.  scale: the score scale (head_dim ** -0.5).

    Returns:
        `[T, Hq, D]` in q's dtype. Session i's new tokens sit at positions length[i] .. length[i] + T_i - 1; the
        rings receive each sequence's last W (resp. 2W) keys and values and length grows by T_i.
    """
    W = window
    check_rings(k_ctx, k_fade, W)
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.shape[0])
    idx = state_indices.to(torch.int64)
    past_all = length.index_select(0, idx)
    out = q.new_empty(q.shape)  # every token belongs to a group (empty sequences have none)
    for group in padded_groups(cu, q.device):
        rows, past = idx[group.seqs], past_all[group.seqs]
        kn, vn, kfn, vfn = (group.pad(t) for t in (k, v, kf, vf))
        kc = torch.cat([_ring_keys(k_ctx, rows, past - W, W).to(kn.dtype), kn], 1)
        vc = torch.cat([_ring_keys(v_ctx, rows, past - W, W).to(vn.dtype), vn], 1)
        kff = torch.cat([_ring_keys(k_fade, rows, past - 2 * W, 2 * W).to(kfn.dtype), kfn], 1)
        vff = torch.cat([_ring_keys(v_fade, rows, past - 2 * W, 2 * W).to(vfn.dtype), vfn], 1)
        o = _attend_bands(group.pad(q), group.pad(qf), kc, vc, kff, vff, past, W, scale)
        group.scatter(o.to(out.dtype), out)
    # Written after attending: a ring entry the chunk overwrites may still be read by the chunk's earlier queries.
    write_rings(k, v, kf, vf, k_ctx, v_ctx, k_fade, v_fade, idx, past_all, cu)
    lens = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:], strict=True)], dtype=torch.int64)
    length.index_copy_(0, idx, past_all + lens.to(length.device))
    return out


@state_math
def fused_recurrent_bmojo_f_attention(
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
    window: int,
    scale: float,
) -> torch.Tensor:
    """One B'MOJO-F decode token per session: attends over its rings and itself, writes it into the rings, length += 1.

    Args:
        q, qf: `[B, Hq, D]` in-context and fading-path queries, rotated at the token's position (length).
        k, v, kf, vf: `[B, Hkv, D]` the token's in-context and fading keys (rotated) and values (Hkv divides Hq).
        k_ctx, v_ctx, k_fade, v_fade, length: the pools, as `chunk_bmojo_f_attention`'s.
        state_indices: `[B]` int pool rows (distinct).  window: W.  scale: the score scale.

    Returns:
        `[B, Hq, D]` in q's dtype. Nothing is read on the host and every shape is fixed by the inputs, so the call
        can be captured in a CUDA graph. The token at position n overwrites entries n % W and n % 2W, which hold
        positions n - W and n - 2W: outside its bands, so reading and writing do not overlap.
    """
    B, Hq, D = q.shape
    Hkv, W, f = k.shape[1], window, work_dtype(q)
    idx = state_indices.to(torch.int64)
    n = length.index_select(0, idx)
    kc = torch.cat([_ring_keys(k_ctx, idx, n - W + 1, W - 1).to(f), k[:, None].to(f)], 1)  # [B, W, Hkv, D]
    vc = torch.cat([_ring_keys(v_ctx, idx, n - W + 1, W - 1).to(f), v[:, None].to(f)], 1)
    kff = _ring_keys(k_fade, idx, n - 2 * W + 1, W).to(f)  # positions n-2W+1 .. n-W
    vff = _ring_keys(v_fade, idx, n - 2 * W + 1, W).to(f)
    j = torch.arange(W, device=q.device)
    exists_c = n[:, None] - W + 1 + j[None, :] >= 0  # [B, W]
    exists_f = n[:, None] - 2 * W + 1 + j[None, :] >= 0
    qc, qff = q.to(f).unflatten(1, (Hkv, -1)), qf.to(f).unflatten(1, (Hkv, -1))
    s_c = torch.einsum("bhgd,bshd->bhgs", qc, kc) * scale
    s_f = torch.einsum("bhgd,bshd->bhgs", qff, kff) * scale
    s_c = s_c.masked_fill(~exists_c[:, None, None], float("-inf"))
    s_f = s_f.masked_fill(~exists_f[:, None, None], float("-inf"))
    p = torch.softmax(torch.cat([s_c, s_f], dim=-1), dim=-1)
    o = torch.einsum("bhgs,bshd->bhgd", p[..., :W], vc) + torch.einsum("bhgs,bshd->bhgd", p[..., W:], vff)
    k_ctx.index_put_((idx, n % W), k.to(k_ctx.dtype))
    v_ctx.index_put_((idx, n % W), v.to(v_ctx.dtype))
    k_fade.index_put_((idx, n % (2 * W)), kf.to(k_fade.dtype))
    v_fade.index_put_((idx, n % (2 * W)), vf.to(v_fade.dtype))
    length.index_copy_(0, idx, n + 1)
    return o.flatten(1, 2).to(q.dtype)
