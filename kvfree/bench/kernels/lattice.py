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
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from kvfree.bench.harness import (
    RunLog,
    cu_seqlens,
    environment,
    graph_matches_eager,
    graph_per_call_ms,
    measure_hbm,
    median_ms,
    rel_err,
    run_script,
    script_args,
    sync,
    table_head,
    untouched_equal,
)
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
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
SZ = REAL
RUN = RunLog()
say = RUN.say


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
    idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[:n].to(torch.int32)
    return pool, idx


def as64(inp: list) -> list:
    return [None if t is None else t.to(f64) for t in inp]


def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.lattice import chunk, fused_recurrent, reference

    gen = torch.Generator(device=dev).manual_seed(1)
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
    lens = SZ["check_lens"]
    cu = cu_seqlens(lens, dev)
    for dtype, forget in itertools.product((torch.float32, torch.bfloat16), (False, True)):
        name = f"{str(dtype).removeprefix('torch.')}{'_mu' if forget else ''}"
        for op, n in (("decode", SZ["check_B"]), ("prefill", sum(lens))):
            inp = lattice_inputs(n, dtype, dev, gen, forget)
            pool, idx = make_pool(dev, gen, SZ["check_B"] if op == "decode" else len(lens))
            ref, before = pool.to(f64), pool.clone()
            with poisoned_outputs():
                if op == "decode":
                    y = fused_recurrent.fused_recurrent_lattice(*inp, pool, idx)
                    y_ref = reference.fused_recurrent_lattice(*as64(inp), ref, idx)
                else:
                    y = chunk.chunk_lattice(*inp, pool, idx, cu, cu_seqlens_cpu=cu.tolist())
                    y_ref = reference.chunk_lattice(*as64(inp), ref, idx, cu, cu_seqlens_cpu=cu.tolist())
            i = idx.long()
            row = {"y_rel": rel_err(y, y_ref), "state_rel": rel_err(pool[i], ref[i]),
                   "untouched_equal": untouched_equal(pool, before, idx)}  # fmt: skip
            row["ok"] = row["untouched_equal"] and max(row["y_rel"], row["state_rel"]) <= tol[dtype]
            res["checks"][f"{op}_{name}"] = row
            say(f"check {op} {name}: {json.dumps(row)}")
            sync()

    if dev.type == "cuda":  # the decode step inside a CUDA graph, replayed on new inputs
        B = SZ["check_B"]
        inp = lattice_inputs(B, torch.bfloat16, dev, gen)
        pool, idx = make_pool(dev, gen, B)
        ok = graph_matches_eager(lambda st: fused_recurrent.fused_recurrent_lattice(*inp, *st, idx), [pool], inp[:4],
                                 lambda: lattice_inputs(B, torch.bfloat16, dev, gen)[:4])  # fmt: skip
        res["checks"]["decode_cuda_graph"] = {"ok": ok, "equal_to_eager": ok}
        say(f"check decode graph replay equals eager: {ok}")


