"""Train a small model of one family on MQAR and evaluate it through the engine's prefill/decode path.

    python -m kvfree.training.train --family mamba2-ska --out runs/mamba2-ska --device cuda --time-limit 420

Training uses the differentiable `HybridLM.forward` on fresh MQAR batches. Evaluation does not: for each held-out
sequence it prefills the prompt (pairs + gap) into a StatePool slot and then decodes the query block token by token
(teacher-forced), as a server would, and scores the prediction at every query key. The result is a native
checkpoint (byte-level tokenizer; MQAR uses token ids 0..127) plus `mqar.json` with the accuracy grid.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
from kvfree.engine.config import ModelConfig, parse_overrides
from kvfree.engine.loader import save_model
from kvfree.engine.model import HybridLM
from kvfree.engine.state_pool import StatePool
from kvfree.engine.step_batch import StepBatch
from kvfree.training.mqar import IGNORE, VOCAB, held_out, make_mqar

BYTE_VOCAB = 261
HIDDEN = 128

# The small hybrid of ska.md §7.3: [Mamba-2, Mamba-2, X, X] with SwiGLU, d = 128; X is the family's recall layer.
MAMBA2 = {"num_heads": 8, "head_dim": 32, "state_size": 16, "n_groups": 1, "conv_kernel": 4, "chunk_size": 64}
RECALL_LAYERS: dict[str, dict[str, Any]] = {
    "mamba2": {},
    "attention": {"attention": {"num_heads": 4, "num_kv_heads": 4, "head_dim": 32}},
    # fp32 accumulators: MQAR sequences are short (<= 4.2K tokens), and fp64 is slow on GPUs.
    "ska": {"ska": {"num_heads": 4, "rank": 24, "head_dim": 32, "chunk_size": 64, "accum_dtype": "float32"}},
    "gka": {"gka": {"num_heads": 4, "head_dim": 32, "conv_kernel": 4, "chunk_size": 64, "num_iter": 30}},
    "lattice": {"lattice": {"num_heads": 4, "head_dim": 32, "num_slots": 32, "conv_kernel": 4}},
    # Eidetic store of 64 tokens: room for every key and value of the largest MQAR cell (32 pairs).
    "bmojo": {
        "bmojo": {
            "num_heads": 4,
            "num_kv_heads": 4,
            "head_dim": 32,
            "ssm_num_heads": 8,
            "ssm_head_dim": 32,
            "ssm_state_size": 16,
            "window": 64,
            "fading_tokens": 1,
            "eidetic_tokens": 64,
        }
    },
}
FAMILIES: dict[str, list[str]] = {
    "mamba2": ["mamba2"] * 4,
    "mamba2-attention": ["mamba2", "mamba2", "attention", "attention"],
    "mamba2-ska": ["mamba2", "mamba2", "ska", "ska"],
    "mamba2-gka": ["mamba2", "mamba2", "gka", "gka"],
    "mamba2-lattice": ["mamba2", "mamba2", "lattice", "lattice"],
    "mamba2-bmojo": ["mamba2", "mamba2", "bmojo", "bmojo"],
}

TRAIN_PAIRS = [4, 8, 16, 32]
TRAIN_GAPS = [64, 128, 256, 512, 1024, 2048, 4096]
# Lattice's reference recurrence loops over tokens in training too (its fused kernel is a later issue): a gap-4096
# step costs ~20x a gap-256 one, so within one device call it trains on short gaps only (BENCHMARKS.md, MQAR).
FAMILY_TRAIN_GAPS = {"mamba2-lattice": [64, 128, 256]}
EVAL_PAIRS = [4, 8, 16, 32]
EVAL_GAPS = [64, 256, 1024, 4096]


def family_config(family: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The ModelConfig of a family name from FAMILIES, with dotted `overrides` (e.g. {"ska.rank": 32}) applied."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    layers = FAMILIES[family]
    data: dict[str, Any] = {
        "vocab_size": BYTE_VOCAB,
        "hidden_size": HIDDEN,
        "layers": layers,
        # Untied: with the LM head tied to the embedding, a 2-layer attention model at width 64 stays on the MQAR
        # plateau (measured), where the untied one learns the task.
        "tie_word_embeddings": False,
        "mlp": {"intermediate_size": 3 * HIDDEN},
        "notes": {"trained_on": "MQAR (docs/design/ska.md §7.3): token ids 0..127", "family": family},
    }
    for kind in set(layers):
        data.update({"mamba2": MAMBA2} if kind == "mamba2" else RECALL_LAYERS[kind])
    return ModelConfig.from_dict(ModelConfig.apply_overrides(data, overrides or {}))


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 10% of the peak as `progress` goes 0 -> 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_for(seq_len: int, tokens_per_step: int, max_batch: int) -> int:
    """Sequences per step for a sequence length: a fixed token budget, so long-gap cells get fewer rows."""
    return max(8, min(max_batch, tokens_per_step // seq_len))


def mixed_batch(pairs: list[int], gap: int, rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` MQAR sequences of one length, 4·max(pairs) + gap, each with its own number of pairs from `pairs`.

    A row with M < max(pairs) pairs gets a gap longer by 4·(max(pairs) - M) so that every row ends together: one
    step then trains every opened pair count at once (one count per step made the gradient swing between cells).
    Returns input_ids and targets, `[rows, T]` each.
    """
    longest = max(pairs)
    counts = torch.bincount(torch.randint(len(pairs), (rows,), generator=gen), minlength=len(pairs)).tolist()
    parts = [make_mqar(M, gap + 4 * (longest - M), n, gen) for M, n in zip(pairs, counts, strict=True) if n]
    return torch.cat([p.input_ids for p in parts]), torch.cat([p.targets for p in parts])


