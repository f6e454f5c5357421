"""`kvfree bench step` (the default of `kvfree bench`): time a preset's model step on this machine, against the floor
measured in the same run.

    kvfree bench step --preset mamba2-370m --batch 1 16 64 256 --prefill-tokens 8192 # GPU: bf16, CUDA graphs
    python -m kvfree.bench.step --preset tiny --device cpu --batch 1 8             # CPU reference path
    kvfree bench offline --prompts 256 --prompt-tokens 512 --max-tokens 64         # LLM.generate end to end

For each batch size B the decode step (embedding to logits, one token for B sessions in a B-slot pool) is timed
through the CUDA graph the server replays and eagerly; one long prompt is timed through prefill. The floor of a
decode step is the bytes it must move, every weight read once plus each session's state read and written once,
over the HBM bandwidth measured in the same process. The graphs are also checked: greedy tokens with and without
them must agree. Prints a table and writes JSON (device, versions, date, shapes, medians, floors) under docs/bench/.

`--offline` times the whole engine instead (kvfree/bench/offline.py): `LLM.generate` of `--prompts` random prompts,
prefill included, then one prompt alone; with `--profile`, a few decode steps' device busy time against their wall
time and the host functions they spend it in.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch

from kvfree.bench.harness import environment, hbm_bandwidth, median_ms, write_json
from kvfree.engine.core.cuda_graphs import DecodeGraphs
from kvfree.engine.core.model_runner import graph_blockers
from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import resolve_device, resolve_dtype
from kvfree.engine.model.presets import PRESETS, preset_config
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool


def build_model(
    preset: str, device: torch.device, dtype: torch.dtype, seed: int = 0, num_layers: int | None = None
) -> HybridLM:
    """A random-initialised model of `preset` (only its first `num_layers` layers, when given), prepared for serving
    as `load_model` prepares a checkpoint."""
    torch.manual_seed(seed)
    config = preset_config(preset)
    if num_layers is not None:
        config = ModelConfig.from_dict({**PRESETS[preset], "layers": PRESETS[preset]["layers"][:num_layers]})
    model = HybridLM(config)
    model.init_weights(seed)
    for layer in model.layers:
        layer.mixer.on_load()
    return model.to(device=device, dtype=dtype).eval()


def weight_bytes(model: HybridLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_decode(model: HybridLM, batch: int, bandwidth: float | None, graphs: bool) -> dict[str, Any]:
    """One decode step of `batch` sessions: graph replay (when possible) and eager, with the floor."""
    device = model.device
    pool = StatePool(model, capacity=batch, max_context=2048)
    slots = [pool.alloc() for _ in range(batch)]
    gen = torch.Generator(device=device).manual_seed(batch)
    # Non-zero states and fresh ids: a step on zeros can run faster than on real data.
    for state in pool.tensors:
        for t in state.values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(t.dtype) * 0.1)
    ids = torch.randint(0, model.config.vocab_size, (batch,), generator=gen, device=device)
    step = StepBatch.decode(slots, device)
    row: dict[str, Any] = {"batch": batch}
    with torch.inference_mode():
        row["eager_ms"] = median_ms(lambda: model.decode(ids, pool.tensors, step), device)
        if graphs:
            captured = DecodeGraphs(
                lambda b: model.decode(ids, pool.tensors, b), batch, pool.scratch_slot, device, sizes=[batch]
            )
            row["graph_ms"] = median_ms(lambda: captured.replay(slots), device)
    state_bytes = pool.bytes_per_session() * batch
    row["bytes"] = weight_bytes(model) + 2 * state_bytes
    if bandwidth:
        row["floor_ms"] = row["bytes"] / bandwidth * 1e3
        best = row.get("graph_ms", row["eager_ms"])
        row["x_floor"] = best / row["floor_ms"]
    row["tokens_per_s"] = batch / (row.get("graph_ms", row["eager_ms"]) / 1e3)
    return row


def check_graph_tokens(model: HybridLM, batch: int, steps: int = 16) -> bool:
    """Greedy tokens of `batch` sessions agree with and without CUDA graphs (same starting states)."""
    device = model.device
    pool = StatePool(model, capacity=batch)
    slots = [pool.alloc() for _ in range(batch)]
    gen = torch.Generator(device=device).manual_seed(7)
    prompt = torch.randint(0, model.config.vocab_size, (batch * 24,), generator=gen, device=device)
    with torch.inference_mode():
        logits = model.prefill(prompt, pool.tensors, StepBatch.prefill(slots, [24] * batch, device))
        saved = [{k: t.clone() for k, t in s.items()} for s in pool.tensors]
        first = logits.argmax(-1)

        def run(step_fn) -> list[list[int]]:
            for state, copy in zip(pool.tensors, saved, strict=True):
                for k, t in state.items():
                    t.copy_(copy[k])
            ids, out = first, []
            for _ in range(steps):
                ids = step_fn(ids).argmax(-1)
                out.append(ids.tolist())
            return out

        eager = run(lambda ids: model.decode(ids, pool.tensors, StepBatch.decode(slots, device)))
        tokens = first.clone()  # the graph's input: each replay reads the ids copied into it
        captured = DecodeGraphs(
            lambda b: model.decode(tokens[: len(b.state_indices)], pool.tensors, b), batch, pool.scratch_slot, device
        )

        def graphed_step(ids: torch.Tensor) -> torch.Tensor:
            tokens.copy_(ids)
            return captured.replay(slots)

        graphed = run(graphed_step)
    return eager == graphed


def bench_prefill(model: HybridLM, tokens: int) -> dict[str, Any]:
    """One prompt of `tokens` tokens through prefill (eager: its shape changes every step)."""
    device = model.device
    pool = StatePool(model, capacity=1, max_context=tokens + 1)
    slot = pool.alloc()
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=gen, device=device)
    batch = StepBatch.prefill([slot], [tokens], device)

    def prefill() -> torch.Tensor:
        restart_prompts(pool)
        return model.prefill(ids, pool.tensors, batch)

    with torch.inference_mode():
        ms = median_ms(prefill, device, rep_ms=500)
    return {"tokens": tokens, "ms": ms, "tokens_per_s": tokens / (ms / 1e3)}


def restart_prompts(pool: StatePool) -> None:
    """Empty every KV cache of `pool` (its lengths to 0), so that a prompt timed over and over starts afresh each
    time: a cache sized for one prompt would otherwise overflow on the second call (the recurrent layers' states
    just go on from where they are, which costs the same)."""
    for state in pool.tensors:
        if "length" in state:
            state["length"].zero_()


def profile_step(model: HybridLM, batch: int, prefill_tokens: int = 0, steps: int = 3) -> dict[str, Any]:
    """Device time per kernel name for `steps` eager decode steps of `batch` sessions (or one prefill of
    `prefill_tokens` tokens), from the torch profiler: what a step is made of, and where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    device = model.device
    capacity = 1 if prefill_tokens else batch
    pool = StatePool(model, capacity=capacity, max_context=max(prefill_tokens, 1) + 1)
    slots = [pool.alloc() for _ in range(capacity)]
    gen = torch.Generator(device=device).manual_seed(3)
    if prefill_tokens:
        ids = torch.randint(0, model.config.vocab_size, (prefill_tokens,), generator=gen, device=device)
        step_batch, steps = StepBatch.prefill(slots, [prefill_tokens], device), 1

        def step() -> torch.Tensor:
            restart_prompts(pool)
            return model.prefill(ids, pool.tensors, step_batch)
    else:
        ids = torch.randint(0, model.config.vocab_size, (batch,), generator=gen, device=device)
        step_batch = StepBatch.decode(slots, device)

        def step() -> torch.Tensor:
            return model.decode(ids, pool.tensors, step_batch)

    with torch.inference_mode():
        step()
        torch.cuda.synchronize(device)
        # Host time: how long Python takes to issue one step (no sync inside). When it exceeds the device time, the
        # GPU waits for launches and the step is host-bound.
        start = time.perf_counter()
        for _ in range(steps):
            step()
        host_us = (time.perf_counter() - start) / steps * 1e6
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels.setdefault(event.name, []).append(event.device_time)
    rows = sorted(
        ({"kernel": k[:90], "per_step": len(v) / steps, "us_per_step": sum(v) / steps} for k, v in kernels.items()),
        key=lambda r: -r["us_per_step"],
    )
    return {
        "batch": batch,
        "prefill_tokens": prefill_tokens,
        "kernels_per_step": sum(r["per_step"] for r in rows),
        "device_us_per_step": sum(r["us_per_step"] for r in rows),
        "host_us_per_step": host_us,
        "top": rows[:15],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfree bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="mamba2-370m", choices=sorted(PRESETS))
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256], help="decode batch sizes")
    parser.add_argument("--prefill-tokens", type=int, default=8192, help="one prompt of this length (0: skip)")
    parser.add_argument("--enforce-eager", action="store_true", help="time eager decode only (no CUDA graphs)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="GPU: also profile a decode step at the first and last batch size "
        "and the prefill, kernel by kernel (torch profiler)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: docs/bench/model-PRESET.json)")
    g = parser.add_argument_group("offline throughput (--offline)")
    g.add_argument("--offline", action="store_true", help="time LLM.generate end to end instead of the model step")
    g.add_argument("--prompts", type=int, default=256, help="prompts generated at once (and state-pool slots)")
    g.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt")
    g.add_argument("--max-tokens", type=int, default=64, help="greedy tokens generated per prompt (EOS ignored)")
    g.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per engine step (LLM prefill_chunk)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs the model is split among")
    args = parser.parse_args(argv)
    if args.offline:
        return offline_main(args)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = build_model(args.preset, device, dtype)
    blockers = graph_blockers(model)
    use_graphs = device.type == "cuda" and not args.enforce_eager and not blockers
    bandwidth = hbm_bandwidth(device)
    decode = [bench_decode(model, b, bandwidth, use_graphs) for b in args.batch]
    prefill = bench_prefill(model, args.prefill_tokens) if args.prefill_tokens else None
    graphs_agree = check_graph_tokens(model, min(args.batch[-1], 8)) if use_graphs else None
    profiles = []
    if args.profile and device.type == "cuda":
        profiles = [profile_step(model, b) for b in sorted({args.batch[0], args.batch[-1]})]
        if args.prefill_tokens:
            profiles.append(profile_step(model, 1, prefill_tokens=args.prefill_tokens))
    payload = {
        "what": "model decode step (embedding to logits) and one-prompt prefill, random weights",
        "preset": args.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()),
        "weight_bytes": weight_bytes(model),
        "environment": environment(device),
        "hbm_bytes_per_s": bandwidth,
        "cuda_graphs": use_graphs,
        "graph_blockers": blockers,
        "graph_tokens_match_eager": graphs_agree,
        "decode": decode,
        "prefill": prefill,
        "profiles": profiles,
    }
    out = write_json(args.out or Path("docs/bench") / f"model-{args.preset}.json", payload)

    env = payload["environment"]
    print(
        f"# {args.preset} ({payload['params'] / 1e6:.0f}M params, {payload['dtype']}) on {env['device']}, "
        f"torch {env['torch']}, triton {env['triton']}; HBM {bandwidth / 1e12 if bandwidth else math.nan:.2f} TB/s"
    )
    if blockers:
        print(f"# eager decode: {'; '.join(blockers)}")
    print(f"{'batch':>6} {'graph ms':>9} {'eager ms':>9} {'floor ms':>9} {'x floor':>8} {'tokens/s':>10}")
    for r in decode:
        print(
            f"{r['batch']:>6} {r.get('graph_ms', math.nan):>9.3f} {r['eager_ms']:>9.3f} "
            f"{r.get('floor_ms', math.nan):>9.3f} {r.get('x_floor', math.nan):>8.2f} {r['tokens_per_s']:>10.0f}"
        )
    if prefill:
        print(f"prefill of {prefill['tokens']} tokens: {prefill['ms']:.1f} ms, {prefill['tokens_per_s']:,.0f} tokens/s")
    if graphs_agree is not None:
        print(f"greedy tokens with and without CUDA graphs agree: {graphs_agree}")
    for prof in profiles:
        what = f"prefill of {prof['prefill_tokens']} tokens" if prof["prefill_tokens"] else f"decode B={prof['batch']}"
        print(
            f"## profile, {what} (eager): {prof['kernels_per_step']:.0f} kernels, "
            f"{prof['device_us_per_step']:.0f} us of device time and {prof['host_us_per_step']:.0f} us of host time "
            "(issuing its launches) per step"
        )
        for r in prof["top"][:10]:
            print(f"  {r['us_per_step']:>9.1f} us  {r['per_step']:>6.0f}x  {r['kernel']}")
    print(f"wrote {out}")
    return 0


