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
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfree.bench import harness
from kvfree.bench.kernels.common import PoolOp, fla_anchors, pool_op_steps, random_slots, sweep_text, table_rows

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
SZ = harness.Sizes(REAL, SMOKE)
SCRIPT = harness.CheckScript("gka", __doc__, SZ, sections=("decode", "prefill", "profile", "anchors"),
                             flags=[("--skip-fla", None)], smoke_sets=["--skip-fla"])  # fmt: skip
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it
say = SCRIPT.log.say


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


def pools(dev: torch.device, gen: torch.Generator, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[H, S]: fp32 pools with PSD H rows (as a running sum of k k^T is), and n distinct random rows, every third
    fresh."""
    He, D, Dv = SZ["HDV"]
    S = SZ["pool"]
    root = torch.randn(S, He, D, D, generator=gen, device=dev) / D
    h = root @ root.transpose(-1, -2) * 4
    s = torch.randn(S, He, D, Dv, generator=gen, device=dev) * 0.5
    idx = random_slots(S, n, gen, dev)
    h[idx[1::3].long()] = 0
    s[idx[1::3].long()] = 0
    return [h, s], idx


@pool_op_steps(SCRIPT)
def gka_op() -> PoolOp:
    """GKA for the shared steps (common.pool_op_steps): its kernels with the ridge, the Chebyshev steps, the scale
    D^-1/2 and the op's default chunk of 64."""
    from kvfree.kernels.gka import chunk, fused_recurrent, reference

    He, D, Dv = SZ["HDV"]
    scale = D**-0.5
    return PoolOp(
        SZ, f"He={He} D={D} Dv={Dv}, {ITERS} Chebyshev steps, a={RIDGE}, fp32 H and S in a {SZ['pool']}-row pool "
        "at random slots",
        gka_inputs, pools, ("h", "s"),
        decode=lambda *a: fused_recurrent.fused_recurrent_gka(*a, RIDGE, ITERS, scale),
        decode_reference=lambda *a: reference.fused_recurrent_gka(*a, RIDGE, ITERS, scale),
        decode_launch=lambda *a, **kw: fused_recurrent.launch(*a, RIDGE, ITERS, scale, **kw),
        prefill=lambda *a, **kw: chunk.chunk_gka(*a, RIDGE, ITERS, scale, 64, **kw),
        prefill_reference=lambda *a, **kw: reference.chunk_gka(*a, RIDGE, ITERS, scale, 64, **kw),
        prefill_launch=lambda *a, **kw: chunk.launch(*a, RIDGE, ITERS, scale, 64, **kw),
        tol={torch.float32: 1e-4, torch.bfloat16: 1e-2},
        decode_bytes=lambda B: B * He * (D * D + D * Dv) * 4 * 2,  # H and S read and written
        decode_GBps="state_GBps",
        prefill_sweep=[(f"L{L}_BM{bm}_w{nw}", {"block_m": bm, "warps_out": nw, "chunk_len": L})
                       for L, bm, nw in SZ["prefill_sweep"]],
        prefill_default=True,
    )  # fmt: skip


@fla_anchors(SCRIPT, "fla.ops.mesa_net.chunk_mesa_net", "fla.ops.mesa_net.decoding_one_step.mesa_net_decoding_one_step")
def time_fla(dev: torch.device, res: dict, chunk_mesa_net: Callable, mesa_net_decoding_one_step: Callable) -> None:
    """fla's MesaNet (conjugate gradient) kernels at the same shapes, as anchors."""
    He, D, Dv = SZ["HDV"]
    gen = torch.Generator(device=dev).manual_seed(4)
    lamb = F.softplus(torch.rand(He, D, generator=gen, device=dev)) + 0.25
    for lens in SZ["prefill_lens"]:
        B, T = len(lens), lens[0]
        q, k, v, g, _ = gka_inputs(B * T, torch.bfloat16, dev, gen)
        q, k, v, g = (t.unflatten(0, (B, T)) for t in (q, k, v, g))
        beta = torch.rand(B, T, He, generator=gen, device=dev).sigmoid()
        ms = harness.bench(lambda q=q, k=k, v=v, g=g, beta=beta: chunk_mesa_net(
            q, k, v, g, beta, lamb, output_final_state=True, max_CG_iteration=ITERS), dev, rep=100)  # fmt: skip
        res["anchors"][f"fla_chunk_mesa_net_B{B}_T{T}"] = {"ms": ms, "Mtok_s": B * T / ms / 1e3}
    for B in SZ["decode_batches"]:
        q, k, v, g, _ = gka_inputs(B, torch.bfloat16, dev, gen)
        beta = torch.rand(B, He, generator=gen, device=dev).sigmoid()
        hkk = torch.randn(B, He, D, D, generator=gen, device=dev)
        hkv = torch.randn(B, He, D, Dv, generator=gen, device=dev)
        ms = harness.bench(lambda q=q, k=k, v=v, g=g, beta=beta, hkk=hkk, hkv=hkv: mesa_net_decoding_one_step(
            q, k, v, g, lamb, beta, hkk, hkv, max_CG_iteration=ITERS), dev, rep=100)  # fmt: skip
        res["anchors"][f"fla_mesa_net_decoding_one_step_B{B}"] = {"us": ms * 1e3}
    say(f"fla anchors: {json.dumps(res['anchors'])}")


# hybrid-model-factory's vLLM plugin's GKA decode kernel on an H100 (fp32 H and S in a slot pool, H=16, D=128, 30
# iterations), measured by the team before this work; its chunked prefill did not compile under triton 3.6.
HMF_DECODE_US = {1: 30.7, 64: 193.0, 256: 646.4}


@SCRIPT.table
def table(res: dict) -> str:
    nan = float("nan")
    lines = harness.table_head(res, "o_rel", lambda k, v: f"  {k:22s} o {v['o_rel']:.1e}  h {v['h_rel']:.1e}  s "
                                                          f"{v['s_rel']:.1e}  untouched {v['untouched_equal']}")
    anc = res["anchors"]
    lines += table_rows("decode He16 D128 r30", 22, res["decode"], [
        ("us", "triton_us", "8.1f"), ("floor", "floor_us", "7.1f"), ("x floor", "over_floor", "8.2f"),
        ("hmf us", lambda k, v: HMF_DECODE_US.get(int(k[1:]), nan), "7.1f"),
        ("fla us", lambda k, v: anc.get(f"fla_mesa_net_decoding_one_step_{k}", {}).get("us", nan), "7.1f"),
        ("ref us", "reference_us", "8.1f")])  # fmt: skip
    lines.append(f"{'prefill':28s} {'ms':>8s} {'Mtok/s':>8s}")
    for k, v in res["prefill"].items():
        if "default" in v:
            sweep = {c: r["Mtok_s"] for c, r in v.items() if c != "default"}
            lines.append(f"  {k:26s} {v['default']['ms']:8.3f} {v['default']['Mtok_s']:8.2f}   sweep Mtok/s: "
                         + sweep_text(sweep, ".2f"))  # fmt: skip
        else:
            lines.append(f"  {k:26s} {v['ms']:8.3f} {v['Mtok_s']:8.2f}")
    for k, v in anc.items():
        if k.startswith("fla_chunk"):
            lines.append(f"  {k:26s} {v['ms']:8.3f} {v['Mtok_s']:8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
