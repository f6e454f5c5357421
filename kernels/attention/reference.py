"""Reference attention in pure PyTorch: RoPE, masked grouped-query attention, and the slot-indexed KV-cache ops.

`apply_rope` and `attend` are the plain math. `chunk_attention` (packed variable-length causal prefill) and
`fused_recurrent_attention` (one decode token per session) serve the engine: each session's keys and values live in
rows of preallocated pool tensors, addressed by `state_indices`, together with its `length` (tokens seen). A full KV
cache stores position p at entry p and holds up to its capacity; with `window` set the cache is a ring of exactly
`window` entries, position p at entry p % window, and a query sees the last `window` tokens, itself included. The ops
rotate queries and keys by RoPE at their absolute positions (`length` + offset), so callers pass unrotated
projections; the cache stores rotated keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfree.kernels.common import state_math
from kvfree.kernels.dispatch import host_cu_seqlens, varlen_positions


class KVCacheFull(ValueError):
    """A session's context would not fit in its full KV cache; raised before any state is touched."""


# -- an fp8 (e4m3) cache: each session's KV heads hold k / k_scale and v / v_scale, scales kept with the session ------
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value: larger values saturate rather than become NaN


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x `[..., Hkv, D]` as the cache stores it: cast to `cache_dtype`, or, for an fp8 cache, divided by `scale`
    `[..., Hkv]` (broadcast over D) and saturated to e4m3's range first."""
    if scale is None:
        return x.to(cache_dtype)
    return (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache entries `[..., Hkv, D]` back in `dtype`: times `scale` `[..., Hkv]` for an fp8 cache."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale[..., None]).to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate `x` by its absolute positions (the "rotate half" layout of Llama / HF).

    x: `[..., T, H, D]` with D even; positions: `[T]` int. Returns a tensor like x.
    """
    D = x.shape[-1]
    cos, sin = rope_cos_sin(positions, D, theta)
    cos = torch.cat([cos, cos], dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat([sin, sin], dim=-1)[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., : D // 2], xf[..., D // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, D: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[T, D/2]` fp32 of the rotation angles at `positions` `[T]` (what `apply_rope` multiplies by)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, device=positions.device, dtype=torch.float32) / D))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return angles.cos(), angles.sin()


@state_math
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention with a boolean mask, grouped-query aware.

    Runs through `F.scaled_dot_product_attention`, so on a GPU the T x S score matrix is never materialised
    (a 128K-token prefill chunk would otherwise need gigabytes of fp32 scores); softmax accumulates in fp32.

    Args:
        q: `[B, T, Hq, D]`;  k, v: `[B, S, Hkv, D]` with Hkv dividing Hq;
        mask: `[B, T, S]` True where query t may attend key s (every row must allow at least one key).

    Returns:
        `[B, T, Hq, D]` in q's dtype.
    """
    Hq, Hkv = q.shape[2], k.shape[2]
    dtype = q.dtype
    k, v = k.to(dtype), v.to(dtype)
    if Hq != Hkv:  # grouped-query: each KV head serves Hq / Hkv query heads (no copy when they are equal)
        k, v = k.repeat_interleave(Hq // Hkv, dim=2), v.repeat_interleave(Hq // Hkv, dim=2)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None]
    )
    return out.transpose(1, 2)


# -- the slot-indexed serving ops ---------------------------------------------------------------------------------
def _check_capacity(k_cache: torch.Tensor, needed: int, window: int | None) -> None:
    """Raise before any write: a full cache must hold `needed` positions; a ring must have exactly `window` entries."""
    capacity = k_cache.shape[1]
    if window is not None and capacity != window:
        raise ValueError(f"window={window}: the ring must have {window} entries, the cache has {capacity}")
    if window is None and needed > capacity:
        raise KVCacheFull(f"a session needs {needed} tokens of context but the KV cache holds {capacity}")


def _rotate(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float) -> tuple[torch.Tensor, ...]:
    """q `[T, Hq, D]` and k `[T, Hkv, D]` rotated at `positions` `[T]` in one pass (the angles are computed once)."""
    return apply_rope(torch.cat([q, k], 1), positions, theta).split([q.shape[1], k.shape[1]], 1)


def _entries(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Cache entry of each absolute position: itself (full cache) or its ring slot."""
    return positions if window is None else positions % window


# Sessions share one padded attention call while padding keeps the group's work within 1.25x of the exact work plus
# this many score entries: a call's fixed cost outweighs a few thousand scores, so tiny sessions always share one.
_PAD_SLACK = 16384


def _groups(queries: list[int], keys: list[int]) -> list[list[int]]:
    """Sessions batched into padded attention calls: by key count, longest first, while padding stays cheap.

    `queries[i]` and `keys[i]` are session i's new tokens and the keys they see (past + new). Equal shapes always
    share a call; a long session does not drag short ones up to its size.
    """
    groups: list[list[int]] = []
    exact = t_max = k_max = 0
    for i in sorted(range(len(queries)), key=lambda i: (-keys[i], -queries[i])):
        if not queries[i]:
            continue
        tq, tk = max(t_max, queries[i]), max(k_max, keys[i])
        if groups and (len(groups[-1]) + 1) * tq * tk <= 1.25 * (exact + queries[i] * keys[i]) + _PAD_SLACK:
            groups[-1].append(i)
            exact, t_max, k_max = exact + queries[i] * keys[i], tq, tk
        else:
            groups.append([i])
            exact, t_max, k_max = queries[i] * keys[i], queries[i], keys[i]
    return [sorted(group) for group in groups]  # packed order within a group: one group of all is the packed layout


def _attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    past: torch.Tensor,
    first: torch.Tensor,
    t_max: int,
    p_max: int,
    window: int | None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of G sessions' new tokens over [their cached past | themselves], right-padded to one call.

    q, k, v: the packed (rotated) tokens of all sessions; rows, starts: `[G]` pool row and first packed token of each
    session of the group; past: `[G]` tokens seen before; first: `[G]` the first past position a new token may see;
    t_max, p_max: the longest new and visible past spans (host ints). Returns `[G, t_max, Hq, D]`; rows past a
    session's own length are padding.
    """
    dev = q.device
    j = torch.arange(t_max, device=dev)
    tok = (starts[:, None] + j[None, :]).clamp(max=q.shape[0] - 1)  # padding repeats a real token
    past_pos = first[:, None] + torch.arange(p_max, device=dev)[None, :]  # [G, Pmax]
    # Only the entries the chunk can see are gathered (a full cache row may hold max_context entries).
    entries = _entries(past_pos, window).clamp(max=k_cache.shape[1] - 1)
    # A session shorter than the group's longest past gathers entries past its length: whatever an earlier session of
    # its slot left there (resets do not clear a full cache, StatePool). The mask gives them no weight, but a weight
    # of 0 times a NaN or inf is NaN, so they are zeroed in the gathered copies.
    stale = (past_pos >= past[:, None])[..., None, None]  # [G, Pmax, 1, 1]
    ks = None if k_scale is None else k_scale[rows][:, None]  # [G, 1, Hkv]: each session's own scales
    vs = None if v_scale is None else v_scale[rows][:, None]
    past_k = dequantize(k_cache[rows[:, None], entries], k.dtype, ks).masked_fill_(stale, 0)
    past_v = dequantize(v_cache[rows[:, None], entries], v.dtype, vs).masked_fill_(stale, 0)
    keys, values = torch.cat([past_k, k[tok]], 1), torch.cat([past_v, v[tok]], 1)
    q_pos = past[:, None] + j[None, :]  # [G, Tmax]
    # Past padding gets a position no query reaches. New-token padding sits after every real query of its session,
    # so causality masks it, and a padding query still sees itself: no row of the mask is empty.
    far = torch.iinfo(torch.int64).max // 2
    key_pos = torch.cat([past_pos.masked_fill(stale[..., 0, 0], far), q_pos], 1)  # [G, Pmax + Tmax]
    mask = key_pos[:, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= key_pos[:, None, :] > q_pos[:, :, None] - window
    return attend(q[tok], keys, values, mask)


def chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rope_theta: float = 10000.0,
    window: int | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal prefill of packed variable-length sequences, each continuing its session's KV cache in the pool.

    Session i's n = `length` tokens seen so far sit in its cache; its T new tokens take positions n .. n+T-1, are
    rotated by RoPE there, attend to the cached past and to each other causally (with `window`: only keys at
    positions > p - window for the query at p), and are then written to the cache.

    Args:
        q: `[T, Hq, D]` bf16/fp16/fp32, unrotated queries of N sequences concatenated.
        k, v: `[T, Hkv, D]`, unrotated keys and values; Hkv divides Hq.
        k_cache, v_cache: `[S, C, Hkv, D]` pools (activation dtype). Rows `state_indices` receive the new tokens'
            rotated keys and values: at entries n .. n+T-1 of a full cache (C = max context), or at p % window for
            the last `window` positions p of each sequence in a ring (C = window).
        length: `[S]` int64 pool of tokens seen; rows `state_indices` grow by each sequence's T.
        state_indices: `[N]` int32, the pool row of each sequence (distinct).
        cu_seqlens: `[N+1]` int32, sequence boundaries in q (device), from 0 to T.
        rope_theta: RoPE base.
        window: None for full causal attention, else the sliding window (the cache's ring size).
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.
        k_scale, v_scale: `[S, Hkv]` fp32 pools, for an fp8 (e4m3) cache: session s's cache holds k / k_scale[s] and
            v / v_scale[s] per KV head (`quantize`); the new tokens attend to each other unquantized.

    Rows not named in `state_indices` are left untouched. Raises `KVCacheFull` (nothing written) when a full cache
    cannot hold n + T positions. The Triton implementation (chunk.py) plans, checks and writes with this one's code,
    rotates bit for bit as it does, and attends with a flash kernel over the cache rows in place (to rounding).

    Returns:
        `[T, Hq, D]` in q's dtype.
    """
    plan = plan_prefill(q, length, state_indices, cu_seqlens, cu_seqlens_cpu, k_cache, window)
    q, k = _rotate(q, k, plan.pos, rope_theta)
    out = _attend_prefill(q, k, v, k_cache, v_cache, plan, window, k_scale, v_scale)
    store_prefill(plan, k, v, k_cache, v_cache, length, window, k_scale, v_scale)
    return out


@dataclass(frozen=True)
class PrefillPlan:
    """What both implementations of `chunk_attention` know of a step before attending (`plan_prefill`).

    cu: the host sequence boundaries; idx: `[N]` int64 pool rows; past: `[N]` int64 tokens each session has seen;
    past_h, lens_h: the same and the new lengths on the host; seq, offset: `[T]` each packed token's sequence and
    place in it; lens: `[N]` new lengths; pos: `[T]` each token's absolute position.
    """

    cu: tuple[int, ...]
    idx: torch.Tensor
    past: torch.Tensor
    past_h: list[int]
    lens_h: list[int]
    seq: torch.Tensor
    offset: torch.Tensor
    lens: torch.Tensor
    pos: torch.Tensor


def plan_prefill(
    q: torch.Tensor,
    length: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor | list[int] | None,
    k_cache: torch.Tensor,
    window: int | None,
) -> PrefillPlan:
    """The step's boundaries and positions, with the capacity checked before anything is written (raises
    `KVCacheFull`). Reads the sessions' lengths on the host (one sync, like the host cu_seqlens)."""
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.shape[0])
    idx = state_indices.to(torch.int64)
    past = length.index_select(0, idx)  # [N] int64
    past_h = past.tolist()
    lens_h = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    _check_capacity(k_cache, max(n + t for n, t in zip(past_h, lens_h, strict=True)), window)
    seq, offset, lens = _positions(cu, str(q.device))
    pos = past[seq] + offset  # absolute position of every packed token
    return PrefillPlan(cu, idx, past, past_h, lens_h, seq, offset, lens, pos)


@functools.lru_cache(maxsize=8)
def _positions(cu: tuple[int, ...], device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`varlen_positions` of the boundaries, kept for the step's later layers (read only: nothing writes them)."""
    seq, offset, lens, _ = varlen_positions(cu, torch.device(device))
    return seq, offset, lens


def _attend_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    window: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The reference's attention of the rotated packed tokens over [cached past | themselves]: sessions in padded
    groups (`_groups`), each one masked `attend` call over the gathered cache entries. Returns `[T, Hq, D]`."""
    dev = q.device
    idx, past, past_h, lens_h = plan.idx, plan.past, plan.past_h, plan.lens_h
    first = torch.zeros_like(past) if window is None else (past - window + 1).clamp(min=0)
    visible = [n if window is None else min(n, window - 1) for n in past_h]  # past tokens a chunk can see
    # Per-session metadata stacked, so that a group's is one index away: rows, starts, past, first, lens.
    meta = torch.stack([idx, torch.tensor(plan.cu[:-1], dtype=torch.int64, device=dev), past, first, plan.lens])
    groups = _groups(lens_h, [p + t for p, t in zip(visible, lens_h, strict=True)])
    out = q.new_empty(q.shape)
    for group in groups:
        rows, starts, g_past, g_first, g_lens = meta if len(group) == len(lens_h) else meta[:, group].unbind()
        t_max = max(lens_h[i] for i in group)
        o = _attend_chunk(
            q, k, v, k_cache, v_cache, rows, starts, g_past, g_first, t_max, max(visible[i] for i in group), window,
            k_scale, v_scale,
        )  # fmt: skip
        j = torch.arange(t_max, device=dev)[None, :]
        real = j < g_lens[:, None]
        if len(groups) == 1:  # every session in one call, in packed order: the real rows are the packed tokens
            out = o[real]
        else:
            out[(starts[:, None] + j)[real]] = o[real]
    return out


def store_prefill(
    plan: PrefillPlan,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    window: int | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """The new tokens' rotated keys and values written to their sessions' cache entries (quantized for an fp8 cache),
    and the lengths grown. Called after attending: a ring keeps only each sequence's last `window` tokens, which the
    chunk's own earlier queries may still have needed."""
    rows, entries = plan.idx[plan.seq], _entries(plan.pos, window)
    if max(plan.lens_h) > k_cache.shape[1]:
        keep = plan.offset >= plan.lens[plan.seq] - k_cache.shape[1]
        rows, entries, k, v = rows[keep], entries[keep], k[keep], v[keep]
    k_cache.index_put_((rows, entries), quantize(k, k_cache.dtype, None if k_scale is None else k_scale[rows]))
    v_cache.index_put_((rows, entries), quantize(v, v_cache.dtype, None if v_scale is None else v_scale[rows]))
    length.index_copy_(0, plan.idx, plan.past + plan.lens)


def fused_recurrent_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    length: torch.Tensor,
    state_indices: torch.Tensor,
    rope_theta: float = 10000.0,
    window: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per session: rotate at position n = `length`, append to the cache, attend over it.

    Args:
        q: `[B, Hq, D]` bf16/fp16/fp32, unrotated.  k, v: `[B, Hkv, D]` unrotated; Hkv divides Hq.
        k_cache, v_cache: `[S, C, Hkv, D]` pools; rows `state_indices` receive the token's rotated key and value at
            entry n (full cache) or n % window (ring of C = window entries).
        length: `[S]` int64 pool of tokens seen; rows `state_indices` grow by one.
        state_indices: `[B]` int32, the pool row of each session (distinct).
        rope_theta: RoPE base.  window: None for full attention, else the sliding window (the ring size).
        k_scale, v_scale: `[S, Hkv]` fp32 pools for an fp8 cache (see `chunk_attention`); the token attends to its
            own key and value as stored, quantized.

    Rows not named in `state_indices` are left untouched. The reference raises `KVCacheFull` (nothing written) when
    a full cache is already full, reading the longest length on the host (it sizes the keys gathered: a device
    sync). The Triton implementation (fused_recurrent.py) reads nothing on the host and does not check capacity, so
    that decode can be captured in a CUDA graph: the engine bounds every session's context (prompt plus max_tokens
    within max_context), and a session past it keeps overwriting its last entry rather than write out of bounds.

    Returns:
        `[B, Hq, D]` in q's dtype.
    """
    idx = state_indices.to(torch.int64)
    n = length.index_select(0, idx)  # [B] tokens seen before this one
    longest = int(n.max())
    _check_capacity(k_cache, longest + 1, window)
    q = append_token(q, k, v, k_cache, v_cache, idx, n, _entries(n, window), rope_theta, k_scale, v_scale)
    # Only the first min(n+1, C) entries hold this session's keys; for a ring that is all of them once it has
    # wrapped, and RoPE already encodes the positions, so entry order does not matter.
    used = min(longest + 1, k_cache.shape[1])
    mask = torch.arange(used, device=q.device)[None, :] < (n + 1)[:, None]
    # Entries past a session's own length hold what an earlier session of its slot left (resets do not clear a
    # full cache): zeroed in the gathered copies, since a softmax weight of 0 times a NaN or inf is NaN.
    stale = ~mask[..., None, None]
    ks = None if k_scale is None else k_scale.index_select(0, idx)[:, None]  # [B, 1, Hkv]: each session's scales
    vs = None if v_scale is None else v_scale.index_select(0, idx)[:, None]
    keys = dequantize(k_cache[idx, :used], k.dtype, ks).masked_fill_(stale, 0)
    values = dequantize(v_cache[idx, :used], v.dtype, vs).masked_fill_(stale, 0)
    out = _attend_one(q, keys, values, mask)
    length.index_copy_(0, idx, n + 1)
    return out


def check_fp8_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the cache is fp8 (scales given); ValueError unless both scale pools are `[S, Hkv]`, alike and contiguous
    along Hkv (what the Triton kernels index)."""
    fp8 = k_scale is not None
    if fp8 and (v_scale is None or k_scale.stride() != v_scale.stride() or k_scale.stride(1) != 1):
        raise ValueError("an fp8 cache needs k_scale and v_scale pools [S, Hkv], contiguous along Hkv")
    return fp8


def append_token(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    idx: torch.Tensor, n: torch.Tensor, entry: torch.Tensor, rope_theta: float,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """The decode token's part both implementations share: q and k rotated at positions `n` `[B]`, the key and value
    written (quantized for an fp8 cache) at `entry` `[B]` of rows `idx` `[B]` int64. Returns the rotated q."""
    q, k = _rotate(q, k, n, rope_theta)  # the token axis is the batch axis here: one position per session
    ks = None if k_scale is None else k_scale.index_select(0, idx)  # [B, Hkv]
    vs = None if v_scale is None else v_scale.index_select(0, idx)
    k_cache.index_put_((idx, entry), quantize(k, k_cache.dtype, ks))
    v_cache.index_put_((idx, entry), quantize(v, v_cache.dtype, vs))
    return q


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per session, grouped-query without copying keys: q `[B, Hq, D]`, k, v `[B, S, Hkv, D]`, mask
    `[B, S]` -> `[B, Hq, D]` in q's dtype. Scores and softmax in fp32 (a `[B, Hq, S]` tensor: small for one query),
    where `attend`'s repeat of the keys for every query head would copy the whole gathered cache Hq/Hkv times."""
    B, Hq, D = q.shape
    Hkv = k.shape[2]
    qg = q.unflatten(1, (Hkv, Hq // Hkv)).float()  # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bshd->bhgs", qg, k.float()) * D**-0.5
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgs,bshd->bhgd", torch.softmax(scores, dim=-1), v.float())
    return out.flatten(1, 2).to(q.dtype)
