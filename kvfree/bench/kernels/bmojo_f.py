"""Check and time the B'MOJO-F Triton kernels (kernels/bmojo_f) on a CUDA GPU, in one run.

    python -m kvfree.bench.kernels.bmojo_f --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)
    python -m kvfree.bench.kernels --op bmojo_f --out DIR  (the same)

Shapes: hybrid-model-factory's 8B attention (Hq=32, Hkv=8, D=128) with its default window W=2048
(checkpoints/hf_hmf.py), rings in the activation dtype in a pool at random slots.

(a) Correctness against the float64 reference, every buffer the kernels allocate poisoned with NaN first: the decode
    step (bf16 and fp32) over sessions fresh, partly filled, wrapped and long past 2W; the prefill (bf16 and fp32) of
    packed prompts of lengths 1, 100, 2047, 2049, 4097, 5000 and an empty one, continuing sessions at those stages;
    relative errors of the outputs, the rings and lengths written equal to the reference's bit for bit, rows not
    named untouched. The decode step captured in a CUDA graph and replayed on new inputs equals eager.
(b) Medians from `triton.testing.do_bench`, bf16: decode at B=1/64/256 over sessions past 2W (every ring entry
    read), eager and replayed from a CUDA graph of 10 steps, against the HBM floor (`fused_recurrent.decode_bytes`:
    the 2W-1 ring rows of k and v each session reads, the rows it writes, q, qf and o) over a device-to-device copy's
    bandwidth measured in the same run, with a block/warp/stage sweep; the reference decode op. Prefill of one 16K
    prompt and 8 x 4096 packed (fresh sessions; and the 16K prompt continuing a session past 2W), tokens/s of the
    Triton op and of the reference op, with a block/warp/stage sweep on the 16K prompt.

Writes DIR/bmojo_f.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import sys

import torch

from kvfree.bench import harness
from kvfree.bench.kernels.common import check_decode_graph, failure, optional, record, table_rows
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
RINGS = ("k_ctx", "v_ctx", "k_fade", "v_fade")
REAL = {
    "shape": (32, 8, 128),  # (Hq, Hkv, D): hmf's 8B hybrid_qwen3
    "W": 2048,  # bmojo_config.window_size's default
    "check_B": 32,
    "check_past": lambda W: [0, 1, W - 1, W, 2 * W - 1, 2 * W, 3 * W + 17, 40000],
    "check_lens": [1, 100, 2047, 2049, 4097, 5000, 0],
    "check_prefill_past": lambda W: [0, 300, W, 0, 3000, 5 * W + 3, 7],
    "decode_batches": (1, 64, 256),
    # (block_n, num_warps, num_stages); the first is the default's
    "decode_sweep": [(64, 4, 3), (64, 8, 3), (32, 4, 4)],
    "decode_splits": [None, 32],  # at B=1
    "prefill": {"1x16384": ([16384], [0]), "8x4096": ([4096] * 8, [0] * 8), "1x16384_cont": ([16384], [40000])},
    # (block_m, block_n, num_warps, num_stages); the first is the default's
    "prefill_sweep": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)],
}
SMOKE = {
    "shape": (4, 2, 16),
    "W": 8,
    "check_B": 5,
    "check_past": lambda W: [0, 1, W - 1, 2 * W, 5 * W + 3],
    "check_lens": [1, 5, 0, 19],
    "check_prefill_past": lambda W: [0, 3, 9, 2 * W + 1],
    "decode_batches": (1, 3),
    "decode_sweep": [(16, 4, 1)],
    "decode_splits": [None, 2],
    "prefill": {"1x40": ([40], [0]), "2x20": ([20, 20], [0, 0])},
    "prefill_sweep": [(16, 16, 4, 1)],
}
SZ = harness.Sizes(REAL, SMOKE)
GOALS = [
    harness.Goal("cuda", "decode_B256_over_floor", "<=", 1.3,
         "decode at B=256 (hmf 8B shape, W=2048), time over its HBM floor (ring rows read and written)"),
]  # fmt: skip
SCRIPT = harness.CheckScript("bmojo_f", __doc__, SZ, sections=("decode", "prefill"), goals=GOALS)
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it


@SCRIPT.shapes
def shapes() -> dict:
    Hq, Hkv, D = SZ["shape"]
    return {"op": f"Hq={Hq} Hkv={Hkv} D={D} W={SZ['W']}, rings in the activation dtype at random pool slots",
            "decode": f"bf16; B in {list(SZ['decode_batches'])}, sessions past 2W",
            "prefill": {k: f"lens {v[0][:2]}{'...' if len(v[0]) > 2 else ''} past {v[1][:1]}"
                        for k, v in SZ["prefill"].items()}}  # fmt: skip


def make_pools(S: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Rings of S rows holding random rotated-key-like data (unit-scale), and lengths 0."""
    _, Hkv, D = SZ["shape"]
    W = SZ["W"]
    pools = {name: torch.randn(S, size, Hkv, D, generator=gen, device=dev).to(dtype)
             for name, size in zip(RINGS, (W, W, 2 * W, 2 * W), strict=True)}  # fmt: skip
    pools["length"] = torch.zeros(S, dtype=torch.int64, device=dev)
    return pools


