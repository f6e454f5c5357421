"""Train a small model of one family on MQAR and evaluate it through the engine's prefill/decode path.

    python -m kvfree.training.train --family mamba2-ska --out runs/mamba2-ska --device cuda --time-limit 420
    python -m kvfree.training.train --family mamba2 --task zoology --width 64 --out runs/z-mamba2-64 --lr 3e-3

Two tasks (kvfree.training.mqar): `mqar`, ska.md §7.3's grid of pairs by gap over 128 token ids, and `zoology`,
Zoology's MQAR over 8,192 token ids, 64-256 pairs in 512-2,048 tokens, where a recurrent state too small for the
pairs shows. Training uses the differentiable `HybridLM.forward` on fresh batches. Evaluation of `mqar` does not:
for each held-out sequence it prefills the prompt (the pairs and the gap) into a StatePool slot and then decodes
the rest token by token (teacher-forced), as a server would, scoring the prediction at every query key; `zoology`
scores the same function through the forward by default (`--eval-path`). The result is a native checkpoint
(byte-level tokenizer; the tasks' token ids are model ids) plus `mqar.json` with the grid.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvfree.checkpoints.byte_tokenizer import write_byte_tokenizer
from kvfree.engine.model.config import ModelConfig, parse_overrides
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import save_model
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.state.pool import StatePool
from kvfree.training.mqar import (
    IGNORE,
    TASKS,
    VOCAB,
    MQARBatch,
    Task,
    cell_key,
    make_mqar,
    make_zoology_mqar,
    parse_cell,
)  # fmt: skip

BYTE_VOCAB = 261
HIDDEN = 128
HEAD_DIM = 32  # every mixer's head width; the number of heads follows the model's width


def recall_layers(width: int) -> dict[str, dict[str, Any]]:
    """Each family's layer configs at model width `width` (a multiple of HEAD_DIM): Mamba-2 with expand 2, and the
    recall layer X with width / HEAD_DIM heads, so that every family has the same width and depth.

    At the default width 128 this is the small hybrid of ska.md §7.3: [Mamba-2, Mamba-2, X, X] with SwiGLU, d = 128.
    """
    if width <= 0 or width % HEAD_DIM:
        raise ValueError(f"width must be a positive multiple of {HEAD_DIM}, got {width}")
    heads = width // HEAD_DIM
    mamba2 = {"num_heads": 2 * heads, "head_dim": HEAD_DIM, "state_size": 16, "n_groups": 1, "conv_kernel": 4,
              "chunk_size": 64}  # fmt: skip
    return {
        "mamba2": {"mamba2": mamba2},
        "attention": {"attention": {"num_heads": heads, "num_kv_heads": heads, "head_dim": HEAD_DIM}},
        # fp32 accumulators: MQAR sequences are short (<= 4.2K tokens), and fp64 is slow on GPUs.
        "ska": {"ska": {"num_heads": heads, "rank": 24, "head_dim": HEAD_DIM, "chunk_size": 64,
                        "accum_dtype": "float32"}},  # fmt: skip
        "gka": {"gka": {"num_heads": heads, "head_dim": HEAD_DIM, "conv_kernel": 4, "chunk_size": 64, "num_iter": 30}},
        "lattice": {"lattice": {"num_heads": heads, "head_dim": HEAD_DIM, "num_slots": HEAD_DIM, "conv_kernel": 4}},
        # Eidetic store of 64 tokens: room for every key and value of the largest ska.md §7.3 cell (32 pairs).
        "bmojo": {
            "bmojo": {
                "num_heads": heads,
                "num_kv_heads": heads,
                "head_dim": HEAD_DIM,
                "ssm_num_heads": 2 * heads,
                "ssm_head_dim": HEAD_DIM,
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
EVAL_PAIRS = [4, 8, 16, 32]
EVAL_GAPS = [64, 256, 1024, 4096]
MQAR_DEFAULTS = {"train_pairs": TRAIN_PAIRS, "train_gaps": TRAIN_GAPS, "eval_pairs": EVAL_PAIRS, "eval_gaps": EVAL_GAPS}
# Zoology's grid at the scale where recurrent layers separate: 64-256 pairs in 512-2,048 tokens (Arora et al. 2023
# ran 4-64 pairs in 64-512). Training also holds short sequences with few pairs, where the curriculum starts. With
# an untied LM head and training on 16-256 pairs in 512-2,048 tokens only, no family left chance in 430 s on an H200,
# attention included; on the CPU, at 4-8 pairs in 64-128 tokens over 8,192 ids, the untied head stayed at chance
# where the tied one learned (BENCHMARKS.md, "Zoology's MQAR"), so this task ties it (`main`).
ZOOLOGY_DEFAULTS = {
    "train_pairs": [4, 8, 16, 32, 64, 128, 256],
    "train_lengths": [128, 256, 512, 1024, 2048],
    "eval_pairs": [64, 128, 256],
    "eval_lengths": [512, 1024, 2048],
}


def family_config(
    family: str,
    overrides: dict[str, Any] | None = None,
    width: int = HIDDEN,
    vocab_size: int = BYTE_VOCAB,
    trained_on: str = TASKS["mqar"].about,
) -> ModelConfig:
    """The ModelConfig of a family name from FAMILIES at model width `width` (`recall_layers`), with dotted
    `overrides` (e.g. {"ska.rank": 32}) applied."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    layers = FAMILIES[family]
    data: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": width,
        "layers": layers,
        # Untied: with the LM head tied to the embedding, a 2-layer attention model at width 64 stays on the MQAR
        # plateau (measured), where the untied one learns the task. Over Zoology's 8,192 ids it is the other way
        # round, and `main` ties them for that task.
        "tie_word_embeddings": False,
        "mlp": {"intermediate_size": 3 * width},
        "notes": {"trained_on": trained_on, "family": family},
    }
    configs = recall_layers(width)
    for kind in set(layers):
        data.update(configs[kind])
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


