"""Gated DeltaNet Triton kernels (interpreted on the CPU, compiled on a GPU) against the float64 PyTorch reference.

Every check draws fresh random inputs as the mixer hands them over (L2-normalised q and k, log decays in [-0.2, 0],
write strengths in (0, 1)), packs sequences of unequal lengths (1, one short of a chunk, one chunk, an empty one, one
past it, several chunks), uses random rows of a larger pool (some fresh, some continuing a state), poisons every
buffer the Triton functions allocate, and checks that the rows not named stay bit-for-bit unchanged.

Tolerances (relative, on outputs and states). fp32 inputs: 1e-5; the kernels compute in fp32 throughout (IEEE dots
interpreted, "tf32x3" on a GPU), measured a few 1e-7. bf16 inputs: the dots take bf16 operands, as fla's kernels do
(the carried state, T, W, U' and the decayed scores rounded to bf16 inside them; the accumulation stays fp32), and the
outputs are rounded to bf16: held to 1.5e-2 on outputs and 5e-3 on states (measured about 1e-2 and 2e-3
interpreted, where Triton's interpreter truncates fp32 to bf16; the GPU rounds to nearest, about half the error).

Shapes are tiny (H <= 2, D <= 32, chunks of 16 where the chunk length does not matter): CI interprets this file twice
on two cores.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.gdn as gdn_ops  # noqa: E402
from kvfree.kernels.gdn import chunk as gdn_chunk  # noqa: E402
from kvfree.kernels.gdn import fused_recurrent as gdn_step  # noqa: E402
from kvfree.kernels.gdn import reference as gdn_ref  # noqa: E402
from tests import kernel_checks  # noqa: E402
from tests.kernel_checks import DEVICE, cu_of, rel, seed, untouched  # noqa: E402

OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # decode (fp32 state math; bf16 inputs and output)
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4}
PREFILL_OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # prefill: bf16 dot operands (module docstring)
PREFILL_STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
f64 = torch.float64


def lens_for(chunk: int) -> list[int]:
    """1 token; one short of a chunk; a chunk; empty; one past it; several chunks and a part."""
    return [1, chunk - 1, chunk, 0, chunk + 1, 3 * chunk + 2]


def op_inputs(
    g: torch.Generator, n: int, H: int, D: int, Dv: int, dtype: torch.dtype, decay: float = 0.2
) -> list[torch.Tensor]:
    """As the mixer hands them over: unit q and k and values in `dtype`, fp32 log decays in [-decay, 0] and write
    strengths in (0, 1)."""
    q = F.normalize(torch.randn(n, H, D, generator=g), dim=-1)
    k = F.normalize(torch.randn(n, H, D, generator=g), dim=-1)
    v = torch.randn(n, H, Dv, generator=g)
    decay = -decay * torch.rand(n, H, generator=g)
    beta = torch.rand(n, H, generator=g)
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)] + [decay.to(DEVICE), beta.to(DEVICE)]


def make_pool(g: torch.Generator, S: int, H: int, D: int, Dv: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 pool of S rows and n distinct random rows of it; every third from the second is zeros (a fresh
    session), the others continue a random state."""
    s = torch.randn(S, H, D, Dv, generator=g)
    idx = torch.randperm(S, generator=g)[:n]
    s[idx[1::3]] = 0
    return s.to(DEVICE), idx.to(torch.int32).to(DEVICE)


def to64(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to(f64) for t in tensors]


# -- prefill ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, H, D, Dv, chunk, knobs",
    [
        (torch.float32, 2, 32, 16, 16, {}),
        (torch.float32, 1, 16, 16, 64, {}),  # the default chunk: T from four 16 x 16 blocks
        (torch.float32, 1, 8, 6, 32, {}),  # D, Dv below a block (masked), Dv != D catches transposes
        (torch.float32, 1, 16, 32, 16, {"block_v": 16, "block_o": 16}),  # two column blocks in the pass and output
        (torch.float32, 1, 16, 16, 64, {"decay": 8.0}),  # decays down to exp(-8) a token: exp(G) underflows in a chunk
        (torch.bfloat16, 2, 16, 16, 16, {}),
        (torch.bfloat16, 1, 16, 16, 64, {}),  # the default chunk
    ],
)
def test_chunked_prefill_matches_the_float64_reference_on_packed_sequences_of_unequal_lengths(
    poison, dtype, H, D, Dv, chunk, knobs
):
    g = seed("chunk", dtype, H, D, Dv, chunk, tuple(knobs))
    knobs = dict(knobs)
    lens = lens_for(chunk)
    inp = op_inputs(g, sum(lens), H, D, Dv, dtype, knobs.pop("decay", 0.2))
    s, idx = make_pool(g, 9, H, D, Dv, len(lens))
    s_ref = s.to(f64)
    rest = untouched(s, idx)
    cu = cu_of(lens)

    o = gdn_chunk.launch(*inp, s, idx, cu, D**-0.5, chunk, cu_seqlens_cpu=cu.cpu(), **knobs)
    o_ref = gdn_ref.chunk_gdn(*to64(inp), s_ref, idx, cu, D**-0.5, chunk)

    i = idx.long()
    assert o.dtype == dtype and o.shape == (sum(lens), H, Dv)
    assert rel(o, o_ref) <= PREFILL_OUT_TOL[dtype]
    assert rel(s[i], s_ref[i]) <= PREFILL_STATE_TOL[dtype]
    assert torch.equal(untouched(s, idx), rest)


