"""`python -m kvfree.training.demo`: distil `kvfree-demo` and its Mamba-2 twin from a teacher, resumable across calls.

    python -m kvfree.training.demo --teacher smol/SmolLM2-135M-Instruct.Q4_1.gguf --out runs/demo \\
        [--families echo mamba2] [--n-train 24000] [--steps 12000 | --time-budget 1500] [--time-limit 600]

How the shipped `checkpoints/default/` was made (BENCHMARKS.md, "kvfree-demo"). Run the same command again to
continue: each stage writes its result under `--out` and is skipped when it is there, and training resumes from its
last saved state. A run needs the teacher, this code and nothing else (no earlier checkpoint).

1. **Data** (`OUT/data/{train,eval}.jsonl`): the teacher's replies to `demo_data`'s chat requests and its
   continuations of text openers, sampled (`demo_teacher.labelled`): the pool the chat and text rows are drawn from.
   Tool use and recall are not stored: every batch makes up new ones (`demo_data`: functions, arguments and facts
   never repeat, so the students learn to read and copy, not to remember). The eval split holds every skill.
2. **Tokenizer** (`OUT/tokenizer/`): the teacher's own `tokenizer.json` (so the students and the teacher share token
   ids and the KL term compares the same vocabulary) with kvfree's ChatML template, which lists tools in the system
   turn and writes calls as `<tool_call>{json}</tool_call>` (plain text tags: the server parses text).
3. **Students** (`student_config`), trained side by side on the same batches: an Echo hybrid (Mamba-2 blocks, SKA
   at every fourth layer; every state bounded) and its Mamba-2-only twin, the embedding tied to the LM head, primed
   from the teacher's (projected on its top `hidden` principal directions).
4. **Batches** (`BatchMaker`, batch `step` made from the seed and `step` alone, in worker processes): a quarter are
   long recall conversations, their length cap growing over the first half of the run from 512 tokens to
   `--max-len` (the curriculum); the rest mix chat and text from the pool with made-up tool calls (a third with the
   tool's result and the final answer) and short recall.
5. **Loss**, on the reply tokens only (every labelled assistant turn; all of a text row): cross-entropy on the known
   replies, plus on the teacher's replies cross-entropy and `--kl-weight` x KL(teacher || student) of the teacher's
   next-token distribution (the teacher runs on those rows only: it has never seen the tool format, and its
   distribution there would pull away from the right call). The LM head runs on the scored positions only.
   AdamW, linear warm-up then cosine decay, gradient clipping, bf16 autocast on a GPU.
6. **State** (`OUT/FAMILY/state/`): model, optimizer, step, in safetensors shards under 15 MB, saved every
   `--save-every` steps and when the time limit is near.
7. **Result**: per family the native checkpoint `OUT/FAMILY/checkpoint/` and `OUT/FAMILY/report.json` (config,
   size, loss curve, tokens by skill, held-out loss of the student and of the teacher on the eval split).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kvfree.checkpoints.byte_tokenizer import CHAT_TEMPLATE
from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.model.loader import load_model, save_model
from kvfree.engine.text.tokenizer import Tokenizer

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
Encoded = tuple[list[int], list[int]]


def encode_example(tok: Tokenizer, row: dict[str, Any], max_len: int) -> Encoded | None:
    """An example -> (token ids, labels), None when longer than `max_len`.

    Text: the opener and its continuation as one plain text, every token labelled. Otherwise the conversation with
    its tools through the chat template, labelled on each target assistant turn (`"target": True`: a call before its
    result, an earlier recall answer) and on the reply (`row["reply"]`) with its end token. Each labelled turn is
    tokenized apart from the prompt before it, as the server tokenizes a prompt that ends with the generation prompt.
    """
    if row["skill"] == "text":
        ids = tok.encode(row["messages"][0]["content"] + row["reply"])
        return (ids, list(ids)) if len(ids) <= max_len else None
    messages, tools = row["messages"], row.get("tools") or None
    ids: list[int] = []
    labels: list[int] = []

    def add(text: str, scored: bool) -> None:
        piece = tok.encode(text)
        ids.extend(piece)
        labels.extend(piece if scored else [IGNORE] * len(piece))

    done = 0  # characters of the rendered conversation encoded so far
    targets = [i for i, m in enumerate(messages) if m.get("target")]
    for i in [*targets, len(messages)]:
        prompt = tok.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True)
        add(prompt[done:], False)
        if i == len(messages):
            add(row["reply"] + "<|im_end|>", True)
            break
        turn = tok.apply_chat_template(messages[: i + 1], tools=tools, add_generation_prompt=False)
        body = turn[len(prompt) :].removesuffix("\n")  # the turn and its end token; the newline after is the prompt's
        add(body, True)
        done = len(prompt) + len(body)
    return (ids, labels) if len(ids) <= max_len else None


def read_rows(path: Path) -> list[dict[str, Any]]:
    """A JSON-lines file's rows (split at "\n" only: a reply may hold U+2028 and other characters `splitlines`
    breaks at)."""
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


_worker_tokenizer: Tokenizer | None = None


def _start_worker(tok_dir: Path) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(tok_dir)


def _encode_in_worker(row: dict[str, Any], max_len: int) -> Encoded | None:
    assert _worker_tokenizer is not None
    return encode_example(_worker_tokenizer, row, max_len)


def encode_file(tok_dir: Path, path: Path, max_len: int) -> list[Encoded]:
    """Every example of a JSON-lines file that fits in `max_len`, encoded (`encode_example`) on all CPU cores:
    rendering the chat template is most of the cost. Forked workers only tokenize (they never touch the GPU)."""
    rows = read_rows(path)
    workers = min(16, os.cpu_count() or 1)
    if workers == 1 or len(rows) < 1000:
        _start_worker(tok_dir)
        return [e for r in rows if (e := _encode_in_worker(r, max_len))]
    with multiprocessing.get_context("fork").Pool(workers, _start_worker, (tok_dir,)) as pool:
        return [e for e in pool.starmap(_encode_in_worker, [(r, max_len) for r in rows], chunksize=256) if e]


def pad_batch(rows: list[Encoded], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoded examples -> (ids `[B, T]` right-padded with pad_id, labels `[B, T]` padded with IGNORE)."""
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for b, (x, y) in enumerate(rows):
        ids[b, : len(x)] = torch.tensor(x)
        labels[b, : len(y)] = torch.tensor(y)
    return ids, labels


