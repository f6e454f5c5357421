"""Check and time the Lattice Triton training kernel (forward with checkpoints, recomputing backward) on a CUDA GPU.

    python -m kvfree.bench.kernels.lattice_train --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)
    python -m kvfree.bench.kernels --op lattice_train --out DIR  (the same)

The op is `backward.lattice_scan_train(S0, q, k, v, gamma, variant)`, what the layer trains with through
`lattice_forward`; its PyTorch path is `reference.lattice_recurrent` (a Python token loop under autograd). Sizes are
those of the MQAR model that trains with it: H=4 heads, d=m=32, fp32 q and k L2-normalised (as the layer's qk norm
leaves them), v in fp32 or bf16, gamma = sigmoid(.), S0 orthonormal columns (QR of randn).

(a) Correctness against autograd of `lattice_recurrent` in float64 (inputs cast to float64, no checkpointing), every
    buffer the kernel allocates poisoned with NaN first: outputs y and final S, and the gradients of q, k, v, gamma
    and S0 from a random upstream dy and dS, as relative errors per tensor (beside the PyTorch path's own in fp32,
    the function's conditioning). All three variants at B=2 T=200 with a distinct S0 per sequence and unit-norm
    values (with randn values "enc" itself is ill-conditioned in fp32); "dec" (the one trained) at B=4 T=1024 (fp32
    and bf16 v) and B=2 T=4160 (not a multiple of the 64-token segment) with S0 `[H, d, m]` expanded over B as the
    layer passes it (a non-contiguous view; its gradient sums over B); "dec" with the folded gamma / max(mu, 1e-4)
    (steps above 1, up to ~10). Two forward+backward calls of the same inputs must give bit-identical outputs and
    gradients (one program per (sequence, head), no atomics).
(b) Forward+backward (the gradients of (y*dy).sum() + (S*dS).sum(), taken with `autograd.grad`) and forward alone
    (no grad) of the Triton path against the PyTorch path (fp32, checkpoint_tokens=64, the layer's default) at the
    MQAR training shapes B=64 T=1024, B=16 T=4160 and B=32 T=2048 (bf16 v): ms, Mtokens/s, the speedup, and the peak
    memory each allocates above its inputs. Triton medians from `triton.testing.do_bench`; the PyTorch path (seconds
    per call) from a few host-timed calls after one warm-up.

Writes DIR/lattice_train.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfree.bench import harness
from kvfree.bench.kernels.common import record
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
# fp32 against float64: the kernel keeps S in fp32 registers through every token, and the column normalisation
# (norms >= 1 in the folded form, mu = 1, since the write is orthogonal to each column) keeps S bounded, so the
# rounding of each step does not grow. Measured with the PyTorch path in fp32 on the CPU at these sizes: ~2e-7 for
# every tensor of "dec" and "sim", at T=4160 too and with folded steps up to ~10. 1e-3 leaves room for a different
# summation order and a long sequence, and still catches a wrong gradient term (O(1e-2..1)).
FP32_TOL = 1e-3
# The kernel returns dv in v's dtype: bf16 rounding alone is up to 2^-9 (~2e-3) relative per element.
BF16_DV_TOL = 4e-3
MU_MIN = 1e-4  # the layer's forget-gate clamp (the folded step is gamma / max(mu, MU_MIN))
GRADS = ("dS0", "dq", "dk", "dv", "dgamma")
REAL = {
    "Hdm": (4, 32, 32),
    "variant_shape": (2, 200),  # (B, T) for all three variants
    "dec_shapes": ((4, 1024), (2, 4160)),  # fp32 v
    "bf16_shape": (4, 1024),  # and twice, for determinism
    "folded_shape": (2, 1024),
    "time_shapes": ((64, 1024), (16, 4160), (32, 2048)),
    "reference_calls": 2,  # timed calls of the PyTorch path after its warm-up (seconds each at T=4160)
    "rep_ms": 200,
}
SMOKE = {
    "Hdm": (2, 8, 8),
    "variant_shape": (2, 16),
    "dec_shapes": ((1, 70),),  # crosses the 64-token segment; the interpreter's time goes with B * H * T
    "bf16_shape": (1, 16),
    "folded_shape": (1, 16),
    "time_shapes": ((1, 16),),
    "reference_calls": 1,
    "rep_ms": 1,
}
SZ = harness.Sizes(REAL, SMOKE)
GOALS = [
    harness.Goal("cuda", "train_speedup_min", ">=", 10.0,
                 "training fwd+bwd speedup over the PyTorch path at the MQAR sizes (min over shapes, x)"),
]  # fmt: skip
SCRIPT = harness.CheckScript("lattice_train", __doc__, SZ, sections=("timing",), goals=GOALS)
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it
say = SCRIPT.log.say


@SCRIPT.shapes
def shapes() -> dict[str, str]:
    H, d, m = SZ["Hdm"]
    return {"op": f"H={H} d={d} m={m} (the MQAR model), fp32 q, k (L2-normalised), gamma = sigmoid(.), S0 orthonormal "
                  "columns; the Triton path checkpoints every 64 tokens",
            "checks": f"all variants at (B, T)={SZ['variant_shape']}; dec at {list(SZ['dec_shapes'])} (fp32 v), "
                      f"{SZ['bf16_shape']} (bf16 v, twice), folded gamma at {SZ['folded_shape']}; against float64 "
                      f"autograd; tolerance {FP32_TOL} (dv with bf16 v {BF16_DV_TOL})",
            "timing": f"dec, bf16 v, (B, T) in {list(SZ['time_shapes'])}; PyTorch path: lattice_recurrent fp32, "
                      "checkpoint_tokens=64"}  # fmt: skip


def train_inputs(B: int, T: int, v_dtype: torch.dtype, dev: torch.device, gen: torch.Generator,
                 folded: bool = False, per_sequence_s0: bool = False, unit_v: bool = False
                 ) -> list[torch.Tensor]:  # fmt: skip
    """Leaves [S0, q, k, v, gamma] requiring grad: S0 `[H, d, m]` (the layer's one learned state, expanded over B
    by `expand_s0`) or `[B, H, d, m]` distinct per sequence; q, k L2-normalised fp32; v = randn in `v_dtype`
    (L2-normalised with `unit_v`); gamma = sigmoid(.), or with `folded` gamma / max(mu, MU_MIN) with
    mu = sigmoid(. + 1.5), steps above 1 up to ~10."""
    H, d, m = SZ["Hdm"]
    s0 = torch.linalg.qr(torch.randn(*((B,) if per_sequence_s0 else ()), H, d, m, generator=gen, device=dev))[0]
    q = F.normalize(torch.randn(B, T, H, m, generator=gen, device=dev), dim=-1)
    k = F.normalize(torch.randn(B, T, H, m, generator=gen, device=dev), dim=-1)
    v = torch.randn(B, T, H, d, generator=gen, device=dev)
    v = (F.normalize(v, dim=-1) if unit_v else v).to(v_dtype)
    gamma = torch.sigmoid(torch.randn(B, T, H, generator=gen, device=dev))
    if folded:
        gamma = gamma / torch.sigmoid(torch.randn(B, T, H, generator=gen, device=dev) + 1.5).clamp_min(MU_MIN)
    return [t.contiguous().requires_grad_() for t in (s0, q, k, v, gamma)]


def expand_s0(s0: torch.Tensor, B: int) -> torch.Tensor:
    """S0 as the layer passes it: `[H, d, m]` -> an expanded (stride-0, non-contiguous) `[B, H, d, m]` view."""
    return s0.expand(B, *s0.shape) if s0.dim() == 3 else s0


def upstream(B: int, T: int, dev: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random dy `[B, T, H, d]` and dS `[B, H, d, m]` (never zeros: a zero dS would hide the final state's path)."""
    H, d, m = SZ["Hdm"]
    return torch.randn(B, T, H, d, generator=gen, device=dev), torch.randn(B, H, d, m, generator=gen, device=dev)


