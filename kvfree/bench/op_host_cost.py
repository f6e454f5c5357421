"""Host cost of one op call, for every op a model's prefill and decode make: `python -m kvfree.bench.op_host_cost`.

    python -m kvfree.bench.op_host_cost --presets mamba2-370m echo-180m gka-2.8b lattice-110m bmojo-1.4b
    python -m kvfree.bench.op_host_cost --presets tiny-hybrid --device cpu          # the reference path

Each preset is built with random weights (its first `--layers` layers: an op's host cost does not depend on how
many layers follow). One eager prefill of `--prompts` x `--prompt-tokens` and one eager decode of 1 and of `--batch`
sessions run with every kernel op the layers import wrapped, so that the first call of each op (per mode and batch)
is recorded with its real arguments. Each recorded call is then replayed in rounds of `--calls` calls back to back
with no sync between them, timed on the host clock, behind a GPU sleep that outlasts the round: the host never waits
for the device, so its time per call is its own (Python, argument checks, allocation, Triton's dispatch and the
launch); the minimum over rounds is reported. The same calls then run back to back on the device, which gives the
device time per call; a row whose device time exceeds its host time is `device_bound` (the host is not the limit of
a stream of such calls). An empty Triton kernel, through kvfree's launcher and through Triton's own dispatch, and a
torch add give the floors in the same process. Writes JSON under docs/bench/ (the serving issue's targets: <= 10 µs
per decode op, <= 25 µs per prefill op) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import pkgutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import kvfree.engine.model.layers as layers_pkg
from kvfree.bench.harness import environment, write_json
from kvfree.bench.step import build_model
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool

TARGET_US = {"decode": 10.0, "prefill": 25.0}

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _nothing(x, n, B: tl.constexpr):
        pass

except ImportError:  # the CPU path runs without Triton
    _nothing = None


@dataclass
class Recorded:
    """One op's first call in one mode: the function and its arguments, to replay."""

    op: str
    mode: str  # "prefill" or "decode Bn"
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)


def _kernel_ops(module: Any) -> dict[str, Callable[..., Any]]:
    """The functions a layer module imported from `kvfree.kernels` (the ops it calls)."""
    return {
        name: obj
        for name, obj in vars(module).items()
        if inspect.isfunction(obj) and obj.__module__.startswith("kvfree.kernels") and not name.startswith("_")
    }


