"""Gated KalmaNet (docs/design/gka.md): the kernels against independent float64 oracles written from the spec's
equations, the serving invariants of every mixer, and the checklist of docs/design/gka.md §14.

Tolerances. The state math (H, S) is checked at 1e-5 in fp32 as everywhere else. The *layer output* in fp32 is
checked at OUT_TOL = 1e-3 instead, because the GKA output is an ill-conditioned function of its inputs at the fp32
level: the solve amplifies rounding by up to kappa = (1 + a) / a = 51 (docs/design/gka.md §4.4), the alpha-blend
(1 - alpha) S^T q + alpha S^T x can nearly cancel for a head, and the per-head RMSNorm then rescales that small
vector to unit size, so the rounding of either path (prefill or decode) shows up at the 1e-5..1e-4 level (the spec
itself asks only for bf16-level agreement, §14.3-§14.4). To keep the tests sharp anyway, every path-equality test
is also run in float64 (weights and states), where the same comparisons must hold to FP64_TOL; the only fp32 step
left there is the shared RMSNorm, which computes in fp32.
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

from kvfree.engine.model.config import ConfigError, ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import load_model, save_model
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from kvfree.kernels.gka import chunk_gka, fused_recurrent_gka, gka_chunked, gka_step, omega_schedule
from tests.conftest import (
    VOCAB,
    assert_states_close,
    mixer_prefill,
    model_prefill,
    random_ids,
    randomize,
    rel_err,
    state_rows,
)

HIDDEN = 32
GKA = {"num_heads": 2, "head_dim": 8, "value_head_dim": 6, "chunk_size": 8}  # Dv != D catches transposes
STATE_TOL = 1e-5  # fp32 states
OUT_TOL = 1e-3  # fp32 layer outputs / logits (see the module docstring)
FP64_TOL = 1e-6  # float64 runs (the shared RMSNorm rounds to fp32)
F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


# -- builders --------------------------------------------------------------------------------------------------------
def make_config(layers: list[str] | None = None, mlp: bool = False, **gka) -> ModelConfig:
    data = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "layers": layers or ["gka"],
        "eos_token_id": 256,
        "gka": {**GKA, **gka},
    }
    if mlp:
        data["mlp"] = {"intermediate_size": 2 * HIDDEN}
    return ModelConfig.from_dict(data)


def make_model(layers: list[str] | None = None, seed: int = 0, mlp: bool = False, **gka) -> HybridLM:
    model = HybridLM(make_config(layers, mlp, **gka))
    randomize(model, seed)
    return model.eval()


def new_state(mixer, capacity: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A state dict like the pool's, in `dtype` throughout (float64 runs keep H and S in float64 too)."""
    return {n: torch.zeros((capacity, *s.shape), dtype=dtype) for n, s in mixer.state_specs(0).items()}


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def random_inputs(B: int, T: int, He: int, D: int, Dv: int, seed: int, dtype=F64, g_scale: float = 0.5):
    """Kernel inputs as the layer produces them: unit q, unit k times beta + 1e-6, v times the same beta."""
    gen = torch.Generator().manual_seed(seed)
    beta = torch.rand(B, T, He, 1, generator=gen, dtype=dtype) + 1e-6
    q = unit(torch.randn(B, T, He, D, generator=gen, dtype=dtype))
    k = unit(torch.randn(B, T, He, D, generator=gen, dtype=dtype)) * beta
    v = torch.randn(B, T, He, Dv, generator=gen, dtype=dtype) * beta
    g = -torch.rand(B, T, He, generator=gen, dtype=dtype) * g_scale
    alpha = torch.rand(B, T, He, generator=gen, dtype=dtype)
    return q, k, v, g, alpha


def random_states(B: int, He: int, D: int, Dv: int, seed: int, n: int = 20, dtype=F64):
    """A consistent non-trivial (H, S): decayed sums of n outer products (H symmetric PSD)."""
    gen = torch.Generator().manual_seed(seed)
    k = unit(torch.randn(B, He, n, D, generator=gen, dtype=dtype))
    v = torch.randn(B, He, n, Dv, generator=gen, dtype=dtype)
    w = 0.9 ** torch.arange(n, 0, -1, dtype=dtype)
    return torch.einsum("bhnd,n,bhne->bhde", k, w, k), torch.einsum("bhnd,n,bhne->bhde", k, w, v)


# -- independent float64 oracles, written from gka.md §3-§4 (per token, paper form of Alg. 1) -----------------------
def cheb_alg1(A: torch.Tensor, q: torch.Tensor, L: torch.Tensor, mu: torch.Tensor, r: int) -> torch.Tensor:
    """Alg. 1 with omega_0 = 2 (App. B.1): A `[..., D, D]` SPD with spectrum in [mu, L] `[...]`, q `[..., D]`."""
    L, mu = L[..., None], mu[..., None]
    rho = (L - mu) / (L + mu)
    xi_prev, xi, w = torch.zeros_like(q), 2 * q / (L + mu), torch.full_like(L, 2.0)
    for _ in range(r):
        w = 4 / (4 - rho**2 * w)
        new = xi - (2 * w / (L + mu)) * ((A @ xi.unsqueeze(-1)).squeeze(-1) - q)  # gradient step
        new = new + (w - 1) * (xi - xi_prev)  # momentum
        xi_prev, xi = xi, new
    return xi


