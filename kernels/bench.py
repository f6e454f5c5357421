"""Benchmark the ops of kernels/ at a given size: median time over repeats, and the memory-bandwidth floor.

    python -m kvfree.kernels.bench                      # CPU, small shapes
    python -m kvfree.kernels.bench --device cuda --preset mamba2-130m --batch 1 64 256

For decode, the floor is the state bytes one step must read and write (the whole `[B, H, P, N]` SSM state, in
and out, fp32) divided by the HBM bandwidth (3 TB/s on an H100 SXM unless --hbm-tbps says otherwise); a decode
step cannot be faster than that, so `floor / measured` is how close the op is to the hardware.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvfree.kernels.mamba2 import ssd_chunked, ssd_step

SHAPES = {
    # heads, head_dim, state, groups: the SSM of each preset's layers (engine/presets.py)
    "tiny": (8, 32, 32, 1),
    "mamba2-130m": (24, 64, 128, 1),
    "mamba2-370m": (32, 64, 128, 1),
}


def timeit(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `repeats` runs (synchronising CUDA around each)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_ssd(
    preset: str, batches: list[int], prefill_tokens: int, chunk: int, device: torch.device, repeats: int, hbm: float
) -> list[dict]:
    H, P, N, G = SHAPES[preset]
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    A = -torch.rand(H, generator=gen, device=device) * 4 - 0.5
    D = randn(H)
    for B in batches:
        x, dt = randn(B, H, P), F.softplus(randn(B, H))
        Bm, Cm, state = randn(B, G, N), randn(B, G, N), randn(B, H, P, N)
        seconds = timeit(functools.partial(ssd_step, x, dt, A, Bm, Cm, D, state), device, repeats)
        state_bytes = 2 * state.numel() * 4  # read and write the fp32 state
        rows.append(
            {
                "op": "ssd_step",
                "preset": preset,
                "batch": B,
                "tokens": B,
                "ms": seconds * 1e3,
                "floor_ms": state_bytes / (hbm * 1e12) * 1e3,
            }
        )
    T = prefill_tokens
    x, dt = randn(T, H, P), F.softplus(randn(T, H))
    Bm, Cm, state = randn(T, G, N), randn(T, G, N), randn(H, P, N)
    seconds = timeit(functools.partial(ssd_chunked, x, dt, A, Bm, Cm, D, state, chunk), device, repeats)
    rows.append({"op": "ssd_chunked", "preset": preset, "batch": 1, "tokens": T, "ms": seconds * 1e3, "floor_ms": None})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hbm-tbps", type=float, default=3.0, help="memory bandwidth for the floor, TB/s")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    rows = bench_ssd(args.preset, args.batch, args.prefill_tokens, args.chunk, device, args.repeats, args.hbm_tbps)
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=2)
    print(f"# {env}")
    print(f"{'op':<12} {'preset':<12} {'batch':>6} {'tokens':>7} {'median ms':>10} {'tokens/s':>11} {'floor ms':>9}")
    for r in rows:
        floor = f"{r['floor_ms']:.4f}" if r["floor_ms"] is not None else "-"
        print(
            f"{r['op']:<12} {r['preset']:<12} {r['batch']:>6} {r['tokens']:>7} {r['ms']:>10.3f} "
            f"{r['tokens'] / r['ms'] * 1e3:>11.0f} {floor:>9}"
        )


if __name__ == "__main__":
    main()
