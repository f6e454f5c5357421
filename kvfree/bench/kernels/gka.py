"""Check and time the Gated KalmaNet Triton kernels on a CUDA GPU, in one run (about 3 minutes on an H100).

    python -m kvfree.bench.kernels.gka --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)
    python -m kvfree.bench.kernels --op gka --out DIR  (the same)

(a) Correctness at real sizes (He=16, D=Dv=128, 30 Chebyshev steps, a = 0.02, fp32 pools of 512 rows, random slots,
    every third session fresh) against the float64 reference, every buffer the kernels allocate poisoned with NaN
    first: the decode step at B=64 with fp32 and bf16 inputs, and the chunked prefill of packed sequences of lengths
    1, 63, 64, 65, 200, 700 and 2000 with fp32 and bf16 inputs; relative errors of outputs and states, rows not named
    bit-identical. The decode step captured in a CUDA graph and replayed on new inputs matches eager.
(b) Medians from `triton.testing.do_bench`: decode at B=1/64/256 (bf16 q, k, v; B=1 also replayed from a CUDA
    graph of 10 steps, per step), with a block/warp sweep; prefill at B=1 T=16384 and 8x4096 packed, bf16 and fp32
    inputs, with a chunk/row-block sweep; the PyTorch reference at the same shapes; and, when fla imports, its
    MesaNet kernels (conjugate gradient, 30 steps) at the same shapes as anchors. The decode floor is the fp32 H and
    S bytes read and written over a device-to-device copy's bandwidth measured in the same run.

Writes DIR/gka.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvfree.bench.harness import (
    RunLog,
    bench,
    cu_seqlens,
    decode_timings,
    environment,
    graph_matches_eager,
    measure_hbm,
    profile_device_us,
    rel_err,
    run_script,
    script_args,
    sync,
    table_head,
    untouched_equal,
)
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
RIDGE, ITERS = 0.02, 30
REAL = {
    "HDV": (16, 128, 128),
    "pool": 512,
    "check_B": 64,
    "check_lens": [1, 63, 64, 65, 200, 700, 2000],
    "decode_batches": (1, 64, 256),
    "decode_sweep": [(128, 4), (128, 8), (32, 2), (32, 4), (32, 8), (16, 4), (64, 4)],  # (block_v, num_warps)
    "prefill_lens": ([16384], [4096] * 8),
    # (chunk, block_m, warps); the first is the default's
    "prefill_sweep": [(32, 32, 4), (32, 32, 8), (32, 32, 2), (16, 16, 4), (16, 16, 2), (64, 64, 4), (64, 32, 4)],
    "reference_lens": [4096],
}
SMOKE = {
    "HDV": (2, 16, 32),
    "pool": 12,
    "check_B": 5,
    "check_lens": [1, 15, 16, 17, 40],
    "decode_batches": (1, 3),
    "decode_sweep": [(16, 4)],
    "prefill_lens": ([40], [20] * 2),
    "prefill_sweep": [(16, 16, 4)],
    "reference_lens": [40],
}
SZ = REAL
RUN = RunLog()
say = RUN.say
rel = rel_err


def gka_inputs(n: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    """Layer-like op inputs for n tokens: unit q, keys of norm beta in (0, 1), values times beta, decays that keep
    a few hundred tokens of memory, alpha in (0, 1)."""
    He, D, Dv = SZ["HDV"]
    beta = torch.rand(n, He, 1, generator=gen, device=dev)
    q = F.normalize(torch.randn(n, He, D, generator=gen, device=dev), dim=-1)
    k = F.normalize(torch.randn(n, He, D, generator=gen, device=dev), dim=-1) * beta
    v = torch.randn(n, He, Dv, generator=gen, device=dev) * beta
    g = -0.02 * torch.rand(n, He, generator=gen, device=dev) * torch.rand(1, He, generator=gen, device=dev) * 5
    alpha = torch.rand(n, He, generator=gen, device=dev)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, alpha]


def pools(dev: torch.device, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 pools with PSD H rows (as a running sum of k k^T is), and n distinct random rows, every third fresh."""
    He, D, Dv = SZ["HDV"]
    S = SZ["pool"]
    root = torch.randn(S, He, D, D, generator=gen, device=dev) / D
    h = root @ root.transpose(-1, -2) * 4
    s = torch.randn(S, He, D, Dv, generator=gen, device=dev) * 0.5
    idx = torch.randperm(S, generator=gen, device=dev)[:n].to(torch.int32)
    h[idx[1::3].long()] = 0
    s[idx[1::3].long()] = 0
    return h, s, idx


