"""Reference Lattice recurrence (orthogonal-update memory slots) in pure PyTorch.

Karami & Mirrokni, "Lattice: Learning to Efficiently Compress the Memory", arXiv 2504.05646v1; the serving spec is
docs/design/lattice.md (section numbers below are the spec's, equation numbers the paper's).

Per head the state is S `[d, m]`: m memory slots, each a unit column in R^d. One token (q, k `[m]`, v `[d]`, step
size gamma > 0, optional forget gate mu in (0, 1]) does, for every slot i (Eq. (13) with Eq. (14), spec §4.2):

    S~[:, i] = mu s_i + c_i P(s_i) h           P(s) = I - s s^T (s is a unit vector)
    S[:, i]  = S~[:, i] / ||S~[:, i]||          back onto the unit sphere (normalised projection)
    y        = S q                              read-out with the updated state

with (h `[d]`, c `[m]`) per variant (the "orthogonal state recurrence" of Eq. (13)):

    dec  (decoding loss, Eq. (7)):   h = S k - v,  c = -gamma k
    enc  (encoding loss, Eq. (10)):  h = v,        c = -gamma (S^T v - k)
    sim  (similarity,    Eq. (12)):  h = v,        c = +gamma k

In matrix form `S~ = S diag(mu - c * (S^T h)) + h c^T` (spec §4.3: a state-dependent per-slot diagonal gate plus a
rank-one write). The forget gate is exactly redundant with the step size: (gamma, mu) gives the same S and y as
(gamma / mu, 1) (spec §4.4), which is how serving folds it away.

The math is sequential (no parallel form of the exact recurrence exists, paper Remark 3.4), so prefill is a loop over
tokens, vectorised over sequences and heads. The state math runs in fp32 (fp64 if the state is fp64, for tests).

`lattice_recurrent` and `lattice_step` are that math on batches of equal-length sequences with explicit states.
`chunk_lattice` (packed variable-length prefill) and `fused_recurrent_lattice` (one decode token per session) are the
slot-indexed ops the layer calls: they read each session's S from a row of a preallocated pool and write it back in
place. `chunk_lattice_qk_conv` / `fused_recurrent_lattice_qk_conv` are the layer's two short convs over the shared q/k
projection, which read one conv tail per session (spec §5.5).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kvfree.kernels.common import state_math
from kvfree.kernels.conv import chunk_causal_conv1d, fused_recurrent_causal_conv1d
from kvfree.kernels.dispatch import host_cu_seqlens, varlen_positions

VARIANTS = ("dec", "enc", "sim")

# Column norms are >= mu >= 1e-4 (the forget-gate clamp), so this floor never binds in a valid model; it only keeps a
# zero column (an illegal state: phi, P(s) and Eq. (14) are undefined there, spec §4.1) from producing inf.
_NORM_FLOOR = 1e-6


def _compute_dtype(S: torch.Tensor) -> torch.dtype:
    return torch.promote_types(S.dtype, torch.float32)


def _increment(
    S: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    g: torch.Tensor,
    mu: torch.Tensor | None,
    variant: str,
) -> torch.Tensor:
    """The un-normalised update S~ of one token, in column-vector layout.

    S: `[..., d, m]`.  k: `[..., m, 1]`.  v: `[..., d, 1]`.  gk: `[..., 1, m]` the state-independent part of c as a
    row (`_columns`: -gamma k for dec, +gamma k for enc and sim).  g: `[..., 1, 1]` gamma (read by `enc` only).
    mu: `[..., 1, 1]` or None (mu = 1).
    Returns S~ `[..., d, m]` whose column i is mu s_i + c_i P(s_i) h (module docstring).
    """
    if variant == "dec":
        h = S @ k - v  # e = S k - v (phi(S) = S on unit columns)
        b = h.transpose(-1, -2) @ S  # a_i = s_i^T e: the parallel part the update discards
        c = gk
    elif variant == "enc":
        h = v
        b = v.transpose(-1, -2) @ S  # S^T v, also the encoder's reconstruction of k
        c = gk - g * b  # -gamma (S^T v - k)
    elif variant == "sim":
        h = v
        b = v.transpose(-1, -2) @ S
        c = gk
    else:
        raise ValueError(f"unknown Lattice variant {variant!r}; known: {VARIANTS}")
    cb = c * b
    f = 1.0 - cb if mu is None else mu - cb  # per-slot retain gate, state dependent through b (spec §4.3)
    return torch.addcmul(S * f, h, c)  # S diag(f) + h c^T


def _step(
    S: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    g: torch.Tensor,
    mu: torch.Tensor | None,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token in column-vector layout (see `_increment`); q `[..., m, 1]`. Returns (y `[..., d, 1]`, new S)."""
    St = _increment(S, k, v, gk, g, mu, variant)
    # Eq. (14) with the measured column norm (spec §7): self-correcting, so fp32 norms never drift from 1.
    # (A sum of squares, not linalg.vector_norm: the latter reduces over dim -2 ~15x slower on CPU.)
    S = St * (St * St).sum(-2, keepdim=True).clamp_min(_NORM_FLOOR**2).rsqrt()
    return S @ q, S


