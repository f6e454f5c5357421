"""`python -m kvfree.training.demo`: distil the `kvfree-demo` student from a teacher, resumable across device calls.

    python -m kvfree.training.demo --teacher smol/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/demo \\
        [--family echo|mamba2] [--n-train 32000] [--steps 6000 | --time-budget 540] [--time-limit 600]

`training/demo_all.sh` runs it for the Echo student and its Mamba-2 twin side by side on one GPU (how the shipped
`checkpoints/default/` was made: BENCHMARKS.md, "kvfree-demo"). Run the same command again to continue: each stage
writes its result under `--out` and is skipped when it is there, and training resumes from its last saved state.

1. **Data** (`OUT/data/{train,eval}.jsonl`): `demo_data.examples` labelled by `demo_teacher.labelled` (the teacher's
   chat replies and text continuations, sampled; the known right tool-use and recall replies).
2. **Tokenizer** (`OUT/tokenizer/`): the teacher's own `tokenizer.json` (written by `tokenizers`, so the student and
   the teacher share token ids and the KL term compares the same vocabulary) with kvfree's ChatML template, which
   lists tools in the system turn and writes calls as `<tool_call>{json}</tool_call>` (plain text tags: the server
   parses text, `server/tools.py`).
3. **Student** (`student_config`): an Echo hybrid (Mamba-2 blocks, SKA at every fourth layer, docs/design/ska.md's
   layout; every state bounded) or its Mamba-2-only twin, the embedding tied to the LM head. Primed from the
   teacher: its token embedding projected onto its top `hidden` principal directions (the student is narrower).
4. **Distillation**: each example rendered with the template; the loss on the reply tokens (the assistant turn and
   its end token) is cross-entropy plus KL(teacher || student) of the teacher's next-token distribution at the same
   positions, with weight `--kl-weight`. AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast
   on a GPU.
5. **State** (`OUT/state/`): model, optimizer, step and data position, in safetensors shards under 15 MB (a
   device call returns files under 16 MB), saved every `--save-every` steps and when the time limit is near.
6. **Result**: the native checkpoint `OUT/checkpoint/` and `OUT/report.json` (config, size, loss curve, held-out
   loss of the student and of the teacher on the eval split).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvfree.checkpoints.byte_tokenizer import CHAT_TEMPLATE
from kvfree.engine.config import ModelConfig
from kvfree.engine.loader import save_model
from kvfree.engine.model import HybridLM
from kvfree.engine.tokenizer import Tokenizer

IGNORE = -100
SHARD_BYTES = 15 * 2**20
FAMILIES = ("echo", "mamba2")


# -- the student -----------------------------------------------------------------------------------------------------
def student_config(
    vocab_size: int, eos_id: int, family: str = "echo", hidden: int = 320, layers: int = 8
) -> ModelConfig:
    """The student: `layers` blocks of width `hidden` with SwiGLU MLPs (2.8x), Mamba-2 mixers (heads of 64, state 64)
    and, for "echo", SKA at every fourth layer (rank 48, heads of 64); embedding tied to the LM head.

    At the defaults and a 49,152-token vocabulary: 27.3M parameters (the Mamba-2 twin 27.9M), 54.6 / 55.8 MB in bf16
    (the wheel's budget is 60 MB).
    """
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    kinds = ["ska" if family == "echo" and i % 4 == 3 else "mamba2" for i in range(layers)]
    heads = 2 * hidden // 64  # Mamba-2 expands the width 2x
    data: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "layers": kinds,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "mamba2": {"num_heads": heads, "head_dim": 64, "state_size": 64, "n_groups": 1, "conv_kernel": 4},
        "mlp": {"intermediate_size": 64 * round(2.8 * hidden / 64)},
    }
    if "ska" in kinds:
        # fp32 accumulators: training sequences are short (BENCHMARKS.md measures fp32 against fp64 at 131K tokens).
        data["ska"] = {"num_heads": hidden // 64, "rank": 48, "head_dim": 64, "chunk_size": 64,
                       "accum_dtype": "float32"}  # fmt: skip
    return ModelConfig.from_dict(data)


def prime_embedding(student: HybridLM, teacher_embedding: torch.Tensor) -> None:
    """Set the student's token embedding `[V, d]` to the teacher's `[V, D]` (D >= d) projected onto its top d
    principal directions, rescaled to the student's current per-row RMS: rows keep their geometry (the nearest
    neighbours of a token stay near), and the scale stays what the student's init expects."""
    emb = student.embed.weight
    V, d = emb.shape
    E = teacher_embedding.detach().to(torch.float32)
    if E.shape[0] != V or E.shape[1] < d:
        raise ValueError(f"teacher embedding {tuple(E.shape)} cannot prime a student embedding {(V, d)}")
    centred = E - E.mean(0, keepdim=True)
    _, _, Vh = torch.linalg.svd(centred, full_matrices=False)
    projected = centred @ Vh[:d].T
    with torch.no_grad():
        target_rms = emb.float().pow(2).mean().sqrt()
        emb.copy_((projected * (target_rms / projected.pow(2).mean().sqrt())).to(emb.dtype))


