"""Check and time the Lattice Triton kernel on a CUDA GPU, in one run (about 2 minutes on an H100).

    python -m kvfree.bench.kernels.lattice --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)
    python -m kvfree.bench.kernels --op lattice --out DIR  (the same)

(a) Correctness at lattice-110m's sizes (H=12, d=m=64, fp32 pool of 512 rows, random slots holding orthonormal
    states) against the float64 reference, every buffer the kernel allocates poisoned with NaN first: the decode
    step at B=64 and the prefill of packed sequences of lengths 1, 700, 64, 3, 2000, 129, each with fp32 and bf16
    inputs, the serving form (mu folded away) and with a forget gate; relative errors of outputs and states, rows
    not named bit-identical. The decode step captured in a CUDA graph and replayed on new inputs equals eager.
(b) Medians from `triton.testing.do_bench`: the op's decode at B=1/64/256 (fp32 q, k as the layer's L2 norm leaves
    them, bf16 v; per step replayed from a CUDA graph, and eager) with a warp sweep, against its floor (the fp32 state
    read and written once, over a device-to-device copy's bandwidth measured in the same run); the prefill at B=1
    T=16384 and 8x4096 packed; the PyTorch reference at the same decode shapes and a shorter prefill (it is a Python
    token loop). The whole layer is timed by `python -m kvfree.bench.layers --preset lattice-110m`.

Writes DIR/lattice.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from kvfree.bench import harness
from kvfree.bench.kernels.common import check_decode_graph, check_on_pools, lens_tag, random_slots, record

REAL = {
    "Hdm": (12, 64, 64),
    "pool": 512,
    "check_B": 64,
    "check_lens": [1, 700, 64, 3, 2000, 129],
    "decode_batches": (1, 64, 256),
    "warps": (2, 4, 8),
    "prefill_lens": ([16384], [4096] * 8),
    "reference_lens": [256] * 8,
}
SMOKE = {
    "Hdm": (2, 16, 8),
    "pool": 12,
    "check_B": 5,
    "check_lens": [1, 17, 3],
    "decode_batches": (1, 3),
    "warps": (4,),
    "prefill_lens": ([40], [20] * 2),
    "reference_lens": [8] * 2,
}
SZ = harness.Sizes(REAL, SMOKE)
SCRIPT = harness.CheckScript("lattice", __doc__, SZ, sections=("decode", "prefill"))
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it


@SCRIPT.shapes
def shapes() -> dict[str, str]:
    H, d, m = SZ["Hdm"]
    return {"op": f"H={H} d={d} m={m} (lattice-110m), variant dec, fp32 states in a {SZ['pool']}-row pool at random "
                  "slots; fp32 q, k (the layer's L2 norm), bf16 v, fp32 gates",
            "decode": f"B in {list(SZ['decode_batches'])}", "prefill": "B=1 T=16384 and 8x4096 packed (cu_seqlens)",
            "checks": f"decode B={SZ['check_B']}; prefill lens {SZ['check_lens']}"}  # fmt: skip


def lattice_inputs(n: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator, forget: bool = False) -> list:
    """Op inputs for n tokens: L2-normalised q, k and values in `dtype` (the timings cast q, k to fp32, as the
    layer's qk_norm leaves them), gamma = sigmoid(.), and mu in (0.3, 1) when `forget` else None."""
    H, d, m = SZ["Hdm"]
    q = F.normalize(torch.randn(n, H, m, generator=gen, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(n, H, m, generator=gen, device=dev), dim=-1).to(dtype)
    v = torch.randn(n, H, d, generator=gen, device=dev).to(dtype)
    gamma = torch.sigmoid(torch.randn(n, H, generator=gen, device=dev))
    mu = 0.3 + 0.7 * torch.rand(n, H, generator=gen, device=dev) if forget else None
    return [q, k, v, gamma, mu]


def make_pool(dev: torch.device, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 pool of orthonormal states and n distinct random rows of it."""
    H, d, m = SZ["Hdm"]
    pool = torch.linalg.qr(torch.randn(SZ["pool"], H, d, m, generator=gen, device=dev))[0].contiguous()
    idx = random_slots(SZ["pool"], n, gen, dev)
    return pool, idx


@SCRIPT.step("checks")
def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.lattice import chunk, fused_recurrent, reference

    gen = torch.Generator(device=dev).manual_seed(1)
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
    lens = SZ["check_lens"]
    cu = harness.cu_seqlens(lens, dev)
    for dtype, forget in itertools.product((torch.float32, torch.bfloat16), (False, True)):
        name = f"{str(dtype).removeprefix('torch.')}{'_mu' if forget else ''}"
        for op, n in (("decode", SZ["check_B"]), ("prefill", sum(lens))):
            inp = lattice_inputs(n, dtype, dev, gen, forget)
            pool, idx = make_pool(dev, gen, SZ["check_B"] if op == "decode" else len(lens))
            if op == "decode":
                row = check_on_pools(fused_recurrent.fused_recurrent_lattice, reference.fused_recurrent_lattice, inp,
                                     {"state": pool}, idx, tol=tol[dtype], out="y")  # fmt: skip
            else:
                row = check_on_pools(chunk.chunk_lattice, reference.chunk_lattice, inp, {"state": pool}, idx, cu,
                                     tol=tol[dtype], out="y", cu_seqlens_cpu=cu.tolist())  # fmt: skip
            record(res, SCRIPT.log, "checks", f"{op}_{name}", row, f"check {op} {name}")
            harness.sync()

    if dev.type == "cuda":  # the decode step inside a CUDA graph, replayed on new inputs
        B = SZ["check_B"]
        inp = lattice_inputs(B, torch.bfloat16, dev, gen)
        pool, idx = make_pool(dev, gen, B)
        check_decode_graph(res, SCRIPT.log, lambda st: fused_recurrent.fused_recurrent_lattice(*inp, *st, idx), [pool],
                           inp[:4], lambda: lattice_inputs(B, torch.bfloat16, dev, gen)[:4])  # fmt: skip


@SCRIPT.step("op")
def time_op(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.lattice import chunk, fused_recurrent, reference

    H, d, m = SZ["Hdm"]
    gen = torch.Generator(device=dev).manual_seed(2)
    pool, _ = make_pool(dev, gen, 1)
    for B in SZ["decode_batches"]:
        inp = lattice_inputs(B, torch.bfloat16, dev, gen)
        inp[0], inp[1] = inp[0].float(), inp[1].float()
        idx = random_slots(SZ["pool"], B, gen, dev)
        state_bytes = B * H * d * m * 4 * 2
        floor_us = state_bytes / res["hbm_copy_GBps"] / 1e3
        # Per step replayed from a CUDA graph of 10 steps, as the engine runs decode: eager medians of a 6 us kernel
        # swung between 6 and 50 us from run to run on the H100 (launch and clock jitter, not the kernel).
        per_step = harness.graph_per_call_ms if dev.type == "cuda" else lambda fn: harness.median_ms(fn, dev)
        sweep = {}
        for w in SZ["warps"]:
            fn = lambda inp=inp, idx=idx, w=w, B=B: fused_recurrent.scan(*inp, pool, idx, None, B, "dec", w)  # noqa: E731
            sweep[f"w{w}"] = per_step(fn) * 1e3
        us = per_step(lambda inp=inp, idx=idx: fused_recurrent.fused_recurrent_lattice(*inp, pool, idx)) * 1e3
        row = {"floor_us": floor_us, "triton_us": us, "over_floor": us / floor_us, "warp_sweep_us": sweep,
               "eager_us": harness.median_ms(lambda inp=inp, idx=idx: fused_recurrent.fused_recurrent_lattice(
                   *inp, pool, idx), dev) * 1e3,
               "reference_us": harness.median_ms(lambda inp=inp, idx=idx: reference.fused_recurrent_lattice(
                   *inp, pool, idx), dev, rep_ms=50) * 1e3}  # fmt: skip
        record(res, SCRIPT.log, "decode", f"B{B}", row, f"decode B={B}")

    for lens in [*SZ["prefill_lens"], SZ["reference_lens"]]:
        T = sum(lens)
        cu = harness.cu_seqlens(lens, dev)
        cu_cpu = cu.tolist()
        idx = random_slots(SZ["pool"], len(lens), gen, dev)
        inp = lattice_inputs(T, torch.bfloat16, dev, gen)
        inp[0], inp[1] = inp[0].float(), inp[1].float()
        row = {}
        for w in SZ["warps"]:
            ms = harness.median_ms(lambda inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu, w=w: chunk.chunk_lattice(
                *inp, pool, idx, cu, cu_seqlens_cpu=cu_cpu, num_warps=w), dev)  # fmt: skip
            row[f"w{w}"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        ms = harness.median_ms(lambda inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu: chunk.chunk_lattice(
            *inp, pool, idx, cu, cu_seqlens_cpu=cu_cpu), dev)  # fmt: skip
        row["default"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        if lens == SZ["reference_lens"]:
            ms = harness.median_ms(lambda inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu: reference.chunk_lattice(
                *inp, pool, idx, cu, cu_seqlens_cpu=cu_cpu), dev, warmup_ms=1, rep_ms=1)  # fmt: skip
            row["reference"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        tag = lens_tag(lens)
        record(res, SCRIPT.log, "prefill", tag, row, f"prefill {tag}")


@SCRIPT.table
def table(res: dict) -> str:
    lines = harness.table_head(res, "y_rel", lambda k, v: f"  {k:22s} y {v['y_rel']:.1e}  S {v['state_rel']:.1e}  "
                               f"untouched {v['untouched_equal']}")  # fmt: skip
    H, d, m = SZ["Hdm"]
    lines.append(f"{f'op decode H{H} d{d} m{m}':22s} {'us':>8s} {'floor':>7s} {'x floor':>8s} {'ref us':>8s}  warps")
    for k, v in res["decode"].items():
        warps = ", ".join(f"{c} {u:.1f}" for c, u in v["warp_sweep_us"].items())
        lines.append(f"  {k:20s} {v['triton_us']:8.1f} {v['floor_us']:7.1f} {v['over_floor']:8.2f} "
                     f"{v['reference_us']:8.1f}  {warps}")  # fmt: skip
    lines.append(f"{'op prefill':22s} {'ms':>8s} {'Mtok/s':>8s}")
    for k, v in res["prefill"].items():
        lines.append(f"  {k:20s} {v['default']['ms']:8.3f} {v['default']['Mtok_s']:8.3f}  "
                     + ", ".join(f"{c} {r['Mtok_s']:.3f}" for c, r in v.items() if c != "default"))  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
