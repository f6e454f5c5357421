"""Check and time the Gated DeltaNet Triton kernels on a CUDA GPU, in one run (a few minutes on an H100).

    python -m kvfree.bench.kernels.gdn --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)
    python -m kvfree.bench.kernels --op gdn --out DIR  (the same)

(a) Correctness at real sizes (H=32, D=Dv=128, fp32 pool of 512 rows at random slots, every third session fresh)
    against the float64 reference, every buffer the kernels allocate poisoned with NaN first: the decode step at B=64
    with fp32 and bf16 inputs, and the chunked prefill of packed sequences of lengths 1, 63, 64, 65, 200, 700 and 2000
    (an empty one among them) with fp32 and bf16 inputs; relative errors of outputs and states, rows not named
    bit-identical. The decode step captured in a CUDA graph and replayed on new inputs matches eager.
(b) Medians from `triton.testing.do_bench`: decode at B=1/64/256 (bf16 q, k, v; B=1 also replayed from a CUDA graph
    of 10 steps, per step) against its floor (the fp32 state read and written once, plus the inputs and outputs,
    over a device-to-device copy's bandwidth measured in the same run), with a BV/num_warps sweep at every B.
(c) The chunked prefill at B=1 T=16384 and 8x4096 packed, bf16 (with a sweep of `chunk.launch`'s block shapes,
    warps and pipelining) and fp32 inputs, in tokens/s; the PyTorch reference at T=4096; per-kernel
    device times.
(d) When fla imports: its `chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule` at the same shapes
    ([B, T, H, D] layouts, q and k pre-normalised, `cu_seqlens` for the packed batch), as anchors, with the ratios,
    and the relative difference of its outputs from ours on the same inputs.

Writes DIR/gdn.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvfree.bench.harness import (
    Goal,
    RunLog,
    bench,
    cu_seqlens,
    decode_timings,
    environment,
    goal_rows,
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
# Prefill sweep entries: keyword arguments of `chunk.launch`; the first is the default's.
PREFILL_SWEEP = [
    {},
    {"block_v": 16},
    {"block_v": 64},
    {"block_v": 64, "warps_pass": 8},
    {"warps_pass": 8},
    {"warps_pass": 2},
    {"num_stages": 3},
    {"block_o": 128, "warps_out": 8},
    {"block_o": 32},
    {"warps_out": 8},
    {"warps_wy": 8},
]
REAL = {
    "HDV": (32, 128, 128),
    "pool": 512,
    "chunk": 64,
    "check_B": 64,
    "check_lens": [1, 63, 64, 0, 65, 200, 700, 2000],
    "decode_batches": (1, 64, 256),
    "decode_sweep": [(16, 2), (16, 4), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)],  # (block_v, warps)
    "prefill_lens": ([16384], [4096] * 8),
    "prefill_sweep": PREFILL_SWEEP,
    "reference_lens": [4096],
}
SMOKE = {
    "HDV": (2, 16, 16),
    "pool": 12,
    "chunk": 16,
    "check_B": 5,
    "check_lens": [1, 15, 16, 0, 17, 40],
    "decode_batches": (1, 3),
    "decode_sweep": [(16, 4)],
    "prefill_lens": ([40], [20] * 2),
    "prefill_sweep": PREFILL_SWEEP[:2],
    "reference_lens": [40],
}
SZ = REAL
GOALS = [
    Goal("cuda", "decode_B256_over_floor", "<=", 1.2, "decode step at B=256 over its HBM floor (x)"),
    Goal("cuda", "prefill_B1_T16384_over_fla", ">=", 1.0, "prefill B=1 T=16384 bf16, tokens/s over fla's chunk op"),
    Goal("cuda", "prefill_8x4096_over_fla", ">=", 1.0, "prefill 8x4096 packed bf16, tokens/s over fla's chunk op"),
]
RUN = RunLog()
say = RUN.say
rel = rel_err


def gdn_inputs(n: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    """Op inputs for n tokens as the mixer hands them over: L2-normalised q and k and values in `dtype`, fp32 log
    decays in [-0.2, 0] scaled per head (memories of a few to a few hundred tokens), fp32 write strengths in (0, 1)."""
    H, D, Dv = SZ["HDV"]
    q = F.normalize(torch.randn(n, H, D, generator=gen, device=dev), dim=-1)
    k = F.normalize(torch.randn(n, H, D, generator=gen, device=dev), dim=-1)
    v = torch.randn(n, H, Dv, generator=gen, device=dev)
    g = -0.2 * torch.rand(n, H, generator=gen, device=dev) * torch.rand(1, H, generator=gen, device=dev)
    beta = torch.rand(n, H, generator=gen, device=dev)
    return [q.to(dtype), k.to(dtype), v.to(dtype), g, beta]


def pool(dev: torch.device, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 state pool and n distinct random rows of it, every third fresh (zeros)."""
    H, D, Dv = SZ["HDV"]
    s = torch.randn(SZ["pool"], H, D, Dv, generator=gen, device=dev) * 0.5
    idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[:n].to(torch.int32)
    s[idx[1::3].long()] = 0
    return s, idx