def test_a_prompt_prefilled_in_two_calls_gives_the_outputs_and_state_of_one(poison):
    """The second call continues the states the first left in the pool; a different chunk length on each call
    changes nothing beyond rounding."""
    g = seed("split")
    H, D, Dv = 2, 16, 16
    lens = [40, 21]
    inp = op_inputs(g, sum(lens), H, D, Dv, torch.float32)
    s, idx = make_pool(g, 5, H, D, Dv, 2)
    s2 = s.clone()
    o_one = gdn_chunk.chunk_gdn(*inp, s, idx, cu_of(lens), D**-0.5, 32)
    first = torch.cat([torch.arange(0, 24), torch.arange(40, 49)])  # 24 tokens of the first, 9 of the second
    second = torch.cat([torch.arange(24, 40), torch.arange(49, 61)])
    o_a = gdn_chunk.chunk_gdn(*(t[first] for t in inp), s2, idx, cu_of([24, 9]), D**-0.5, 16)
    o_b = gdn_chunk.chunk_gdn(*(t[second] for t in inp), s2, idx, cu_of([16, 12]), D**-0.5, 64)
    o_two = torch.empty_like(o_one)
    o_two[first], o_two[second] = o_a, o_b
    assert rel(o_two, o_one) <= 1e-5 and rel(s2, s) <= 1e-5


# -- decode ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, B, H, D, Dv, block_v",
    [
        (torch.float32, 1, 2, 32, 16, None),
        (torch.float32, 4, 2, 8, 6, None),  # D, Dv below a block (masked)
        (torch.float32, 9, 1, 16, 40, 16),  # three column blocks, the last one masked
        (torch.bfloat16, 4, 2, 32, 16, None),
    ],
)
def test_decode_step_matches_the_float64_reference_at_several_batch_sizes(poison, dtype, B, H, D, Dv, block_v):
    g = seed("step", dtype, B, H, D, Dv, block_v)
    inp = op_inputs(g, B, H, D, Dv, dtype)
    s, idx = make_pool(g, B + 6, H, D, Dv, B)
    s_ref = s.to(f64)
    rest = untouched(s, idx)

    o = gdn_step.launch(*inp, s, idx, D**-0.5, block_v=block_v)
    o_ref = gdn_ref.fused_recurrent_gdn(*to64(inp), s_ref, idx, D**-0.5)

    i = idx.long()
    assert o.dtype == dtype and o.shape == (B, H, Dv)
    assert rel(o, o_ref) <= OUT_TOL[dtype]
    assert rel(s[i], s_ref[i]) <= STATE_TOL[dtype]
    assert torch.equal(untouched(s, idx), rest)


def test_decode_after_a_prefill_continues_the_sequence_like_the_recurrent_reference(poison):
    """Prefill two prompts with the chunk kernel, then decode steps with the step kernel: the outputs and states of
    the token-by-token float64 definition (`gdn_recurrent`) over each whole sequence."""
    g = seed("continue")
    H, D, Dv = 2, 16, 16
    lens, steps = [37, 5], 3
    prompt = op_inputs(g, sum(lens), H, D, Dv, torch.float32)
    s, idx = make_pool(g, 6, H, D, Dv, 2)
    s0 = s[idx.long()].to(f64)
    outs = [gdn_chunk.chunk_gdn(*prompt, s, idx, cu_of(lens), 0.25, 16)]
    tokens = [op_inputs(g, 2, H, D, Dv, torch.float32) for _ in range(steps)]
    outs += [gdn_step.fused_recurrent_gdn(*tok, s, idx, 0.25) for tok in tokens]

    for n, (start, length) in enumerate([(0, lens[0]), (lens[0], lens[1])]):
        seq = [torch.cat([p[start : start + length], *(tok[i][n : n + 1] for tok in tokens)])
               for i, p in enumerate(prompt)]  # fmt: skip
        o_ref, s_ref = gdn_ref.gdn_recurrent(*(t.to(f64)[None] for t in seq), s0[n : n + 1], 0.25)
        o = torch.cat([outs[0][start : start + length]] + [out[n : n + 1] for out in outs[1:]])
        assert rel(o, o_ref[0]) <= 1e-5
        assert rel(s[idx[n].long()], s_ref[0]) <= 1e-5


def test_bad_shapes_are_refused():
    g = seed("shapes")
    inp = op_inputs(g, 4, 2, 16, 16, torch.float32)
    s, idx = make_pool(g, 6, 2, 16, 16, 4)
    with pytest.raises(ValueError, match="fp32 pool"):
        gdn_step.fused_recurrent_gdn(*inp, s.double(), idx, 0.25)
    with pytest.raises(ValueError, match="shapes"):
        gdn_chunk.chunk_gdn(*inp, s[:, :1], idx[:1], cu_of([4]), 0.25)


# -- dispatch --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, want", [("reference", "reference"), ("triton", "triton")])
def test_ops_dispatch_to_what_the_mode_says_and_fp64_always_to_the_reference(monkeypatch, mode, want):
    calls = kernel_checks.recorded_dispatch(
        monkeypatch, mode, (gdn_ref, "fused_recurrent_gdn", "reference"), (gdn_step, "fused_recurrent_gdn", "triton")
    )
    g = seed("dispatch")
    inp = op_inputs(g, 2, 2, 16, 16, torch.float32)
    s, idx = make_pool(g, 4, 2, 16, 16, 2)
    gdn_ops.fused_recurrent_gdn(*inp, s, idx, 0.25)
    gdn_ops.fused_recurrent_gdn(*to64(inp), s.double(), idx, 0.25)
    assert calls == [want, "reference"]
