"""Reference SKA (Spectral Koopman Attention, Echo; docs/design/ska.md) in pure PyTorch.

Per (session, head) SKA keeps raw second-order sums of its own keys z (width r) and values v (width P):

    G = sum_t a_t z_t z_t^T        M = sum_t a_t a_{t-1} z_t z_{t-1}^T        C = sum_t a_t v_t z_t^T

and reads a query q out through one linear map per operator (docs/design/ska.md §2.6, "J"):

    J = eta * c^K * C G'^-1 (M G'^-1)^K,     G' = G + eps * m^2 * I = L L^T,
    c = gamma / max(1, sigma_max(L^-1 M L^-T)),      y = J q.

The stats are kept UNnormalised: dividing keys and queries by the key max-norm m (the paper's eq. 3) is
exactly the same as using the ridge eps * m^2 on raw stats (docs/design/ska.md §2.3), so m only enters the ridge and the
state never needs rescaling when m changes. J equals the paper's App. F pipeline (Cholesky, whitened operator,
spectral normalisation, value map, whitened query, power filter, unwhitening) for every query (§2.6).

Modes (docs/design/ska.md §3.3-3.4), all reading and writing the same `SKAState`:

- chunk-causal (`ska_chunked`, training forward and mode-C prefill; `ska_step(mode="C")` for decode): the
  queries of chunk c = [cS, (c+1)S) on the ABSOLUTE position grid read the operator of all tokens < cS.
- prefix (`ska_prefix`, mode-P prefill; `ska_step(mode="P")`): the operator of all tokens so far, this
  segment included, read by every token of the segment (non-causal within a prompt, as the paper's prefix mode).

Key max-norm m (`key_norm`, docs/design/ska.md §3.3 [PROPOSAL], §8 item 1):

- "causal" (default): the ridge of the operator built at a chunk boundary uses m = max ||a_t z_t|| over the
  tokens that operator contains. Training forward, prefill (any split) and decode are then the same function.
- "frozen" (the paper): m = max key norm of a session's FIRST segment (the whole sequence in training, the
  first prefill when serving), then frozen. Non-causal inside that first segment, and a split first prefill
  differs from one prefill.

Serving ops (the engine's op shape, docs/design/architecture.md §3): `chunk_ska` (packed variable-length prefill,
mode C or P) and `fused_recurrent_ska` (one decode token per session) read each session's `SKAState` from rows of
preallocated pool tensors and write the new state back in place; they are built on `ska_chunked` / `ska_prefix` /
`ska_step`, which are the math on batches of sessions.

Precision: keys, queries and values are fp32; the stats G, M, C and everything from them up to J are in the
dtype of the state's accumulators (`acc_dtype`, fp64 by default in the engine: docs/design/ska.md §5 recommends fp64
accumulators for sessions beyond ~16K tokens, and at r <= 64 the r^3 work per chunk is cheap); J is cast to fp32
for the per-token readout y = J q.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvfree.kernels.common import state_math
from kvfree.kernels.dispatch import host_cu_seqlens, varlen_positions

logger = logging.getLogger(__name__)

MODES = ("C", "P")  # decode_mode: chunk-causal (ska.md §3.3) or the paper's prefix mode (§3.4)
M_FLOOR = 1e-6  # docs/design/ska.md §2.3: m = max(max ||z||, 1e-6)
JITTERS = (1e-4, 1e-3, 1e-2)  # docs/design/ska.md §3.3/§5: Cholesky retries with (jitter * m^2) I added
_FALLBACKS = [0]


def cholesky_fallback_count() -> int:
    """How many Cholesky factorisations needed the jitter fallback since the process started (a diagnostic)."""
    return _FALLBACKS[0]


class SKAState(NamedTuple):
    """The per-session state of one SKA layer, batched over B sessions (docs/design/ska.md §3.2).

    G: `[B, H, r, r]` acc dtype, sum a_t z_t z_t^T (raw keys, no ridge inside).
    M: `[B, H, r, r]` acc dtype, sum a_t a_{t-1} z_t z_{t-1}^T.
    C: `[B, H, P, r]` acc dtype, sum a_t v_t z_t^T.
    z_prev: `[B, H, r]` fp32, a_{t-1} z_{t-1} of the last token consumed (0 for a new session); storing the
        masked key makes a separate a_prev flag unnecessary.
    m: `[B, H]` fp32, key max-norm (see `key_norm`); 0 for a new session.
    J: `[B, H, P, r]` fp32, cached readout of the operator that the last consumed token's chunk reads
        (mode C) or of all tokens so far (mode P); 0 for a new session.
    pos: `[B]` int64, tokens consumed (absolute position of the next token).
    """

    G: torch.Tensor
    M: torch.Tensor
    C: torch.Tensor
    z_prev: torch.Tensor
    m: torch.Tensor
    J: torch.Tensor
    pos: torch.Tensor


def ska_empty_state(
    batch: int,
    heads: int,
    rank: int,
    head_dim: int,
    acc_dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> SKAState:
    """The state of B new sessions (all zeros)."""
    B, H, r, P = batch, heads, rank, head_dim
    f32 = torch.float32
    return SKAState(
        G=torch.zeros(B, H, r, r, dtype=acc_dtype, device=device),
        M=torch.zeros(B, H, r, r, dtype=acc_dtype, device=device),
        C=torch.zeros(B, H, P, r, dtype=acc_dtype, device=device),
        z_prev=torch.zeros(B, H, r, dtype=f32, device=device),
        m=torch.zeros(B, H, dtype=f32, device=device),
        J=torch.zeros(B, H, P, r, dtype=f32, device=device),
        pos=torch.zeros(B, dtype=torch.int64, device=device),
    )


# -- the operator: G, M, C, m -> J ------------------------------------------------------------------------------
def robust_cholesky(G: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """Lower Cholesky factor of symmetric G `[..., r, r]`; where it fails, retry with (1e-4, 1e-3, 1e-2) * unit * I.

    unit: `[...]` the jitter unit (m^2, so the jitter is relative to the raw key scale; docs/design/ska.md §3.3).
    Each fallback is counted (`cholesky_fallback_count`) and logged. Raises FloatingPointError if all fail.
    """
    L, info = torch.linalg.cholesky_ex(G)
    if not bool((info > 0).any()):
        return L
    eye = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
    jitter = torch.zeros_like(unit)
    for scale in JITTERS:
        bad = info > 0
        _FALLBACKS[0] += int(bad.sum())
        logger.warning("SKA: Cholesky failed for %d operator(s); retrying with jitter %g*m^2", int(bad.sum()), scale)
        jitter = torch.where(bad, scale * unit, jitter)
        L, info = torch.linalg.cholesky_ex(G + jitter[..., None, None] * eye)
        if not bool((info > 0).any()):
            return L
    raise FloatingPointError("SKA: Cholesky failed even with jitter 1e-2*m^2 (non-finite statistics?)")


@torch.no_grad()
def power_iteration_sigma(A: torch.Tensor, iters: int) -> torch.Tensor:
    """sigma_max estimate of A `[..., r, r]` -> `[...]` (detached; docs/design/ska.md §2.5 [PROPOSAL], matching REPO).

    v0 = 1/sqrt(r); repeat `iters` times: u = A v / ||A v||, v = A^T u / ||A^T u|| (norms clamped at 1e-8);
    sigma = ||A v||. A few steps under-estimate sigma; the paper uses 6.
    """
    r = A.shape[-1]
    v = torch.full((*A.shape[:-1],), 1.0 / math.sqrt(r), dtype=A.dtype, device=A.device)
    for _ in range(iters):
        u = (A @ v.unsqueeze(-1)).squeeze(-1)
        u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-8)
        v = (A.mT @ u.unsqueeze(-1)).squeeze(-1)
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    return (A @ v.unsqueeze(-1)).squeeze(-1).norm(dim=-1)


@state_math
def ska_readout(
    G: torch.Tensor,
    M: torch.Tensor,
    C: torch.Tensor,
    m: torch.Tensor,
    *,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
) -> torch.Tensor:
    """The readout J = eta c^K C G'^-1 (M G'^-1)^K of raw stats (docs/design/ska.md §2.6, §3.3 make_J).

    G, M: `[..., r, r]`; C: `[..., P, r]` (all one dtype, the compute dtype); m: `[...]` key max-norm (floored at
    1e-6), which sets the ridge G' = G + eps m^2 I. eta, gamma: scalars (gamma already constrained to [1, 1.5]).
    order: K. Returns J `[..., P, r]` in G's dtype; differentiable in G, M, C, eta, gamma (sigma is detached).
    """
    dt = G.dtype
    r = G.shape[-1]
    unit = m.to(dt).clamp_min(M_FLOOR).square()
    eye = torch.eye(r, dtype=dt, device=G.device)
    Gt = G + (eps * unit)[..., None, None] * eye
    Gt = 0.5 * (Gt + Gt.mT)  # exact symmetry for the factorisation ([PROPOSAL] §2.8)
    L = robust_cholesky(Gt, unit)
    with torch.no_grad():  # whitened operator A_w = L^-1 M L^-T only serves the (detached) spectral norm
        Ld = L.detach()
        Y = torch.linalg.solve_triangular(Ld, M.detach(), upper=False)
        Aw = torch.linalg.solve_triangular(Ld, Y.mT, upper=False).mT
        sigma = power_iteration_sigma(Aw, power_iters)
    c = torch.as_tensor(gamma, dtype=dt, device=G.device) / sigma.clamp_min(1.0)
    # X <- C G'^-1, then K times X <- X M G'^-1 (G' symmetric, so (X M G'^-1)^T = G'^-1 M^T X^T).
    X = torch.cholesky_solve(C.mT, L).mT
    for _ in range(order):
        X = torch.cholesky_solve((X @ M).mT, L).mT
    scale = torch.as_tensor(eta, dtype=dt, device=G.device) * c.pow(order)
    return scale[..., None, None] * X


# -- chunk-causal extend (training forward, mode-C prefill) ------------------------------------------------------
def _grid(x: torch.Tensor, front: int, nc: int, S: int) -> torch.Tensor:
    """`[B, T, ...]` -> `[B, nc, S, ...]`, zero rows in front (aligning to the absolute chunk grid) and at the end."""
    B, T = x.shape[:2]
    back = nc * S - front - T
    pad = [0, 0] * (x.dim() - 2) + [front, back]
    return F.pad(x, pad).view(B, nc, S, *x.shape[2:])


def _with_padding(a: torch.Tensor | None, lens: torch.Tensor | None, T: int) -> torch.Tensor | None:
    """The action mask `[B, T]` with each row's right padding (positions >= lens) set to 0, so it is never written
    into the statistics (a masked key is 0: it adds nothing to G, M, C, and its norm 0 never raises m)."""
    if lens is None:
        return a
    real = torch.arange(T, device=lens.device) < lens[:, None]
    return real if a is None else a * real


def _take(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    """`x[b, idx[b]]` for every row b of x `[B, N, ...]`; `x[:, -1]` when idx is None."""
    return x[:, -1] if idx is None else x[torch.arange(x.shape[0], device=x.device), idx]


def _mask_keys(z: torch.Tensor, v: torch.Tensor, a: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if a is None:
        return z, v
    w = a.to(z.dtype)[..., None, None]
    return z * w, v * w


def _chunk_stats(
    z: torch.Tensor, v: torch.Tensor, a: torch.Tensor | None, state: SKAState, front: int, nc: int, S: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked keys and the per-chunk sums of G, M, C over new tokens placed at offset `front` of an nc-chunk grid.

    z: `[B, T, H, r]`, v: `[B, T, H, P]`, a: `[B, T]` or None. Returns (a z `[B, T, H, r]`, Gc, Mc `[B, nc, H, r, r]`,
    Cc `[B, nc, H, P, r]`) in the state's accumulator dtype. Each lag pair z_t z_{t-1}^T belongs to the chunk of its
    later token t (eqs. 7 + 9); the first token's partner is the stored z_prev.
    """
    acc = state.G.dtype
    zw, vw = _mask_keys(z, v, a)
    zl = torch.cat([state.z_prev[:, None].to(zw.dtype), zw[:, :-1]], dim=1)  # lag partner of each token
    zc, lc, vc = (_grid(t.to(acc), front, nc, S) for t in (zw, zl, vw))  # [B, nc, S, H, r|P]
    Gc = torch.einsum("bcshr,bcshk->bchrk", zc, zc)
    Mc = torch.einsum("bcshr,bcshk->bchrk", zc, lc)
    Cc = torch.einsum("bcshp,bcshr->bchpr", vc, zc)
    return zw, Gc, Mc, Cc


