"""`python -m kvfree.bench.layers`: one mixer layer of a preset timed as the engine runs it, on a CUDA GPU.

    python -m kvfree.bench.layers --preset lattice-110m [--kind lattice] [--out docs/bench/layer-lattice.json]
    python -m kvfree.bench.layers --preset tiny-lattice --smoke --out DIR/x.json   # the script, on the CPU

The layer is the preset's mixer of `--kind` (default: its first non-Mamba-2 kind) at the preset's sizes with
random bf16 weights, a state pool of 512 rows and `on_load` applied as at checkpoint load. Decode at B = 1, 64, 256
(one token per session at random pool rows): per step replayed from a CUDA graph of 10 steps (as the engine runs
decode) and eager; prefill of 8 x 4,096 packed tokens (eager); a per-kernel device-time profile (torch profiler) of
the B=1 and largest decode steps and of the prefill. The kernel check scripts (`python -m kvfree.bench.kernels
--op ...`) time the ops alone; this is the whole layer: projections, op(s), output projection.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvfree.bench.harness import environment, graph_per_call_ms, median_ms, sync, write_json
from kvfree.engine.model.layers import build_mixer
from kvfree.engine.model.presets import PRESETS, preset_config
from kvfree.engine.model.step_batch import StepBatch

REAL = {"pool": 512, "decode": (1, 64, 256), "prefill": [4096] * 8}
SMOKE = {"pool": 8, "decode": (1, 3), "prefill": [16, 8]}  # the script itself on the CPU (reference path)
SZ = REAL


def make_layer(preset: str, kind: str | None, device: torch.device) -> tuple[torch.nn.Module, dict, str]:
    """(the mixer, its state pool tensors `{name: [SZ['pool'], ...]}` reset for new sessions, its kind)."""
    config = preset_config(preset)
    kind = kind or next((k for k in config.layers if k != "mamba2"), config.layers[0])
    if kind not in config.layers:
        raise ValueError(f"preset {preset!r} has no {kind!r} layer; its kinds: {sorted(set(config.layers))}")
    torch.manual_seed(0)
    mixer = build_mixer(kind, config)
    mixer.on_load()
    mixer = mixer.to(device, torch.bfloat16).eval()
    state = {name: torch.zeros(SZ['pool'], *spec.shape, dtype=spec.dtype or torch.bfloat16, device=device)
             for name, spec in mixer.state_specs(4096).items()}  # fmt: skip
    mixer.reset_state(state, torch.arange(SZ['pool'], device=device))
    return mixer, state, kind


def profile(fn, steps: int = 3) -> dict[str, float]:
    """Device microseconds per call of each kernel of `fn` (the dozen largest)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    sync()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync()
    per = {e.key[:60]: e.device_time_total / steps for e in prof.key_averages() if e.device_time_total > 0}
    return {k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:12]}


def run(preset: str, kind: str | None, dev: torch.device) -> dict:
    mixer, state, kind = make_layer(preset, kind, dev)
    hidden = preset_config(preset).hidden_size
    gen = torch.Generator(device=dev).manual_seed(1)
    what = f"one {kind} layer of {preset}, bf16 weights, {SZ['pool']}-row pool"
    res = environment(dev) | {"what": what, "preset": preset, "kind": kind, "decode": {}, "prefill": {}, "profile": {}}
    with torch.inference_mode():
        calls = {}
        for B in SZ['decode']:
            x = torch.randn(B, hidden, generator=gen, device=dev).to(torch.bfloat16)
            batch = StepBatch.decode(torch.randperm(SZ['pool'], generator=gen, device=dev)[:B].to(torch.int32))
            fn = lambda x=x, batch=batch: mixer.decode(x, state, batch)  # noqa: E731
            # (graph_per_call_ms is NaN off a GPU)
            res["decode"][f"B{B}"] = {"graph_us": graph_per_call_ms(fn) * 1e3, "eager_us": median_ms(fn, dev) * 1e3}
            calls[f"decode_B{B}"] = fn
        T = sum(SZ['prefill'])
        x = torch.randn(T, hidden, generator=gen, device=dev).to(torch.bfloat16)
        slots = torch.randperm(SZ['pool'], generator=gen, device=dev)[: len(SZ['prefill'])].to(torch.int32)
        batch = StepBatch.prefill(slots, SZ['prefill'])
        calls["prefill"] = lambda: mixer.prefill(x, state, batch)
        ms = median_ms(calls["prefill"], dev)
        res["prefill"][f"{len(SZ['prefill'])}x{SZ['prefill'][0]}"] = {"ms": ms, "Mtok_s": T / ms / 1e3}
        for name in (f"decode_B{SZ['decode'][0]}", f"decode_B{SZ['decode'][-1]}", "prefill"):
            if dev.type == "cuda":
                res["profile"][name] = profile(calls[name])
    return res


def table(res: dict) -> str:
    lines = [f"# {res['what']} on {res['device']}, torch {res['torch']}, triton {res['triton']}",
             f"{'decode':8s} {'graph us':>9s} {'eager us':>9s}"]  # fmt: skip
    for k, v in res["decode"].items():
        lines.append(f"{k:8s} {v['graph_us']:9.1f} {v['eager_us']:9.1f}")
    for k, v in res["prefill"].items():
        lines.append(f"prefill {k}: {v['ms']:.3f} ms, {v['Mtok_s']:.2f} M tokens/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--kind", default=None, help="which mixer kind of the preset (default: its first non-mamba2)")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: docs/bench/layer-KIND.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script runs, times nothing")
    a = ap.parse_args(argv)
    global SZ
    if a.smoke:
        SZ, dev = SMOKE, torch.device("cpu")
    elif torch.cuda.is_available():
        dev = torch.device("cuda")
    else:
        print("kvfree.bench.layers needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    res = run(a.preset, a.kind, dev)
    path = write_json(a.out or Path("docs/bench") / f"layer-{res['kind']}.json", res)
    print(table(res))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
