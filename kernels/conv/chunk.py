"""Triton causal depthwise conv1d over packed variable-length sequences, tails in place in a pool (prefill).

One program per (token block of one sequence, channel block); token blocks never cross a sequence boundary. Tap k of
output row t reads input row t-(K-1)+k: from x when it lies inside the sequence, else from the sequence's pool row
(the last K-1 inputs seen). The program of a sequence's first block is the only one that reads the pool row, so it
also writes the new tail there, after a barrier that orders its reads before its writes.

The block metadata comes from the host on an eager step, or from the device (`device_chunks`) for a step captured in
a CUDA graph: the grid is then sized by a bound on the block count and the programs past the real count return at
once. An empty sequence has no block, so its pool row is neither read nor written.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import common
from ..dispatch import DeviceChunks, chunk_metadata, host_cu_seqlens
from ..launcher import launch_kernel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") in ("1", "true", "True")


@triton.jit
def _conv_varlen_kernel(
    x,
    y,
    state,
    state_indices,
    cu_seqlens,
    block_indices,
    weight,
    bias,
    stride_xt,
    stride_xc,
    stride_ss,
    stride_sk,
    stride_sc,
    stride_wc,
    stride_wk,
    C,
    K: tl.constexpr,
    KP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(block_indices + 2 * i_b).to(tl.int64)
    if i_n < 0:  # past the real block count (a grid sized by a bound: device metadata)
        return
    j = tl.load(block_indices + 2 * i_b + 1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    slot = tl.load(state_indices + i_n).to(tl.int64)
    seqlen = eos - bos

    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    rows = j * BT + tl.arange(0, BT)  # position in the sequence
    m_t = rows < seqlen
    p_state = state + slot * stride_ss + o_c[None, :] * stride_sc

    if HAS_BIAS:
        acc = tl.zeros([BT, BC], dtype=tl.float32) + tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    else:
        acc = tl.zeros([BT, BC], dtype=tl.float32)
    for k in tl.static_range(K):
        src = rows - (K - 1) + k  # input position this tap reads; < 0 means the tail
        w = tl.load(weight + o_c * stride_wc + k * stride_wk, mask=m_c, other=0.0).to(tl.float32)
        in_x = (src >= 0) & m_t
        xv = tl.load(x + (bos + src)[:, None] * stride_xt + o_c[None, :] * stride_xc,
                     mask=in_x[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        in_s = (src < 0) & m_t
        sv = tl.load(p_state + (src + K - 1)[:, None] * stride_sk, mask=in_s[:, None] & m_c[None, :],
                     other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + (bos + rows)[:, None] * C + o_c[None, :], acc.to(y.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])

    if j == 0:
        # New tail row r = input position seqlen-(K-1)+r: from x, or (short sequences) from the old tail.
        r = tl.arange(0, KP)
        pos = seqlen - (K - 1) + r
        m_r = r < K - 1
        tx = tl.load(x + (bos + pos)[:, None] * stride_xt + o_c[None, :] * stride_xc,
                     mask=((pos >= 0) & m_r)[:, None] & m_c[None, :], other=0.0)
        ts = tl.load(p_state + (pos + K - 1)[:, None] * stride_sk, mask=((pos < 0) & m_r)[:, None] & m_c[None, :],
                     other=0.0)
        new = tl.where((pos >= 0)[:, None], tx.to(state.dtype.element_ty), ts)
        tl.debug_barrier()  # every read of the old tail in this program happens before any write
        tl.store(p_state + r[:, None] * stride_sk, new, mask=m_r[:, None] & m_c[None, :])


def chunk_causal_conv1d(
    x: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    cu_seqlens_cpu: torch.Tensor | list[int] | tuple[int, ...] | None = None,
    device_chunks: DeviceChunks | None = None,
) -> torch.Tensor:
    """Triton `kvfree.kernels.conv.chunk_causal_conv1d` (same arguments and result; see its docstring).

    x may have any strides; y is contiguous. Needs K >= 2.
    """
    if activation not in (None, "silu"):
        raise ValueError(f"activation={activation!r}: expected None or 'silu'")
    T, C = x.shape
    K = weight.shape[1]
    if K < 2 or tuple(state.shape[1:]) != (K - 1, C):
        raise ValueError(f"state {tuple(state.shape)} must be [S, K-1={K - 1}, C={C}] with K >= 2")
    BT = 16 if INTERPRET else 32  # [32, 128] tiles: 32 fp32 values per thread and tensor, no spills at K=4
    BC = min(128, max(16, common.next_power_of_2(C)))
    if K - 1 > BT:
        raise ValueError(f"kernel size K={K} is larger than the token block {BT} + 1")
    if device_chunks is not None:  # nb is a bound; the kernel skips the blocks past the real count
        device_chunks.check(cu_seqlens, T)
        blocks, _, nb = device_chunks.get(BT)
    else:
        blocks, _, nb = chunk_metadata(host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T), BT, x.device)
    y = common.output_buffer((T, C), x.dtype, x.device)
    if nb == 0:
        return y
    launch_kernel(_conv_varlen_kernel, (nb, common.cdiv(C, BC)),
        x, y, state, state_indices, cu_seqlens, blocks, weight, bias if bias is not None else weight,
        x.stride(0), x.stride(1), state.stride(0), state.stride(1), state.stride(2), weight.stride(0),
        weight.stride(1), C,
        K=K, KP=max(2, common.next_power_of_2(K - 1)), BT=BT, BC=BC, HAS_BIAS=bias is not None,
        SILU=activation == "silu", num_warps=4,
    )
    return y
