"""Train every MQAR family at once, spread over the GPUs of one machine, and tabulate the held-out grids.

    python -m kvfree.training.train_all --out runs/mqar --time-limit 400 --eval-time-limit 80 --per-gpu 2

Each run is `training/train.py` in its own process (`CUDA_VISIBLE_DEVICES` picks its GPU); arguments this script
does not know (e.g. `--eval-time-limit`, `--set ska.rank=32`, `--seed 1`) go to every run. The models are small and
their steps launch-bound, so runs can share a GPU, but each then gets fewer steps: the shipped checkpoints trained
one (at most two) per GPU. A run is FAMILY:LR[:WIDTH[:SEED]] (`--task zoology` passes through to every run);
a family at one width may run at several learning rates and seeds, and the run with the best mean held-out
accuracy is the one reported first for it. Logs go to `<out>/<run>/train.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvfree.training.train import FAMILIES, grid_table

# Run i goes to GPU i % (number of GPUs): on 4 GPUs with --per-gpu 2 the first two runs share their GPU with the
# last two, so the runs that need the most steps (SKA, GKA) come third and fourth and train alone.
DEFAULT_RUNS = [
    "mamba2-lattice:1e-3",
    "mamba2-attention:1e-3",
    "mamba2-ska:1e-3",
    "mamba2-gka:1e-3",
    "mamba2-bmojo:1e-3",
    "mamba2:1e-3",
]


def parse_run(spec: str) -> tuple[str, float, int | None, int | None]:
    """ "family:lr[:width[:seed]]" -> (family, lr, width, seed); a missing width or seed is None (train.py's)."""
    family, _, rest = spec.partition(":")
    fields = rest.split(":")
    if family not in FAMILIES or not 1 <= len(fields) <= 3:
        raise argparse.ArgumentTypeError(
            f"run {spec!r}: expected FAMILY:LR[:WIDTH[:SEED]] with FAMILY one of {sorted(FAMILIES)}"
        )
    try:
        lr = float(fields[0])
        width, seed = (int(f) if f else None for f in (fields + ["", ""])[1:3])
    except ValueError:
        raise argparse.ArgumentTypeError(f"run {spec!r}: LR must be a number, WIDTH and SEED integers") from None
    return family, lr, width, seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=parse_run, nargs="+", default=[parse_run(r) for r in DEFAULT_RUNS])
    parser.add_argument("--time-limit", type=float, default=400.0, help="training seconds per run")
    parser.add_argument("--per-gpu", type=int, default=2, help="runs sharing one GPU at most")
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--eval-sequences", type=int, default=1024)
    args, passthrough = parser.parse_known_args(argv)

    gpus = max(1, torch.cuda.device_count())
    # Physical ids as this process sees them, so a parent's CUDA_VISIBLE_DEVICES=2,3 is honoured.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
    if len(args.runs) > gpus * args.per_gpu:
        parser.error(f"{len(args.runs)} runs do not fit {gpus} GPU(s) x {args.per_gpu} per GPU")
    procs: list[tuple[str, str, subprocess.Popen]] = []
    for i, (family, lr, width, seed) in enumerate(args.runs):
        group = family if width is None else f"{family}-w{width}"  # runs of a group differ in lr and seed
        name = f"{group}-lr{lr:g}" + ("" if seed is None else f"-s{seed}")
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # Each run's host work (batch making, launches) on its share of the cores: with every process using all of
        # them, 16 runs on a 64-core host made ~0.4 steps/s each where one alone made 13 (measured).
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(args.runs))))
        if torch.cuda.is_available():
            env["CUDA_VISIBLE_DEVICES"] = visible[i % gpus]
        cmd = [sys.executable, "-m", "kvfree.training.train", "--family", family, "--lr", str(lr), "--out", str(out)]
        cmd += ["--time-limit", str(args.time_limit), "--steps", str(args.steps)]
        cmd += ["--eval-sequences", str(args.eval_sequences), *passthrough]
        cmd += [] if width is None else ["--width", str(width)]
        cmd += [] if seed is None else ["--seed", str(seed)]
        log = (out / "train.log").open("w")
        procs.append((group, name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)))
        time.sleep(0.5)  # stagger CUDA context creation
    failed = [name for _, name, p in procs if p.wait() != 0]

    results: dict[str, list[dict]] = {}
    for group, name, _ in procs:
        report = args.out / name / "mqar.json"
        if report.exists():
            data = json.loads(report.read_text())
            data["run"] = name
            data["mean"] = sum(data["accuracy"].values()) / len(data["accuracy"])
            results.setdefault(group, []).append(data)
    summary = {}
    for group, runs in results.items():
        runs.sort(key=lambda r: -r["mean"])
        for rank, r in enumerate(runs):
            last = r["log"][-1] if r["log"] else {}
            print(
                f"\n### {r['run']}{' (best)' if rank == 0 else ''}: {r['params']} params, {r['steps']} steps, "
                f"{r['train_seconds']:.0f} s, final train loss {last.get('loss', float('nan')):.3f}, "
                f"mean held-out {100 * r['mean']:.1f}%"
            )
            print(grid_table(r["accuracy"]))
        summary[group] = runs[0]["run"]
    (args.out / "summary.json").write_text(json.dumps({"best": summary, "failed": failed}, indent=2) + "\n")
    if failed:
        print(f"\nfailed runs: {failed} (see their train.log)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
