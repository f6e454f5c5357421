"""Check and time the Triton RMS norms on a CUDA GPU, in one run (well under a minute on an H100).

    python -m kvfree.bench.kernels.norm --out DIR       (--smoke: tiny sizes on the CPU, TRITON_INTERPRET=1)

(a) Correctness at the mamba2-370m sizes against the float64 reference, outputs poisoned with NaN first: `rms_norm`
    and `add_rms_norm` (residual None, given, given in place) at [1, 1024], [256, 1024], [8192, 1024] with bf16 x and
    weight (and one fp32 case), fp32 residual; `gated_rms_norm` at D=2048 with groups of 2048 and 256, both
    `norm_before_gate`, x and gate strided column slices of one [N, 4384] bf16 projection. Also the fraction of
    elements bit-equal to the PyTorch reference path in the same dtypes (information), and one CUDA-graph capture
    replayed on new inputs.
(b) `triton.testing.do_bench` medians, Triton against the reference, at N = 1, 256, 8192 (and N=1 replayed from a CUDA
    graph of 10 calls, per call: the decode step runs in a graph), with the bytes moved (each input read once, each
    output written once) over the time as GB/s, against a device-to-device copy measured in the same run.

Writes DIR/norm.json, prints a short table last, and exits 1 when a check fails.
"""

from __future__ import annotations

import json
import sys

import torch

from kvfree.bench import harness
from kvfree.bench.kernels.common import record, sweep_text
from kvfree.kernels.common import poisoned_outputs

f64 = torch.float64
REAL = {"rows": (1, 256, 8192), "D": 1024, "D_inner": 2048, "groups": (2048, 256), "proj": 4384, "copy_mib": 512}
SMOKE = {"rows": (1, 5, 33), "D": 96, "D_inner": 128, "groups": (128, 32), "proj": 300, "copy_mib": 1}
SZ = harness.Sizes(REAL, SMOKE)
EPS = 1e-5
COPY = {"key": "copy_GBps", "label": "copy"}  # the result's name for the copy bandwidth, and the table's


def measure_copy(res: dict, dev: torch.device, log: harness.RunLog) -> None:
    """A device-to-device copy of copy_mib, bytes read plus written (`harness.measure_hbm`)."""
    harness.measure_hbm(res, dev, log, **COPY, gib=SZ["copy_mib"] / 1024)


SCRIPT = harness.CheckScript("norm", __doc__, SZ, sections=("timing",), measure=measure_copy)
main = SCRIPT.main  # `python -m kvfree.bench.kernels.norm` (not an --op of `python -m kvfree.bench.kernels`)
say = SCRIPT.log.say
rel = harness.rel_err


@SCRIPT.shapes
def shapes() -> dict[str, str]:
    return {"rms/add": f"[N, {SZ['D']}] bf16 x and weight, fp32 residual",
            "gated": f"D={SZ['D_inner']}, x/gate column slices of [N, {SZ['proj']}] bf16, bf16 weight"}  # fmt: skip