MIX = {"chat": 0.2, "text": 0.15, "tools": 0.4, "recall": 0.25}  # mixed batches: the chance of each skill per row


class BatchMaker(torch.utils.data.Dataset):
    """Batch `(step, steps)` of a run, made from `Random(seed, step)` alone (a resumed run continues exactly; worker
    processes make batches ahead of the GPU).

    A batch is `{"ids", "labels"}` `[B, T]`, `"from_teacher"` `[B]` (rows whose reply the teacher wrote, for the KL
    term) and `"tokens"` (scored tokens by skill). A quarter of the batches hold long recall conversations with up
    to four questions, their filler aimed at one length (log-uniform up to the curriculum's cap, which grows from
    512 tokens to `max_len` over the first half of the `steps`; a conversation may run past it, never past
    `max_len`); the rest draw rows by `MIX`: chat and text from the teacher's `pool`, tools and short recall made
    up. Either way rows of about one length are kept while the batch holds at most `batch_tokens` padded tokens.
    Values in made-up rows are new strings and real words of the tokenizer's vocabulary (`vocabulary_words`).
    """

    def __init__(self, tok_dir: Path, pool: list[dict[str, Any]], seed: int, batch_tokens: int, max_len: int,
                 pad_id: int, long_share: float = 0.25) -> None:  # fmt: skip
        self.tok_dir, self.pool, self.seed = tok_dir, pool, seed
        self.batch_tokens, self.max_len, self.pad_id, self.long_share = batch_tokens, max_len, pad_id, long_share
        if max_len > batch_tokens:
            raise ValueError(f"max_len {max_len} is more than batch_tokens {batch_tokens}: a row would not fit")
        self.by_skill = {s: [i for i, r in enumerate(pool) if r["skill"] == s] for s in ("chat", "text")}
        self.mix = {s: w for s, w in MIX.items() if s not in self.by_skill or self.by_skill[s]}  # a pool may lack one
        self._tok: Tokenizer | None = None
        self._words: list[str] = []
        self._encoded: dict[int, Encoded | None] = {}
        self._filler_tokens = 0.0

    def __len__(self) -> int:
        return 1 << 40

    @property
    def tok(self) -> Tokenizer:
        if self._tok is None:  # made in each worker process, not pickled across
            self._tok = Tokenizer(self.tok_dir)
            from kvfree.training.demo_data import FILLER

            turns = [[{"role": "user", "content": a}, {"role": "assistant", "content": b}] for a, b in FILLER]
            rendered = [self._tok.apply_chat_template(t, add_generation_prompt=False) for t in turns]
            self._filler_tokens = sum(len(self._tok.encode(r)) for r in rendered) / len(rendered)
            self._words = vocabulary_words(self._tok)
        return self._tok

    def recall_cap(self, step: int, steps: int) -> int:
        """The curriculum: the longest recall conversation of batch `step` of `steps`."""
        return int(min(self.max_len, 512 + (self.max_len - 512) * min(1.0, 2 * step / max(1, steps))))

    def __getitem__(self, index: tuple[int, int]) -> dict[str, Any]:
        from kvfree.training.demo_data import ValueRandom, example, recall_example

        step, steps = index
        tok = self.tok  # and the word list
        rng = ValueRandom(f"kvfree-demo/batch/{self.seed}/{step}", self._words)
        if rng.random() < self.long_share:
            length = int(math.exp(rng.uniform(math.log(384), math.log(max(385, self.recall_cap(step, steps))))))
            candidates = []
            while sum(len(e[0]) for _, e, _ in candidates) < self.batch_tokens:
                questions = rng.choice([1, 2, 3, 4])  # later questions add up to as much filler again, half on average
                turns = max(1, int(length / self._filler_tokens / (1 + (questions - 1) / 2)))
                ex = recall_example(rng, "train", turns, questions)
                if (encoded := encode_example(tok, self._row(ex), self.max_len)) is not None:
                    candidates.append(("recall", encoded, False))
                elif turns == 1 and questions == 1:
                    raise ValueError(f"max_len {self.max_len} holds no recall conversation with one filler turn")
                else:
                    length = int(length * 0.8)
        else:
            candidates, misses = [], 0
            while sum(len(e[0]) for _, e, _ in candidates) < 2.5 * self.batch_tokens:
                if misses > 1000:
                    raise ValueError(f"max_len {self.max_len} holds almost no example: raise it")
                skill = rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
                if skill in self.by_skill:
                    encoded = self._pooled(rng.choice(self.by_skill[skill]))
                else:
                    encoded = encode_example(tok, self._row(example(rng, "train", skill, 16)), self.max_len)
                if encoded is None:
                    misses += 1
                else:
                    candidates.append((skill, encoded, skill in self.by_skill))
        # Rows of about one length (little padding): those nearest a randomly chosen one, while they fit.
        pivot = math.log(len(rng.choice(candidates)[1][0]))
        candidates.sort(key=lambda c: abs(math.log(len(c[1][0])) - pivot))
        rows: list[tuple[str, Encoded, bool]] = []
        longest = 0
        for c in candidates:
            if rows and (len(rows) + 1) * max(longest, len(c[1][0])) > self.batch_tokens:
                break
            rows.append(c)
            longest = max(longest, len(c[1][0]))
        ids, labels = pad_batch([e for _, e, _ in rows], self.pad_id)
        tokens: dict[str, int] = {}
        for skill, (_, y), _ in rows:
            tokens[skill] = tokens.get(skill, 0) + sum(t != IGNORE for t in y)
        return {"ids": ids, "labels": labels, "from_teacher": torch.tensor([t for *_, t in rows]), "tokens": tokens}

    @staticmethod
    def _row(ex: Any) -> dict[str, Any]:
        return {"skill": ex.skill, "messages": ex.messages, "tools": ex.tools, "reply": ex.answer}

    def _pooled(self, i: int) -> Encoded | None:
        if i not in self._encoded:
            self._encoded[i] = encode_example(self.tok, self.pool[i], self.max_len)
        return self._encoded[i]


