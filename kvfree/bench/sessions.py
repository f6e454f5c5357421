"""`kvfree bench sessions`: what a session's next turn costs by where its state was parked, against recomputing it.

    kvfree bench sessions ./mamba2-370m                                   # GPU: bf16
    kvfree bench sessions tests/tiny_checkpoint --device cpu --context 512

`kvfree serve` is started in a subprocess on a free loopback port with two state slots, two host-memory slots and a
snapshot directory, so that idle sessions are pushed out by newer ones: GPU slot -> host memory -> disk. For each
place, `--repeats` times: a new session is prefilled with `--context` random token ids (`POST /v1/sessions`), newer
filler sessions push it to that place (checked with `GET /v1/sessions/{id}`), then its turn is timed: the same ids
plus `--new-tokens` more, one greedy token (`POST /v1/completions` with `session_id`). "recompute" is the same
turn without a session: every token prefilled again. Then a session's snapshot is downloaded
(`GET /v1/sessions/{id}/snapshot`) and restored (`POST /v1/sessions/restore`) `--repeats` times, medians, as a
Python client (httpx) sees it and, where curl is installed, as curl does: httpx's own reading and writing in Python
adds tens of ms to a 50 MB transfer (for a 52 MB snapshot on the development VM ~120 ms to a download that curl
received in 135 ms), so curl's rates, the server's, are the ones judged against the targets when there are both.

With `--under-load N` (default 64 on a GPU, 0 on the CPU), a second server with N + 2 state slots then runs N
streams decoding without end while sessions take turns at `--move-rate` per second, for `--load-seconds` twice: once
on 2 sessions, which stay resident, and once on 8, which share the 2 spare slots, so every turn evicts one session
to host memory and loads another. The inter-token gaps of the N streams (as the client receives them) in both
phases say what the moves cost the streams that do not move.

Writes one JSON (default docs/bench/sessions-CHECKPOINT.json): settings, device and versions, the median and minimum
of each place's turns, the snapshot rates, and the targets of the session-tiers issue with whether each is met.
Prints a table last. Exit status: 0 when it ran (targets met or not), 2 for bad arguments or a server that did not
start.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvfree.bench.harness import Goal, environment, write_json
from kvfree.bench.offline import random_prompts
from kvfree.bench.serve import (
    ServedCheckpoint,
    ServerProcess,
    ServerStartError,
    git_commit,
    print_targets_and_path,
    sigterm_exits,
)
from kvfree.checkpoints import default_checkpoint_path
from kvfree.load_args import add_load_args
from kvfree.loadtest.cli import positive
from kvfree.loadtest.prom import ITL_HISTOGRAM, MetricsSnapshot, engine_pace, histogram_quantiles

PLACES = ("gpu", "host", "disk")
SLOTS = 2  # GPU slots and host-memory slots of the server: two newer sessions push an idle one a tier down
PARK_WAIT_S = 2.0  # how long a parked session's move may take to land before another newer session is made


# The session-tiers issue's targets: a parked session resumes within a few ms of a resident one, and snapshots move
# at memory speed (H100 with a Mamba-2 370M checkpoint; the CPU ones for the development machine).
TARGETS = (
    Goal("cuda", "host_over_gpu_ms", "<=", 5, "parked in host memory: <= resident + 5 ms"),
    Goal("cuda", "disk_over_gpu_ms", "<=", 40, "parked on disk: <= resident + 40 ms"),
    Goal("cuda", "snapshot_download_mb_per_s", ">=", 1000, "snapshot download >= 1 GB/s"),
    Goal("cuda", "snapshot_restore_mb_per_s", ">=", 1000, "snapshot restore >= 1 GB/s"),
    Goal("cuda", "load_itl_p99_over_p50", "<=", 1.5, "under load, moves at 10/s: streams' ITL p99 <= 1.5x p50"),
    Goal("cpu", "host_over_gpu_ms", "<=", 10, "parked in host memory: <= resident + 10 ms"),
    Goal("cpu", "disk_over_gpu_ms", "<=", 60, "parked on disk: <= resident + 60 ms"),
    Goal("cpu", "snapshot_download_mb_per_s", ">=", 500, "snapshot download >= 500 MB/s"),
    Goal("cpu", "snapshot_restore_mb_per_s", ">=", 500, "snapshot restore >= 500 MB/s"),
)


class SessionDriver:
    """The HTTP calls of the benchmark, against one server."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=600, trust_env=False)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        r = self.http.post(path, **kwargs)
        if r.status_code != 200:
            raise RuntimeError(f"POST {path}: {r.status_code} {r.text[:500]}")
        return r

    def new_session(self, prompt: list[int]) -> str:
        return self.post("/v1/sessions", json={"prompt": prompt}).json()["id"]

    def location(self, session_id: str) -> str:
        return self.http.get(f"/v1/sessions/{session_id}").json()["location"]

    def park(self, session_id: str, place: str, filler: list[int]) -> int:
        """Make newer sessions until `session_id` is in `place`; returns how many it took. After each, its move is
        given a moment to land (a spill is written on the server's I/O thread, behind the spills before it)."""
        made = 0
        while (where := self.location(session_id)) != place:
            if PLACES.index(where) > PLACES.index(place) or made > 4 * SLOTS:
                raise RuntimeError(f"could not park session {session_id} in {place}: it is in {where}")
            self.new_session(filler)
            made += 1
            deadline = time.monotonic() + PARK_WAIT_S
            while where == "host" and self.location(session_id) == where and time.monotonic() < deadline:
                time.sleep(0.01)  # (an eviction lands at once: only a spill is waited for)
        return made

    def turn(self, prompt: list[int], session_id: str | None) -> float:
        """Seconds of one turn: `prompt`, one greedy token, on the session (or none)."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if session_id is not None:
            body["session_id"] = session_id
        start = time.perf_counter()
        self.post("/v1/completions", json=body)
        return time.perf_counter() - start

    def close(self) -> None:
        self.http.close()


def measure(driver: SessionDriver, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """Every place's turns, recompute, and the snapshot rates."""
    per_repeat = len(PLACES) + 1  # a session for each place, and the recompute prompt
    prompts = random_prompts(args.repeats * per_repeat + 2, args.context + args.new_tokens, vocab_size, args.seed)
    filler = prompts[-1][:8]
    driver.turn(prompts[-2], None)  # warm-up: kernels compiled, buffers grown
    turns: dict[str, list[float]] = {place: [] for place in (*PLACES, "recompute")}
    fillers = 0
    for r in range(args.repeats):
        for p, place in enumerate(PLACES):
            ids = prompts[r * per_repeat + p]
            sid = driver.new_session(ids[: args.context])
            fillers += driver.park(sid, place, filler)
            turns[place].append(driver.turn(ids, sid))
        turns["recompute"].append(driver.turn(prompts[r * per_repeat + len(PLACES)], None))
    sid = driver.new_session(prompts[0][: args.context])
    downloads, restores = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        data = driver.http.get(f"/v1/sessions/{sid}/snapshot").content
        downloads.append(time.perf_counter() - start)
        start = time.perf_counter()
        driver.post("/v1/sessions/restore", content=data, headers={"content-type": "application/octet-stream"})
        restores.append(time.perf_counter() - start)
    download, restore = statistics.median(downloads), statistics.median(restores)
    curl = curl_rates(driver, sid, data, args.repeats)
    ms = {k: [round(v * 1e3, 3) for v in vs] for k, vs in turns.items()}
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {
        **curl,
        "turn_ms": ms,
        "turn_ms_median": med,
        "turn_ms_min": {k: min(v) for k, v in ms.items()},
        "host_over_gpu_ms": med["host"] - med["gpu"],
        "disk_over_gpu_ms": med["disk"] - med["gpu"],
        "recompute_over_gpu_ms": med["recompute"] - med["gpu"],
        "filler_sessions": fillers,
        "snapshot_bytes": len(data),
        "snapshot_download_s": download,
        "snapshot_restore_s": restore,
        "httpx_download_mb_per_s": len(data) / download / 1e6,
        "httpx_restore_mb_per_s": len(data) / restore / 1e6,
        # The rates judged: curl's where it is installed (the server's speed; httpx's own reading and writing in
        # Python adds tens of ms to 50 MB), else httpx's.
        "snapshot_client": "curl" if curl else "httpx",
        "snapshot_download_mb_per_s": curl.get("curl_download_mb_per_s", len(data) / download / 1e6),
        "snapshot_restore_mb_per_s": curl.get("curl_restore_mb_per_s", len(data) / restore / 1e6),
    }