def _columns(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    variant: str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor | None, ...]:
    """Per-token inputs `[..., H, m|d]` / gates `[..., H]` -> the column/row layout `_step` reads, in `dtype`.

    Everything that does not depend on the state is computed here, once for all tokens, not in the token loop.
    """
    q, k, v, gamma = q.to(dtype), k.to(dtype), v.to(dtype), gamma.to(dtype)
    gk = gamma[..., None] * k
    if variant == "dec":
        gk = -gk
    g = gamma[..., None, None]
    mu = None if mu is None else mu.to(dtype)[..., None, None]
    return q[..., None], k[..., None], v[..., None], gk[..., None, :], g, mu


@state_math
def lattice_unnormalised_update(
    S: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None = None,
    variant: str = "dec",
) -> torch.Tensor:
    """S~ before the sphere projection (Eq. (13) with the forget gate of Eq. (16)); for invariant checks.

    S: `[B, H, d, m]` unit columns.  k: `[B, H, m]`.  v: `[B, H, d]`.  gamma, mu: `[B, H]`.
    Returns S~ `[B, H, d, m]` with S~[:, i] - mu s_i orthogonal to s_i.
    """
    dtype = _compute_dtype(S)
    _, kc, vc, gk, g, m = _columns(k, k, v, gamma, mu, variant, dtype)
    return _increment(S.to(dtype), kc, vc, gk, g, m, variant)


