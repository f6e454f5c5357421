"""`kvfree bench agentic`: conversations re-sent whole every round, as agent frameworks send them, against `kvfree
serve` with the prefix cache on and then off, in one run.

    kvfree bench agentic ./mamba2-370m --conversations 128 --rounds 12                 # GPU (SGLang's PR #31643 setup)
    kvfree bench agentic tests/tiny_checkpoint --device cpu --conversations 4 --rounds 3   # CPU smoke

The work: N conversations, each opening with a system prompt of --system-tokens random token ids (its own), each
round adding a user message of --user-tokens random ids and the model's reply of --max-tokens greedy tokens (EOS
ignored). Every request sends the whole history as token ids to `/v1/completions`, streamed, without a session (as
a stateless agent loop does), with `return_tokens_as_token_ids` so that the reply goes back into the history as the
exact tokens generated. The N conversations run at once, each a closed loop (its next round is sent when its reply
has ended). The same work runs twice, each against its own `kvfree serve` subprocess: with the prefix cache (the
default), then with `--no-prefix-cache`.

Per mode: the hit rate (cached prompt tokens, `usage.prompt_tokens_details.cached_tokens`, over the prompt tokens an
exact cache could reuse: from round 2 on, the previous round's prompt and reply less the reply's last token, which
was sampled and never fed); TTFT p50 / p99 by round (the first streamed token); output tokens/s over the mode's wall
time; the checkpoints held at the end (`/metrics`). And whether every reply with the cache equals the reply without
it, conversation by conversation, round by round (greedy).

Writes one JSON (default docs/bench/agentic-CHECKPOINT.json) and prints a table last. Exit status: 0 when every
request completed (targets met or not), 1 when some did not, 2 for bad arguments or a server that did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvfree.bench.harness import Goal, environment, goal_rows, write_json
from kvfree.bench.serve import (
    SERVER_DEFAULTS,
    ServedCheckpoint,
    ServerProcess,
    ServerStartError,
    git_commit,
    print_targets_and_path,
    sigterm_exits,
)
from kvfree.checkpoints import CheckpointError, default_checkpoint_path
from kvfree.load_args import add_load_args
from kvfree.loadtest.cli import positive

GOALS = [
    Goal("cuda", "hit_rate", ">=", 0.97, "prefix cache hit rate over the reusable prefix (SGLang's MambaRadixCache: "
         "0.83)"),
    Goal("cuda", "ttft_last_over_first", "<=", 1.5, "TTFT p50 of the last round over the first's, cache on"),
    Goal("cuda", "outputs_equal", ">=", 1.0, "greedy replies with the cache equal those without it (fraction)"),
]  # fmt: skip


class Conversation:
    """One conversation's history (token ids) and what each of its rounds measured."""

    def __init__(self, index: int, args: argparse.Namespace, vocab_size: int) -> None:
        self.rng = random.Random(args.seed * 100_003 + index)
        self.vocab_size = vocab_size
        self.history = self.random_ids(args.system_tokens)
        self.user_tokens = args.user_tokens
        self.replies: list[list[int]] = []
        self.rounds: list[dict[str, Any]] = []

    def random_ids(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab_size) for _ in range(n)]

    def next_prompt(self) -> list[int]:
        self.history = self.history + self.random_ids(self.user_tokens)
        return self.history


