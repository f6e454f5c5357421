"""Helpers for the end-to-end server tests (tests/server/test_server.py): test checkpoints, real servers on free
loopback ports (uvicorn in a thread, or `python -m kvfree serve` in a subprocess), and checks of OpenAI-shaped errors.

The checkpoints are built from `engine.presets.init_checkpoint` and then edited:

- `make_checkpoint` ("rich"): weights of unit scale instead of the 0.02 init and Mamba-2 layers with slow decays
  and no skip term, so that greedy output depends on the whole context (a wrong or stale state changes the tokens,
  even a hundred tokens later) instead of collapsing into one repeated byte; and an
  untied LM head whose rows for non-printable bytes and most special tokens are zero, so greedy decoding emits
  printable ASCII, newlines, `<|endoftext|>` and `<|im_end|>` only. Replies then round-trip through text exactly,
  which session prefix reuse needs when a client sends the reply back in the next turn's history.
- `make_chain_checkpoint` ("bigram"): every mixer's `out_proj` is zero, so the residual stream is the token's
  embedding and the next-token logits depend on the previous token only; embedding and LM head are set so greedy
  decoding after the generation prompt's newline writes a fixed chain of tokens, then `<|im_end|>`.
  `make_tool_checkpoint` writes `<tool_call>`, two added multi-character tokens holding
  `{"name": "get_weather", "arguments": {"city": "Paris"}}` (split where a grammar stops forcing), `</tool_call>`;
  `make_thinking_checkpoint` a `<think>` block, then an answer, with reasoning tags declared.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import uvicorn
from safetensors.torch import load_file, save_file

from kvfree.checkpoints.byte_tokenizer import build_byte_tokenizer
from kvfree.engine.model.presets import init_checkpoint
from kvfree.server.app import create_app
from kvfree.server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[1]

EOS_ID, IM_START_ID, IM_END_ID, TOOL_START_ID, TOOL_END_ID = 256, 257, 258, 259, 260

# The tool call the bigram checkpoint writes, split over two added tokens. The split falls where a `get_weather`
# call's grammar stops forcing bytes (the city is the model's to choose), and the first piece is how the tokenizer
# encodes the forced part: a grammar lets the model write only the canonical tokens of bytes it forces.
TOOL_PIECES = ('{"name": "get_weather", "arguments": {"city": "', 'Paris"}}')
TOOL_CALL_TEXT = "".join(TOOL_PIECES)


# -- checkpoints --------------------------------------------------------------------------------------------------


def _edit_checkpoint(path: Path, config_edit: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(config_edit)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


def make_checkpoint(preset: str, path: Path, seed: int = 0) -> Path:
    """A random checkpoint of `preset` whose greedy output is context-dependent printable text (module doc)."""
    init_checkpoint(preset, path, seed=seed)
    raw = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(10_000 + seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name == "embed.weight":
            t = 0.3 * torch.randn(t.shape, generator=gen)
        elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            t = 3.0 * torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1])
        elif name.endswith(".weight") and t.dim() == 2 and ".conv." not in name:
            t = torch.randn(t.shape, generator=gen) / math.sqrt(t.shape[1])
        elif name.endswith("norm.weight"):
            t = 1 + 0.2 * torch.randn(t.shape, generator=gen)
        out[name] = t
    # Mamba-2 with a long memory: slow decays (small A) and no skip term (D = 0), so what a token puts in the
    # state still changes the output a hundred tokens later.
    for name, t in raw.items():
        if name.endswith("mixer.A_log"):
            heads = t.shape[0]
            prefix = name.removesuffix("A_log")
            out[name] = _log_uniform(heads, 0.003, 0.03, gen).log()
            out[prefix + "D"] = torch.zeros(heads)
            dt = _log_uniform(heads, 0.05, 0.5, gen)
            out[prefix + "dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
            in_proj = out[prefix + "in_proj.weight"].clone()
            in_proj[-heads:] *= 0.3  # the dt rows: dt stays near dt_bias
            out[prefix + "in_proj.weight"] = in_proj
    vocab, hidden = raw["embed.weight"].shape
    head = 3.0 * torch.randn(vocab, hidden, generator=gen) / math.sqrt(hidden)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[32:127] = True  # printable ASCII
    allowed[10] = True  # newline
    allowed[EOS_ID] = allowed[IM_END_ID] = True
    head[~allowed] = 0.0  # logit 0: never the argmax among ~100 logits of std 3
    head[[EOS_ID, IM_END_ID]] *= 0.6  # stops happen, but not at once
    out["lm_head.weight"] = head
    _edit_checkpoint(path, {"tie_word_embeddings": False}, out)
    return path


def _log_uniform(n: int, lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    return torch.exp(torch.rand(n, generator=gen) * (math.log(hi) - math.log(lo)) + math.log(lo))


def make_chain_checkpoint(path: Path, chain: list[str], tokenizer_config: dict[str, Any] | None = None) -> Path:
    """A bigram checkpoint whose greedy reply after the generation prompt's newline is `chain` (each entry an added
    token, or an existing special token such as `<tool_call>`), then `<|im_end|>` (module doc). `tokenizer_config`
    entries are merged into its tokenizer_config.json."""
    init_checkpoint("tiny", path, seed=0)
    tok = build_byte_tokenizer()
    assert len(set(chain)) == len(chain), "a bigram chain cannot repeat a token (it has one successor)"
    tok.add_tokens([p for p in chain if tok.token_to_id(p) is None])
    tok.save(str(path / "tokenizer.json"))
    ids = [10, *(tok.token_to_id(p) for p in chain), IM_END_ID]
    vocab = tok.get_vocab_size()
    raw = load_file(str(path / "model.safetensors"))
    hidden = raw["embed.weight"].shape[1]
    out = {k: v for k, v in raw.items() if k != "embed.weight"}
    for name in out:
        if name.endswith("out_proj.weight"):
            out[name] = torch.zeros_like(out[name])
    # token -> its own residual direction -> the next token of the chain; every other token -> <|im_end|>.
    embed = torch.zeros(vocab, hidden)
    embed[:, 0] = 1.0
    head = torch.zeros(vocab, hidden)
    head[IM_END_ID, 0] = 1.0
    for dim, (token, following) in enumerate(zip(ids, ids[1:], strict=False), start=1):
        embed[token] = 0.0
        embed[token, dim] = 1.0
        head[following, dim] = 1.0
    out["embed.weight"] = embed
    out["lm_head.weight"] = head
    out["norm.weight"] = torch.ones(hidden)
    _edit_checkpoint(path, {"tie_word_embeddings": False, "vocab_size": vocab}, out)
    if tokenizer_config:
        cfg_path = path / "tokenizer_config.json"
        cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | tokenizer_config, indent=2))
    return path


def make_tool_checkpoint(path: Path) -> Path:
    """The bigram checkpoint that answers every chat with one `get_weather` tool call (module doc)."""
    return make_chain_checkpoint(path, ["<tool_call>", *TOOL_PIECES, "</tool_call>"])


# The thinking checkpoint's reply: a reasoning block, then the answer (two added tokens each side).
THINK_CHAIN = ["<think>", "Paris is ", "in France.", "</think>", "\n\n", "It is in ", "France, Europe."]


def make_thinking_checkpoint(path: Path) -> Path:
    """A bigram checkpoint that thinks before it answers, with Qwen3's reasoning tags declared."""
    return make_chain_checkpoint(path, THINK_CHAIN, {"reasoning_start": "<think>", "reasoning_end": "</think>"})


