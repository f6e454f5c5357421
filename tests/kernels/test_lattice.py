"""Lattice Triton kernel (interpreted on the CPU, compiled on a GPU) against the float64 PyTorch reference.

Every check draws fresh random inputs (unit-norm keys of the layer's scale, step sizes in (0, 1), forget gates in
(0.3, 1)), packs sequences of unequal lengths (1, 0, several tokens), uses random rows of a larger pool of
orthonormal states (some continuing, some a fresh S0), poisons every buffer the Triton functions allocate, and checks
that rows not named stay bit-for-bit unchanged. Tolerances (relative, outputs and states): 1e-4 with fp32 inputs,
1e-2 with bf16 inputs. At the model level, the layer's 1e-5 (2e-4 for "enc") prefill/decode tolerance of
tests/engine/test_lattice.py, and the shipped MQAR checkpoint must score the same through both paths.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # must precede the first import of a module that defines Triton kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import kvfree.kernels.lattice as lattice_ops  # noqa: E402
from kvfree.kernels.lattice import chunk as lattice_chunk  # noqa: E402
from kvfree.kernels.lattice import fused_recurrent as lattice_step  # noqa: E402
from kvfree.kernels.lattice import reference as lattice_ref  # noqa: E402
from tests import kernel_checks  # noqa: E402
from tests.kernel_checks import DEVICE, assert_mqar_scores_the_same, cu_of, rel, run_layers, seed, untouched  # noqa: E402

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
LENS = [5, 1, 0, 23, 2]  # several tokens; one; an empty sequence (state kept); a longer one; two
f64 = torch.float64


def op_inputs(g, n: int, H: int, d: int, m: int, dtype: torch.dtype, forget: bool) -> list[torch.Tensor | None]:
    """As the layer hands them over: L2-normalised q and k (in `dtype`), values, fp32 gates: gamma = sigmoid(.)
    and, when `forget`, mu in (0.3, 1) (None is the folded serving form)."""
    q = F.normalize(torch.randn(n, H, m, generator=g), dim=-1)
    k = F.normalize(torch.randn(n, H, m, generator=g), dim=-1)
    v = torch.randn(n, H, d, generator=g)
    gamma = torch.sigmoid(torch.randn(n, H, generator=g))
    mu = 0.3 + 0.7 * torch.rand(n, H, generator=g) if forget else None
    return [t.to(dtype).to(DEVICE) for t in (q, k, v)] + [gamma.to(DEVICE), None if mu is None else mu.to(DEVICE)]


def make_pool(g, S: int, H: int, d: int, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 pool of S rows of random states with orthonormal columns, and n distinct random rows of it."""
    pool = torch.linalg.qr(torch.randn(S, H, d, m, generator=g, dtype=f64))[0].float().contiguous()
    idx = torch.randperm(S, generator=g)[:n]
    return pool.to(DEVICE), idx.to(torch.int32).to(DEVICE)


def as64(inp: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if t is None else t.to(f64) for t in inp]


# -- prefill and decode against the reference -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, H, d, m, variant, forget",
    [
        (torch.float32, 2, 16, 16, "dec", False),  # the serving form: mu folded away
        (torch.float32, 2, 12, 6, "dec", True),  # d != m, both below a block (masked): catches a transposed state
        (torch.float32, 1, 8, 8, "enc", True),
        (torch.float32, 2, 8, 5, "sim", False),
        (torch.bfloat16, 2, 16, 8, "dec", True),
    ],
)
def test_chunk_lattice_matches_reference(poison, dtype, H, d, m, variant, forget):
    g = seed("chunk", dtype, H, d, m, variant, forget)
    inp = op_inputs(g, sum(LENS), H, d, m, dtype, forget)
    pool, idx = make_pool(g, 9, H, d, m, len(LENS))
    ref_pool = pool.to(f64)
    rest = untouched(pool, idx)
    cu = cu_of(LENS)

    y = lattice_chunk.chunk_lattice(*inp, pool, idx, cu, variant, cu_seqlens_cpu=cu.cpu())
    y_ref = lattice_ref.chunk_lattice(*as64(inp), ref_pool, idx, cu, variant)

    assert y.dtype == torch.float32 and y.shape == (sum(LENS), H, d)
    assert rel(y, y_ref) <= TOL[dtype]
    assert rel(pool[idx.long()], ref_pool[idx.long()]) <= TOL[dtype]
    assert torch.equal(untouched(pool, idx), rest)


