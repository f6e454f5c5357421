"""`kvfree bench <what> [ARGS]`: which benchmark runs, and the old `kvfree bench --serve ...` spellings."""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """One `kvfree bench` subcommand: the module whose `main(argv)` runs it, and flags put in front of its arguments
    (the offline run is a mode of the model-step script)."""

    module: str
    summary: str
    flags: tuple[str, ...] = ()


BENCHMARKS: dict[str, Benchmark] = {
    "step": Benchmark("kvfree.bench.step", "a preset's model step: decode at several batch sizes and one long "
                      "prefill, against the floor (the default)"),
    "offline": Benchmark("kvfree.bench.step", "LLM.generate end to end on a random preset", ("--offline",)),
    "serve": Benchmark("kvfree.bench.serve", "a checkpoint served over HTTP to streaming clients, against "
                       "LLM.generate of the same work"),
    "agentic": Benchmark("kvfree.bench.agentic", "conversations re-sent whole every round (agent frameworks), the "
                         "prefix cache on and off: hit rate, TTFT by round"),
    "sessions": Benchmark("kvfree.bench.sessions", "a session's next turn by where its state was parked, against "
                          "recomputing it; snapshot download and restore"),
    "structured": Benchmark("kvfree.bench.structured", "a decode batch with grammar-constrained rows against the "
                            "same batch free"),
    "context": Benchmark("kvfree.bench.context", "sessions that fit and decode tok/s at long contexts (hmf's 8B/32B "
                         "shapes, tensor parallelism, the fp8 KV cache)"),
    "layers": Benchmark("kvfree.bench.layers", "one mixer layer of a preset timed as the engine runs it"),
    "stores": Benchmark("kvfree.bench.stores", "write-through cost per turn: storing a session's state in a "
                        "directory or Redis"),
    "op-host-cost": Benchmark("kvfree.bench.op_host_cost", "host microseconds per eager op call"),
    "kv-cache-quality": Benchmark("kvfree.bench.kv_cache_quality", "the fp8 KV cache's logit error and greedy "
                                  "agreement against the unquantized cache"),
    "kernels": Benchmark("kvfree.bench.kernels.__main__", "one op's Triton kernels checked against float64 and "
                         "timed on a GPU (--op OP; --smoke on the CPU)"),
}  # fmt: skip

# The spellings from before the subcommands, still taken: `kvfree bench --serve CKPT ...` and so on.
OLD_FLAGS = {"--sessions": "sessions", "--structured": "structured", "--serve": "serve"}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    rows = "\n".join(f"  {name:<{width}}  {b.summary}" for name, b in BENCHMARKS.items())
    return (
        "usage: kvfree bench <what> [ARGS]   (kvfree bench <what> --help: that benchmark's options)\n\n"
        f"{rows}\n\nWith no <what>, the model step runs (`kvfree bench --preset mamba2-370m`); "
        "`kvfree bench --serve CKPT` and the other old flags still work."
    )


def choose(argv: list[str]) -> tuple[str, list[str]]:
    """The benchmark `argv` names, and the arguments its own parser gets."""
    if argv and argv[0] in BENCHMARKS:
        return argv[0], argv[1:]
    old = next((name for flag, name in OLD_FLAGS.items() if flag in argv), None)
    return old or "step", argv


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv in (["-h"], ["--help"], ["help"]):
        print(usage())
        return 0
    if argv and not argv[0].startswith("-") and argv[0] not in BENCHMARKS:
        print(f"kvfree bench: unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    name, rest = choose(argv)
    bench = BENCHMARKS[name]
    return importlib.import_module(bench.module).main([*bench.flags, *rest])
