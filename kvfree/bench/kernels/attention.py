"""Check and time the Triton prefill attention (kernels/attention/chunk.py) on a CUDA GPU, in one run.

    python -m kvfree.bench.kernels.attention --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)
    python -m kvfree.bench.kernels --op attention --out DIR  (the same)

(a) Correctness at real sizes against the float64 reference (`reference._attend_prefill` over the same rotated
    inputs), every buffer the kernel allocates poisoned with NaN first: packed prompts of lengths 1, 127, 128, 129,
    700 and 2000, some continuing a cache (full, and a wrapped ring of 512 under a 512-token window), at
    attention-370m's shape (Hq=Hkv=16, D=64; bf16 and fp32) and a grouped-query one (Hq=16, Hkv=4, D=128; bf16, and
    an fp8 cache); the cache only read. The whole op (`chunk_attention`: rotate, attend, write) through Triton and
    the reference from the same pools: the same cache bytes and lengths, other rows untouched.
(b) Medians from `triton.testing.do_bench`, bf16, at attention-370m's shape and at H16 D128: the kernel on one 16K
    prompt and 8 x 4096 packed, fresh and continued (half the tokens already cached), causal; sliding windows of 4096
    and 512 (bmojo-1.4b's); an fp8 cache; a block/warp/stage sweep on the 16K prompt; the whole Triton op and the
    reference op. The anchor is `F.scaled_dot_product_attention(is_causal=True)` on contiguous `[B, H, T, D]` bf16
    (PyTorch's flash kernel) at the same shape; a continued prompt's anchor is flash over the whole context less
    flash over its cached half (the same work).
(c) attention-370m end to end: one 16K prompt through the model's prefill (built with random weights by the engine's
    `kvfree.bench.step.build_model`, in a subprocess: the kernels package does not import the engine), with the
    attention op on Triton (after, with a per-kernel profile) and forced onto its PyTorch reference (before).

Writes DIR/attention.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfree.bench import harness
from kvfree.bench.kernels.common import failure, first_call_s, optional, record, table_rows
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
REAL = {
    "shapes": {"370m": (16, 16, 64), "h16d128": (16, 16, 128)},  # (Hq, Hkv, D)
    "check_shapes": {"370m": (16, 16, 64), "gqa16x4d128": (16, 4, 128)},
    "check_lens": [1, 127, 128, 129, 700, 2000],
    "check_past": [0, 300, 0, 64, 1000, 5],
    "check_window": 512,
    "T": 16384,
    "packed": 8,
    "windows": [4096, 512],
    # (BLOCK_M, BLOCK_N, num_warps, num_stages); the defaults are among them
    "sweep": [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 2), (128, 64, 4, 4), (128, 32, 4, 3),
              (64, 64, 4, 3), (128, 128, 8, 2)],  # fmt: skip
    "e2e": ("attention-370m", 16384),  # preset, prompt tokens
    "layers": 48,
}
SMOKE = {
    "shapes": {"370m": (2, 2, 16)},
    "check_shapes": {"370m": (2, 2, 16), "gqa": (4, 2, 32)},
    "check_lens": [1, 15, 16, 17, 40],
    "check_past": [0, 30, 0, 16, 5],
    "check_window": 12,
    "T": 64,
    "packed": 2,
    "windows": [16],
    "sweep": [(16, 16, 4, 1)],
    "e2e": ("tiny-attention", 32),
    "layers": 4,
}
SZ = harness.Sizes(REAL, SMOKE)
GOALS = [
    harness.Goal("cuda", "ratio_370m", ">=", 0.70, "prefill kernel on one 16K prompt at attention-370m's shape (H16 "
                 "D64) over causal flash attention's tokens/s"),
    harness.Goal("cuda", "ratio_h16d128", ">=", 0.70,
                 "prefill kernel on one 16K prompt at H16 D128 over causal flash attention's tokens/s"),
    harness.Goal("cuda", "e2e_tokens_per_s", ">=", 150_000, "attention-370m, one 16K prompt end to end (tokens/s)"),
]  # fmt: skip
SCRIPT = harness.CheckScript("attention", __doc__, SZ, sections=("timing", "anchors", "rope", "end_to_end"),
                             goals=GOALS, flags=[("--skip-e2e", "skip the end-to-end model prefill")], measure=None)
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it
say = SCRIPT.log.say


@SCRIPT.shapes
def shapes() -> dict:
    return {"timing": {k: f"Hq={h} Hkv={kv} D={d}" for k, (h, kv, d) in SZ["shapes"].items()},
            "checks": {k: f"Hq={h} Hkv={kv} D={d}" for k, (h, kv, d) in SZ["check_shapes"].items()},
            "prompts": f"1x{SZ['T']} and {SZ['packed']}x{SZ['T'] // SZ['packed']}, bf16; continued: half cached",
            "end_to_end": f"{SZ['e2e'][0]}, one prompt of {SZ['e2e'][1]} tokens, random weights"}  # fmt: skip


def make_case(shape: tuple[int, int, int], lens: list[int], past: list[int], window: int | None, dtype: torch.dtype,
              dev: torch.device, gen: torch.Generator) -> dict:  # fmt: skip
    """Packed q, k, v of `lens` tokens (standing for rotated projections), a pool of N + 2 rows (a full cache sized
    to the longest context, or a ring of `window`) at random slots whose lengths are `past`, and the step's plan."""
    from kvfree.kernels.attention.reference import plan_prefill

    Hq, Hkv, D = shape
    T, N = sum(lens), len(lens)
    C = window or max(p + t for p, t in zip(past, lens, strict=True))
    q, k, v = (torch.randn(T, h, D, generator=gen, device=dev).to(dtype) for h in (Hq, Hkv, Hkv))
    k_cache, v_cache = (torch.randn(N + 2, C, Hkv, D, generator=gen, device=dev).to(dtype) for _ in range(2))
    slots = torch.randperm(N + 2, generator=gen, device=dev)[:N].to(torch.int32)
    length = torch.zeros(N + 2, dtype=torch.int64, device=dev)
    length[slots.long()] = torch.tensor(past, device=dev)
    cu = harness.cu_seqlens(lens, dev)
    plan = plan_prefill(q, length, slots, cu, cu.tolist(), k_cache, window)
    return {"q": q, "k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "length": length, "slots": slots,
            "cu": cu, "plan": plan, "window": window}  # fmt: skip