@pytest.mark.parametrize(
    "dtype, H, d, m, variant, forget",
    [
        (torch.float32, 3, 16, 16, "dec", False),
        (torch.float32, 2, 12, 6, "enc", True),
        (torch.float32, 2, 8, 8, "sim", True),
        (torch.bfloat16, 2, 16, 16, "dec", False),
    ],
)
def test_fused_recurrent_lattice_matches_reference(poison, dtype, H, d, m, variant, forget):
    g = seed("step", dtype, H, d, m, variant, forget)
    B = 5
    inp = op_inputs(g, B, H, d, m, dtype, forget)
    pool, idx = make_pool(g, 11, H, d, m, B)
    ref_pool = pool.to(f64)
    rest = untouched(pool, idx)

    y = lattice_step.fused_recurrent_lattice(*inp, pool, idx, variant)
    y_ref = lattice_ref.fused_recurrent_lattice(*as64(inp), ref_pool, idx, variant)

    assert y.dtype == torch.float32 and y.shape == (B, H, d)
    assert rel(y, y_ref) <= TOL[dtype]
    assert rel(pool[idx.long()], ref_pool[idx.long()]) <= TOL[dtype]
    assert torch.equal(untouched(pool, idx), rest)


def gated_inputs(
    g, n: int, H: int, d: int, m: int, K: int, dtype: torch.dtype, forget: bool, bias: bool, post: str
) -> dict:
    """The gated ops' inputs as the layer's projections give them: p, v and step logits in `dtype`, conv filters in
    `dtype` (biases when `bias`), and the post-gate (`post`: "none", "gate", or "norm": gate and head norm)."""
    p = torch.randn(n, H * m, generator=g)
    v = torch.randn(n, H, d, generator=g)
    step = torch.randn(n, 2 * H if forget else H, generator=g) + (torch.arange(2 * H if forget else H) >= H) * 3.0
    w = torch.randn(2, H * m, K, generator=g) / K**0.5
    b = torch.randn(2, H * m, generator=g) * 0.1 if bias else [None, None]
    gate = torch.randn(n, H * d, generator=g) if post != "none" else None
    norm_w = 1 + 0.3 * torch.randn(d, generator=g) if post == "norm" else None
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return {"p": cast(p), "v": cast(v), "step": cast(step), "conv": (cast(w[0]), cast(b[0]), cast(w[1]), cast(b[1])),
            "post": (cast(gate), cast(norm_w), 1e-5)}  # fmt: skip


def run_gated(mod, inp: dict, tails, pool, idx, cu, variant: str, qk_l2: bool) -> torch.Tensor:
    """`mod.chunk_lattice_gated` (cu given) or `mod.fused_recurrent_lattice_gated` on `inp`."""
    if cu is None:
        return mod.fused_recurrent_lattice_gated(inp["p"], inp["v"], inp["step"], tails, pool, idx, *inp["conv"],
                                                 variant, qk_l2, 1e-4, *inp["post"])  # fmt: skip
    return mod.chunk_lattice_gated(inp["p"], inp["v"], inp["step"], tails, pool, idx, cu, *inp["conv"], variant,
                                   qk_l2, 1e-4, *inp["post"])  # fmt: skip