def _segment_m(
    m0: torch.Tensor, norms: torch.Tensor, t0: int, key_norm: str
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per-chunk running key max (causal) or the frozen m, and the m to store. norms: `[B, nc, S, H]`."""
    if key_norm == "causal":
        cm = torch.cummax(norms.amax(dim=2), dim=1).values  # [B, nc, H]: max over chunks <= c
        starts = torch.cat([m0[:, None], torch.maximum(m0[:, None], cm[:, :-1])], dim=1)  # max over tokens < cS
        return starts, torch.maximum(m0, cm[:, -1])
    m = norms.amax(dim=(1, 2)) if t0 == 0 else m0  # paper: seq-max of the first segment, then frozen
    return None, m


@state_math
def ska_chunked(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    t0: int,
    *,
    chunk_size: int,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    a: torch.Tensor | None = None,
    lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SKAState]:
    """Chunk-causal SKA (eqs. 7-10) over T new tokens of B sessions that all start at absolute position t0.

    This is `extend` of ska.md §3.3: the first chunk may be partial and continue the stored state (its queries
    read the stored J); its first lag pair uses the stored z_prev; the totals at each later chunk boundary are
    stored + exclusive cumsum of the per-chunk sums, and each later chunk gets a fresh J. With a fresh state and
    t0 = 0 it is the training forward (chunk 0 outputs exactly 0).

    Args:
        z, q: `[B, T, H, r]` raw keys and queries (fp32).  v: `[B, T, H, P]` values (fp32).
        state: the sessions' `SKAState` (pos is assumed to equal t0 for every row, but see t0).
        t0: host int, the absolute position of the first new token (sets the chunk grid). Only `t0 % chunk_size`
            and `t0 == 0` enter the math (state.pos carries each row's own position), so rows at different
            positions that agree on both can share one call (`chunk_ska` batches them so).
        a: optional `[B, T]` action mask in {0, 1} (0 = the token is not written into the stats, e.g. padding).
        lens: optional `[B]` int64, row b's real tokens are its first lens[b] (>= 1): the rest is right padding,
            masked out of the stats; its outputs are meaningless and the state is taken at each row's last real token.

    Returns:
        y `[B, T, H, P]` fp32, and the new state (totals over all tokens < t0 + T, z_prev = a z of the last token,
        J of the chunk holding the last token, pos = t0 + T; with `lens`, T is each row's lens).
    """
    B, T, H, r = z.shape
    S = chunk_size
    front = t0 % S
    nc = -(-(front + T) // S)
    zw, Gc, Mc, Cc = _chunk_stats(z, v, _with_padding(a, lens, T), state, front, nc, S)
    Gcs, Mcs, Ccs = Gc.cumsum(1), Mc.cumsum(1), Cc.cumsum(1)
    norms = _grid(zw.detach().norm(dim=-1), front, nc, S)  # [B, nc, S, H]; m is detached (docs/design/ska.md §2.9)
    m_starts, m_new = _segment_m(state.m, norms, t0, key_norm)

    # Operators to build: every chunk c >= 1 (stats of all tokens < its start), and chunk 0 when it starts at t0 > 0.
    # Chunk 0 of a continued, partial chunk reads the stored J; chunk 0 of a new session reads J = 0 (empty stats).
    first = 0 if (front == 0 and t0 > 0) else 1
    Js = []
    if front > 0 or t0 == 0:
        Js.append((state.J if front > 0 else torch.zeros_like(state.J))[:, None])
    if first < nc:

        def excl(cs: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
            starts = torch.cat([torch.zeros_like(cs[:, :1]), cs[:, :-1]], dim=1)[:, first:]
            return base[:, None] + starts

        ms = m_starts[:, first:] if m_starts is not None else m_new[:, None].expand(B, nc - first, H)
        J = ska_readout(
            excl(Gcs, state.G),
            excl(Mcs, state.M),
            excl(Ccs, state.C),
            ms,
            eps=eps,
            eta=eta,
            gamma=gamma,
            order=order,
            power_iters=power_iters,
        )
        Js.append(J.float())
    Jall = torch.cat(Js, dim=1)  # [B, nc, H, P, r]
    y = torch.einsum("bcshr,bchpr->bcshp", _grid(q.float(), front, nc, S), Jall)
    y = y.reshape(B, nc * S, H, -1)[:, front : front + T]
    last = None if lens is None else lens - 1  # each row's last real token
    new = SKAState(  # padding adds exact zeros to the totals and to the running max
        G=state.G + Gcs[:, -1],
        M=state.M + Mcs[:, -1],
        C=state.C + Ccs[:, -1],
        z_prev=_take(zw, last).float(),
        m=m_new,
        J=_take(Jall, None if last is None else (front + last) // S),
        pos=state.pos + (T if lens is None else lens),
    )
    return y, new


# -- prefix mode extend (mode-P prefill) -------------------------------------------------------------------------
@state_math
def ska_prefix(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    t0: int,
    *,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    a: torch.Tensor | None = None,
    chunk_size: int = 64,
    lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SKAState]:
    """The paper's prefix mode (ska.md §3.4) over T new tokens: add all of them to the stats, build ONE J from the
    totals, and read every new token through it (y_t = J q_t, non-causal within the segment).

    Shapes, `a` and `lens` as `ska_chunked` (only `t0 == 0` matters here). The stats are summed per chunk of
    `chunk_size` tokens then added (ska.md §5 rec. 1), so mode P and mode C leave the same totals. A one-token call is
    the paper's inclusive decode step.
    """
    B, T, H, r = z.shape
    zw, Gc, Mc, Cc = _chunk_stats(z, v, _with_padding(a, lens, T), state, 0, -(-T // chunk_size), chunk_size)
    G, M, C = state.G + Gc.sum(1), state.M + Mc.sum(1), state.C + Cc.sum(1)
    m = _update_m(state.m, zw.detach().norm(dim=-1).amax(dim=1), torch.tensor(t0 == 0), key_norm)
    J = ska_readout(G, M, C, m, eps=eps, eta=eta, gamma=gamma, order=order, power_iters=power_iters).float()
    y = torch.einsum("bthr,bhpr->bthp", q.float(), J)
    z_prev = _take(zw, None if lens is None else lens - 1).float()
    return y, SKAState(G=G, M=M, C=C, z_prev=z_prev, m=m, J=J, pos=state.pos + (T if lens is None else lens))


def _update_m(m0: torch.Tensor, norms: torch.Tensor, first: torch.Tensor, key_norm: str) -> torch.Tensor:
    """New key max-norm `[B, H]` after new keys of max norm `norms` `[B, H]`: the running max ("causal"), or
    ("frozen") the new keys' max where this is a session's first segment (`first`, broadcastable bool) else m0."""
    if key_norm == "causal":
        return torch.maximum(m0, norms)
    return torch.where(first.to(norms.device), norms, m0)


# -- decode: one token per session, sessions at different positions ---------------------------------------------
def _accumulate(state: SKAState, z: torch.Tensor, v: torch.Tensor, a: torch.Tensor | None, key_norm: str) -> SKAState:
    """Add one token per session (z `[B, H, r]`, v `[B, H, P]`) to the stats: three rank-1 updates."""
    zw, vw = _mask_keys(z, v, a)
    acc = state.G.dtype
    za, va, zp = zw.to(acc), vw.to(acc), state.z_prev.to(acc)
    m = _update_m(state.m, zw.detach().norm(dim=-1), (state.pos == 0)[:, None], key_norm)
    return SKAState(
        G=state.G + za[..., :, None] * za[..., None, :],
        M=state.M + za[..., :, None] * zp[..., None, :],
        C=state.C + va[..., :, None] * za[..., None, :],
        z_prev=zw.float(),
        m=m,
        J=state.J,
        pos=state.pos + 1,
    )


@state_math
def ska_step(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    *,
    chunk_size: int,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    mode: str = "C",
    a: torch.Tensor | None = None,
) -> tuple[torch.Tensor, SKAState]:
    """One decode token for each of B sessions (each at its own position state.pos).

    z, q: `[B, H, r]`; v: `[B, H, P]`; a: optional `[B]` action mask. Returns y `[B, H, P]` fp32 and the new state.

    mode "C" (ska.md §3.3): a session entering a new chunk (pos % S == 0, pos > 0) first rebuilds J from its stats
    (exactly the tokens < pos); then y = J q; then the token is added to the stats (it becomes visible from the
    next chunk on). Equals `ska_chunked` token by token. Cost per token O(r^2 + P r), plus one J build every S.
    mode "P" (ska.md §3.4): add the token first, rebuild J from the new stats, y = J q (the paper's inclusive
    re-estimation; equals `ska_prefix` with one token).
    """
    kw = {"eps": eps, "eta": eta, "gamma": gamma, "order": order, "power_iters": power_iters}
    if mode == "P":
        state = _accumulate(state, z, v, a, key_norm)
        J = ska_readout(state.G, state.M, state.C, state.m, **kw).float()
        return torch.einsum("bhpr,bhr->bhp", J, q.float()), state._replace(J=J)
    J = state.J
    enter = (state.pos % chunk_size == 0) & (state.pos > 0)
    if bool(enter.any()):
        idx = enter.nonzero().squeeze(1)
        Jn = ska_readout(state.G[idx], state.M[idx], state.C[idx], state.m[idx], **kw).float()
        J = J.index_copy(0, idx, Jn)
    y = torch.einsum("bhpr,bhr->bhp", J, q.float())
    new = _accumulate(state, z, v, a, key_norm)._replace(J=J)
    return y, new


# -- serving ops: pool rows addressed by state_indices, updated in place -----------------------------------------
def _gather(pools: SKAState, idx: torch.Tensor) -> SKAState:
    return SKAState(*(pool.index_select(0, idx) for pool in pools))


def _scatter(pools: SKAState, idx: torch.Tensor, new: SKAState) -> None:
    for pool, value in zip(pools, new, strict=True):
        pool.index_copy_(0, idx, value.to(pool.dtype))


class _Group(NamedTuple):
    """Some sequences of a packed batch, laid out as a batch `[n, longest, ...]` (right-padded where lengths differ).

    Consecutive sequences (a whole batch, or one sequence) are addressed by slices, so laying them out is a view.
    """

    seqs: slice | torch.Tensor  # the sequences, [n] int64 if not a slice
    tokens: slice | torch.Tensor  # their tokens on the packed axis, [Tg] int64 if not a slice
    n: int
    longest: int
    # The padded layout: each token's row and column `[Tg]` and the lengths `[n]` (int64); None if all are equal.
    place: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, cu: tuple[int, ...], members: list[int], device: torch.device) -> _Group:
        first, last = members[0], members[-1]
        if last - first + 1 == len(members):
            seqs, tokens = slice(first, last + 1), slice(cu[first], cu[last + 1])
        else:
            seqs = torch.tensor(members, device=device)
            tokens = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in members]).to(device)
        ends = [0]
        for i in members:
            ends.append(ends[-1] + cu[i + 1] - cu[i])
        longest = max(cu[i + 1] - cu[i] for i in members)
        equal = ends[-1] == len(members) * longest
        place = None if equal else varlen_positions(tuple(ends), device)[:3]
        return cls(seqs, tokens, len(members), longest, place)

    @property
    def lens(self) -> torch.Tensor | None:
        """`[n]` int64 lengths where they differ, for `ska_chunked` / `ska_prefix`; None when all are `longest`."""
        return None if self.place is None else self.place[2]

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """Packed `[T, ...]` -> `[n, longest, ...]`, zeros after each sequence's end."""
        t = t[self.tokens]
        if self.place is None:
            return t.unflatten(0, (self.n, self.longest))
        row, col, _ = self.place
        out = t.new_zeros(self.n, self.longest, *t.shape[1:])
        out[row, col] = t
        return out

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """`[n, longest, ...]` -> the group's tokens `[Tg, ...]`, in the order of `tokens`."""
        if self.place is None:
            return t.flatten(0, 1)
        row, col, _ = self.place
        return t[row, col]


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {MODES}")


def chunk_ska(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_size: int,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    mode: str = "C",
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """SKA prefill over packed variable-length sequences, each continuing its session's state in place in the pool.

    mode "C": the chunk-causal extend (`ska_chunked`, ska.md §3.3) on each session's absolute chunk grid; mode "P":
    the paper's prefix mode (`ska_prefix`, §3.4): one operator over everything up to the segment's end.

    Args:
        z, q: `[T, H, r]` fp32 raw keys and queries of N sequences concatenated.  v: `[T, H, P]` fp32 values.
        state: an `SKAState` of pool tensors, in its field order: G, M `[S, H, r, r]` and C `[S, H, P, r]` (the
            accumulator dtype, fp64 or fp32), z_prev `[S, H, r]` fp32, m `[S, H]` fp32, J `[S, H, P, r]` fp32 and
            pos `[S]` int64. Rows `state_indices` hold the sessions' states and receive the new ones (all seven
            fields); other rows are left untouched. A sequence of length 0 leaves its row as it is.
        state_indices: `[N]` int32, the pool row of each sequence (distinct).
        cu_seqlens: `[N+1]` int32, sequence boundaries in z (device), from 0 to T.
        chunk_size: S, the chunk of the chunk-causal operator (mode P sums its stats per chunk of S, ska.md §5).
        eps: ridge (times m^2).  eta: output scale.  gamma: spectral gain, already clamped to [1, 1.5].
        order: K, the power filter order.  power_iters: power-iteration steps for sigma_max.
        key_norm: "causal" or "frozen" (see the module docstring).  mode: "C" or "P".
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device when None.

    Returns:
        y: `[T, H, P]` fp32, the readout J q of every token.

    Reads each session's position to the host (a sync): it fixes the chunk grid. Sessions that agree on what the
    math depends on (mode C: pos % S and pos == 0; mode P: pos == 0) run as one batch, right-padded to the longest;
    in a fresh prefill that is every session.
    """
    _check_mode(mode)
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, z.shape[0])
    idx = state_indices.to(torch.int64)
    starts = state.pos.index_select(0, idx).tolist()
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, t0 in enumerate(starts):
        if cu[i + 1] > cu[i]:
            groups.setdefault((t0 % chunk_size if mode == "C" else 0, t0 == 0), []).append(i)  # mode P: no grid
    extend = ska_chunked if mode == "C" else ska_prefix
    kw = {"eps": eps, "eta": eta, "gamma": gamma, "order": order, "power_iters": power_iters, "key_norm": key_norm}
    parts = []
    for members in groups.values():
        g = _Group.of(cu, members, z.device)
        rows = idx[g.seqs]
        # Any member's position stands for the group's: they agree on all the math reads of it (ska_chunked).
        out, new = extend(
            g.pad(z), g.pad(q), g.pad(v), _gather(state, rows), starts[members[0]], chunk_size=chunk_size, lens=g.lens,
            **kw,
        )  # fmt: skip
        _scatter(state, rows, new)
        parts.append((g.tokens, g.unpad(out)))
    if len(parts) == 1 and isinstance(parts[0][0], slice) and parts[0][0] == slice(0, z.shape[0]):
        return parts[0][1]  # one group of every token, in order (e.g. a fresh prefill)
    y = z.new_zeros(*z.shape[:2], v.shape[-1], dtype=torch.float32)
    for tokens, part in parts:
        y[tokens] = part
    return y


def fused_recurrent_ska(
    z: torch.Tensor,
    q: torch.Tensor,
    v: torch.Tensor,
    state: SKAState,
    state_indices: torch.Tensor,
    chunk_size: int,
    eps: float,
    eta: torch.Tensor | float,
    gamma: torch.Tensor | float,
    order: int,
    power_iters: int,
    key_norm: str = "causal",
    mode: str = "C",
) -> torch.Tensor:
    """One SKA decode token per session (`ska_step`), its state updated in place in the pool.

    Args:
        z, q: `[B, H, r]` fp32 raw keys and queries.  v: `[B, H, P]` fp32 values.
        state: an `SKAState` of pool tensors `[S, ...]`, as in `chunk_ska`; rows `state_indices` advance by one
            token (mode C: J is rebuilt first where a session enters a chunk; mode P: after adding the token, every
            step). Other rows are left untouched.
        state_indices: `[B]` int32, the pool row of each session (distinct).
        chunk_size, eps, eta, gamma, order, power_iters, key_norm, mode: as in `chunk_ska`.

    Returns:
        y: `[B, H, P]` fp32.
    """
    _check_mode(mode)
    idx = state_indices.to(torch.int64)
    y, new = ska_step(
        z, q, v, _gather(state, idx), chunk_size=chunk_size, eps=eps, eta=eta, gamma=gamma, order=order,
        power_iters=power_iters, key_norm=key_norm, mode=mode,
    )  # fmt: skip
    _scatter(state, idx, new)
    return y
