"""`kvfree bench serve`: a checkpoint served over HTTP to closed-loop streaming clients, against `LLM.generate`
of the same work in the same run.

    kvfree bench serve ./mamba2-370m --clients 1 64 256                    # GPU: bf16, CUDA graphs
    kvfree bench serve tests/tiny_checkpoint --device cpu --clients 1 32    # CPU, the tiny test model

The work: prompts of --prompt-tokens random token ids, each continued by --max-tokens greedy tokens with EOS
ignored. At C clients, C x --requests-per-client requests go through C closed-loop clients streaming
`/v1/completions` (each sends its next request when its previous stream has ended) to `kvfree serve` started in a
subprocess on a free loopback port. Output tokens/s is completion tokens over the level's wall time; TTFT and ITL
come from the streams' text events (loadtest/served_levels.py says what a text event is). After the server has
stopped, `LLM.generate` runs the same prompts with the server's settings (dtype, device, max batch tokens, max
context) in a pool of min(C, --max-sessions) slots: the closed loop never has more than C requests running, and an
offline run with more slots would batch more than the server ever can. served/offline is the ratio of the two
rates, level by level.

Writes one JSON (default docs/bench/serve-CHECKPOINT.json): the command lines, settings, device and versions,
each level's numbers beside its offline run, the targets and whether each is met. Prints a table last. Exit
status: 0 when every request generated its tokens (whether targets are met or not), 1 when some did not, 2 for
bad arguments or a server that did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from kvfree.bench.harness import Goal, environment, print_goals, write_json
from kvfree.bench.offline import offline_run, random_prompts
from kvfree.checkpoints import CONFIG_FILE, CheckpointError, default_checkpoint_path
from kvfree.engine.model.config import parse_overrides
from kvfree.engine.model.loader import resolve_device, resolve_dtype
from kvfree.load_args import add_load_args
from kvfree.loadtest.cli import positive
from kvfree.loadtest.progress import Progress
from kvfree.loadtest.report import json_safe
from kvfree.loadtest.served_levels import level_numbers, run_served_levels
from kvfree.server.settings import ServerSettings

SERVER_DEFAULTS = ServerSettings()
WARMUP_PROMPTS = 8  # as `kvfree bench offline`: at most this many prompts, 4 tokens generated each, before timing
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Target(Goal):
    """A goal one level's number must meet: the level of `clients` clients."""

    clients: int = 0


# The serving goals this benchmark checks. The GPU ones are for one H100 with a Mamba-2 370M checkpoint; the CPU one
# for the tiny test checkpoint. A target whose level was not run is reported as not run.
TARGETS = (
    Target("cuda", "served_over_offline", ">=", 0.85, "64 streaming clients: >= 85% of LLM.generate's rate", 64),
    Target("cuda", "served_over_offline", ">=", 0.85, "256 streaming clients: >= 85% of LLM.generate's rate", 256),
    Target("cuda", "itl_p99_over_p50", "<=", 3.0, "64 clients: ITL p99 <= 3x ITL p50", 64),
    Target("cuda", "ttft_p99_s", "<=", 0.5, "64 clients: TTFT p99 <= 0.5 s", 64),
    Target("cpu", "served_over_offline", ">=", 0.8, "CPU, 32 streams: >= 80% of LLM.generate's rate", 32),
)

FAIRNESS = (
    "offline run per level: LLM.generate of the level's own prompts (clients x requests per client), same "
    "sampling, with the server's dtype, device, max batch tokens (LLM prefill_chunk) and max context, in a pool of "
    "min(clients, max sessions) slots: the closed loop never has more requests running than it has clients, so "
    "a larger offline pool would batch more than the server can. Run after the server has stopped, in the "
    "benchmark's own process, after a warm-up of its own (its prefill CUDA graphs captured up to the step "
    "budget first, as the server's are at start-up)."
)


# -- the server process -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited, or did not answer /ready in time (the message holds the end of its log)."""