def triton_grads(leaves: list[torch.Tensor], dy: torch.Tensor, ds: torch.Tensor, variant: str) -> list[torch.Tensor]:
    """[y, S, dS0, dq, dk, dv, dgamma] of the Triton path."""
    from kvfree.kernels.lattice.backward import lattice_scan_train

    s0, q, k, v, gamma = leaves
    y, s = lattice_scan_train(expand_s0(s0, q.shape[0]), q, k, v, gamma, variant)
    return [y, s, *torch.autograd.grad((y, s), leaves, (dy, ds))]


def torch_grads(leaves: list[torch.Tensor], dy: torch.Tensor, ds: torch.Tensor, variant: str,
                checkpoint_tokens: int) -> list[torch.Tensor]:  # fmt: skip
    """[y, S, dS0, dq, dk, dv, dgamma] of the PyTorch path (autograd of `lattice_recurrent`, in the leaves' dtype)."""
    from kvfree.kernels.lattice.reference import lattice_recurrent

    s0, q, k, v, gamma = leaves
    y, s = lattice_recurrent(expand_s0(s0, q.shape[0]), q, k, v, gamma, None, variant,
                             checkpoint_tokens=checkpoint_tokens)  # fmt: skip
    return [y, s, *torch.autograd.grad((y, s), leaves, (dy.to(y.dtype), ds.to(s.dtype)))]


