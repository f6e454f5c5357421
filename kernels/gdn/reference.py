"""Reference Gated DeltaNet (GDN) state math in pure PyTorch: the gated delta rule (Yang, Kautz & Hatamizadeh 2024).

Per head, with L2-normalised keys and queries, write strength beta_t in (0, 1] (or (0, 2] with negative eigenvalues)
and log-decay g_t <= 0:

    S'_t = exp(g_t) S_{t-1}                           [D, Dv] fp32 state: the decay
    u_t  = beta_t (v_t - S'_t^T k_t)                  the delta rule: write what the state does not yet predict
    S_t  = S'_t + k_t u_t^T
    o_t  = scale S_t^T q_t

`gdn_step` is the decode form (one token). `gdn_chunked` is the prefill/training form, chunk by chunk in the WY form:
within a chunk of C tokens with cumulative log-decay G (G_c = g_1 + ... + g_c) and start state S0,

    A[i, j] = beta_i exp(G_i - G_j) k_i . k_j   (j < i, else 0)       T = (I + A)^-1   (unit lower triangular)
    W = T (beta exp(G) K)      U = T (beta V)      U' = U - W S0       (U' row t is u_t)
    O = scale ((exp(G) Q) S0 + (exp(G_i - G_j) q_i . k_j)_{j <= i} U')
    S_end = exp(G_C) S0 + (exp(G_C - G) K)^T U'

so only the carry of S from chunk to chunk is sequential; W and U need nothing from earlier chunks.

`chunk_gdn` (packed variable-length prefill) and `fused_recurrent_gdn` (one decode step) are the serving ops: they
read each session's state from a row of a preallocated pool, by slot, and write the new state back in place.

State math runs in fp32, or in fp64 when the inputs are fp64 (used by the tests).
"""

from __future__ import annotations

import torch

from kvfree.kernels.common import state_math, to_chunks, work_dtype
from kvfree.kernels.dispatch import host_cu_seqlens, padded_groups


@state_math
def gdn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One gated-delta-rule step for B sessions.

    Args:
        q: `[B, H, D]` L2-normalised queries.  k: `[B, H, D]` L2-normalised keys.  v: `[B, H, Dv]` values.
        g: `[B, H]` log decay (<= 0).  beta: `[B, H]` write strength.  state: `[B, H, D, Dv]`.  scale: output scale.

    Returns:
        o: `[B, H, Dv]`; the new state `[B, H, D, Dv]` (fp32, or fp64 for fp64 inputs).
    """
    f = work_dtype(q, state)
    q, k, v, beta = q.to(f), k.to(f), v.to(f), beta.to(f)
    s = torch.exp(g.to(f))[..., None, None] * state.to(f)
    # Products by broadcasting and sums (not matmul), so that the update is bitwise independent of the batch.
    u = beta.unsqueeze(-1) * (v - (k.unsqueeze(-1) * s).sum(-2))
    s = s + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = scale * (q.unsqueeze(-1) * s).sum(-2)
    return o, s


@state_math
def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, token by token: q, k `[B, T, H, D]`, v `[B, T, H, Dv]`, g, beta `[B, T, H]`, state `[B, H, D,
    Dv]` -> (o `[B, T, H, Dv]`, final state), by `gdn_step` (the tests' float64 truth for `gdn_chunked`)."""
    outs = []
    for t in range(q.shape[1]):
        o, state = gdn_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, scale)
        outs.append(o)
    f = work_dtype(q, state)
    return (torch.stack(outs, 1) if outs else q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=f)), state.to(f)


