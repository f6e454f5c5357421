"""The cached Triton launcher (kernels/launcher.py): what keys a compiled binary, and on a GPU, that a warm call runs
the binary Triton would have chosen, for every alignment and integer specialisation."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from kvfree.kernels import launcher  # noqa: E402
from kvfree.kernels.launcher import _arg_key, launch_kernel  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (elsewhere Triton's path runs)")


def test_the_key_tells_apart_every_integer_triton_specialises_on():
    keys = {n: _arg_key(n) for n in (1, 2, 16, 17, 32, 2**31 - 16, 2**31, 2**40 + 1)}
    assert keys[16] == keys[32] == keys[2**31 - 16]  # divisible by 16, 32-bit
    assert keys[2] == keys[17]  # neither 1 nor divisible by 16
    assert len({keys[1], keys[2], keys[16], keys[2**31], keys[2**40 + 1]}) == 5  # 1, plain, %16, wide %16, wide


def test_the_host_side_grid_arithmetic_is_tritons():
    """Wrappers size grids and blocks with kernels.common's plain-Python cdiv and next_power_of_2 (Triton's are
    constexpr functions, slow to call from the host): the same numbers."""
    from kvfree.kernels import common

    for n in range(0, 1100):
        assert common.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 64, 255):
            assert common.cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert common.next_power_of_2(2**31 + 1) == triton.next_power_of_2(2**31 + 1) == 2**32


def test_the_key_tells_apart_tensors_by_dtype_and_sixteen_byte_alignment():
    x = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(x) == _arg_key(x[4:])  # 16 bytes in: still aligned
    assert _arg_key(x) != _arg_key(x[1:])  # 4 bytes in: not
    assert _arg_key(x) != _arg_key(x.to(torch.bfloat16))
    assert _arg_key(0.5) == _arg_key(2.0) and _arg_key(None) is None and _arg_key(True) != _arg_key(False)


@triton.jit
def _strided_copy_kernel(src, dst, n, stride, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs * stride, mask=mask) * scale, mask=mask)


@cuda
def test_a_warm_call_runs_the_binary_for_its_own_alignment_and_integers():
    """Calls alternate between aligned and misaligned pointers, strides 1, 16 and 3, and lengths that are and are not
    multiples of 16: each combination compiles once, later calls of it take the cached binary, and every result
    is exact (a binary reused across an alignment it assumed would read wrong elements or fault)."""
    base = torch.randn(4096, device="cuda")
    out = torch.empty(4096 + 8, device="cuda")
    combos = [(off, stride, n) for off in (0, 1) for stride in (1, 16, 3) for n in (64, 63)]
    for _ in range(3):
        for off, stride, n in combos:
            src, dst = base[off:], out[off : off + n]
            launch_kernel(_strided_copy_kernel, (triton.cdiv(n, 32),), src, dst, n, stride, 0.5, BLOCK=32)
            torch.testing.assert_close(dst, src[: n * stride : stride] * 0.5, rtol=0, atol=0)
    cached = launcher._launchers[id(_strided_copy_kernel)]._cache
    assert 1 < len(cached) <= len(combos)  # one binary per specialisation, not one per call