def kernel_call(c: dict, **config) -> Callable[[], torch.Tensor]:
    """The kernel alone on a case (what the op runs between rotating and writing)."""
    from kvfree.kernels.attention.chunk import prefill_attention

    p = c["plan"]
    scales = (c["k_scale"], c["v_scale"]) if "k_scale" in c else (None, None)
    return lambda: prefill_attention(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], p.past, p.idx, c["cu"],
                                     p.cu, c["window"], *scales, **config)  # fmt: skip


def to_fp8(c: dict, gen: torch.Generator) -> None:
    """The case's cache as an fp8 one: per-session, per-KV-head scales, e4m3 entries."""
    from kvfree.kernels.attention.reference import FP8, quantize

    S, Hkv = c["k_cache"].shape[0], c["k_cache"].shape[2]
    dev = c["q"].device
    for name in ("k", "v"):
        scale = torch.rand(S, Hkv, generator=gen, device=dev) * 2 + 0.25
        c[f"{name}_scale"] = scale
        c[f"{name}_cache"] = quantize(c[f"{name}_cache"].float(), FP8, scale[:, None])


# ---------------------------------------------------------------------------------------------------------------------
@SCRIPT.step("checks")
def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.attention import chunk, reference
    from kvfree.kernels.attention.reference import dequantize

    gen = torch.Generator(device=dev).manual_seed(1)
    lens, past, W = SZ["check_lens"], SZ["check_past"], SZ["check_window"]
    runs = []
    for name, shape in SZ["check_shapes"].items():
        runs += [(name, shape, None, torch.bfloat16, False), (name, shape, W, torch.bfloat16, False)]
        runs.append((name, shape, None, torch.float32, False) if shape == SZ["check_shapes"]["370m"]
                    else (name, shape, None, torch.bfloat16, True))  # fmt: skip
    for name, shape, window, dtype, fp8 in runs:
        c = make_case(shape, lens, past, window, dtype, dev, gen)
        if fp8:
            to_fp8(c, gen)
        before = (c["k_cache"].clone(), c["v_cache"].clone())
        with poisoned_outputs():
            out = kernel_call(c)()
        harness.sync()
        if fp8:
            keys = dequantize(c["k_cache"], f64, c["k_scale"][:, None].double())
            values = dequantize(c["v_cache"], f64, c["v_scale"][:, None].double())
        else:
            keys, values = c["k_cache"].to(f64), c["v_cache"].to(f64)
        want = reference._attend_prefill(c["q"].to(f64), c["k"].to(f64), c["v"].to(f64), keys, values, c["plan"],
                                         window, None, None)  # fmt: skip
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        row = {"o_rel": harness.rel_err(out, want), "tol": tol,
               "cache_unchanged": bool(torch.equal(c["k_cache"].view(torch.uint8), before[0].view(torch.uint8))
                                       and torch.equal(c["v_cache"].view(torch.uint8), before[1].view(torch.uint8)))}
        row["ok"] = row["cache_unchanged"] and row["o_rel"] <= tol  # (NaN fails)
        tag = f"kernel_{name}_{'w' + str(window) if window else 'causal'}_{str(dtype)[6:]}{'_fp8' if fp8 else ''}"
        record(res, SCRIPT.log, "checks", tag, row, f"check {tag}")
        del c, keys, values, want

    # The rotation: the Triton RoPE is the reference's bit for bit (the cache stores the rotated keys).
    c = make_case(SZ["check_shapes"]["370m"], lens, past, None, torch.bfloat16, dev, gen)
    want = reference._rotate(c["q"], c["k"], c["plan"].pos, 10000.0)
    got = chunk.rotate(c["q"], c["k"], c["plan"], 10000.0)
    same = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    res["checks"]["rope_bit_equal"] = {"ok": same, "o_rel": harness.rel_err(got[0], want[0])}
    say(f"check rope bit for bit: {same}")

    # The whole op, Triton against the reference from the same pools: cache bytes, lengths, untouched rows.
    for window in (None, W):
        c = make_case(SZ["check_shapes"]["370m"], lens, past, window, torch.bfloat16, dev, gen)
        outs = {}
        for impl in ("reference", "triton"):
            k_cache, v_cache, length = c["k_cache"].clone(), c["v_cache"].clone(), c["length"].clone()
            fn = reference.chunk_attention if impl == "reference" else chunk.chunk_attention
            with poisoned_outputs():
                o = fn(c["q"], c["k"], c["v"], k_cache, v_cache, length, c["slots"], c["cu"], window=window,
                       cu_seqlens_cpu=c["cu"].tolist())  # fmt: skip
            outs[impl] = (o, k_cache, v_cache, length)
        (o_r, k_r, v_r, n_r), (o_t, k_t, v_t, n_t) = outs["reference"], outs["triton"]
        same = torch.equal(k_t, k_r) and torch.equal(v_t, v_r) and torch.equal(n_t, n_r)
        row = {"o_rel_to_reference_op": harness.rel_err(o_t, o_r), "tol": 1e-2, "same_cache_and_lengths": bool(same),
               "untouched_equal": harness.untouched_equal(k_t, c["k_cache"], c["slots"])
               and harness.untouched_equal(v_t, c["v_cache"], c["slots"])}  # fmt: skip
        row["ok"] = row["same_cache_and_lengths"] and row["untouched_equal"] and row["o_rel_to_reference_op"] <= 1e-2
        tag = f"op_{'w' + str(window) if window else 'causal'}"
        record(res, SCRIPT.log, "checks", tag, row, f"check {tag}")