class ServerProcess:
    """`kvfree serve ARGS --host 127.0.0.1 --port P` in a subprocess (P a free port), its output in `log_path`.

    Use as `with ServerProcess(...) as url:`: entering waits until GET /ready answers 200 (or raises
    ServerStartError with the log's end); leaving, normally or on an error, sends SIGTERM and waits, then kills it
    if it has not exited.
    """

    def __init__(self, serve_args: list[str], log_path: Path, start_timeout: float, stop_timeout: float = 60.0) -> None:
        self.serve_args = serve_args
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.command: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.start_seconds: float | None = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def start(self) -> str:
        """Start the server and wait until it is ready; returns its base URL."""
        start = time.perf_counter()
        for _attempt in range(3):  # another process can take the free port before the server binds it
            port = _free_port()
            self.command = [sys.executable, "-m", "kvfree", "serve", *self.serve_args, "--host", "127.0.0.1"]
            self.command += ["--port", str(port)]
            url = f"http://127.0.0.1:{port}"
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
                )
            try:
                if self._wait_ready(url, start + self.start_timeout):
                    self.start_seconds = time.perf_counter() - start
                    return url
            except BaseException:
                self.stop()
                raise
            if self.proc.poll() is None:  # alive but not ready in time
                self.stop()
                raise ServerStartError(
                    f"the server was not ready after {self.start_timeout:g} s; the end of its log "
                    f"({self.log_path}):\n{self.log_tail()}"
                )
            self.exit_code = self.proc.returncode
            if "address already in use" not in self.log_tail().lower():
                break
        raise ServerStartError(
            f"the server exited with status {self.exit_code} before it was ready; the end of its log "
            f"({self.log_path}):\n{self.log_tail()}"
        )

    def _wait_ready(self, url: str, deadline: float) -> bool:
        """Poll GET /ready until 200 (True), the process exits or the deadline passes (False)."""
        assert self.proc is not None
        with httpx.Client(base_url=url, timeout=2.0, trust_env=False) as http:
            while time.perf_counter() < deadline and self.proc.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    if http.get("/ready").status_code == 200:
                        return True
                time.sleep(0.2)
        return False

    def stop(self) -> int | None:
        """SIGTERM, then wait `stop_timeout` seconds, then SIGKILL; returns the exit status (None: never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.exit_code = self.proc.returncode
        return self.exit_code


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit, so `finally` blocks (stopping the server) run; Python's default
    would end the process at once and leave the server running."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: signals cannot be caught here
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- the run ------------------------------------------------------------------------------------------------------


def vocab_size_of(checkpoint: Path) -> int:
    """The checkpoint's vocabulary size, from its config (a CheckpointError naming the file when unreadable)."""
    try:
        return int(json.loads((checkpoint / CONFIG_FILE).read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{checkpoint}: no readable vocab_size in {CONFIG_FILE} ({e})") from None


@dataclass(frozen=True)
class ServedCheckpoint:
    """What a benchmark that serves a checkpoint settles first (`kvfree bench serve`, `kvfree bench sessions`): the
    checkpoint and its vocabulary, where and in what dtype it runs, and where its JSON goes (default:
    docs/bench/KIND-CHECKPOINT.json)."""

    path: Path
    vocab_size: int
    device: torch.device
    dtype: torch.dtype
    out: Path

    @classmethod
    def from_args(cls, args: argparse.Namespace, kind: str) -> ServedCheckpoint:
        device = resolve_device(args.device)
        out = args.out or Path("docs/bench") / f"{kind}-{args.checkpoint.resolve().name}.json"
        return cls(args.checkpoint, vocab_size_of(args.checkpoint), device, resolve_dtype(args.dtype, device), out)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def print_targets_and_path(payload: dict[str, Any]) -> None:
    """A served benchmark's last lines: its targets, met or missed, and where its JSON went."""
    print_goals(payload["targets"], payload["device_type"])
    print(f"wrote {payload['out']}")


def _level_seed(seed: int, clients: int) -> int:
    """The prompts' seed of a level: the served and offline runs of one level draw the same prompts."""
    return seed * 100_003 + clients


def git_commit() -> str | None:
    """The commit of the checkout kvfree runs from (None outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def serve_args(args: argparse.Namespace, device: str, dtype: str) -> list[str]:
    """The `kvfree serve` arguments (all but host and port) that size the server as the benchmark asks."""
    out = [str(args.checkpoint), "--device", device, "--dtype", dtype, "--max-sessions", str(args.max_sessions)]
    out += ["--max-waiting", str(max(SERVER_DEFAULTS.max_waiting, max(args.clients)))]  # no level ever gets a 429
    out += ["--max-batch-tokens", str(args.max_batch_tokens), "--max-context", str(args.max_context)]
    out += ["--prefill-batch-wait-ms", f"{args.prefill_batch_wait_ms:g}"]
    out += ["--max-prompt-tokens", str(max(args.prompt_tokens, SERVER_DEFAULTS.max_prompt_tokens))]
    out += ["--max-output-tokens", str(max(args.max_tokens, SERVER_DEFAULTS.max_output_tokens))]
    for override in args.overrides:
        out += ["--set", override]
    if args.enforce_eager:
        out.append("--enforce-eager")
    if args.tensor_parallel_size > 1:
        out += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.kv_cache_dtype != "auto":
        out += ["--kv-cache-dtype", args.kv_cache_dtype]
    return out + args.serve_args


def run_offline(
    args: argparse.Namespace, device: str, dtype: Any, vocab_size: int, progress: bool
) -> dict[int, dict[str, Any]]:
    """`LLM.generate` of each level's prompts in a pool of min(clients, max sessions) slots, after a warm-up per
    pool (FAIRNESS). Returns each level's `offline_run` record, with the pool's size as `sessions`."""
    import torch

    from kvfree.engine.llm import LLM

    results: dict[int, dict[str, Any]] = {}
    by_pool: dict[int, list[int]] = {}
    for clients in args.clients:
        by_pool.setdefault(min(clients, args.max_sessions), []).append(clients)
    for sessions, levels in by_pool.items():
        llm = LLM(
            args.checkpoint,
            device=device,
            dtype=dtype,
            max_sessions=sessions,
            max_context=args.max_context,
            prefill_chunk=args.max_batch_tokens,
            config_overrides=parse_overrides(args.overrides),
            enforce_eager=args.enforce_eager,
            tensor_parallel_size=args.tensor_parallel_size,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        if llm.config.vocab_size != vocab_size:
            raise ValueError(f"the model's vocab_size {llm.config.vocab_size} is not config.json's {vocab_size}")
        llm.runner.capture_prefill_graphs(args.max_batch_tokens)  # as the server did at start-up (FAIRNESS)
        offline_run(llm, min(sessions, WARMUP_PROMPTS), args.prompt_tokens, WARMUP_TOKENS)
        for clients in levels:
            prompts = clients * args.requests_per_client
            # offline_run draws its prompts with random_prompts(prompts, prompt_tokens, vocab, seed), as the served
            # side did: the same token ids.
            run = offline_run(llm, prompts, args.prompt_tokens, args.max_tokens, seed=_level_seed(args.seed, clients))
            results[clients] = {"sessions": sessions, **run}
            if progress:
                print(
                    f"offline, {prompts} prompts in {sessions} slots: {run['output_tokens_per_s']:,.1f} tokens/s",
                    file=sys.stderr,
                )
        llm.close()  # (the other tensor-parallel ranks, if any)
        del llm
        gc.collect()  # the next pool's model and states take the device memory this one held
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def _server_value(metric: str, level: dict[str, Any]) -> float | None:
    """A latency target's metric from the server's own histograms (every token counted, bucket-interpolated)."""
    itl, ttft = level.get("server_itl_s") or {}, level.get("server_ttft_s") or {}
    if metric == "itl_p99_over_p50" and itl.get("p50") and itl.get("p99") is not None:
        return itl["p99"] / itl["p50"]
    if metric == "ttft_p99_s":
        return ttft.get("p99")
    return None


def evaluate_targets(device_type: str, levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every target, with its level's value and whether it is met (None: not for this device, or not run)."""
    by_clients = {level["clients"]: level for level in levels}
    out = []
    for target in TARGETS:
        row: dict[str, Any] = {
            "what": target.what,
            "device": target.device,
            "clients": target.clients,
            "metric": target.metric,
            "op": target.op,
            "threshold": target.threshold,
            "value": None,
            "met": None,
        }
        level = by_clients.get(target.clients)
        if target.device != device_type:
            row["note"] = f"for {target.device}; this run is on {device_type}"
        elif level is None:
            row["note"] = f"not run: no level of {target.clients} clients"
        elif level[target.metric] is None:
            row["note"] = "no value measured"
        else:
            row["value"] = level[target.metric]
            row["met"] = target.met(level[target.metric]) and level["complete"]
            if not level["complete"]:
                row["note"] = "the level did not complete every request"
            server = _server_value(target.metric, level)
            if server is not None:
                row["server_value"] = server  # the same from the server's per-token histograms: a cross-check
            chunks = level["text_chunks_per_token"]
            if target.metric.startswith(("itl", "ttft")) and chunks is not None and chunks < 0.95:
                row["note"] = "; ".join(filter(None, [row.get("note"), (
                    f"measured on text events: {chunks:.0%} as many events as tokens (tokens that are not yet whole "
                    "characters send none), so some gaps span several tokens; server_value is per token"
                )]))  # fmt: skip
        out.append(row)
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.1f}"


def _engine_columns(pace: dict[str, float] | None) -> str:
    """The engine's mean step, the share of the level it was stepping, and the share of that it waited for the
    device (loadtest.prom.engine_pace)."""
    if pace is None:
        return f"{'-':>14} {'-':>5} {'-':>8}"
    return f"{pace['step_ms_mean']:>14.2f} {pace['busy_share']:>5.0%} {pace['device_wait_share']:>8.0%}"


def print_table(payload: dict[str, Any]) -> None:
    """The summary a person reads: one row per level, then the targets."""
    env = payload["environment"]
    s = payload["settings"]
    print(
        f"# {payload['checkpoint_name']} ({s['dtype']}) on {env['device']}, torch {env['torch']}: "
        f"{s['prompt_tokens']}-token prompts, {s['max_tokens']} tokens each, {s['requests_per_client']} requests "
        f"per client, {s['max_sessions']} server slots"
    )
    print(
        f"{'clients':>7} {'requests':>8} {'served tok/s':>12} {'offline tok/s':>13} {'ratio':>6} "
        f"{'TTFT p50/p99 ms':>17} {'ITL p50/p99 ms':>16} {'chunks/tok':>10} {'client CPU':>10} "
        f"{'engine step ms':>14} {'busy':>5} {'GPU wait':>8}"
    )
    for r in payload["levels"]:
        ratio, chunks, cpu = r["served_over_offline"], r["text_chunks_per_token"], r["client_cpu_fraction"]
        print(
            f"{r['clients']:>7} {r['ok']:>4}/{r['requests']:<3} {r['output_tokens_per_s']:>12,.1f} "
            f"{r['offline']['output_tokens_per_s']:>13,.1f} {'-' if ratio is None else f'{ratio:.2f}':>6} "
            f"{_ms(r['ttft_p50_s']) + ' / ' + _ms(r['ttft_p99_s']):>17} "
            f"{_ms(r['itl_p50_s']) + ' / ' + _ms(r['itl_p99_s']):>16} "
            f"{'-' if chunks is None else f'{chunks:.2f}':>10} "
            f"{'-' if cpu is None else f'{cpu:.0%}':>10} {_engine_columns(r['server_engine'])}"
        )
    print_targets_and_path(payload)


def run(args: argparse.Namespace) -> int:
    """The whole benchmark: serve, the levels over HTTP, stop, the offline runs, the JSON and the table."""
    served = ServedCheckpoint.from_args(args, "serve")
    checkpoint, vocab_size, device, dtype, out = served.path, served.vocab_size, served.device, served.dtype, served.out
    dtype_name = served.dtype_name
    if args.server_log is not None:
        log_path = args.server_log
        log_path.parent.mkdir(parents=True, exist_ok=True)
    else:  # kept after the run: the server's own account, if a number looks wrong
        fd, name = tempfile.mkstemp(prefix=f"kvfree-serve-bench-{checkpoint.resolve().name}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    progress = Progress(False if args.no_progress else None)
    levels_prompts = [
        (c, random_prompts(c * args.requests_per_client, args.prompt_tokens, vocab_size, _level_seed(args.seed, c)))
        for c in args.clients
    ]
    warmup = random_prompts(min(args.max_sessions, WARMUP_PROMPTS), args.prompt_tokens, vocab_size, 0)

    def report(level) -> None:
        if not args.no_progress:
            print(f"served, {level.concurrency} clients: {level.output_tokens_per_s:,.1f} tokens/s", file=sys.stderr)

    server = ServerProcess(serve_args(args, str(device), dtype_name), log_path, args.start_timeout)
    print(f"starting the server (log: {log_path})", file=sys.stderr)
    with sigterm_exits():
        with server as url:
            started = time.perf_counter()
            warm, served = asyncio.run(
                run_served_levels(
                    url,
                    levels_prompts,
                    args.max_tokens,
                    warmup=warmup,
                    warmup_tokens=WARMUP_TOKENS,
                    request_timeout=args.request_timeout,
                    client_processes=args.client_processes,
                    progress=progress,
                    on_level=report,
                )
            )
            served_seconds = time.perf_counter() - started
        offline = run_offline(args, str(device), dtype, vocab_size, progress=not args.no_progress)

    levels = []
    for level in served:
        row = level_numbers(level)
        expected = level.planned_requests * args.max_tokens
        row["expected_completion_tokens"] = expected
        row["complete"] = row["ok"] == row["requests"] and row["completion_tokens"] == expected
        row["offline"] = offline[level.concurrency]
        offline_rate = row["offline"]["output_tokens_per_s"]
        row["served_over_offline"] = row["output_tokens_per_s"] / offline_rate if offline_rate else None
        levels.append(row)
    payload = {
        "what": "kvfree serve over HTTP (closed-loop streaming /v1/completions, token-id prompts, greedy, EOS "
        "ignored) against LLM.generate of the same prompts, random token ids",
        "command": [sys.executable, "-m", "kvfree", "bench", *args.argv],
        "server_command": server.command,
        "server_log": str(log_path),
        "server_start_s": server.start_seconds,
        "server_exit_code": server.exit_code,
        "checkpoint": str(checkpoint),
        "checkpoint_name": checkpoint.resolve().name,
        "device_type": device.type,
        "settings": {
            "clients": args.clients,
            "requests_per_client": args.requests_per_client,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "device": str(device),
            "dtype": dtype_name,
            "max_sessions": args.max_sessions,
            "max_batch_tokens": args.max_batch_tokens,
            "max_context": args.max_context,
            "prefill_batch_wait_ms": args.prefill_batch_wait_ms,
            "enforce_eager": args.enforce_eager,
            "tensor_parallel_size": args.tensor_parallel_size,
            "kv_cache_dtype": args.kv_cache_dtype,
            "overrides": args.overrides,
            "server_only_args": args.serve_args,
            "seed": args.seed,
            "request_timeout_s": args.request_timeout,
            "client_processes": args.client_processes,
        },
        "environment": {**environment(device), "kvfree_commit": git_commit()},
        "definitions": {
            "output_tokens_per_s": "completion tokens of successful requests / the level's wall time",
            "ttft": "request sent to its stream's first text event",
            "itl": "gaps between successive text events of one stream",
            "served_over_offline": "served output tokens/s / offline output tokens/s of the same level",
            "offline": FAIRNESS,
            "client_cpu_fraction": "the client's CPU time over the level (summed over its processes) / the level's "
            "wall time / client_processes: near 1, the client itself may limit the rate; client and server share "
            "this machine",
            "server_engine": "the engine's own counters over the level (loadtest.prom.engine_pace): steps, mean step "
            "ms, busy_share (stepping / the level's wall time), device_wait_share (waiting for the device / "
            "stepping), decode rows and prefill tokens per step",
        },
        "warmup": None if warm is None else level_numbers(warm),
        "served_seconds": served_seconds,
        "levels": levels,
        "targets": evaluate_targets(device.type, levels),
        "out": str(out),
    }
    write_json(out, json_safe(payload))
    print_table(payload)
    return 0 if all(r["complete"] for r in levels) else 1


# -- command line -------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The parser of `kvfree bench serve` (every flag's help says what it does)."""
    p = argparse.ArgumentParser(
        prog="kvfree bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # (the old spelling)
    p.add_argument(
        "checkpoint",
        nargs="?",
        type=Path,
        default=None,
        help="checkpoint directory to serve, e.g. one written by `kvfree init-checkpoint mamba2-370m DIR` "
        "(default: the one shipped with kvfree)",
    )
    g = p.add_argument_group("the work")
    g.add_argument(
        "--clients",
        type=positive(int),
        nargs="+",
        default=[1, 64, 256],
        metavar="C",
        help="concurrency levels: closed-loop streaming clients, one level after another (default: 1 64 256)",
    )
    g.add_argument(
        "--requests-per-client",
        type=positive(int),
        default=4,
        metavar="R",
        help="a level of C clients sends C x R requests in all (default: %(default)s)",
    )
    g.add_argument(
        "--prompt-tokens", type=positive(int), default=512, help="random token ids per prompt (default: %(default)s)"
    )
    g.add_argument(
        "--max-tokens",
        type=positive(int),
        default=64,
        help="greedy tokens generated per request, EOS ignored (default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    g = p.add_argument_group("server settings (the offline run gets the same)")
    add_load_args(g)  # --device, --dtype, --set, --enforce-eager: as `kvfree serve` and `kvfree generate` take them
    g.add_argument(
        "--max-sessions",
        type=positive(int),
        default=None,
        help="server state slots; the offline run of C clients gets min(C, this) (default: the largest --clients)",
    )
    g.add_argument(
        "--max-batch-tokens",
        type=positive(int),
        default=SERVER_DEFAULTS.max_batch_tokens,
        help="tokens per engine step, the server's --max-batch-tokens and LLM's prefill_chunk (default: %(default)s, "
        "the server's)",
    )
    g.add_argument(
        "--max-context",
        type=positive(int),
        default=SERVER_DEFAULTS.max_context,
        help="KV-cache size for models with attention layers (default: %(default)s, the server's)",
    )
    g.add_argument(
        "--prefill-batch-wait-ms",
        type=float,
        default=SERVER_DEFAULTS.prefill_batch_wait_ms,
        help="the server's --prefill-batch-wait-ms (offline never waits; default: %(default)s, the server's)",
    )
    g.add_argument(
        "--serve-arg",
        dest="serve_args",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `kvfree serve`, as is, written with '=' when it starts with '-' "
        "(--serve-arg=--max-prefill-tokens --serve-arg=4096); the server's only, not mirrored offline (repeatable)",
    )
    g = p.add_argument_group("bounds and output")
    g.add_argument(
        "--out", type=Path, default=None, help="JSON path (default: docs/bench/serve-CHECKPOINT_DIR_NAME.json)"
    )
    g.add_argument(
        "--server-log",
        type=Path,
        default=None,
        help="where the server's stdout and stderr go (default: a kvfree-serve-bench-*.log in the temp folder, "
        "kept; the JSON names it)",
    )
    g.add_argument(
        "--start-timeout",
        type=positive(float),
        default=600.0,
        help="seconds the server may take to load and answer /ready (default: %(default)s)",
    )
    g.add_argument(
        "--request-timeout",
        type=positive(float),
        default=600.0,
        help="seconds one request may take (default: %(default)s)",
    )
    g.add_argument(
        "--client-processes",
        type=positive(int),
        default=None,
        metavar="N",
        help="split each level's clients over up to N processes, so the client's own Python does not limit a fast "
        "server (see client_cpu_fraction in the JSON) (default: one per 64 clients of the largest level, at most "
        "a quarter of this machine's cores)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bars or per-level lines on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    """`kvfree bench serve ...` (`argv` as after `bench`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    args.clients = list(dict.fromkeys(args.clients))  # a repeated level would only run twice
    args.checkpoint = args.checkpoint or default_checkpoint_path()
    args.max_sessions = args.max_sessions or max(args.clients)
    if args.client_processes is None:
        args.client_processes = max(1, min(math.ceil(max(args.clients) / 64), (os.cpu_count() or 1) // 4))
    try:
        parse_overrides(args.overrides)
        return run(args)
    except (CheckpointError, ServerStartError, ValueError) as e:
        print(f"kvfree bench serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