# -- data ------------------------------------------------------------------------------------------------------------
def encode_example(tok: Tokenizer, row: dict[str, Any], max_len: int) -> tuple[list[int], list[int]] | None:
    """A labelled example -> (token ids, labels). Chat, tools, recall: the prompt (messages and tools, with the
    generation prompt) then the reply and the end of turn, labels IGNORE on the prompt. Text: the opener and its
    continuation as one plain text, every token labelled. None when it does not fit in `max_len`."""
    if row["skill"] == "text":
        ids = tok.encode(row["messages"][0]["content"] + row["reply"])
        return (ids, list(ids)) if len(ids) <= max_len else None
    prompt = tok.apply_chat_template(row["messages"], tools=row.get("tools") or None, add_generation_prompt=True)
    ids = tok.encode(prompt)
    reply = tok.encode(row["reply"] + "<|im_end|>")
    if len(ids) + len(reply) > max_len:
        return None
    return ids + reply, [IGNORE] * len(ids) + reply


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_worker_tokenizer: Tokenizer | None = None


def _start_worker(tok_dir: Path) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(tok_dir)


def _encode_in_worker(row: dict[str, Any], max_len: int) -> tuple[list[int], list[int]] | None:
    assert _worker_tokenizer is not None
    return encode_example(_worker_tokenizer, row, max_len)