@state_math
def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over B sequences of T tokens each, from `state`, in the chunked WY form (module
    docstring). Differentiable.

    Args:
        q: `[B, T, H, D]` L2-normalised queries.  k: `[B, T, H, D]` L2-normalised keys.  v: `[B, T, H, Dv]` values.
        g: `[B, T, H]` log decay (<= 0).  beta: `[B, T, H]` write strength.  state: `[B, H, D, Dv]` initial states.
        scale: output scale.  chunk_size: C (the result does not depend on it beyond rounding).

    Returns:
        o: `[B, T, H, Dv]`; the final state `[B, H, D, Dv]` (fp32, or fp64 for fp64 inputs).
    """
    B, T, H, _ = q.shape
    Dv = v.shape[-1]
    f = work_dtype(q, state)
    s = state.to(f)
    if T == 0:
        return q.new_zeros(B, 0, H, Dv, dtype=f), s
    C = chunk_size
    # Padding tokens have q = k = v = 0, beta = 0 and g = 0 (decay 1): they leave the state unchanged.
    Q, K, V = (to_chunks(t.to(f), C) for t in (q, k, v))  # [B, H, nc, C, D|Dv]
    G = torch.cumsum(to_chunks(g.to(f), C), dim=-1)  # [B, H, nc, C] cumulative log decay within each chunk
    Bt = to_chunks(beta.to(f), C).unsqueeze(-1)  # [B, H, nc, C, 1]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) on and below the diagonal; the exponent is masked before exp (above it, it may be large).
    decay = torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")))
    kk = (K @ K.transpose(-1, -2)) * decay
    eye = torch.eye(C, dtype=f, device=q.device)
    # T (I + A) = I with A strictly lower: one unit-triangular solve gives W and U for every chunk at once.
    a = eye + (Bt * kk).masked_fill(~lower.tril(-1), 0.0)
    rhs = torch.cat([Bt * torch.exp(G).unsqueeze(-1) * K, Bt * V], dim=-1)
    W, U = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True).split([K.shape[-1], Dv], -1)
    qk = (Q @ K.transpose(-1, -2)) * decay  # [B, H, nc, C, C], zero above the diagonal
    Qg = Q * torch.exp(G).unsqueeze(-1)
    Kend = K * torch.exp(G[..., -1:] - G).unsqueeze(-1)  # each key's decay to its chunk's end
    outs = []
    for n in range(Q.shape[2]):  # the only sequential part: the state carried from chunk to chunk
        u = U[:, :, n] - W[:, :, n] @ s
        outs.append(scale * (Qg[:, :, n] @ s + qk[:, :, n] @ u))
        s = torch.exp(G[:, :, n, -1])[..., None, None] * s + Kend[:, :, n].transpose(-1, -2) @ u
    O = torch.stack(outs, dim=2)  # [B, H, nc, C, Dv]
    return O.movedim(1, 3).reshape(B, -1, H, Dv)[:, :T], s


# -- the serving ops: packed variable-length prefill and decode on pool rows ----------------------------------------
@state_math
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
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """Chunked gated-delta-rule prefill over packed variable-length sequences, states in place in their pool.

    Args:
        q: `[T, H, D]` L2-normalised queries of N sequences concatenated.  k: `[T, H, D]` L2-normalised keys.
        v: `[T, H, Dv]` values.  g: `[T, H]` log decay (<= 0).  beta: `[T, H]` write strength.
        state: `[S, H, D, Dv]` fp32 pool. Rows `state_indices` hold the initial states and receive the final ones;
            other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence.
        cu_seqlens: `[N+1]` int32, sequence boundaries in q (device), from 0 to T.
        scale: output scale (D^-1/2).
        chunk_size: tokens per chunk; chunks never cross a sequence boundary.
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.

    Returns:
        o: `[T, H, Dv]` in q's dtype (computed in fp32, or fp64 for fp64 inputs or pools).
    """
    T, H, _ = q.shape
    Dv = v.shape[-1]
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    f = work_dtype(q, state)
    o = q.new_zeros(T, H, Dv, dtype=f)
    idx = state_indices.to(torch.int64)
    # Sequences of similar length share one padded call (padding leaves states unchanged, see gdn_chunked).
    for group in padded_groups(cu, q.device):
        rows = idx[group.seqs]
        out, s_end = gdn_chunked(
            *(group.pad(t) for t in (q, k, v, g, beta)), state.index_select(0, rows), scale, chunk_size
        )
        group.scatter(out, o)
        state.index_copy_(0, rows, s_end.to(state.dtype))
    return o.to(q.dtype)


def fused_recurrent_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One gated-delta-rule decode step per session (`gdn_step`), its state updated in place in its pool.

    Args:
        q: `[B, H, D]` L2-normalised queries.  k: `[B, H, D]` L2-normalised keys.  v: `[B, H, Dv]` values.
        g: `[B, H]` log decay (<= 0).  beta: `[B, H]` write strength.
        state: `[S, H, D, Dv]` fp32 pool; rows `state_indices` take the step, other rows are left untouched.
        state_indices: `[B]` int32, the pool row of each session.
        scale: output scale (D^-1/2).

    Returns:
        o: `[B, H, Dv]` in q's dtype, `scale * S^T q` with the new S.
    """
    idx = state_indices.to(torch.int64)
    o, s_new = gdn_step(q, k, v, g, beta, state.index_select(0, idx), scale)
    state.index_copy_(0, idx, s_new.to(state.dtype))
    return o.to(q.dtype)