async def one_round(http: httpx.AsyncClient, conv: Conversation, args: argparse.Namespace) -> None:
    """Send the conversation's next round (the whole history), stream the reply, append it to the history."""
    prompt = conv.next_prompt()
    reusable = 0
    if conv.rounds:
        last = conv.rounds[-1]
        reusable = last["prompt_tokens"] + len(conv.replies[-1]) - 1
    body = {
        "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "logprobs": 0, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    start = time.perf_counter()
    ttft, reply, usage = None, [], None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                if tokens and ttft is None:
                    ttft = time.perf_counter() - start
                reply += [int(t.removeprefix("token_id:")) for t in tokens]
    if usage is None or len(reply) != args.max_tokens:
        raise RuntimeError(f"a round ended with {len(reply)} of {args.max_tokens} tokens (usage {usage})")
    conv.replies.append(reply)
    conv.history = prompt + reply
    cached = usage["prompt_tokens_details"]["cached_tokens"] if usage.get("prompt_tokens_details") else 0
    conv.rounds.append({"prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached, "reusable": reusable,
                        "ttft_s": ttft, "seconds": time.perf_counter() - start})  # fmt: skip


async def run_mode(url: str, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """Every conversation's rounds against the server at `url`; returns the mode's numbers and replies."""
    convs = [Conversation(i, args, vocab_size) for i in range(args.conversations)]
    limits = httpx.Limits(max_connections=args.conversations + 4, max_keepalive_connections=args.conversations + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits, trust_env=False) as http:

        async def loop(conv: Conversation) -> None:
            for _ in range(args.rounds):
                await one_round(http, conv, args)

        start = time.perf_counter()
        await asyncio.gather(*(loop(c) for c in convs))
        wall = time.perf_counter() - start
        metrics = (await http.get("/metrics")).text
        slots = (await http.get("/v1/models")).json()["data"][0].get("session_slots")
    by_round = []
    for r in range(args.rounds):
        ttfts = sorted(c.rounds[r]["ttft_s"] for c in convs)
        by_round.append({
            "round": r + 1, "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "prompt_tokens_mean": statistics.mean(c.rounds[r]["prompt_tokens"] for c in convs),
            "cached_tokens_mean": statistics.mean(c.rounds[r]["cached_tokens"] for c in convs),
        })  # fmt: skip
    cached = sum(min(x["cached_tokens"], x["reusable"]) for c in convs for x in c.rounds)
    reusable = sum(x["reusable"] for c in convs for x in c.rounds)
    tokens = args.conversations * args.rounds * args.max_tokens
    return {
        "wall_s": wall, "output_tokens_per_s": tokens / wall, "hit_rate": cached / reusable if reusable else None,
        "cached_tokens": sum(x["cached_tokens"] for c in convs for x in c.rounds), "reusable_tokens": reusable,
        "prompt_tokens": sum(x["prompt_tokens"] for c in convs for x in c.rounds), "by_round": by_round,
        "prefix_cache": prefix_cache_gauges(metrics), "session_slots": slots, "replies": [c.replies for c in convs],
    }  # fmt: skip


def prefix_cache_gauges(metrics: str) -> dict[str, float]:
    """The prefix cache's gauges from a /metrics text: checkpoints, bytes by tier, events by kind."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("kvfree_prefix_cache_"):
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("kvfree_prefix_cache_")] = float(value)
    return out


def serve_args(args: argparse.Namespace, cp: ServedCheckpoint, cache: bool) -> list[str]:
    """The `kvfree serve` arguments of one mode (all but host and port)."""
    out = [str(cp.path), "--device", str(cp.device), "--dtype", cp.dtype_name, "--max-context", str(args.max_context)]
    if args.max_sessions is not None:
        out += ["--max-sessions", str(args.max_sessions)]
    out += ["--max-waiting", str(max(SERVER_DEFAULTS.max_waiting, args.conversations))]
    longest = args.system_tokens + args.rounds * (args.user_tokens + args.max_tokens)
    out += ["--max-prompt-tokens", str(max(longest, SERVER_DEFAULTS.max_prompt_tokens))]
    for override in args.overrides:
        out += ["--set", override]
    if args.enforce_eager:
        out.append("--enforce-eager")
    if args.kv_cache_dtype != "auto":
        out += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.tensor_parallel_size > 1:
        out += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    return out + ([] if cache else ["--no-prefix-cache"]) + args.serve_args


def run(args: argparse.Namespace) -> int:
    args.checkpoint = args.checkpoint or default_checkpoint_path()
    try:
        cp = ServedCheckpoint.from_args(args, "agentic")
    except (CheckpointError, ValueError) as e:
        print(f"kvfree bench agentic: {e}", file=sys.stderr)
        return 2
    modes: dict[str, dict[str, Any]] = {}
    failed = False
    with sigterm_exits(), tempfile.TemporaryDirectory() as tmp:
        for name, cache in (("cache_on", True), ("cache_off", False)):
            server = ServerProcess(serve_args(args, cp, cache), Path(tmp) / f"{name}.log", args.start_timeout)
            try:
                with server as url:
                    modes[name] = asyncio.run(run_mode(url, args, cp.vocab_size))
            except ServerStartError as e:
                print(f"kvfree bench agentic: {e}", file=sys.stderr)
                return 2
            except RuntimeError as e:
                print(f"kvfree bench agentic ({name}): {e}", file=sys.stderr)
                failed = True
                break
    payload = report(args, cp, modes)
    write_json(cp.out, payload)
    print_table(payload)
    print_targets_and_path(payload)
    return 1 if failed else 0


def report(args: argparse.Namespace, cp: ServedCheckpoint, modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON: the work, the environment, each mode's numbers (replies left out), the comparison, the targets."""
    payload: dict[str, Any] = {
        "what": "conversations re-sent whole every round to /v1/completions, prefix cache on and off",
        "command": " ".join(["kvfree", "bench", "agentic", *sys.argv[1:]]) if sys.argv[0].endswith("kvfree") else None,
        "checkpoint": str(cp.path), "kvfree_commit": git_commit(), "device_type": cp.device.type,
        "env": environment(cp.device), "out": str(cp.out),
        "work": {k: getattr(args, k) for k in ("conversations", "rounds", "system_tokens", "user_tokens",
                                               "max_tokens", "max_sessions", "seed")},
    }  # fmt: skip
    payload["modes"] = {name: {k: v for k, v in m.items() if k != "replies"} for name, m in modes.items()}
    values: dict[str, float | None] = {}
    on, off = modes.get("cache_on"), modes.get("cache_off")
    if on is not None:
        values["hit_rate"] = on["hit_rate"]
        first, last = on["by_round"][0]["ttft_p50_ms"], on["by_round"][-1]["ttft_p50_ms"]
        values["ttft_last_over_first"] = last / first if first else None
    if on is not None and off is not None:
        replies = zip(on["replies"], off["replies"], strict=True)
        pairs = [(a, b) for ca, cb in replies for a, b in zip(ca, cb, strict=True)]
        values["outputs_equal"] = sum(a == b for a, b in pairs) / len(pairs)
        payload["speedup_tokens_per_s"] = on["output_tokens_per_s"] / off["output_tokens_per_s"]
    payload["values"] = values
    payload["targets"] = goal_rows(GOALS, values, cp.device.type)
    return payload


def print_table(payload: dict[str, Any]) -> None:
    work = payload["work"]
    sizes = f"system {work['system_tokens']} + user {work['user_tokens']} + reply {work['max_tokens']} tokens a round"
    print(f"{work['conversations']} conversations x {work['rounds']} rounds, {sizes}; {payload['env']['device']}")
    for name, m in payload["modes"].items():
        hit = "-" if m["hit_rate"] is None else f"{m['hit_rate']:.3f}"
        held = m["prefix_cache"].get("checkpoints", 0)
        print(f"{name}: hit rate {hit}, {m['output_tokens_per_s']:.0f} output tok/s, {held:.0f} checkpoints held")
        print("  round  ttft p50 ms  ttft p99 ms  prompt  cached")
        for r in m["by_round"]:
            print(f"  {r['round']:5d} {r['ttft_p50_ms']:12.1f} {r['ttft_p99_ms']:12.1f} "
                  f"{r['prompt_tokens_mean']:7.0f} {r['cached_tokens_mean']:7.0f}")  # fmt: skip
    if "outputs_equal" in payload["values"]:
        print(f"replies equal with and without the cache: {payload['values']['outputs_equal']:.3f}; "
              f"throughput on/off {payload['speedup_tokens_per_s']:.2f}x")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfree bench agentic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", nargs="?", type=Path, default=None,
                   help="checkpoint directory to serve (default: the one shipped with kvfree)")  # fmt: skip
    g = p.add_argument_group("the work")
    g.add_argument("--conversations", type=positive(int), default=128, help="conversations at once (default: 128)")
    g.add_argument("--rounds", type=positive(int), default=12, help="rounds per conversation (default: 12)")
    g.add_argument("--system-tokens", type=positive(int), default=512, help="system prompt tokens (default: 512)")
    g.add_argument("--user-tokens", type=positive(int), default=128, help="user tokens a round (default: 128)")
    g.add_argument("--max-tokens", type=positive(int), default=64, help="reply tokens a round (default: 64)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default: 0)")
    g = p.add_argument_group("server settings (both modes)")
    add_load_args(g)
    g.add_argument("--max-sessions", type=positive(int), default=None,
                   help="server state slots (default: the server's: sized by GPU memory, 64 on the CPU)")  # fmt: skip
    g.add_argument("--max-context", type=positive(int), default=32768,
                   help="KV-cache size for models with attention layers (default: %(default)s)")  # fmt: skip
    g.add_argument("--serve-arg", dest="serve_args", action="append", default=[], metavar="ARG",
                   help="one more `kvfree serve` argument for both modes (repeatable)")  # fmt: skip
    g.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default: docs/bench/agentic-CHECKPOINT.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
