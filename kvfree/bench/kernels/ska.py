"""Check and time the SKA Triton kernels on a CUDA GPU, in one run (meant to stay within ~4 minutes on an H100).

    python -m kvfree.bench.kernels.ska --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)
    python -m kvfree.bench.kernels --op ska --out DIR  (the same)

Sizes: echo-180m's SKA layer (H=12, r=48, P=64, chunk 64, K=2 power order, 6 power iterations, eps 1e-3), pools
of 512 rows at random slots, rows at assorted positions (new, mid-chunk, exactly at a chunk boundary).

(a) Correctness against the reference with fp64 statistics (the highest precision the state layout has), every
    buffer the kernels allocate poisoned with NaN first: decode at B=64 for 3 steps (some rows cross a boundary)
    and the prefill of packed lengths 1, 63, 64, 65, 200, 700, 2000 continuing those rows; fp64 accumulators with
    fp32 and bf16 inputs, fp32 accumulators with fp32 inputs; relative errors of y and every state field, rows not
    named bit-identical. 64 decode steps captured in one CUDA graph and replayed equal eager.
(b) Decode at B=1/64/256 (fp32 inputs, both accumulator dtypes): the mean per step over 64 steps replayed from one
    CUDA graph (each session crosses one chunk boundary, so the rebuild is in the mean), against the floor: the state
    bytes one step must move (G, M, C read and written in the accumulator dtype, J read, z_prev and m) over the
    device-to-device copy bandwidth measured in this run. Also the step at positions where no session rebuilds and
    where all do, the rebuild's fp64 products through `tl.dot` (where it compiles), and the reference.
(c) Prefill at B=1 T=16384 and 8x4096 packed (both accumulator dtypes; tokens/s), and the reference at T=4096.
(d) fp32 vs fp64 accumulators after 128K tokens (docs/design/ska.md §5): one session prefilled with 131072 tokens,
    and one decoded token by token through all of them; relative error of G, M, C, of the last operator J and of the
    last chunk's outputs against a float64 computation (exact fp64 sums of the same fp32 keys, J from
    `reference.ska_readout` in fp64). Keys isotropic, and anisotropic (scales 1 .. 1e-2 across the rank).

Writes DIR/ska.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import functools
import sys

import torch

from kvfree.bench import harness
from kvfree.bench.kernels.common import lens_tag, optional, random_slots, record, table_rows
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
f32 = torch.float32
REAL = {
    "HrP": (12, 48, 64),
    "chunk": 64,
    "pool": 512,
    "check_B": 64,
    "check_lens": [1, 63, 64, 65, 200, 700, 2000],
    "decode_batches": (1, 64, 256),
    "prefill_lens": ([16384], [4096] * 8),
    "reference_T": 4096,
    "drift_T": 131072,
}
SMOKE = {
    "HrP": (2, 8, 8),
    "chunk": 8,
    "pool": 12,
    "check_B": 5,
    "check_lens": [1, 7, 8, 9, 20],
    "decode_batches": (2,),  # (the interpreted rebuild is slow: one batch keeps the smoke run under a minute)
    "prefill_lens": ([16], [8] * 2),
    "reference_T": 16,
    "drift_T": 16,
}
SZ = harness.Sizes(REAL, SMOKE)
SCRIPT = harness.CheckScript("ska", __doc__, SZ, sections=("decode", "prefill", "drift"),
                             flags=[("--skip-drift", None)])  # fmt: skip
main = SCRIPT.main  # (argv): `python -m kvfree.bench.kernels --op OP` calls it
say = SCRIPT.log.say
ACC = {"fp64": f64, "fp32": f32}


@SCRIPT.shapes
def shapes() -> dict[str, str]:
    H, r, P = SZ["HrP"]
    return {"op": f"H={H} r={r} P={P}, chunk {SZ['chunk']}, K=2, 6 power iterations, eps 1e-3, a {SZ['pool']}-row pool "
                  "at random slots",
            "decode": f"fp32 inputs; B in {list(SZ['decode_batches'])}; fp64 and fp32 accumulators",
            "prefill": f"{SZ['prefill_lens'][0]} and {len(SZ['prefill_lens'][1])}x{SZ['prefill_lens'][1][0]}",
            "drift": f"{SZ['drift_T']} tokens, one session"}  # fmt: skip


def op_kw(dev: torch.device) -> dict:
    """The layer's op parameters; eta and gamma as device tensors, as the mixer passes them (no host read)."""
    return {"chunk_size": SZ["chunk"], "eps": 1e-3, "eta": torch.tensor(1.5, device=dev),
            "gamma": torch.tensor(1.2, device=dev), "order": 2, "power_iters": 6}  # fmt: skip