@pytest.mark.parametrize(
    "dtype, K, forget, bias, qk_l2, variant, post, decode",
    [
        (torch.float32, 4, True, True, True, "dec", "norm", False),  # the layer's defaults
        (torch.float32, 3, False, False, True, "enc", "none", False),
        (torch.float32, 2, True, True, False, "dec", "gate", False),
        (torch.float32, 1, True, False, True, "sim", "norm", False),  # no conv tail at all
        (torch.bfloat16, 4, True, True, True, "dec", "norm", False),
        (torch.float32, 4, True, True, True, "dec", "norm", True),
        (torch.float32, 4, True, False, True, "dec", "none", True),
        (torch.bfloat16, 3, False, True, True, "dec", "gate", True),
    ],
)
def test_gated_ops_match_reference(poison, dtype, K, forget, bias, qk_l2, variant, post, decode):
    """The layer's convs, q/k norm, gates and post-gate inside the kernel: outputs, states and conv tails as the
    reference (conv ops, normalise, gates, recurrence, gelu gate and head norm), with sequences shorter than the tail
    (1 and 2 tokens: the new tail mixes the old one with the new tokens), an empty one, and random (continued)
    tails."""
    H, d, m = 2, 12, 8
    lens = [5] if decode else [1, 2, 0, 23, 4]
    n = 5 if decode else sum(lens)
    g = seed("gated", dtype, K, forget, bias, qk_l2, variant, post, decode)
    inp = gated_inputs(g, n, H, d, m, K, dtype, forget, bias, post)
    pool, idx = make_pool(g, 9, H, d, m, len(lens) if not decode else 5)
    tails = torch.randn(9, K - 1, H * m, generator=g).to(dtype).to(DEVICE)
    ref_pool, ref_tails = pool.to(f64), tails.to(f64)
    rest, rest_tails = untouched(pool, idx), untouched(tails, idx)
    cu = None if decode else cu_of(lens)

    mod = lattice_step if decode else lattice_chunk
    y = run_gated(mod, inp, tails, pool, idx, cu, variant, qk_l2)
    inp64 = {k: (tuple(t.to(f64) if isinstance(t, torch.Tensor) else t for t in v) if isinstance(v, tuple)
                 else v.to(f64)) for k, v in inp.items()}  # fmt: skip
    y_ref = run_gated(lattice_ref, inp64, ref_tails, ref_pool, idx, cu, variant, qk_l2)

    i = idx.long()
    if post == "none":
        assert y.dtype == torch.float32 and y.shape == (n, H, d)
    else:
        assert y.dtype == dtype and y.shape == (n, H * d)
    assert rel(y, y_ref) <= TOL[dtype]
    assert rel(pool[i], ref_pool[i]) <= TOL[dtype]
    if K > 1:
        assert torch.equal(tails[i].to(f64), ref_tails[i])  # copies of inputs: exact
        assert torch.equal(untouched(tails, idx), rest_tails)
    assert torch.equal(untouched(pool, idx), rest)


def test_split_prefill_then_decode_continues_the_sequence(poison):
    """A prompt prefilled in two calls (the second continuing the states the first left in the pool) gives the
    outputs and states of one call; decode steps after it continue exactly as the reference does."""
    g = seed("continue")
    H, d, m = 2, 16, 8
    lens = [30, 9]
    prompt = op_inputs(g, sum(lens), H, d, m, torch.float32, False)
    pool, idx = make_pool(g, 6, H, d, m, 2)
    pool_two, ref_pool = pool.clone(), pool.to(f64)

    y_one = lattice_chunk.chunk_lattice(*prompt, pool, idx, cu_of(lens))
    first = torch.cat([torch.arange(0, 17), torch.arange(30, 31)])  # 17 tokens of the first sequence, 1 of the second
    second = torch.cat([torch.arange(17, 30), torch.arange(31, 39)])
    y_a = lattice_chunk.chunk_lattice(*(t[first] for t in prompt[:4]), None, pool_two, idx, cu_of([17, 1]))
    y_b = lattice_chunk.chunk_lattice(*(t[second] for t in prompt[:4]), None, pool_two, idx, cu_of([13, 8]))
    y_two = torch.empty_like(y_one)
    y_two[first], y_two[second] = y_a, y_b
    assert torch.equal(y_two, y_one) and torch.equal(pool_two, pool)  # the same arithmetic in the same order

    outs = [y_one]
    refs = [lattice_ref.chunk_lattice(*as64(prompt), ref_pool, idx, cu_of(lens))]
    for _ in range(3):
        tok = op_inputs(g, 2, H, d, m, torch.float32, False)
        outs.append(lattice_step.fused_recurrent_lattice(*tok, pool, idx))
        refs.append(lattice_ref.fused_recurrent_lattice(*as64(tok), ref_pool, idx))
    assert rel(torch.cat(outs), torch.cat(refs)) <= 1e-4 and rel(pool, ref_pool) <= 1e-5