def check_row(o: torch.Tensor, o_ref: torch.Tensor, s: torch.Tensor, s_ref: torch.Tensor, s0: torch.Tensor,
              idx: torch.Tensor, tol: float) -> dict:  # fmt: skip
    """Relative errors of the output and of the named pool rows, whether the other rows are unchanged (`s0`: the pool
    before), and whether all of it is within `tol`."""
    i = idx.long()
    row = {"o_rel": rel(o, o_ref), "s_rel": rel(s[i], s_ref[i]), "untouched_equal": untouched_equal(s, s0, idx)}
    row["ok"] = row["untouched_equal"] and max(row["o_rel"], row["s_rel"]) <= tol
    return row


def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.gdn import chunk, fused_recurrent, reference

    H, D, Dv = SZ["HDV"]
    scale = D**-0.5
    L = SZ["chunk"]
    gen = torch.Generator(device=dev).manual_seed(1)
    # fp32: a few 1e-7 expected (tf32x3 dots); bf16: the outputs' own rounding (~2e-3) plus the rounding of the
    # chunk-start states and U' to bf16 between launches (the states themselves stay within ~1e-5).
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
    prefill_tol = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2}  # bf16 dot operands, as fla's (chunk.py's docstring)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        B = SZ["check_B"]
        inp = gdn_inputs(B, dtype, dev, gen)
        s, idx = pool(dev, gen, B)
        s_ref, s0 = s.to(f64), s.clone()
        with poisoned_outputs():
            o = fused_recurrent.fused_recurrent_gdn(*inp, s, idx, scale)
        o_ref = reference.fused_recurrent_gdn(*(t.to(f64) for t in inp), s_ref, idx, scale)
        row = check_row(o, o_ref, s, s_ref, s0, idx, tol[dtype])
        res["checks"][f"decode_B{B}_{name}"] = row
        say(f"check decode {name}: {json.dumps(row)}")

        lens = SZ["check_lens"]
        cu = cu_seqlens(lens, dev)
        inp = gdn_inputs(sum(lens), dtype, dev, gen)
        s, idx = pool(dev, gen, len(lens))
        s_ref, s0 = s.to(f64), s.clone()
        o_ref = reference.chunk_gdn(*(t.to(f64) for t in inp), s_ref, idx, cu, scale, L)
        with poisoned_outputs():
            o = chunk.launch(*inp, s, idx, cu, scale, L, cu_seqlens_cpu=cu.tolist())
        row = check_row(o, o_ref, s, s_ref, s0, idx, prefill_tol[dtype])
        res["checks"][f"prefill_{name}"] = row
        say(f"check prefill {name}: {json.dumps(row)}")
        sync()

    if dev.type == "cuda":  # the decode step inside a CUDA graph, replayed on new inputs
        B = SZ["check_B"]
        inp = gdn_inputs(B, torch.bfloat16, dev, gen)
        s, idx = pool(dev, gen, B)
        ok = graph_matches_eager(lambda st: fused_recurrent.fused_recurrent_gdn(*inp, *st, idx, scale), [s], inp,
                                 lambda: gdn_inputs(B, torch.bfloat16, dev, gen))  # fmt: skip
        res["checks"]["decode_cuda_graph"] = {"ok": ok, "equal_to_eager": ok}
        say(f"check decode graph replay equals eager: {ok}")