def offline_main(args: argparse.Namespace) -> int:
    """`--offline`: LLM.generate throughput of a random-initialised preset (written to a temporary checkpoint)."""
    import tempfile

    from kvfree.bench.offline import offline_run, profile_steps
    from kvfree.engine.llm import LLM
    from kvfree.engine.model.presets import init_checkpoint

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    with tempfile.TemporaryDirectory() as tmp:
        path = init_checkpoint(args.preset, Path(tmp) / args.preset, dtype=dtype)
        llm = LLM(
            path,
            device=str(device),
            dtype=dtype,
            max_sessions=args.prompts,
            prefill_chunk=args.max_batch_tokens,
            enforce_eager=args.enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    # Warm-up: Triton compiles, the allocator grows, and every prefill graph a step can meet is captured, as a
    # server does at start-up (an LLM captures a bucket on its first step, which the timed runs must not meet).
    llm.runner.capture_prefill_graphs(args.max_batch_tokens)
    offline_run(llm, min(args.prompts, 8), args.prompt_tokens, 4)
    runs = [offline_run(llm, args.prompts, args.prompt_tokens, args.max_tokens)]
    if args.prompts > 1:
        runs.append(offline_run(llm, 1, args.prompt_tokens, args.max_tokens))
    profile = None
    if args.profile and device.type == "cuda":
        profile = profile_steps(llm, args.prompts, args.prompt_tokens)
    cuda_graphs = llm.runner.graphs is not None
    llm.close()  # (the other tensor-parallel ranks, if any)
    # The floor of a full decode step on one GPU: every weight (of its part) read once, each session's state (its
    # part) read and written once.
    bandwidth = hbm_bandwidth(device)
    floor_bytes = weight_bytes(llm.model) + 2 * args.prompts * llm.pool.bytes_per_session(part=True)
    floor_ms = floor_bytes / bandwidth * 1e3 if bandwidth else None
    for r in runs:
        if floor_ms is not None and r["prompts"] == args.prompts:
            r["decode_floor_ms"] = floor_ms
            r["decode_x_floor"] = r["decode_step_ms"] / floor_ms
    payload = {
        "what": "LLM.generate end to end (prefill included), greedy, EOS ignored, random weights and prompts",
        "preset": args.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "tensor_parallel_size": args.tensor_parallel_size,
        "environment": environment(device),
        "cuda_graphs": cuda_graphs,
        "overlap": llm.engine.overlap,
        "max_batch_tokens": args.max_batch_tokens,
        "hbm_bytes_per_s": bandwidth,
        "decode_floor_bytes": floor_bytes,
        "runs": runs,
        "profile": profile,
    }
    out = write_json(args.out or Path("docs/bench") / f"offline-{args.preset}.json", payload)
    env = payload["environment"]
    print(f"# {args.preset} ({payload['dtype']}) on {env['device']}, torch {env['torch']}: LLM.generate")
    if floor_ms is not None:
        print(
            f"# decode floor at {args.prompts} sessions: {floor_ms:.2f} ms ({floor_bytes / 1e9:.1f} GB at "
            f"{bandwidth / 1e12:.2f} TB/s measured here)"
        )
    print(
        f"{'prompts':>8} {'tokens/s':>10} {'decode tok/s':>13} {'wall s':>8} {'step ms':>8} {'host ms':>8} "
        f"{'prefill s':>10}"
    )
    for r in runs:
        print(
            f"{r['prompts']:>8} {r['output_tokens_per_s']:>10,.0f} {r['decode_phase_tokens_per_s']:>13,.0f} "
            f"{r['wall_s']:>8.2f} {r['decode_step_ms']:>8.2f} {r['decode_host_ms']:>8.2f} {r['prefill_s']:>10.2f}"
        )
    for phase in ("prefill", "decode") if profile else ():
        p = profile[phase]
        print(
            f"## {profile['batch']} prompts, a {phase} step: {p['step_ms']:.2f} ms, the device busy "
            f"{p['device_busy_ms']:.2f} ms of it (idle {p['device_idle_fraction']:.0%}); host functions:"
        )
        for f in p["host_functions"][:10]:
            print(f"  {f['ms_per_step']:>8.3f} ms {f['calls_per_step']:>8.0f}x  {f['function']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
