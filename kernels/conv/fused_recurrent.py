"""Triton causal depthwise conv1d for one decode token per session, tails shifted in place in a pool.

One program per (session, channel block): it reads the session's K-1 tail rows and its token, writes the output, and
after a barrier (its reads of the tail come before its writes) stores the tail shifted by one token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import common
from ..launcher import launch_kernel


@triton.jit
def _conv_step_kernel(
    x,
    y,
    state,
    state_indices,
    weight,
    bias,
    stride_xb,
    stride_xc,
    stride_ss,
    stride_sk,
    stride_sc,
    stride_wc,
    stride_wk,
    C,
    K: tl.constexpr,
    KP: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    r = tl.arange(0, KP)
    m_r = r < K - 1
    m = m_r[:, None] & m_c[None, :]
    p_state = state + slot * stride_ss + o_c[None, :] * stride_sc

    tail = tl.load(p_state + r[:, None] * stride_sk, mask=m, other=0.0)  # [KP, BC] rows 0..K-2
    xv = tl.load(x + i_b * stride_xb + o_c * stride_xc, mask=m_c, other=0.0)
    w_tail = tl.load(weight + o_c[None, :] * stride_wc + r[:, None] * stride_wk, mask=m, other=0.0).to(tl.float32)
    w_last = tl.load(weight + o_c * stride_wc + (K - 1) * stride_wk, mask=m_c, other=0.0).to(tl.float32)
    acc = tl.sum(tail.to(tl.float32) * w_tail, axis=0) + xv.to(tl.float32) * w_last
    if HAS_BIAS:
        acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + i_b * C + o_c, acc.to(y.dtype.element_ty), mask=m_c)

    # Shifted tail: row r <- old row r+1, the last row <- this token.
    nxt = tl.load(p_state + (r + 1)[:, None] * stride_sk, mask=(r + 1 < K - 1)[:, None] & m_c[None, :], other=0.0)
    new = tl.where((r == K - 2)[:, None], xv.to(state.dtype.element_ty)[None, :], nxt)
    tl.debug_barrier()  # every read of the old tail in this program happens before any write
    tl.store(p_state + r[:, None] * stride_sk, new, mask=m)


def fused_recurrent_causal_conv1d(
    x: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Triton `kvfree.kernels.conv.fused_recurrent_causal_conv1d` (same arguments and result; see its docstring).

    x may have any strides. Graph-capturable.
    """
    if activation not in (None, "silu"):
        raise ValueError(f"activation={activation!r}: expected None or 'silu'")
    Bs, C = x.shape
    K = weight.shape[1]
    if K < 2 or tuple(state.shape[1:]) != (K - 1, C):
        raise ValueError(f"state {tuple(state.shape)} must be [S, K-1={K - 1}, C={C}] with K >= 2")
    y = common.output_buffer((Bs, C), x.dtype, x.device)
    if Bs == 0:
        return y
    BC = min(256, max(16, common.next_power_of_2(C)))
    launch_kernel(_conv_step_kernel, (Bs, common.cdiv(C, BC)),
        x, y, state, state_indices, weight, bias if bias is not None else weight,
        x.stride(0), x.stride(1), state.stride(0), state.stride(1), state.stride(2), weight.stride(0),
        weight.stride(1), C,
        K=K, KP=max(2, common.next_power_of_2(K - 1)), BC=BC, HAS_BIAS=bias is not None,
        SILU=activation == "silu", num_warps=4,
    )
    return y