def oracle(q, k, v, g, alpha, h0=None, s0=None, a=0.02, r=30, scale=None, exact=False, decay_h=True):
    """Recurrent GKA in float64, one token at a time. Inputs as `random_inputs` ([B, T, He, *]).

    Returns o `[B, T, He, Dv]`, final H, S. `exact=True` replaces CH by torch.linalg.solve. `decay_h=False`: H is
    never decayed (hmf's use_forgetting_gate_kk = false), S still is.
    """
    q, k, v, g, alpha = (t.to(F64) for t in (q, k, v, g, alpha))
    B, T, He, D = q.shape
    Dv = v.shape[-1]
    scale = D**-0.5 if scale is None else scale
    H = torch.zeros(B, He, D, D, dtype=F64) if h0 is None else h0.to(F64).clone()
    S = torch.zeros(B, He, D, Dv, dtype=F64) if s0 is None else s0.to(F64).clone()
    eye = torch.eye(D, dtype=F64)
    out = []
    for t in range(T):
        gam = torch.exp(g[:, t])[..., None, None]
        H = (gam if decay_h else 1.0) * H + torch.einsum("bhi,bhj->bhij", k[:, t], k[:, t])
        S = gam * S + torch.einsum("bhi,bhj->bhij", k[:, t], v[:, t])
        fro = torch.linalg.matrix_norm(H)  # direct Frobenius norm
        lam = a * fro
        A = H + lam[..., None, None] * eye
        x = torch.linalg.solve(A, q[:, t]) if exact else cheb_alg1(A, q[:, t], fro + lam, lam, r)
        qp = alpha[:, t, :, None] * x + (1 - alpha[:, t, :, None]) * q[:, t]  # convex combination
        out.append(scale * torch.einsum("bhde,bhd->bhe", S, qp))
    return torch.stack(out, 1), H, S


def oracle_layer(mixer, x: torch.Tensor) -> torch.Tensor:
    """The whole GKA layer (gka.md §3 steps 1-12) in float64 from the module's weights, token by token from a new
    session: x `[T, d]` -> `[T, d]`. Written without the module's code paths (no ShortConv, no norms module).
    With `use_forgetting_gate_kk = false` H is never decayed, S still is."""
    c = mixer.cfg
    He, D, Dv, K = c.num_heads, c.head_dim, c.v_head_dim, c.conv_kernel
    W = {n: p.detach().to(F64) for n, p in mixer.named_parameters()}
    x = x.to(F64)
    hist = torch.zeros(K - 1, mixer.conv_dim, dtype=F64)
    H = torch.zeros(He, D, D, dtype=F64)
    S = torch.zeros(He, D, Dv, dtype=F64)
    eye = torch.eye(D, dtype=F64)
    ys = []
    for t in range(x.shape[0]):
        xt = x[t]
        pre = torch.cat([W["q_proj.weight"] @ xt, W["k_proj.weight"] @ xt, W["v_proj.weight"] @ xt])
        window = torch.cat([hist, pre[None]])  # [K, C], oldest first; conv weight[:, -1] takes the newest
        hist = window[1:]
        act = F.silu((window.T * W["conv.weight"]).sum(-1))
        qh, kh, vh = act[: He * D].view(He, D), act[He * D : 2 * He * D].view(He, D), act[2 * He * D :].view(He, Dv)
        beta = torch.sigmoid(W["b_proj.weight"] @ xt + W["b_proj.bias"]) + 1e-6
        alpha = torch.sigmoid(W["alpha_proj.weight"] @ xt + W["alpha_proj.bias"])
        dt = F.softplus(W["a_proj.weight"] @ xt + W["dt_bias"])
        gamma = torch.exp(-torch.exp(W["A_log"]) * dt)
        gate = (W["g_proj.weight"] @ xt).view(He, Dv)
        heads = []
        for e in range(He):
            q = qh[e] / (qh[e].norm() + 1e-6)
            k = beta[e] * kh[e] / (kh[e].norm() + 1e-6)
            v = beta[e] * vh[e]
            H[e] = (gamma[e] if c.use_forgetting_gate_kk else 1.0) * H[e] + torch.outer(k, k)
            S[e] = gamma[e] * S[e] + torch.outer(k, v)
            fro = torch.linalg.matrix_norm(H[e])
            lam = c.ridge_strength * fro
            xhat = cheb_alg1(H[e] + lam * eye, q, fro + lam, lam, c.num_iter)
            o = D**-0.5 * S[e].T @ (alpha[e] * xhat + (1 - alpha[e]) * q)
            o = o / torch.sqrt(o.pow(2).mean() + c.norm_eps) * W["norm.weight"] * F.silu(gate[e])
            heads.append(o)
        ys.append(W["o_proj.weight"] @ torch.cat(heads))
    return torch.stack(ys)


