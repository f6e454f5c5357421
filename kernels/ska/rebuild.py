"""Triton device functions that build SKA's readout J from raw statistics, shared by the decode and prefill kernels.

`build_readout` is `reference.ska_readout` for one (session, head) in registers, in the accumulator dtype (fp64 or
fp32): G' = G + eps m^2 I symmetrised, its Cholesky factor L with the jitter fallback decided on the device, the
whitened operator A_w = L^-1 M L^-T, sigma_max by power iteration, and J = eta c^K C G'^-1 (M G'^-1)^K. Sizes are
padded to a power of two R >= 16 (r <= 64 at every shipped size): G' gets an identity block on the padding, M and C
zeros, so the padding never mixes with the real block and the real block of J is the unpadded J.

How it maps to registers: L is computed one column per step (right-looking: the column of the running Schur
complement, its pivot, then a rank-1 downdate of the complement), and L^-1 one row per step (forward substitution on
the identity). Everything after that is matrix products: A_w = L^-1 M L^-T, G'^-1 = L^-T L^-1,
X = C G'^-1, then K times X <- X (M G'^-1). The explicit inverse replaces the reference's triangular solves (it turns
6 + 4K sequential triangular sweeps into products); for a factor of condition number kappa both err by about
kappa * u relative, so in fp64 the two agree to ~1e-9 even at kappa = 1e7 (a 16K-token session with eps = 1e-3).

Products: `tl.dot` with `input_precision="ieee"` (fp32 FMA in fp32, the reference's fp32 solves' accuracy; exact fp64
MMA in fp64) where `tensor_core_products` says so, else R rank-1 steps on the FMA units (`USE_DOT=False`: fp64 before
compute capability 8.0, and the interpreter).

Jitter fallback without a host sync (docs/design/ska.md §5 rec. 3): when a pivot is not positive (or NaN) the factor
is recomputed from G' + j m^2 I with j = 1e-4, 1e-3, 1e-2 in turn, in a device loop. Retries are counted in a device
counter (`device_fallback_count`, folded into `kvfree.kernels.ska.cholesky_fallback_count`); where even 1e-2 fails
(non-finite statistics), where the reference raises FloatingPointError, the kernel writes J = NaN, which every later
readout of that session shows, and counts the failure in the counter's second entry.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..masks import block_mask
from .reference import JITTERS, M_FLOOR

# The device loop computes the jitter as JITTER0 * 10^k; the reference's list must stay that sequence.
assert all(math.isclose(j, JITTERS[0] * 10**k) for k, j in enumerate(JITTERS)), JITTERS
JITTER0 = tl.constexpr(JITTERS[0])
FLOOR = tl.constexpr(M_FLOOR)

_COUNTERS: dict[str, torch.Tensor] = {}


def fallback_counter(device: torch.device) -> torch.Tensor:
    """The device's `[2]` int64 counter (Cholesky retries with jitter, operators that failed even with 1e-2).

    Allocated on the first call per device: the engine's prefill warm-up makes that call before any CUDA graph is
    captured, so a captured decode step only ever atomically adds to it."""
    key = str(torch.device(device))
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(2, dtype=torch.int64, device=device)
    return _COUNTERS[key]


def device_fallback_count() -> tuple[int, int]:
    """(jitter retries, failed operators) the kernels counted on every device so far (reads them: a device sync)."""
    totals = [c.tolist() for c in _COUNTERS.values()]
    return sum(t[0] for t in totals), sum(t[1] for t in totals)


def tensor_core_products(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels' matrix products use `tl.dot` for accumulators of `dtype` on `device`: always in fp32;
    in fp64 on CUDA GPUs of compute capability 8.0 or newer (fp64 MMA, exact fp64 arithmetic: on an H100 the rebuild
    ran 3x faster than with rank-1 FMA steps), else (and under the interpreter) the FMA steps."""
    if dtype == torch.float32:
        return True
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (8, 0)


def split_eps(eps: float) -> tuple[float, float]:
    """eps as an fp32 pair (hi, lo) with hi + lo == eps to ~1e-15: Triton passes Python floats as fp32, and the
    fp64 ridge must not be rounded to fp32 (the kernel adds the two in fp64)."""
    hi = float(torch.tensor(eps, dtype=torch.float32))
    return hi, float(torch.tensor(eps - hi, dtype=torch.float32))


