"""Reference Gated KalmaNet (GKA) state math in pure PyTorch (docs/design/gka.md §4-§6).

Per head, with keys and values already scaled by the write gate and log-decay g_t <= 0 (gamma_t = exp(g_t)):

    H_t  = gamma_t H_{t-1} + k_t k_t^T                 [D, D]   key covariance (symmetric PSD), fp32
    S_t  = gamma_t S_{t-1} + k_t v_t^T                 [D, Dv]  key-value state, fp32
    s_t  = ||H_t||_F ,  lambda_t = a s_t
    x_t  = CH(H_t + lambda_t I, q_t, r)                Chebyshev iteration, r steps (§4.5, omega_0 = 2)
    q'_t = q_t + alpha_t (x_t - q_t)                   alpha-connection
    o_t  = scale S_t^T q'_t

`gka_step` is the decode form (one token, the state matrices explicit). `gka_chunked` is the prefill/training
form: within a chunk of C tokens every H_t is used implicitly as `zeta_t H_0 + sum_j Lambda[t, j] k_j k_j^T`,
its Frobenius norm comes from the three-term formula of §6.1, the C Chebyshev solves of a chunk run as one
matrix iteration (§6.2), and the output is chunked gated linear attention (§6.3). All chunks are solved at
once after a cheap sequential pass that forms the chunk-start states.

`chunk_gka` (packed variable-length prefill) and `fused_recurrent_gka` (one decode step) are the serving ops, slot-
indexed like `kvfree.kernels.mamba2`'s: they read each session's (H, S) from rows of preallocated pools and write the
new states back in place. `chunk_gka` lays every sequence's chunks side by side in one row (no padding beyond whole
chunks), so all sequences share one Chebyshev solve; only the cheap chunk-start pass runs per sequence.

`gka_step`, `gka_chunked` and both serving ops take `decay_h` (keyword, default True). False is hybrid-model-factory's
`use_forgetting_gate_kk = false`: H_t = H_{t-1} + k_t k_t^T (H's decays are those of g = 0: zeta = 1, Lambda = 1 on
and below the diagonal) while S still decays with g. Everything that reads H (its Frobenius norm, hence the ridge,
and the Chebyshev matvec) uses H's own decays; the output uses S's.

State math runs in fp32, or in fp64 when the inputs are fp64 (used by the tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvfree.kernels.common import state_math, to_chunks, work_dtype
from kvfree.kernels.dispatch import chunk_metadata, host_cu_seqlens, varlen_positions
from kvfree.kernels.mamba2.reference import segsum

# Squared Frobenius norms are clamped here before the square root: ||H|| = 0 only when every key seen is exactly
# zero (docs/design/gka.md §5.2 / §13.16 guard); the clamp keeps the step size and the sqrt gradient finite.
_MIN_FRO_SQ = 1e-30


def omega_schedule(ridge: float, num_iter: int) -> list[float]:
    """The Chebyshev weights omega_1..omega_r for ridge ratio a (host floats; data-independent, §4.4).

    omega_0 = 2 (App. B.1, Lemma 3, and the public code; Alg. 1's printed omega_0 = 0 is a typo, §13.2);
    omega_i = 1 / (1 - (rho^2 / 4) omega_{i-1}) with rho = (L - mu)/(L + mu) = 1/(1 + 2a) for every token.
    """
    rho2_4 = (0.5 / (1.0 + 2.0 * ridge)) ** 2
    out, w = [], 2.0
    for _ in range(num_iter):
        w = 1.0 / (1.0 - rho2_4 * w)
        out.append(w)
    return out


def chebyshev_solve(
    matvec: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor, fro: torch.Tensor, ridge: float, num_iter: int
) -> torch.Tensor:
    """Approximately solve `(H + a s I) x = q` by `num_iter` Chebyshev steps (docs/design/gka.md §4.5, code form).

    Args:
        matvec: X -> H X applied row-wise to a tensor shaped like `q` (H symmetric PSD, one H per row).
        q: `[..., D]` right-hand sides.
        fro: `[..., 1]` s = ||H||_F of each row's H (> 0); eigenvalue bounds mu = a s, L = s + a s.
        ridge: a.  num_iter: r >= 0.

    Returns:
        x: `[..., D]` the r-th iterate (a fixed polynomial in H applied to q; linear in q).
    """
    lam = ridge * fro
    step = 2.0 / ((1.0 + 2.0 * ridge) * fro)  # 2 / (L + mu)
    x_prev = torch.zeros_like(q)
    x = step * q
    for w in omega_schedule(ridge, num_iter):
        t = (step * w) * (matvec(x) + lam * x - q) + (w - 1.0) * x_prev
        x_prev, x = x, w * x - t
    return x


@state_math
def gka_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
    *,
    decay_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step for B sessions (docs/design/gka.md §5.2, in its exact order).

    Args:
        q: `[B, He, D]` L2-normalised queries.  k: `[B, He, D]` L2-normalised keys times (beta + 1e-6).
        v: `[B, He, Dv]` values times (beta + 1e-6).  g: `[B, He]` log forget gate (<= 0).  alpha: `[B, He]`.
        h: `[B, He, D, D]` key covariance.  s: `[B, He, D, Dv]` key-value state.
        ridge: a.  num_iter: r.  scale: output scale (D^-1/2).
        decay_h: False: H is not decayed (H + k k^T; hmf's use_forgetting_gate_kk = false), S still is.

    Returns:
        o: `[B, He, Dv]`; new h `[B, He, D, D]`; new s `[B, He, D, Dv]` (fp32, or fp64 for fp64 inputs).
    """
    f = work_dtype(q, h)
    q, k, v, alpha = q.to(f), k.to(f), v.to(f), alpha.to(f)
    gamma = torch.exp(g.to(f))[..., None, None]
    # Outer products by broadcasting (not matmul) so the state update is bitwise independent of the batch.
    h = (gamma * h.to(f) if decay_h else h.to(f)) + k.unsqueeze(-1) * k.unsqueeze(-2)
    fro = h.square().sum((-2, -1)).clamp_min(_MIN_FRO_SQ).sqrt().unsqueeze(-1)  # [B, He, 1], direct norm
    x = chebyshev_solve(lambda z: (h @ z.unsqueeze(-1)).squeeze(-1), q, fro, ridge, num_iter)
    qp = q + alpha.unsqueeze(-1) * (x - q)
    s = gamma * s.to(f) + k.unsqueeze(-1) * v.unsqueeze(-2)
    o = scale * (qp.unsqueeze(-2) @ s).squeeze(-2)
    return o, h, s


def _decays(G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """zeta `[..., C]` (decay from the chunk start to token c, inclusive) and Lambda `[..., C, C]` of log decays G."""
    # Lambda[c, j] = exp(g_{j+1} + ... + g_c) for j <= c, else 0. Summed increments (segsum), not differences
    # of a cumsum, so that strong decay neither loses precision nor turns into 0/0.
    return torch.exp(torch.cumsum(G, dim=-1)), torch.exp(segsum(G))


def _chunk_summaries(
    K: torch.Tensor, V: torch.Tensor, G: torch.Tensor, decay_h: bool = True
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor, torch.Tensor]:
    """What each chunk needs of its own tokens, for chunk tensors `[B, He, nc, C, *]` (any chunk layout).

    Returns S's decays (zeta `[B, He, nc, C]`: decay from the chunk start to token c, inclusive; Lambda `[B, He, nc,
    C, C]`), H's (the same, or those of G = 0 without `decay_h`), and the chunk's own contribution to the state at its
    end, dh `[B, He, nc, D, D]` and ds `[B, He, nc, D, Dv]`.
    """
    dec_s = _decays(G)
    dec_h = dec_s if decay_h else _decays(torch.zeros_like(G))
    # lam[..., -1, :]: the decay from token j to the chunk end
    dh = torch.einsum("bhncd,bhnc,bhnce->bhnde", K, dec_h[1][..., -1, :], K)
    ds = torch.einsum("bhncd,bhnc,bhnce->bhnde", K, dec_s[1][..., -1, :], V)
    return dec_s, dec_h, dh, ds


def _carry(
    zh_end: torch.Tensor, zs_end: torch.Tensor, dh: torch.Tensor, ds: torch.Tensor, h0: torch.Tensor, s0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunk-start states by a sequential pass over the nc chunks of each sequence (cheap elementwise work).

    zh_end, zs_end: `[B, He, nc]` whole-chunk decays of H and of S.  dh, ds: `[B, He, nc, D, D|Dv]`
    (`_chunk_summaries`).  h0, s0: `[B, He, D, D|Dv]` the states before the first chunk. A chunk with decays 1 and
    dh = ds = 0 passes the state on exactly.

    Returns H0 `[B, He, nc, D, D]`, S0 `[B, He, nc, D, Dv]` (the states each chunk starts from) and the final h, s.
    """
    zh_end, zs_end = zh_end[..., None, None], zs_end[..., None, None]
    hs, ss = [h0], [s0]
    for n in range(zs_end.shape[2]):
        hs.append(zh_end[:, :, n] * hs[-1] + dh[:, :, n])
        ss.append(zs_end[:, :, n] * ss[-1] + ds[:, :, n])
    return torch.stack(hs[:-1], dim=2), torch.stack(ss[:-1], dim=2), hs[-1], ss[-1]


def _chunk_outputs(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    A: torch.Tensor,
    dec_s: tuple[torch.Tensor, torch.Tensor],
    dec_h: tuple[torch.Tensor, torch.Tensor],
    H0: torch.Tensor,
    S0: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
) -> torch.Tensor:
    """The outputs `[B, He, nc, C, Dv]` of every chunk at once from its start states (§6.1-§6.3); chunks independent.

    dec_s, dec_h: (zeta, Lambda) of S and of H (`_chunk_summaries`): the norm and the solve read H's, the output S's.
    """
    zh, lh = dec_h
    # ||H_c||_F^2 for every token of every chunk at once (three-term formula, §6.1):
    #   zeta_c^2 ||H0||^2 + 2 zeta_c sum_j Lam[c,j] k_j^T H0 k_j + sum_{j,j'} Lam[c,j] Lam[c,j'] (k_j . k_j')^2
    gram = K @ K.transpose(-1, -2)  # [B, He, nc, C, C]
    p = torch.einsum("bhncd,bhnde,bhnce->bhnc", K, H0, K)
    fro_sq = (
        zh.square() * H0.square().sum((-2, -1)).unsqueeze(-1)
        + 2.0 * zh * (lh @ p.unsqueeze(-1)).squeeze(-1)
        + ((lh @ gram.square()) * lh).sum(-1)
    )
    fro = fro_sq.clamp_min(_MIN_FRO_SQ).sqrt().unsqueeze(-1)  # [B, He, nc, C, 1]

    # Chebyshev for all queries at once (§6.2): row c of matvec(X) is H_c x_c, never forming H_c.
    def matvec(X: torch.Tensor) -> torch.Tensor:
        return zh.unsqueeze(-1) * (X @ H0) + ((X @ K.transpose(-1, -2)) * lh) @ K

    X = chebyshev_solve(matvec, Q, fro, ridge, num_iter)
    Qp = Q + A.unsqueeze(-1) * (X - Q)

    # Chunked gated linear attention with the blended queries (§6.3), with S's decays.
    zeta, lam = dec_s
    return scale * (zeta.unsqueeze(-1) * (Qp @ S0) + ((Qp @ K.transpose(-1, -2)) * lam) @ V)


@state_math
def gka_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h0: torch.Tensor,
    s0: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
    chunk_size: int,
    *,
    decay_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GKA over B sequences of T tokens each, continuing from states (h0, s0) (docs/design/gka.md §6). Differentiable.

    Args:
        q: `[B, T, He, D]` L2-normalised queries.  k: `[B, T, He, D]` normalised keys times (beta + 1e-6).
        v: `[B, T, He, Dv]` values times (beta + 1e-6).  g: `[B, T, He]` log forget gates (<= 0).
        alpha: `[B, T, He]` alpha-connection gates.  h0: `[B, He, D, D]`, s0: `[B, He, D, Dv]` initial states.
        ridge: a.  num_iter: r.  scale: output scale.  chunk_size: C.
        decay_h: False: H is not decayed (hmf's use_forgetting_gate_kk = false), S still is.

    Returns:
        o: `[B, T, He, Dv]`; final h `[B, He, D, D]`; final s `[B, He, D, Dv]` (fp32, or fp64 for fp64 inputs).
    """
    B, T, He, D = q.shape
    Dv = v.shape[-1]
    f = work_dtype(q, h0)
    h0, s0 = h0.to(f), s0.to(f)
    if T == 0:
        return q.new_zeros(B, 0, He, Dv, dtype=f), h0, s0
    C = chunk_size
    # Padding tokens have k = v = q = 0 and g = 0 (decay 1): they leave the state unchanged and output zeros.
    Q, K, V = (to_chunks(t.to(f), C) for t in (q, k, v))  # [B, He, nc, C, D|Dv]
    G = to_chunks(g.to(f), C)  # [B, He, nc, C]
    A = to_chunks(alpha.to(f), C)
    nc = Q.shape[2]
    dec_s, dec_h, dh, ds = _chunk_summaries(K, V, G, decay_h)
    H0, S0, h, s = _carry(dec_h[0][..., -1], dec_s[0][..., -1], dh, ds, h0, s0)
    O = _chunk_outputs(Q, K, V, A, dec_s, dec_h, H0, S0, ridge, num_iter, scale)  # [B, He, nc, C, Dv]
    o = O.movedim(1, 3).reshape(B, nc * C, He, Dv)[:, :T]
    return o, h, s


# -- the serving ops: packed variable-length prefill and decode on pool rows ----------------------------------------
def _varlen_chunks(
    cu: tuple[int, ...], chunk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """The chunk layout of packed sequences: each sequence zero-padded to whole chunks, all chunks in one row.

    Returns (`dest` `[T]` int64: each packed token's place on the chunk-padded axis of NC * chunk tokens,
    `chunk_seq`, `chunk_idx` `[NC]` int64: each chunk's sequence and its index within it, NC, the most chunks of one
    sequence). An empty sequence has no chunks.
    """
    indices, offsets, nc = chunk_metadata(cu, chunk, device)
    seq, pos, _, _ = varlen_positions(cu, device)
    dest = offsets.long()[seq] * chunk + pos
    counts = [-(-(cu[i + 1] - cu[i]) // chunk) for i in range(len(cu) - 1)]
    indices = indices.long()
    return dest, indices[:, 0], indices[:, 1], nc, max(counts)


def _gka_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h0: torch.Tensor,
    s0: torch.Tensor,
    cu: tuple[int, ...],
    ridge: float,
    num_iter: int,
    scale: float,
    chunk_size: int,
    decay_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gka_chunked` on packed sequences of any lengths: q `[T, He, D]` ... (as `chunk_gka`), h0, s0 `[N, He, D,
    D|Dv]` and host boundaries `cu` -> (o `[T, He, Dv]`, final h, final s), all in the work dtype.

    Every sequence's chunks lie side by side in one row (no padding beyond whole chunks), so one Chebyshev solve
    serves all sequences; only the cheap chunk-start pass runs per sequence (padded to the most chunks).
    """
    T, He, _ = q.shape
    Dv = v.shape[-1]
    f = h0.dtype
    C = chunk_size
    dest, chunk_seq, chunk_idx, nc, most = _varlen_chunks(cu, C, q.device)

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # [T, He, *] -> [1, He, NC, C, *]: padding tokens have k = v = q = 0 and g = 0 (decay 1), so they leave the
        # state unchanged and output zeros, as in gka_chunked.
        out = t.new_zeros(nc * C, *t.shape[1:], dtype=f)
        out[dest] = t.to(f)
        return out.view(1, nc, C, *t.shape[1:]).movedim(3, 1)

    Q, K, V, G, A = (chunks(t) for t in (q, k, v, g, alpha))
    dec_s, dec_h, dh, ds = _chunk_summaries(K, V, G, decay_h)

    # The chunk-start states per sequence: lay the chunk summaries out as [N, He, most, ...] (missing chunks pass the
    # state on: decay 1, no increment), run gka_chunked's pass, and read each real chunk's start state back.
    def per_seq(t: torch.Tensor, fill: float) -> torch.Tensor:
        out = t.new_full((len(cu) - 1, He, most, *t.shape[3:]), fill)
        out[chunk_seq, :, chunk_idx] = t[0].movedim(1, 0)
        return out

    H0, S0, h, s = _carry(
        per_seq(dec_h[0][..., -1], 1.0), per_seq(dec_s[0][..., -1], 1.0), per_seq(dh, 0.0), per_seq(ds, 0.0), h0, s0
    )
    H0, S0 = (t[chunk_seq, :, chunk_idx].movedim(0, 1)[None] for t in (H0, S0))  # [1, He, NC, D, D|Dv]
    O = _chunk_outputs(Q, K, V, A, dec_s, dec_h, H0, S0, ridge, num_iter, scale)  # [1, He, NC, C, Dv]
    return O[0].movedim(0, 2).reshape(nc * C, He, Dv)[dest], h, s


@state_math
def chunk_gka(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
    decay_h: bool = True,
) -> torch.Tensor:
    """Chunked GKA prefill over packed variable-length sequences, states (h, s) in place in their pools.

    Args:
        q: `[T, He, D]` L2-normalised queries of N sequences concatenated.
        k: `[T, He, D]` L2-normalised keys times (beta + 1e-6).  v: `[T, He, Dv]` values times (beta + 1e-6).
        g: `[T, He]` log forget gates (<= 0).  alpha: `[T, He]` alpha-connection gates.
        h: `[S, He, D, D]` fp32 key-covariance pool.  s: `[S, He, D, Dv]` fp32 key-value pool. Rows `state_indices`
            hold the initial states and receive the final ones; other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence.
        cu_seqlens: `[N+1]` int32, sequence boundaries in q (device), from 0 to T.
        ridge: a.  num_iter: r (Chebyshev steps).  scale: output scale (D^-1/2).
        chunk_size: tokens per chunk; chunks never cross a sequence boundary. The result does not depend on it
            beyond rounding.
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.
        decay_h: False: H is not decayed (H_t = H_{t-1} + k k^T; hmf's use_forgetting_gate_kk = false), S still is.

    Returns:
        o: `[T, He, Dv]` in q's dtype (computed in fp32, or fp64 for fp64 inputs or pools).
    """
    T, He, _ = q.shape
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    if T == 0:
        return q.new_zeros(0, He, v.shape[-1])
    f = work_dtype(q, h)
    idx = state_indices.to(torch.int64)
    h0, s0 = h.index_select(0, idx).to(f), s.index_select(0, idx).to(f)
    N = len(cu) - 1
    if all(cu[i + 1] - cu[i] == T // N for i in range(N)):
        # Equal lengths (a single sequence included): a plain batch for gka_chunked, no chunk layout to build.
        o, h_end, s_end = gka_chunked(
            *(t.unflatten(0, (N, T // N)) for t in (q, k, v, g, alpha)), h0, s0, ridge, num_iter, scale, chunk_size,
            decay_h=decay_h,
        )
        o = o.flatten(0, 1)
    else:
        o, h_end, s_end = _gka_varlen(q, k, v, g, alpha, h0, s0, cu, ridge, num_iter, scale, chunk_size, decay_h)
    h.index_copy_(0, idx, h_end.to(h.dtype))
    s.index_copy_(0, idx, s_end.to(s.dtype))
    return o.to(q.dtype)


def fused_recurrent_gka(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    alpha: torch.Tensor,
    h: torch.Tensor,
    s: torch.Tensor,
    state_indices: torch.Tensor,
    ridge: float,
    num_iter: int,
    scale: float,
    *,
    decay_h: bool = True,
) -> torch.Tensor:
    """One GKA decode step per session (`gka_step`), its states (h, s) updated in place in their pools.

    Args:
        q: `[B, He, D]` L2-normalised queries.  k: `[B, He, D]` L2-normalised keys times (beta + 1e-6).
        v: `[B, He, Dv]` values times (beta + 1e-6).  g: `[B, He]` log forget gates (<= 0).  alpha: `[B, He]`.
        h: `[S, He, D, D]` fp32 pool; rows `state_indices` become `exp(g) h + k k^T` (`h + k k^T` without decay_h).
        s: `[S, He, D, Dv]` fp32 pool; rows `state_indices` become `exp(g) s + k v^T`. Other rows are left untouched.
        state_indices: `[B]` int32, the pool row of each session.
        ridge: a.  num_iter: r (Chebyshev steps).  scale: output scale (D^-1/2).
        decay_h: False: H is not decayed (hmf's use_forgetting_gate_kk = false), S still is.

    Returns:
        o: `[B, He, Dv]` in q's dtype, `scale * S^T q'` with the new S.
    """
    idx = state_indices.to(torch.int64)
    o, h_new, s_new = gka_step(
        q, k, v, g, alpha, h.index_select(0, idx), s.index_select(0, idx), ridge, num_iter, scale, decay_h=decay_h
    )
    h.index_copy_(0, idx, h_new.to(h.dtype))
    s.index_copy_(0, idx, s_new.to(s.dtype))
    return o.to(q.dtype)