# ---------------------------------------------------------------------------------------------------------------------
def flash_ms(B: int, T: int, H: int, D: int, dev: torch.device, gen: torch.Generator) -> float:
    """Causal SDPA on contiguous `[B, H, T, D]` bf16: PyTorch's flash kernel on a GPU (its default pick there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(B, H, T, D, generator=gen, device=dev).to(torch.bfloat16) for _ in range(3))
    backends = [SDPBackend.FLASH_ATTENTION] if dev.type == "cuda" else [SDPBackend.MATH]

    def run() -> torch.Tensor:
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return harness.bench(run, dev)


@SCRIPT.step("timing")
def time_kernels(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.attention import chunk, reference

    gen = torch.Generator(device=dev).manual_seed(2)
    T, P = SZ["T"], SZ["packed"]
    for name, shape in SZ["shapes"].items():
        Hq, Hkv, D = shape
        rows = res["timing"].setdefault(name, {})
        flash = {"1x": flash_ms(1, T, Hq, D, dev, gen), "1x_half": flash_ms(1, T // 2, Hq, D, dev, gen),
                 f"{P}x": flash_ms(P, T // P, Hq, D, dev, gen),
                 f"{P}x_half": flash_ms(P, T // P // 2, Hq, D, dev, gen)}  # fmt: skip
        res["anchors"][name] = {k: {"ms": v} for k, v in flash.items()}
        say(f"{name} flash anchors (ms): {json.dumps(flash)}")
        # (case, lens, past, window, anchor ms)
        cases = [
            (f"1x{T}", [T], [0], None, flash["1x"]),
            (f"{P}x{T // P}", [T // P] * P, [0] * P, None, flash[f"{P}x"]),
            (f"1x{T}_cont", [T // 2], [T // 2], None, flash["1x"] - flash["1x_half"]),
            (f"{P}x{T // P}_cont", [T // P // 2] * P, [T // P // 2] * P, None, flash[f"{P}x"] - flash[f"{P}x_half"]),
        ]
        for W in SZ["windows"]:
            cases.append((f"1x{T}_w{W}", [T], [0], W, flash["1x"]))
        if name == "370m":
            cases.append((f"1x{T}_cont_fp8", [T // 2], [T // 2], None, flash["1x"] - flash["1x_half"]))
        for tag, lens, past, window, anchor in cases:
            c = make_case(shape, lens, past, window, torch.bfloat16, dev, gen)
            if tag.endswith("fp8"):
                to_fp8(c, gen)
            fn = kernel_call(c)
            first = first_call_s(fn)
            ms = harness.bench(fn, dev)
            new = sum(lens)
            row = {"ms": ms, "Mtok_s": new / ms / 1e3, "anchor_ms": anchor, "anchor_Mtok_s": new / anchor / 1e3,
                   "ratio_to_flash": anchor / ms, "first_call_s": first}  # fmt: skip
            if window:
                row["anchor"] = "causal flash over the whole prompt (more work than the window's)"
            if tag == f"1x{T}":
                sweep = {}
                for bm, bn, w, s in SZ["sweep"]:
                    cfg = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": s}
                    try:
                        sweep[f"M{bm}_N{bn}_w{w}_s{s}"] = harness.bench(kernel_call(c, **cfg), dev)
                    except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                        sweep[f"M{bm}_N{bn}_w{w}_s{s}"] = failure(e)
                row["sweep_ms"] = sweep
                res["goals_values"][f"ratio_{name}"] = row["ratio_to_flash"]
            if tag in (f"1x{T}", f"{P}x{T // P}"):  # the whole op, and the reference op, on the same inputs
                length0 = c["length"].clone()

                def op(impl, c=c, length0=length0) -> None:
                    c["length"].copy_(length0)  # each call continues the same past (a full cache fills otherwise)
                    impl(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"], c["length"], c["slots"], c["cu"],
                         cu_seqlens_cpu=c["plan"].cu)  # fmt: skip

                row["triton_op_ms"] = harness.bench(lambda: op(chunk.chunk_attention), dev)
                row["reference_op_ms"] = harness.bench(lambda: op(reference.chunk_attention), dev, rep=50)
                row["reference_op_Mtok_s"] = new / row["reference_op_ms"] / 1e3
            rows[tag] = row
            say(f"{name} {tag}: {json.dumps(row)}")
            del c
        # The rotation alone: the Triton RoPE against the reference's fp32 passes.
        c = make_case(shape, [T], [0], None, torch.bfloat16, dev, gen)
        rope = {"triton_ms": harness.bench(lambda c=c: chunk.rotate(c["q"], c["k"], c["plan"], 10000.0), dev),
                "reference_ms": harness.bench(lambda c=c: reference._rotate(c["q"], c["k"], c["plan"].pos, 10000.0),
                                              dev)}  # fmt: skip
        record(res, SCRIPT.log, "rope", name, rope, f"{name} rope 1x{T}")
        del c
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------------
# The model's prefill, timed in a subprocess (kernels/ does not import the engine): a preset built with random
# weights as `kvfree bench` builds it, one prompt in a one-slot pool whose slot is reset before every call (the
# engine bench's own prefill timing repeats the prompt into the same session, which a full KV cache refuses), with
# chunk_attention's dispatch forced onto its reference for "before". Prints one JSON line.
_E2E = """
import json, sys
import torch
import kvfree.kernels.attention as attention
impl, preset, device, tokens = sys.argv[1], sys.argv[2], torch.device(sys.argv[3]), int(sys.argv[4])
if impl == "reference":
    attention.chunk_attention.device_check = lambda device: False