# -- servers ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """`create_app(settings)` under a real uvicorn server on a free loopback port, in a thread of this process.

    `env` is applied only while the app is created (e.g. KVFREE_API_KEYS, read by `create_app`).
    """

    def __init__(self, settings: ServerSettings, env: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.env = env or {}
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.app = None

    def start(self, timeout: float = 60.0) -> ThreadServer:
        for _attempt in range(3):  # a free port can be taken between probing and binding: try another
            self.settings.port = free_port()
            saved = {k: os.environ.get(k) for k in self.env}
            os.environ.update(self.env)
            try:
                self.app = create_app(self.settings)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            config = uvicorn.Config(
                self.app, host="127.0.0.1", port=self.settings.port, log_level="warning", access_log=False
            )
            self.server = uvicorn.Server(config)
            self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
            self.thread.start()
            deadline = time.monotonic() + timeout
            while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.server.started:
                return self
            self.stop()
        raise RuntimeError("the test server did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(60)
            assert not self.thread.is_alive(), "the test server did not stop"

    def openai(self, api_key: str = "unused", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def async_openai(self, api_key: str = "unused", **kw: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)


def serve(model: Path, name: str, env: dict[str, str] | None = None, **settings: Any) -> ThreadServer:
    """A started `ThreadServer` of `model` served as `name` (on the CPU unless `device` is given)."""
    settings.setdefault("device", "cpu")
    return ThreadServer(ServerSettings(model=model, served_model_name=name, **settings), env=env).start()


def served_fixture(checkpoint: str, name: str, **settings: Any):
    """A module-scoped pytest fixture: the test module's `ckpts[checkpoint]` served as `name` (`serve`), stopped when
    the module is done."""

    @pytest.fixture(scope="module")
    def fixture(ckpts):
        server = serve(ckpts[checkpoint], name, **settings)
        yield server
        server.stop()

    return fixture


class ProcServer:
    """`python -m kvfree serve MODEL --port P ARGS...` in a subprocess; stdout and stderr go to `log_path`."""

    def __init__(self, model: Path, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.model = model
        self.args = args
        self.log_path = log_path
        self.env = env or {}
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> ProcServer:
        for _attempt in range(3):
            self.port = free_port()
            cmd = [sys.executable, "-m", "kvfree", "serve", str(self.model), "--port", str(self.port)]
            cmd += ["--device", "cpu", *self.args]
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                        return self
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.kill()
                break
        raise RuntimeError(f"the server process did not become ready; its log:\n{self.log()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self, timeout: float) -> int:
        """SIGTERM, then the exit code (raises subprocess.TimeoutExpired if it takes longer than `timeout`)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)


# -- checks -------------------------------------------------------------------------------------------------------


def assert_openai_error(
    response: httpx.Response,
    status: int,
    param: str | None | type[Ellipsis] = ...,
    code: str | None | type[Ellipsis] = ...,
    error_type: str | None = None,
) -> dict[str, Any]:
    """`response` is `status` with OpenAI's error body (exactly message/type/param/code) and, when given, that
    `param`, `code` and `type`. Returns the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if error_type is None:
        error_type = "invalid_request_error" if status < 500 and status != 429 else error["type"]
    assert error["type"] == error_type, error
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of sample `name{labels}` in Prometheus text (labels as rendered, e.g. 'location="disk"')."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise AssertionError(f"metric {key} not found in /metrics")


def wait_for(predicate, timeout: float, interval: float = 0.05, message: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")