def check_case(name: str, variant: str, B: int, T: int, v_dtype: torch.dtype, dev: torch.device,
               gen: torch.Generator, res: dict, folded: bool = False, per_sequence_s0: bool = False,
               unit_v: bool = False, determinism: bool = False) -> None:  # fmt: skip
    """One correctness row: relative errors of y, S and the five gradients against float64 autograd, and for
    comparison the largest of the PyTorch path's own in fp32 (`pytorch_fp32_max_rel`: the function's conditioning)."""
    leaves = train_inputs(B, T, v_dtype, dev, gen, folded, per_sequence_s0, unit_v)
    dy, ds = upstream(B, T, dev, gen)
    with poisoned_outputs():  # forward and backward buffers both start as NaN
        out = triton_grads(leaves, dy, ds, variant)
    harness.sync()
    ref = torch_grads([t.detach().to(f64).requires_grad_() for t in leaves], dy, ds, variant, checkpoint_tokens=0)
    # rel_err is NaN where an element was left unwritten (poisoned), and NaN <= tol is False: a failure.
    errs = {n: harness.rel_err(o, r) for n, o, r in zip(("y", "S", *GRADS), out, ref, strict=True)}
    base = torch_grads(leaves, dy, ds, variant, checkpoint_tokens=0)
    base_err = max(harness.rel_err(o, r) for o, r in zip(base, ref, strict=True))
    tol = {n: BF16_DV_TOL if n == "dv" and v_dtype == torch.bfloat16 else FP32_TOL for n in errs}
    row = {"variant": variant, "B": B, "T": T, "v": str(v_dtype).removeprefix("torch."),
           "S0": "[B,H,d,m] per sequence" if per_sequence_s0 else "[H,d,m].expand(B) (non-contiguous)",
           "v_rows": "unit norm" if unit_v else "randn", "gamma_max": leaves[4].max().item(), "rel": errs,
           "max_rel": max(errs.values()), "pytorch_fp32_max_rel": base_err,
           "ok": all(e <= tol[n] for n, e in errs.items())}  # fmt: skip
    record(res, SCRIPT.log, "checks", name, row, f"check {name}")
    if determinism:  # the same inputs again, fresh buffers: equal bit for bit
        again = triton_grads(leaves, dy, ds, variant)
        same = all(torch.equal(a, b) for a, b in zip(out, again, strict=True))
        res["checks"][f"{name}_deterministic"] = {"ok": same, "bit_identical": same}
        say(f"check {name} twice bit-identical: {same}")