from kvfree.bench.step import build_model
from kvfree.engine.state.pool import StatePool
from kvfree.engine.model.step_batch import StepBatch
from kvfree.bench.harness import median_ms
model = build_model(preset, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
pool = StatePool(model, capacity=1, max_context=tokens)
slot = pool.alloc()
gen = torch.Generator(device=device).manual_seed(1)
ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=gen, device=device)
batch = StepBatch.prefill([slot], [tokens], device)
def step():
    pool.reset(slot)
    return model.prefill(ids, pool.tensors, batch)
with torch.inference_mode():
    ms = median_ms(step, device, rep_ms=1000)
    top = []
    if device.type == "cuda" and impl == "triton":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type.name == "CUDA":
                per[e.name[:80]] = per.get(e.name[:80], 0.0) + e.device_time
        top = [{"kernel": k, "us": round(v, 1)} for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:10]]
print(json.dumps({"tokens": tokens, "ms": ms, "tokens_per_s": tokens / ms * 1e3, "profile_top": top}))
"""


@SCRIPT.step("end_to_end", unless="--skip-e2e")
def time_end_to_end(dev: torch.device, res: dict) -> None:
    preset, tokens = SZ["e2e"]
    # after: the default dispatch (Triton on a GPU); before: the attention op on its reference, the rest unchanged.
    impls = {"after": "triton", "before": "reference"} if dev.type == "cuda" else {"after": "triton"}
    for when, impl in impls.items():
        env = {**os.environ, "KVFREE_KERNELS": "auto"} if dev.type == "cuda" else dict(os.environ)
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", _E2E, impl, preset, dev.type, str(tokens)], capture_output=True,
                              text=True, env=env, timeout=900)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"the {impl} prefill exited {proc.returncode}:\n{proc.stdout[-2000:]}"
                               f"\n{proc.stderr[-3000:]}")  # fmt: skip
        row = json.loads(proc.stdout.strip().splitlines()[-1]) | {"wall_s": time.time() - t0}
        record(res, SCRIPT.log, "end_to_end", when, row, f"end to end ({when})")
    res["goals_values"]["e2e_tokens_per_s"] = res["end_to_end"]["after"]["tokens_per_s"]
    # The "before" the kernel alone explains: the after figure with each layer's op time swapped for the reference's.
    op = res["timing"].get("370m", {}).get(f"1x{SZ['T']}", {})
    if "reference_op_ms" in op and dev.type == "cuda":
        after = res["end_to_end"]["after"]
        ms = after["ms"] + SZ["layers"] * (op["reference_op_ms"] - op["triton_op_ms"])
        res["end_to_end"]["before_estimated_from_the_op"] = {"ms": ms, "tokens_per_s": after["tokens"] / ms * 1e3}


# ---------------------------------------------------------------------------------------------------------------------
@SCRIPT.table
def table(res: dict) -> str:
    def check_line(k: str, v: dict) -> str:
        return f"  {k:36s} rel {v.get('o_rel', v.get('o_rel_to_reference_op')):.1e}  ok {v['ok']}"

    lines = harness.table_head(res, line=check_line, key=None)
    kernels = {f"{name} {tag}": r for name, rows in res["timing"].items() for tag, r in rows.items()}
    lines += table_rows("kernel (bf16)", 28, kernels, [
        ("ms", "ms", "8.3f"), ("Mtok/s", "Mtok_s", "8.2f"), ("flash", "anchor_Mtok_s", "8.2f"),
        ("x flash", "ratio_to_flash", "8.2f"), ("op ms", optional("triton_op_ms"), "8.3f"),
        ("ref ms", optional("reference_op_ms"), "8.2f"),
    ], sweep="sweep_ms", label="sweep ms", fmt=".3f")  # fmt: skip
    for name, r in res["rope"].items():
        lines.append(f"  rope {name}: triton {r['triton_ms']:.3f} ms, reference {r['reference_ms']:.3f} ms")
    for impl, r in res["end_to_end"].items():
        lines.append(f"  end to end {impl:28s} {r['ms']:9.1f} ms {r['tokens_per_s']:12,.0f} tokens/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
