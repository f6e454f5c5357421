"""Decode throughput at long context: as many sessions as fit in GPU memory, each holding N tokens of context.

A primed hybrid (hmf's Qwen3 with half of its attention layers replaced) keeps a KV cache in its attention layers,
so its session state grows with context and the number of sessions that fit shrinks. This benchmark builds a model
(a checkpoint, or random weights in one of hmf's Qwen3 shapes: 8B or 32B with GKA, 8B with GDN), and for each
context length fills a state pool with as many sessions as fit, their states set as after N tokens (random keys,
values and recurrent states: a decode step reads them whatever they hold), then times batched decode steps over all
of them, captured in a CUDA graph where the model allows it. It writes a JSON with the sessions, the bytes per
session, the step time, tokens/s and the floor (bytes a step must read over the HBM bandwidth measured in the same
run).

With `--tensor-parallel-size N` the step runs on N GPUs, one process each, every layer's heads split among them
(docs/design/tensor-parallel.md): each GPU holds its part of every session, the pool sized by the GPU with the least
memory free; the figures per GPU are the tokens/s over N and the floor of one GPU's bytes.

    python -m kvfree.bench.context --hmf-8b-gka --contexts 16384 32768 65536 131072
    python -m kvfree.bench.context --hmf-32b-gka --tensor-parallel-size 4 --contexts 16384 131072
    python -m kvfree.bench.context --hmf-8b-gdn --contexts 16384 65536
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvfree.bench.harness import environment, hbm_bandwidth, median_ms, write_json
from kvfree.bench.step import check_graph_tokens
from kvfree.checkpoints.hf_hmf import convert_config
from kvfree.engine.core.cuda_graphs import DecodeGraphs
from kvfree.engine.core.model_runner import graph_blockers
from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import KV_CACHE_DTYPES, HybridLM
from kvfree.engine.model.loader import load_model
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.tensor_parallel import ONE_RANK, TensorParallel
from kvfree.engine.parallel.ranks import free_address
from kvfree.engine.state.pool import StatePool

# hmf's GKA-primed Qwen3-8B (amazon/GKA-primed-HQwen3-8B-Instruct): Qwen3-8B's shape, every other layer GKA.
HMF_QWEN3_8B_GKA: dict[str, Any] = {
    "model_type": "hybrid_qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "hybrid_override_pattern": "-".join(["*", "GKA"] * 18), "gka_config": {},
}  # fmt: skip
# hmf's GKA-primed Qwen3-32B (amazon/GKA-primed-HQwen3-32B-Instruct): Qwen3-32B's shape, the same alternation.
HMF_QWEN3_32B_GKA: dict[str, Any] = {
    **HMF_QWEN3_8B_GKA, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
    "num_attention_heads": 64, "hybrid_override_pattern": "-".join(["*", "GKA"] * 32),
}  # fmt: skip
# hmf's GDN-primed Qwen3-8B (its priming recipe qwen3_8b_gdn.yaml): the same shape, every other layer Gated DeltaNet.
HMF_QWEN3_8B_GDN: dict[str, Any] = {
    **{k: v for k, v in HMF_QWEN3_8B_GKA.items() if k != "gka_config"},
    "hybrid_override_pattern": "-".join(["*", "GDN"] * 18), "gdn_config": {},
}  # fmt: skip
SHAPES = {"hmf_8b_gka": ("hmf GKA-primed Qwen3-8B shape", HMF_QWEN3_8B_GKA),
          "hmf_32b_gka": ("hmf GKA-primed Qwen3-32B shape", HMF_QWEN3_32B_GKA),
          "hmf_8b_gdn": ("hmf GDN-primed Qwen3-8B shape", HMF_QWEN3_8B_GDN)}  # fmt: skip


def random_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel = ONE_RANK
) -> HybridLM:
    """Random weights built directly on `device` in `dtype` (an 8B model in fp32 on the host would be 32 GB); with
    `tp`, this rank's part."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = HybridLM(config, tp)
            for layer in model.layers:
                layer.mixer.reset_parameters()
    finally:
        torch.set_default_dtype(default)
    for layer in model.layers:
        layer.mixer.on_load()
    return model.eval()


def fill(pool: StatePool, context: int, gen: torch.Generator) -> None:
    """Every session's state as after `context` tokens: lengths set, entries random (never zeros)."""
    for state in pool.tensors:
        for name, t in state.items():
            if name.endswith("_scale"):  # an fp8 cache's scales: positive
                t.fill_(1.0)
            elif t.is_floating_point():
                dtype = torch.float32 if t.element_size() == 1 else t.dtype  # (no randn in fp8: drawn, then cast)
                for row in range(t.shape[0]):  # row by row: a whole pool's fp32 randn would not fit beside it
                    t[row].copy_(torch.randn(t[row].shape, generator=gen, device=t.device, dtype=dtype) * 0.1)
            elif name == "length":
                t.fill_(context)


