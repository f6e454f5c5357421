"""`kvfree bench --sessions`: what a session's next turn costs by where its state was parked, against recomputing it.

    kvfree bench --sessions ./mamba2-370m                                   # GPU: bf16
    kvfree bench --sessions tests/tiny_checkpoint --device cpu --context 512

`kvfree serve` is started in a subprocess on a free loopback port with two state slots, two host-memory slots and a
snapshot directory, so that idle sessions are pushed out by newer ones: GPU slot -> host memory -> disk. For each
place, `--repeats` times: a new session is prefilled with `--context` random token ids (`POST /v1/sessions`), newer
filler sessions push it to that place (checked with `GET /v1/sessions/{id}`), then its turn is timed: the same ids
plus `--new-tokens` more, one greedy token (`POST /v1/completions` with `session_id`). "recompute" is the same
turn without a session: every token prefilled again. Then a session's snapshot is downloaded
(`GET /v1/sessions/{id}/snapshot`) and restored (`POST /v1/sessions/restore`) `--repeats` times, medians. All is
timed as a Python client (httpx) sees it: for a 52 MB snapshot on the development VM httpx itself adds ~120 ms to a
download that curl receives in 135 ms.

Writes one JSON (default docs/bench/sessions-CHECKPOINT.json): settings, device and versions, the median and minimum
of each place's turns, the snapshot rates, and the targets of the session-tiers issue with whether each is met.
Prints a table last. Exit status: 0 when it ran (targets met or not), 2 for bad arguments or a server that did not
start.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvfree.checkpoints import default_checkpoint_path
from kvfree.cli import add_load_args
from kvfree.engine.loader import resolve_device, resolve_dtype
from kvfree.engine.throughput import random_prompts
from kvfree.kernels.benchmarking import Goal, environment, print_goals, write_json
from kvfree.loadtest.cli import positive
from kvfree.serve_bench import ServerProcess, ServerStartError, git_commit, sigterm_exits, vocab_size_of

PLACES = ("gpu", "host", "disk")
SLOTS = 2  # GPU slots and host-memory slots of the server: two newer sessions push an idle one a tier down


# The session-tiers issue's targets: a parked session resumes within a few ms of a resident one, and snapshots move
# at memory speed (H100 with a Mamba-2 370M checkpoint; the CPU ones for the development machine).
TARGETS = (
    Goal("cuda", "host_over_gpu_ms", "<=", 5, "parked in host memory: <= resident + 5 ms"),
    Goal("cuda", "disk_over_gpu_ms", "<=", 40, "parked on disk: <= resident + 40 ms"),
    Goal("cuda", "snapshot_download_mb_per_s", ">=", 1000, "snapshot download >= 1 GB/s"),
    Goal("cuda", "snapshot_restore_mb_per_s", ">=", 1000, "snapshot restore >= 1 GB/s"),
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
        """Make newer sessions until `session_id` is in `place`; returns how many it took."""
        made = 0
        while (where := self.location(session_id)) != place:
            if PLACES.index(where) > PLACES.index(place) or made > 4 * SLOTS:
                raise RuntimeError(f"could not park session {session_id} in {place}: it is in {where}")
            self.new_session(filler)
            made += 1
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
    ms = {k: [round(v * 1e3, 3) for v in vs] for k, vs in turns.items()}
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {
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
        "snapshot_download_mb_per_s": len(data) / download / 1e6,
        "snapshot_restore_mb_per_s": len(data) / restore / 1e6,
    }


def evaluate_targets(device_type: str, numbers: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {**t.__dict__, "value": numbers[t.metric], "met": t.met(numbers[t.metric]) if t.device == device_type else None}
        for t in TARGETS
    ]


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
    print(
        f"snapshot of {mb:.1f} MB: download {n['snapshot_download_mb_per_s']:.0f} MB/s, restore "
        f"{n['snapshot_restore_mb_per_s']:.0f} MB/s"
    )
    print_goals(payload["targets"], payload["device_type"])
    print(f"wrote {payload['out']}")


def run(args: argparse.Namespace) -> int:
    checkpoint: Path = args.checkpoint
    vocab_size = vocab_size_of(checkpoint)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    out = args.out or Path("docs/bench") / f"sessions-{checkpoint.resolve().name}.json"
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
        except ServerStartError as e:
            print(f"kvfree bench --sessions: {e}", file=sys.stderr)
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
            "host_slots": SLOTS, "serve_args": args.serve_args,
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
        prog="kvfree bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sessions", action="store_true", required=True, help="this mode: session turns by tier")
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
    p.add_argument("--start-timeout", type=positive(float), default=900.0, help="seconds to wait for the server")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: docs/bench/sessions-CHECKPOINT.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.checkpoint is None:
        args.checkpoint = default_checkpoint_path()
    return run(args)