class OpRecorder:
    """Wraps every kernel op of every layer module; records the first call of each (op, mode)."""

    def __init__(self) -> None:
        self.mode = ""
        self.calls: dict[tuple[str, str], Recorded] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> OpRecorder:
        for info in pkgutil.iter_modules(layers_pkg.__path__):
            module = importlib.import_module(f"{layers_pkg.__name__}.{info.name}")
            for name, fn in _kernel_ops(module).items():
                self._undo.append((module, name, fn))
                setattr(module, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in reversed(self._undo):
            setattr(module, name, fn)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.setdefault((name, self.mode), Recorded(name, self.mode, fn, args, kwargs))
            return fn(*args, **kwargs)

        return recorded


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _sleep_cycles_per_us(device: torch.device) -> float:
    """How many `torch.cuda._sleep` cycles make a microsecond on this GPU (measured once)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    begin.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / (begin.elapsed_time(end) * 1e3)


def host_us(fn: Callable[[], object], device: torch.device, calls: int, rounds: int = 5) -> dict[str, Any]:
    """Host and device microseconds per call of `fn`, over `rounds` rounds of `calls` calls.

    On a GPU each round first queues a sleep long enough to outlast the host's loop, so the host never waits for the
    device (its time is its own: the minimum over rounds, the least disturbed by the rest of the machine) and the
    calls then run back to back on the device (their time is the device's alone: the median).
    """
    for _ in range(3):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(3):
        fn()
    rough = (time.perf_counter() - start) / 3 * 1e6
    _sync(device)
    hosts, devices = [], []
    for _ in range(rounds):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(2 * rough * calls * _sleep_cycles_per_us(device)) + 1000)
            begin.record()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        hosts.append((time.perf_counter() - start) / calls * 1e6)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            devices.append(begin.elapsed_time(end) / calls * 1e3)
        else:
            _sync(device)
    return {
        "host_us": min(hosts),
        "host_us_median": statistics.median(hosts),
        "device_us": statistics.median(devices) if devices else None,
    }


def _empty_triton_kernel() -> Callable[[], None] | None:
    """A Triton kernel that does nothing, launched through kvfree's launcher: the launch floor (None without
    Triton)."""
    if _nothing is None:
        return None
    from kvfree.kernels.launcher import launch_kernel

    x = torch.empty(16, device="cuda")
    return lambda: launch_kernel(_nothing, (1,), x, 16, B=16)


def _empty_triton_kernel_jit() -> Callable[[], None] | None:
    """The same empty kernel through Triton's own `kernel[grid](...)` path (what the launcher saves)."""
    if _nothing is None:
        return None
    x = torch.empty(16, device="cuda")
    return lambda: _nothing[(1,)](x, 16, B=16)


def record_preset(preset: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> OpRecorder:
    """Run one prefill and decodes of `preset` (first `args.layers` layers) with every op recorded."""
    model = build_model(preset, device, dtype, num_layers=args.layers)
    sessions = max(args.batch, args.prompts)
    pool = StatePool(model, capacity=sessions, max_context=args.prompt_tokens + 64)
    if pool.bytes_per_token():
        # Attention layers append to their KV cache on every replayed call: room for all of them.
        pool = StatePool(model, capacity=sessions, max_context=(args.prompt_tokens + 1) * (2 * args.calls + 16))
    slots = [pool.alloc() for _ in range(sessions)]
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = model.config.vocab_size
    recorder = OpRecorder()
    with recorder, torch.inference_mode():
        recorder.mode = "prefill"
        ids = torch.randint(0, vocab, (args.prompts * args.prompt_tokens,), generator=gen).to(device)
        model.prefill(ids, pool.tensors, StepBatch.prefill(slots[: args.prompts], [args.prompt_tokens] * args.prompts,
                                                           device))
        for batch in sorted({1, args.batch}):
            recorder.mode = f"decode B{batch}"
            ids = torch.randint(0, vocab, (batch,), generator=gen).to(device)
            model.decode(ids, pool.tensors, StepBatch.decode(slots[:batch], device))
    _sync(device)
    return recorder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["mamba2-370m"], help="model presets whose ops to time")
    parser.add_argument("--layers", type=int, default=4, help="layers of each preset to build (default 4)")
    parser.add_argument("--prompts", type=int, default=4, help="sequences in the recorded prefill")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per sequence in the prefill")
    parser.add_argument("--batch", type=int, default=64, help="sessions in the larger recorded decode")
    parser.add_argument("--calls", type=int, default=64, help="calls per timed round (5 rounds per op)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/op-host-cost.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bf16": torch.bfloat16,
             "fp32": torch.float32}[args.dtype]

    floors: dict[str, Any] = {}
    x = torch.randn(1024, device=device)
    floors["torch_add"] = host_us(lambda: x + x, device, args.calls)
    if device.type == "cuda" and _nothing is not None:
        floors["empty_triton_kernel_launcher"] = host_us(_empty_triton_kernel(), device, args.calls)
        floors["empty_triton_kernel_jit"] = host_us(_empty_triton_kernel_jit(), device, args.calls)

    rows = []
    for preset in args.presets:
        recorder = record_preset(preset, device, dtype, args)
        with torch.inference_mode():
            for rec in recorder.calls.values():
                timing = host_us(lambda rec=rec: rec.fn(*rec.args, **rec.kwargs), device, args.calls)
                kind = "decode" if rec.mode.startswith("decode") else "prefill"
                # The device takes longer per call than the host: in a stream of such calls the host is not the limit.
                device_bound = timing["device_us"] is not None and timing["device_us"] > timing["host_us"]
                # On the CPU the op's work is the host's: the targets are for a GPU's host side.
                target = TARGET_US[kind] if device.type == "cuda" else None
                rows.append({
                    "preset": preset, "op": rec.op, "mode": rec.mode, **timing, "device_bound": device_bound,
                    "target_us": target, "met": None if target is None else (not device_bound and
                                                                              timing["host_us"] <= target),
                })  # fmt: skip
        del recorder
        if device.type == "cuda":
            torch.cuda.empty_cache()

    payload = {
        "what": "host microseconds per eager op call, issued back to back without a sync "
        "(kvfree/bench/op_host_cost.py)",
        "environment": environment(device),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "floors": floors,
        "ops": rows,
    }
    path = write_json(args.out, payload)
    print(f"{'preset':<14} {'op':<34} {'mode':<11} {'host µs':>8} {'device µs':>9} {'target':>6}")
    for name, timing in floors.items():
        dev = f"{timing['device_us']:.1f}" if timing["device_us"] is not None else "-"
        print(f"{'(floor)':<14} {name:<34} {'':<11} {timing['host_us']:>8.1f} {dev:>9}")
    for row in rows:
        dev = f"{row['device_us']:.1f}" if row["device_us"] is not None else "-"
        flag = "bound" if row["device_bound"] else {True: "met", False: "missed", None: "-"}[row["met"]]
        print(f"{row['preset']:<14} {row['op']:<34} {row['mode']:<11} {row['host_us']:>8.1f} {dev:>9} {flag:>6}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
