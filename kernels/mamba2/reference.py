"""Reference SSD (Mamba-2) in pure PyTorch.

The recurrence, per head h (state S is `[P, N]`):

    S_t = exp(dt_t * A) * S_{t-1} + dt_t * x_t ⊗ B_t
    y_t = S_t · C_t + D * x_t

`ssd_chunked` computes the same thing for T tokens at once with the chunked algorithm of the Mamba-2 paper:
inside a chunk the output is a masked quadratic form (like attention with a decay mask); across chunks only
the `[H, P, N]` states are passed. All arithmetic is fp32 whatever the input dtype (float64 when given float64,
so the same code serves as the float64 oracle of the kernels).

`chunk_mamba2` (packed variable-length prefill) and `fused_recurrent_mamba2` (one decode step) are the slot-indexed
references of the Triton kernels in `chunk.py` and `fused_recurrent.py`, with the same signatures: they take the raw
dt, read each sequence's state from a row of a preallocated pool and write the final state back to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import state_math
from ..dispatch import DeviceChunks, host_cu_seqlens, padded_groups


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32, or float64 when any input is float64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def segsum(a: torch.Tensor) -> torch.Tensor:
    """Pairwise decay exponents: `out[..., i, j] = a[..., j+1] + ... + a[..., i]` for i >= j, -inf above the diagonal.

    Summing the masked increments (instead of differencing a cumsum) keeps the exponent exact for long chunks.
    a: `[..., L]` -> `[..., L, L]`.
    """
    L = a.shape[-1]
    strict = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(-1)
    x = a.unsqueeze(-1).expand(*a.shape, L).masked_fill(~strict, 0.0)
    out = torch.cumsum(x, dim=-2)
    lower = torch.ones(L, L, dtype=torch.bool, device=a.device).tril(0)
    return out.masked_fill(~lower, float("-inf"))


@state_math
def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over a batch of sequences of T tokens each, starting from `state`.

    Args:
        x: `[Bt, T, H, P]` inputs.  dt: `[Bt, T, H]` step sizes (after softplus and clamp).  A: `[H]` (negative).
        B, C: `[Bt, T, G, N]` with G dividing H.  D: `[H]` skip.  state: `[Bt, H, P, N]` initial states.
        chunk_size: tokens per chunk of the quadratic form.

    Returns:
        y: `[Bt, T, H, P]` fp32 outputs; final_state: `[Bt, H, P, N]` fp32 (float64 for float64 inputs).
    """
    Bt, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    L = chunk_size
    pad = (-T) % L
    nc = (T + pad) // L
    f32 = _acc_dtype(x, dt, B, C, state)
    # Padding with dt = 0 and x = 0 leaves the state unchanged (decay exp(0) = 1, no input).
    xs = F.pad(x.to(f32), (0, 0, 0, 0, 0, pad)).view(Bt, nc, L, H, P)
    dts = F.pad(dt.to(f32), (0, 0, 0, pad)).view(Bt, nc, L, H)
    Bs = F.pad(B.to(f32), (0, 0, 0, 0, 0, pad)).repeat_interleave(H // G, dim=2).view(Bt, nc, L, H, N)
    Cs = F.pad(C.to(f32), (0, 0, 0, 0, 0, pad)).repeat_interleave(H // G, dim=2).view(Bt, nc, L, H, N)

    a = (dts * A.to(f32)).permute(0, 1, 3, 2)  # [Bt, nc, H, L] log-decay per token
    a_cum = torch.cumsum(a, dim=-1)
    xdt = xs * dts.unsqueeze(-1)  # [Bt, nc, L, H, P]

    # 1. Within each chunk: y_t = sum_{s<=t} (C_t . B_s) exp(a_{s+1..t}) dt_s x_s
    decay = torch.exp(segsum(a))  # [Bt, nc, H, L, L]
    scores = torch.einsum("bclhn,bcshn->bchls", Cs, Bs) * decay
    y = torch.einsum("bchls,bcshp->bclhp", scores, xdt)

    # 2. Each chunk's contribution to the state at its end, starting from zero.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [Bt, nc, H, L]
    chunk_states = torch.einsum("bchl,bclhn,bclhp->bchpn", to_end, Bs, xdt)  # [Bt, nc, H, P, N]

    # 3. Pass states across chunks: S_start[z] = sum_{c <= z} decay(chunks c..z-1) S_end[c-1], S_end[-1] = state.
    states = torch.cat([state.to(f32).unsqueeze(1), chunk_states], dim=1)  # [Bt, nc+1, H, P, N]
    chunk_decay = torch.exp(segsum(F.pad(a_cum[..., -1].transpose(1, 2), (1, 0))))  # [Bt, H, nc+1, nc+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)  # z = nc is the final state
    start_states, final_state = states[:, :-1], states[:, -1]

    # 4. The carried state's contribution inside each chunk.
    y = y + torch.einsum("bclhn,bchpn,bchl->bclhp", Cs, start_states, torch.exp(a_cum))

    y = y.reshape(Bt, nc * L, H, P)[:, :T] + x.to(f32) * D.to(f32)[:, None]
    return y, final_state


@state_math
def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch of sessions.

    Args:
        x: `[Bt, H, P]`.  dt: `[Bt, H]`.  A, D: `[H]`.  B, C: `[Bt, G, N]`.  state: `[Bt, H, P, N]`.

    Returns:
        y: `[Bt, H, P]` fp32; new_state: `[Bt, H, P, N]` fp32 (float64 for float64 inputs).
    """
    H = x.shape[1]
    G = B.shape[1]
    f32 = _acc_dtype(x, dt, B, C, state)
    dt = dt.to(f32)
    Bh = B.to(f32).repeat_interleave(H // G, dim=1)  # [Bt, H, N]
    Ch = C.to(f32).repeat_interleave(H // G, dim=1)
    decay = torch.exp(dt * A.to(f32))  # [Bt, H]
    new_state = state.to(f32) * decay[..., None, None] + (dt[..., None] * x.to(f32)).unsqueeze(-1) * Bh.unsqueeze(2)
    y = torch.einsum("bhpn,bhn->bhp", new_state, Ch) + x.to(f32) * D.to(f32)[:, None]
    return y, new_state


def softplus_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float] | None, dtype: torch.dtype
) -> torch.Tensor:
    """Raw dt -> step size: `softplus(dt + dt_bias)` (torch's, threshold 20), clamped to `dt_limit=(lo, hi)`."""
    dt = F.softplus(dt.to(dtype) + dt_bias.to(dtype))
    if dt_limit is not None:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def chunk_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] | None = None,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    device_chunks: DeviceChunks | None = None,
) -> torch.Tensor:
    """Chunked SSD prefill over packed variable-length sequences, states in place in a pool.

    Args:
        x: `[T, H, P]` bf16/fp16/fp32, the tokens of N sequences concatenated.
        dt: `[T, H]` raw step sizes; the op applies `softplus(dt + dt_bias)`, then clamps to `dt_limit`.
        B, C: `[T, G, N]` with G dividing H; head h uses group `h // (H // G)`.
        state: `[S, H, P, N]` fp32 pool; rows `state_indices` hold the initial states and receive the final ones.
            Other rows are left untouched.
        state_indices: `[N]` int32, the pool row of each sequence (padding names a scratch row, never -1).
        cu_seqlens: `[N+1]` int32, sequence boundaries in x (device), from 0 to T.
        A: `[H]` fp32, negative (`-exp(A_log)`).  D: `[H]` skip.  dt_bias: `[H]`.
        dt_limit: `(lo, hi)` or None.
        chunk_size: tokens per chunk; chunks never cross a sequence boundary. The result does not depend on it
            beyond rounding.
        cu_seqlens_cpu: a host copy of cu_seqlens (tensor, list or tuple); copied from the device (a sync) when None
            and `device_chunks` is not given.
        device_chunks: for a step captured in a CUDA graph, `DeviceChunks(cu_seqlens, T)`
            (`kvfree.kernels.dispatch`): the Triton kernels then take their chunk metadata from the device, sized by
            the bound `T // L + N` chunks, and never read `cu_seqlens` on the host. Sequences may be empty (a padded
            step's sentinels): they output nothing and leave their pool rows untouched. The reference ignores it.

    Returns:
        y: `[T, H, P]` in x's dtype, the SSD output plus `D * x`.

    Gathers the pool rows, runs `ssd_chunked` once per group of similar lengths (right-padding with post-softplus
    dt = 0 and x = 0 leaves a state unchanged) and writes the final states back. The groups are planned on the host,
    so `device_chunks` is not used (without `cu_seqlens_cpu` the boundaries are copied from the device).
    """
    cu = host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, x.shape[0])
    acc = _acc_dtype(x, dt, B, C, state)
    dt = softplus_dt(dt, dt_bias, dt_limit, acc)
    y = x.new_empty(x.shape)
    # Right-padding with post-softplus dt = 0 and x = 0 leaves a state unchanged, so each group of similar lengths
    # is one batched `ssd_chunked` call.
    for g in padded_groups(cu, x.device):
        idx = state_indices[g.seqs].to(torch.int64)
        yg, final = ssd_chunked(
            g.pad(x), g.pad(dt), A, g.pad(B), g.pad(C), D, state.index_select(0, idx), chunk_size
        )
        state.index_copy_(0, idx, final.to(state.dtype))
        g.scatter(yg, y)
    return y


def fused_recurrent_mamba2(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float] | None = None,
) -> torch.Tensor:
    """One SSD decode step per session, its state updated in place in the pool.

    Args:
        x: `[Bs, H, P]` bf16/fp16/fp32.  dt: `[Bs, H]` raw (softplus of `dt + dt_bias`, clamped to `dt_limit`).
        B, C: `[Bs, G, N]`, G dividing H.
        state: `[S, H, P, N]` fp32 pool; rows `state_indices` become `exp(dt*A) * state + dt * x ⊗ B`.
        state_indices: `[Bs]` int32, the pool row of each session.
        A: `[H]` fp32 negative.  D: `[H]`.  dt_bias: `[H]`.  dt_limit: `(lo, hi)` or None.

    Returns:
        y: `[Bs, H, P]` in x's dtype, `new_state · C + D * x`.
    """
    acc = _acc_dtype(x, dt, B, C, state)
    idx = state_indices.to(torch.int64)
    y, new = ssd_step(x, softplus_dt(dt, dt_bias, dt_limit, acc), A, B, C, D, state.index_select(0, idx))
    state.index_copy_(0, idx, new.to(state.dtype))
    return y.to(x.dtype)