# -- Chebyshev iteration ---------------------------------------------------------------------------------------------
def test_omega_schedule_matches_spec_table() -> None:
    """omega_0 = 2 (not Alg. 1's typo 0): the constants of gka.md §4.5 for a = 0.02, decreasing to omega*_1."""
    w = omega_schedule(0.02, 30)
    assert w[0] == pytest.approx(1.8597, abs=1e-4)
    assert w[4] == pytest.approx(1.6081, abs=1e-4)
    assert w[29] == pytest.approx(1.56903, abs=1e-5)
    rho = 1 / 1.04
    w_star = 2 * (1 - math.sqrt(1 - rho**2)) / rho**2
    assert all(a >= b > w_star for a, b in zip([2.0, *w], w, strict=False))


def _ridge_problems(D: int = 16, seed: int = 0):
    """Float64 (H, q): decayed sums of unit outer products, plus the rank-1 case where the bound kappa = 51 is tight."""
    gen = torch.Generator().manual_seed(seed)
    k = unit(torch.randn(6, 300, D, generator=gen, dtype=F64))
    gam = torch.tensor([0.5, 0.9, 0.99, 0.999, 1.0, 0.0], dtype=F64)
    w = gam[:, None] ** torch.arange(299, -1, -1, dtype=F64)  # gamma = 0 keeps only the newest key: rank 1
    H = torch.einsum("bnd,bn,bne->bde", k, w, k)
    q = unit(torch.randn(6, D, generator=gen, dtype=F64))
    return H, q


def test_chebyshev_approaches_exact_ridge_solution() -> None:
    """CH(r) -> (H + a||H|| I)^-1 q as r grows (float64), through the decode kernel itself: with alpha = 1 and an
    identity S, the kernel's output is scale * x."""
    a, D = 0.02, 16
    H_prev, q = _ridge_problems(D)
    k = torch.zeros(6, 1, D, dtype=F64)  # the step adds k k^T = 0: H stays H_prev
    S = torch.eye(D, dtype=F64).expand(6, 1, D, D)
    fro = torch.linalg.matrix_norm(H_prev)
    exact = torch.linalg.solve(H_prev + a * fro[:, None, None] * torch.eye(D, dtype=F64), q)
    errs = []
    for r in [1, 5, 10, 20, 30, 60, 120]:
        o, _, _ = gka_step(
            q[:, None], k, k, torch.zeros(6, 1, dtype=F64), torch.ones(6, 1, dtype=F64), H_prev[:, None], S, a, r, 1.0
        )
        errs.append(max(rel_err(o[i, 0], exact[i]) for i in range(6)))
    assert all(e2 < e1 for e1, e2 in zip(errs, errs[1:], strict=False)), errs
    # Worst case ~ 2 R_a^r with R_a = (sqrt(51) - 1) / (sqrt(51) + 1) (docs/design/gka.md §4.5 table: 4.3e-4 at r = 30).
    assert errs[4] < 1e-3
    assert errs[-1] < 1e-10


def test_num_iter_error_decreases_and_alpha_zero_is_gla() -> None:
    """§14.6: error vs the exact-solve oracle decreases over r in {1, 5, 10, 30} (chunked kernel, float64, alpha = 1);
    alpha = 0 is plain gated linear attention (independent of r)."""
    q, k, v, g, _ = random_inputs(2, 70, 2, 8, 6, seed=1)
    ones, zeros = torch.ones(2, 70, 2, dtype=F64), torch.zeros(2, 70, 2, dtype=F64)
    h0, s0 = random_states(2, 2, 8, 6, seed=2)
    exact, _, _ = oracle(q, k, v, g, ones, h0, s0, exact=True)
    errs = [rel_err(gka_chunked(q, k, v, g, ones, h0, s0, 0.02, r, 8**-0.5, 64)[0], exact) for r in (1, 5, 10, 30)]
    assert all(e2 < e1 for e1, e2 in zip(errs, errs[1:], strict=False)), errs
    assert errs[-1] < 1e-3
    # Plain GLA oracle: o_t = scale * S_t^T q_t.
    S, gla = s0.clone(), []
    for t in range(70):
        S = torch.exp(g[:, t])[..., None, None] * S + torch.einsum("bhi,bhj->bhij", k[:, t], v[:, t])
        gla.append(8**-0.5 * torch.einsum("bhde,bhd->bhe", S, q[:, t]))
    for r in (1, 30):
        o, _, _ = gka_chunked(q, k, v, g, zeros, h0, s0, 0.02, r, 8**-0.5, 64)
        assert rel_err(o, torch.stack(gla, 1)) < 1e-12


