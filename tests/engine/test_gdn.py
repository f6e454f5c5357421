"""Gated DeltaNet's reference math (kernels/gdn/reference.py): the chunked WY form against the token-by-token
definition in float64, the serving ops on pool rows, and what the delta rule promises (a key written with full
strength is then recalled exactly). The layer against hmf's own code is tests/test_hmf.py (`gdn_fp32`); the Triton
kernels against these references are tests/kernels/test_gdn.py; the mixer's serving invariants
tests/engine/test_mixers.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfree.kernels.gdn import reference as gdn
from tests.conftest import rel_err

F64 = torch.float64


def inputs(gen: torch.Generator, B: int, T: int, H: int, D: int, Dv: int, decay: float = 0.3) -> list[torch.Tensor]:
    """Unit queries and keys, values, log decays in [-decay, 0] and write strengths in (0, 1), in float64."""
    q = F.normalize(torch.randn(B, T, H, D, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=F64)
    g = -decay * torch.rand(B, T, H, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    return [q, k, v, g, beta]


@pytest.mark.parametrize(("T", "chunk", "decay"), [(1, 16, 0.3), (47, 16, 0.3), (64, 64, 0.3), (150, 32, 8.0)])
def test_the_chunked_wy_form_computes_the_token_by_token_definition(T, chunk, decay):
    """Outputs and final states of `gdn_chunked` equal `gdn_recurrent`'s from a random state, for a single token, a
    part chunk, whole chunks, and decays strong enough (down to exp(-8) a token) to underflow across a chunk."""
    gen = torch.Generator().manual_seed(T)
    q, k, v, g, beta = inputs(gen, 2, T, 3, 16, 8, decay)
    s0 = torch.randn(2, 3, 16, 8, generator=gen, dtype=F64)
    o_ref, s_ref = gdn.gdn_recurrent(q, k, v, g, beta, s0, 0.25)
    o, s = gdn.gdn_chunked(q, k, v, g, beta, s0, 0.25, chunk)
    assert rel_err(o, o_ref) <= 1e-12
    assert rel_err(s, s_ref) <= 1e-12


def test_packed_prefill_and_decode_on_pool_rows_continue_each_session_and_leave_other_rows_alone():
    """`chunk_gdn` over three packed sequences (one empty) then `fused_recurrent_gdn` steps: each session's outputs
    and state are its own definition's, continued from its pool row; rows not named are bit for bit unchanged."""
    gen = torch.Generator().manual_seed(7)
    H, D, Dv, lens = 2, 16, 8, [37, 0, 70]
    pool = torch.randn(6, H, D, Dv, generator=gen, dtype=F64)
    before = pool.clone()
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    seqs = [inputs(gen, 1, n + 2, H, D, Dv) for n in lens]  # each: prompt of n tokens, then 2 decode tokens
    packed = [torch.cat([s[i][0, :n] for s, n in zip(seqs, lens, strict=True)]) for i in range(5)]
    cu = torch.tensor([0, 37, 37, 107], dtype=torch.int32)
    o = gdn.chunk_gdn(*packed, pool, slots, cu, 0.5, chunk_size=16)
    outs = [o[:37], o[37:37], o[37:]]
    for t in range(2):
        step = [torch.cat([s[i][0, n + t : n + t + 1] for s, n in zip(seqs, lens, strict=True)]) for i in range(5)]
        o_t = gdn.fused_recurrent_gdn(*step, pool, slots, 0.5)
        outs = [torch.cat([a, o_t[j : j + 1]]) for j, a in enumerate(outs)]
    for j, (s, slot) in enumerate(zip(seqs, slots.tolist(), strict=True)):
        o_ref, s_ref = gdn.gdn_recurrent(*s, before[slot : slot + 1], 0.5)
        assert rel_err(outs[j], o_ref[0]) <= 1e-12
        assert rel_err(pool[slot], s_ref[0]) <= 1e-12
    assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])


def test_a_key_written_at_full_strength_is_recalled_exactly():
    """With beta = 1 and no decay the delta rule replaces what the state held for a unit key k by v: afterwards
    S^T k = v whatever S held before (an additive linear-attention write would return v plus the old S^T k)."""
    gen = torch.Generator().manual_seed(3)
    k = F.normalize(torch.randn(1, 2, 16, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(1, 2, 8, generator=gen, dtype=F64)
    state = torch.randn(1, 2, 16, 8, generator=gen, dtype=F64)
    ones, zeros = torch.ones(1, 2, dtype=F64), torch.zeros(1, 2, dtype=F64)
    o, _ = gdn.gdn_step(k, k, v, zeros, ones, state, 1.0)  # the query is the key just written
    assert rel_err(o, v) <= 1e-12