def inputs(n: int, dtype: torch.dtype, dev: torch.device, gen: torch.Generator) -> list[torch.Tensor]:
    """q, k, v, qf, kf, vf for n tokens: queries and keys at the scale the layer's q/k RMSNorm gives them."""
    Hq, Hkv, D = SZ["shape"]
    return [torch.randn(n, h, D, generator=gen, device=dev).to(dtype) for h in (Hq, Hkv, Hkv, Hq, Hkv, Hkv)]


def state_of(pools: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [pools[n] for n in (*RINGS, "length")]


def check_row(o: torch.Tensor, o_ref: torch.Tensor, pools: dict, ref: dict, before: dict, idx: torch.Tensor,
              tol: float) -> dict:  # fmt: skip
    """The output's relative error, whether the rings and lengths equal the reference's (cast back) and whether the
    rows not named are unchanged."""
    row = {"o_rel": harness.rel_err(o, o_ref), "tol": tol,
           "state_equal": all(bool(torch.equal(t, ref[n].to(t.dtype))) for n, t in pools.items()),
           "untouched_equal": all(harness.untouched_equal(t, before[n], idx) for n, t in pools.items())}  # fmt: skip
    row["ok"] = row["state_equal"] and row["untouched_equal"] and row["o_rel"] <= tol  # (NaN fails)
    return row


@SCRIPT.step("checks")
def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.bmojo_f import chunk, fused_recurrent, reference

    Hq, Hkv, D = SZ["shape"]
    W, scale = SZ["W"], D**-0.5
    gen = torch.Generator(device=dev).manual_seed(1)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        # decode: sessions at every stage of their rings
        past = SZ["check_past"](W)
        B = SZ["check_B"]
        past = (past * (B // len(past) + 1))[:B]
        pools = make_pools(B + 2, dtype, dev, gen)
        idx = torch.randperm(B + 2, generator=gen, device=dev)[:B].to(torch.int32)
        pools["length"][idx.long()] = torch.tensor(past, device=dev)
        inp = inputs(B, dtype, dev, gen)
        before = {n: t.clone() for n, t in pools.items()}
        ref = {n: t.to(f64) if t.is_floating_point() else t.clone() for n, t in pools.items()}
        with poisoned_outputs():
            o = fused_recurrent.fused_recurrent_bmojo_f_attention(*inp, *state_of(pools), idx, W, scale)
        o_ref = reference.fused_recurrent_bmojo_f_attention(*(t.to(f64) for t in inp), *state_of(ref), idx, W, scale)
        row = check_row(o, o_ref, pools, ref, before, idx, tol[dtype])
        record(res, SCRIPT.log, "checks", f"decode_B{B}_{name}", row, f"check decode {name}")
        del pools, ref, before, o_ref

        # prefill: packed prompts continuing sessions at every stage
        lens, past = SZ["check_lens"], SZ["check_prefill_past"](W)
        N = len(lens)
        pools = make_pools(N + 2, dtype, dev, gen)
        idx = torch.randperm(N + 2, generator=gen, device=dev)[:N].to(torch.int32)
        pools["length"][idx.long()] = torch.tensor(past, device=dev)
        cu = harness.cu_seqlens(lens, dev)
        inp = inputs(sum(lens), dtype, dev, gen)
        before = {n: t.clone() for n, t in pools.items()}
        ref = {n: t.to(f64) if t.is_floating_point() else t.clone() for n, t in pools.items()}
        with poisoned_outputs():
            o = chunk.chunk_bmojo_f_attention(*inp, *state_of(pools), idx, cu, W, scale, cu_seqlens_cpu=cu.tolist())
        o_ref = reference.chunk_bmojo_f_attention(*(t.to(f64) for t in inp), *state_of(ref), idx, cu, W, scale,
                                                  cu_seqlens_cpu=cu.tolist())  # fmt: skip
        row = check_row(o, o_ref, pools, ref, before, idx, tol[dtype])
        record(res, SCRIPT.log, "checks", f"prefill_{name}", row, f"check prefill {name}")
        del pools, ref, before, o_ref
        harness.sync()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    if dev.type == "cuda":  # the decode step inside a CUDA graph, replayed on new inputs
        B = SZ["check_B"]
        pools = make_pools(B, torch.bfloat16, dev, gen)
        pools["length"].copy_(torch.randint(0, 5 * W, (B,), generator=gen, device=dev))
        idx = torch.randperm(B, generator=gen, device=dev).to(torch.int32)
        inp = inputs(B, torch.bfloat16, dev, gen)
        check_decode_graph(
            res, SCRIPT.log, lambda st: fused_recurrent.fused_recurrent_bmojo_f_attention(*inp, *st, idx, W, scale),
            state_of(pools), inp, lambda: inputs(B, torch.bfloat16, dev, gen),
        )  # fmt: skip


@SCRIPT.step("decode")
def time_decode(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.bmojo_f import fused_recurrent, reference

    Hq, Hkv, D = SZ["shape"]
    W, scale = SZ["W"], D**-0.5
    gen = torch.Generator(device=dev).manual_seed(2)
    S = max(SZ["decode_batches"]) + 8
    pools = make_pools(S, torch.bfloat16, dev, gen)
    pools["length"].copy_(torch.randint(2 * W, 20 * W, (S,), generator=gen, device=dev))  # every ring entry read
    state = state_of(pools)
    for B in SZ["decode_batches"]:
        inp = inputs(B, torch.bfloat16, dev, gen)
        idx = torch.randperm(S, generator=gen, device=dev)[:B].to(torch.int32)
        args = (*inp, *state, idx, W, scale)
        moved = fused_recurrent.decode_bytes(B, Hq, Hkv, D, W, 2)
        floor_us = moved / res["hbm_copy_GBps"] / 1e3
        ms = harness.bench(lambda args=args: fused_recurrent.fused_recurrent_bmojo_f_attention(*args), dev, rep=200)
        row = {"floor_us": floor_us, "triton_us": ms * 1e3, "over_floor": ms * 1e3 / floor_us,
               "GBps": moved / ms / 1e6, "MB_moved": moved / 1e6}  # fmt: skip
        if dev.type == "cuda":
            graph_us = harness.graph_per_call_ms(lambda args=args: fused_recurrent.fused_recurrent_bmojo_f_attention(
                *args))  # fmt: skip
            row["graph_per_step_us"] = graph_us * 1e3
            row["graph_over_floor"] = row["graph_per_step_us"] / floor_us
        row["reference_us"] = harness.bench(lambda args=args: reference.fused_recurrent_bmojo_f_attention(*args), dev,
                                            rep=50) * 1e3  # fmt: skip
        sweep = {}
        for bn, nw, ns in SZ["decode_sweep"]:
            fn = lambda args=args, bn=bn, nw=nw, ns=ns: fused_recurrent.launch(  # noqa: E731
                *args, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                sweep[f"N{bn}_w{nw}_s{ns}"] = harness.bench(fn, dev) * 1e3
            except Exception as e:  # a config that does not compile is reported, not fatal
                sweep[f"N{bn}_w{nw}_s{ns}"] = failure(e)
        if B == 1:
            for sp in SZ["decode_splits"]:
                fn = lambda args=args, sp=sp: fused_recurrent.launch(*args, splits=sp)  # noqa: E731
                sweep[f"splits{sp or 'auto'}"] = harness.bench(fn, dev) * 1e3
        row["sweep_us"] = sweep
        if B == 256:
            res["goals_values"]["decode_B256_over_floor"] = row["over_floor"]
        record(res, SCRIPT.log, "decode", f"B{B}", row, f"decode B={B}")


@SCRIPT.step("prefill")
def time_prefill(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.bmojo_f import chunk, reference

    _, _, D = SZ["shape"]
    W, scale = SZ["W"], D**-0.5
    gen = torch.Generator(device=dev).manual_seed(3)
    for tag, (lens, past) in SZ["prefill"].items():
        T, N = sum(lens), len(lens)
        cu = harness.cu_seqlens(lens, dev)
        cu_cpu = tuple(cu.tolist())
        pools = make_pools(N, torch.bfloat16, dev, gen)
        idx = torch.arange(N, device=dev, dtype=torch.int32)
        length0 = torch.tensor(past, device=dev)
        inp = inputs(T, torch.bfloat16, dev, gen)

        def op(impl, inp=inp, pools=pools, idx=idx, cu=cu, cu_cpu=cu_cpu, length0=length0, **config) -> None:
            pools["length"].copy_(length0)  # every call continues the same past
            impl(*inp, *state_of(pools), idx, cu, W, scale, cu_seqlens_cpu=cu_cpu, **config)

        ms = harness.bench(lambda: op(chunk.chunk_bmojo_f_attention), dev)
        row = {"ms": ms, "Mtok_s": T / ms / 1e3}
        row["reference_ms"] = harness.bench(lambda: op(reference.chunk_bmojo_f_attention), dev, rep=50)
        row["reference_Mtok_s"] = T / row["reference_ms"] / 1e3
        row["speedup"] = row["reference_ms"] / ms
        if tag == next(iter(SZ["prefill"])):
            sweep = {}
            for bm, bn, nw, ns in SZ["prefill_sweep"]:
                cfg = {"block_m": bm, "block_n": bn, "num_warps": nw, "num_stages": ns}
                key = f"M{bm}_N{bn}_w{nw}_s{ns}"
                try:
                    sweep[key] = T / harness.bench(lambda cfg=cfg: op(chunk.launch, **cfg), dev) / 1e3
                except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                    sweep[key] = failure(e)
            row["sweep_Mtok_s"] = sweep
        record(res, SCRIPT.log, "prefill", tag, row, f"prefill {tag}")
        del pools, inp
        if dev.type == "cuda":
            torch.cuda.empty_cache()


@SCRIPT.table
def table(res: dict) -> str:
    lines = harness.table_head(res, "o_rel", lambda k, v: f"  {k:22s} o {v['o_rel']:.1e} (tol {v['tol']:.0e})  "
                               f"rings/length equal {v['state_equal']}  untouched {v['untouched_equal']}")  # fmt: skip
    lines.insert(1, f"shape {res['shapes']['op']}")
    lines += table_rows("decode bf16", 14, res["decode"], [
        ("us", "triton_us", "8.1f"), ("graph us", optional("graph_per_step_us"), "9.1f"),
        ("floor us", "floor_us", "9.1f"), ("x floor", "over_floor", "8.2f"),
        ("graph x", optional("graph_over_floor"), "8.2f"), ("GB/s", "GBps", "7.0f"), ("ref us", "reference_us", "9.1f"),
    ], label="sweep us")  # fmt: skip
    lines += table_rows("prefill bf16", 14, res["prefill"], [
        ("ms", "ms", "8.2f"), ("Mtok/s", "Mtok_s", "8.3f"), ("ref ms", "reference_ms", "9.1f"),
        ("ref Mtok/s", "reference_Mtok_s", "10.3f"), ("x ref", "speedup", "7.1f"),
    ], sweep="sweep_Mtok_s", label="sweep Mtok/s", fmt=".3f")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