def curl_rates(driver: SessionDriver, session_id: str, data: bytes, repeats: int) -> dict[str, float]:
    """The snapshot's download and restore rates as curl sees them (its own `time_total`, without its start-up);
    empty without curl."""
    curl = shutil.which("curl")
    if curl is None:
        return {}
    url = str(driver.http.base_url).rstrip("/")
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        get = [curl, "-sf", "-o", os.devnull, "-w", "%{time_total}", f"{url}/v1/sessions/{session_id}/snapshot"]
        post = [curl, "-sf", "-o", os.devnull, "-w", "%{time_total}", "-X", "POST", "--data-binary", f"@{f.name}",
                "-H", "content-type: application/octet-stream", f"{url}/v1/sessions/restore"]  # fmt: skip
        times = {"download": [], "restore": []}
        for _ in range(repeats):
            for kind, cmd in (("download", get), ("restore", post)):
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                times[kind].append(float(out))
    return {f"curl_{kind}_mb_per_s": len(data) / statistics.median(t) / 1e6 for kind, t in times.items()}


# -- under load: streams decoding while sessions move ----------------------------------------------------------------
MOVING_SESSIONS = 8  # sessions taking turns in the moving phase: more than the 2 spare slots, so each turn moves two
MAX_STREAM_TOKENS = 4096  # the server's default limit per completion: a stream outlasts a phase (cancelled at its end)


