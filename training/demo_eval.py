"""Score a served model on the `kvfree-demo` skills, through the server's own API (any OpenAI-compatible kvfree server).

    python -m kvfree.training.demo_eval --base-url http://127.0.0.1:8000 --n 40 --filler-tokens 1024 4096 16384

- **tools**: held-out requests (`demo_data`, split "eval": function names, argument names and values from word banks
  the training split never uses) sent to `/v1/chat/completions` with their tools and `tool_choice: "auto"`, greedy:
  the server's structured-outputs engine lets the model answer in words or call, and makes any call it opens valid
  for one of the tools shown. Scored separately: exactly one call (`finish_reason: "tool_calls"`), the expected
  function, arguments valid for its schema, and exactly the expected arguments.
- **recall**: a fact stated in the first turn, then filler turns until the conversation holds at least N tokens,
  prefilled into a session (`POST /v1/sessions`), then the question asked on that session: right when the reply
  contains the answer. Reported per N, with the tokens the session's state already held (`cached_tokens`).

With `--teacher PATH` (a Hugging Face model folder or `.gguf`) the same requests are put to the teacher through
transformers instead of a server, greedy: tools rendered with kvfree's chat template (the prompt the student sees)
and its reply parsed by `tool_calls_in` (the format exactly); recall with the teacher's own chat template, and lengths
past its context window (`max_position_embeddings`) reported as beyond it rather than run.

Prints a JSON report (and writes it with `--out`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai

from kvfree.training.demo_data import FILLER, Example, examples, recall_example


@dataclass
class ToolScore:
    """How one reply fares: one well-formed call; the expected function; arguments valid for its schema; equal."""

    formed: bool
    right_function: bool
    valid_arguments: bool
    exact_arguments: bool

    @property
    def right(self) -> bool:
        return self.formed and self.right_function and self.valid_arguments


def score_tool_reply(finish_reason: str | None, tool_calls: list[Any] | None, example: Example) -> ToolScore:
    """Score a chat reply (`finish_reason`, `message.tool_calls` as the SDK returns them) against a tools example."""
    calls = tool_calls or []
    if finish_reason != "tool_calls" or len(calls) != 1:
        return ToolScore(False, False, False, False)
    call = calls[0]
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        return ToolScore(False, False, False, False)
    if not isinstance(arguments, dict):
        return ToolScore(False, False, False, False)
    right_function = call.function.name == example.expected["name"]
    try:
        jsonschema.validate(arguments, example.schema or {})
        valid = True
    except jsonschema.ValidationError:
        valid = False
    exact = right_function and arguments == example.expected["arguments"]
    return ToolScore(True, right_function, right_function and valid, exact)


def evaluate_tools(client: openai.OpenAI, model: str, cases: list[Example], max_tokens: int = 128,
                   replies: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Greedy replies to `cases` (tools examples) through chat completions, scored; each reply appended to
    `replies` when given (the expected call, the calls made, the text)."""
    scores = []
    for ex in cases:
        r = client.chat.completions.create(
            model=model, messages=ex.messages, tools=ex.tools, tool_choice="auto", temperature=0, max_tokens=max_tokens
        )
        choice = r.choices[0]
        scores.append(score_tool_reply(choice.finish_reason, choice.message.tool_calls, ex))
        if replies is not None:
            made = [{"name": c.function.name, "arguments": c.function.arguments}
                    for c in choice.message.tool_calls or []]  # fmt: skip
            shown = [t["function"]["name"] for t in ex.tools or []]
            replies.append({"expected": ex.expected, "shown": shown, "calls": made, "content": choice.message.content,
                            "right_function": scores[-1].right_function,
                            "exact_arguments": scores[-1].exact_arguments})  # fmt: skip
    return summarise(scores)


def summarise(scores: list[ToolScore]) -> dict[str, Any]:
    """The shares of replies that are right, well-formed, call the right function, and have the exact arguments."""
    n = max(1, len(scores))
    return {
        "requests": len(scores),
        "right": sum(s.right for s in scores) / n,
        "well_formed": sum(s.formed for s in scores) / n,
        "right_function": sum(s.right_function for s in scores) / n,
        "exact_arguments": sum(s.exact_arguments for s in scores) / n,
    }


def recall_conversation(rng: random.Random, http: httpx.Client, min_tokens: int) -> tuple[list[dict[str, Any]], str]:
    """A fact, then filler turns until the conversation renders to at least `min_tokens` tokens (counted by the
    server's `/tokenize`), then the question. Returns (messages before the question, and the question appended; the
    answer is the example's)."""
    ex = recall_example(rng, "eval", filler_turns=0)
    head, question = ex.messages[:-1], ex.messages[-1]
    messages = list(head)
    step = 16
    while True:
        count = http.post("/tokenize", json={"messages": [*messages, question]}).raise_for_status().json()["count"]
        if count >= min_tokens:
            return [*messages, question], ex.expected
        for _ in range(step):
            ask, reply = rng.choice(FILLER)
            messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
        step = max(16, min(1024, step * 2))