def vocabulary_words(tok: Tokenizer) -> list[str]:
    """The words of a byte-level BPE vocabulary (each leading-space token of three or more ASCII letters: words and
    the starts of longer ones), less the evaluation's recall answers: real words for made-up values
    (`demo_data.ValueRandom`)."""
    from kvfree.training.demo_data import EVAL_VALUES

    words = []
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if text.startswith(" ") and len(text) >= 4 and text[1:].isalpha() and text[1:].isascii():
            words.append(text[1:])
    return sorted(w for w in set(words) if w.lower() not in EVAL_VALUES)


def batch_stream(maker: BatchMaker, start: int, workers: int, schedule: dict[str, int]):
    """Batches `start`, `start + 1`, ... made by `workers` processes (in this one when 0). Each is asked for as
    `(step, schedule["steps"])`, read when it is handed out: the run may fix its length after it has begun."""

    def indices():
        step = start
        while True:
            yield step, schedule["steps"]
            step += 1

    if workers == 0:
        yield from map(maker.__getitem__, indices())
        return
    loader = torch.utils.data.DataLoader(maker, batch_size=None, sampler=indices(), num_workers=workers,
                                         prefetch_factor=4, multiprocessing_context="fork")  # fmt: skip
    yield from loader


# -- the loss --------------------------------------------------------------------------------------------------------
def distill_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    from_teacher: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    kl_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss at N scored positions, in fp32: the mean cross-entropy of the known replies' positions, plus that of
    the teacher's replies' positions and kl_weight * KL(teacher || student) there (a term is left out when the
    batch has none of its positions).

    logits `[N, V]` (the student's), targets `[N]`, from_teacher `[N]` bool; teacher_logits `[M, V]` at the M
    positions where from_teacher is set, in order (`teacher_scored_logits`).
    """
    logits = logits.float()
    loss = logits.new_zeros(())
    parts: dict[str, float] = {}
    for name, rows in (("ce_known", ~from_teacher), ("ce_teacher", from_teacher)):
        if rows.any():
            ce = F.cross_entropy(logits[rows], targets[rows])
            parts[name] = ce.item()
            loss = loss + ce
    if teacher_logits is not None and kl_weight > 0 and from_teacher.any():
        t_logp = F.log_softmax(teacher_logits.float(), -1)
        kl = F.kl_div(F.log_softmax(logits[from_teacher], -1), t_logp, log_target=True, reduction="batchmean")
        parts["kl"] = kl.item()
        loss = loss + kl_weight * kl
    return loss, parts


def scored_logits(model: HybridLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The student's next-token logits `[N, V]` at the positions labels[:, 1:] scores, in row-major order."""
    h = model.hidden_states(ids)[:, :-1]
    return model.logits(h[labels[:, 1:] != IGNORE])


@torch.no_grad()
def teacher_scored_logits(teacher: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A Hugging Face causal LM's next-token logits `[N, V]` at the positions `scored_logits` takes: the LM head
    runs on those rows only, not on every padded position."""
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
    model.load_state_dict({k[len("model.") :]: v for k, v in tensors.items() if k.startswith("model.")})
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
def held_out_loss(model: Any, encoded: list[Encoded], pad_id: int, device: str, teacher: bool = False) -> float:
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
    """`data/train.jsonl` (the teacher's chat replies and text continuations) and `data/eval.jsonl` (every skill,
    held out); each kept if there."""
    from kvfree.training.demo_data import SKILLS, examples
    from kvfree.training.demo_teacher import labelled

    for split, n, skills in (("train", a.n_train, ("chat", "text")), ("eval", a.n_eval, SKILLS)):
        path = data / f"{split}.jsonl"
        if not path.is_file():
            data.mkdir(parents=True, exist_ok=True)
            cases = examples(split, a.seed, n, skills)
            rows = labelled(teacher, cases, a.teacher_batch, a.max_new_tokens, a.temperature)
            part = path.with_suffix(".part")  # renamed when whole: a run stopped midway leaves no half file
            part.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            part.rename(path)


def new_student(family: str, a: argparse.Namespace, vocab_size: int, eos_id: int,
                teacher_embedding: torch.Tensor) -> tuple[HybridLM, torch.optim.Optimizer]:  # fmt: skip
    """A student and its optimizer: initialised and primed from the teacher's embedding, or with `--init` the
    weights of an earlier run's checkpoint (a second stage), in fp32."""
    torch.manual_seed(a.seed)
    if a.init:
        model = load_model(a.init, device="cpu", dtype=torch.float32)
        if model.config.layers != student_config(vocab_size, eos_id, family, a.hidden, a.layers).layers:
            raise ValueError(f"--init {a.init}: its layers {model.config.layers} are not a {family} student's")
    else:
        model = HybridLM(student_config(vocab_size, eos_id, family, a.hidden, a.layers))
        model.init_weights(a.seed)
        prime_embedding(model, teacher_embedding)
    model.to(a.device).train()
    return model, torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Data, tokenizer, then the students trained side by side to `steps` (or the time limit); returns the last
    family's report."""
    from kvfree.training.demo_teacher import Teacher

    started = time.time()
    out = Path(a.out)
    on_gpu = a.device.startswith("cuda")
    teacher = Teacher.load(a.teacher, a.device, torch.bfloat16 if on_gpu else torch.float32)
    data = Path(a.data) if a.data else out / "data"
    build_data(teacher, a, data)
    tok_dir = write_tokenizer(teacher.tokenizer, out / "tokenizer")
    if a.data_only:
        return {"data": str(data), "seconds": round(time.time() - started, 1)}
    tok = Tokenizer(tok_dir)
    eos_id = tok.token_to_id(tok.eos_token)
    pool = read_rows(data / "train.jsonl")
    held = encode_file(tok_dir, data / "eval.jsonl", a.max_len)
    teacher_embedding = teacher.model.get_input_embeddings().weight
    if teacher_embedding.shape[0] != tok.vocab_size:  # the KL term and the priming compare vocabularies row by row
        raise ValueError(f"the teacher's embedding has {teacher_embedding.shape[0]} rows, its tokenizer "
                         f"{tok.vocab_size} tokens")  # fmt: skip

    students = {f: new_student(f, a, tok.vocab_size, eos_id, teacher_embedding) for f in a.families}
    fresh = {"step": 0, "log": [], "steps": a.steps, "requested_steps": a.steps, "tokens": 0, "scored_tokens": {},
             "train_seconds": 0.0}  # fmt: skip
    metas = {f: load_state(out / f / "state", m, o) or dict(fresh, log=[]) for f, (m, o) in students.items()}
    if len({m["step"] for m in metas.values()}) != 1:
        at = {f: m["step"] for f, m in metas.items()}
        raise ValueError(f"the students' saved states are at different steps: {at}")
    meta = next(iter(metas.values()))
    step, steps, tokens, scored_tokens = meta["step"], meta["steps"], meta["tokens"], meta["scored_tokens"]
    if meta["requested_steps"] != a.steps:  # resumed with a new --steps: it replaces the schedule's length
        steps = a.steps
    logs = {f: m["log"] for f, m in metas.items()}
    schedule = {"steps": steps}  # read by the index stream as it hands out batches (the curriculum's length)
    maker = BatchMaker(tok_dir, pool, a.seed, a.batch_tokens, a.max_len, eos_id)
    stream = batch_stream(maker, step, a.workers, schedule)
    timed_from, timed_step, rate_from, train_seconds = time.time(), step, 0.0, meta["train_seconds"]
    print(json.dumps({"pool": len(pool), "step": step, "seconds": round(time.time() - started, 1)}), flush=True)

    def save(seconds: float) -> None:
        for f, (model, opt) in students.items():
            save_state(out / f / "state", model, opt, {"step": step, "log": logs[f], "steps": steps,
                       "requested_steps": a.steps, "tokens": tokens, "scored_tokens": scored_tokens,
                       "train_seconds": seconds})  # fmt: skip

    while step < steps and time.time() - started < a.time_limit:
        batch = next(stream)
        ids, labels = batch["ids"].to(a.device), batch["labels"].to(a.device)
        scored = labels[:, 1:] != IGNORE
        targets = labels[:, 1:][scored]
        from_teacher = batch["from_teacher"].to(a.device)[:, None].expand_as(scored)[scored]
        t_logits = None
        if a.kl_weight > 0 and batch["from_teacher"].any():
            rows = batch["from_teacher"].nonzero().squeeze(1).to(a.device)
            t_logits = teacher_scored_logits(teacher.model, ids[rows], labels[rows])
        lr = lr_at(step, steps, a.lr, a.warmup)
        losses = {}
        for family, (model, opt) in students.items():
            for group in opt.param_groups:
                group["lr"] = lr
            with torch.autocast("cuda", torch.bfloat16, enabled=on_gpu):
                logits = scored_logits(model, ids, labels)
            loss, parts = distill_loss(logits, targets, from_teacher, t_logits, a.kl_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses[family] = {"loss": loss.item(), **parts}
        step += 1
        tokens += ids.numel()
        for skill, n in batch["tokens"].items():
            scored_tokens[skill] = scored_tokens.get(skill, 0) + n
        if a.time_budget and timed_step == 0 and step in (20, 70):
            # The schedule's length from the rate measured over steps 20-70 (past compilation and warm-up): the run
            # ends inside the budget; the report keeps the steps it chose.
            if step == 20:
                rate_from = time.time()
            else:
                rate = 50 / (time.time() - rate_from)
                steps = min(steps, max(step + 1, int(step + rate * (a.time_budget - (time.time() - started)))))
                schedule["steps"] = steps
                print(json.dumps({"steps_per_second": round(rate, 2), "steps": steps}), flush=True)
        if step % a.log_every == 0 or step == 1:
            for family, row in losses.items():
                logs[family].append({"step": step, **row, "lr": lr, "tokens": tokens,
                                     "seconds": round(time.time() - started, 1)})  # fmt: skip
            print(json.dumps({"step": step, "tokens": tokens, "seconds": round(time.time() - started, 1),
                              **{f: round(r["loss"], 4) for f, r in losses.items()}}), flush=True)  # fmt: skip
        if step % a.save_every == 0 or step == steps:
            save(train_seconds + time.time() - timed_from)
    train_seconds += time.time() - timed_from
    save(train_seconds)

    with torch.autocast("cuda", torch.bfloat16, enabled=on_gpu):
        teacher_loss = held_out_loss(teacher.model, held, eos_id, a.device, teacher=True)
    report: dict[str, Any] = {}
    for family, (model, _) in students.items():
        model.eval()
        params = sum(p.numel() for p in model.parameters())
        with torch.autocast("cuda", torch.bfloat16, enabled=on_gpu):
            student_loss = held_out_loss(model, held, eos_id, a.device)
        report = {
            "family": family, "step": step, "steps": steps, "done": step >= steps, "params": params,
            "bf16_bytes": 2 * params, "config": model.config.to_dict(), "pool_examples": len(pool), "tokens": tokens,
            "scored_tokens": scored_tokens, "train_seconds": round(train_seconds, 1),
            "device": torch.cuda.get_device_name() if on_gpu else "cpu", "args": vars(a), "log": logs[family],
            "held_out_examples": len(held), "held_out_loss": {"student": student_loss, "teacher": teacher_loss},
        }  # fmt: skip
        if report["done"]:
            save_model(model.to(torch.bfloat16), out / family / "checkpoint", tokenizer_from=tok_dir)
        (out / family / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True, help="a Hugging Face model folder or a .gguf file")
    ap.add_argument("--out", required=True, help="run folder: data, tokenizer, FAMILY/{state,checkpoint,report.json}")
    ap.add_argument("--data", default=None, help="the labelled data's folder (default OUT/data); share it between runs")
    ap.add_argument("--data-only", action="store_true", help="build the data and the tokenizer, then stop")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES), help="students to train")
    ap.add_argument("--init", default=None, help="start from this checkpoint's weights (one family only)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--n-train", type=int, default=24000, help="chat and text examples the teacher labels")
    ap.add_argument("--n-eval", type=int, default=200)
    ap.add_argument("--teacher-batch", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the teacher's replies")
    ap.add_argument("--max-len", type=int, default=4096, help="longest example in tokens (the curriculum's end)")
    ap.add_argument("--batch-tokens", type=int, default=24576, help="padded tokens per batch at most")
    ap.add_argument("--steps", type=int, default=12000)
    ap.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds; if set, the schedule's length is cut at step 70 to end within it",
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--time-limit", type=float, default=480.0, help="seconds; the state is saved before it runs out")
    ap.add_argument("--workers", type=int, default=None, help="batch-making processes (default: 8 on a GPU, else 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if a.init and len(a.families) != 1:
        ap.error("--init starts one student: name its family with --families")
    if a.workers is None:
        a.workers = min(8, max(0, (os.cpu_count() or 1) - 2)) if a.device.startswith("cuda") else 0
    report = run(a)
    print(json.dumps({k: report.get(k) for k in ("family", "step", "done", "params", "held_out_loss", "data")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