def time_decode(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.gdn import fused_recurrent, reference

    H, D, Dv = SZ["HDV"]
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(2)
    s, _ = pool(dev, gen, 1)
    for B in SZ["decode_batches"]:
        inp = gdn_inputs(B, torch.bfloat16, dev, gen)
        idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[:B].to(torch.int32)
        args = (*inp, s, idx, scale)
        # The state read and written once, plus q, k, v in, o out (bf16) and g, beta (fp32).
        moved = B * H * (D * Dv * 4 * 2 + (2 * D + 2 * Dv) * 2 + 8)
        sweep = {f"BV{bv}_w{nw}": lambda args=args, bv=bv, nw=nw: fused_recurrent.launch(
            *args, block_v=bv, num_warps=nw) for bv, nw in SZ["decode_sweep"]}  # fmt: skip
        row = decode_timings(lambda args=args: fused_recurrent.fused_recurrent_gdn(*args),
                             lambda args=args: reference.fused_recurrent_gdn(*args), sweep, moved,
                             res["hbm_copy_GBps"], dev, graph=B == 1)  # fmt: skip
        row["GBps"] = moved / row["triton_us"] / 1e3
        row["best_sweep_over_floor"] = min(row["sweep_us"].values()) / row["floor_us"]
        res["decode"][f"B{B}"] = row
        say(f"decode B={B}: {json.dumps(row)}")
    res["goals_values"]["decode_B256_over_floor"] = res["decode"].get("B256", {}).get("over_floor")


def _knob_tag(knobs: dict) -> str:
    return "default" if not knobs else "_".join(f"{k}={v}" for k, v in knobs.items())


def time_prefill(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.gdn import chunk, reference

    H, D, Dv = SZ["HDV"]
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(3)
    s, _ = pool(dev, gen, 1)
    for lens in SZ["prefill_lens"]:
        T = sum(lens)
        tag = f"B1_T{T}" if len(lens) == 1 else f"{len(lens)}x{lens[0]}"
        cu = cu_seqlens(lens, dev)
        cu_cpu = cu.tolist()
        idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[: len(lens)].to(torch.int32)
        for dtype in (torch.bfloat16, torch.float32):
            inp = gdn_inputs(T, dtype, dev, gen)
            name = f"{tag}_{str(dtype).removeprefix('torch.')}"
            row = {}
            configs = SZ["prefill_sweep"] if dtype == torch.bfloat16 else SZ["prefill_sweep"][:1]
            for knobs in configs:
                def run(knobs=knobs, inp=inp, idx=idx, cu=cu, cu_cpu=cu_cpu):
                    return chunk.launch(*inp, s, idx, cu, scale, SZ["chunk"], cu_seqlens_cpu=cu_cpu, **knobs)

                try:
                    t = time.time()
                    run()
                    sync()
                    first = time.time() - t
                    ms = bench(run, dev, rep=100)
                    row[_knob_tag(knobs)] = {"ms": ms, "Mtok_s": T / ms / 1e3, "first_call_s": first}
                except Exception as e:  # a config that does not compile (shared memory, registers) is reported
                    row[_knob_tag(knobs)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            res["prefill"][name] = row
            say(f"prefill {name}: {json.dumps(row)}")
            del inp
    for n in SZ["reference_lens"]:
        inp = gdn_inputs(n, torch.bfloat16, dev, gen)
        cu = cu_seqlens([n], dev)
        idx = torch.zeros(1, dtype=torch.int32, device=dev)
        ms = bench(lambda inp=inp, cu=cu, idx=idx, n=n: reference.chunk_gdn(
            *inp, s, idx, cu, scale, 64, cu_seqlens_cpu=[0, n]), dev, rep=50)  # fmt: skip
        res["prefill"][f"reference_B1_T{n}"] = {"ms": ms, "Mtok_s": n / ms / 1e3}
        say(f"prefill reference T={n}: {ms:.2f} ms")
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def profile_kernels(dev: torch.device, res: dict) -> None:
    """Device time per kernel of one default prefill (B=1 T=16384, bf16) and one decode step at the largest batch
    (torch profiler, a few calls after warm-up): which launch the time goes to."""
    from kvfree.kernels.gdn import chunk, fused_recurrent

    H, D, Dv = SZ["HDV"]
    gen = torch.Generator(device=dev).manual_seed(5)
    s, _ = pool(dev, gen, 1)
    T = SZ["prefill_lens"][0][0]
    B = max(SZ["decode_batches"])
    pre = gdn_inputs(T, torch.bfloat16, dev, gen)
    cu = cu_seqlens([T], dev)
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    dec = gdn_inputs(B, torch.bfloat16, dev, gen)
    idx = torch.randperm(SZ["pool"], generator=gen, device=dev)[:B].to(torch.int32)
    calls = {
        "prefill": lambda: chunk.chunk_gdn(*pre, s, one, cu, D**-0.5, 64, cu_seqlens_cpu=[0, T]),
        "decode": lambda: fused_recurrent.fused_recurrent_gdn(*dec, s, idx, D**-0.5),
    }
    profile_device_us(calls, res["profile"], RUN)


def time_fla(dev: torch.device, res: dict) -> None:
    """fla's gated-delta-rule kernels at the same shapes, as anchors (and as a cross-check of the math)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # not installed here
        res["anchors"]["fla"] = f"not importable: {e!r}"[:300]
        say(res["anchors"]["fla"])
        return
    from kvfree.kernels.gdn import chunk, fused_recurrent

    anc = res["anchors"]
    anc["fla_version"] = getattr(fla, "__version__", "?")
    H, D, Dv = SZ["HDV"]
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(4)
    for lens in SZ["prefill_lens"]:
        N, T = len(lens), sum(lens)
        tag = f"B1_T{T}" if N == 1 else f"{N}x{lens[0]}"
        q, k, v, g, beta = gdn_inputs(T, torch.bfloat16, dev, gen)
        h0 = torch.randn(N, H, D, Dv, generator=gen, device=dev) * 0.5
        cu = cu_seqlens(lens, dev)
        packed = {"cu_seqlens": cu.long(), "cu_seqlens_cpu": cu.cpu().long()} if N > 1 else {}

        def fla_chunk(q=q, k=k, v=v, g=g, beta=beta, h0=h0, packed=packed):
            return chunk_gated_delta_rule(
                q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=False, **packed,
            )  # fmt: skip

        ms = bench(fla_chunk, dev, rep=100)
        row = {"ms": ms, "Mtok_s": T / ms / 1e3}
        o_fla, s_fla = fla_chunk()
        s = h0.clone()
        idx = torch.arange(N, dtype=torch.int32, device=dev)
        o = chunk.chunk_gdn(q, k, v, g, beta, s, idx, cu, scale, 64, cu_seqlens_cpu=cu.tolist())
        row["o_rel_diff_to_kvfree"] = rel(o_fla[0], o)
        row["state_rel_diff_to_kvfree"] = rel(s_fla, s)
        ours = res["prefill"].get(f"{tag}_bfloat16", {}).get("default", {}).get("Mtok_s")
        if ours:
            row["kvfree_over_fla"] = ours / row["Mtok_s"]
            res["goals_values"][f"prefill_{tag}_over_fla"] = row["kvfree_over_fla"]
        anc[f"fla_chunk_gated_delta_rule_{tag}"] = row
        say(f"fla chunk {tag}: {json.dumps(row)}")
        del q, k, v, o_fla, o
    for B in SZ["decode_batches"]:
        q, k, v, g, beta = gdn_inputs(B, torch.bfloat16, dev, gen)
        h0 = torch.randn(B, H, D, Dv, generator=gen, device=dev) * 0.5

        def fla_step(q=q, k=k, v=v, g=g, beta=beta, h0=h0):
            # (keywords: fla 0.6's fifth positional argument is `gk`, a per-key decay, not beta)
            return fused_recurrent_gated_delta_rule(
                q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=scale, initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=False,
            )  # fmt: skip

        row = {"us": bench(fla_step, dev, rep=100) * 1e3}
        o_fla, _ = fla_step()
        s = h0.clone()
        o = fused_recurrent.fused_recurrent_gdn(q, k, v, g, beta, s, torch.arange(B, dtype=torch.int32, device=dev),
                                                scale)  # fmt: skip
        row["o_rel_diff_to_kvfree"] = rel(o_fla[:, 0], o)
        ours = res["decode"].get(f"B{B}", {}).get("triton_us")
        if ours:
            row["kvfree_speedup"] = row["us"] / ours
        anc[f"fla_fused_recurrent_gated_delta_rule_B{B}"] = row
        say(f"fla decode B={B}: {json.dumps(row)}")


def table(res: dict) -> str:
    nan = float("nan")
    lines = table_head(res)
    for k, v in res["checks"].items():
        if "o_rel" in v:
            lines.append(f"  {k:34s} o {v['o_rel']:.1e}  s {v['s_rel']:.1e}  untouched {v['untouched_equal']}")
    anc = res["anchors"]
    H, D, Dv = SZ["HDV"]
    lines.append(f"{f'decode H{H} D{D} Dv{Dv}':22s} {'us':>8s} {'floor':>7s} {'x floor':>8s} {'fla us':>7s} "
                 f"{'ref us':>8s}")  # fmt: skip
    for k, v in res["decode"].items():
        fla_us = anc.get(f"fla_fused_recurrent_gated_delta_rule_{k}", {}).get("us", nan)
        lines.append(f"  {k:20s} {v['triton_us']:8.1f} {v['floor_us']:7.1f} {v['over_floor']:8.2f} {fla_us:7.1f} "
                     f"{v['reference_us']:8.1f}" + (f"  graph {v['triton_graph_per_step_us']:.1f}"
                                                    if "triton_graph_per_step_us" in v else ""))  # fmt: skip
        lines.append("    sweep: " + ", ".join(f"{c} {u:.1f}" for c, u in v["sweep_us"].items()))
    lines.append(f"{'prefill':28s} {'ms':>8s} {'Mtok/s':>8s}")
    for k, v in res["prefill"].items():
        if "default" in v and "ms" in v["default"]:
            lines.append(f"  {k:26s} {v['default']['ms']:8.3f} {v['default']['Mtok_s']:8.2f}")
            for c, r in v.items():
                if c != "default":
                    lines.append(f"      {c:46s} " + (f"{r['Mtok_s']:8.2f}" if "Mtok_s" in r else r.get("error", "")))
        elif "ms" in v:
            lines.append(f"  {k:26s} {v['ms']:8.3f} {v['Mtok_s']:8.2f}")
    for k, v in anc.items():
        if k.startswith("fla_chunk"):
            lines.append(f"  {k:40s} {v['ms']:8.3f} {v['Mtok_s']:8.2f}  kvfree/fla {v.get('kvfree_over_fla', nan):.2f}"
                         f"  o diff {v['o_rel_diff_to_kvfree']:.1e}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global SZ
    a, dev = script_args(argv, __doc__, "gdn", ("--skip-fla", None))
    if dev is None:
        return 2
    if a.smoke:
        SZ, a.skip_fla = SMOKE, True
    H, D, Dv = SZ["HDV"]
    res = environment(dev) | {
        "shapes": {"op": f"H={H} D={D} Dv={Dv}, fp32 state in a {SZ['pool']}-row pool at random slots, "
                         f"chunk {SZ['chunk']}",
                   "decode": f"bf16 q, k, v; B in {list(SZ['decode_batches'])}",
                   "prefill": "B=1 T=16384 and 8x4096 packed (cu_seqlens), bf16 and fp32 inputs",
                   "checks": f"decode B={SZ['check_B']}; prefill lens {SZ['check_lens']}"},
        "checks": {}, "decode": {}, "prefill": {}, "profile": {}, "anchors": {}, "goals_values": {}, "errors": [],
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
    steps.append(("goals", lambda: res.update(goals=goal_rows(GOALS, res["goals_values"], dev.type))))
    return run_script(steps, res, Path(a.out) / "gdn.json", RUN, table, dev.type)


if __name__ == "__main__":
    sys.exit(main())