def encode_file(tok_dir: Path, path: Path, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Every example of a JSON-lines file that fits in `max_len`, encoded (`encode_example`) on all CPU cores:
    rendering the chat template is most of the cost, and tens of thousands of examples take minutes on one core.
    Forked workers only tokenize (they never touch the GPU the parent may hold)."""
    rows = read_rows(path)
    workers = min(16, os.cpu_count() or 1)
    if workers == 1 or len(rows) < 1000:
        _start_worker(tok_dir)
        return [e for r in rows if (e := _encode_in_worker(r, max_len))]
    with multiprocessing.get_context("fork").Pool(workers, _start_worker, (tok_dir,)) as pool:
        return [e for e in pool.starmap(_encode_in_worker, [(r, max_len) for r in rows], chunksize=256) if e]


def pad_batch(rows: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoded examples -> (ids `[B, T]` right-padded with pad_id, labels `[B, T]` padded with IGNORE)."""
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for b, (x, y) in enumerate(rows):
        ids[b, : len(x)] = torch.tensor(x)
        labels[b, : len(y)] = torch.tensor(y)
    return ids, labels


def batches(encoded: list[tuple[list[int], list[int]]], batch_tokens: int, start: int, seed: int, pad_id: int,
            window: int = 512):  # fmt: skip
    """Endless (position, ids `[B, T]`, labels `[B, T]`) from a seeded shuffle, resuming at example `start`.

    Examples are taken `window` at a time in the shuffled order, sorted by length inside the window (so a batch
    holds examples of similar length and little padding), cut into batches of at most `batch_tokens` padded
    tokens, and those batches shuffled. `position` counts the examples consumed when the window is done, so a
    resume repeats at most one window.
    """
    order = list(range(len(encoded)))
    pos = start - start % window
    while True:
        epoch, at = divmod(pos, len(order))
        rng = random.Random(seed + epoch)
        rng.shuffle(order)
        chosen = sorted((order[(at + i) % len(order)] for i in range(window)), key=lambda j: len(encoded[j][0]))
        cut: list[list[int]] = [[]]
        for j in chosen:  # longest so far is this one: the list is sorted by length
            if cut[-1] and (len(cut[-1]) + 1) * len(encoded[j][0]) > batch_tokens:
                cut.append([])
            cut[-1].append(j)
        rng.shuffle(cut)
        pos += window
        for rows in cut:
            yield pos, *pad_batch([encoded[j] for j in rows], pad_id)


# -- the loss --------------------------------------------------------------------------------------------------------
def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, labels: torch.Tensor,
                 kl_weight: float) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """Next-token loss on the labelled positions: CE(labels) + kl_weight * KL(teacher || student), both in fp32.

    student_logits `[B, T, V]` (position t predicts token t+1); labels `[B, T]` (IGNORE unscored); teacher_logits
    `[N, V]`: the teacher's at the N scored positions, in order (`teacher_scored_logits`).
    """
    logits = student_logits[:, :-1]
    target = labels[:, 1:]
    scored = target != IGNORE
    s_logits = logits[scored].float()
    ce = F.cross_entropy(s_logits, target[scored])
    parts = {"ce": ce.item()}
    loss = ce
    if teacher_logits is not None and kl_weight > 0:
        t_logp = F.log_softmax(teacher_logits.float(), -1)
        kl = F.kl_div(F.log_softmax(s_logits, -1), t_logp, log_target=True, reduction="batchmean")
        parts["kl"] = kl.item()
        loss = loss + kl_weight * kl
    return loss, parts


@torch.no_grad()
def teacher_scored_logits(teacher: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's next-token logits `[N, V]` at the positions `distill_loss` scores (labels[:, 1:]
    not IGNORE): the LM head runs on those rows only, not on every padded position."""
    hidden = teacher.base_model(input_ids=ids).last_hidden_state[:, :-1]
    return teacher.get_output_embeddings()(hidden[labels[:, 1:] != IGNORE])


# -- resumable state -------------------------------------------------------------------------------------------------
def save_state(path: Path, model: HybridLM, opt: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    """Model and optimizer tensors in safetensors shards of at most SHARD_BYTES, plus meta.json (written last, so a
    state without it is incomplete and ignored)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "meta.json").unlink(missing_ok=True)
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    for i, state in opt.state_dict()["state"].items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{i}.{k}"] = v.detach().contiguous().cpu().reshape(v.shape)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    for old in path.glob("shard-*.safetensors"):
        old.unlink()
    for j, shard in enumerate(shards):
        save_file(shard, str(path / f"shard-{j:03d}.safetensors"))
    (path / "meta.json").write_text(json.dumps(meta | {"shards": len(shards)}, indent=1))


