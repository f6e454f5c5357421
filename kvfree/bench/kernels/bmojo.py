"""Check and time the B'MOJO Triton kernels on a CUDA GPU, in one run (a few minutes on an H100).

    python -m kvfree.bench.kernels.bmojo --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)
    python -m kvfree.bench.kernels --op bmojo --out DIR  (the same)

Shapes: bmojo-1.4b's memory part of one layer (Hq = Hkv = 16, dh = 128, w = 512, m_f = 1, m_e = 64, d = 2048,
k = 4; bf16 K/V) in a pool of 512 rows holding random consistent memory states (random positions, a third of them
at a chunk boundary, eidetic stores in key order); the fading projection is a layer-like RMS norm and two d x
Hkv*dh bf16 GEMMs.

(a) Correctness against the float64 reference (K/V in float64; scores and y_buf fp32, as the reference computes
    them), every buffer the kernels allocate poisoned with NaN first: the decode step at B=64 with fp32 and bf16
    inputs, and the prefill of packed sequences of lengths 1, 511, 512, 513, 2000 and 0 from states at several
    phases; relative errors of the output and of every state field, integer fields (t, counts, eidetic positions)
    exactly, rows not named bit-identical. The decode step captured in a CUDA graph and replayed equals eager.
(b) Medians from `triton.testing.do_bench`: decode at B=1/64/256 (bf16; B=1 also replayed from a CUDA graph of 10
    steps, per step), with a (key block, splits) sweep; the decode floor is the memory state's bytes read and
    written (K/V of ring, fading and eidetic, y_buf, the token's row) over a device-to-device copy's bandwidth
    measured in the same run, the fading projection's weight read shown beside it. Prefill at B=1 T=16384 and
    8x4096 packed (bf16) with a block sweep; the PyTorch reference at the same shapes.

Writes DIR/bmojo.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch

from kvfree.bench import harness
from kvfree.bench.kernels.common import check_decode_graph, lens_tag, random_slots, record, sweep_text, table_rows
from kvfree.kernels import common
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
FIELDS = ("t", "y_buf", "ring_k", "ring_v", "ring_eps", "fad_k", "fad_v", "fad_n", "eid_k", "eid_v", "eid_eps",
          "eid_pos", "eid_n")  # fmt: skip
KV = ("ring_k", "ring_v", "fad_k", "fad_v", "eid_k", "eid_v")
EXACT = ("t", "fad_n", "eid_n", "eid_pos")
REAL = {
    "shape": {"Hq": 16, "Hkv": 16, "dh": 128, "w": 512, "m_f": 1, "m_e": 64, "D": 2048, "taps": 4},
    "pool": 512,
    "check_B": 64,
    "check_lens": [1, 511, 512, 513, 2000, 0],
    "decode_batches": (1, 64, 256),
    "decode_sweep": [(64, None), (32, None), (128, None), (64, 1), (64, 4), (64, 11)],  # (block_n, splits)
    "prefill_lens": ([16384], [4096] * 8),
    "prefill_sweep": [(64, 64, 4), (64, 32, 4), (32, 64, 4), (64, 64, 8), (128, 64, 8)],  # (BM, BN, warps)
}
SMOKE = {
    "shape": {"Hq": 2, "Hkv": 2, "dh": 16, "w": 8, "m_f": 2, "m_e": 4, "D": 24, "taps": 4},
    "pool": 12,
    "check_B": 5,
    "check_lens": [1, 7, 8, 9, 20, 0],
    "decode_batches": (1, 3),
    "decode_sweep": [(16, 2)],
    "prefill_lens": ([40], [20] * 2),
    "prefill_sweep": [(16, 16, 4)],
}
SZ = harness.Sizes(REAL, SMOKE)
SCRIPT = harness.CheckScript("bmojo", __doc__, SZ, sections=("decode", "prefill", "profile"))
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it


@SCRIPT.shapes
def shapes() -> dict:
    return {"op": SZ["shape"], "pool": SZ["pool"], "decode": f"bf16; B in {list(SZ['decode_batches'])}",
            "prefill": f"bf16, lens {SZ['prefill_lens']} from new sessions",
            "checks": f"decode B={SZ['check_B']}; prefill lens {SZ['check_lens']}"}  # fmt: skip


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """`common.poisoned_outputs`, with integer buffers (the kernels' step metadata, positions) poisoned too: NaN
    does not fit them, -2**40 is as wrong as a position or count can be."""
    with poisoned_outputs():
        nan_buffer = common.output_buffer

        def any_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if dtype.is_floating_point:
                return nan_buffer(shape, dtype, device)
            return torch.full(shape, -(2**40), dtype=dtype, device=device)

        common.output_buffer = any_buffer
        try:
            yield
        finally:
            common.output_buffer = nan_buffer


class Fading:
    """The layer's fading projection: RMS norm of y, then W_K and W_V (bf16 weights, as a served model)."""

    def __init__(self, dev: torch.device, gen: torch.Generator) -> None:
        s = SZ["shape"]
        D, n = s["D"], s["Hkv"] * s["dh"]
        self.wk = (torch.randn(D, n, generator=gen, device=dev) / D**0.5).to(torch.bfloat16)
        self.wv = (torch.randn(D, n, generator=gen, device=dev) / D**0.5).to(torch.bfloat16)
        self.heads = (s["Hkv"], s["dh"])

    def __call__(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dt = f64 if y.dtype == f64 else torch.bfloat16
        a = (y.float() * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt)
        return (a @ self.wk.to(dt)).unflatten(-1, self.heads), (a @ self.wv.to(dt)).unflatten(-1, self.heads)


def make_pools(dev: torch.device, gen: torch.Generator, dtype: torch.dtype, t: torch.Tensor) -> dict:
    """Pools of len(t) rows of random memory states consistent with positions t (0: a new session, all zeros)."""
    s = SZ["shape"]
    S, w, m_f, m_e, Hkv, dh, D = len(t), s["w"], s["m_f"], s["m_e"], s["Hkv"], s["dh"], s["D"]
    L = max(s["taps"], m_f)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev)

    store_end = ((t - 1).clamp(min=0) // w) * w  # the store summarises positions < store_end (the lazy rule)
    n = torch.minimum(store_end, torch.tensor(m_e, device=dev))
    j = torch.arange(m_e, device=dev)
    live = j[None, :] < n[:, None]
    # Distinct positions: one per bucket of store_end / m_e; scores in descending order (the store's key order).
    eid_pos = ((j[None, :] + torch.rand(S, m_e, generator=gen, device=dev)) * store_end[:, None] / m_e).long()
    eid_eps = (torch.rand(S, m_e, generator=gen, device=dev) * 3).sort(1, descending=True).values
    p = {
        "t": t.clone(), "y_buf": rnd(S, L, D), "ring_k": rnd(S, w, Hkv, dh), "ring_v": rnd(S, w, Hkv, dh),
        "ring_eps": torch.rand(S, w, generator=gen, device=dev) * 2, "fad_k": rnd(S, m_f, Hkv, dh),
        "fad_v": rnd(S, m_f, Hkv, dh), "fad_n": torch.where(store_end > 0, m_f, 0),
        "eid_k": rnd(S, m_e, Hkv, dh) * live[..., None, None], "eid_v": rnd(S, m_e, Hkv, dh) * live[..., None, None],
        "eid_eps": eid_eps * live, "eid_pos": eid_pos * live, "eid_n": n,
    }  # fmt: skip
    fresh = t == 0
    for name, x in p.items():
        if name != "t":
            x[fresh] = 0
    return {name: x.to(dtype) if name in KV else x for name, x in p.items()}


def positions(dev: torch.device, gen: torch.Generator, S: int) -> torch.Tensor:
    """Random positions, every third exactly at a chunk boundary, a few new sessions."""
    w = SZ["shape"]["w"]
    t = torch.randint(1, 40 * w, (S,), generator=gen, device=dev)
    t[::3] = (t[::3] // w).clamp(min=1) * w
    t[5::7] = 0
    return t


def fields(p: dict) -> list[torch.Tensor]:
    return [p[name] for name in FIELDS]


def check_rows(o: torch.Tensor, o_ref: torch.Tensor, p: dict, ref: dict, before: dict, idx: torch.Tensor,
               tol: float) -> dict:  # fmt: skip
    """Relative errors of the output and of every state field in the named rows (integer fields: equal or not),
    whether the other rows are unchanged, and whether all of it is within `tol`."""
    i = idx.long()
    row: dict = {"o_rel": harness.rel_err(o, o_ref)}
    worst = row["o_rel"]
    for name in FIELDS:
        if name in EXACT:
            row[f"{name}_equal"] = bool(torch.equal(p[name][i], ref[name][i]))
        elif p[name].numel():
            row[f"{name}_rel"] = harness.rel_err(p[name][i], ref[name][i])
            worst = max(worst, row[f"{name}_rel"])
    row["untouched_equal"] = all(harness.untouched_equal(p[n], before[n], idx) for n in FIELDS)
    row["ok"] = bool(row["untouched_equal"] and all(row[f"{n}_equal"] for n in EXACT) and worst <= tol)
    return row


@SCRIPT.step("checks")
def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.bmojo import chunk, fused_recurrent, reference

    s = SZ["shape"]
    gen = torch.Generator(device=dev).manual_seed(1)
    fading = Fading(dev, gen)
    tol = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        B = SZ["check_B"]
        p = make_pools(dev, gen, dtype, positions(dev, gen, SZ["pool"]))
        ref = {n: x.to(f64) if n in KV else x.clone() for n, x in p.items()}
        before = {n: x.clone() for n, x in p.items()}
        idx = random_slots(SZ["pool"], B, gen, dev)
        q = torch.randn(B, s["Hq"], s["dh"], generator=gen, device=dev).to(dtype)
        k, v = (torch.randn(B, s["Hkv"], s["dh"], generator=gen, device=dev).to(dtype) for _ in range(2))
        y = torch.randn(B, s["D"], generator=gen, device=dev)
        with poisoned():
            o = fused_recurrent.fused_recurrent_bmojo(q, k, v, y, *fields(p), idx, fading, s["taps"])
        o_ref = reference.fused_recurrent_bmojo(q.to(f64), k.to(f64), v.to(f64), y, *fields(ref), idx, fading,
                                                s["taps"])  # fmt: skip
        row = check_rows(o, o_ref, p, ref, before, idx, tol[dtype])
        row["boundary_sessions"] = int(((before["t"][idx.long()] % s["w"] == 0) & (before["t"][idx.long()] > 0)).sum())
        record(res, SCRIPT.log, "checks", f"decode_B{B}_{name}", row, f"check decode {name}")

        lens = SZ["check_lens"]
        T = sum(lens)
        cu = harness.cu_seqlens(lens, dev)
        p = make_pools(dev, gen, dtype, positions(dev, gen, SZ["pool"]))
        ref = {n: x.to(f64) if n in KV else x.clone() for n, x in p.items()}
        before = {n: x.clone() for n, x in p.items()}
        idx = random_slots(SZ["pool"], len(lens), gen, dev)
        q = torch.randn(T, s["Hq"], s["dh"], generator=gen, device=dev).to(dtype)
        k, v = (torch.randn(T, s["Hkv"], s["dh"], generator=gen, device=dev).to(dtype) for _ in range(2))
        y = torch.randn(T, s["D"], generator=gen, device=dev)
        with poisoned():
            o = chunk.chunk_bmojo(q, k, v, y, *fields(p), idx, cu, fading, s["taps"], cu_seqlens_cpu=cu.tolist())
        o_ref = reference.chunk_bmojo(q.to(f64), k.to(f64), v.to(f64), y, *fields(ref), idx, cu, fading, s["taps"],
                                      cu_seqlens_cpu=cu.tolist())  # fmt: skip
        row = check_rows(o, o_ref, p, ref, before, idx, tol[dtype])
        record(res, SCRIPT.log, "checks", f"prefill_{name}", row, f"check prefill {name}")
        harness.sync()

    if dev.type == "cuda":  # the decode step inside a CUDA graph, replayed on new inputs, twice (boundaries move)
        B = SZ["check_B"]
        p = make_pools(dev, gen, torch.bfloat16, positions(dev, gen, SZ["pool"]))
        idx = random_slots(SZ["pool"], B, gen, dev)

        def new_inputs() -> list[torch.Tensor]:
            return [torch.randn(B, s["Hq"], s["dh"], generator=gen, device=dev).to(torch.bfloat16),
                    *(torch.randn(B, s["Hkv"], s["dh"], generator=gen, device=dev).to(torch.bfloat16)
                      for _ in range(2)), torch.randn(B, s["D"], generator=gen, device=dev)]  # fmt: skip

        inp = new_inputs()
        check_decode_graph(res, SCRIPT.log,
                           lambda st: fused_recurrent.fused_recurrent_bmojo(*inp, *st, idx, fading, s["taps"]),
                           fields(p), inp, new_inputs, replays=3)  # fmt: skip


def state_bytes(B: int) -> int:
    """Bytes a decode step must move for B sessions' memory state: K/V of ring, fading and eidetic read, the token's
    K/V row and score written, y_buf read and written, the scalars (bf16 K/V)."""
    s = SZ["shape"]
    kv = 2 * s["Hkv"] * s["dh"] * 2
    L = max(s["taps"], s["m_f"])
    return B * (kv * (s["w"] + s["m_f"] + s["m_e"]) + kv + 4 + 2 * 4 * L * s["D"] + 3 * 8 * 2)


@SCRIPT.step("decode")
def time_decode(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.bmojo import fused_recurrent, reference

    s = SZ["shape"]
    gen = torch.Generator(device=dev).manual_seed(2)
    fading = Fading(dev, gen)
    p = make_pools(dev, gen, torch.bfloat16, positions(dev, gen, SZ["pool"]))
    weight_bytes = 2 * s["D"] * s["Hkv"] * s["dh"] * 2
    for B in SZ["decode_batches"]:
        idx = random_slots(SZ["pool"], B, gen, dev)
        q = torch.randn(B, s["Hq"], s["dh"], generator=gen, device=dev).to(torch.bfloat16)
        k, v = (torch.randn(B, s["Hkv"], s["dh"], generator=gen, device=dev).to(torch.bfloat16) for _ in range(2))
        y = torch.randn(B, s["D"], generator=gen, device=dev)
        args = (q, k, v, y, *fields(p), idx, fading, s["taps"])
        sweep = {f"BN{bn}_S{ns or 'auto'}": lambda args=args, bn=bn, ns=ns: fused_recurrent.launch(
            *args, block_n=bn, num_splits=ns) for bn, ns in SZ["decode_sweep"]}  # fmt: skip
        row = harness.decode_timings(lambda args=args: fused_recurrent.fused_recurrent_bmojo(*args),
                                     lambda args=args: reference.fused_recurrent_bmojo(*args), sweep, state_bytes(B),
                                     res["hbm_copy_GBps"], dev)  # fmt: skip
        row["fading_weights_us"] = weight_bytes / res["hbm_copy_GBps"] / 1e3
        record(res, SCRIPT.log, "decode", f"B{B}", row, f"decode B={B}")


@SCRIPT.step("prefill")
def time_prefill(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.bmojo import chunk, reference

    s = SZ["shape"]
    gen = torch.Generator(device=dev).manual_seed(3)
    fading = Fading(dev, gen)
    for lens in SZ["prefill_lens"]:
        T, tag = sum(lens), lens_tag(lens)
        cu = harness.cu_seqlens(lens, dev)
        cu_cpu = cu.tolist()
        idx = torch.arange(len(lens), dtype=torch.int32, device=dev)
        q = torch.randn(T, s["Hq"], s["dh"], generator=gen, device=dev).to(torch.bfloat16)
        k, v = (torch.randn(T, s["Hkv"], s["dh"], generator=gen, device=dev).to(torch.bfloat16) for _ in range(2))
        y = torch.randn(T, s["D"], generator=gen, device=dev).to(torch.bfloat16)
        p = make_pools(dev, gen, torch.bfloat16, torch.zeros(len(lens), dtype=torch.int64, device=dev))
        fresh = {n: x.clone() for n, x in p.items()}

        def run(fn: Callable, p=p, fresh=fresh, inp=(q, k, v, y, idx, cu, cu_cpu), **kw) -> float:
            q_, k_, v_, y_, idx_, cu_, cu_cpu_ = inp

            def call() -> None:
                for n in p:  # every call prefills from a new session (the reset is a few MB of copies)
                    p[n].copy_(fresh[n])
                fn(q_, k_, v_, y_, *fields(p), idx_, cu_, fading, s["taps"], cu_seqlens_cpu=cu_cpu_, **kw)

            return harness.median_ms(call, dev, rep_ms=100)

        row: dict = {}
        for bm, bn, nw in SZ["prefill_sweep"]:
            ms = run(chunk.launch, block_m=bm, block_n=bn, num_warps=nw)
            row[f"BM{bm}_BN{bn}_w{nw}"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        ms = run(chunk.chunk_bmojo)
        row["default"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        ms = run(reference.chunk_bmojo)
        row["reference"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        record(res, SCRIPT.log, "prefill", tag, row, f"prefill {tag}")
    if dev.type == "cuda":
        torch.cuda.empty_cache()


@SCRIPT.step("profile", gpu_only=True)
def profile_kernels(dev: torch.device, res: dict) -> None:
    """Device time per kernel of one default prefill (B=1 T=16384) and one decode step at the largest batch (torch
    profiler, a few calls after warm-up): which launch the time goes to."""
    from kvfree.kernels.bmojo import chunk, fused_recurrent

    s = SZ["shape"]
    gen = torch.Generator(device=dev).manual_seed(5)
    fading = Fading(dev, gen)
    T, B = SZ["prefill_lens"][0][0], max(SZ["decode_batches"])
    p = make_pools(dev, gen, torch.bfloat16, positions(dev, gen, SZ["pool"]))
    pre = [
        torch.randn(T, h, s["dh"], generator=gen, device=dev).to(torch.bfloat16) for h in (s["Hq"], s["Hkv"], s["Hkv"])
    ]
    y_pre = torch.randn(T, s["D"], generator=gen, device=dev)
    dec = [
        torch.randn(B, h, s["dh"], generator=gen, device=dev).to(torch.bfloat16) for h in (s["Hq"], s["Hkv"], s["Hkv"])
    ]
    y_dec = torch.randn(B, s["D"], generator=gen, device=dev)
    cu = harness.cu_seqlens([T], dev)
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    idx = random_slots(SZ["pool"], B, gen, dev)
    calls = {
        "prefill": lambda: chunk.chunk_bmojo(
            *pre, y_pre, *fields(p), one, cu, fading, s["taps"], cu_seqlens_cpu=[0, T]
        ),
        "decode": lambda: fused_recurrent.fused_recurrent_bmojo(*dec, y_dec, *fields(p), idx, fading, s["taps"]),
    }
    harness.profile_device_us(calls, res["profile"], SCRIPT.log, top=15)


def check_line(k: str, v: dict) -> str:
    worst = max(x for n, x in v.items() if n.endswith("_rel"))
    return f"  {k:20s} o {v['o_rel']:.1e}  worst state {worst:.1e}  untouched {v['untouched_equal']}"


@SCRIPT.table
def table(res: dict) -> str:
    nan = float("nan")
    lines = harness.table_head(res, "o_rel", check_line)
    lines += table_rows("decode (bf16)", 16, res["decode"], [
        ("us", "triton_us", "8.1f"), ("graph us", lambda k, v: v.get("triton_graph_per_step_us", nan), "9.1f"),
        ("floor", "floor_us", "7.1f"), ("x floor", "over_floor", "8.2f"), ("fad W us", "fading_weights_us", "9.1f"),
        ("ref us", "reference_us", "8.1f")])  # fmt: skip
    lines.append(f"{'prefill (bf16)':28s} {'ms':>8s} {'Mtok/s':>8s}")
    for k, v in res["prefill"].items():
        for c in ("default", "reference"):
            lines.append(f"  {k + ' ' + c:26s} {v[c]['ms']:8.3f} {v[c]['Mtok_s']:8.2f}")
        sweep = {c: r["Mtok_s"] for c, r in v.items() if c not in ("default", "reference")}
        lines.append("    sweep Mtok/s: " + sweep_text(sweep, ".2f"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