@state_math
def lattice_step(
    S: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None = None,
    variant: str = "dec",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for B sequences (the same arithmetic as one iteration of `lattice_recurrent`).

    Args:
        S: `[B, H, d, m]` state with unit columns (fp32; fp64 allowed for tests).
        q, k: `[B, H, m]`.  v: `[B, H, d]`.  gamma: `[B, H]` step sizes.  mu: `[B, H]` forget gate or None (= 1).
        variant: "dec" (the paper's final configuration), "enc" or "sim".

    Returns:
        y: `[B, H, d]` and the new state `[B, H, d, m]`, both in the state's compute dtype.
    """
    dtype = _compute_dtype(S)
    y, S = _step(S.to(dtype), *_columns(q, k, v, gamma, mu, variant, dtype), variant)
    return y[..., 0], S


def _scan(
    S: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor,
    g: torch.Tensor,
    mu: torch.Tensor | None,
    mask: torch.Tensor | None,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token loop over time-major columns (`[T, B, H, ...]`, mask `[T, B, 1, 1, 1]`) -> (y `[T, B, H, d]`, S)."""
    ys = []
    for t in range(q.shape[0]):
        y, S_new = _step(S, q[t], k[t], v[t], gk[t], g[t], None if mu is None else mu[t], variant)
        # A masked (padding) position keeps the state bit-identical; its output is never read.
        S = S_new if mask is None else torch.where(mask[t], S_new, S)
        ys.append(y[..., 0])
    return torch.stack(ys), S


@state_math
def lattice_recurrent(
    S: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None = None,
    variant: str = "dec",
    mask: torch.Tensor | None = None,
    checkpoint_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact recurrent prefill of T tokens for B sequences from states S (spec §5.2, Mode A).

    Resumable by construction: running tokens 0..a then a..T from the returned state equals running 0..T.

    Args:
        S: `[B, H, d, m]` initial states with unit columns (not modified).
        q, k: `[B, T, H, m]`.  v: `[B, T, H, d]`.  gamma: `[B, T, H]`.  mu: `[B, T, H]` or None (= 1).
        variant: "dec", "enc" or "sim".
        mask: `[B, T]` bool, False where a position is padding (the state is carried over unchanged), or None.
        checkpoint_tokens: when > 0 and autograd is recording, recompute the loop in segments of this many tokens
            during backward instead of storing every per-token state: activation memory drops from
            O(T * d * m) to O(T / segment * d * m + segment * d * m) per head, for one extra forward pass.

    Returns:
        y: `[B, T, H, d]` outputs and the final state `[B, H, d, m]`, in the state's compute dtype.
    """
    dtype = _compute_dtype(S)
    # Time-major and contiguous, so that every per-token slice and every state the loop makes is a dense
    # `[B, H, d, m]` block: inputs arrive strided (e.g. from the conv's transpose), and elementwise ops would pass
    # those strides on to S (measured: the column-norm reduction ran 25x slower on such a layout).
    cols = [None if t is None else t.transpose(0, 1).contiguous() for t in _columns(q, k, v, gamma, mu, variant, dtype)]
    m = None if mask is None else mask.transpose(0, 1)[:, :, None, None, None]
    S = S.to(dtype).contiguous()
    T = q.shape[1]
    if checkpoint_tokens <= 0 or checkpoint_tokens >= T or not torch.is_grad_enabled():
        y, S = _scan(S, *cols, m, variant)
        return y.transpose(0, 1), S
    ys = []
    for a in range(0, T, checkpoint_tokens):
        seg = [None if c is None else c[a : a + checkpoint_tokens] for c in (*cols, m)]
        y, S = checkpoint(_scan, S, *seg, variant, use_reentrant=False, preserve_rng_state=False)
        ys.append(y)
    return torch.cat(ys).transpose(0, 1), S


# -- slot-indexed ops on the state pool ---------------------------------------------------------------------------
def chunk_lattice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    variant: str = "dec",
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """Exact recurrent prefill over packed variable-length sequences, states in place in a pool (spec §5.2, §5.5).

    There is no parallel form: the reference runs one token loop for all N sequences at once, right-padded to the
    longest and masked, so a padding position leaves its sequence's state bit-identical.

    Args:
        q, k: `[T, H, m]` (fp32 after the layer's L2 norm, or the activation dtype), the tokens of N sequences
            concatenated.  v: `[T, H, d]`.  gamma: `[T, H]` step sizes.  mu: `[T, H]` forget gate, or None (mu = 1,
            the folded serving form).
        state: `[S, H, d, m]` fp32 pool (fp64 allowed for tests) of states with unit columns; rows `state_indices`
            hold the initial states and receive the final ones. Other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence (padding names a scratch row, never -1).
        cu_seqlens: `[N+1]` int32, sequence boundaries on the token axis (device), from 0 to T. A sequence may be
            empty (its state is kept).
        variant: "dec", "enc" or "sim".
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.

    Returns:
        y: `[T, H, d]` in the state's compute dtype (fp32, or fp64 for an fp64 state): the read-outs `S_t q_t`.
    """
    T = q.shape[0]
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    n, longest = len(cu) - 1, max(b - a for a, b in zip(cu, cu[1:], strict=False))
    if longest == 0:
        return q.new_empty(T, *v.shape[1:], dtype=_compute_dtype(state))
    idx = state_indices.to(torch.int64)
    if n * longest == T:  # equal lengths: the packed axis is already [N, L], with no padding and no mask
        seq = pos = mask = None
    else:
        seq, pos, lens, _ = varlen_positions(cu, q.device)
        mask = torch.arange(longest, device=q.device) < lens[:, None]

    def pad(t: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        if mask is None:
            return t.unflatten(0, (n, longest))
        out = t.new_full((n, longest, *t.shape[1:]), value)
        out[seq, pos] = t
        return out

    y, final = lattice_recurrent(
        state.index_select(0, idx), pad(q), pad(k), pad(v), pad(gamma),
        None if mu is None else pad(mu, 1.0),  # pads: gamma = 0, mu = 1 (a no-op step), and masked anyway
        variant, mask=mask,
    )  # fmt: skip
    state.index_copy_(0, idx, final.to(state.dtype))
    return y.flatten(0, 1) if mask is None else y[seq, pos]


def fused_recurrent_lattice(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gamma: torch.Tensor,
    mu: torch.Tensor | None,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    variant: str = "dec",
) -> torch.Tensor:
    """One decode token per session, its state updated in place in the pool (the arithmetic of one prefill step).

    Args:
        q, k: `[B, H, m]`.  v: `[B, H, d]`.  gamma: `[B, H]`.  mu: `[B, H]` or None (mu = 1).
        state: `[S, H, d, m]` fp32 pool; rows `state_indices` advance by one token. Other rows are left untouched.
        state_indices: `[B]` int32, the pool row of each session.
        variant: "dec", "enc" or "sim".

    Returns:
        y: `[B, H, d]` in the state's compute dtype.
    """
    idx = state_indices.to(torch.int64)
    y, new = lattice_step(state.index_select(0, idx), q, k, v, gamma, mu, variant)
    state.index_copy_(0, idx, new.to(state.dtype))
    return y


def _shared_tail_convs(
    conv: Callable[..., torch.Tensor],
    x: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    convs: tuple[tuple[torch.Tensor, torch.Tensor | None], ...],
) -> tuple[torch.Tensor, ...]:
    """Several depthwise convs of the same input from one tail per session, as one conv over stacked channels.

    The pool holds a single tail for all of them, so the conv ops, which advance the tail they read, cannot run on
    it once per filter: the named rows are gathered once, stacked (`[N, K-1, G*C]`) and run as one conv on that
    copy, and the advanced tail (the same in every stacked copy) is written back once.
    `conv` is `chunk_causal_conv1d` or `fused_recurrent_causal_conv1d` with its grid arguments bound; x `[..., C]`.
    """
    C, G = x.shape[-1], len(convs)
    idx = state_indices.to(torch.int64)
    tails = state.index_select(0, idx).repeat(1, 1, G)
    rows = torch.arange(len(idx), dtype=torch.int32, device=idx.device)
    weight = torch.cat([w for w, _ in convs])
    bias = None
    if any(b is not None for _, b in convs):
        bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b for w, b in convs])
    y = conv(x.repeat(*(1,) * (x.dim() - 1), G), tails, rows, weight, bias)
    state.index_copy_(0, idx, tails[..., :C])
    return y.split(C, dim=-1)


def chunk_lattice_qk_conv(
    p: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    q_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's two short convs (conv_q, conv_k) over the shared q/k projection of packed sequences.

    Both read the same input, so one tail per session serves both (spec §6.2); it is read once and advanced once.

    Args:
        p: `[T, C]` (C = H*m) the projection of N sequences' tokens, concatenated.
        state: `[S, K-1, C]` pool of tails (p's dtype or fp32); rows `state_indices` are read, then overwritten with
            each sequence's last `K-1` inputs (as `kvfree.kernels.conv.chunk_causal_conv1d`). Others are untouched.
        state_indices: `[N]` int32, the pool row of each sequence.
        cu_seqlens: `[N+1]` int32, sequence boundaries in p (device), from 0 to T.
        q_weight, k_weight: `[C, K]` depthwise filters; `[:, -1]` multiplies the current token.
        q_bias, k_bias: `[C]` or None.
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor or list); copied from the device (a sync) when None.

    Returns:
        q, k: `[T, C]` each in p's dtype, no activation.
    """

    def conv(x, tails, rows, weight, bias):
        return chunk_causal_conv1d(x, tails, rows, cu_seqlens, weight, bias, None, cu_seqlens_cpu=cu_seqlens_cpu)

    q, k = _shared_tail_convs(conv, p, state, state_indices, ((q_weight, q_bias), (k_weight, k_bias)))
    return q, k


def fused_recurrent_lattice_qk_conv(
    p: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    q_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per session through conv_q and conv_k from the session's one tail, shifted once in place.

    Args:
        p: `[B, C]` one token's q/k projection per session.
        state: `[S, K-1, C]` pool of tails; rows `state_indices` shift by one token. Other rows are left untouched.
        state_indices: `[B]` int32, the pool row of each session.
        q_weight, k_weight: `[C, K]`.  q_bias, k_bias: `[C]` or None.

    Returns:
        q, k: `[B, C]` each in p's dtype, no activation.
    """

    def conv(x, tails, rows, weight, bias):
        return fused_recurrent_causal_conv1d(x, tails, rows, weight, bias, None)

    q, k = _shared_tail_convs(conv, p, state, state_indices, ((q_weight, q_bias), (k_weight, k_bias)))
    return q, k


# -- the gated form: the layer's convs, q/k norm and gates folded into the op (what the layer serves with) --------
def lattice_gates(step: torch.Tensor, num_heads: int, mu_min: float) -> torch.Tensor:
    """Step logits `[..., H]` or `[..., 2H]` (with a forget gate) -> gamma `[..., H]` fp32 in the folded form:
    sigmoid(s_h), divided by mu = max(sigmoid(s_{H+h}), mu_min) when there is a forget gate (spec §4.4: (gamma, mu)
    and (gamma / mu, 1) give the same recurrence)."""
    s = step.float()
    gamma = torch.sigmoid(s[..., :num_heads])
    if s.shape[-1] == 2 * num_heads:
        gamma = gamma / torch.sigmoid(s[..., num_heads:]).clamp_min(mu_min)
    return gamma


def gated_heads(
    q: torch.Tensor, k: torch.Tensor, step: torch.Tensor, num_heads: int, qk_l2: bool, mu_min: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Conv outputs q, k `[..., H*m]` and step logits -> (q, k `[..., H, m]`, fp32 and L2-normalised when qk_l2,
    gamma `[..., H]`): the per-token inputs of the recurrence."""
    q, k = q.unflatten(-1, (num_heads, -1)), k.unflatten(-1, (num_heads, -1))
    if qk_l2:
        q, k = F.normalize(q.float(), dim=-1, eps=1e-6), F.normalize(k.float(), dim=-1, eps=1e-6)
    return q, k, lattice_gates(step, num_heads, mu_min)


def lattice_post_gate(
    y: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """The layer's post-gate: y `[N, H, d]` -> gelu_tanh(gate) * rms_norm(y) * w over each head (w None: no norm),
    computed in fp32, returned `[N, H*d]` in gate's dtype (fp64 kept for tests)."""
    dt = torch.promote_types(y.dtype, torch.float32)
    y = y.to(dt)
    if norm_weight is not None:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps) * norm_weight.to(dt)
    out = F.gelu(gate.to(dt), approximate="tanh") * y.flatten(-2)
    return out if gate.dtype == torch.float64 else out.to(gate.dtype)


def chunk_lattice_gated(
    p: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    q_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    variant: str = "dec",
    qk_l2: bool = True,
    mu_min: float = 1e-4,
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | None = None,
) -> torch.Tensor:
    """The layer's prefill from its projections: `chunk_lattice_qk_conv`, `gated_heads`, then `chunk_lattice`.

    Args:
        p: `[T, H*m]` the shared q/k projection of N sequences' tokens, concatenated.  v: `[T, H, d]` values.
        step: `[T, H]` step logits, or `[T, 2H]` step and forget-gate logits (see `lattice_gates`).
        conv_state: `[S, K-1, H*m]` pool of conv tails; state: `[S, H, d, m]` fp32 pool of states. Rows
            `state_indices` are continued and advanced in place; other rows are left untouched.
        state_indices: `[N]` int32.  cu_seqlens: `[N+1]` int32 (device), from 0 to T.
        q_weight, k_weight: `[H*m, K]` the two depthwise conv filters; q_bias, k_bias: `[H*m]` or None.
        variant: "dec", "enc" or "sim".  qk_l2: L2-normalise q and k per head.  mu_min: the forget-gate clamp.
        gate: `[T, H*d]` the post-gate projection, or None.  norm_weight: `[d]` the head RMSNorm's weight, or None
            (no norm).  eps: its epsilon.
        cu_seqlens_cpu: a host copy of cu_seqlens; copied from the device (a sync) when None.

    Returns:
        Without a gate, y: `[T, H, d]` fp32 (fp64 with an fp64 state), the read-outs `S_t q_t`; with one,
        `lattice_post_gate(y, gate, norm_weight, eps)`: `[T, H*d]` in gate's dtype.
    """
    H = v.shape[1]
    qc, kc = chunk_lattice_qk_conv(p, conv_state, state_indices, cu_seqlens, q_weight, q_bias, k_weight, k_bias,
                                   cu_seqlens_cpu=cu_seqlens_cpu)  # fmt: skip
    q, k, gamma = gated_heads(qc, kc, step, H, qk_l2, mu_min)
    y = chunk_lattice(q, k, v, gamma, None, state, state_indices, cu_seqlens, variant, cu_seqlens_cpu=cu_seqlens_cpu)
    return y if gate is None else lattice_post_gate(y, gate, norm_weight, eps)


def fused_recurrent_lattice_gated(
    p: torch.Tensor,
    v: torch.Tensor,
    step: torch.Tensor,
    conv_state: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    q_weight: torch.Tensor,
    q_bias: torch.Tensor | None,
    k_weight: torch.Tensor,
    k_bias: torch.Tensor | None,
    variant: str = "dec",
    qk_l2: bool = True,
    mu_min: float = 1e-4,
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """One decode token per session from its projections (`chunk_lattice_gated`'s arguments with one token per
    session: p `[B, H*m]`, v `[B, H, d]`, step `[B, H or 2H]`, gate `[B, H*d]`) -> y `[B, H, d]` fp32, or `[B, H*d]`
    in gate's dtype with a gate; conv tails and states advance in place."""
    H = v.shape[1]
    qc, kc = fused_recurrent_lattice_qk_conv(p, conv_state, state_indices, q_weight, q_bias, k_weight, k_bias)
    q, k, gamma = gated_heads(qc, kc, step, H, qk_l2, mu_min)
    y = fused_recurrent_lattice(q, k, v, gamma, None, state, state_indices, variant)
    return y if gate is None else lattice_post_gate(y, gate, norm_weight, eps)


def orthonormal_columns(S: torch.Tensor) -> torch.Tensor:
    """The Q factor of S `[..., d, m]` (m <= d) with a positive diagonal in R, computed in fp64.

    Differentiable. The sign convention makes it the identity on matrices that already have orthonormal columns
    (up to rounding), so re-orthonormalising a stored S0 at load time does not change the model.
    Returns `[..., d, m]` in S's dtype.
    """
    Q, R = torch.linalg.qr(S.double())
    sign = torch.sign(torch.diagonal(R, dim1=-2, dim2=-1))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return (Q * sign[..., None, :]).to(S.dtype)
