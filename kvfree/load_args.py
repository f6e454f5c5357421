"""How a model is loaded, as command-line flags: shared by `kvfree generate`, `kvfree serve` and the benchmarks
that start a server (`kvfree bench serve`, `kvfree bench sessions`)."""

from __future__ import annotations

import argparse


def add_load_args(p: argparse.ArgumentParser) -> None:
    """How to load a model: device, dtype and config overrides (shared by generate and serve)."""
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value at load, e.g. --set gka.num_iter=10 (VALUE is JSON; repeatable)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run without CUDA graphs (default: every decode batch size replays a graph captured at "
        "start-up, and prefill steps of all-Mamba-2 models one captured per token bucket, where the mixers allow it)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split every layer's heads among N processes, one per GPU (cuda:0 .. cuda:N-1; with --device cpu, N CPU "
        "processes): a model too big for one GPU, or more room for sessions (default: 1)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="the attention layers' KV cache: auto (the model's dtype) or fp8 (e4m3 with a scale per session and KV "
        "head: half the bytes of bf16, so about twice the sessions at long context)",
    )