def check_row(o: torch.Tensor, o_ref: torch.Tensor, h: tuple, s: tuple, idx: torch.Tensor, tol: float) -> dict:
    """Relative errors of the output and of the named pool rows (`h`, `s`: pool, float64 reference pool, pool
    before), whether the other rows are unchanged, and whether all of it is within `tol`."""
    i = idx.long()
    row = {"o_rel": rel(o, o_ref), "h_rel": rel(h[0][i], h[1][i]), "s_rel": rel(s[0][i], s[1][i]),
           "untouched_equal": untouched_equal(h[0], h[2], idx) and untouched_equal(s[0], s[2], idx)}  # fmt: skip
    row["ok"] = row["untouched_equal"] and max(row["o_rel"], row["h_rel"], row["s_rel"]) <= tol
    return row


def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.gka import chunk, fused_recurrent, reference

    He, D, Dv = SZ["HDV"]
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(1)
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        B = SZ["check_B"]
        inp = gka_inputs(B, dtype, dev, gen)
        h, s, idx = pools(dev, gen, B)
        h_ref, s_ref = h.to(f64), s.to(f64)
        h0, s0 = h.clone(), s.clone()
        with poisoned_outputs():
            o = fused_recurrent.fused_recurrent_gka(*inp, h, s, idx, RIDGE, ITERS, scale)
        o_ref = reference.fused_recurrent_gka(*(t.to(f64) for t in inp), h_ref, s_ref, idx, RIDGE, ITERS, scale)
        row = check_row(o, o_ref, (h, h_ref, h0), (s, s_ref, s0), idx, tol[dtype])
        res["checks"][f"decode_B{B}_{name}"] = row
        say(f"check decode {name}: {json.dumps(row)}")

        lens = SZ["check_lens"]
        cu = cu_seqlens(lens, dev)
        inp = gka_inputs(sum(lens), dtype, dev, gen)
        h, s, idx = pools(dev, gen, len(lens))
        h_ref, s_ref = h.to(f64), s.to(f64)
        h0, s0 = h.clone(), s.clone()
        with poisoned_outputs():
            o = chunk.chunk_gka(*inp, h, s, idx, cu, RIDGE, ITERS, scale, 64, cu_seqlens_cpu=cu.tolist())
        o_ref = reference.chunk_gka(*(t.to(f64) for t in inp), h_ref, s_ref, idx, cu, RIDGE, ITERS, scale, 64)
        row = check_row(o, o_ref, (h, h_ref, h0), (s, s_ref, s0), idx, tol[dtype])
        res["checks"][f"prefill_{name}"] = row
        say(f"check prefill {name}: {json.dumps(row)}")
        sync()

    if dev.type == "cuda":  # the decode step inside a CUDA graph, replayed on new inputs
        B = SZ["check_B"]
        inp = gka_inputs(B, torch.bfloat16, dev, gen)
        h, s, idx = pools(dev, gen, B)
        ok = graph_matches_eager(lambda st: fused_recurrent.fused_recurrent_gka(*inp, *st, idx, RIDGE, ITERS, scale),
                                 [h, s], inp, lambda: gka_inputs(B, torch.bfloat16, dev, gen))  # fmt: skip
        res["checks"]["decode_cuda_graph"] = {"ok": ok, "equal_to_eager": ok}
        say(f"check decode graph replay equals eager: {ok}")


