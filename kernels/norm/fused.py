"""Triton RMS norms: plain, fused residual-add (vLLM's `fused_add_rms_norm`), and gated (Mamba-2 / GKA), one pass each.

Every op reads its inputs once and writes its outputs once. Rows of `[N, D]` (any leading shape flattened) are tiled
`[BLOCK_N, BLOCK_D]` per program: one row, or several when D is small, so a program always has ~1-2K elements in
flight; the whole row (or group) sits in registers, so D (the group, for the gated norm) is at most `MAX_D`. Math is
fp32; the casts follow `reference.py` exactly (for `rms_norm` the normalised value is rounded to weight's dtype
before the multiplication by the weight), so on a GPU the result differs from the reference only by the reduction's
summation order and rsqrt's rounding.

Input rows may be strided (column slices of a larger projection output, e.g. `in_proj(x).split(...)` views): each
tensor's row stride is passed to the kernel and nothing is copied, provided its last dim has unit stride and its
leading dims merge into one stride (otherwise `reshape` copies, which is correct but slower). Outputs are new
contiguous tensors (`add_rms_norm(..., inplace=True)` writes the residual into `residual` instead).

No host syncs and no data-dependent control flow on the host: every launch parameter comes from shapes, so the
functions can be captured in CUDA graphs. No backward: the dispatcher in `__init__.py` keeps autograd on the reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")

MAX_D = 8192  # widest row (group, for the gated norm) held in one block; wider ones go to the reference
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the kernels load and store
_TILE = 2048  # elements per program that we aim for when rows are short (rows per program = _TILE // BLOCK_D)
_MAX_ROWS = 32



def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """`t` `[..., D]` as `[N, D]` with unit column stride: a view (keeping t's row stride) whenever possible."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, D)


def _config(N: int, width: int, block_n: int | None, num_warps: int | None) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, num_warps) for rows of `width` elements: ~_TILE elements per program (several rows when
    they are short), 256 per warp (8 a thread: one 16-byte vector of bf16, two of fp32, per tensor), 1 to 16 warps."""
    if width > MAX_D:
        raise ValueError(f"rows of {width} elements: the Triton norms hold a row in one block, at most {MAX_D}")
    BD = common.next_power_of_2(width)
    BN = block_n or max(1, min(_MAX_ROWS, _TILE // BD, common.next_power_of_2(N)))
    nw = num_warps or max(1, min(16, BN * BD // 256))
    return BD, BN, nw


@triton.jit
def _cast(v, dtype: tl.constexpr, INTERP: tl.constexpr):
    """fp32 `v` to `dtype`, rounding to nearest even. The interpreter (triton 3.6) truncates fp32 -> bf16, so there
    the rounding is done by hand on the bits first (NaN aside, which these norms never make from finite inputs)."""
    if INTERP and dtype == tl.bfloat16:
        b = v.to(tl.uint32, bitcast=True)
        v = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _rms_norm_kernel(
    x,
    res,
    res_out,
    weight,
    y,
    N,
    D,
    stride_x,
    stride_r,
    stride_ro,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ADD: tl.constexpr,  # add_rms_norm: store r = res + x (or x) as the residual, normalise r
    HAS_RES: tl.constexpr,  # a residual is read (else r = x)
    INTERP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    m_c = cols < D
    m = (rows < N)[:, None] & m_c[None, :]
    rows = rows.to(tl.int64)  # row * stride can pass 2**31 on long prompts with wide projections
    r = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(res + rows[:, None] * stride_r + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if ADD:
        # Same layout as the load above, so each element is read and written by the same thread: safe in place.
        tl.store(res_out + rows[:, None] * stride_ro + cols[None, :], r, mask=m)
    # Masked columns are 0 and add nothing; divide by the true D.
    rstd = tl.rsqrt(tl.sum(r * r, axis=1) / D + eps)
    w = tl.load(weight + cols, mask=m_c, other=0.0)
    # As the reference: round the normalised value to weight's dtype, then multiply (exact in fp32 for bf16/fp16
    # operands, so rounding the fp32 product gives the correctly rounded low-precision product the reference gets).
    yn = _cast(r * rstd[:, None], weight.dtype.element_ty, INTERP).to(tl.float32)
    yv = _cast(yn * w.to(tl.float32)[None, :], y.dtype.element_ty, INTERP)
    tl.store(y + rows[:, None] * D + cols[None, :], yv, mask=m)


@triton.jit
def _gated_rms_norm_kernel(
    x,
    gate,
    weight,
    y,
    N,
    D,
    GS,
    stride_x,
    stride_g,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NORM_BEFORE_GATE: tl.constexpr,
    INTERP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * GS + tl.arange(0, BLOCK_G)  # this program's group of GS channels
    m_c = tl.arange(0, BLOCK_G) < GS
    m = (rows < N)[:, None] & m_c[None, :]
    rows = rows.to(tl.int64)
    xv = tl.load(x + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    gv = tl.load(gate + rows[:, None] * stride_g + cols[None, :], mask=m, other=0.0).to(tl.float32)
    gv = gv * tl.sigmoid(gv)  # silu; masked lanes stay 0
    if not NORM_BEFORE_GATE:
        xv = xv * gv
    rstd = tl.rsqrt(tl.sum(xv * xv, axis=1) / GS + eps)
    w = tl.load(weight + cols, mask=m_c, other=0.0).to(tl.float32)
    out = w[None, :] * (xv * rstd[:, None])
    if NORM_BEFORE_GATE:
        out = out * gv
    tl.store(y + rows[:, None] * D + cols[None, :], _cast(out, y.dtype.element_ty, INTERP), mask=m)


def _check(weight: torch.Tensor, D: int, *tensors: torch.Tensor) -> torch.Tensor:
    """Validates shapes and dtypes; returns the weight with unit stride (the kernels index it by column)."""
    if weight.shape != (D,):
        raise ValueError(f"weight {tuple(weight.shape)} must be [D={D}]")
    for t in (weight, *tensors):
        if t.dtype not in DTYPES:
            raise TypeError(f"{t.dtype}: the Triton norms take {', '.join(map(str, DTYPES))}")
    return weight.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, block_n: int | None = None, num_warps: int | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim: `(x / rms(x)).to(weight.dtype) * weight` (reference.rms_norm).

    Args:
        x: `[..., D]` bf16/fp16/fp32, rows may be strided; D <= MAX_D.
        weight: `[D]` bf16/fp16/fp32.  eps: added to the mean square.
        block_n, num_warps: override the launch configuration (for benchmarks).

    Returns:
        y: `[..., D]` in weight's dtype, contiguous.
    """
    D = x.shape[-1]
    weight = _check(weight, D, x)
    x2 = _rows(x, D)
    N = x2.shape[0]
    y = common.output_buffer((N, D), weight.dtype, x.device)
    if N:
        BD, BN, nw = _config(N, D, block_n, num_warps)
        launch_kernel(_rms_norm_kernel, (common.cdiv(N, BN),),
            x2, x2, x2, weight, y, N, D, x2.stride(0), 0, 0, eps,
            BLOCK_N=BN, BLOCK_D=BD, ADD=False, HAS_RES=False, INTERP=INTERPRET,
            num_warps=nw,
        )
    return y.view(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    inplace: bool = False,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`r = residual + x.float()` (or `x.float()` when residual is None), `y = rms_norm(r)`, in one pass.

    Args:
        x: `[..., D]` bf16/fp16/fp32, rows may be strided; D <= MAX_D.
        residual: `[..., D]` (x's shape) fp32 (bf16/fp16 accepted, read upcast), rows may be strided; or None.
        weight: `[D]` bf16/fp16/fp32.  eps: added to the mean square.
        inplace: write r into `residual` (fp32, rows addressable by one stride) and return it; ignored when
            residual is None. Otherwise r is a new contiguous tensor. Either way r is never x itself.
        block_n, num_warps: override the launch configuration (for benchmarks).

    Returns:
        (y `[..., D]` in weight's dtype, r `[..., D]` fp32).
    """
    D = x.shape[-1]
    weight = _check(weight, D, x, *(() if residual is None else (residual,)))
    x2 = _rows(x, D)
    N = x2.shape[0]
    r2 = x2  # a placeholder pointer when there is no residual
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
        r2 = _rows(residual, D)
    inplace = inplace and residual is not None
    ro2 = _inplace_rows(residual, D) if inplace else None
    direct = ro2 is not None  # r written straight into residual's memory
    if direct:
        r2 = ro2  # read and write the same elements (each by the same thread: see the kernel)
    else:
        ro2 = common.output_buffer((N, D), torch.float32, x.device)
    y = common.output_buffer((N, D), weight.dtype, x.device)
    if N:
        BD, BN, nw = _config(N, D, block_n, num_warps)
        launch_kernel(_rms_norm_kernel, (common.cdiv(N, BN),),
            x2, r2, ro2, weight, y, N, D, x2.stride(0), r2.stride(0), ro2.stride(0), eps,
            BLOCK_N=BN, BLOCK_D=BD, ADD=True, HAS_RES=residual is not None,
            INTERP=INTERPRET, num_warps=nw,
        )
    if direct:
        return y.view(x.shape), residual
    if inplace:  # residual's rows are not addressable by one stride: r was computed aside, copy it back
        return y.view(x.shape), residual.copy_(ro2.view(x.shape))
    return y.view(x.shape), ro2.view(x.shape)


def _inplace_rows(residual: torch.Tensor, D: int) -> torch.Tensor | None:
    """residual `[..., D]` fp32 as an `[N, D]` view of its own memory (unit columns, one row stride), else None."""
    if residual.dtype != torch.float32:
        raise ValueError(f"inplace needs an fp32 residual, got {residual.dtype}")
    if residual.stride(-1) != 1:
        return None
    try:
        return residual.view(-1, D)
    except RuntimeError:  # leading dims do not merge into one stride
        return None


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    norm_before_gate: bool = False,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Gated RMSNorm over groups of `group_size` channels (reference.gated_rms_norm), fp32 math.

    norm_before_gate=False (Mamba-2): `rmsnorm_g(x * silu(gate)) * w`; True (GKA): `rmsnorm_g(x) * w * silu(gate)`.

    Args:
        x, gate: `[..., D]` (same shape) bf16/fp16/fp32, rows may be strided; group_size divides D, <= MAX_D.
        weight: `[D]` bf16/fp16/fp32.  eps: added to the mean square.
        block_n, num_warps: override the launch configuration (for benchmarks).

    Returns:
        y: `[..., D]` in weight's dtype, contiguous.
    """
    D = x.shape[-1]
    weight = _check(weight, D, x, gate)
    if gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
    if group_size <= 0 or D % group_size:
        raise ValueError(f"group_size {group_size} must divide D={D}")
    x2, g2 = _rows(x, D), _rows(gate, D)
    N = x2.shape[0]
    y = common.output_buffer((N, D), weight.dtype, x.device)
    if N:
        BG, BN, nw = _config(N, group_size, block_n, num_warps)
        launch_kernel(_gated_rms_norm_kernel, (common.cdiv(N, BN), D // group_size),
            x2, g2, weight, y, N, D, group_size, x2.stride(0), g2.stride(0), eps,
            BLOCK_N=BN, BLOCK_G=BG, NORM_BEFORE_GATE=bool(norm_before_gate),
            INTERP=INTERPRET, num_warps=nw,
        )
    return y.view(x.shape)