Sampler = Callable[[float, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def mqar_sampler(pairs: list[int], gaps: list[int], batch: int, tokens_per_step: int) -> Sampler:
    """The batches of this grid's training: `sample(progress, gen)` -> input_ids and targets, `[rows, T]` each.

    `pairs` and `gaps` are sorted easiest first; the curriculum opens a growing prefix of each over the first half of
    training. A step draws one gap (weighted by `gap_weights`) and mixes every opened pair count in its batch
    (`mixed_batch`); it holds at most `batch` sequences and about `tokens_per_step` tokens.
    """

    def sample(progress: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        open_pairs, open_gaps = opened(pairs, progress), opened(gaps, progress)
        gap = open_gaps[int(torch.multinomial(gap_weights(open_gaps), 1, generator=gen))]
        rows = batch_for(4 * max(open_pairs) + gap, tokens_per_step, batch)
        return mixed_batch(open_pairs, gap, rows, gen)

    return sample


def zoology_sampler(pairs: list[int], lengths: list[int], batch: int, tokens_per_step: int, vocab: int) -> Sampler:
    """Batches of Zoology's MQAR (`make_zoology_mqar`): a step draws one length from `lengths`, then each row a
    number of pairs among the opened ones that fit it (4 M <= T); the curriculum opens `pairs` (sorted easiest
    first) as `opened` says. At most `batch` rows and about `tokens_per_step` tokens."""

    def sample(progress: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        open_pairs = opened(pairs, progress)
        fitting = [T for T in lengths if 4 * open_pairs[0] <= T]
        T = fitting[int(torch.randint(len(fitting), (), generator=gen))]
        fit = [M for M in open_pairs if 4 * M <= T]
        rows = batch_for(T, tokens_per_step, batch)
        counts = torch.bincount(torch.randint(len(fit), (rows,), generator=gen), minlength=len(fit)).tolist()
        parts = [make_zoology_mqar(M, T, n, gen, vocab) for M, n in zip(fit, counts, strict=True) if n]
        return torch.cat([p.input_ids for p in parts]), torch.cat([p.targets for p in parts])

    return sample


def opened(cells: list[int], progress: float) -> list[int]:
    """The curriculum: the prefix of an easiest-first list of cells open at `progress` in [0, 1], a quarter of them
    (at least one) at the start and all of them from halfway on."""
    return cells[: max(1, math.ceil(min(1.0, 0.25 + 1.5 * progress) * len(cells)))]


def train(
    model: HybridLM,
    steps: int,
    lr: float,
    time_limit: float,
    seed: int,
    sample: Sampler,
    vocab: int = VOCAB,
    log_every: int = 100,
) -> list[dict[str, float]]:
    """AdamW on fresh batches from `sample(progress, gen)`; stops at `steps` or `time_limit` seconds.

    Progress is whichever budget binds first (steps or seconds), so the learning-rate schedule and the sampler's
    curriculum complete even when the time limit ends training early. The loss is cross-entropy at the targets (not
    IGNORE) over the task's first `vocab` tokens.
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
        ids, targets = (t.to(device) for t in sample(progress, gen))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, lr, warmup)
        with autocast:
            logits = model(ids)
        logits = logits[..., :vocab].float()
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
def score_batch(model: HybridLM, data: MQARBatch, vocab: int) -> tuple[int, int]:
    """(correct, scored) answers over one batch of MQAR sequences, through the serving path: StatePool, prefill of
    the prompt (data.prefix_len tokens), then teacher-forced decode of the rest, scoring the argmax over the task's
    `vocab` tokens at every target."""
    pool = StatePool(model, capacity=data.input_ids.shape[0], max_context=data.input_ids.shape[1] + 1)
    ids, targets = data.input_ids.to(model.device), data.targets.to(model.device)
    B = ids.shape[0]
    slots = torch.tensor([pool.alloc() for _ in range(B)], device=model.device)
    prefix = data.prefix_len
    model.prefill(ids[:, :prefix].flatten(), pool.tensors, StepBatch.prefill(slots, [prefix] * B))
    has_target = data.targets != IGNORE
    scored = has_target.any(dim=0).tolist()  # positions where some row has a target (host-side)
    last = max(pos for pos, s in enumerate(scored) if s)  # the tokens after the last target need no decoding
    correct = torch.zeros((), dtype=torch.long, device=model.device)
    decode_batch = StepBatch.decode(slots)
    for pos in range(prefix, last + 1):
        logits = model.decode(ids[:, pos], pool.tensors, decode_batch)
        if scored[pos]:
            correct += (logits[:, :vocab].argmax(-1) == targets[:, pos]).sum()
    return int(correct), int(has_target.sum())


@torch.inference_mode()
def score_batch_forward(model: HybridLM, data: MQARBatch, vocab: int, rows: int = 16) -> tuple[int, int]:
    """(correct, scored) as `score_batch`, from the training forward (`HybridLM.forward`, teacher-forced, every
    position in one pass) instead of prefill + decode: the same function, computed in parallel. `rows` sequences at
    a time bound the logits' memory (rows x T x vocab)."""
    correct = scored = 0
    for a in range(0, data.input_ids.shape[0], rows):
        ids, targets = data.input_ids[a : a + rows].to(model.device), data.targets[a : a + rows].to(model.device)
        mask = targets != IGNORE
        pred = model(ids)[..., :vocab].argmax(-1)
        correct += int((pred[mask] == targets[mask]).sum())
        scored += int(mask.sum())
    return correct, scored


def evaluate_batch(model: HybridLM, num_pairs: int, x: int, batch: int, index: int, task: Task = TASKS["mqar"],
                   forward: bool = False) -> tuple[int, int]:  # fmt: skip
    """(correct, scored) answers over held-out batch `index` of the task's cell (num_pairs, x): through the serving
    path (`score_batch`), or with `forward` through the training forward (`score_batch_forward`)."""
    score = score_batch_forward if forward else score_batch
    return score(model, task.held_out(num_pairs, x, batch, index), task.vocab)


def evaluate_cell(model: HybridLM, num_pairs: int, x: int, sequences: int, batch: int, task: Task = TASKS["mqar"]
                  ) -> float:  # fmt: skip
    """Held-out accuracy of one cell over ceil(sequences / batch) batches of `batch` sequences."""
    scores = [evaluate_batch(model, num_pairs, x, batch, i, task) for i in range(math.ceil(sequences / batch))]
    return sum(c for c, _ in scores) / sum(t for _, t in scores)


def evaluate(
    model: HybridLM,
    pairs: list[int],
    xs: list[int],
    sequences: int,
    batch: int,
    time_limit: float = math.inf,
    task: Task = TASKS["mqar"],
    forward: bool = False,
) -> tuple[dict[str, float], dict[str, int]]:
    """Accuracy per cell that fits the task, keyed as `task.key` ("M=<pairs>,gap=<gap>"), and the number of
    held-out sequences behind each.

    Cells are visited round-robin, one batch each per round, so that when `time_limit` (seconds) runs out every
    cell has the same number of sequences (give or take one batch). The first round always completes. `forward`:
    score through the training forward rather than the serving path (`evaluate_batch`).
    """
    cells = [(M, x) for x in xs for M in pairs if task.fits(M, x)]
    scores = {cell: [0, 0, 0] for cell in cells}  # correct, scored, sequences
    start = time.perf_counter()
    for index in range(math.ceil(sequences / batch)):
        for M, x in cells:
            if index > 0 and time.perf_counter() - start > time_limit:
                break
            correct, total = evaluate_batch(model, M, x, batch, index, task, forward)
            score = scores[(M, x)]
            score[0], score[1], score[2] = score[0] + correct, score[1] + total, score[2] + batch
    grid = {task.key(M, x): c / t for (M, x), (c, t, _) in scores.items()}
    counts = {task.key(M, x): n for (M, x), (_, _, n) in scores.items()}
    return grid, counts


def format_table(grid: dict[str, float], pairs: list[int], xs: list[int], axis: str = "gap") -> str:
    """Markdown table: one row per gap (or length: `axis`), one column per number of pairs, accuracy in %; a cell
    not in `grid` (one that does not fit the task) is "-"."""
    lines = [f"| {axis} \\ pairs | " + " | ".join(str(M) for M in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    for x in xs:
        cells = [f"{100 * grid[key]:.1f}" if (key := cell_key(M, axis, x)) in grid else "-" for M in pairs]
        lines.append(f"| {x} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def grid_table(grid: dict[str, float]) -> str:
    """`format_table` of a report's grid, its pairs, gaps (or lengths) and axis read from the cells' names."""
    cells = [parse_cell(key) for key in grid]
    return format_table(grid, sorted({M for M, _, _ in cells}), sorted({x for _, _, x in cells}), cells[0][1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument(
        "--task",
        choices=sorted(TASKS),
        default="mqar",
        help="mqar: ska.md §7.3's grid of pairs by gap (V = 128); zoology: Zoology's MQAR, pairs by length (V = 8192)",
    )
    parser.add_argument("--width", type=int, default=HIDDEN, help=f"model width, a multiple of {HEAD_DIM}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=256, help="sequences per step at most")
    parser.add_argument("--tokens-per-step", type=int, default=65536, help="tokens per step at most (long gaps)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds of training at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-pairs", type=int, nargs="+", help="default: 4 ... 32 (zoology: 4 ... 256)")
    parser.add_argument("--train-gaps", type=int, nargs="+", help="mqar; default: 64 ... 4096")
    parser.add_argument("--train-lengths", type=int, nargs="+", help="zoology; default: 128 ... 2048")
    parser.add_argument("--eval-pairs", type=int, nargs="+", help="default: 4 8 16 32 (zoology: 64 128 256)")
    parser.add_argument("--eval-gaps", type=int, nargs="+", help="mqar; default: 64 256 1024 4096")
    parser.add_argument("--eval-lengths", type=int, nargs="+", help="zoology; default: 512 1024 2048")
    parser.add_argument(
        "--eval-path",
        choices=["serving", "forward"],
        help="serving: prefill + teacher-forced decode, as a server runs it (mqar's default); forward: the training "
        "forward, the same function in one parallel pass (zoology's default: its rows decode up to 1,536 tokens each)",
    )
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
    task = TASKS[args.task]
    zoology = task.name == "zoology"
    other = ("--train-gaps", "--eval-gaps") if zoology else ("--train-lengths", "--eval-lengths")
    given = [flag for flag in other if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given:
        parser.error(f"{' and '.join(given)} do not apply to --task {task.name}")
    defaults = ZOOLOGY_DEFAULTS if zoology else MQAR_DEFAULTS
    for name, default in defaults.items():
        # sorted: the curriculum opens them easiest first
        setattr(args, name, sorted(getattr(args, name) or default))
    train_xs, eval_xs = (args.train_lengths, args.eval_lengths) if zoology else (args.train_gaps, args.eval_gaps)
    overrides = parse_overrides(args.overrides)
    if zoology:
        # The LM head tied to the embedding: over 8,192 ids an untied head stayed at chance where the tied one learned
        # (BENCHMARKS.md, "Zoology's MQAR"); `--set tie_word_embeddings=false` unties it.
        overrides = {"tie_word_embeddings": True} | overrides

    torch.manual_seed(args.seed)
    config = family_config(args.family, overrides, args.width, max(BYTE_VOCAB, task.vocab), task.about)
    model = HybridLM(config)
    model.init_weights(args.seed, std=None)  # PyTorch's default init: see HybridLM.init_weights
    model.to(args.device)
    params = sum(p.numel() for p in model.parameters())
    print(f"family={args.family} width={args.width} task={task.name} params={params} device={args.device}", flush=True)
    if zoology:
        sample = zoology_sampler(args.train_pairs, train_xs, args.batch, args.tokens_per_step, task.vocab)
    else:
        sample = mqar_sampler(args.train_pairs, train_xs, args.batch, args.tokens_per_step)
    start = time.perf_counter()
    log = train(model, args.steps, args.lr, args.time_limit, args.seed, sample, task.vocab)
    train_seconds = time.perf_counter() - start
    # The checkpoint is stored in bf16 (a few MB for every family together); evaluate exactly those weights.
    model.to(torch.bfloat16).to(torch.float32)
    eval_start = time.perf_counter()
    eval_path = args.eval_path or ("forward" if zoology else "serving")
    grid, counts = evaluate(
        model, args.eval_pairs, eval_xs, args.eval_sequences, args.eval_batch, args.eval_time_limit, task,
        forward=eval_path == "forward",
    )  # fmt: skip
    eval_seconds = time.perf_counter() - eval_start
    print(format_table(grid, args.eval_pairs, eval_xs, task.axis), flush=True)

    model.to("cpu", torch.bfloat16)
    pool = StatePool(model, capacity=1, max_context=1)  # a session's state as served (bf16 weights)
    with tempfile.TemporaryDirectory() as tok:
        write_byte_tokenizer(tok)
        save_model(model, args.out, tokenizer_from=tok)
    axis = "lengths" if zoology else "gaps"
    report = {
        "task": task.name,
        "family": args.family,
        "width": args.width,
        "overrides": overrides,
        "layers": config.layers,
        "params": params,
        "state_bytes": pool.bytes_per_session(0),  # recurrent state; attention's KV cache adds the next per token
        "state_bytes_per_token": pool.bytes_per_token(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "steps": log[-1]["step"] if log else 0,
        "batch": args.batch,
        "tokens_per_step": args.tokens_per_step,
        "lr": args.lr,
        "seed": args.seed,
        "train_seconds": train_seconds,
        "train_pairs": args.train_pairs,
        f"train_{axis}": train_xs,
        "eval_path": eval_path,
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