def time_op(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.lattice import chunk, fused_recurrent, reference

    H, d, m = SZ["Hdm"]
    gen = torch.Generator(device=dev).manual_seed(2)
    pool, _ = make_pool(dev, gen, 1)
    for B in SZ["decode_batches"]:
        inp = lattice_inputs(B, torch.bfloat16, dev, gen)
        inp[0], inp[1] = inp[0].float(), inp[1].float()
        idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[:B].to(torch.int32)
        state_bytes = B * H * d * m * 4 * 2
        floor_us = state_bytes / res["hbm_copy_GBps"] / 1e3
        # Per step replayed from a CUDA graph of 10 steps, as the engine runs decode: eager medians of a 6 us kernel
        # swung between 6 and 50 us from run to run on the H100 (launch and clock jitter, not the kernel).
        per_step = graph_per_call_ms if dev.type == "cuda" else lambda fn: median_ms(fn, dev)
        sweep = {}
        for w in SZ["warps"]:
            fn = lambda inp=inp, idx=idx, w=w, B=B: fused_recurrent.scan(*inp, pool, idx, None, B, "dec", w)  # noqa: E731
            sweep[f"w{w}"] = per_step(fn) * 1e3
        us = per_step(lambda inp=inp, idx=idx: fused_recurrent.fused_recurrent_lattice(*inp, pool, idx)) * 1e3
        row = {"floor_us": floor_us, "triton_us": us, "over_floor": us / floor_us, "warp_sweep_us": sweep,
               "eager_us": median_ms(lambda inp=inp, idx=idx: fused_recurrent.fused_recurrent_lattice(
                   *inp, pool, idx), dev) * 1e3,
               "reference_us": median_ms(lambda inp=inp, idx=idx: reference.fused_recurrent_lattice(
                   *inp, pool, idx), dev, rep_ms=50) * 1e3}  # fmt: skip
        res["decode"][f"B{B}"] = row
        say(f"decode B={B}: {json.dumps(row)}")

    for lens in [*SZ["prefill_lens"], SZ["reference_lens"]]:
        T = sum(lens)
        cu = cu_seqlens(lens, dev)
        cu_cpu = cu.tolist()
        idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[: len(lens)].to(torch.int32)
        inp = lattice_inputs(T, torch.bfloat16, dev, gen)
        inp[0], inp[1] = inp[0].float(), inp[1].float()
        tag = f"B1_T{T}" if len(lens) == 1 else f"{len(lens)}x{lens[0]}"
        row = {}
        for w in SZ["warps"]:
            ms = median_ms(lambda inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu, w=w: chunk.chunk_lattice(
                *inp, pool, idx, cu, cu_seqlens_cpu=cu_cpu, num_warps=w), dev)  # fmt: skip
            row[f"w{w}"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        ms = median_ms(lambda inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu: chunk.chunk_lattice(
            *inp, pool, idx, cu, cu_seqlens_cpu=cu_cpu), dev)  # fmt: skip
        row["default"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        if lens == SZ["reference_lens"]:
            ms = median_ms(lambda inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu: reference.chunk_lattice(
                *inp, pool, idx, cu, cu_seqlens_cpu=cu_cpu), dev, warmup_ms=1, rep_ms=1)  # fmt: skip
            row["reference"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        res["prefill"][tag] = row
        say(f"prefill {tag}: {json.dumps(row)}")


def table(res: dict) -> str:
    lines = table_head(res)
    for k, v in res["checks"].items():
        if "y_rel" in v:
            lines.append(f"  {k:22s} y {v['y_rel']:.1e}  S {v['state_rel']:.1e}  untouched {v['untouched_equal']}")
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


def main(argv: list[str] | None = None) -> int:
    global SZ
    a, dev = script_args(argv, __doc__, "lattice")
    if dev is None:
        return 2
    if a.smoke:
        SZ = SMOKE
    H, d, m = SZ["Hdm"]
    res = environment(dev) | {
        "shapes": {"op": f"H={H} d={d} m={m} (lattice-110m), variant dec, fp32 states in a {SZ['pool']}-row pool at "
                         "random slots; fp32 q, k (the layer's L2 norm), bf16 v, fp32 gates",
                   "decode": f"B in {list(SZ['decode_batches'])}",
                   "prefill": "B=1 T=16384 and 8x4096 packed (cu_seqlens)",
                   "checks": f"decode B={SZ['check_B']}; prefill lens {SZ['check_lens']}"},
        "checks": {}, "decode": {}, "prefill": {}, "errors": [],
    }  # fmt: skip
    measure_hbm(res, dev, RUN)
    steps = [
        ("checks", lambda: check_correctness(dev, res)),
        ("op", lambda: time_op(dev, res)),
    ]
    return run_script(steps, res, Path(a.out) / "lattice.json", RUN, table, dev.type)


if __name__ == "__main__":
    sys.exit(main())
