"""The `kvfree` command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvfree.engine.model.config import parse_overrides
from kvfree.engine.model.presets import PRESETS
from kvfree.load_args import add_load_args


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None, help="checkpoint directory (default: the one shipped with kvfree)")
    add_load_args(p)


def cmd_generate(args: argparse.Namespace) -> int:
    from kvfree.engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_sessions=1,
        max_context=args.max_context,
        config_overrides=parse_overrides(args.overrides),
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop or [],
    )
    start = time.perf_counter()
    sys.stdout.write(args.prompt if not args.chat else "")
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    seq = llm.last_sequence
    n = len(seq.output_token_ids)
    print(file=sys.stdout)
    print(
        f"[{n} tokens in {elapsed:.2f}s: {n / elapsed:.1f} tokens/s, prompt {len(seq.prompt_token_ids)} tokens, "
        f"finish_reason={seq.finish_reason}, device={llm.model.device}]",
        file=sys.stderr,
    )
    return 0


def cmd_init_checkpoint(args: argparse.Namespace) -> int:
    from kvfree.engine.model.loader import resolve_dtype
    from kvfree.engine.model.presets import init_checkpoint

    path = init_checkpoint(args.preset, args.output, seed=args.seed, dtype=resolve_dtype(args.dtype, _cpu()))
    print(f"wrote a random-initialised {args.preset!r} checkpoint to {path}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from kvfree.checkpoints.hf_hmf import convert_hmf
    from kvfree.checkpoints.hf_mamba2 import convert_hf_mamba2
    from kvfree.checkpoints.hf_qwen3 import convert_hf_qwen3

    converter = {"hf-mamba2": convert_hf_mamba2, "hf-qwen3": convert_hf_qwen3, "hmf": convert_hmf}[args.from_format]
    path = converter(args.src, args.dst, tokenizer_from=args.tokenizer)
    print(f"converted {args.src} ({args.from_format}) to {path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    # Imported here: the server is optional for `kvfree generate` and the engine does not depend on it.
    from kvfree.server.main import serve
    from kvfree.server.settings import ServerSettings

    hmac_key = os.environ.get("KVFREE_SNAPSHOT_HMAC_KEY")
    settings = ServerSettings(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        device=args.device,
        dtype=args.dtype,
        max_sessions=args.max_sessions,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_waiting=args.max_waiting,
        max_batch_tokens=args.max_batch_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        prefill_batch_wait_ms=args.prefill_batch_wait_ms,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_context=args.max_context,
        max_host_sessions=args.max_host_sessions,
        snapshot_dir=args.snapshot_dir,
        session_store=args.session_store,
        session_write=args.session_write,
        session_ttl_seconds=args.session_ttl,
        session_lease_seconds=args.session_lease,
        prefix_cache=not args.no_prefix_cache,
        prefix_cache_bytes=args.prefix_cache_budget,
        replica_id=args.replica_id,
        snapshot_hmac_key=hmac_key.encode() if hmac_key else None,
        api_keys_file=args.api_keys_file,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_seconds=args.shutdown_grace,
        cors_origins=args.cors_origin or [],
        config_overrides=parse_overrides(args.overrides),
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_cache_dtype=args.kv_cache_dtype,
        engine_process=not args.engine_in_process,
    )
    return serve(settings)


def memory_budget(text: str) -> int:
    """A size in bytes from "8GiB", "500MB", "1e9" or a share of this machine's memory ("0.1")."""
    from kvfree.engine.protocol import host_memory_bytes

    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9,
             "tb": 10**12, "b": 1}  # fmt: skip
    raw = text.strip().lower()
    unit = next((u for u in units if raw.endswith(u)), None)
    try:
        value = float(raw[: -len(unit)] if unit else raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size (8GiB, 500MB, 1e9) or a share (0.1)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size cannot be negative")
    if unit is None and 0 < value < 1:
        return int(value * host_memory_bytes())
    return int(value * (units[unit] if unit else 1))


def cmd_loadtest(args: argparse.Namespace) -> int:
    # Imported here: the load generator speaks HTTP only and has its own parser (`kvfree loadtest --help`).
    from kvfree.loadtest.cli import main as loadtest_main

    return loadtest_main(args.forwarded)


def cmd_bench(args: argparse.Namespace) -> int:
    # Every benchmark lives in kvfree/bench/, above the engine and the server; each has its own parser.
    from kvfree.bench.cli import main as bench_main

    return bench_main(args.forwarded)


def cmd_chat(args: argparse.Namespace) -> int:
    # Imported here: the terminal client speaks HTTP only and has its own parser (`kvfree chat --help`).
    from kvfree.clients.chat import main as chat_main

    return chat_main(args.forwarded)


def _add_forwarding_parser(sub: argparse._SubParsersAction, name: str, help: str, func) -> None:
    """A subcommand whose arguments all go to another module's own parser (`kvfree NAME --help` prints that one).

    prefix_chars="+" keeps argparse from reading `--url`, `-h` ... here, so they all land in the REMAINDER list.
    """
    p = sub.add_parser(name, help=help, add_help=False, prefix_chars="+")
    p.add_argument("forwarded", nargs=argparse.REMAINDER)
    p.set_defaults(func=func)


def _cpu():
    import torch

    return torch.device("cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfree", description="kvfree: a constant-memory inference server for recurrent language models."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete a prompt, streaming tokens to the terminal")
    p.add_argument("prompt", nargs="?", default="Hello", help="the prompt text (default: 'Hello')")
    _add_model_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens; 1 is off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--max-context", type=int, default=4096, help="KV-cache size for models with attention layers")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve a checkpoint over the OpenAI-compatible HTTP API, with sessions")
    p.add_argument(
        "model", nargs="?", type=Path, default=None, help="checkpoint directory (default: the one shipped with kvfree)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    add_load_args(p)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: directory name)")
    p.add_argument(
        "--max-sessions",
        type=int,
        default=None,
        help="state-pool slots, sequences decoded at once: at most this many on a GPU, where the pool is sized by "
        "--gpu-memory-utilization (default: as many as fit, at most 1024); exactly this many on the CPU (default 64)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="U",
        help="the share of the GPU's memory the server may use: what the weights and the largest step's activations "
        "leave of it holds the session slots, each a session's whole state at --max-context (default: %(default)s; "
        "the start-up log says how many fit)",
    )
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued for a slot before 429 Retry-After")
    p.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine on a thread of the HTTP server's process instead of a process of its own (the default, "
        "where the HTTP front's Python never competes with the engine's for one interpreter; in-process is for "
        "debugging, profiling both sides in one process, or a CPU too small for two)",
    )
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=2048,
        help="tokens per engine step while sequences decode: one per decoding sequence, the rest for prompt "
        "chunks. This trades time to first token against inter-token latency: a step's time grows with its "
        "tokens, and every running stream waits that step for its next token. Larger: new prompts are fed "
        "faster (lower TTFT) but running streams stutter while they are (higher ITL p99); smaller: smooth "
        "streams, slower admission; BENCHMARKS.md has this default measured served. (default: %(default)s)",
    )
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="prompt tokens per step when nothing decodes, so no stream waits on the step "
        "(default: --max-batch-tokens). On a GPU, the prefill CUDA graphs of every step size up to the larger of "
        "the two (at most 8,192 tokens) are captured at start-up: 60 graphs for 2,048 tokens, ~3 s on an H100",
    )
    p.add_argument(
        "--prefill-batch-wait-ms",
        type=float,
        default=50.0,
        help="while streams decode, how long a new prompt may wait for others to share its prefill step. A prefill "
        "step holds up every running stream and has a fixed cost whatever its size (milliseconds replayed from a "
        "CUDA graph, tens of them launched eagerly), so sharing it raises throughput and makes fewer ITL spikes, "
        "for up to this much more TTFT; 0 prefills every prompt at once (default: %(default)s)",
    )
    p.add_argument("--max-prompt-tokens", type=int, default=32768)
    p.add_argument("--max-output-tokens", type=int, default=4096, help="upper bound for max_tokens")
    p.add_argument("--max-context", type=int, default=8192, help="KV-cache size for models with attention layers")
    p.add_argument(
        "--max-host-sessions",
        type=int,
        default=1024,
        help="idle sessions kept in host memory before the oldest spill to --snapshot-dir",
    )
    p.add_argument(
        "--snapshot-dir",
        type=Path,
        default=None,
        help="where sessions spill, and persist across restarts (sign them: KVFREE_SNAPSHOT_HMAC_KEY)",
    )
    g = p.add_argument_group("reuse without sessions (the prefix cache)")
    g.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="keep no checkpoints: a request without a session_id always prefills its whole prompt (by default "
        "every request leaves its state at the end of its prompt, of its output and at message boundaries, and a "
        "later request of the same API key resumes from the longest of them that begins its prompt)",
    )
    g.add_argument(
        "--prefix-cache-budget",
        type=memory_budget,
        default=None,
        metavar="SIZE",
        help="host memory the checkpoints evicted from the GPU pool may hold: bytes (8GiB, 500MB, 1e9) or a share "
        "of this machine's memory (0.1); default a tenth of it, at most 8 GiB; 0 keeps checkpoints only in free slots",
    )
    g = p.add_argument_group("sessions beyond one process")
    g.add_argument(
        "--session-store",
        default=None,
        metavar="URL_OR_DIR",
        help="where sessions persist: redis://host:6379/0 (shared by replicas: any replica continues any session) "
        "or a directory. Every turn's state is stored before its last event (see --session-write)",
    )
    g.add_argument(
        "--session-write",
        choices=["through", "async", "spill"],
        default="through",
        help="through: store a session after every turn, before its last event, so a crash (kill -9) loses no "
        "completed turn (the engine waits for each write: ~0.15-0.25 s for a 370M model's 49 MB state on a CPU "
        "host); async: from a background thread, at most 16 writes behind (kvfree_session_writes_pending, "
        "kvfree_session_write_lag_seconds), which a crash can lose; spill: only when it leaves host memory and "
        "at shutdown, like --snapshot-dir (default: %(default)s)",
    )
    g.add_argument(
        "--replica-id",
        default=None,
        metavar="NAME",
        help="this replica's name in the X-Kvfree-Replica response header (default: HOSTNAME:PORT, so replicas on one "
        "host differ)",
    )
    g.add_argument("--session-ttl", type=float, default=None, metavar="S", help="expire stored sessions unused S s")
    g.add_argument(
        "--session-lease",
        type=float,
        default=10.0,
        metavar="S",
        help="a turn's claim on a session in a shared store, renewed every S/3 seconds while the turn runs (however "
        "long): a crashed replica's claim lapses within S seconds, and a turn on another replica gets 409 with "
        "Retry-After meanwhile (default: %(default)s)",
    )
    p.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        help="one API key per line; or set KVFREE_API_KEYS=key1,key2 (no keys: no auth). /health, /ready, /ping, "
        "/version and /metrics stay open without a key (for probes and Prometheus): keep the port private or put a "
        "proxy in front to close them",
    )
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024 * 1024, help="largest request body accepted")
    p.add_argument(
        "--shutdown-grace", type=float, default=10.0, help="seconds running requests get to finish after SIGTERM"
    )
    p.add_argument("--cors-origin", action="append", help="allow this browser origin (repeatable; default: CORS off)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("init-checkpoint", help="write a random-initialised checkpoint of a named size")
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("output", type=Path, help="directory to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="weight dtype to store (float32 or bfloat16)")
    p.set_defaults(func=cmd_init_checkpoint)

    p = sub.add_parser("convert", help="convert another format's checkpoint to a kvfree checkpoint")
    p.add_argument(
        "--from",
        dest="from_format",
        required=True,
        choices=["hf-mamba2", "hf-qwen3", "hmf"],
        help="source format: hf-mamba2 / hf-qwen3 = a Hugging Face Mamba2ForCausalLM / Qwen3ForCausalLM directory; "
        "hmf = a hybrid-model-factory hybrid_qwen3 directory (Qwen3 with SWA, GKA, GDN, Mamba-2 or B'MOJO-F layers)",
    )
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="directory with tokenizer.json (+ tokenizer_config.json) if SRC has none",
    )
    p.set_defaults(func=cmd_convert)

    _add_forwarding_parser(
        sub,
        "loadtest",
        "load-test servers over HTTP: memory vs context, latency vs concurrency, verified session soak",
        cmd_loadtest,
    )
    _add_forwarding_parser(
        sub,
        "bench",
        "run a benchmark: kvfree bench {step,offline,serve,sessions,structured,context,layers,stores,op-host-cost,"
        "kv-cache-quality,kernels} [ARGS] (`kvfree bench --help` lists them; `kvfree bench serve --help` and so on; "
        "the old spellings --serve, --sessions, --structured and --offline still work)",
        cmd_bench,
    )
    _add_forwarding_parser(
        sub, "chat", "chat in the terminal on a server session (/fork, /save FILE, /load FILE)", cmd_chat
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    from kvfree.checkpoints import CheckpointError
    from kvfree.engine.protocol import SessionStoreError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, SessionStoreError, ValueError) as e:
        print(f"kvfree {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