def param(x: torch.Tensor | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """eta or gamma as a one-element device tensor the kernels load (a tensor is used as it is: no host read, so the
    call stays graph-capturable; a Python float becomes a tensor of the accumulator dtype, exact as the reference)."""
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(1)
    return torch.tensor([x], dtype=dtype, device=device)


@triton.jit
def mm(a, b, KB: tl.constexpr, USE_DOT: tl.constexpr):
    """a `[Ma, KB]` @ b `[KB, Nb]` in a's dtype: `tl.dot` (fp32, ieee) or KB rank-1 steps on the FMA units."""
    if USE_DOT:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        k = tl.arange(0, KB)
        out = tl.zeros((a.shape[0], b.shape[1]), dtype=a.dtype)
        for i in range(KB):
            a_col = tl.sum(tl.where(k[None, :] == i, a, 0.0), axis=1)  # exact: one term is non-zero
            b_row = tl.sum(tl.where(k[:, None] == i, b, 0.0), axis=0)
            out += a_col[:, None] * b_row[None, :]
    return out


@triton.jit
def cholesky(A, R: tl.constexpr):
    """Lower Cholesky factor of symmetric A `[R, R]` and whether every pivot was positive (int32 0/1).

    Right-looking, one column per step; a non-positive or NaN pivot (LAPACK's `info > 0`) clears the flag and the
    step goes on with pivot 1, so the loop has a fixed trip count (its result is then discarded)."""
    i = tl.arange(0, R)
    L = tl.zeros_like(A)
    ok = tl.full((), 1, tl.int32)
    for j in range(R):
        col = tl.sum(tl.where(i[None, :] == j, A, 0.0), axis=1)  # A[:, j] of the Schur complement
        d = tl.sum(tl.where(i == j, col, 0.0), axis=0)
        good = d > 0.0  # False for NaN as well
        ok = ok & good.to(tl.int32)
        s = tl.sqrt(tl.where(good, d, 1.0))
        lj = tl.where(i > j, col / s, tl.where(i == j, s, 0.0))
        L = tl.where(i[None, :] == j, lj[:, None], L)
        A = A - lj[:, None] * lj[None, :]  # rows/columns <= j become garbage and are never read again
    return L, ok


@triton.jit
def lower_inverse(L, R: tl.constexpr):
    """L^-1 for lower-triangular L `[R, R]` with a positive diagonal: forward substitution on the identity, one row
    per step (row k = (e_k - sum_{j<k} L[k, j] row_j) / L[k, k]; rows >= k are still zero, so no mask is needed)."""
    i = tl.arange(0, R)
    X = tl.zeros_like(L)
    for k in range(R):
        lk = tl.sum(tl.where(i[:, None] == k, L, 0.0), axis=0)  # L[k, :]
        d = tl.sum(tl.where(i == k, lk, 0.0), axis=0)
        s = tl.sum(lk[:, None] * X, axis=0)
        row = (tl.where(i == k, 1.0, 0.0) - s) / d
        X = tl.where(i[:, None] == k, row[None, :], X)
    return X


@triton.jit
def load_tile(ptr, stride_row, n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """A `[BR, BC]` tile of a row-major matrix (last dimension contiguous), zeros outside `[n_rows, n_cols]`."""
    rows = tl.arange(0, BR)
    cols = tl.arange(0, BC)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0.0)


@triton.jit
def build_readout(
    p_g,
    p_m,
    p_c,
    stride_g,
    stride_m,
    stride_c,
    m,
    eps_hi,
    eps_lo,
    eta,
    gamma,
    counter,
    r: tl.constexpr,
    P: tl.constexpr,
    R: tl.constexpr,
    PB: tl.constexpr,
    ORDER: tl.constexpr,
    ITERS: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    """J `[PB, R]` (accumulator dtype, zero padding) = `reference.ska_readout` of one (session, head).

    p_g, p_m: the `[r, r]` statistics G and M; p_c: C `[P, r]` (row strides given, last dimension contiguous; read
    where they are used, so only the tiles in use hold registers). m: the key max-norm (fp32 scalar); eps as the pair
    of `split_eps`; eta, gamma: scalars (any float dtype); counter: the `[2]` int64 fallback counter.
    """
    G = load_tile(p_g, stride_g, r, r, R, R)
    dt = G.dtype
    i = tl.arange(0, R)
    eye = i[:, None] == i[None, :]
    pad = i >= r
    mm_ = tl.maximum(m.to(dt), FLOOR)
    unit = mm_ * mm_
    eps = tl.cast(eps_hi, dt) + tl.cast(eps_lo, dt)  # (Python floats under the interpreter)
    Gt = G + tl.where(eye, eps * unit, 0.0)
    Gt = 0.5 * (Gt + tl.trans(Gt))  # exact symmetry for the factorisation
    Gt = tl.where(eye & pad[:, None], 1.0, Gt)  # identity on the padding

    # Jitter fallback on the device: try 0, then 1e-4, 1e-3, 1e-2 times m^2 on the diagonal.
    L, ok = cholesky(Gt, R)
    tries = tl.full((), 0, tl.int32)
    jit = unit * JITTER0
    while (ok == 0) & (tries < 3):
        L, ok = cholesky(Gt + tl.where(eye & (i[:, None] < r), jit, 0.0), R)
        jit = jit * 10.0
        tries += 1
    if tries > 0:
        tl.atomic_add(counter, tries.to(tl.int64))
    if ok == 0:
        tl.atomic_add(counter + 1, 1)

    Linv = lower_inverse(L, R)
    LinvT = tl.trans(Linv)
    M = load_tile(p_m, stride_m, r, r, R, R)
    Aw = mm(mm(Linv, M, R, USE_DOT), LinvT, R, USE_DOT)
    # sigma_max(A_w) by power iteration (detached in the reference; the same arithmetic here).
    v = tl.where(pad, 0.0, 1.0).to(dt) / tl.sqrt(tl.full((), r, dt))
    for _ in range(ITERS):
        u = tl.sum(Aw * v[None, :], axis=1)
        u = u / tl.maximum(tl.sqrt(tl.sum(u * u, axis=0)), 1e-8)
        v = tl.sum(Aw * u[:, None], axis=0)
        v = v / tl.maximum(tl.sqrt(tl.sum(v * v, axis=0)), 1e-8)
    Av = tl.sum(Aw * v[None, :], axis=1)
    sigma = tl.sqrt(tl.sum(Av * Av, axis=0))
    c = gamma.to(dt) / tl.maximum(sigma, 1.0)

    Ginv = mm(LinvT, Linv, R, USE_DOT)
    X = mm(load_tile(p_c, stride_c, P, r, PB, R), Ginv, R, USE_DOT)  # C G'^-1
    if ORDER > 0:
        B = mm(M, Ginv, R, USE_DOT)  # M G'^-1
        for _ in range(ORDER):
            X = mm(X, B, R, USE_DOT)
    scale = eta.to(dt)
    for _ in range(ORDER):
        scale = scale * c
    J = scale * X
    return tl.where(block_mask(ok != 0, J), J, float("nan"))