def inputs(N: int, dev: torch.device, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Layer-like inputs: the residual-stream pieces at width D, and gate/x as column slices of one projection."""
    D, Di = SZ["D"], SZ["D_inner"]
    proj = torch.randn(N, SZ["proj"], generator=gen, device=dev).to(dtype)
    return {
        "x": torch.randn(N, D, generator=gen, device=dev).to(dtype),
        "res": 4 * torch.randn(N, D, generator=gen, device=dev),
        "w": (1 + 0.3 * torch.randn(D, generator=gen, device=dev)).to(dtype),
        "gate": proj[:, :Di],
        "xi": proj[:, Di : 2 * Di],
        "wi": (1 + 0.3 * torch.randn(Di, generator=gen, device=dev)).to(dtype),
    }


# ---------------------------------------------------------------------------------------------------------------------
@SCRIPT.step("checks")
def check_correctness(dev: torch.device, res: dict) -> None:
    from kvfree.kernels.norm import fused
    from kvfree.kernels.norm import reference as ref

    with poisoned_outputs():  # an element a kernel does not write shows as NaN
        _check_all(dev, res, fused, ref)


def _record(res: dict, name: str, errs: dict, tol: float, extra: dict | None = None) -> None:
    r = {k: v for k, v in errs.items()} | {"tol": tol} | (extra or {})
    flags = [v for k, v in (extra or {}).items() if k.endswith("ok")]
    r["ok"] = bool(all(v <= tol for v in errs.values()) and all(flags))
    record(res, SCRIPT.log, "checks", name, r, f"check {name}")


def _check_all(dev, res, fused, ref) -> None:
    gen = torch.Generator(device=dev).manual_seed(1234)
    for N in SZ["rows"]:
        dtypes = (torch.bfloat16, torch.float32) if SZ["rows"].index(N) == 1 else (torch.bfloat16,)
        for dtype in dtypes:
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            t = f"N{N}_{'bf16' if dtype == torch.bfloat16 else 'fp32'}"
            d = inputs(N, dev, gen, dtype)
            x, r0, w = d["x"], d["res"], d["w"]
            y = fused.rms_norm(x, w, EPS)
            same = (y == ref.rms_norm(x, w, EPS)).float().mean().item()
            _record(res, f"rms_{t}", {"y_rel": rel(y, ref.rms_norm(x.to(f64), w.to(f64), EPS))}, tol,
                    {"bit_equal_to_reference_path": same})
            for mode in ("none", "given", "inplace"):
                resid = None if mode == "none" else r0.clone()
                want_y, want_r = ref.add_rms_norm(x.to(f64), None if resid is None else resid.to(f64), w.to(f64), EPS)
                y, r = fused.add_rms_norm(x, resid, w, EPS, inplace=mode == "inplace")
                extra = {"inplace_ok": r is resid} if mode == "inplace" else {}
                _record(res, f"add_{mode}_{t}", {"y_rel": rel(y, want_y), "r_rel": rel(r, want_r)}, tol, extra)
            xi, gate, wi = d["xi"], d["gate"], d["wi"]
            for gs in SZ["groups"]:
                for nbg in (False, True):
                    y = fused.gated_rms_norm(xi, gate, wi, gs, EPS, nbg)
                    want = ref.gated_rms_norm(xi.to(f64), gate.to(f64), wi.to(f64), gs, EPS, nbg)
                    same = (y == ref.gated_rms_norm(xi, gate, wi, gs, EPS, nbg)).float().mean().item()
                    _record(res, f"gated_g{gs}_{'nbg' if nbg else 'gate_first'}_{t}", {"y_rel": rel(y, want)}, tol,
                            {"bit_equal_to_reference_path": same})
    if dev.type == "cuda":
        _check_graph(dev, res, fused, ref, gen)


def _check_graph(dev, res, fused, ref, gen) -> None:
    """Capture (gated norm, in-place add-norm) in a CUDA graph, refill the inputs, replay: same as eager calls."""
    st = inputs(4, dev, gen)
    gs = SZ["groups"][1]
    out = {}

    def step() -> None:
        out["g"] = fused.gated_rms_norm(st["xi"], st["gate"], st["wi"], gs, EPS)
        out["y"], out["r"] = fused.add_rms_norm(st["x"], st["res"], st["w"], EPS, inplace=True)

    s = torch.cuda.Stream()  # warm up (compile) outside the capture, on a side stream as torch asks
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new = inputs(4, dev, gen)
    for k in ("x", "res", "w", "gate", "xi", "wi"):
        st[k].copy_(new[k])
    graph.replay()
    harness.sync()
    want_g = ref.gated_rms_norm(new["xi"], new["gate"], new["wi"], gs, EPS)
    want_y, want_r = ref.add_rms_norm(new["x"], new["res"], new["w"], EPS)
    errs = {"g_rel": rel(out["g"], want_g), "y_rel": rel(out["y"], want_y), "r_rel": rel(out["r"], want_r)}
    _record(res, "cuda_graph_replay", errs, 1e-2, {"inplace_ok": out["r"] is st["res"]})


# ---------------------------------------------------------------------------------------------------------------------
@SCRIPT.step("timing")
def time_all(dev: torch.device, res: dict) -> None:
    gen = torch.Generator(device=dev).manual_seed(5)
    rows = SZ["rows"]
    for i, N in enumerate(rows):
        _time_rows(N, inputs(N, dev, gen), dev, res, res["copy_GBps"], sweep=i == len(rows) - 1)


def _time_rows(N: int, d: dict, dev: torch.device, res: dict, hbm: float, sweep: bool) -> None:
    from kvfree.kernels.norm import fused
    from kvfree.kernels.norm import reference as ref

    D, Di = SZ["D"], SZ["D_inner"]
    x, r0, w, xi, gate, wi = d["x"], d["res"], d["w"], d["xi"], d["gate"], d["wi"]
    resid = r0.clone()
    add_bytes = N * D * (2 + 4 + 4 + 2) + D * 2  # x bf16, residual fp32 in and out, y bf16
    ops = {  # name: (triton, reference, bytes moved: inputs once, outputs once)
        "rms": (lambda: fused.rms_norm(x, w, EPS), lambda: ref.rms_norm(x, w, EPS), N * D * 4 + D * 2),
        "add": (lambda: fused.add_rms_norm(x, r0, w, EPS), lambda: ref.add_rms_norm(x, r0, w, EPS), add_bytes),
        "add_inplace": (lambda: fused.add_rms_norm(x, resid, w, EPS, inplace=True), None, add_bytes),
    }
    for gs in SZ["groups"]:
        ops[f"gated_g{gs}"] = (lambda gs=gs: fused.gated_rms_norm(xi, gate, wi, gs, EPS),
                               lambda gs=gs: ref.gated_rms_norm(xi, gate, wi, gs, EPS), N * Di * 6 + Di * 2)
    for name, (tri, refn, nbytes) in ops.items():
        row = {"bytes": nbytes, "floor_us": nbytes / hbm / 1e3}
        ms = harness.bench(tri, dev)
        row |= {"triton_us": ms * 1e3, "triton_GBps": nbytes / ms / 1e6}
        if refn is not None:
            ms = harness.bench(refn, dev)
            row |= {"reference_us": ms * 1e3, "reference_GBps": nbytes / ms / 1e6}
        if N == 1 and dev.type == "cuda":
            row["triton_graph_us"] = harness.graph_per_call_ms(tri) * 1e3
            if refn is not None:
                row["reference_graph_us"] = harness.graph_per_call_ms(refn) * 1e3
        record(res, SCRIPT.log, "timing", f"{name}_N{N}", row, f"time {name} N={N}")
    if sweep:  # launch configurations around the default
        us = {}
        for bn, nw in [(1, 4), (1, 8), (2, 8), (4, 8)]:
            us[f"add_BN{bn}_w{nw}"] = harness.bench(
                lambda bn=bn, nw=nw: fused.add_rms_norm(x, r0, w, EPS, block_n=bn, num_warps=nw), dev) * 1e3
            us[f"gated_g{Di}_BN{bn}_w{nw}"] = harness.bench(
                lambda bn=bn, nw=nw: fused.gated_rms_norm(xi, gate, wi, Di, EPS, block_n=bn, num_warps=nw), dev) * 1e3
        res["sweep_us"] = us
        say(f"sweep N={N}: {json.dumps(us)}")


@SCRIPT.table
def table(res: dict) -> str:
    nan = float("nan")
    lines = harness.table_head(res, **COPY)
    worst: dict[str, float] = {}
    for k, v in res["checks"].items():
        kind = "fp32" if k.endswith("fp32") else "bf16"
        worst[kind] = max(worst.get(kind, 0.0), *(e for n, e in v.items() if n.endswith("_rel")))
    lines.append("  worst rel err: " + ", ".join(f"{k} {e:.1e}" for k, e in worst.items()))
    lines.append(f"{'op':20s} {'triton us':>10s} {'GB/s':>7s} {'floor us':>9s} {'ref us':>8s} "
                 f"{'graph tri/ref us':>17s}")
    for k, v in res["timing"].items():
        g = ""
        if "triton_graph_us" in v:
            g = f"{v['triton_graph_us']:.2f}/{v.get('reference_graph_us', nan):.2f}"
        lines.append(f"  {k:18s} {v['triton_us']:10.2f} {v['triton_GBps']:7.0f} {v['floor_us']:9.2f} "
                     f"{v.get('reference_us', nan):8.1f} {g:>17s}")
    if res.get("sweep_us"):
        lines.append("  sweep us: " + sweep_text(res["sweep_us"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
