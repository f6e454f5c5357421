"""SKA (Spectral Koopman Attention, Echo; docs/design/ska.md) and the Spectral Koopman MLP.

- the six parity tests of docs/design/ska.md §3.5;
- a float64 reference written directly from the paper's equations (seq-max normalised stats, eqs. 7-10, the App. F
  pipeline step by step, one token at a time) that the mixer must match;
- the engine invariants (prefill == decode steps, split and packed prefill, forward == prefill, snapshots, slots);
- mode P (the paper's prefix mode) as docs/design/ska.md §3.4 defines it;
- the serving ops `chunk_ska` / `fused_recurrent_ska` on pool rows against the per-session math;
- the Koopman MLP (eq. 14, |lambda| <= 1) and models that use it;
- a 16K-token session.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvfree.engine.model.config import ConfigError, ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.layers.mlp import KoopmanMLP
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from kvfree.kernels.ska import (
    SKAState,
    cholesky_fallback_count,
    chunk_ska,
    fused_recurrent_ska,
    robust_cholesky,
    ska_chunked,
    ska_empty_state,
    ska_prefix,
    ska_readout,
    ska_step,
)
from tests.conftest import (
    SUBCONFIGS,
    VOCAB,
    assert_states_close,
    greedy,
    mixer_decode_all,
    mixer_prefill,
    model_prefill,
    random_ids,
    randomize,
    rel_err,
    state_rows,
)

D = 32
SKA = {"num_heads": 2, "rank": 6, "head_dim": 8, "chunk_size": 8}
TOL = 1e-5  # fp32 projections and readout; the stats and the operator are fp64 (accum_dtype default)
F64 = torch.float64


def make_model(
    layers: list[str], seed: int = 0, mlp: dict | None = None, hidden: int = D, mamba2: dict | None = None, **ska
) -> HybridLM:
    data = {"vocab_size": VOCAB, "hidden_size": hidden, "layers": layers, "ska": {**SKA, **ska}}
    if "mamba2" in layers:
        data["mamba2"] = mamba2 or SUBCONFIGS["mamba2"]
    if mlp is not None:
        data["mlp"] = mlp
    model = HybridLM(ModelConfig.from_dict(data))
    randomize(model, seed)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            if layer.mixer.kind == "ska":  # interior values: gamma inside (1, 1.5) so its clamp is not what's tested
                layer.mixer.eta.fill_(1.3 + 0.1 * i)
                layer.mixer.gamma.fill_(1.2 + 0.05 * i)
    return model.eval()


def ska_mixer(seed: int = 0, capacity: int = 4, **ska):
    model = make_model(["ska"], seed=seed, **ska)
    pool = StatePool(model, capacity=capacity)
    return model.layers[0].mixer, pool.tensors[0], pool


# -- an independent float64 SKA, straight from the paper's equations ---------------------------------------------
def power_sigma(A: torch.Tensor, iters: int) -> float:
    """docs/design/ska.md §2.5: v0 = 1/sqrt(r); u = Av/|Av|, v = A^T u/|A^T u|; sigma = |Av|."""
    v = torch.full((A.shape[1],), 1 / math.sqrt(A.shape[1]), dtype=A.dtype)
    for _ in range(iters):
        u = A @ v
        u = u / max(float(u.norm()), 1e-8)
        v = A.T @ u
        v = v / max(float(v.norm()), 1e-8)
    return float((A @ v).norm())


def app_f(Gt, M, Cv, q, eta: float, gamma: float, K: int, iters: int) -> torch.Tensor:
    """App. F steps 4-10 literally: Cholesky, whitened operator, spectral norm, value map, query whitening,
    power filter, unwhiten and read. Gt already holds the ridge."""
    L = torch.linalg.cholesky(Gt)
    Y = torch.linalg.solve_triangular(L, M, upper=False)
    Aw = torch.linalg.solve_triangular(L, Y.T, upper=False).T
    Ah = gamma / max(1.0, power_sigma(Aw, iters)) * Aw
    Bv = torch.linalg.solve(Gt, Cv.T).T
    wq = torch.linalg.solve_triangular(L, q[:, None], upper=False)[:, 0]
    wf = torch.linalg.matrix_power(Ah, K) @ wq
    return eta * Bv @ (L @ wf)


def reference(mixer, x: torch.Tensor, seen, m_seen, a: torch.Tensor | None = None) -> torch.Tensor:
    """SKA layer output for one sequence x `[T, D]` in float64, one token at a time.

    seen(t): how many leading tokens form the statistics that token t reads (t // S * S in chunk-causal mode).
    m_seen(t): how many leading tokens the key max-norm m is taken over (eq. 3). Keys and queries are divided by
    m and the stats of eqs. 4-6 / 53 (with eps I) are built from scratch for every token.
    """
    c = mixer.cfg
    H, r, P = c.num_heads, c.rank, c.head_dim
    T = x.shape[0]
    x = x.double()
    Z = (x @ mixer.k_proj.weight.double().T).view(T, H, r)
    Q = (x @ mixer.q_proj.weight.double().T).view(T, H, r)
    V = (x @ mixer.v_proj.weight.double().T).view(T, H, P)
    a = torch.ones(T, dtype=F64) if a is None else a.double()
    eta, gamma = float(mixer.eta), min(max(float(mixer.gamma), 1.0), 1.5)
    out = torch.zeros(T, H, P, dtype=F64)
    for h in range(H):
        for t in range(T):
            n = seen(t)
            if n == 0:
                continue  # empty stats: Cv = 0, the output is exactly 0
            m = max(max(float(a[s] * Z[s, h].norm()) for s in range(m_seen(t))), 1e-6)
            z, q = Z[:, h] / m, Q[t, h] / m
            Gt = c.ridge_eps * torch.eye(r, dtype=F64)
            M = torch.zeros(r, r, dtype=F64)
            Cv = torch.zeros(P, r, dtype=F64)
            for s in range(n):
                Gt += a[s] * torch.outer(z[s], z[s])
                Cv += a[s] * torch.outer(V[s, h], z[s])
                if s >= 1:
                    M += a[s] * a[s - 1] * torch.outer(z[s], z[s - 1])
            out[t, h] = app_f(Gt, M, Cv, q, eta, gamma, c.power_order, c.power_iters)
    return out.flatten(1) @ mixer.o_proj.weight.double().T


def chunk_causal(S: int):
    return lambda t: t // S * S


def random_stats(gen: torch.Generator, r: int = 6, P: int = 5, T: int = 40, dtype=torch.float32):
    Z = torch.randn(T, r, generator=gen, dtype=dtype) * torch.rand(T, 1, generator=gen, dtype=dtype).add(0.2)
    V = torch.randn(T, P, generator=gen, dtype=dtype)
    return Z.T @ Z, Z[1:].T @ Z[:-1], V.T @ Z, torch.randn(r, generator=gen, dtype=dtype)


# == ska.md §3.5 parity tests ====================================================================================
def test_1_app_f_pipeline_equals_closed_form_fp32() -> None:
    """§3.5 #1: the literal App. F pipeline == eta c^K Cv G~^-1 (M G~^-1)^K q (the kernel's J), in FP32."""
    gen = torch.Generator().manual_seed(1)
    for K in (1, 2, 3):
        G, M, C, q = random_stats(gen)
        eps, eta, gamma = 1e-3, 1.5, 1.25
        literal = app_f(G + eps * torch.eye(6), M, C, q, eta, gamma, K, 6)
        J = ska_readout(G, M, C, torch.tensor(1.0), eps=eps, eta=eta, gamma=gamma, order=K, power_iters=6)
        assert J.dtype == torch.float32
        assert rel_err(J @ q, literal.double()) <= 1e-5
        assert rel_err(J @ q, app_f(*(t.double() for t in (G + eps * torch.eye(6), M, C, q)), eta, gamma, K, 6)) < 1e-5


@pytest.mark.parametrize("key_norm", ["causal", "frozen"])
def test_2_mode_c_prefill_then_decode_equals_chunked_forward(key_norm: str) -> None:
    """§3.5 #2: extend(prompt) then per-token decode == the parallel chunk-causal forward at every position;
    chunk 0 outputs exactly 0. With key_norm="frozen" (m frozen at the prompt's max) the prompt holds the
    largest key, so that the forward's whole-sequence max is the same fixed m."""
    torch.manual_seed(2)
    mixer, state, _ = ska_mixer(key_norm=key_norm)
    S = mixer.cfg.chunk_size
    x = torch.randn(45, D)
    x[3] *= 20.0  # the largest key sits in the prompt
    whole = mixer(x[None])[0]
    assert torch.equal(whole[:S], torch.zeros(S, D))
    assert whole[S:].abs().min() > 0
    for slot, cut in enumerate((13, 16, 5)):
        y = torch.cat([mixer_prefill(mixer, state, slot, x[:cut]), mixer_decode_all(mixer, state, slot, x[cut:])])
        assert torch.equal(y[:S], torch.zeros(S, D))
        assert rel_err(y, whole) <= TOL, cut


def test_3_causality() -> None:
    """§3.5 #3: perturbing token t leaves the outputs at positions < S*floor(t/S) unchanged; in fact every output
    before the NEXT chunk boundary except t's own (whose query changed): token t enters the statistics only from
    the chunk after its own on."""
    torch.manual_seed(3)
    mixer, _, _ = ska_mixer()
    S = mixer.cfg.chunk_size
    x = torch.randn(1, 40, D)
    base = mixer(x)
    for t in (5, 8, 21, 31):
        x2 = x.clone()
        x2[0, t] += 3.0
        y = mixer(x2)
        end = (t // S + 1) * S
        assert torch.equal(y[0, : t // S * S], base[0, : t // S * S]), t
        others = torch.arange(end) != t
        assert torch.equal(y[0, :end][others], base[0, :end][others]), t
        assert not torch.allclose(y[0, t], base[0, t]) or t < S, t
        assert not torch.allclose(y[0, end:], base[0, end:]), t


def test_4_k0_is_ridge_retrieval() -> None:
    """§3.5 #4 (Cor. I.9): with K = 0 the output is exactly ridge retrieval eta Cv G~^-1 q."""
    gen = torch.Generator().manual_seed(4)
    G, M, C, q = random_stats(gen, dtype=F64)
    m = torch.tensor(2.5, dtype=F64)
    J = ska_readout(G, M, C, m, eps=1e-3, eta=1.7, gamma=1.4, order=0, power_iters=6)
    ridge = 1.7 * C @ torch.linalg.solve(G + 1e-3 * 2.5**2 * torch.eye(6, dtype=F64), q)
    assert rel_err(J @ q, ridge) <= 1e-12
    # and the mixer with power_order 0 matches the float64 reference (whose K = 0 pipeline is the same ridge)
    torch.manual_seed(4)
    mixer, _, _ = ska_mixer(power_order=0)
    x = torch.randn(27, D)
    S = mixer.cfg.chunk_size
    assert rel_err(mixer(x[None])[0], reference(mixer, x, chunk_causal(S), chunk_causal(S))) <= TOL


def test_5_raw_stats_with_scaled_ridge_equal_normalised_stats() -> None:
    """§3.5 #5 (§2.3): raw stats with ridge eps*m^2 and a raw query == normalised stats + eps and q/m."""
    gen = torch.Generator().manual_seed(5)
    G, M, C, q = random_stats(gen, dtype=F64)
    G, M, C, q = 9.0 * G, 9.0 * M, 3.0 * C, 3.0 * q  # keys of norm up to ~3 * 4: m far from 1
    m = torch.tensor(7.3, dtype=F64)
    kw = {"eps": 1e-3, "eta": 1.5, "gamma": 1.3, "order": 2, "power_iters": 6}
    raw = ska_readout(G, M, C, m, **kw) @ q
    normalised = ska_readout(G / m**2, M / m**2, C / m, torch.tensor(1.0, dtype=F64), **kw) @ (q / m)
    assert rel_err(raw, normalised) <= 1e-12


@pytest.mark.parametrize("accum", ["float64", "float32"])
def test_6_state_bytes_per_head_and_constant_in_context(accum: str) -> None:
    """§3.5 #6: bytes per head = s*(2r^2 + P r) + 4*(r + 1) + 4*P r (s = accumulator size; the last term is the
    cached J), plus an 8-byte position per layer; the same for every context length."""
    model = make_model(["ska", "ska"], accum_dtype=accum)
    pool = StatePool(model, capacity=2, max_context=64)
    H, r, P = SKA["num_heads"], SKA["rank"], SKA["head_dim"]
    s = 8 if accum == "float64" else 4
    per_head = s * (2 * r * r + P * r) + 4 * (r + 1) + 4 * P * r
    if accum == "float32":
        assert per_head == 4 * (2 * r * r + P * r + r + 1) + 4 * P * r  # the paper's count, + J
    expected = 2 * (H * per_head + 8)
    assert pool.bytes_per_session() == expected
    assert pool.bytes_per_session(10) == pool.bytes_per_session(1_000_000) == expected
    assert pool.bytes_per_token() == 0
    slot = pool.alloc()
    for n in (5, 300):
        model.prefill(torch.randint(0, 256, (n,)), pool.tensors, StepBatch.prefill([slot], [n]))
        assert pool.session_bytes(slot) == expected


# == against the float64 reference ================================================================================
@pytest.mark.parametrize("masked", [False, True])
def test_forward_matches_float64_reference(masked: bool) -> None:
    """The batched training forward (raw stats, fp64 accumulators, J readout) == the per-token float64 paper
    pipeline on seq-max-normalised stats (causal m), with and without an action mask (eq. 53)."""
    torch.manual_seed(6)
    mixer, _, _ = ska_mixer()
    S = mixer.cfg.chunk_size
    x = torch.randn(2, 37, D)
    a = (torch.rand(2, 37) > 0.3).float() if masked else None
    y = mixer(x, mask=a)
    for b in range(2):
        ref = reference(mixer, x[b], chunk_causal(S), chunk_causal(S), None if a is None else a[b])
        assert rel_err(y[b], ref) <= TOL


def test_frozen_key_norm_is_the_papers_sequence_max() -> None:
    """key_norm="frozen": the forward normalises by the max over the WHOLE sequence (eq. 3, non-causal)."""
    torch.manual_seed(7)
    mixer, _, _ = ska_mixer(key_norm="frozen")
    x = torch.randn(30, D)
    x[27] *= 10.0  # a late large key changes the ridge of every earlier chunk
    ref = reference(mixer, x, chunk_causal(mixer.cfg.chunk_size), lambda t: 30)
    assert rel_err(mixer(x[None])[0], ref) <= TOL


def test_gamma_is_clamped_to_its_range() -> None:
    torch.manual_seed(8)
    mixer, _, _ = ska_mixer()
    x = torch.randn(1, 30, D)
    outs = []
    for g in (2.0, 1.5, 0.2, 1.0):
        with torch.no_grad():
            mixer.gamma.fill_(g)
        outs.append(mixer(x))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
    assert not torch.allclose(outs[1], outs[3])


# == engine invariants (mode C) ===================================================================================
@pytest.mark.parametrize("T", [1, 7, 37])
def test_prefill_equals_decode_steps(T: int) -> None:
    torch.manual_seed(T)
    mixer, state, _ = ska_mixer()
    prefix, x = torch.randn(11, D), torch.randn(T, D)
    for slot in (0, 1):
        mixer_prefill(mixer, state, slot, prefix)
    y_prefill = mixer_prefill(mixer, state, 0, x)
    y_decode = mixer_decode_all(mixer, state, 1, x)
    assert y_prefill.shape == (T, D)
    assert rel_err(y_decode, y_prefill) <= TOL
    assert_states_close(state_rows(state, 1), state_rows(state, 0))


MLPS = [None, {"intermediate_size": 64}, {"intermediate_size": 64, "kind": "koopman"}]


@pytest.mark.parametrize("mlp", MLPS)
def test_training_forward_equals_prefill(mlp) -> None:
    torch.manual_seed(11)
    model = make_model(["mamba2", "ska", "ska"], mlp=mlp)
    ids = torch.randint(0, 256, (3, 29))
    batched = model(ids)
    pool = StatePool(model, capacity=3)
    packed = model.prefill(ids.flatten(), pool.tensors, StepBatch.prefill([0, 1, 2], [29] * 3), all_logits=True)
    assert rel_err(batched.flatten(0, 1), packed) <= TOL


def test_training_forward_is_differentiable() -> None:
    with torch.inference_mode(False), torch.enable_grad():
        model = make_model(["mamba2", "ska"], mlp={"intermediate_size": 64, "kind": "koopman", "gated": True})
        ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(12))
        loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    ska = model.layers[1].mixer
    for p in (ska.k_proj.weight, ska.q_proj.weight, ska.v_proj.weight, ska.o_proj.weight, ska.eta, ska.gamma):
        assert p.grad.abs().sum() > 0
    assert model.layers[0].mlp.omega.grad.abs().sum() > 0


def test_snapshot_restore_mid_sequence_continues_identically() -> None:
    model = make_model(["mamba2", "ska"], seed=13, mlp={"intermediate_size": 64, "kind": "koopman"})
    pool = StatePool(model, capacity=2)
    first = int(model_prefill(model, pool, 1, random_ids(21, 13)).argmax())
    (warm,), _ = greedy(model, pool, [1], [first], 5)  # stop mid-chunk (26 tokens consumed)
    snapshot = pool.export(1)
    assert snapshot["layers.1.G"].dtype == F64 and int(snapshot["layers.1.pos"]) == 26
    (expected,), exp_logits = greedy(model, pool, [1], [warm[-1]], 15)
    other = StatePool(model, capacity=3)
    other.import_(2, snapshot)
    (got,), got_logits = greedy(model, other, [2], [warm[-1]], 15)
    assert got == expected
    assert torch.equal(got_logits, exp_logits)


def test_freed_slot_keeps_nothing_of_the_old_session() -> None:
    model = make_model(["ska", "mamba2"], seed=15)
    pool = StatePool(model, capacity=2)
    fresh = {k: v.clone() for k, v in pool.export(0).items()}
    slot = pool.alloc()
    model.prefill(torch.randint(0, 256, (40,)), pool.tensors, StepBatch.prefill([slot], [40]))
    pool.free(slot)
    again = pool.alloc()
    assert again == slot
    for key, tensor in pool.export(again).items():
        assert torch.equal(tensor, fresh[key]), key
    new_pool = StatePool(model, capacity=1)
    ids = torch.randint(0, 256, (19,))
    a = model.prefill(ids, pool.tensors, StepBatch.prefill([again], [19]))
    b = model.prefill(ids, new_pool.tensors, StepBatch.prefill([0], [19]))
    assert torch.equal(a, b)


# == mode P: the paper's prefix mode (ska.md §3.4) ================================================================
def test_mode_p_prefill_reads_one_operator_over_the_whole_segment() -> None:
    """Mode P prefill: every token of a segment reads the ONE operator of all tokens up to the segment's end (m over
    the same tokens); a second segment continues the totals. Checked against the float64 paper pipeline."""
    torch.manual_seed(16)
    mixer, state, _ = ska_mixer(decode_mode="P")
    x = torch.randn(30, D)
    y = torch.cat([mixer_prefill(mixer, state, 0, x[:19]), mixer_prefill(mixer, state, 0, x[19:])])
    end = lambda t: 19 if t < 19 else 30  # noqa: E731
    assert rel_err(y, reference(mixer, x, end, end)) <= TOL
    assert not torch.allclose(y[:8], torch.zeros(8, D))  # unlike chunk-causal mode, chunk 0 reads the prompt


def test_mode_p_decode_reestimates_inclusively() -> None:
    """Mode P decode: the token is added first, then the operator is re-estimated and read (the paper's step);
    a one-token prefill is the same thing; modes P and C leave the same statistics."""
    torch.manual_seed(17)
    mixer, state, _ = ska_mixer(decode_mode="P")
    x = torch.randn(26, D)
    y = torch.cat([mixer_prefill(mixer, state, 0, x[:20]), mixer_decode_all(mixer, state, 0, x[20:])])
    end = lambda t: 20 if t < 20 else t + 1  # noqa: E731
    assert rel_err(y[20:], reference(mixer, x, end, end)[20:]) <= TOL
    one = torch.cat(
        [mixer_prefill(mixer, state, 1, x[:20]), *(mixer_prefill(mixer, state, 1, x[t : t + 1]) for t in range(20, 26))]
    )
    assert rel_err(one, y) <= TOL
    assert_states_close(state_rows(state, 1), state_rows(state, 0))
    mixer.cfg.decode_mode = "C"
    try:
        mixer_prefill(mixer, state, 2, x[:20])
        mixer_decode_all(mixer, state, 2, x[20:])
    finally:
        mixer.cfg.decode_mode = "P"
    p_state, c_state = state_rows(state, 0), state_rows(state, 2)
    assert_states_close({k: p_state[k] for k in "GMC"}, {k: c_state[k] for k in "GMC"})
    assert torch.equal(p_state["m"], c_state["m"]) and torch.equal(p_state["pos"], c_state["pos"])


# == the serving ops on pool rows =================================================================================
OP = {"chunk_size": 8, "eps": 1e-3, "eta": 1.3, "gamma": 1.2, "order": 2, "power_iters": 6}
H, R, P = 2, 6, 5
POSITIONS = [0, 0, 16, 3, 8, 11, 5, 13]  # tokens each pool row has consumed


def op_inputs(gen: torch.Generator, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(T, H, R, generator=gen), torch.randn(T, H, R, generator=gen), torch.randn(T, H, P, generator=gen)


def filled_pool(gen: torch.Generator, key_norm: str) -> SKAState:
    """A pool of len(POSITIONS) rows, row i having consumed POSITIONS[i] random tokens (mode C)."""
    rows = []
    for n in POSITIONS:
        row = ska_empty_state(1, H, R, P, F64)
        if n:
            _, row = ska_chunked(*(t[None] for t in op_inputs(gen, n)), row, 0, key_norm=key_norm, **OP)
        rows.append(row)
    return SKAState(*(torch.cat(fields) for fields in zip(*rows, strict=True)))


def row_of(pool: SKAState, i: int) -> SKAState:
    return SKAState(*(t[i : i + 1].clone() for t in pool))


@pytest.mark.parametrize("key_norm", ["causal", "frozen"])
@pytest.mark.parametrize("mode", ["C", "P"])
def test_chunk_ska_equals_each_session_alone(mode: str, key_norm: str) -> None:
    """One packed `chunk_ska` call == `ska_chunked` / `ska_prefix` on each session alone, for sessions at assorted
    positions (grouped by their chunk grid, some groups right-padded, some not consecutive in the batch), a sequence
    of length 0 (its row unchanged); rows not named are left bit-for-bit unchanged."""
    gen = torch.Generator().manual_seed(30)
    pool = filled_pool(gen, key_norm)
    before = SKAState(*(t.clone() for t in pool))
    seqs = [(3, 7), (0, 5), (5, 12), (1, 19), (2, 4), (4, 9), (6, 0)]  # (pool row, new tokens)
    lens = [n for _, n in seqs]
    z, q, v = op_inputs(gen, sum(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([row for row, _ in seqs], dtype=torch.int32)
    y = chunk_ska(z, q, v, pool, slots, cu, **OP, key_norm=key_norm, mode=mode)
    assert y.shape == (sum(lens), H, P) and y.dtype == torch.float32
    extend = ska_chunked if mode == "C" else ska_prefix
    for (row, n), start in zip(seqs, cu[:-1].tolist(), strict=True):
        if n == 0:
            continue
        part = slice(start, start + n)
        y1, new = extend(z[None, part], q[None, part], v[None, part], row_of(before, row), POSITIONS[row], **OP,
                         key_norm=key_norm)  # fmt: skip
        assert rel_err(y[part], y1[0]) <= 1e-6, (row, n)
        assert_states_close(row_of(pool, row)._asdict(), new._asdict(), tol=1e-12)
    for row in (6, 7):
        for name, got, old in zip(SKAState._fields, row_of(pool, row), row_of(before, row), strict=True):
            assert torch.equal(got, old), (row, name)


@pytest.mark.parametrize("mode", ["C", "P"])
def test_fused_recurrent_ska_equals_ska_step_on_the_rows(mode: str) -> None:
    """`fused_recurrent_ska` == `ska_step` on the gathered rows (one of them entering a chunk), in place; rows not
    named are left bit-for-bit unchanged; an unknown mode is refused."""
    gen = torch.Generator().manual_seed(31)
    pool = filled_pool(gen, "causal")
    before = SKAState(*(t.clone() for t in pool))
    rows = [5, 2, 0]  # pos 11 (mid-chunk), 16 (enters chunk 2), 0 (new session)
    z, q, v = op_inputs(gen, len(rows))
    y = fused_recurrent_ska(z, q, v, pool, torch.tensor(rows, dtype=torch.int32), **OP, mode=mode)
    idx = torch.tensor(rows)
    y1, new = ska_step(z, q, v, SKAState(*(t[idx] for t in before)), **OP, mode=mode)
    assert torch.equal(y, y1)
    for name, got, want in zip(SKAState._fields, pool, new, strict=True):
        assert torch.equal(got[idx], want), name
    untouched = torch.tensor([i for i in range(len(POSITIONS)) if i not in rows])
    for name, got, old in zip(SKAState._fields, pool, before, strict=True):
        assert torch.equal(got[untouched], old[untouched]), name
    with pytest.raises(ValueError, match="mode"):
        fused_recurrent_ska(z, q, v, pool, torch.tensor(rows, dtype=torch.int32), **OP, mode="X")
    with pytest.raises(ValueError, match="mode"):
        chunk_ska(z, q, v, pool, torch.tensor(rows, dtype=torch.int32), torch.tensor([0, 1, 2, 3]), **OP, mode="X")


# == numerics =====================================================================================================
def test_cholesky_jitter_fallback() -> None:
    """A Gram that is not positive definite is factorised with jitter 1e-4*m^2 (then 1e-3, 1e-2), and counted."""
    G = torch.eye(4, dtype=F64).repeat(3, 1, 1)
    G[1, 2, 2] = -5e-5  # slightly indefinite: needs the first jitter (1e-4)
    G[2, 3, 3] = -5e-3  # needs the last one (1e-2)
    before = cholesky_fallback_count()
    L = robust_cholesky(G, torch.ones(3, dtype=F64))
    assert cholesky_fallback_count() - before == 4  # rows 1 and 2 fail; row 2 fails again with 1e-4 and 1e-3
    assert torch.equal(L[0], torch.eye(4, dtype=F64))
    assert torch.allclose(L[1] @ L[1].T, G[1] + 1e-4 * torch.eye(4, dtype=F64))
    assert torch.allclose(L[2] @ L[2].T, G[2] + 1e-2 * torch.eye(4, dtype=F64))
    with pytest.raises(FloatingPointError):
        robust_cholesky(-torch.eye(3, dtype=F64), torch.tensor(1.0, dtype=F64))


def test_long_session_16k() -> None:
    """16K tokens through a small Mamba-2 + SKA model (S = 64): nothing non-finite, no Cholesky fallback, and decoding
    the last 64 tokens after a prefill of 16K - 64 gives what one prefill of all 16K gives (the stats of the two
    slots are summed differently: rank-1 updates vs per-chunk GEMMs; fp64 accumulators keep them equal)."""
    T, tail = 16384, 64
    mamba = {**SUBCONFIGS["mamba2"], "chunk_size": 64}
    model = make_model(["mamba2", "ska"], seed=18, hidden=16, mamba2=mamba, num_heads=2, rank=8, chunk_size=64)
    ids = torch.randint(0, 256, (T,), generator=torch.Generator().manual_seed(18))
    pool = StatePool(model, capacity=2)
    fallbacks = cholesky_fallback_count()
    mixer = model.layers[1].mixer
    keys = []
    mixer._proj = lambda x: keys.append(type(mixer)._proj(mixer, x)) or keys[-1]  # record the fp32 keys
    whole = model.prefill(ids, pool.tensors, StepBatch.prefill([0], [T]), all_logits=True)[-tail:]
    del mixer._proj
    z = keys[0][0].double()  # [T, H, r]: the exact products of these fp32 keys, summed in fp64
    exact_G = torch.einsum("thr,thk->hrk", z, z)
    # The stored Gram of 16K tokens equals the exact sum to fp64 accuracy (fp32 accumulators: only ~1e-7).
    assert rel_err(pool.tensors[1]["G"][0], exact_G) <= 1e-12
    model.prefill(ids[:-tail], pool.tensors, StepBatch.prefill([1], [T - tail]))
    stepped = torch.cat([model.decode(ids[t : t + 1], pool.tensors, StepBatch.decode([1])) for t in range(T - tail, T)])
    assert torch.isfinite(whole).all() and torch.isfinite(stepped).all()
    assert cholesky_fallback_count() == fallbacks
    assert rel_err(stepped, whole) <= TOL
    state = pool.tensors[1]
    for name, t in state.items():
        assert torch.isfinite(t.double()).all(), name
    assert int(state["pos"][1]) == T
    assert float(state["m"][1].min()) > 0
    # The two slots' accumulators (rank-1 updates vs per-chunk GEMMs) differ only by the fp32 rounding of the last
    # 64 tokens' projections (decode vs prefill GEMMs), not by accumulation error over 16K tokens.
    for name in ("G", "M", "C"):
        assert rel_err(state[name][1], state[name][0]) <= 1e-7, name
    # The SKA layer contributes to the logits at the end of the session (its output is not zero).
    assert model.layers[1].mixer.decode(torch.randn(1, 16), state, StepBatch.decode([1])).abs().sum() > 0


# == the Spectral Koopman MLP =====================================================================================
def test_koopman_mlp_is_the_eq14_rotation() -> None:
    """readout(conj(lambda) * g) with g = silu(lift h) as complex pairs (g_2i + i g_2i+1): eq. 14 written with
    complex numbers, independent of the module's real pair arithmetic."""
    torch.manual_seed(19)
    mlp = KoopmanMLP(16, 12)
    randomize(mlp, 19)
    with torch.no_grad():
        mlp.gamma.mul_(0.5)  # |lambda| < 1 here: no clamping involved
        mlp.omega.mul_(0.5)
    h = torch.randn(3, 5, 16)
    out = mlp(h)
    assert out.shape == (3, 5, 16)
    g = torch.nn.functional.silu(h.double() @ mlp.lift.weight.double().T).unflatten(-1, (6, 2))
    lam = torch.complex(mlp.gamma.double(), mlp.omega.double())
    assert (lam.abs() < 1).all()
    zc = lam.conj() * torch.complex(g[..., 0], g[..., 1])
    z = torch.stack([zc.real, zc.imag], -1).flatten(-2)
    assert rel_err(out, z @ mlp.readout.weight.double().T) <= 1e-6


def test_koopman_eigenvalues_are_clamped_to_the_unit_disk() -> None:
    mlp = KoopmanMLP(8, 8)
    with torch.no_grad():
        mlp.gamma.copy_(torch.tensor([3.0, 0.3, -2.0, 0.0]))
        mlp.omega.copy_(torch.tensor([4.0, 0.4, 0.0, 0.0]))
    re, im = mlp.eigenvalues()
    rho = torch.hypot(re, im)
    assert torch.allclose(rho, torch.tensor([1.0, 0.5, 1.0, 0.0]))
    assert torch.allclose(torch.atan2(im[:3], re[:3]), torch.atan2(mlp.omega[:3], mlp.gamma[:3]))  # phase kept
    # A pair with |lambda| = 1 is a pure rotation: the pair's norm is preserved.
    g = torch.randn(10, 2)
    z = torch.stack([re[0] * g[:, 0] + im[0] * g[:, 1], re[0] * g[:, 1] - im[0] * g[:, 0]], -1)
    assert torch.allclose(z.norm(dim=-1), g.norm(dim=-1))
    with torch.inference_mode(False), torch.enable_grad():  # gradients stay finite at lambda = 0 and when clamped
        mlp = KoopmanMLP(8, 8)
        with torch.no_grad():
            mlp.gamma.copy_(torch.tensor([3.0, 0.3, -2.0, 0.0]))
            mlp.omega.copy_(torch.tensor([4.0, 0.4, 0.0, 0.0]))
        mlp(torch.randn(4, 8)).sum().backward()
        assert torch.isfinite(mlp.gamma.grad).all() and torch.isfinite(mlp.omega.grad).all()


def test_koopman_model_prefill_equals_decode() -> None:
    torch.manual_seed(20)
    model = make_model(["mamba2", "ska"], mlp={"intermediate_size": 64, "kind": "koopman", "gated": True})
    ids = torch.randint(0, 256, (23,))
    pool = StatePool(model, capacity=2)
    pre = model.prefill(ids, pool.tensors, StepBatch.prefill([0], [23]), all_logits=True)
    dec = torch.cat([model.decode(ids[t : t + 1], pool.tensors, StepBatch.decode([1])) for t in range(23)])
    assert rel_err(dec, pre) <= TOL
    for layer_state in pool.tensors:
        assert_states_close(state_rows(layer_state, 1), state_rows(layer_state, 0))


def test_mlp_tensor_names_and_init() -> None:
    """SwiGLU blocks keep their tensor names; the Koopman MLP gets a LayerNorm (weight and bias) under the same
    `mlp_norm` name; init_weights applies the mixers' own inits after the generic N(0, 0.02)."""
    swiglu = make_model(["ska"], mlp={"intermediate_size": 64})
    names = set(swiglu.state_dict())
    assert {"layers.0.mlp_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.down_proj.weight"} <= names
    assert "layers.0.mlp_norm.bias" not in names
    koop = make_model(["ska"], mlp={"intermediate_size": 64, "kind": "koopman"})
    names = set(koop.state_dict())
    assert {"layers.0.mlp_norm.weight", "layers.0.mlp_norm.bias", "layers.0.mlp.lift.weight"} <= names
    assert {"layers.0.mlp.readout.weight", "layers.0.mlp.gamma", "layers.0.mlp.omega"} <= names
    assert "layers.0.mlp.gate.weight" not in names
    assert sum(p.numel() for n, p in koop.layers[0].mlp.named_parameters() if "weight" in n) == 2 * D * 64
    koop.init_weights(seed=0)
    ska = koop.layers[0].mixer
    assert torch.equal(ska.o_proj.weight, torch.zeros_like(ska.o_proj.weight))  # W_o zero: SKA starts as identity
    Wk = ska.k_proj.weight  # [H r, D] with H r <= D: orthonormal rows
    assert torch.allclose(Wk @ Wk.T, torch.eye(Wk.shape[0]), atol=1e-5)
    assert float(ska.eta) == 1.5 and float(ska.gamma) == 1.0
    assert torch.equal(koop.layers[0].mlp.gamma, torch.ones(32))
    ids = torch.randint(0, 256, (2, 20))
    x = koop.embed(ids).float()
    assert torch.equal(koop.layers[0].mixer(koop.layers[0].norm(x)), torch.zeros_like(x))


def test_checkpoint_round_trip(tmp_path) -> None:
    from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
    from kvfree.engine.model.loader import load_model, save_model

    model = make_model(["mamba2", "ska"], seed=21, mlp={"intermediate_size": 64, "kind": "koopman"}, key_norm="frozen")
    write_byte_tokenizer(tmp_path / "tok")
    path = save_model(model, tmp_path / "ckpt", tokenizer_from=tmp_path / "tok")
    loaded = load_model(path, device="cpu")
    assert loaded.config.ska.key_norm == "frozen" and loaded.config.mlp.kind == "koopman"
    ids = torch.randint(0, 256, (2, 19))
    assert torch.equal(loaded(ids), model(ids))


def test_config_errors() -> None:
    base = {"vocab_size": VOCAB, "hidden_size": D, "layers": ["ska"]}
    bad = [
        ({"ska": {**SKA, "decode_mode": "X"}}, "ska.decode_mode"),
        ({"ska": {**SKA, "key_norm": "l2"}}, "ska.key_norm"),
        ({"ska": {**SKA, "accum_dtype": "bfloat16"}}, "ska.accum_dtype"),
        ({"ska": {**SKA, "gamma_init": 2.0}}, "ska.gamma_init"),
        ({"ska": {**SKA, "power_order": -1}}, "ska.power_order"),
        ({"ska": {**SKA, "ridge_eps": 0.0}}, "ska.ridge_eps"),
        ({"ska": SKA, "mlp": {"intermediate_size": 63, "kind": "koopman"}}, "mlp.intermediate_size"),
        ({"ska": SKA, "mlp": {"intermediate_size": 64, "kind": "moe"}}, "mlp.kind"),
        ({"ska": SKA, "mlp": {"intermediate_size": 64, "gated": True}}, "mlp.gated"),
    ]
    for extra, key in bad:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            ModelConfig.from_dict({**base, **extra})
