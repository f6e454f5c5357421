"""Write-through cost per turn: what storing one session's state after a turn costs, for a preset's state size.

    python -m kvfree.bench.stores --preset mamba2-370m --store /tmp/sessions
    python -m kvfree.bench.stores --preset mamba2-370m --store redis://127.0.0.1:6379/0

A turn's write is `SessionTiers.persist_turn`: copy the session's pool rows to the host, encode the
snapshot (checksum included), write it to the store; the load is the reverse, when another replica continues the
session. Times the median of `--turns` of each with random non-zero state; writes JSON under docs/bench/.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvfree.bench.harness import environment, write_json
from kvfree.bench.step import build_model
from kvfree.engine.model.loader import resolve_device, resolve_dtype
from kvfree.engine.model.presets import PRESETS
from kvfree.engine.sessions.manager import SessionManager
from kvfree.engine.sessions.store import open_store
from kvfree.engine.state.pool import StatePool
from kvfree.engine.state.snapshot import model_fingerprint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="mamba2-370m", choices=sorted(PRESETS))
    parser.add_argument("--store", required=True, help="a directory, or redis://host:port/db")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: docs/bench/store-KIND.json)")
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = build_model(args.preset, device, dtype)
    pool = StatePool(model, capacity=1)
    fingerprint = model_fingerprint(model)
    store = open_store(args.store, fingerprint, fsync=True)  # as under `--session-write through`
    manager = SessionManager(pool, fingerprint, max_host_sessions=1, store=store, write_through=True)
    session = manager.create(owner=None)
    manager.acquire_slot(session)
    gen = torch.Generator(device=device).manual_seed(0)
    writes, loads = [], []
    for turn in range(args.turns):
        for state in pool.tensors:  # a turn changed the state
            for t in state.values():
                if t.is_floating_point():
                    t.copy_(torch.randn(t.shape, generator=gen, device=device).to(t.dtype))
        session.extend([turn])
        start = time.perf_counter()
        manager.tiers.persist_turn(session)
        writes.append(time.perf_counter() - start)
        start = time.perf_counter()
        snap = manager.tiers.read_snapshot(session)  # read, verify and check, as a reload does
        loads.append(time.perf_counter() - start)
    manager.delete(session)
    store.close()
    state_bytes = pool.bytes_per_session()
    kind = "redis" if str(args.store).startswith(("redis://", "rediss://")) else "directory"
    payload = {
        "what": "write-through of one session per turn (pool rows to host, encode, store) and its reload",
        "preset": args.preset,
        "store": kind,
        "environment": environment(device),
        "state_bytes": state_bytes,
        "snapshot_bytes": snap.state.nbytes,
        "turns": args.turns,
        "write_ms_median": statistics.median(writes) * 1e3,
        "load_ms_median": statistics.median(loads) * 1e3,
    }
    out = write_json(args.out or Path("docs/bench") / f"store-{kind}.json", payload)
    print(
        f"{args.preset} state {state_bytes / 2**20:.1f} MiB on {kind}: write-through "
        f"{payload['write_ms_median']:.1f} ms per turn "
        f"({state_bytes / payload['write_ms_median'] / 1e6:.2f} GB/s), reload"
        f" {payload['load_ms_median']:.1f} ms (median of {args.turns}; {payload['environment']['device']})"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