def ska_inputs(n: int, dev: torch.device, gen: torch.Generator, dtype=f32, aniso: bool = False) -> list[torch.Tensor]:
    """Raw keys, queries, values for n tokens (the layer's fp32 projections: unit-variance entries); `aniso` scales
    the key and query coordinates from 1 down to 1e-2 (an ill-conditioned Gram, the case fp32 sums hurt)."""
    H, r, P = SZ["HrP"]
    z, q = (torch.randn(n, H, r, generator=gen, device=dev) for _ in range(2))
    if aniso:
        scale = torch.logspace(0, -2, r, device=dev)
        z, q = z * scale, q * scale
    v = torch.randn(n, H, P, generator=gen, device=dev)
    return [t.to(dtype) for t in (z, q, v)]


def empty_pool(dev: torch.device, acc: torch.dtype, rows: int | None = None):
    from kvfree.kernels.ska.reference import ska_empty_state

    H, r, P = SZ["HrP"]
    return ska_empty_state(rows or SZ["pool"], H, r, P, acc, dev)


def filled_pool(dev: torch.device, gen: torch.Generator, acc: torch.dtype, n: int):
    """A pool whose n random rows (returned, int32) consumed assorted numbers of tokens (some exactly at a chunk
    boundary, every fourth none), filled through the reference; the other rows hold random junk that must survive."""
    from kvfree.kernels.ska import reference

    S = SZ["chunk"]
    pool = empty_pool(dev, acc)
    for t in pool[:6]:
        t.copy_(torch.randn(t.shape, generator=gen, device=dev).to(t.dtype))
    idx = random_slots(SZ["pool"], n, gen, dev)
    choices = [0, S // 2, S, 2 * S, 3 * S - 1, 4 * S + 3, 5 * S]
    lens = [choices[i % len(choices)] for i in range(n)]
    pool.pos[idx.long()] = 0
    for name in ("G", "M", "C", "z_prev", "m", "J"):
        getattr(pool, name)[idx.long()] = 0
    cu = harness.cu_seqlens(lens, dev)
    z, q, v = ska_inputs(sum(lens), dev, gen)
    kw = op_kw(dev)
    reference.chunk_ska(z, q, v, pool, idx, cu, **kw, cu_seqlens_cpu=cu.tolist())
    return pool, idx


def clone(pool):
    return type(pool)(*(t.clone() for t in pool))


def f64_stats(pool):
    return type(pool)(
        *(t.to(f64, copy=True) if n in "GMC" else t.clone() for n, t in zip(pool._fields, pool, strict=True))
    )


def compare(pool, want, before, idx, y, y_ref, tol) -> dict:
    i = idx.long()
    row = {"y_rel": harness.rel_err(y, y_ref)}
    for name, a, b in zip(pool._fields, pool, want, strict=True):
        if name == "pos":
            row["pos_equal"] = bool(torch.equal(a[i], b[i]))
        else:
            row[f"{name}_rel"] = harness.rel_err(a[i], b[i])
    row["untouched_equal"] = all(harness.untouched_equal(a, b, idx) for a, b in zip(pool, before, strict=True))
    errs = [v for k, v in row.items() if k.endswith("_rel")]
    row["ok"] = row["untouched_equal"] and row["pos_equal"] and max(errs) <= tol  # NaN fails
    return row


@SCRIPT.step("checks")
def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.ska import chunk, fused_recurrent, reference

    gen = torch.Generator(device=dev).manual_seed(1)
    kw = op_kw(dev)
    tol = {f32: 1e-4, torch.bfloat16: 1e-2}
    for acc_name, dtype in (("fp64", f32), ("fp64", torch.bfloat16), ("fp32", f32)):
        acc = ACC[acc_name]
        tag = f"acc_{acc_name}_{str(dtype).removeprefix('torch.')}"
        B = SZ["check_B"]
        pool, idx = filled_pool(dev, gen, acc, B)
        want, before = f64_stats(pool), clone(pool)
        ys, refs = [], []
        for _ in range(3):
            z, q, v = ska_inputs(B, dev, gen, dtype)
            with poisoned_outputs():
                ys.append(fused_recurrent.fused_recurrent_ska(z, q, v, pool, idx, **kw))
            refs.append(reference.fused_recurrent_ska(z.float(), q.float(), v.float(), want, idx, **kw))
        row = compare(pool, want, before, idx, torch.cat(ys), torch.cat(refs), tol[dtype])
        record(res, SCRIPT.log, "checks", f"decode_B{B}_{tag}", row, f"check decode {tag}")

        lens = SZ["check_lens"]
        pool, idx = filled_pool(dev, gen, acc, len(lens))
        want, before = f64_stats(pool), clone(pool)
        cu = harness.cu_seqlens(lens, dev)
        z, q, v = ska_inputs(sum(lens), dev, gen, dtype)
        with poisoned_outputs():
            y = chunk.chunk_ska(z, q, v, pool, idx, cu, **kw, cu_seqlens_cpu=cu.tolist())
        y_ref = reference.chunk_ska(z.float(), q.float(), v.float(), want, idx, cu, **kw, cu_seqlens_cpu=cu.tolist())
        row = compare(pool, want, before, idx, y, y_ref, tol[dtype])
        record(res, SCRIPT.log, "checks", f"prefill_{tag}", row, f"check prefill {tag}")
        harness.sync()

    if dev.type == "cuda":  # 64 decode steps in one CUDA graph (each row crosses a boundary), replayed == eager
        B, S = SZ["check_B"], SZ["chunk"]
        pool, idx = filled_pool(dev, gen, f64, B)
        steps = [ska_inputs(B, dev, gen) for _ in range(S)]
        static = [[t.clone() for t in s] for s in steps]
        work = clone(pool)
        fused_recurrent.fused_recurrent_ska(*static[0], work, idx, **kw)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [fused_recurrent.fused_recurrent_ska(*s, work, idx, **kw) for s in static]
        for t, p in zip(work, pool, strict=True):
            t.copy_(p)
        graph.replay()
        eager = [fused_recurrent.fused_recurrent_ska(*s, pool, idx, **kw) for s in steps]
        ok = all(torch.equal(a, b) for a, b in zip(outs, eager, strict=True)) and all(
            torch.equal(a, b) for a, b in zip(work, pool, strict=True)
        )
        res["checks"]["decode_cuda_graph_64_steps"] = {"ok": ok, "equal_to_eager": ok}
        say(f"check 64 decode steps from one graph == eager: {ok}")


def state_bytes(B: int, acc: torch.dtype) -> int:
    """Bytes one decode step must move: G, M, C read and written (accumulator dtype), J read, z_prev read and
    written, m read and written (fp32)."""
    H, r, P = SZ["HrP"]
    s = torch.finfo(acc).bits // 8
    return B * H * (2 * s * (2 * r * r + P * r) + 4 * P * r + 2 * 4 * r + 2 * 4)


def step_us(dev: torch.device, args: tuple, kw: dict, positions: torch.Tensor, fn=None) -> float:
    """Median us of one decode step `fn(*args, **kw)` (default: the Triton op) with the sessions at `positions`,
    reset before each call."""
    from kvfree.kernels.ska.fused_recurrent import fused_recurrent_ska

    pool, idx = args[3], args[4]
    start = pool.pos.clone()
    start[idx.long()] = positions

    def step():
        pool.pos.copy_(start)
        (fn or fused_recurrent_ska)(*args, **kw)

    return harness.median_ms(step, dev, rep_ms=100) * 1e3


def mean_of_steps_us(dev: torch.device, args: tuple, kw: dict, gen: torch.Generator) -> float:
    """Mean us per step of chunk_size decode steps replayed from one CUDA graph, the sessions at random positions:
    each crosses one chunk boundary, so its rebuild is in the mean."""
    from kvfree.kernels.ska.fused_recurrent import fused_recurrent_ska

    pool, idx = args[3], args[4]
    S = kw["chunk_size"]
    pool.pos[idx.long()] = torch.randint(0, 1000, (idx.shape[0],), generator=gen, device=dev)
    start = pool.pos.clone()
    fused_recurrent_ska(*args, **kw)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(S):
            fused_recurrent_ska(*args, **kw)

    def replay():
        pool.pos.copy_(start)
        graph.replay()

    return harness.median_ms(replay, dev, rep_ms=200) * 1e3 / S


@SCRIPT.step("decode")
def time_decode(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.ska import fused_recurrent, reference

    gen = torch.Generator(device=dev).manual_seed(2)
    kw = op_kw(dev)
    S = SZ["chunk"]
    for acc_name, acc in ACC.items():
        pool = empty_pool(dev, acc)
        for t in pool[:3]:  # statistics of a few thousand tokens' scale (the timings do not depend on them)
            t.copy_(torch.randn(t.shape, generator=gen, device=dev).to(acc))
        G = pool.G.double()
        pool.G.copy_((G @ G.mT + 4096 * torch.eye(G.shape[-1], device=dev, dtype=f64)).to(acc))
        pool.m.fill_(3.0)
        for B in SZ["decode_batches"]:
            idx = random_slots(SZ["pool"], B, gen, dev)
            z, q, v = ska_inputs(B, dev, gen)
            floor_us = state_bytes(B, acc) / res["hbm_copy_GBps"] / 1e3
            row = {"floor_us": floor_us}

            mid = torch.full((B,), 10 * S + 5, device=dev)
            at_boundary = torch.full((B,), 10 * S, device=dev)
            args = (z, q, v, pool, idx)
            row["no_rebuild_us"] = step_us(dev, args, kw, mid)
            row["all_rebuild_us"] = step_us(dev, args, kw, at_boundary)
            if acc == f64:
                try:
                    fn = functools.partial(fused_recurrent.launch, use_dot=True)
                    row["all_rebuild_fp64_dot_us"] = step_us(dev, args, kw, at_boundary, fn)
                except Exception as e:  # fp64 tl.dot does not compile on every Triton/GPU pair
                    row["all_rebuild_fp64_dot_us"] = f"failed: {e!r}"[:200]
            if dev.type == "cuda":
                row["mean_of_64_steps_us"] = mean_of_steps_us(dev, args, kw, gen)
                row["over_floor"] = row["mean_of_64_steps_us"] / floor_us
            if B <= 64:
                row["reference_us"] = step_us(dev, args, kw, mid, reference.fused_recurrent_ska)
            record(res, SCRIPT.log, "decode", f"{acc_name}_B{B}", row, f"decode {acc_name} B={B}")


@SCRIPT.step("prefill")
def time_prefill(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.ska import chunk, reference

    gen = torch.Generator(device=dev).manual_seed(3)
    kw = op_kw(dev)
    for acc_name, acc in ACC.items():
        for lens in SZ["prefill_lens"]:
            T, tag = sum(lens), f"{acc_name}_{lens_tag(lens)}"
            cu = harness.cu_seqlens(lens, dev)
            cu_cpu = cu.tolist()
            idx = random_slots(SZ["pool"], len(lens), gen, dev)
            z, q, v = ska_inputs(T, dev, gen)
            pool = empty_pool(dev, acc)

            def run(z=z, q=q, v=v, idx=idx, cu=cu, cu_cpu=cu_cpu, pool=pool):
                pool.pos.zero_()  # a fresh prefill each time (the other fields only scale, never break, the work)
                chunk.chunk_ska(z, q, v, pool, idx, cu, **kw, cu_seqlens_cpu=cu_cpu)

            ms = harness.median_ms(run, dev, rep_ms=300)
            record(res, SCRIPT.log, "prefill", tag, {"ms": ms, "Mtok_s": T / ms / 1e3}, f"prefill {tag}")
    T = SZ["reference_T"]
    z, q, v = ska_inputs(T, dev, gen)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    idx = torch.zeros(1, dtype=torch.int32, device=dev)
    pool = empty_pool(dev, f64)

    def ref():
        pool.pos.zero_()
        reference.chunk_ska(z, q, v, pool, idx, cu, **kw, cu_seqlens_cpu=[0, T])

    ms = harness.median_ms(ref, dev, rep_ms=300)
    res["prefill"][f"reference_fp64_B1_T{T}"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
    say(f"prefill reference T={T}: {ms:.2f} ms")


@SCRIPT.step("drift", unless="--skip-drift")
def drift(dev: torch.device, res: dict) -> None:
    """fp32 vs fp64 accumulators after drift_T tokens, prefilled at once and decoded token by token."""
    from kvfree.kernels.ska import chunk, fused_recurrent, reference

    T, S = SZ["drift_T"], SZ["chunk"]
    kw = op_kw(dev)
    gen = torch.Generator(device=dev).manual_seed(4)
    one = torch.zeros(1, dtype=torch.int32, device=dev)
    for aniso in (False, True):
        keys = "aniso" if aniso else "iso"
        z, q, v = ska_inputs(T, dev, gen, aniso=aniso)
        # float64 truth: exact sums of the fp32 keys (all of them), and the operator of the tokens before the last
        # chunk (the one the session's last chunk reads), from reference.ska_readout in fp64.
        zd, vd = z.double(), v.double()
        zl = torch.cat([torch.zeros_like(zd[:1]), zd[:-1]])
        exact = {"G": torch.einsum("thr,thk->hrk", zd, zd), "M": torch.einsum("thr,thk->hrk", zd, zl),
                 "C": torch.einsum("thp,thr->hpr", vd, zd)}  # fmt: skip
        cut = T - S
        head = [torch.einsum(e, a[:cut], b[:cut]) for e, a, b in (("thr,thk->hrk", zd, zd), ("thr,thk->hrk", zd, zl),
                                                                  ("thp,thr->hpr", vd, zd))]  # fmt: skip
        m = z[:cut].norm(dim=-1).amax(0)
        J64 = reference.ska_readout(*head, m.double(), eps=kw["eps"], eta=kw["eta"].double(),
                                    gamma=kw["gamma"].double(), order=2, power_iters=6)  # fmt: skip
        y64 = torch.einsum("hpr,thr->thp", J64, q[cut:].double())
        for path in ("prefill", "decode"):
            for acc_name, acc in ACC.items():
                pool = empty_pool(dev, acc, rows=1)
                if path == "prefill":
                    y = chunk.chunk_ska(z, q, v, pool, one, torch.tensor([0, T], dtype=torch.int32, device=dev), **kw,
                                        cu_seqlens_cpu=[0, T])[cut:]  # fmt: skip
                else:
                    ys = [fused_recurrent.fused_recurrent_ska(z[t : t + 1], q[t : t + 1], v[t : t + 1], pool, one, **kw)
                          for t in range(T)]  # fmt: skip
                    y = torch.cat(ys[cut:])
                row = {f"{k}_rel": harness.rel_err(getattr(pool, k)[0], exact[k]) for k in "GMC"}
                row["J_rel"] = harness.rel_err(pool.J[0], J64)
                row["y_last_chunk_rel"] = harness.rel_err(y, y64)
                record(res, SCRIPT.log, "drift", f"{keys}_{path}_{acc_name}", row,
                       f"drift {keys} {path} {acc_name} T={T}")  # fmt: skip
                harness.sync()


def check_line(k: str, v: dict) -> str:
    worst = max((x for n, x in v.items() if n.endswith("_rel")), default=float("nan"))
    return f"  {k:30s} y {v['y_rel']:.1e}  worst field {worst:.1e}  untouched {v['untouched_equal']}"


@SCRIPT.table
def table(res: dict) -> str:
    lines = harness.table_head(res, "y_rel", check_line)
    lines += table_rows("decode H12 r48 P64", 22, res["decode"], [
        ("mean64 us", optional("mean_of_64_steps_us"), "10.1f"), ("floor", "floor_us", "7.1f"),
        ("x floor", optional("over_floor"), "8.2f"), ("no-rb us", "no_rebuild_us", "9.1f"),
        ("all-rb us", "all_rebuild_us", "10.1f"), ("ref us", optional("reference_us"), "8.1f")])  # fmt: skip
    lines += table_rows("prefill", 28, res["prefill"], [("ms", "ms", "8.3f"), ("Mtok/s", "Mtok_s", "8.2f")])
    lines += table_rows(f"drift after {SZ['drift_T']} tokens (rel. err vs float64): G, J, y of the last chunk", 28,
                        res["drift"], [], lambda k, v: f" G {v['G_rel']:.1e}  J {v['J_rel']:.1e}  "
                        f"y {v['y_last_chunk_rel']:.1e}")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