def time_decode(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.gka import fused_recurrent, reference

    He, D, Dv = SZ["HDV"]
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(2)
    h, s, _ = pools(dev, gen, 1)
    for B in SZ["decode_batches"]:
        inp = gka_inputs(B, torch.bfloat16, dev, gen)
        idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[:B].to(torch.int32)
        args = (*inp, h, s, idx, RIDGE, ITERS, scale)
        state_bytes = B * He * (D * D + D * Dv) * 4 * 2
        sweep = {f"BV{bv}_w{nw}": lambda args=args, bv=bv, nw=nw: fused_recurrent.launch(
            *args, block_v=bv, num_warps=nw) for bv, nw in SZ["decode_sweep"]}  # fmt: skip
        row = decode_timings(lambda args=args: fused_recurrent.fused_recurrent_gka(*args),
                             lambda args=args: reference.fused_recurrent_gka(*args), sweep, state_bytes,
                             res["hbm_copy_GBps"], dev, graph=B == 1)  # fmt: skip
        row["state_GBps"] = state_bytes / row["triton_us"] / 1e3
        res["decode"][f"B{B}"] = row
        say(f"decode B={B}: {json.dumps(row)}")


def time_prefill(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.gka import chunk, reference

    He, D, Dv = SZ["HDV"]
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(3)
    h, s, _ = pools(dev, gen, 1)
    for lens in SZ["prefill_lens"]:
        T = sum(lens)
        tag = f"B1_T{T}" if len(lens) == 1 else f"{len(lens)}x{lens[0]}"
        cu = cu_seqlens(lens, dev)
        cu_cpu = cu.tolist()
        idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[: len(lens)].to(torch.int32)
        for dtype in (torch.bfloat16, torch.float32):
            inp = gka_inputs(T, dtype, dev, gen)
            name = f"{tag}_{str(dtype).removeprefix('torch.')}"
            row = {}
            configs = SZ["prefill_sweep"] if dtype == torch.bfloat16 else SZ["prefill_sweep"][:1]
            for L, bm, nw in configs:
                def run(L=L, bm=bm, nw=nw, inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu):
                    return chunk.launch(*inp, h, s, idx, cu, RIDGE, ITERS, scale, cu_seqlens_cpu=cu_cpu,
                                        block_m=bm, warps_out=nw, chunk_len=L)  # fmt: skip

                t = time.time()
                run()
                sync()
                first = time.time() - t
                ms = bench(run, dev, rep=100)
                row[f"L{L}_BM{bm}_w{nw}"] = {"ms": ms, "Mtok_s": T / ms / 1e3, "first_call_s": first}
            ms = bench(
                lambda inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu: chunk.chunk_gka(
                    *inp, h, s, idx, cu, RIDGE, ITERS, scale, 64, cu_seqlens_cpu=cu_cpu), dev, rep=100,
            )  # fmt: skip
            row["default"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
            res["prefill"][name] = row
            say(f"prefill {name}: {json.dumps(row)}")
            del inp
    for n in SZ["reference_lens"]:
        inp = gka_inputs(n, torch.bfloat16, dev, gen)
        cu = cu_seqlens([n], dev)
        idx = torch.zeros(1, dtype=torch.int32, device=dev)
        ms = bench(lambda inp=inp, cu=cu, idx=idx, n=n: reference.chunk_gka(
            *inp, h, s, idx, cu, RIDGE, ITERS, scale, 64, cu_seqlens_cpu=[0, n]), dev, rep=50)  # fmt: skip
        res["prefill"][f"reference_B1_T{n}"] = {"ms": ms, "Mtok_s": n / ms / 1e3}
        say(f"prefill reference T={n}: {ms:.2f} ms")
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def profile_kernels(dev: torch.device, res: dict) -> None:
    """Device time per kernel of one default prefill (B=1 T=16384, bf16) and one decode step at the largest batch
    (torch profiler, a few calls after warm-up): which launch the time goes to."""
    from kvfree.kernels.gka import chunk, fused_recurrent

    He, D, Dv = SZ["HDV"]
    gen = torch.Generator(device=dev).manual_seed(5)
    h, s, _ = pools(dev, gen, 1)
    T = SZ["prefill_lens"][0][0]
    B = max(SZ["decode_batches"])
    pre = gka_inputs(T, torch.bfloat16, dev, gen)
    cu = cu_seqlens([T], dev)
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    dec = gka_inputs(B, torch.bfloat16, dev, gen)
    idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[:B].to(torch.int32)
    calls = {
        "prefill": lambda: chunk.chunk_gka(*pre, h, s, one, cu, RIDGE, ITERS, D**-0.5, 64, cu_seqlens_cpu=[0, T]),
        "decode": lambda: fused_recurrent.fused_recurrent_gka(*dec, h, s, idx, RIDGE, ITERS, D**-0.5),
    }
    profile_device_us(calls, res["profile"], RUN)


def time_fla(dev: torch.device, res: dict) -> None:
    """fla's MesaNet (conjugate gradient) kernels at the same shapes, as anchors."""
    try:
        import fla
        from fla.ops.mesa_net import chunk_mesa_net
        from fla.ops.mesa_net.decoding_one_step import mesa_net_decoding_one_step
    except Exception as e:  # not installed here
        res["anchors"]["fla"] = f"not importable: {e!r}"[:300]
        say(res["anchors"]["fla"])
        return
    res["anchors"]["fla_version"] = getattr(fla, "__version__", "?")
    He, D, Dv = SZ["HDV"]
    gen = torch.Generator(device=dev).manual_seed(4)
    lamb = F.softplus(torch.rand(He, D, generator=gen, device=dev)) + 0.25
    for lens in SZ["prefill_lens"]:
        B, T = len(lens), lens[0]
        q, k, v, g, _ = gka_inputs(B * T, torch.bfloat16, dev, gen)
        q, k, v, g = (t.unflatten(0, (B, T)) for t in (q, k, v, g))
        beta = torch.rand(B, T, He, generator=gen, device=dev).sigmoid()
        ms = bench(lambda q=q, k=k, v=v, g=g, beta=beta: chunk_mesa_net(
            q, k, v, g, beta, lamb, output_final_state=True, max_CG_iteration=ITERS), dev, rep=100)  # fmt: skip
        res["anchors"][f"fla_chunk_mesa_net_B{B}_T{T}"] = {"ms": ms, "Mtok_s": B * T / ms / 1e3}
    for B in SZ["decode_batches"]:
        q, k, v, g, _ = gka_inputs(B, torch.bfloat16, dev, gen)
        beta = torch.rand(B, He, generator=gen, device=dev).sigmoid()
        hkk = torch.randn(B, He, D, D, generator=gen, device=dev)
        hkv = torch.randn(B, He, D, Dv, generator=gen, device=dev)
        ms = bench(lambda q=q, k=k, v=v, g=g, beta=beta, hkk=hkk, hkv=hkv: mesa_net_decoding_one_step(
            q, k, v, g, lamb, beta, hkk, hkv, max_CG_iteration=ITERS), dev, rep=100)  # fmt: skip
        res["anchors"][f"fla_mesa_net_decoding_one_step_B{B}"] = {"us": ms * 1e3}
    say(f"fla anchors: {json.dumps(res['anchors'])}")


# hybrid-model-factory's vLLM plugin's GKA decode kernel on an H100 (fp32 H and S in a slot pool, H=16, D=128, 30
# iterations), measured by the team before this work; its chunked prefill did not compile under triton 3.6.
HMF_DECODE_US = {1: 30.7, 64: 193.0, 256: 646.4}


def table(res: dict) -> str:
    nan = float("nan")
    lines = table_head(res)
    for k, v in res["checks"].items():
        if "o_rel" in v:
            lines.append(f"  {k:22s} o {v['o_rel']:.1e}  h {v['h_rel']:.1e}  s {v['s_rel']:.1e}  "
                         f"untouched {v['untouched_equal']}")  # fmt: skip
    anc = res["anchors"]
    lines.append(f"{'decode He16 D128 r30':22s} {'us':>8s} {'floor':>7s} {'x floor':>8s} {'hmf us':>7s} "
                 f"{'fla us':>7s} {'ref us':>8s}")  # fmt: skip
    for k, v in res["decode"].items():
        B = int(k[1:])
        fla_us = anc.get(f"fla_mesa_net_decoding_one_step_{k}", {}).get("us", nan)
        lines.append(f"  {k:20s} {v['triton_us']:8.1f} {v['floor_us']:7.1f} {v['over_floor']:8.2f} "
                     f"{HMF_DECODE_US.get(B, nan):7.1f} {fla_us:7.1f} {v['reference_us']:8.1f}")  # fmt: skip
        lines.append("    sweep: " + ", ".join(f"{c} {u:.1f}" for c, u in v["sweep_us"].items()))
    lines.append(f"{'prefill':28s} {'ms':>8s} {'Mtok/s':>8s}")
    for k, v in res["prefill"].items():
        if "default" in v:
            lines.append(f"  {k:26s} {v['default']['ms']:8.3f} {v['default']['Mtok_s']:8.2f}   sweep Mtok/s: "
                         + ", ".join(f"{c} {r['Mtok_s']:.2f}" for c, r in v.items() if c != "default"))  # fmt: skip
        else:
            lines.append(f"  {k:26s} {v['ms']:8.3f} {v['Mtok_s']:8.2f}")
    for k, v in anc.items():
        if k.startswith("fla_chunk"):
            lines.append(f"  {k:26s} {v['ms']:8.3f} {v['Mtok_s']:8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global SZ
    a, dev = script_args(argv, __doc__, "gka", ("--skip-fla", None))
    if dev is None:
        return 2
    if a.smoke:
        SZ, a.skip_fla = SMOKE, True
    He, D, Dv = SZ["HDV"]
    res = environment(dev) | {
        "shapes": {"op": f"He={He} D={D} Dv={Dv}, {ITERS} Chebyshev steps, a={RIDGE}, fp32 H and S in a "
                         f"{SZ['pool']}-row pool at random slots",
                   "decode": f"bf16 q, k, v; B in {list(SZ['decode_batches'])}",
                   "prefill": "B=1 T=16384 and 8x4096 packed (cu_seqlens), bf16 and fp32 inputs",
                   "checks": f"decode B={SZ['check_B']}; prefill lens {SZ['check_lens']}"},
        "checks": {}, "decode": {}, "prefill": {}, "profile": {}, "anchors": {}, "errors": [],
    }  # fmt: skip
    measure_hbm(res, dev, RUN)
    steps = [
        ("checks", lambda: check_correctness(dev, res)),
        ("decode", lambda: time_decode(dev, res)),
        ("prefill", lambda: time_prefill(dev, res)),
    ]
    if dev.type == "cuda":
        steps.append(("profile", lambda: profile_kernels(dev, res)))
    if not a.skip_fla:
        steps.append(("fla", lambda: time_fla(dev, res)))
    return run_script(steps, res, Path(a.out) / "gka.json", RUN, table, dev.type)


if __name__ == "__main__":
    sys.exit(main())
