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

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfree.bench import harness
from kvfree.bench.kernels.common import PoolOp, fla_anchors, lens_tag, pool_op_steps, random_slots, record, table_rows

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
SZ = harness.Sizes(REAL, SMOKE)
GOALS = [
    harness.Goal("cuda", "decode_B256_over_floor", "<=", 1.2, "decode step at B=256 over its HBM floor (x)"),
    harness.Goal("cuda", "prefill_B1_T16384_over_fla", ">=", 1.0,
                 "prefill B=1 T=16384 bf16, tokens/s over fla's chunk op"),
    harness.Goal("cuda", "prefill_8x4096_over_fla", ">=", 1.0,
                 "prefill 8x4096 packed bf16, tokens/s over fla's chunk op"),
]  # fmt: skip
SCRIPT = harness.CheckScript("gdn", __doc__, SZ, sections=("decode", "prefill", "profile", "anchors"), goals=GOALS,
                             flags=[("--skip-fla", None)], smoke_sets=["--skip-fla"])  # fmt: skip
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it


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


def pool(dev: torch.device, gen: torch.Generator, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[an fp32 state pool] and n distinct random rows of it, every third fresh (zeros)."""
    H, D, Dv = SZ["HDV"]
    s = torch.randn(SZ["pool"], H, D, Dv, generator=gen, device=dev) * 0.5
    idx = random_slots(SZ["pool"], n, gen, dev)
    s[idx[1::3].long()] = 0
    return [s], idx


def _knob_tag(knobs: dict) -> str:
    return "default" if not knobs else "_".join(f"{k}={v}" for k, v in knobs.items())


@pool_op_steps(SCRIPT)
def gdn_op() -> PoolOp:
    """GDN for the shared steps (common.pool_op_steps): its kernels with the scale D^-1/2 and SZ's chunk."""
    from kvfree.kernels.gdn import chunk, fused_recurrent, reference

    H, D, Dv = SZ["HDV"]
    scale, L = D**-0.5, SZ["chunk"]
    return PoolOp(
        SZ, f"H={H} D={D} Dv={Dv}, fp32 state in a {SZ['pool']}-row pool at random slots, chunk {L}",
        gdn_inputs, pool, ("s",),
        decode=lambda *a: fused_recurrent.fused_recurrent_gdn(*a, scale),
        decode_reference=lambda *a: reference.fused_recurrent_gdn(*a, scale),
        decode_launch=lambda *a, **kw: fused_recurrent.launch(*a, scale, **kw),
        prefill=lambda *a, **kw: chunk.chunk_gdn(*a, scale, L, **kw),
        prefill_reference=lambda *a, **kw: reference.chunk_gdn(*a, scale, L, **kw),
        # timed at the op's default chunk, checked at SZ's (the same 64 at real sizes)
        prefill_reference_timed=lambda *a, **kw: reference.chunk_gdn(*a, scale, 64, **kw),
        prefill_launch=lambda *a, **kw: chunk.launch(*a, scale, L, **kw),
        # fp32: a few 1e-7 expected (tf32x3 dots); bf16: the outputs' own rounding (~2e-3) plus the rounding of the
        # chunk-start states and U' to bf16 between launches (the states themselves stay within ~1e-5).
        tol={torch.float32: 1e-4, torch.bfloat16: 1e-2},
        prefill_tol={torch.float32: 1e-4, torch.bfloat16: 1.5e-2},  # bf16 dot operands, as fla's (chunk.py's docstring)
        # The state read and written once, plus q, k, v in, o out (bf16) and g, beta (fp32).
        decode_bytes=lambda B: B * H * (D * Dv * 4 * 2 + (2 * D + 2 * Dv) * 2 + 8),
        decode_GBps="GBps", decode_best_sweep=True, decode_goal=256,
        prefill_sweep=[(_knob_tag(knobs), knobs) for knobs in SZ["prefill_sweep"]], prefill_failures=True,
    )  # fmt: skip


@fla_anchors(SCRIPT, "fla.ops.gated_delta_rule.chunk_gated_delta_rule",
             "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule")  # fmt: skip
def time_fla(dev: torch.device, res: dict, chunk_gated_delta_rule: Callable, fused_recurrent_gated_delta_rule: Callable
             ) -> None:  # fmt: skip
    """fla's gated-delta-rule kernels at the same shapes, as anchors (and as a cross-check of the math)."""
    from kvfree.kernels.gdn import chunk, fused_recurrent

    H, D, Dv = SZ["HDV"]
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(4)
    for lens in SZ["prefill_lens"]:
        N, T, tag = len(lens), sum(lens), lens_tag(lens)
        q, k, v, g, beta = gdn_inputs(T, torch.bfloat16, dev, gen)
        h0 = torch.randn(N, H, D, Dv, generator=gen, device=dev) * 0.5
        cu = harness.cu_seqlens(lens, dev)
        packed = {"cu_seqlens": cu.long(), "cu_seqlens_cpu": cu.cpu().long()} if N > 1 else {}

        def fla_chunk(q=q, k=k, v=v, g=g, beta=beta, h0=h0, packed=packed):
            return chunk_gated_delta_rule(
                q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=False, **packed,
            )  # fmt: skip

        ms = harness.bench(fla_chunk, dev, rep=100)
        row = {"ms": ms, "Mtok_s": T / ms / 1e3}
        o_fla, s_fla = fla_chunk()
        s = h0.clone()
        idx = torch.arange(N, dtype=torch.int32, device=dev)
        o = chunk.chunk_gdn(q, k, v, g, beta, s, idx, cu, scale, 64, cu_seqlens_cpu=cu.tolist())
        row["o_rel_diff_to_kvfree"] = harness.rel_err(o_fla[0], o)
        row["state_rel_diff_to_kvfree"] = harness.rel_err(s_fla, s)
        ours = res["prefill"].get(f"{tag}_bfloat16", {}).get("default", {}).get("Mtok_s")
        if ours:
            row["kvfree_over_fla"] = ours / row["Mtok_s"]
            res["goals_values"][f"prefill_{tag}_over_fla"] = row["kvfree_over_fla"]
        record(res, SCRIPT.log, "anchors", f"fla_chunk_gated_delta_rule_{tag}", row, f"fla chunk {tag}")
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

        row = {"us": harness.bench(fla_step, dev, rep=100) * 1e3}
        o_fla, _ = fla_step()
        s = h0.clone()
        o = fused_recurrent.fused_recurrent_gdn(q, k, v, g, beta, s, torch.arange(B, dtype=torch.int32, device=dev),
                                                scale)  # fmt: skip
        row["o_rel_diff_to_kvfree"] = harness.rel_err(o_fla[:, 0], o)
        ours = res["decode"].get(f"B{B}", {}).get("triton_us")
        if ours:
            row["kvfree_speedup"] = row["us"] / ours
        record(res, SCRIPT.log, "anchors", f"fla_fused_recurrent_gated_delta_rule_B{B}", row, f"fla decode B={B}")


@SCRIPT.table
def table(res: dict) -> str:
    nan = float("nan")
    lines = harness.table_head(res, "o_rel", lambda k, v: f"  {k:34s} o {v['o_rel']:.1e}  s {v['s_rel']:.1e}  "
                                                          f"untouched {v['untouched_equal']}")  # fmt: skip
    anc = res["anchors"]
    H, D, Dv = SZ["HDV"]

    def fla_us(k: str, v: dict) -> float:
        return anc.get(f"fla_fused_recurrent_gated_delta_rule_{k}", {}).get("us", nan)

    def graph(k: str, v: dict) -> str:  # B=1 replayed from a CUDA graph, per step
        return f"  graph {v['triton_graph_per_step_us']:.1f}" if "triton_graph_per_step_us" in v else ""

    lines += table_rows(f"decode H{H} D{D} Dv{Dv}", 22, res["decode"], [
        ("us", "triton_us", "8.1f"), ("floor", "floor_us", "7.1f"), ("x floor", "over_floor", "8.2f"),
        ("fla us", fla_us, "7.1f"), ("ref us", "reference_us", "8.1f")], graph)  # fmt: skip
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


if __name__ == "__main__":
    sys.exit(main())