def evaluate_recall(base_url: str, model: str, filler_tokens: list[int], per_length: int, seed: int = 0,
                    max_tokens: int = 16) -> dict[str, Any]:  # fmt: skip
    """Recall after `filler_tokens` of conversation: the history prefilled into a session, then the question."""
    rng = random.Random(f"kvfree-demo-recall/{seed}")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    out: dict[str, Any] = {}
    with httpx.Client(base_url=base_url, timeout=600) as http:
        for tokens in filler_tokens:
            right, cached, prompt, cases = 0, [], [], []
            for _ in range(per_length):
                messages, answer = recall_conversation(rng, http, tokens)
                session = http.post("/v1/sessions", json={"messages": messages[:-1]}).raise_for_status().json()
                try:
                    r = client.chat.completions.create(
                        model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                        extra_body={"session_id": session["id"]},
                    )  # fmt: skip
                finally:
                    http.delete(f"/v1/sessions/{session['id']}")
                reply = r.choices[0].message.content or ""
                right += answer.lower() in reply.lower()
                cases.append({"fact": messages[1]["content"], "reply": reply, "right": answer.lower() in reply.lower()})
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
                prompt.append(r.usage.prompt_tokens)
            out[str(tokens)] = {
                "right": right / max(1, per_length),
                "conversations": per_length,
                "prompt_tokens_mean": sum(prompt) / max(1, len(prompt)),
                "cached_tokens_mean": sum(cached) / max(1, len(cached)),
                "cases": cases,
            }
    return out


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_calls_in(text: str) -> list[Any]:
    """The calls in a reply outside the server, shaped as the SDK returns them (`.function.name`, `.function.arguments`
    as a JSON string): each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` whose JSON has a string name and
    an object of arguments. Stricter than the server's parser (`server/tools.py`, which `training` must not import):
    anything else in the tags is not a call."""
    from types import SimpleNamespace

    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict):
            function = SimpleNamespace(name=call["name"], arguments=json.dumps(call["arguments"]))
            calls.append(SimpleNamespace(function=function))
    return calls


def evaluate_teacher(path: str, n: int, filler_tokens: list[int], per_length: int, seed: int = 0,
                     max_tokens: int = 128) -> dict[str, Any]:  # fmt: skip
    """The teacher's scores on the same held-out tool requests and recall conversations (see the module doc)."""
    from kvfree.checkpoints.byte_tokenizer import CHAT_TEMPLATE
    from kvfree.training.demo_teacher import Teacher

    teacher = Teacher.load(path)
    tok = teacher.tokenizer
    scores = []
    for ex in examples("eval", seed, n, skills=("tools",)):
        prompt = tok.apply_chat_template(ex.messages, tools=ex.tools, chat_template=CHAT_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
        (reply,) = teacher.generate([prompt], max_tokens)
        calls = tool_calls_in(reply)
        scores.append(score_tool_reply("tool_calls" if calls else "stop", calls, ex))
    report: dict[str, Any] = {"model": Path(path).name, "tools": summarise(scores), "recall": {}}
    window = teacher.model.config.max_position_embeddings
    rng = random.Random(f"kvfree-demo-recall/{seed}")
    for tokens in filler_tokens:
        if tokens + max_tokens > window:
            report["recall"][str(tokens)] = {"right": None, "beyond_context": window}
            continue
        right = 0
        for _ in range(per_length):
            ex = recall_example(rng, "eval", filler_turns=0)
            messages = ex.messages[:-1]
            def length(history: list[dict[str, Any]]) -> int:
                text = tok.apply_chat_template(history, tokenize=False)
                return len(tok(text, add_special_tokens=False)["input_ids"])

            while length([*messages, ex.messages[-1]]) < tokens:
                for _ in range(8):  # eight exchanges between counts: the count re-reads the whole conversation
                    ask, reply = rng.choice(FILLER)
                    messages += [{"role": "user", "content": ask}, {"role": "assistant", "content": reply}]
            (answer,) = teacher.replies([[*messages, ex.messages[-1]]], 16)
            right += ex.expected.lower() in answer.lower()
        report["recall"][str(tokens)] = {"right": right / max(1, per_length), "conversations": per_length}
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    ap.add_argument("--model", default=None, help="default: the server's only model")
    ap.add_argument("--n", type=int, default=40, help="held-out tool requests")
    ap.add_argument("--filler-tokens", type=int, nargs="*", default=[1024, 4096], help="recall lengths (tokens)")
    ap.add_argument("--recall-per-length", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    ap.add_argument("--teacher", default=None, help="score this Hugging Face model / .gguf instead of a server")
    a = ap.parse_args(argv)
    if a.teacher:
        report = evaluate_teacher(a.teacher, a.n, a.filler_tokens, a.recall_per_length, a.seed)
        return _print_report(report, a.out)
    client = openai.OpenAI(base_url=a.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = a.model or client.models.list().data[0].id
    replies: list[dict[str, Any]] = []
    report = {
        "model": model,
        "tools": evaluate_tools(client, model, examples("eval", a.seed, a.n, skills=("tools",)), replies=replies),
        "recall": evaluate_recall(a.base_url, model, a.filler_tokens, a.recall_per_length, a.seed),
        "tool_replies": replies,
    }
    return _print_report(report, a.out)


def _print_report(report: dict[str, Any], out: Path | None) -> int:
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
