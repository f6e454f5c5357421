"""Benchmark clients people point at servers, run against `kvfree serve` unchanged (a real uvicorn server on loopback).

- `guidellm` (from PyPI, a test dependency): `guidellm run` with synthetic data, the tokenizer read from the served
  checkpoint, four concurrent streams, through each request format it has for OpenAI servers: chat completions,
  completions, and the Responses API. Every request must succeed with the tokens it asked for.
- vLLM's `vllm bench serve` (not installable here: it needs vLLM and a GPU): its request bodies for the `openai` and
  `openai-chat` backends, sent as it sends them (streamed, `stream_options.include_usage`, `ignore_eos`, `logprobs:
  null`, `repetition_penalty`, `x-request-id`, chat content as a list of text parts, token-id prompts), and the
  stream read as it reads it: events split on blank lines, `data: ` stripped, `[DONE]` last, the text of
  `choices[0]`, then a usage chunk with `completion_tokens`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_fixtures import make_checkpoint, serve

NAME = "kvfree-tiny"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def server(ckpt):
    srv = serve(ckpt, NAME, max_sessions=8)
    yield srv
    srv.stop()


# -- guidellm ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_guidellm_benchmarks_kvfree(server, ckpt, tmp_path, request_format):
    pytest.importorskip("guidellm")
    out = tmp_path / "benchmarks.json"
    cmd = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={server.url},model={NAME},request_format={request_format}",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", "kind=max_requests,count=8",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        "--tokenizer", f"kind=huggingface_auto,model={ckpt}",
        "--output", f"kind=json,path={out}",
        "--disable-console",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    assert bench["metrics"]["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    for request in bench["requests"]["successful"]:
        assert 1 <= request["output_metrics"]["text_tokens"] <= 8, request["output_metrics"]
        assert request["input_metrics"]["text_tokens"] >= 32, request["input_metrics"]


# -- vllm bench serve's request format ----------------------------------------------------------------------------


def _bench_serve_request(server, path: str, payload: dict) -> dict:
    """One request as `vllm bench serve` sends and reads it; what it records (success, text, token counts)."""
    headers = {"Content-Type": "application/json", "x-request-id": "bench-1"}
    text, usage, saw_choice, done = "", {}, False, False
    with server.http() as http, http.stream("POST", path, json=payload, headers=headers) as r:
        assert r.status_code == 200, r.read()
        buffer = ""
        for piece in r.iter_text():
            buffer += piece
            while "\n\n" in buffer:
                message, buffer = buffer.split("\n\n", 1)
                message = message.strip()
                if not message or message.startswith(":"):
                    continue
                chunk = message.removeprefix("data: ")
                if chunk == "[DONE]":
                    done = True
                    continue
                assert not done, "an event after [DONE]"
                data = json.loads(chunk)
                if choices := data.get("choices"):
                    saw_choice = True
                    first = choices[0]
                    text += (first.get("text") if "text" in first else first["delta"].get("content")) or ""
                elif data.get("usage"):
                    usage = data["usage"]
    assert done and buffer.strip() == ""
    return {"success": saw_choice, "text": text, "usage": usage}


def test_vllm_bench_serve_completions_format(server):
    base = {"model": NAME, "repetition_penalty": 1.0, "max_tokens": 12, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    for prompt in ("The quick brown fox", [72, 101, 108, 108, 111]):  # text, and token ids (its random dataset)
        got = _bench_serve_request(server, "/v1/completions", {**base, "prompt": prompt})
        assert got["success"] and got["text"]
        assert got["usage"]["completion_tokens"] == 12
        assert got["usage"]["prompt_tokens"] == (5 if isinstance(prompt, list) else len(prompt.encode()))


def test_vllm_bench_serve_chat_format(server):
    payload = {
        "model": NAME,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "The quick brown fox"}]}],
        "max_completion_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
    }
    got = _bench_serve_request(server, "/v1/chat/completions", payload)
    assert got["success"] and got["usage"]["completion_tokens"] == 12
    assert got["usage"]["prompt_tokens"] > len("The quick brown fox")  # the chat template's tokens too