def test_bad_shapes_are_refused():
    g = seed("shapes")
    inp = op_inputs(g, 4, 2, 8, 8, torch.float32, False)
    pool, idx = make_pool(g, 6, 2, 8, 8, 4)
    with pytest.raises(ValueError, match="fp32 pool"):
        lattice_step.fused_recurrent_lattice(*inp, pool.double(), idx)
    with pytest.raises(ValueError, match="shapes"):
        lattice_chunk.chunk_lattice(*inp, pool[:, :1], idx[:1], cu_of([4]))
    with pytest.raises(ValueError, match="variant"):
        lattice_step.fused_recurrent_lattice(*inp, pool, idx, "nope")


# -- training: the differentiable kernel -----------------------------------------------------------------------------
@pytest.mark.parametrize("variant, T, v_dtype", [("dec", 70, torch.float32), ("enc", 12, torch.float32),
                                                 ("sim", 9, torch.float32), ("dec", 20, torch.bfloat16)])  # fmt: skip
def test_training_scan_gradients_match_autograd_of_the_reference(poison, variant, T, v_dtype):
    """`lattice_scan_train` (forward with checkpoints every 64 tokens, backward recomputing each segment): outputs,
    final states and the gradients of q, k, v, gamma and S0 against autograd through the float64 reference, for
    random upstream gradients of both outputs; 70 tokens cross a checkpoint."""
    from kvfree.kernels.lattice.backward import lattice_scan_train

    B, H, d, m = 2, 2, 12, 8
    g = seed("train", variant, T, v_dtype)
    with torch.inference_mode(False), torch.enable_grad():  # conftest runs every test in inference mode
        S0 = torch.linalg.qr(torch.randn(B, H, d, m, generator=g, dtype=f64))[0].float().contiguous()
        q = F.normalize(torch.randn(B, T, H, m, generator=g), dim=-1)
        k = F.normalize(torch.randn(B, T, H, m, generator=g), dim=-1)
        v = torch.randn(B, T, H, d, generator=g).to(v_dtype)
        gamma = torch.sigmoid(torch.randn(B, T, H, generator=g))
        gy, gs = torch.randn(B, T, H, d, generator=g), torch.randn(B, H, d, m, generator=g)
        leaves = [t.to(DEVICE).requires_grad_() for t in (S0, q, k, v, gamma)]
        y, S = lattice_scan_train(*leaves, variant)
        ((y * gy.to(DEVICE)).sum() + (S * gs.to(DEVICE)).sum()).backward()
        ref_leaves = [t.detach().to(f64).requires_grad_() for t in leaves]
        y_ref, S_ref = lattice_ref.lattice_recurrent(*ref_leaves, None, variant)
        ((y_ref * gy.to(DEVICE, f64)).sum() + (S_ref * gs.to(DEVICE, f64)).sum()).backward()
    tol = 1e-4 if v_dtype == torch.float32 else 1e-2  # bf16 v: its gradient is rounded to bf16 (2^-9 per element)
    assert rel(y, y_ref) <= 1e-4 and rel(S, S_ref) <= 1e-4
    for name, got, want in zip(("S0", "q", "k", "v", "gamma"), leaves, ref_leaves, strict=True):
        assert got.grad.dtype == got.dtype, name
        assert rel(got.grad, want.grad) <= (tol if name == "v" else 1e-4), name