@SCRIPT.step("checks")
def check_correctness(dev: torch.device, res: dict) -> None:
    gen = torch.Generator(device=dev).manual_seed(1)
    f32, bf16 = torch.float32, torch.bfloat16
    B, T = SZ["variant_shape"]
    # Unit-norm values here: "enc" with randn values (|v| ~ sqrt(d)) is itself ill-conditioned (c = -gamma (S^T v - k)
    # swings each column far per token): its PyTorch path in fp32 was measured 1e-3..0.3 off float64 at T=100..1024
    # depending on the seed, where with unit v it is ~5e-7. There a check would measure the function, not the kernel.
    for variant in ("dec", "enc", "sim"):
        check_case(f"{variant}_B{B}_T{T}_s0_per_seq", variant, B, T, f32, dev, gen, res, per_sequence_s0=True,
                   unit_v=True)  # fmt: skip
    for B, T in SZ["dec_shapes"]:
        check_case(f"dec_B{B}_T{T}", "dec", B, T, f32, dev, gen, res)
    B, T = SZ["bf16_shape"]
    check_case(f"dec_B{B}_T{T}_bf16v", "dec", B, T, bf16, dev, gen, res, determinism=True)
    B, T = SZ["folded_shape"]
    check_case(f"dec_B{B}_T{T}_folded", "dec", B, T, f32, dev, gen, res, folded=True)


def few_calls_ms(fn: Callable[[], object], calls: int) -> tuple[float, float | None]:
    """(median ms of `calls` host-timed calls after one warm-up, MiB the warm-up allocated at its peak above what
    was allocated before it; None without a GPU). For the PyTorch path: at ~1 s a call do_bench's minimum of 8 calls
    would take most of the run, and a Python token loop's time is its host time once synced."""
    harness.sync()
    mib = peak_mib(fn)
    times = []
    for _ in range(calls):
        harness.sync()
        start = time.perf_counter()
        fn()
        harness.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, mib