def gap_weights(gaps: list[int]) -> torch.Tensor:
    """Sampling weights ∝ 1/sqrt(gap): a long-gap step holds few sequences (token budget), so few queries to learn
    from, while held-out accuracy depends on the number of pairs far more than on the gap (BENCHMARKS.md)."""
    return torch.tensor([g**-0.5 if g > 0 else 1.0 for g in gaps])


def train(
    model: HybridLM,
    steps: int,
    batch: int,
    lr: float,
    time_limit: float,
    seed: int,
    pairs: list[int],
    gaps: list[int],
    tokens_per_step: int = 65536,
    log_every: int = 100,
) -> list[dict[str, float]]:
    """AdamW on fresh MQAR batches of a random (pairs, gap) cell per step; stops at `steps` or `time_limit`.

    Progress is whichever budget binds first (steps or seconds), so the learning-rate schedule and the curriculum
    complete even when the time limit ends training early. `pairs` and `gaps` are sorted easiest first; the
    curriculum opens a growing prefix of each. A step draws one gap (weighted by `gap_weights`) and mixes every
    opened pair count in its batch (`mixed_batch`); it holds at most `batch` sequences and about `tokens_per_step`
    tokens.
    """
    device = model.device
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    gen = torch.Generator().manual_seed(seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    log: list[dict[str, float]] = []
    start, losses, hits = time.perf_counter(), [], []  # per step since the last log entry
    warmup = min(200, steps // 10 + 1)

    def log_period(done: int) -> None:
        """One log entry for the steps since the last one: mean loss and accuracy at the query keys."""
        entry = {
            "step": done,
            "loss": float(torch.stack(losses).mean()),
            "train_acc": float(torch.stack(hits).mean()),
            "seconds": time.perf_counter() - start,
        }
        log.append(entry)
        print(json.dumps(entry), flush=True)
        losses.clear()
        hits.clear()

    model.train()
    for step in range(steps):
        elapsed = time.perf_counter() - start
        if elapsed > time_limit:
            break
        progress = max(step / steps, elapsed / time_limit)
        # Curriculum: the harder cells (more pairs, longer gaps) open up over the first half of training.
        opened = min(1.0, 0.25 + 1.5 * progress)
        open_pairs = pairs[: max(1, math.ceil(opened * len(pairs)))]
        open_gaps = gaps[: max(1, math.ceil(opened * len(gaps)))]
        gap = open_gaps[int(torch.multinomial(gap_weights(open_gaps), 1, generator=gen))]
        rows = batch_for(4 * max(open_pairs) + gap, tokens_per_step, batch)
        ids, targets = (t.to(device) for t in mixed_batch(open_pairs, gap, rows, gen))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, lr, warmup)
        with autocast:
            logits = model(ids)
        logits = logits[..., :VOCAB].float()
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        scored = targets != IGNORE
        hits.append((logits.detach().argmax(-1) == targets)[scored].float().mean())
        if (step + 1) % log_every == 0:
            log_period(step + 1)
    if losses:  # the steps after the last full logging period (training stopped by its time limit)
        log_period(int(log[-1]["step"]) + len(losses) if log else len(losses))
    model.eval()
    return log


@torch.inference_mode()
def evaluate_batch(model: HybridLM, num_pairs: int, gap: int, batch: int, index: int) -> tuple[int, int]:
    """(correct, scored) answers over held-out batch `index` of a cell, through StatePool + prefill + teacher-forced
    decode (the serving path)."""
    data = held_out(num_pairs, gap, batch, index)
    pool = StatePool(model, capacity=batch, max_context=data.input_ids.shape[1] + 1)
    ids = data.input_ids.to(model.device)
    B, T = ids.shape
    slots = torch.tensor([pool.alloc() for _ in range(B)], device=model.device)
    prefix = data.prefix_len
    model.prefill(ids[:, :prefix].flatten(), pool.tensors, StepBatch.prefill(slots, [prefix] * B))
    correct = total = 0
    decode_batch = StepBatch.decode(slots)
    for pos in range(prefix, T - 1):
        logits = model.decode(ids[:, pos], pool.tensors, decode_batch)
        if data.targets[0, pos] != IGNORE:
            pred = logits[:, :VOCAB].argmax(-1)
            correct += int((pred == ids[:, pos + 1]).sum())
            total += B
    return correct, total


def evaluate_cell(model: HybridLM, num_pairs: int, gap: int, sequences: int, batch: int) -> float:
    """Held-out accuracy of one cell over ceil(sequences / batch) batches of `batch` sequences."""
    scores = [evaluate_batch(model, num_pairs, gap, batch, i) for i in range(math.ceil(sequences / batch))]
    return sum(c for c, _ in scores) / sum(t for _, t in scores)


def evaluate(
    model: HybridLM,
    pairs: list[int],
    gaps: list[int],
    sequences: int,
    batch: int,
    time_limit: float = math.inf,
) -> tuple[dict[str, float], dict[str, int]]:
    """Accuracy per cell, keyed "M=<pairs>,gap=<gap>", and the number of held-out sequences behind each.

    Cells are visited round-robin, one batch each per round, so that when `time_limit` (seconds) runs out every
    cell has the same number of sequences (give or take one batch). The first round always completes.
    """
    cells = [(M, g) for g in gaps for M in pairs]
    scores = {cell: [0, 0, 0] for cell in cells}  # correct, scored, sequences
    start = time.perf_counter()
    for index in range(math.ceil(sequences / batch)):
        for M, g in cells:
            if index > 0 and time.perf_counter() - start > time_limit:
                break
            correct, total = evaluate_batch(model, M, g, batch, index)
            score = scores[(M, g)]
            score[0], score[1], score[2] = score[0] + correct, score[1] + total, score[2] + batch
    grid = {f"M={M},gap={g}": c / t for (M, g), (c, t, _) in scores.items()}
    counts = {f"M={M},gap={g}": n for (M, g), (_, _, n) in scores.items()}
    return grid, counts


def format_table(grid: dict[str, float], pairs: list[int], gaps: list[int]) -> str:
    """Markdown table: one row per gap, one column per number of pairs, accuracy in %."""
    lines = ["| gap \\ pairs | " + " | ".join(str(M) for M in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    for g in gaps:
        cells = [f"{100 * grid[f'M={M},gap={g}']:.1f}" for M in pairs]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=256, help="sequences per step at most")
    parser.add_argument("--tokens-per-step", type=int, default=65536, help="tokens per step at most (long gaps)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds of training at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-pairs", type=int, nargs="+", default=TRAIN_PAIRS)
    parser.add_argument("--train-gaps", type=int, nargs="+", help="default: 64 ... 4096 (64 ... 256 for Lattice)")
    parser.add_argument("--eval-pairs", type=int, nargs="+", default=EVAL_PAIRS)
    parser.add_argument("--eval-gaps", type=int, nargs="+", default=EVAL_GAPS)
    parser.add_argument("--eval-sequences", type=int, default=1024)
    parser.add_argument("--eval-batch", type=int, default=256)
    parser.add_argument(
        "--eval-time-limit",
        type=float,
        default=math.inf,
        help="seconds of evaluation at most; cells share it round-robin (the report says how many sequences each got)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help="override a value of the family's config, e.g. --set ska.rank=32 (VALUE is JSON; repeatable)",
    )
    args = parser.parse_args(argv)
    args.train_gaps = args.train_gaps or FAMILY_TRAIN_GAPS.get(args.family, TRAIN_GAPS)
    for name in ("train_pairs", "train_gaps", "eval_pairs", "eval_gaps"):
        setattr(args, name, sorted(getattr(args, name)))  # the curriculum opens them easiest first
    overrides = parse_overrides(args.overrides)

    torch.manual_seed(args.seed)
    config = family_config(args.family, overrides)
    model = HybridLM(config)
    model.init_weights(args.seed, std=None)  # PyTorch's default init: see HybridLM.init_weights
    model.to(args.device)
    params = sum(p.numel() for p in model.parameters())
    print(f"family={args.family} params={params} device={args.device}", flush=True)
    start = time.perf_counter()
    log = train(
        model,
        args.steps,
        args.batch,
        args.lr,
        args.time_limit,
        args.seed,
        args.train_pairs,
        args.train_gaps,
        args.tokens_per_step,
    )
    train_seconds = time.perf_counter() - start
    # The checkpoint is stored in bf16 (a few MB for every family together); evaluate exactly those weights.
    model.to(torch.bfloat16).to(torch.float32)
    eval_start = time.perf_counter()
    grid, counts = evaluate(
        model, args.eval_pairs, args.eval_gaps, args.eval_sequences, args.eval_batch, args.eval_time_limit
    )
    eval_seconds = time.perf_counter() - eval_start
    table = format_table(grid, args.eval_pairs, args.eval_gaps)
    print(table, flush=True)

    model.to("cpu", torch.bfloat16)
    with tempfile.TemporaryDirectory() as tok:
        write_byte_tokenizer(tok)
        save_model(model, args.out, tokenizer_from=tok)
    report = {
        "family": args.family,
        "overrides": overrides,
        "layers": config.layers,
        "params": params,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "steps": log[-1]["step"] if log else 0,
        "batch": args.batch,
        "tokens_per_step": args.tokens_per_step,
        "lr": args.lr,
        "train_seconds": train_seconds,
        "train_pairs": args.train_pairs,
        "train_gaps": args.train_gaps,
        "eval_batch": args.eval_batch,
        "eval_sequences": min(counts.values()),
        "eval_sequences_per_cell": counts,
        "eval_seconds": eval_seconds,
        "accuracy": grid,
        "log": log,
    }
    (args.out / "mqar.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