def test_training_forward_of_a_model_agrees_between_reference_and_triton(monkeypatch):
    """A two-layer Lattice model's training forward (forget gate on, so the Triton path folds it) and the gradients
    of every parameter through either path, fp32."""
    from tests.engine.test_lattice import make_model

    grads = {}
    with torch.inference_mode(False), torch.enable_grad():  # conftest runs every test in inference mode
        model = make_model(("lattice", "lattice"), seed=5, mlp=True).to(DEVICE)
        ids = torch.randint(0, 256, (2, 40), generator=seed("train-model")).to(DEVICE)
        for mode in ("reference", "triton"):
            monkeypatch.setenv("KVFREE_KERNELS", mode)
            model.zero_grad()
            logits = model(ids)
            logits.float().square().mean().backward()
            params = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            grads[mode] = (logits.detach(), params)
    assert rel(grads["triton"][0], grads["reference"][0]) <= 1e-5
    assert grads["triton"][1].keys() == grads["reference"][1].keys()
    for name, g in grads["triton"][1].items():
        assert rel(g, grads["reference"][1][name]) <= 1e-4, name


# -- dispatch --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, want", [("reference", "reference"), ("triton", "triton")])
def test_ops_dispatch_to_what_the_mode_says(monkeypatch, mode, want):
    """KVFREE_KERNELS picks the implementation; fp64 inputs or pools always take the reference (the kernel is
    fp32)."""
    calls = kernel_checks.recorded_dispatch(
        monkeypatch, mode, (lattice_ref, "fused_recurrent_lattice", "reference"),
        (lattice_step, "fused_recurrent_lattice", "triton"),
    )  # fmt: skip
    g = seed("dispatch")
    inp = op_inputs(g, 2, 2, 8, 8, torch.float32, False)
    pool, idx = make_pool(g, 4, 2, 8, 8, 2)
    lattice_ops.fused_recurrent_lattice(*inp, pool, idx)
    lattice_ops.fused_recurrent_lattice(*as64(inp), pool.double(), idx)
    assert calls == [want, "reference"]


# -- whole models ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["dec", "enc"])
def test_lattice_model_logits_agree_between_reference_and_triton(monkeypatch, variant):
    """tests/engine/test_lattice.py's model (two Lattice layers, d=8, m=6, conv width 3, forget gate) in fp32: logits
    of a split prefill and decode steps through the Triton path are as close to the same model in float64 as the fp32
    reference path is (within 2x, or that file's tolerance). Held to the float64 run, not to the other fp32 path:
    "enc" amplifies rounding (the reference's own fp32 error here is 9e-4, against 2e-4 for one layer in
    tests/engine/test_lattice.py), so two fp32 orders of summation differ by about as much as either errs."""
    import copy

    from tests.engine.test_lattice import TOL_VARIANT, make_model

    model = make_model(("lattice", "lattice"), seed=4, mlp=True, variant=variant).to(DEVICE).eval()
    g = seed("model", variant)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (21, 12)]
    monkeypatch.setenv("KVFREE_KERNELS", "reference")
    exact = run_layers(copy.deepcopy(model).double(), prompts, steps=3)
    ref = run_layers(model, prompts, steps=3)
    monkeypatch.setenv("KVFREE_KERNELS", "triton")
    out = run_layers(model, prompts, steps=3)
    assert rel(out, exact) <= 2 * max(rel(ref, exact), TOL_VARIANT[variant])
    if variant == "dec":
        assert rel(ref, exact) <= TOL_VARIANT[variant]


def test_shipped_mqar_lattice_checkpoint_scores_the_same_through_triton(monkeypatch):
    """checkpoints/trained/mqar-mamba2-lattice on held-out MQAR sequences (M=8, gap=64: prefill, then teacher-forced
    decode) through the Lattice Triton kernel scores what the reference scores, and what its report says. Its Mamba-2
    layers stay on the reference, to keep the interpreted run short."""
    # Two sequences, not four: the interpreted token walk is the slowest of the layers (80 s for four on CI).
    assert_mqar_scores_the_same("mqar-mamba2-lattice", lattice_ops, monkeypatch, batch=2)
