"""Re-evaluate a trained MQAR checkpoint and compare with the grid in its `mqar.json`.

    python -m kvfree.training.evaluate checkpoints/trained/mqar-mamba2-ska            # the report's cells, on the CPU
    python -m kvfree.training.evaluate RUN --pairs 4 8 --gaps 64 --sequences 256      # a cheaper subset

By default every cell of the report is scored on exactly the held-out sequences that `training/train.py` scored
(the first `eval_sequences_per_cell` of the cell's fixed held-out stream, in batches of the report's `eval_batch`),
of the report's task, through the path the report used (its `eval_path`: the serving path, StatePool + prefill +
teacher-forced decode, or the training forward). On another device the arithmetic differs in rounding only, so the
table should match to within a few answers. `--gaps` are the lengths of a `zoology` report.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvfree.engine.model.loader import load_model
from kvfree.training.mqar import TASKS, parse_cell
from kvfree.training.train import evaluate_batch, grid_table


def reevaluate(
    path: Path,
    device: str,
    pairs: list[int] | None = None,
    gaps: list[int] | None = None,
    sequences: int | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """(new grid, reported grid) over the chosen cells of the checkpoint at `path` (default: all of its report's).

    `sequences` sets the held-out sequences per cell (rounded up to whole batches of the report's `eval_batch`);
    without it each cell gets exactly the report's sequences, and only then is the reported grid returned for
    comparison (empty otherwise: other sequences, other numbers).
    """
    report = json.loads((path / "mqar.json").read_text())
    reported: dict[str, float] = report["accuracy"]
    task = TASKS[report.get("task", "mqar")]
    forward = report.get("eval_path") == "forward"
    cells = [parse_cell(key) for key in reported]
    pairs = pairs or sorted({M for M, _, _ in cells})
    gaps = gaps or sorted({x for _, _, x in cells})
    batch = report.get("eval_batch", 256)
    per_cell = report.get("eval_sequences_per_cell", {})
    model = load_model(path, device=device, dtype="float32")
    grid = {}
    for x in gaps:
        for M in pairs:
            if not task.fits(M, x):
                continue
            key = task.key(M, x)
            n = sequences or per_cell.get(key, report["eval_sequences"])
            scores = [evaluate_batch(model, M, x, min(batch, n), i, task, forward) for i in range(math.ceil(n / batch))]
            grid[key] = sum(c for c, _ in scores) / sum(t for _, t in scores)
    exact = sequences is None
    return grid, {key: reported[key] for key in grid if key in reported and exact}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a directory written by training/train.py (with mqar.json)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pairs", type=int, nargs="+", help="numbers of pairs to score (default: the report's)")
    parser.add_argument("--gaps", type=int, nargs="+", help="gaps (zoology: lengths) to score (default: the report's)")
    parser.add_argument(
        "--sequences", type=int, help="held-out sequences per cell, rounded up to whole batches (default: the report's)"
    )
    args = parser.parse_args(argv)
    if not (args.checkpoint / "mqar.json").is_file():
        parser.error(f"{args.checkpoint}: no mqar.json (not a checkpoint written by training/train.py)")
    start = time.perf_counter()
    grid, reported = reevaluate(args.checkpoint, args.device, args.pairs, args.gaps, args.sequences)
    print(grid_table(grid))
    if reported:
        worst = max(abs(grid[k] - reported[k]) for k in reported)
        print(f"largest difference from the report: {100 * worst:.2f} points over {len(reported)} cells")
    print(f"{time.perf_counter() - start:.0f} s on {args.device}")


if __name__ == "__main__":
    main()