def profile_steps(step, steps: int = 3, top: int = 12) -> list[dict[str, Any]]:
    """The GPU kernels of a few decode steps by total time (torch profiler): name, calls, ms per step."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total / 1e3 / steps) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[2])
    return [{"kernel": k[:90], "calls_per_step": c / steps, "ms_per_step": round(ms, 3)} for k, c, ms in rows[:top]]


def bench_context(model: HybridLM, context: int, steps: int, memory_fraction: float, max_sessions: int,
                  bandwidth: float | None, profile: bool = False, graphs: bool = True) -> dict[str, Any]:  # fmt: skip
    """The row of one context length: sessions that fit, bytes per session, step time, tokens/s, floor."""
    device, tp = model.device, model.tp
    probe = StatePool(model, capacity=1, max_context=context + steps + 1)
    per_session = probe.bytes_per_session()
    per_gpu = probe.bytes_per_session(part=True)  # what one GPU holds of a session
    per_token = probe.bytes_per_token()
    del probe
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    # The rest is for the step's activations and the attention gather (a copy of one layer's keys and values).
    sessions = min(max_sessions, int(free * memory_fraction / per_gpu))
    if tp.size > 1:  # every rank holds the same sessions: as many as the fullest GPU takes
        fits = torch.tensor([sessions], device=device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        sessions = int(fits)
    row: dict[str, Any] = {"context": context, "sessions": sessions, "bytes_per_session": per_session,
                           "bytes_per_session_per_gpu": per_gpu, "bytes_per_token": per_token}  # fmt: skip
    if sessions < 1:
        row["error"] = "not one session fits"
        return row
    pool = StatePool(model, capacity=sessions, max_context=context + steps + 1)
    slots = [pool.alloc() for _ in range(sessions)]
    fill(pool, context, torch.Generator(device=device).manual_seed(context))
    ids = torch.randint(0, model.config.vocab_size, (sessions,), device=device)
    batch = StepBatch.decode(slots, device)

    lengths = [state["length"] for state in pool.tensors if "length" in state]
    graph = None
    if graphs and not graph_blockers(model):
        with torch.inference_mode():
            graph = DecodeGraphs(lambda b: model.decode(ids, pool.tensors, b), sessions, pool.scratch_slot, device,
                                 sizes=[sessions])  # fmt: skip

    def step() -> None:
        for length in lengths:  # decode appends one token: keep every session at `context` tokens
            length.fill_(context)
        if graph is not None:
            graph.replay(slots)
        else:
            model.decode(ids, pool.tensors, batch)

    row["cuda_graph"] = graph is not None
    with torch.inference_mode():
        # (Ranks time a fixed number of steps: each step is a collective every rank must join.)
        row["step_ms"] = median_ms(step, device, repeats=50 if tp.size > 1 else None)
        if profile:
            row["profile"] = profile_steps(step)
    row["tokens_per_s"] = sessions / row["step_ms"] * 1e3
    row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / tp.size
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # (this GPU's part)
    row["bytes_per_step"] = weights + sessions * per_gpu  # what one GPU reads
    if bandwidth:
        row["floor_ms"] = row["bytes_per_step"] / bandwidth * 1e3
        row["x_floor"] = row["step_ms"] / row["floor_ms"]
    return row


def time_to_first_token(model: HybridLM, context: int, chunk: int) -> dict[str, Any]:
    """Seconds to prefill one fresh prompt of `context` random tokens, `chunk` tokens a step (as the engine
    splits a long prompt; its default is 8192), up to its first token's logits. One warm-up prompt of one chunk
    first (kernel compilation and autotuning are not timed)."""
    device = model.device
    pool = StatePool(model, capacity=1, max_context=context + 1)
    gen = torch.Generator(device=device).manual_seed(context)

    def prefill(n: int) -> None:
        slot = pool.alloc()
        ids = torch.randint(0, model.config.vocab_size, (n,), device=device, generator=gen)
        for start in range(0, n, chunk):
            piece = ids[start : start + chunk]
            model.prefill(piece, pool.tensors, StepBatch.prefill([slot], [len(piece)], device))
        pool.free(slot)

    with torch.inference_mode():
        prefill(min(chunk, context))
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        prefill(context)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    return {"prompt_tokens": context, "prefill_chunk": chunk, "seconds": seconds, "tokens_per_s": context / seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfree.bench.context", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path, help="a kvfree checkpoint directory")
    src.add_argument("--hmf-8b-gka", action="store_true", help="random weights in hmf's GKA Qwen3-8B shape")
    src.add_argument("--hmf-32b-gka", action="store_true", help="random weights in hmf's GKA Qwen3-32B shape")
    src.add_argument("--hmf-8b-gdn", action="store_true", help="random weights in hmf's GDN Qwen3-8B shape")
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--steps", type=int, default=8, help="decode steps the pool leaves room for")
    ap.add_argument("--memory-fraction", type=float, default=0.6, help="share of free GPU memory for the pool")
    ap.add_argument("--max-sessions", type=int, default=1024)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs the model is split among")
    ap.add_argument("--kv-cache-dtype", choices=sorted(KV_CACHE_DTYPES), default="auto",
                    help="the attention KV cache's dtype")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="also profile a few decode steps at each context")
    ap.add_argument("--enforce-eager", action="store_true", help="time eager decode (default: a CUDA graph)")
    ap.add_argument("--ttft", action="store_true",
                    help="also time the prefill of one fresh prompt of each context length (time to first token)")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="prompt tokens a prefill step (with --ttft)")
    ap.add_argument("--out", type=Path, help="the JSON (default: docs/bench/<shape or checkpoint>-context.json)")
    args = ap.parse_args(argv)
    if args.out is None:
        stem = args.checkpoint.name if args.checkpoint else next(k for k in SHAPES if getattr(args, k))
        args.out = Path("docs/bench") / f"{stem.replace('_', '-')}-context.json"
    if args.tensor_parallel_size > 1:
        mp.start_processes(_rank_main, args=(args, free_address()), nprocs=args.tensor_parallel_size,
                           start_method="spawn")  # fmt: skip
    else:
        run(args, ONE_RANK)
    return 0


def _rank_main(rank: int, args: argparse.Namespace, init_method: str) -> None:
    torch.cuda.set_device(rank)
    tp = TensorParallel.start(rank, args.tensor_parallel_size, init_method)
    try:
        run(args, tp)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, tp: TensorParallel) -> None:
    """The benchmark on this rank's GPU (rank 0 writes the JSON and prints the table)."""
    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    if args.checkpoint is not None:
        model, name = load_model(args.checkpoint, device=device, dtype=dtype, tp=tp), str(args.checkpoint)
    else:
        label, hf_config = SHAPES[next(k for k in SHAPES if getattr(args, k))]
        config = ModelConfig.from_dict(convert_config(hf_config, Path(label)))
        model, name = random_model(config, device, dtype, tp), f"{label}, random weights"
    model.set_kv_cache_dtype(args.kv_cache_dtype)
    bandwidth = hbm_bandwidth(device)
    # The captured decode must give the eager decode's greedy tokens (8 sessions, 16 steps).
    graph_check = None if args.enforce_eager or graph_blockers(model) else check_graph_tokens(model, 8)
    rows = []
    for n in args.contexts:
        row = bench_context(model, n, args.steps, args.memory_fraction, args.max_sessions, bandwidth, args.profile,
                            not args.enforce_eager)  # fmt: skip
        torch.cuda.empty_cache()  # the last context's pool
        if args.ttft:
            row["ttft"] = time_to_first_token(model, n, args.prefill_chunk)
        rows.append(row)
    if tp.rank != 0:
        return
    params = sum(p.numel() for p in model.parameters()) * tp.size  # (about: norms are held whole by every rank)
    write_json(args.out, {"model": name, "parameters": params, "layers": model.config.layers,
                          "tensor_parallel_size": tp.size, "kv_cache_dtype": args.kv_cache_dtype,
                          "graph_tokens_equal_eager": graph_check,
                          "hbm_bytes_per_s": bandwidth, "env": environment(device), "rows": rows})  # fmt: skip
    print(f"TP={tp.size}, KV cache {args.kv_cache_dtype}; CUDA-graph decode gives the eager tokens: {graph_check}")
    head = ("context", "sessions", "MB/session", "step ms", "tok/s", "tok/s/GPU", "x floor")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 8, 10, 8, 8, 9, 7), strict=True)))
    for r in rows:
        ms, tps, x = r.get("step_ms", float("nan")), r.get("tokens_per_s", 0), r.get("x_floor", 0)
        mb, gpu = r["bytes_per_session"] / 1e6, tps / tp.size
        print(f"{r['context']:>8} {r['sessions']:>8} {mb:>10.1f} {ms:>8.1f} {tps:>8.0f} {gpu:>9.0f} {x:>7.1f}")
    for r in rows:
        if "ttft" in r:
            t = r["ttft"]
            print(f"time to first token, {t['prompt_tokens']} tokens: {t['seconds']:.2f} s ({t['tokens_per_s']:.0f} "
                  f"tok/s, {t['prefill_chunk']} a step)")  # fmt: skip
    for r in rows:
        for k in r.get("profile", [])[:8]:
            print(f"  {r['context']:>6} {k['ms_per_step']:>8.2f} ms {k['calls_per_step']:>6.0f}x {k['kernel']}")


if __name__ == "__main__":
    raise SystemExit(main())