def peak_mib(fn: Callable[[], object]) -> float | None:
    """MiB `fn()` allocates at its peak above what is allocated before it (None without a GPU)."""
    if not torch.cuda.is_available():
        fn()
        return None
    harness.sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    harness.sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def train_bytes(B: int, T: int) -> int:
    """Bytes one forward+backward must move at least (bf16 v): the forward reads q, k (fp32), v, gamma and writes y
    (fp32) and a state every 64 tokens; the backward reads the inputs, the checkpoints and dy again and writes dq, dk,
    dv (fp32) and dgamma. The backward's per-segment scratch is left out (it may stay in L2)."""
    from kvfree.kernels.lattice.backward import SEGMENT

    H, d, m = SZ["Hdm"]
    inputs = 4 * m * 2 + 2 * d + 4  # q, k, v, gamma per token and head
    ckpt = -(-T // SEGMENT) * d * m * 4  # per sequence and head
    per_head_token = 2 * inputs + 4 * d + 4 * d + (4 * m * 2 + 4 * d + 4)  # inputs twice, y, dy, the gradients
    return B * H * (T * per_head_token + 2 * ckpt)


@SCRIPT.step("timing")
def time_training(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.lattice.backward import lattice_scan_train
    from kvfree.kernels.lattice.reference import lattice_recurrent

    gen = torch.Generator(device=dev).manual_seed(2)
    speedups = []
    for B, T in SZ["time_shapes"]:
        leaves = train_inputs(B, T, torch.bfloat16, dev, gen)
        dy, ds = upstream(B, T, dev, gen)
        s0, q, k, v, gamma = leaves

        def tri_step(leaves=leaves, dy=dy, ds=ds) -> object:
            return triton_grads(leaves, dy, ds, "dec")

        def ref_step(leaves=leaves, dy=dy, ds=ds) -> object:
            return torch_grads(leaves, dy, ds, "dec", checkpoint_tokens=64)

        def tri_fwd(s0=s0, q=q, k=k, v=v, gamma=gamma, B=B) -> object:
            with torch.no_grad():
                return lattice_scan_train(expand_s0(s0, B), q, k, v, gamma, "dec")

        def ref_fwd(s0=s0, q=q, k=k, v=v, gamma=gamma, B=B) -> object:
            with torch.no_grad():
                return lattice_recurrent(expand_s0(s0, B), q, k, v, gamma, None, "dec", checkpoint_tokens=64)

        n, calls = B * T, SZ["reference_calls"]
        tri_ms = harness.median_ms(tri_step, dev, rep_ms=SZ["rep_ms"])
        ref_ms, ref_mib = few_calls_ms(ref_step, calls)
        tri_fwd_ms = harness.median_ms(tri_fwd, dev, rep_ms=SZ["rep_ms"])
        ref_fwd_ms, _ = few_calls_ms(ref_fwd, calls)
        row = {"tokens": n,
               "fwd_bwd": {"triton_ms": tri_ms, "triton_Mtok_s": n / tri_ms / 1e3, "pytorch_ms": ref_ms,
                           "pytorch_Mtok_s": n / ref_ms / 1e3, "speedup": ref_ms / tri_ms,
                           "triton_peak_MiB": peak_mib(tri_step), "pytorch_peak_MiB": ref_mib},
               "fwd": {"triton_ms": tri_fwd_ms, "triton_Mtok_s": n / tri_fwd_ms / 1e3, "pytorch_ms": ref_fwd_ms,
                       "pytorch_Mtok_s": n / ref_fwd_ms / 1e3, "speedup": ref_fwd_ms / tri_fwd_ms},
               "pytorch_calls": calls}  # fmt: skip
        floor_us = train_bytes(B, T) / res["hbm_copy_GBps"] / 1e3
        row["fwd_bwd"] |= {"floor_us": floor_us, "over_floor": tri_ms * 1e3 / floor_us}
        speedups.append(row["fwd_bwd"]["speedup"])
        record(res, SCRIPT.log, "timing", f"B{B}_T{T}", row, f"time B={B} T={T}")
    res["goals_values"]["train_speedup_min"] = min(speedups)


def check_line(name: str, v: dict) -> str:
    worst = max(v["rel"], key=lambda n: v["rel"][n])
    return (f"  {name:24s} max rel {v['max_rel']:.1e} ({worst:6s})  torch fp32 {v['pytorch_fp32_max_rel']:.1e}  "
            f"y {v['rel']['y']:.1e}  S {v['rel']['S']:.1e}  gamma<={v['gamma_max']:.1f}")


@SCRIPT.table
def table(res: dict) -> str:
    lines = harness.table_head(res, "rel", check_line)
    H, d, m = SZ["Hdm"]
    lines.append(f"{f'dec H{H} d{d} m{m} bf16 v':18s} {'fwd+bwd ms':>10s} {'Mtok/s':>7s} {'torch ms':>9s} "
                 f"{'x':>6s} | {'fwd ms':>7s} {'torch ms':>9s} {'x':>6s} | peak MiB tri/torch")  # fmt: skip
    for name, v in res["timing"].items():
        fb, fw = v["fwd_bwd"], v["fwd"]
        mib = "/".join("-" if x is None else f"{x:.0f}" for x in (fb["triton_peak_MiB"], fb["pytorch_peak_MiB"]))
        lines.append(f"  {name:16s} {fb['triton_ms']:10.2f} {fb['triton_Mtok_s']:7.2f} {fb['pytorch_ms']:9.1f} "
                     f"{fb['speedup']:6.1f} | {fw['triton_ms']:7.2f} {fw['pytorch_ms']:9.1f} {fw['speedup']:6.1f} "
                     f"| {mib}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
