"""Reference B'MOJO memory math in pure PyTorch (docs/design/bmojo.md §3.3-§3.10, "semantics C").

For the token at absolute position t (chunk c = t // w, chunk start s = c*w) the attention keys are

    window   : positions max(0, t-w+1) .. t                     (raw tokens, the current one included)
    fading   : m_f SSM outputs y_{s-m_f} .. y_{s-1}            (c >= 1)
    eidetic  : TopM_{m_e} of positions 0 .. s-1 by key (innovation eps desc, position asc)   (c >= 1)

so the memory changes once per chunk. The functions here are the pieces the B'MOJO layer composes:

- `innovation`: eps_t = mean_d (y_t - mean(y_{t-1..t-k}))^2, a fixed depthwise causal conv (kernels/conv) whose tail
  (the last outputs of the session) is carried in the state;
- `topm_index` / `eidetic_update`: the bounded eidetic store, merged once per chunk boundary;
- `chunked_memory_attention`: the per-chunk block form of the paper's interleaved sliding window (spec §3.10).

All selection arithmetic is fp32 (scores) and int64 (positions), whatever the activation dtype.
"""

from __future__ import annotations

import torch

from kvfree.kernels.attention import attend
from kvfree.kernels.common import state_math
from kvfree.kernels.conv import causal_conv1d


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
    L, D = y_buf.shape[1], y.shape[-1]
    # e_t = y_t - sum_i alpha_i y_{t-i} is a depthwise causal conv with L+1 taps; taps older than k are zero.
    weight = torch.zeros(D, L + 1, dtype=torch.float32, device=y.device)
    weight[:, L - taps : L] = -1.0 / taps
    weight[:, L] = 1.0
    err, new_buf = causal_conv1d(y.float(), weight, None, y_buf.float())
    return err.pow(2).mean(-1), new_buf


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
    first_chunk_start: int,
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
        first_chunk_start: absolute position of the first query (a multiple of w).

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
    prev_pos = first_chunk_start - w + torch.arange(n, device=dev)[:, None] * w + j[None, :]  # [n, w]
    prev_ok = (j[None, :] > j[:, None])[None] & (prev_pos >= 0)[:, None, :]  # [n, w(query), w(key)]
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
