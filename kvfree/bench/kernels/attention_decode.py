"""Check and time the Triton decode attention (kernels/attention/fused_recurrent.py) on a CUDA GPU, in one run.

    python -m kvfree.bench.kernels --op attention_decode --out DIR   (--smoke: tiny sizes on the CPU, interpreted)

(a) Correctness at real sizes against the float64 reference (`reference._attend_one` over the same rows, an fp8
    cache dequantized), at hmf's 8B shape (Hq=32, Hkv=8, D=128): sessions of 1 .. 16,384 keys at random slots of a
    pool, in bf16 and with an e4m3 cache, for the default launch and every launch of the sweep; the cache only read.
(b) Medians from `triton.testing.do_bench` at the same shape, 16,384 keys a session: bf16 with 60 sessions and
    e4m3 with 116 (as many as `kvfree bench context --hmf-8b-gka` fits in 60% of an H200's memory), and both with
    16 sessions (few sessions: the split over the keys decides); the default launch and a sweep of block sizes,
    warps, pipeline stages and split rules. Each time's bandwidth is the bytes of K and V read over it, beside the
    HBM copy bandwidth measured in the same run (its floor). `--before MODULE`: that module's `decode_attention`
    (the kernel as it was, copied beside) timed on the same inputs.

Writes DIR/attention_decode.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch

from kvfree.bench import harness
from kvfree.bench.kernels.common import failure, random_slots, record, sweep_text

REAL = {
    "shape": (32, 8, 128),  # (Hq, Hkv, D): hmf's Qwen3-8B
    "context": 16384,
    "batches": {"bf16": [60, 16], "fp8": [116, 16]},
    "check_used": [1, 200, 4097, 16384, 9000, 127],
    # (block_n, num_warps, num_stages, programs_per_sm, min_split); the defaults are among them
    "sweep": [(bn, 4, s, pps, 256) for bn in (64, 128) for s in (2, 3, 4) for pps in (4, 8, 16, 32)]
    + [(128, 8, 3, 8, 256), (256, 4, 2, 8, 256), (32, 4, 3, 8, 256)],
}
SMOKE = {
    "shape": (4, 2, 16),
    "context": 100,
    "batches": {"bf16": [3], "fp8": [3]},
    "check_used": [1, 37, 100],
    "sweep": [(16, 4, 1, 4, 64), (32, 4, 2, 4, 16)],
}
SZ = harness.Sizes(REAL, SMOKE)
GOALS = [
    harness.Goal("cuda", "fp8_x_floor", "<=", 1.5, "e4m3 decode attention, 116 sessions x 16K keys at hmf's 8B shape, "
                 "time over the floor (its bytes at the HBM copy bandwidth)"),
    harness.Goal("cuda", "bf16_x_floor", "<=", 1.3,
                 "bf16 decode attention, 60 sessions x 16K keys, time over the floor"),
]  # fmt: skip
SCRIPT = harness.CheckScript(
    "attention_decode", __doc__, SZ, sections=("timing",), goals=GOALS,
    flags=[("--before", "a module whose decode_attention (the kernel as it was) is timed beside", {"default": None})],
)  # fmt: skip
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it
KNOBS = ("block_n", "num_warps", "num_stages", "programs_per_sm", "min_split")


@SCRIPT.shapes
def shapes() -> dict:
    hq, hkv, d = SZ["shape"]
    return {"heads": f"Hq={hq} Hkv={hkv} D={d}", "context": SZ["context"], "sessions": SZ["batches"],
            "check_used": SZ["check_used"]}  # fmt: skip


def launch_name(knobs: tuple[int | None, ...]) -> str:
    return " ".join(f"{k}={v}" for k, v in as_knobs(knobs).items() if v is not None) or "default"


def as_knobs(knobs: tuple[int | None, ...]) -> dict[str, int | None]:
    return dict(zip(KNOBS, knobs, strict=True))


def make_case(B: int, used: list[int], cache: str, dev: torch.device, gen: torch.Generator) -> dict[str, Any]:
    """Queries for B sessions at random slots of a pool of B + 2 rows sized to the longest of `used`, the rows
    random (an e4m3 cache: random values over random per-session, per-head scales)."""
    from kvfree.kernels.attention.reference import FP8, quantize

    Hq, Hkv, D = SZ["shape"]
    C = max(used)
    q = torch.randn(B, Hq, D, generator=gen, device=dev).to(torch.bfloat16)
    case: dict[str, Any] = {"q": q, "slots": random_slots(B + 2, B, gen, dev), "max_used": C,
                            "used": torch.tensor(used, device=dev, dtype=torch.int64)}  # fmt: skip
    for name in ("k", "v"):
        rows = torch.randn(B + 2, C, Hkv, D, generator=gen, device=dev)
        if cache == "fp8":
            scale = torch.rand(B + 2, Hkv, generator=gen, device=dev) * 2 + 0.25
            case[f"{name}_scale"], case[f"{name}_cache"] = scale, quantize(rows, FP8, scale[:, None])
        else:
            case[f"{name}_scale"], case[f"{name}_cache"] = None, rows.to(torch.bfloat16)
        del rows
    return case


def call(fn: Callable[..., torch.Tensor], c: dict[str, Any], **knobs: int | None) -> Callable[[], torch.Tensor]:
    return lambda: fn(c["q"], c["k_cache"], c["v_cache"], c["used"], c["slots"], c["max_used"], c["k_scale"],
                      c["v_scale"], **knobs)  # fmt: skip


def read_bytes(c: dict[str, Any]) -> int:
    """The bytes of K and V a step must read: every session's entries, at the cache's element size."""
    _, _, Hkv, D = c["k_cache"].shape
    return int(c["used"].sum()) * Hkv * D * c["k_cache"].element_size() * 2


# ---------------------------------------------------------------------------------------------------------------------
@SCRIPT.step("checks")
def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.attention.fused_recurrent import decode_attention
    from kvfree.kernels.attention.reference import _attend_one, dequantize

    gen = torch.Generator(device=dev).manual_seed(1)
    used = SZ["check_used"]
    for cache in ("bf16", "fp8"):
        c = make_case(len(used), used, cache, dev, gen)
        i = c["slots"].long()
        keys, values = (c[f"{n}_cache"][i] if cache == "bf16" else
                        dequantize(c[f"{n}_cache"][i], torch.float64, c[f"{n}_scale"][i][:, None].double())
                        for n in ("k", "v"))  # fmt: skip
        mask = torch.arange(c["max_used"], device=dev)[None, :] < c["used"][:, None]
        want = _attend_one(c["q"].double(), keys.double(), values.double(), mask)
        before = c["k_cache"].clone()
        for knobs in [(None,) * 5, *SZ["sweep"]]:
            name = f"{cache} {launch_name(knobs)}"
            try:
                out = call(decode_attention, c, **as_knobs(knobs))()
            except Exception as e:  # a launch that does not fit (shared memory): reported, not a failed check
                res["checks"][name] = {"ok": True, "skipped": failure(e)}
                continue
            err = harness.rel_err(out, want)
            row = {"rel": err, "read_only": bool(torch.equal(c["k_cache"].view(torch.uint8),
                                                             before.view(torch.uint8)))}  # fmt: skip
            row["ok"] = row["read_only"] and err <= 1e-2
            record(res, SCRIPT.log, "checks", name, row, f"check {name}")
        del c, keys, values, before


@SCRIPT.step("timing")
def time_kernels(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.attention.fused_recurrent import decode_attention

    before = SCRIPT.args.before and importlib.import_module(SCRIPT.args.before).decode_attention
    gen = torch.Generator(device=dev).manual_seed(2)
    bw = res["hbm_copy_GBps"]
    for cache, batches in SZ["batches"].items():
        for B in batches:
            c = make_case(B, [SZ["context"]] * B, cache, dev, gen)
            nbytes = read_bytes(c)
            floor_ms = nbytes / (bw * 1e9) * 1e3
            row: dict[str, Any] = {"sessions": B, "bytes": nbytes, "floor_ms": floor_ms}
            row["ms"] = harness.bench(call(decode_attention, c), dev)
            row["x_floor"] = row["ms"] / floor_ms
            if before:
                row["before_ms"] = harness.bench(call(before, c), dev)
                row["before_x_floor"] = row["before_ms"] / floor_ms
            sweep: dict[str, float | str] = {}
            for knobs in SZ["sweep"]:
                try:
                    sweep[launch_name(knobs)] = harness.bench(call(decode_attention, c, **as_knobs(knobs)), dev)
                except Exception as e:
                    sweep[launch_name(knobs)] = failure(e, 60)
            row["sweep_ms"] = sweep
            timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
            row["best"] = min(timed, key=timed.__getitem__) if timed else None
            row["best_ms"] = timed[row["best"]] if timed else None
            record(res, SCRIPT.log, "timing", f"{cache} B={B}", row, f"time {cache} B={B}")
            if batches[0] == B:  # the goals' row
                res["goals_values"][f"{cache}_x_floor"] = row["x_floor"]
            del c


@SCRIPT.table
def table(res: dict) -> str:
    lines = harness.table_head(res)
    heads = ("floor ms", "ms", "x floor", "before", "best")
    lines.append(f"{'cache, sessions':18s}" + "".join(f" {h:>9s}" for h in heads) + "  best launch")
    for k, v in res["timing"].items():
        cells = (v["floor_ms"], v["ms"], v["x_floor"], v.get("before_ms", float("nan")), v["best_ms"] or float("nan"))
        lines.append(f"  {k:16s}" + "".join(f" {x:9.3f}" for x in cells) + f"  {v['best']}")
        lines.append("    sweep: " + sweep_text(v["sweep_ms"], ".3f"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