async def _stream(http: httpx.AsyncClient, prompt: list[int], gaps: list[float], window: list[float]) -> None:
    """One endless greedy stream; the gaps between its chunks that fall inside `window` ([start, end]) are kept."""
    body = {"prompt": prompt, "max_tokens": MAX_STREAM_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
    last = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"stream: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None and window[0] <= last and now <= window[1]:
                gaps.append(now - last)
            last = now


async def _turns(http: httpx.AsyncClient, histories: list[list[int]], extra: list[int], rate: float,
                 until: float) -> int:  # fmt: skip
    """Turns on the sessions of `histories` (id first, then the tokens it holds), round robin at `rate` per second
    until `until`; returns how many ran."""
    done, period = 0, 1.0 / rate
    next_at = time.perf_counter()
    while next_at < until:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        history = histories[done % len(histories)]
        sid, tokens = history[0], history[1:]
        prompt = tokens + extra
        r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                     "session_id": sid})  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"turn: {r.status_code} {r.text[:300]}")
        history[1:] = prompt
        done += 1
        next_at += period
    return done


async def _phase(url: str, histories: list[list[int]], stream_prompts: list[list[int]], extra: list[int],
                 args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """N streams, and turns on `histories` at `--move-rate` for `--load-seconds` once the streams decode."""
    limits = httpx.Limits(max_connections=len(stream_prompts) + 4, max_keepalive_connections=len(stream_prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False, limits=limits) as http:
        gaps: list[float] = []
        window = [math.inf, math.inf]
        streams = [asyncio.create_task(_stream(http, p, gaps, window)) for p in stream_prompts]
        await asyncio.sleep(args.load_warmup)  # every stream prefilled and decoding
        before = MetricsSnapshot.parse((await http.get("/metrics")).text)
        window[0] = time.perf_counter()
        window[1] = window[0] + args.load_seconds
        try:
            turns = await _turns(http, histories, extra, args.move_rate, window[1])
            after = MetricsSnapshot.parse((await http.get("/metrics")).text)
            wall = time.perf_counter() - window[0]
        finally:
            failed = [t.exception() for t in streams if t.done() and not t.cancelled() and t.exception()]
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(streams)} streams failed: {failed[0]}")
    if not gaps:
        raise RuntimeError("no stream produced two tokens in the timed window")
    gaps.sort()
    ms = [g * 1e3 for g in gaps]
    p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    # The server's own gaps (its ITL histogram, as fine as its buckets) and its steps: what the client adds on top.
    server = histogram_quantiles(before, after, ITL_HISTOGRAM, (0.5, 0.99)) or {}
    return {
        "turns": turns, "gaps": len(ms), "itl_p50_ms": p50, "itl_p99_ms": p99, "p99_over_p50": p99 / p50,
        "server_itl_ms": {k: v * 1e3 for k, v in server.items()}, "engine": engine_pace(before, after, wall),
    }  # fmt: skip


def measure_under_load(url: str, args: argparse.Namespace, vocab_size: int) -> dict[str, Any]:
    """ITL of `--under-load` streams with turns on resident sessions, then with turns that move sessions."""
    prompts = random_prompts(args.under_load + MOVING_SESSIONS + 1, args.context, vocab_size, args.seed + 1)
    extra = prompts[-1][: args.new_tokens]
    driver = SessionDriver(url)
    try:
        histories = [[driver.new_session(p), *p] for p in prompts[: MOVING_SESSIONS]]
    finally:
        driver.close()
    stream_prompts = [p[:64] for p in prompts[MOVING_SESSIONS:-1]]
    resident = asyncio.run(_phase(url, histories[:2], stream_prompts, extra, args))
    moving = asyncio.run(_phase(url, histories, stream_prompts, extra, args))
    return {
        "streams": args.under_load, "move_rate_per_s": args.move_rate, "seconds": args.load_seconds,
        "resident": resident, "moving": moving, "load_itl_p99_over_p50": moving["p99_over_p50"],
    }  # fmt: skip


def evaluate_targets(device_type: str, numbers: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {**t.__dict__, "value": numbers.get(t.metric),
         "met": t.met(numbers[t.metric]) if t.device == device_type and t.metric in numbers else None}
        for t in TARGETS
    ]  # fmt: skip


def print_table(payload: dict[str, Any]) -> None:
    n, s = payload["numbers"], payload["settings"]
    print(
        f"# {payload['checkpoint_name']} ({s['dtype']}) on {payload['environment']['device']}: sessions of "
        f"{s['context']} tokens, turns of {s['new_tokens']} new tokens and one generated, {s['repeats']} each"
    )
    print(f"{'session was':>12} {'turn ms (median)':>17} {'min':>8} {'over resident':>14}")
    for place in (*PLACES, "recompute"):
        over = n["turn_ms_median"][place] - n["turn_ms_median"]["gpu"]
        print(f"{place:>12} {n['turn_ms_median'][place]:>17.2f} {n['turn_ms_min'][place]:>8.2f} {over:>+14.2f}")
    mb = n["snapshot_bytes"] / 1e6
    for client in ("curl", "httpx"):
        if f"{client}_download_mb_per_s" in n:
            print(f"snapshot of {mb:.1f} MB, {client}: download {n[f'{client}_download_mb_per_s']:.0f} MB/s, "
                  f"restore {n[f'{client}_restore_mb_per_s']:.0f} MB/s")  # fmt: skip
    load = n.get("under_load")
    if load:
        print(f"{load['streams']} streams decoding, turns at {load['move_rate_per_s']}/s for {load['seconds']} s:")
        for phase in ("resident", "moving"):
            x = load[phase]
            srv = x["server_itl_ms"]
            print(f"{phase:>12} turns: ITL p50 {x['itl_p50_ms']:.2f} ms, p99 {x['itl_p99_ms']:.2f} ms "
                  f"({x['p99_over_p50']:.2f}x), {x['turns']} turns; the server's: p50 {srv.get('p50', math.nan):.2f}"
                  f" ms, p99 {srv.get('p99', math.nan):.2f} ms")  # fmt: skip
    print_targets_and_path(payload)


def run(args: argparse.Namespace) -> int:
    served = ServedCheckpoint.from_args(args, "sessions")
    checkpoint, vocab_size, device, dtype, out = served.path, served.vocab_size, served.device, served.dtype, served.out
    with tempfile.TemporaryDirectory(prefix="kvfree-session-bench-") as tmp:
        serve_args = [str(checkpoint), "--device", str(device), "--dtype", str(dtype).removeprefix("torch.")]
        serve_args += ["--max-sessions", str(SLOTS), "--max-host-sessions", str(SLOTS), "--snapshot-dir", tmp]
        serve_args += ["--max-prompt-tokens", str(args.context + args.new_tokens), *args.serve_args]
        for override in args.overrides:
            serve_args += ["--set", override]
        if args.enforce_eager:
            serve_args.append("--enforce-eager")
        log = Path(tmp) / "server.log"
        server = ServerProcess(serve_args, log, start_timeout=args.start_timeout)
        try:
            with sigterm_exits(), server as url:
                driver = SessionDriver(url)
                try:
                    numbers = measure(driver, args, vocab_size)
                finally:
                    driver.close()
            under_load = args.under_load if args.under_load is not None else (64 if device.type == "cuda" else 0)
            if under_load:
                args.under_load = under_load
                load_args = [*serve_args, "--max-sessions", str(under_load + 2), "--max-host-sessions", "1024"]
                load_args[load_args.index("--max-prompt-tokens") + 1] = str(args.context + args.new_tokens * 1000)
                loaded = ServerProcess(load_args, Path(tmp) / "load-server.log", start_timeout=args.start_timeout)
                with sigterm_exits(), loaded as url:
                    numbers["under_load"] = measure_under_load(url, args, vocab_size)
                numbers["load_itl_p99_over_p50"] = numbers["under_load"]["load_itl_p99_over_p50"]
        except ServerStartError as e:
            print(f"kvfree bench sessions: {e}", file=sys.stderr)
            return 2
    payload = {
        "what": "a session's next turn by where its state was parked (GPU slot, host memory, disk) against "
        "recomputing the whole prompt, and a snapshot's download and restore, over HTTP",
        "command": [sys.executable, "-m", "kvfree", "bench", *sys.argv[2:]],
        "server_command": server.command,
        "checkpoint": str(checkpoint),
        "checkpoint_name": checkpoint.resolve().name,
        "device_type": device.type,
        "settings": {
            "context": args.context, "new_tokens": args.new_tokens, "repeats": args.repeats, "seed": args.seed,
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "gpu_slots": SLOTS,
            "host_slots": SLOTS, "serve_args": args.serve_args, "under_load": args.under_load,
            "move_rate": args.move_rate, "load_seconds": args.load_seconds,
        },  # fmt: skip
        "environment": {**environment(device), "kvfree_commit": git_commit()},
        "numbers": numbers,
        "targets": evaluate_targets(device.type, numbers),
        "out": str(out),
    }
    write_json(out, payload)
    print_table(payload)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvfree bench sessions", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sessions", action="store_true", help=argparse.SUPPRESS)  # (the old spelling)
    p.add_argument("checkpoint", nargs="?", type=Path, default=None, help="checkpoint directory (default: shipped)")
    p.add_argument("--context", type=positive(int), default=2048, help="tokens a session holds (default: %(default)s)")
    p.add_argument("--new-tokens", type=positive(int), default=16, help="new tokens per turn (default: %(default)s)")
    p.add_argument("--repeats", type=positive(int), default=5, help="turns timed per place (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: %(default)s)")
    add_load_args(p)
    p.add_argument(
        "--serve-arg",
        dest="serve_args",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `kvfree serve`, written with '=' when it starts with '-' (repeatable)",
    )
    p.add_argument("--under-load", type=int, default=None, metavar="N",
                   help="streams decoding while sessions move (default: 64 on a GPU, 0 on the CPU; 0: skip)")
    p.add_argument("--move-rate", type=positive(float), default=10.0, help="session turns per second under load")
    p.add_argument("--load-seconds", type=positive(float), default=5.0, help="seconds of each phase under load")
    p.add_argument("--load-warmup", type=positive(float), default=3.0,
                   help="seconds the streams decode before a phase is timed")
    p.add_argument("--start-timeout", type=positive(float), default=900.0, help="seconds to wait for the server")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: docs/bench/sessions-CHECKPOINT.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.checkpoint is None:
        args.checkpoint = default_checkpoint_path()
    return run(args)