# -- decode kernel ---------------------------------------------------------------------------------------------------
def test_decode_step_matches_float64_oracle() -> None:
    """§14.2: fp32 gka_step over a sequence within 1e-5 of the float64 oracle (CH(30)), states within 1e-6."""
    q, k, v, g, alpha = random_inputs(3, 40, 2, 8, 6, seed=3)
    h0, s0 = random_states(3, 2, 8, 6, seed=4)
    want, H_want, S_want = oracle(q, k, v, g, alpha, h0, s0)
    h, s, got = h0.float(), s0.float(), []
    for t in range(40):
        o, h, s = gka_step(*(x[:, t].float() for x in (q, k, v, g, alpha)), h, s, 0.02, 30, 8**-0.5)
        got.append(o)
    assert h.dtype == s.dtype == torch.float32
    assert rel_err(torch.stack(got, 1), want) <= 1e-5
    assert rel_err(h, H_want) <= 1e-6 and rel_err(s, S_want) <= 1e-6


def test_decode_state_is_bitwise_independent_of_batch_composition() -> None:
    """§14.2: the H, S update of a session is bit-for-bit the same whatever else is in the batch."""
    q, k, v, g, alpha = (x[:, 0].float() for x in random_inputs(4, 1, 2, 8, 6, seed=5))
    h0, s0 = (x.float() for x in random_states(4, 2, 8, 6, seed=6))
    _, h_all, s_all = gka_step(q, k, v, g, alpha, h0, s0, 0.02, 30, 0.3)
    for idx in ([2], [3, 1], [1, 0, 2]):
        i = torch.tensor(idx)
        _, h, s = gka_step(q[i], k[i], v[i], g[i], alpha[i], h0[i], s0[i], 0.02, 30, 0.3)
        assert torch.equal(h, h_all[i]) and torch.equal(s, s_all[i])


# -- chunked prefill kernel ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
def test_chunked_prefill_matches_oracle(T: int) -> None:
    """§14.3: chunk boundaries, nonzero initial state. float64: the chunked algebra (three-term norms, all-queries
    CH, chunked GLA) equals the recurrent oracle to rounding; fp32: outputs and states close to it."""
    B, He, D, Dv = 2, 2, 8, 6
    q, k, v, g, alpha = random_inputs(B, T, He, D, Dv, seed=T)
    h0, s0 = random_states(B, He, D, Dv, seed=T + 1)
    for r in (0, 30):  # r = 0 returns 2q / ((1 + 2a) ||H_t||): checks the three-term norms on their own
        want, H, S = oracle(q, k, v, g, alpha, h0, s0, r=r)
        o, h, s = gka_chunked(q, k, v, g, alpha, h0, s0, 0.02, r, D**-0.5, 64)
        assert rel_err(o, want) < 1e-12 and rel_err(h, H) < 1e-13 and rel_err(s, S) < 1e-13
    o, h, s = gka_chunked(*(x.float() for x in (q, k, v, g, alpha, h0, s0)), 0.02, 30, D**-0.5, 64)
    assert o.dtype == h.dtype == torch.float32
    assert rel_err(o, want) <= 2e-5
    assert rel_err(h, H) <= STATE_TOL and rel_err(s, S) <= STATE_TOL


