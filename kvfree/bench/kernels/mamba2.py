"""Check and time the Mamba-2 (SSD) and short causal conv Triton ops on a CUDA GPU, in one run (2-3 min, H100).

    python -m kvfree.bench.kernels [--out docs/bench]   # writes docs/bench/kernels.json (the default --op, mamba2)
    python -m kvfree.bench.kernels --smoke              # the script itself, tiny sizes, CPU interpreter
    python -m kvfree.bench.kernels.mamba2 [--out DIR]   # the same as the first

(a) Correctness at real sizes against the float64 reference: H=16 P=128 N=128 (G=1 and G=H) and the mamba2-370m
    layer (H=32 P=64 N=128 G=1, conv width 2304); bf16 inputs (and one fp32 case), fp32 states in a 512-row pool at
    random slots, packed sequences of unequal lengths; relative errors, and the untouched rows checked unchanged.
(b) Medians from `triton.testing.do_bench`: the decode op at B=1/64/256 (and B=1 replayed from a CUDA graph), a
    block-size sweep at B=256, the chunked prefill at B=1 T=16384 and 8x4096 packed (chunk 64/128/256), the conv ops,
    the reference path for the same, and, when fla imports, `fused_recurrent_simple_gla` / `chunk_simple_gla` at the
    same shapes as anchors. HBM bandwidth is measured in the same run (a 2 GiB device-to-device copy, bytes read plus
    written); each decode time is reported against its floor, the fp32 state bytes read and written over it.

Writes DIR/kernels.json and prints a short table last; exits 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F

from kvfree.bench import harness
from kvfree.bench.kernels.common import first_call_s, fla_ops, lens_tag, random_slots, record
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
POOL = 512
# The sizes; --smoke swaps in tiny ones to run the script itself on the CPU under TRITON_INTERPRET=1.
REAL = {
    "check_lens": [1, 700, 64, 3, 2000, 129],
    "check_ssd": [  # name, H, P, N, G, dtype, chunk, dt_limit
        ("h16_g1_bf16", 16, 128, 128, 1, torch.bfloat16, 64, None),
        ("h16_g16_bf16", 16, 128, 128, 16, torch.bfloat16, 64, (0.0, float("inf"))),
        ("h16_g1_bf16_chunk256", 16, 128, 128, 1, torch.bfloat16, 256, None),
        ("m370_bf16", 32, 64, 128, 1, torch.bfloat16, 64, (1e-3, 0.1)),
        ("m370_fp32", 32, 64, 128, 1, torch.float32, 64, None),
    ],
    "check_conv": [  # name, channels, x dtype, tail dtype
        ("conv2304_bf16", 2304, torch.bfloat16, torch.bfloat16),
        ("conv2304_bf16_fp32tail", 2304, torch.bfloat16, torch.float32),
        ("conv4352_fp32", 4352, torch.float32, torch.float32),
    ],
    "HPN": (16, 128, 128),
    "decode_batches": (1, 64, 256),
    "prefill_plan": [  # (G, lens, chunk sizes, optional: skipped when over the time budget)
        (1, [16384], [64], False),
        (1, [4096] * 8, [64], False),
        (16, [16384], [64], False),
        (16, [4096] * 8, [64], False),
        (1, [16384], [128, 256], True),
        (1, [4096] * 8, [128, 256], True),
        (16, [16384], [128], True),
    ],
    "conv_width": 2304,
    "conv_lens": ([16384], [4096] * 8),
}
SMOKE = {
    "check_lens": [1, 40, 3, 17],
    "check_ssd": [
        ("tiny_bf16", 2, 16, 16, 1, torch.bfloat16, 16, None),
        ("tiny_fp32", 2, 16, 16, 2, torch.float32, 32, None),
    ],
    "check_conv": [("conv40_bf16", 40, torch.bfloat16, torch.float32)],
    "HPN": (2, 16, 16),
    "decode_batches": (1, 3, 8),
    "prefill_plan": [(1, [40], [16], False), (2, [20] * 2, [16, 32], True)],
    "conv_width": 40,
    "conv_lens": ([40], [20] * 2),
}
SZ = harness.Sizes(REAL, SMOKE)
SCRIPT = harness.CheckScript(
    "kernels", __doc__, SZ, sections=("decode", "prefill", "conv", "anchors"), script="kvfree.bench.kernels",
    flags=[("--budget-s", "seconds after which the optional parts (chunk-size sweep, fla anchors) are skipped",
            {"type": float, "default": 140.0}), ("--skip-fla", None)],
    smoke_sets=["--skip-fla"],
)  # fmt: skip
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels` calls it
say = SCRIPT.log.say
rel = harness.rel_err


@SCRIPT.shapes
def shapes() -> dict[str, str]:
    return {"decode": "H=16 P=128 N=128 G=1, bf16 x/B/C, fp32 state, pool 512 rows, random slots",
            "prefill": "H=16 P=128 N=128 G=1|16, bf16, B=1 T=16384 and 8x4096 packed (cu_seqlens)",
            "checks": "lens [1,700,64,3,2000,129]; H16/P128/N128 and mamba2-370m H32/P64/N128/G1",
            "conv": "C=2304 K=4 bf16"}  # fmt: skip


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ssd_inputs(T: int, H: int, P: int, N: int, G: int, dtype: torch.dtype, dev, gen) -> dict:
    """Layer-like inputs: x, B, C as strided views of one activation (as the layer splits them), raw dt."""
    xbc = torch.randn(T, H * P + 2 * G * N, generator=gen, device=dev).to(dtype)
    x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
    A = -torch.exp(torch.rand(H, generator=gen, device=dev) * 2.7)  # A_log in [0, 2.7]: A in [-15, -1]
    dt_bias = torch.log(torch.expm1(torch.exp(torch.rand(H, generator=gen, device=dev) * 4.6 - 6.9)))  # dt 1e-3..0.1
    return {
        "x": x.unflatten(-1, (H, P)),
        "dt": 0.5 * torch.randn(T, H, generator=gen, device=dev),
        "B": B.unflatten(-1, (G, N)),
        "C": C.unflatten(-1, (G, N)),
        "A": A,
        "D": torch.randn(H, generator=gen, device=dev),
        "dt_bias": dt_bias,
    }


def pool_and_slots(shape, n: int, dtype, dev, gen) -> tuple[torch.Tensor, torch.Tensor]:
    pool = torch.randn(POOL, *shape, generator=gen, device=dev).to(dtype)
    idx = random_slots(POOL, n, gen, dev)
    pool[idx[1::3].long()] = 0  # some fresh sessions
    return pool, idx


def as64(d: dict) -> dict:
    return {k: v.to(f64) for k, v in d.items()}


# ---------------------------------------------------------------------------------------------------------------------
@SCRIPT.step("checks")
def check_correctness(dev, res: dict) -> None:
    from kvfree.kernels.conv import chunk as cc
    from kvfree.kernels.conv import fused_recurrent as cf
    from kvfree.kernels.conv import reference as cr
    from kvfree.kernels.mamba2 import chunk as mc
    from kvfree.kernels.mamba2 import fused_recurrent as mf
    from kvfree.kernels.mamba2 import reference as mr

    with poisoned_outputs():  # an element a kernel does not write shows as NaN
        _check_all(dev, res, cc, cf, cr, mc, mf, mr)


def _check_all(dev, res, cc, cf, cr, mc, mf, mr) -> None:
    gen = torch.Generator(device=dev).manual_seed(1234)
    lens = SZ["check_lens"]
    cu = harness.cu_seqlens(lens, dev)
    cu_cpu = cu.tolist()
    T = sum(lens)
    for name, H, P, N, G, dtype, chunk, lim in SZ["check_ssd"]:
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        inp = ssd_inputs(T, H, P, N, G, dtype, dev, gen)
        args = (inp["x"], inp["dt"], inp["B"], inp["C"])
        params = (inp["A"], inp["D"], inp["dt_bias"])
        a64 = as64(inp)
        pool, idx = pool_and_slots((H, P, N), len(lens), torch.float32, dev, gen)
        before, ref_pool = pool.clone(), pool.to(f64)
        y = mc.chunk_mamba2(*args, pool, idx, cu, *params, lim, chunk, cu_seqlens_cpu=cu_cpu)
        harness.sync()
        y_ref = mr.chunk_mamba2(
            a64["x"], a64["dt"], a64["B"], a64["C"], ref_pool, idx, cu, a64["A"], a64["D"], a64["dt_bias"], lim, chunk
        )
        r = {
            "y_rel": rel(y, y_ref),
            "state_rel": rel(pool[idx.long()], ref_pool[idx.long()]),
            "untouched_equal": harness.untouched_equal(pool, before, idx),
        }
        # then one decode step on the same rows
        dinp = ssd_inputs(len(lens), H, P, N, G, dtype, dev, gen)
        d64 = as64(dinp)
        before = pool.clone()
        y = mf.fused_recurrent_mamba2(dinp["x"], dinp["dt"], dinp["B"], dinp["C"], pool, idx, dinp["A"], dinp["D"],
                                      dinp["dt_bias"], lim)
        harness.sync()
        y_ref = mr.fused_recurrent_mamba2(d64["x"], d64["dt"], d64["B"], d64["C"], ref_pool, idx, d64["A"], d64["D"],
                                          d64["dt_bias"], lim)
        r |= {
            "decode_y_rel": rel(y, y_ref),
            "decode_state_rel": rel(pool[idx.long()], ref_pool[idx.long()]),
            "decode_untouched_equal": harness.untouched_equal(pool, before, idx),
        }
        r["ok"] = bool(
            max(r["y_rel"], r["state_rel"], r["decode_y_rel"], r["decode_state_rel"]) <= tol
            and r["untouched_equal"] and r["decode_untouched_equal"]
        )
        record(res, SCRIPT.log, "checks", f"ssd_{name}", r, f"check ssd {name}")
        del inp, pool, before, ref_pool, y, y_ref
        empty_cache()

    for name, Cw, dtype, sdtype in SZ["check_conv"]:
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
        K = 4
        x = torch.randn(T, Cw + 8, generator=gen, device=dev).to(dtype)[:, 4 : Cw + 4]
        w = torch.randn(Cw, K, generator=gen, device=dev) * 0.5
        b = torch.randn(Cw, generator=gen, device=dev)
        pool, idx = pool_and_slots((K - 1, Cw), len(lens), sdtype, dev, gen)
        before, ref_pool = pool.clone(), pool.to(f64)
        y = cc.chunk_causal_conv1d(x, pool, idx, cu, w, b, "silu", cu_seqlens_cpu=cu_cpu)
        harness.sync()
        y_ref = cr.chunk_causal_conv1d(x.to(f64), ref_pool, idx, cu, w.to(f64), b.to(f64), "silu")
        r = {"y_rel": rel(y, y_ref), "tail_equal": bool(torch.equal(pool.to(f64), ref_pool)),
             "untouched_equal": harness.untouched_equal(pool, before, idx)}
        xd = torch.randn(len(lens), Cw, generator=gen, device=dev).to(dtype)
        before = pool.clone()
        y = cf.fused_recurrent_causal_conv1d(xd, pool, idx, w, b, "silu")
        harness.sync()
        y_ref = cr.fused_recurrent_causal_conv1d(xd.to(f64), ref_pool, idx, w.to(f64), b.to(f64), "silu")
        r |= {"decode_y_rel": rel(y, y_ref), "decode_tail_equal": bool(torch.equal(pool.to(f64), ref_pool)),
              "decode_untouched_equal": harness.untouched_equal(pool, before, idx)}
        r["ok"] = bool(max(r["y_rel"], r["decode_y_rel"]) <= tol and all(v for k, v in r.items() if "equal" in k))
        record(res, SCRIPT.log, "checks", name, r, f"check {name}")


# ---------------------------------------------------------------------------------------------------------------------
@SCRIPT.step("decode")
def time_decode(dev, res: dict) -> None:
    from kvfree.kernels.mamba2 import fused_recurrent as mf
    from kvfree.kernels.mamba2 import reference as mr

    (H, P, N), G = SZ["HPN"], 1
    gen = torch.Generator(device=dev).manual_seed(5)
    pool = torch.randn(POOL, H, P, N, generator=gen, device=dev) * 0.1
    for Bs in SZ["decode_batches"]:
        inp = ssd_inputs(Bs, H, P, N, G, torch.bfloat16, dev, gen)
        idx = random_slots(POOL, Bs, gen, dev)
        args = (inp["x"], inp["dt"], inp["B"], inp["C"], pool, idx, inp["A"], inp["D"], inp["dt_bias"], None)
        state_bytes = Bs * H * P * N * 4 * 2
        floor_us = state_bytes / res["hbm_copy_GBps"] / 1e3
        row = {"floor_us": floor_us}
        ms = harness.bench(lambda args=args: mf.fused_recurrent_mamba2(*args), dev, rep=200)
        row |= {"triton_us": ms * 1e3, "triton_GBps": state_bytes / ms / 1e6, "over_floor": ms * 1e3 / floor_us,
                "block_p": mf._block_p(Bs, H, P, N, dev)}
        ms = harness.bench(lambda args=args: mr.fused_recurrent_mamba2(*args), dev, rep=100)
        row["reference_us"] = ms * 1e3
        if Bs == 1 and dev.type == "cuda":
            mf.fused_recurrent_mamba2(*args)  # compiled and warm before capture
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    mf.fused_recurrent_mamba2(*args)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                mf.fused_recurrent_mamba2(*args)
            ms = harness.bench(graph.replay, dev, rep=200)
            row["triton_graph_us"] = ms * 1e3
            # ten steps in one graph: the per-step cost without the replay's own launch
            graph10 = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph10):
                for _ in range(10):
                    mf.fused_recurrent_mamba2(*args)
            row["triton_graph_per_step_of_10_us"] = harness.bench(graph10.replay, dev, rep=200) * 1e3 / 10
        if Bs == max(SZ["decode_batches"]):
            sweep = {}
            for bp, nw in [(8, 2), (8, 4), (16, 4), (16, 8), (32, 4), (32, 8)]:
                ms = harness.bench(lambda args=args, bp=bp, nw=nw: mf.launch(*args, block_p=bp, num_warps=nw), dev,
                                   rep=200)  # fmt: skip
                sweep[f"BP{bp}_w{nw}"] = ms * 1e3
            row["sweep_us"] = sweep
        record(res, SCRIPT.log, "decode", f"B{Bs}", row, f"decode B={Bs}")


@SCRIPT.step("prefill")
def time_prefill(dev, res: dict) -> None:
    from kvfree.kernels.mamba2 import chunk as mc
    from kvfree.kernels.mamba2 import reference as mr

    H, P, N = SZ["HPN"]
    gen = torch.Generator(device=dev).manual_seed(6)
    pool = torch.zeros(POOL, H, P, N, device=dev)
    for G, lens, chunks, optional in SZ["prefill_plan"]:
        T = sum(lens)
        inp = ssd_inputs(T, H, P, N, G, torch.bfloat16, dev, gen)
        cu = harness.cu_seqlens(lens, dev)
        cu_cpu = cu.tolist()
        idx = random_slots(POOL, len(lens), gen, dev)
        tag = f"G{G}_{lens_tag(lens)}"
        for L in chunks:
            if optional and time.time() - SCRIPT.log.start > SCRIPT.args.budget_s:
                say(f"prefill {tag} L={L}: skipped (time budget)")
                continue
            args = (inp["x"], inp["dt"], inp["B"], inp["C"], pool, idx, cu, inp["A"], inp["D"], inp["dt_bias"], None, L)
            first_s = first_call_s(lambda args=args, cu_cpu=cu_cpu: mc.chunk_mamba2(*args, cu_seqlens_cpu=cu_cpu))
            ms = harness.bench(lambda args=args, cu_cpu=cu_cpu: mc.chunk_mamba2(*args, cu_seqlens_cpu=cu_cpu), dev)
            row = {"ms": ms, "Mtok_s": T / ms / 1e3, "first_call_s": first_s,
                   "state_config": str(mc._chunk_state_kernel.best_config),
                   "out_config": str(mc._chunk_out_kernel.best_config)}
            if chunks.index(L) == 0 and G == 1:  # the reference once per shape
                ms_ref = harness.median_ms(lambda args=args, cu_cpu=cu_cpu: mr.chunk_mamba2(
                    *args, cu_seqlens_cpu=cu_cpu), dev, warmup_ms=5, rep_ms=20)  # fmt: skip
                row["reference_ms"] = ms_ref
                row["reference_Mtok_s"] = T / ms_ref / 1e3
            record(res, SCRIPT.log, "prefill", f"{tag}_L{L}", row, f"prefill {tag} L={L}")
        del inp
        empty_cache()


@SCRIPT.step("conv")
def time_conv(dev, res: dict) -> None:
    from kvfree.kernels.conv import chunk as cc
    from kvfree.kernels.conv import fused_recurrent as cf

    Cw, K = SZ["conv_width"], 4
    gen = torch.Generator(device=dev).manual_seed(7)
    w = torch.randn(Cw, K, generator=gen, device=dev).bfloat16()
    b = torch.randn(Cw, generator=gen, device=dev).bfloat16()
    pool = torch.randn(POOL, K - 1, Cw, generator=gen, device=dev).bfloat16()
    for lens in SZ["conv_lens"]:
        x = torch.randn(sum(lens), Cw, generator=gen, device=dev).bfloat16()
        cu = harness.cu_seqlens(lens, dev)
        idx = random_slots(POOL, len(lens), gen, dev)
        cu_cpu = cu.tolist()
        ms = harness.bench(lambda x=x, cu=cu, idx=idx, cu_cpu=cu_cpu: cc.chunk_causal_conv1d(
            x, pool, idx, cu, w, b, cu_seqlens_cpu=cu_cpu), dev)  # fmt: skip
        nbytes = 2 * x.numel() * 2
        res["conv"][f"prefill_{len(lens)}x{lens[0]}"] = {"us": ms * 1e3, "GBps": nbytes / ms / 1e6}
    for Bs in (1, max(SZ["decode_batches"])):
        x = torch.randn(Bs, Cw, generator=gen, device=dev).bfloat16()
        idx = random_slots(POOL, Bs, gen, dev)
        ms = harness.bench(lambda x=x, idx=idx: cf.fused_recurrent_causal_conv1d(x, pool, idx, w, b), dev, rep=200)
        res["conv"][f"decode_B{Bs}"] = {"us": ms * 1e3}
    say(f"conv: {json.dumps(res['conv'])}")


@SCRIPT.step("fla", unless="--skip-fla")
def time_fla(dev, res: dict) -> None:
    if time.time() - SCRIPT.log.start > SCRIPT.args.budget_s:
        res["anchors"]["fla"] = "skipped (time budget): rerun with a larger --budget-s"
        say(res["anchors"]["fla"])
        return
    ops = fla_ops(res, SCRIPT.log, "fla.ops.simple_gla.chunk_simple_gla",
                  "fla.ops.simple_gla.fused_recurrent_simple_gla")  # fmt: skip
    if ops is None:
        return
    chunk_simple_gla, fused_recurrent_simple_gla = ops
    H, K, V = 16, 128, 128
    for B, T in [(1, 16384), (8, 4096)]:
        q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
        k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).bfloat16()
        v = torch.randn(B, T, H, V, device=dev, dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(B, T, H, device=dev) + 4)
        ms = harness.bench(lambda q=q, k=k, v=v, g=g: chunk_simple_gla(q, k, v, g=g, output_final_state=True), dev)
        res["anchors"][f"fla_chunk_simple_gla_B{B}_T{T}"] = {"ms": ms, "Mtok_s": B * T / ms / 1e3}
        del q, k, v, g
    for B in (1, 64, 256):
        q = torch.randn(B, 1, H, K, device=dev, dtype=torch.bfloat16)
        k = F.normalize(torch.randn(B, 1, H, K, device=dev), dim=-1).bfloat16()
        v = torch.randn(B, 1, H, V, device=dev, dtype=torch.bfloat16)
        g = F.logsigmoid(torch.randn(B, 1, H, device=dev) + 4)
        h0 = torch.randn(B, H, K, V, device=dev)
        ms = harness.bench(lambda q=q, k=k, v=v, g=g, h0=h0: fused_recurrent_simple_gla(
            q, k, v, g=g, initial_state=h0, output_final_state=True), dev, rep=200)  # fmt: skip
        res["anchors"][f"fla_fused_recurrent_simple_gla_B{B}"] = {"us": ms * 1e3,
                                                                   "state_GBps": h0.numel() * 8 / ms / 1e6}
    torch.cuda.empty_cache()
    say(f"fla anchors: {json.dumps(res['anchors'])}")


@SCRIPT.table
def table(res: dict) -> str:
    nan = float("nan")
    lines = harness.table_head(res, line=lambda k, v: f"  {k:26s} y {v.get('y_rel', nan):.1e}  decode y "
                               f"{v.get('decode_y_rel', nan):.1e}  state {v.get('state_rel', 0):.1e}  untouched ok "
                               f"{v.get('untouched_equal')}")  # fmt: skip
    anc = res["anchors"]
    lines.append(f"{'decode H16 P128 N128':22s} {'triton us':>10s} {'floor':>7s} {'x floor':>8s} {'ref us':>8s} "
                 f"{'fla us':>7s}")
    for k, v in res["decode"].items():
        fla_us = anc.get(f"fla_fused_recurrent_simple_gla_{k}", {}).get("us", nan)
        line = f"  {k:20s} {v['triton_us']:10.1f} {v['floor_us']:7.1f} {v['over_floor']:8.2f} "
        line += f"{v['reference_us']:8.1f} {fla_us:7.1f}"
        if "triton_graph_us" in v:
            line += f"   graph {v['triton_graph_us']:.1f} (per step of 10: {v['triton_graph_per_step_of_10_us']:.1f})"
        lines.append(line)
    for k, v in res["decode"].items():
        if "sweep_us" in v:
            lines.append(f"  {k} sweep us: " + ", ".join(f"{c} {u:.1f}" for c, u in v["sweep_us"].items()))
    lines.append(f"{'prefill (bf16)':28s} {'ms':>8s} {'Mtok/s':>8s} {'ref Mtok/s':>11s}")
    for k, v in res["prefill"].items():
        lines.append(f"  {k:26s} {v['ms']:8.3f} {v['Mtok_s']:8.1f} {v.get('reference_Mtok_s', nan):11.2f}")
    for k, v in anc.items():
        if k.startswith("fla_chunk"):
            lines.append(f"  {k:26s} {v['ms']:8.3f} {v['Mtok_s']:8.1f}")
    if res["conv"]:
        lines.append("conv (C=2304 bf16): " + ", ".join(f"{k} {v['us']:.1f} us" for k, v in res["conv"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