def load_state(path: Path, model: HybridLM, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Restore what `save_state` wrote (None when there is no complete state)."""
    if not (path / "meta.json").is_file():
        return None
    meta = json.loads((path / "meta.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for j in range(meta["shards"]):
        tensors.update(load_file(str(path / f"shard-{j:03d}.safetensors")))
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    opt_state = opt.state_dict()
    for key, v in tensors.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            opt_state["state"].setdefault(int(i), {})[name] = v
    opt.load_state_dict(opt_state)
    return meta


# -- the run ---------------------------------------------------------------------------------------------------------
def write_tokenizer(teacher_tokenizer: Any, out: Path) -> Path:
    """The teacher's tokenizer.json with kvfree's ChatML template and tool-call tags, in directory `out`."""
    out.mkdir(parents=True, exist_ok=True)
    teacher_tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    has_im_end = "<|im_end|>" in teacher_tokenizer.get_vocab()
    eos = "<|im_end|>" if has_im_end else teacher_tokenizer.eos_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos, "eos_token": eos, "pad_token": eos,
              "chat_template": CHAT_TEMPLATE, "tool_call_start": "<tool_call>", "tool_call_end": "</tool_call>",
              "model_max_length": 1 << 20}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


@torch.no_grad()
def held_out_loss(model: Any, encoded: list[tuple[list[int], list[int]]], pad_id: int, device: str,
                  teacher: bool = False) -> float:  # fmt: skip
    """Mean next-token cross-entropy on the reply tokens of `encoded` (the student, or with teacher=True an HF
    causal LM)."""
    total, count = 0.0, 0
    for start in range(0, len(encoded), 8):
        ids, labels = pad_batch(encoded[start : start + 8], pad_id)
        ids = ids.to(device)
        logits = model(ids).logits if teacher else model(ids)
        target = labels[:, 1:].to(device)
        scored = target != IGNORE
        total += F.cross_entropy(logits[:, :-1][scored].float(), target[scored], reduction="sum").item()
        count += int(scored.sum())
    return total / max(count, 1)


def build_data(teacher: Any, a: argparse.Namespace, data: Path) -> None:
    """`data/{train,eval}.jsonl`: the prompts labelled with the teacher's (or the known) replies; kept if there."""
    from kvfree.training.demo_data import examples
    from kvfree.training.demo_teacher import labelled

    for split, n in (("train", a.n_train), ("eval", a.n_eval)):
        path = data / f"{split}.jsonl"
        if not path.is_file():
            data.mkdir(parents=True, exist_ok=True)
            rows = labelled(teacher, examples(split, a.seed, n), a.teacher_batch, a.max_new_tokens, a.temperature)
            part = path.with_suffix(".part")  # renamed when whole: a run stopped midway leaves no half file
            part.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            part.rename(path)


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvfree.training.demo_teacher import Teacher

    started = time.time()
    out = Path(a.out)
    on_gpu = a.device.startswith("cuda")
    if on_gpu and a.memory_fraction < 1:  # two students share one GPU: each one's cache stays within its share
        torch.cuda.set_per_process_memory_fraction(a.memory_fraction)
    teacher = Teacher.load(a.teacher, a.device, torch.bfloat16 if on_gpu else torch.float32)
    data = Path(a.data) if a.data else out / "data"
    build_data(teacher, a, data)
    tok_dir = write_tokenizer(teacher.tokenizer, out / "tokenizer")
    if a.data_only:
        return {"data": str(data), "seconds": round(time.time() - started, 1)}
    tok = Tokenizer(tok_dir)
    eos_id = tok.token_to_id(tok.eos_token)
    encoded = encode_file(tok_dir, data / "train.jsonl", a.max_len)
    held = encode_file(tok_dir, data / "eval.jsonl", a.max_len)
    print(json.dumps({"train_examples": len(encoded), "seconds": round(time.time() - started, 1)}), flush=True)

    teacher_vocab = teacher.model.get_input_embeddings().weight.shape[0]
    if teacher_vocab != tok.vocab_size:  # the KL term and the priming compare the two vocabularies row by row
        raise ValueError(f"the teacher's embedding has {teacher_vocab} rows, its tokenizer {tok.vocab_size} tokens")
    torch.manual_seed(a.seed)
    config = student_config(tok.vocab_size, eos_id, a.family, a.hidden, a.layers)
    model = HybridLM(config)
    model.init_weights(a.seed)
    prime_embedding(model, teacher.model.get_input_embeddings().weight)
    model.to(a.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    meta = load_state(out / "state", model, opt) or {"step": 0, "position": 0, "log": [], "steps": a.steps,
                                                     "requested_steps": a.steps, "tokens": 0, "train_seconds": 0.0}
    step, log, steps = meta["step"], meta["log"], meta["steps"]
    if meta["requested_steps"] != a.steps:  # resumed with a new --steps: it replaces the schedule's length
        steps = a.steps
    stream = batches(encoded, a.batch_tokens, meta["position"], a.seed, eos_id)
    position, tokens, train_seconds = meta["position"], meta["tokens"], meta["train_seconds"]
    timed_from, timed_step, rate_from = time.time(), step, 0.0

    def progress(seconds: float) -> dict[str, Any]:
        return {"step": step, "position": position, "log": log, "steps": steps, "requested_steps": a.steps,
                "tokens": tokens, "train_seconds": seconds}  # fmt: skip

    while step < steps and time.time() - started < a.time_limit:
        position, ids, labels = next(stream)
        ids, labels = ids.to(a.device), labels.to(a.device)
        t_logits = teacher_scored_logits(teacher.model, ids, labels) if a.kl_weight > 0 else None
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, a.lr, a.warmup)
        with torch.autocast("cuda", torch.bfloat16, enabled=on_gpu):
            logits = model(ids)
        loss, parts = distill_loss(logits, t_logits, labels, a.kl_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += ids.numel()
        if a.time_budget and timed_step == 0 and step in (20, 70):
            # The schedule's length from the rate measured over steps 20-70 (past compilation and warm-up): the run
            # ends inside the budget; the report keeps the steps it chose.
            if step == 20:
                rate_from = time.time()
            else:
                rate = 50 / (time.time() - rate_from)
                steps = min(steps, max(step + 1, int(step + rate * (a.time_budget - (time.time() - started)))))
                print(json.dumps({"steps_per_second": round(rate, 2), "steps": steps}), flush=True)
        if step % a.log_every == 0 or step == 1:
            log.append({"step": step, "loss": loss.item(), **parts, "lr": lr_at(step - 1, steps, a.lr, a.warmup),
                        "tokens": tokens, "seconds": round(time.time() - started, 1)})  # fmt: skip
            print(json.dumps(log[-1]), flush=True)
        if step % a.save_every == 0 or step == steps:
            save_state(out / "state", model, opt, progress(train_seconds + time.time() - timed_from))
    train_seconds += time.time() - timed_from
    save_state(out / "state", model, opt, progress(train_seconds))

    model.eval()
    params = sum(p.numel() for p in model.parameters())
    with torch.autocast("cuda", torch.bfloat16, enabled=on_gpu):
        losses = {"student": held_out_loss(model, held, eos_id, a.device),
                  "teacher": held_out_loss(teacher.model, held, eos_id, a.device, teacher=True)}  # fmt: skip
    report: dict[str, Any] = {
        "family": a.family, "step": step, "steps": steps, "done": step >= steps, "params": params,
        "bf16_bytes": 2 * params, "config": config.to_dict(), "train_examples": len(encoded),
        "tokens": tokens, "train_seconds": round(train_seconds, 1), "device": torch.cuda.get_device_name()
        if on_gpu else "cpu", "args": vars(a), "log": log, "held_out_examples": len(held), "held_out_loss": losses,
    }  # fmt: skip
    if report["done"]:
        save_model(model.to(torch.bfloat16), out / "checkpoint", tokenizer_from=tok_dir)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True, help="a Hugging Face model folder or a .gguf file")
    ap.add_argument("--out", required=True, help="run folder: data, tokenizer, state, checkpoint, report.json")
    ap.add_argument("--data", default=None, help="the labelled data's folder (default OUT/data); share it between runs")
    ap.add_argument("--data-only", action="store_true", help="build the data and the tokenizer, then stop")
    ap.add_argument("--family", choices=FAMILIES, default="echo")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n-train", type=int, default=32000)
    ap.add_argument("--n-eval", type=int, default=200)
    ap.add_argument("--teacher-batch", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the teacher's replies")
    ap.add_argument("--max-len", type=int, default=3072, help="examples longer than this many tokens are skipped")
    ap.add_argument("--batch-tokens", type=int, default=16384, help="padded tokens per batch at most")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds; if set, the schedule's length is cut at step 70 to end within it")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--time-limit", type=float, default=480.0, help="seconds; the state is saved before it runs out")
    ap.add_argument("--memory-fraction", type=float, default=1.0, help="of the GPU's memory this process may use")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    report = run(ap.parse_args(argv))
    print(json.dumps({k: report.get(k) for k in ("family", "step", "done", "params", "held_out_loss", "data")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