def test_gate_extremes() -> None:
    """§14.5: gamma = 1 for 1e5 tokens (H grows to ||H|| ~ 1e5; fp32 stays accurate), gamma -> 0 resets,
    beta -> 0 leaves the state untouched."""
    He, D, Dv, T, seg = 1, 8, 6, 100_000, 8192
    q, k, v, _, alpha = random_inputs(1, T, He, D, Dv, seed=7, dtype=torch.float32)
    g = torch.zeros(1, T, He)
    h0, s0 = random_states(1, He, D, Dv, seed=8)
    h, s = h0.float(), s0.float()
    last = T - seg
    for start in range(0, last, seg):  # fp32 segments carrying the state, as long prompts are fed; the solve
        piece = (x[:, start : min(start + seg, last)] for x in (q, k, v, g, alpha))  # doesn't feed the state: r = 0
        _, h, s = gka_chunked(*piece, h, s, 0.02, 0, D**-0.5, 64)
    o32, h32, s32 = gka_chunked(*(x[:, last:] for x in (q, k, v, g, alpha)), h, s, 0.02, 30, D**-0.5, 64)
    # With gamma = 1 the exact float64 states are plain sums: H = H0 + K^T K, S = S0 + K^T V.
    k64, v64 = k[0, :, 0].double(), v[0, :, 0].double()
    h_mid = h0 + (k64[:last].T @ k64[:last])[None, None]
    s_mid = s0 + (k64[:last].T @ v64[:last])[None, None]
    o64, h64, s64 = gka_chunked(
        *(x[:, last:].double() for x in (q, k, v, g, alpha)), h_mid, s_mid, 0.02, 30, D**-0.5, 64
    )
    assert rel_err(h64, h0 + (k64.T @ k64)[None, None]) < 1e-12
    assert torch.linalg.matrix_norm(h64).item() > 1e4
    assert rel_err(h32, h64) <= STATE_TOL and rel_err(s32, s64) <= STATE_TOL
    assert rel_err(o32, o64) <= 1e-4
    # The decode step after it agrees too (fp32 state vs float64 state).
    step = [x[:, -1].float() for x in random_inputs(1, 1, He, D, Dv, seed=9)]
    o_a, _, _ = gka_step(*step, h32, s32, 0.02, 30, D**-0.5)
    o_b, _, _ = gka_step(*(x.double() for x in step), h64, s64, 0.02, 30, D**-0.5)
    assert rel_err(o_a, o_b) <= 1e-4

    # gamma -> 0: the token after a reset sees nothing of the history.
    q, k, v, g, alpha = random_inputs(1, 10, 2, D, Dv, seed=10)
    g[:, 6] = -1e4
    h0, s0 = random_states(1, 2, D, Dv, seed=11)
    o, _, _ = gka_chunked(q, k, v, g, alpha, h0, s0, 0.02, 30, 0.3, 4)
    fresh, _, _ = gka_chunked(*(x[:, 6:] for x in (q, k, v, g, alpha)), 0 * h0, 0 * s0, 0.02, 30, 0.3, 4)
    assert rel_err(o[:, 6:], fresh) < 1e-12

    # beta -> 0 (k, v scaled by 1e-6): H, S only decay; fp32 results stay finite and accurate even from zero state.
    q, k, v, g, alpha = random_inputs(1, 50, 2, D, Dv, seed=12, g_scale=0.05)
    k, v = k / k.norm(dim=-1, keepdim=True) * 1e-6, v * 1e-6
    _, h, s = gka_chunked(q, k, v, g, alpha, h0, s0, 0.02, 30, 0.3, 16)
    decay = torch.exp(g.sum(1))[..., None, None]
    assert rel_err(h, decay * h0) < 1e-9 and rel_err(s, decay * s0) < 1e-9
    o32, _, _ = gka_chunked(*(x.float() for x in (q, k, v, g, alpha, 0 * h0, 0 * s0)), 0.02, 30, 0.3, 16)
    want, _, _ = oracle(q, k, v, g, alpha, scale=0.3)
    assert torch.isfinite(o32).all() and rel_err(o32, want) <= 1e-4


# -- hmf's use_forgetting_gate_kk = false: H never decays, S does ---------------------------------------------------
@pytest.mark.parametrize("T", [1, 37])
def test_undecayed_key_covariance_matches_oracle(T: int) -> None:
    """decay_h=False: H_t = H_{t-1} + k k^T while S_t = gamma S_{t-1} + k v^T. In float64 the chunked form (three-term
    norms and matrix Chebyshev on H's own decays, output on S's; chunks of 16, nonzero initial states) and the decode
    step equal the per-token oracle to rounding; H is the plain sum h0 + sum k k^T and S the one the default gives."""
    B, He, D, Dv = 2, 2, 8, 6
    q, k, v, g, alpha = random_inputs(B, T, He, D, Dv, seed=30 + T)
    h0, s0 = random_states(B, He, D, Dv, seed=31 + T)
    for r in (0, 30):  # r = 0 checks the three-term norms on their own
        want, H, S = oracle(q, k, v, g, alpha, h0, s0, r=r, decay_h=False)
        o, h, s = gka_chunked(q, k, v, g, alpha, h0, s0, 0.02, r, D**-0.5, 16, decay_h=False)
        assert rel_err(o, want) < 1e-12 and rel_err(h, H) < 1e-13 and rel_err(s, S) < 1e-13
    assert rel_err(h, h0 + torch.einsum("btei,btej->beij", k, k)) < 1e-13
    o_default, _, s_default = gka_chunked(q, k, v, g, alpha, h0, s0, 0.02, 30, D**-0.5, 16)
    assert torch.equal(s, s_default) and rel_err(o_default, want) > 1e-2  # the flag changes H only, and matters
    hh, ss, steps = h0, s0, []
    for t in range(T):
        o_t, hh, ss = gka_step(*(x[:, t] for x in (q, k, v, g, alpha)), hh, ss, 0.02, 30, D**-0.5, decay_h=False)
        steps.append(o_t)
    assert rel_err(torch.stack(steps, 1), want) < 1e-12 and rel_err(hh, H) < 1e-13 and rel_err(ss, S) < 1e-13


# -- serving ops: pool rows addressed by state_indices ---------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, decay_h", [(F64, True), (torch.float32, True), (F64, False)]  # False: H undecayed (use_forgetting_gate_kk)
)
@pytest.mark.parametrize("lens", [[37], [8, 8, 8], [77, 5, 0, 33, 1]])
def test_chunk_gka_equals_gka_chunked_per_sequence(lens: list[int], dtype: torch.dtype, decay_h: bool) -> None:
    """chunk_gka on packed sequences == gka_chunked on each alone, states in place in the pool rows named; the other
    rows stay bit-for-bit. Equal lengths take the batched path, unequal ones the shared chunk layout; an empty sequence
    keeps its state exactly."""
    He, D, Dv, S, C = 2, 8, 6, 7, 16
    slots = [5, 0, 3, 6, 1][: len(lens)]
    q, k, v, g, alpha = (t.to(dtype) for t in random_inputs(len(lens), max(lens), He, D, Dv, seed=20))
    h0, s0 = (t.to(dtype) for t in random_states(len(lens), He, D, Dv, seed=21))
    h, s = (t.to(dtype) for t in random_states(S, He, D, Dv, seed=22))  # no zero rows to hide a stray write
    h[slots], s[slots] = h0, s0
    h_before, s_before = h.clone(), s.clone()
    packed = [torch.cat([t[i, :n] for i, n in enumerate(lens)]) for t in (q, k, v, g, alpha)]
    cu = [0, *itertools.accumulate(lens)]
    state_indices = torch.tensor(slots, dtype=torch.int32)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    o = chunk_gka(*packed, h, s, state_indices, cu_t, 0.02, 30, D**-0.5, C, decay_h=decay_h)
    assert o.shape == (cu[-1], He, Dv) and o.dtype == dtype and h.dtype == s.dtype == dtype
    tol = 1e-13 if dtype == F64 else STATE_TOL
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(h[slots[i]], h0[i]) and torch.equal(s[slots[i]], s0[i])
            continue
        one = (t[i : i + 1, :n] for t in (q, k, v, g, alpha))
        want, H, S_ = gka_chunked(*one, h0[i : i + 1], s0[i : i + 1], 0.02, 30, D**-0.5, C, decay_h=decay_h)
        assert rel_err(o[cu[i] : cu[i + 1]], want[0]) <= tol
        assert rel_err(h[slots[i]], H[0]) <= tol and rel_err(s[slots[i]], S_[0]) <= tol
    others = [r for r in range(S) if r not in slots]
    assert torch.equal(h[others], h_before[others]) and torch.equal(s[others], s_before[others])


@pytest.mark.parametrize("decay_h", [True, False])
def test_fused_recurrent_gka_updates_pool_rows(decay_h: bool) -> None:
    """fused_recurrent_gka == gka_step on the gathered rows, bit for bit; the rows not named stay untouched."""
    He, D, Dv, S = 2, 8, 6, 5
    slots = [3, 0, 4]
    q, k, v, g, alpha = (t[:, 0].float() for t in random_inputs(3, 1, He, D, Dv, seed=23))
    h, s = (t.float() for t in random_states(S, He, D, Dv, seed=24))
    h_before, s_before = h.clone(), s.clone()
    idx = torch.tensor(slots, dtype=torch.int32)
    o = fused_recurrent_gka(q, k, v, g, alpha, h, s, idx, 0.02, 30, D**-0.5, decay_h=decay_h)
    want, H, S_ = gka_step(q, k, v, g, alpha, h_before[slots], s_before[slots], 0.02, 30, D**-0.5, decay_h=decay_h)
    assert torch.equal(o, want) and torch.equal(h[slots], H) and torch.equal(s[slots], S_)
    assert torch.equal(h[[1, 2]], h_before[[1, 2]]) and torch.equal(s[[1, 2]], s_before[[1, 2]])


# -- the layer: independent reference and serving invariants ---------------------------------------------------------
@pytest.mark.parametrize("kk", [True, False])
def test_layer_matches_independent_float64_reference(kk: bool) -> None:
    """The whole layer (conv, L2 norms, beta, alpha, Mamba-2 gate, CH, RMSNorm gate-after-norm, out proj) against a
    float64 per-token implementation of docs/design/gka.md §3 (T = 37 spans several chunks of 8); also with
    use_forgetting_gate_kk = false (H never decays)."""
    model = make_model(seed=1, use_forgetting_gate_kk=kk)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    want = oracle_layer(model.layers[0].mixer, x)
    got32 = model.layers[0].mixer(x[None])[0]
    assert rel_err(got32, want) <= OUT_TOL
    model.double()
    assert rel_err(model.layers[0].mixer(x[None].double())[0], want) <= FP64_TOL


def _parity_prefill_vs_decode(dtype: torch.dtype, T: int, seed: int, **gka) -> tuple[float, float]:
    model = make_model(seed=seed, **gka).to(dtype)
    mixer = model.layers[0].mixer
    state = new_state(mixer, 2, dtype)
    gen = torch.Generator().manual_seed(seed)
    prefix, x = torch.randn(11, HIDDEN, generator=gen, dtype=dtype), torch.randn(T, HIDDEN, generator=gen, dtype=dtype)
    for slot in (0, 1):
        mixer_prefill(mixer, state, slot, prefix)
    y_prefill = mixer_prefill(mixer, state, 0, x)
    y_decode = torch.cat([mixer.decode(x[t : t + 1], state, StepBatch.decode([1])) for t in range(T)])
    assert y_prefill.shape == (T, HIDDEN)
    worst_state = max(rel_err(state[n][1], state[n][0]) for n in state)
    return rel_err(y_decode, y_prefill), worst_state


@pytest.mark.parametrize("T", [1, 7, 37])
def test_prefill_equals_decode_steps(T: int) -> None:
    err, state_err = _parity_prefill_vs_decode(F64, T, seed=T)
    assert err <= FP64_TOL and state_err <= 1e-12
    err, state_err = _parity_prefill_vs_decode(torch.float32, T, seed=T)
    assert err <= OUT_TOL and state_err <= STATE_TOL


@pytest.mark.parametrize("T", [7, 37])
def test_prefill_equals_decode_steps_with_undecayed_key_covariance(T: int) -> None:
    """use_forgetting_gate_kk = false (H never decays, S does): prefill == decode steps, outputs and states."""
    err, state_err = _parity_prefill_vs_decode(F64, T, seed=40 + T, use_forgetting_gate_kk=False)
    assert err <= FP64_TOL and state_err <= 1e-12
    err, state_err = _parity_prefill_vs_decode(torch.float32, T, seed=40 + T, use_forgetting_gate_kk=False)
    assert err <= OUT_TOL and state_err <= STATE_TOL


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_split_prefill_equals_one_prefill(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    model = make_model(seed=2).to(dtype)
    mixer = model.layers[0].mixer
    state = new_state(mixer, 2, dtype)
    T = 45
    x = torch.randn(T, HIDDEN, generator=gen, dtype=dtype)
    whole = mixer_prefill(mixer, state, 0, x)
    cuts = sorted(torch.randperm(T - 1, generator=gen)[:4].add(1).tolist())
    pieces = [mixer_prefill(mixer, state, 1, x[a:b]) for a, b in zip([0, *cuts], [*cuts, T], strict=True)]
    assert rel_err(torch.cat(pieces), whole) <= (FP64_TOL if dtype == F64 else OUT_TOL)
    assert_states_close(state_rows(state, 1), state_rows(state, 0), 1e-12 if dtype == F64 else STATE_TOL)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_packed_prefill_equals_separate(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    model = make_model(seed=3).to(dtype)
    mixer = model.layers[0].mixer
    state = new_state(mixer, 3, dtype)
    lens = [5, 19, 1]
    xs = [torch.randn(n, HIDDEN, generator=gen, dtype=dtype) for n in lens]
    for slot in range(3):
        mixer_prefill(mixer, state, slot, torch.randn(4 + slot, HIDDEN, generator=gen, dtype=dtype))
    saved = {k: v.clone() for k, v in state.items()}
    alone = [mixer_prefill(mixer, state, slot, x) for slot, x in enumerate(xs)]
    after_alone = {k: v.clone() for k, v in state.items()}
    for k in state:
        state[k].copy_(saved[k])
    packed = mixer.prefill(torch.cat(xs), state, StepBatch.prefill([0, 1, 2], lens))
    assert rel_err(packed, torch.cat(alone)) <= (FP64_TOL if dtype == F64 else OUT_TOL)
    for slot in range(3):
        assert_states_close(
            state_rows(state, slot), state_rows(after_alone, slot), 1e-12 if dtype == F64 else STATE_TOL
        )


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_training_forward_equals_prefill(dtype: torch.dtype) -> None:
    """HybridLM.forward (batched) == packed prefill, sequence by sequence (model with MLPs, two GKA layers)."""
    model = make_model(["gka", "gka"], seed=6, mlp=True).to(dtype)
    ids = torch.randint(0, 256, (3, 29), generator=torch.Generator().manual_seed(6))
    batched = model(ids)
    state = [new_state(layer.mixer, 3, dtype) for layer in model.layers]
    packed = model.prefill(ids.flatten(), state, StepBatch.prefill([0, 1, 2], [29] * 3), all_logits=True)
    assert batched.shape == (3, 29, VOCAB)
    assert rel_err(batched.flatten(0, 1), packed) <= (FP64_TOL if dtype == F64 else OUT_TOL)


def test_training_forward_is_differentiable() -> None:
    with torch.inference_mode(False), torch.enable_grad():
        model = make_model(["gka", "gka"], seed=8, mlp=True)
        ids = torch.randint(0, 256, (2, 21))
        loss = F.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    mixer = model.layers[0].mixer
    for p in (mixer.A_log, mixer.dt_bias, mixer.alpha_proj.weight, mixer.b_proj.weight, mixer.conv.weight):
        assert p.grad.abs().sum() > 0


# -- state pool: sessions, snapshots, memory -------------------------------------------------------------------------
@pytest.mark.parametrize("gka", [{}, {"use_v_conv": False, "conv_kernel": 3}])
def test_bytes_per_session_is_constant_and_matches_formula(gka: dict) -> None:
    """§14.7 / §9.3 per layer: (K-1)(2 He D + He Dv [v conv]) b_act + He (4 D^2 + 4 D Dv)."""
    model = make_model(["gka", "gka", "gka"], **gka)
    c = model.config.gka
    He, D, Dv, K = c.num_heads, c.head_dim, c.v_head_dim, c.conv_kernel
    conv_channels = 2 * He * D + (He * Dv if c.use_v_conv else 0)
    per_layer = (K - 1) * conv_channels * 4 + He * (4 * D * D + 4 * D * Dv)  # fp32 model: b_act = 4
    pool = StatePool(model, capacity=2, max_context=64)
    assert pool.bytes_per_session() == 3 * per_layer
    big = StatePool(model, capacity=2, max_context=1 << 20)
    assert big.bytes_per_session() == pool.bytes_per_session() == pool.bytes_per_session(100_000)
    assert pool.bytes_per_token() == 0
    model_prefill(model, pool, 0, random_ids(70, 1))
    assert pool.session_bytes(0) == 3 * per_layer
    # bf16 activations: the conv tail halves, H and S stay fp32.
    half = StatePool(model.to(torch.bfloat16), capacity=1)
    assert half.bytes_per_session() == 3 * ((K - 1) * conv_channels * 2 + He * (4 * D * D + 4 * D * Dv))


# -- configuration ----------------------------------------------------------------------------------------------------
def test_num_iter_override_at_load(tmp_path) -> None:
    """`gka.num_iter` is a serving knob: load_model(config_overrides=...) (what LLM(...) and `--set` use) changes the
    output; r = 30 is close to a converged solve and closer than r = 10."""
    from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer

    model = make_model(["gka", "gka"], seed=11, mlp=True)
    with tempfile.TemporaryDirectory() as tok:
        write_byte_tokenizer(tok)
        path = save_model(model, tmp_path / "ckpt", tokenizer_from=tok)
    ids = torch.tensor(random_ids(100, 12))
    default = load_model(path, device="cpu", dtype="float32")(ids[None])[0]
    fewer = load_model(path, device="cpu", dtype="float32", config_overrides={"gka.num_iter": 10})
    assert fewer.config.gka.num_iter == 10 and fewer.layers[0].mixer.cfg.num_iter == 10
    assert rel_err(fewer(ids[None])[0], default) > 1e-4  # the override really changes the function
    # Convergence, in float64 so that fp32 rounding does not hide it.
    logits = {}
    for r in (10, 30, 200, 400):
        m = load_model(path, device="cpu", dtype=torch.float64, config_overrides={"gka.num_iter": r})
        logits[r] = m(ids[None])[0]
    assert rel_err(logits[30], default) < OUT_TOL
    assert rel_err(logits[30], logits[400]) < 1e-2
    assert rel_err(logits[30], logits[400]) < 0.1 * rel_err(logits[10], logits[400])
    assert rel_err(logits[200], logits[400]) < FP64_TOL  # converged


def test_config_checks() -> None:
    for field, value in [("ridge_strength", 0.0), ("num_iter", 0), ("value_head_dim", 0), ("chunk_size", -1)]:
        with pytest.raises(ConfigError, match=f"config.gka.{field}"):
            make_config(**{field: value})
    assert make_config(value_head_dim=None).gka.v_head_dim == GKA["head_dim"]


# -- long session ------------------------------------------------------------------------------------------------------
def test_long_session_16k() -> None:
    """16K tokens through a two-layer GKA model (one layer with a ~1.4K-token memory, one that barely forgets, so
    ||H|| grows to ~1e4): finite everywhere, H symmetric PSD, and 64 decode steps after a 16K-64 prefill match
    the last 64 positions of one 16K prefill."""
    t0 = time.perf_counter()
    model = make_model(["gka", "gka"], seed=13, chunk_size=64)
    with torch.no_grad():
        model.layers[0].mixer.A_log.fill_(math.log(1e-3))
        model.layers[1].mixer.A_log.fill_(math.log(1e-5))
    T, tail = 16_384, 64
    ids = torch.tensor(random_ids(T, 14))
    pool = StatePool(model, capacity=2)
    full = model.prefill(ids, pool.tensors, StepBatch.prefill([0], [T]), all_logits=True)
    model.prefill(ids[: T - tail], pool.tensors, StepBatch.prefill([1], [T - tail]))
    steps = torch.cat([model.decode(ids[t : t + 1], pool.tensors, StepBatch.decode([1])) for t in range(T - tail, T)])
    assert torch.isfinite(full).all() and torch.isfinite(steps).all()
    assert rel_err(steps, full[T - tail :]) <= 1e-5  # measured 5e-7 (this model has no near-cancelling head)
    for layer_state in pool.tensors:
        for name, tensor in layer_state.items():
            assert torch.isfinite(tensor).all(), name
        assert rel_err(layer_state["h"][1], layer_state["h"][0]) <= 1e-4  # 16K tokens of fp32 accumulation
        assert rel_err(layer_state["s"][1], layer_state["s"][0]) <= 1e-4
        H = layer_state["h"][1].double()
        assert rel_err(H, H.transpose(-1, -2)) <= 1e-6
        eig = torch.linalg.eigvalsh((H + H.transpose(-1, -2)) / 2)
        assert (eig.min(-1).values >= -1e-5 * eig.max(-1).values).all()
    assert torch.linalg.matrix_norm(pool.tensors[1]["h"][0]).min() > 1e3
    assert time.perf_counter() - t0 < 60
