"""Tensor parallelism end to end on the CPU (two processes joined by gloo): `LLM(tensor_parallel_size=2)` gives one
rank's tokens and log-probabilities; `kvfree serve --tensor-parallel-size 2` serves a session whose snapshot
continues exactly in a one-rank server, and a one-rank snapshot continues in it (a snapshot's format does not
depend on the ranks)."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch

from kvfree.checkpoints import write_checkpoint
from kvfree.engine.llm import LLM
from kvfree.engine.model.config import ModelConfig
from kvfree.engine.model.hybrid_lm import HybridLM
from kvfree.engine.protocol import SamplingParams
from tests.engine.test_tensor_parallel import PROMPTS, hybrid_checkpoint
from tests.paths import ROOT, TINY_CHECKPOINT
from tests.server_fixtures import ProcServer

SERVED = "hybrid"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return hybrid_checkpoint(tmp_path_factory.mktemp("tp") / "hybrid")


def generate_at(path: str, device: str, sizes: tuple[int, ...], prompts: list[list[int]], tokens: int = 10) -> dict:
    """size -> (greedy then seeded-sampling completions of `prompts`, decoded together, and the fingerprint)."""
    greedy = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    sampled = SamplingParams(max_tokens=tokens, temperature=1.0, seed=7, ignore_eos=True, logprobs=3)
    runs = {}
    for size in sizes:
        llm = LLM(path, device=device, dtype="float32", max_sessions=4, max_context=128, tensor_parallel_size=size)
        try:
            runs[size] = (llm.generate(prompts, greedy) + llm.generate(prompts, sampled), llm.fingerprint)
        finally:
            llm.close()
    return runs


def assert_same_completions(one: list, other: list) -> None:
    """The same tokens, log-probabilities equal to float32 rounding (the partial sums are added in another order)
    and the same top alternatives."""
    for a, b in zip(one, other, strict=True):
        assert a.token_ids == b.token_ids
        # (prompt logprobs too where asked: every rank runs the scored LM head, its collectives with it)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        prompt = list(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)) if a.prompt_logprobs else []
        for x, y in [*zip(a.logprobs, b.logprobs, strict=True), *prompt]:
            assert math.isclose(x.logprob, y.logprob, rel_tol=1e-3, abs_tol=1e-4)
            assert [i for i, _ in x.top] == [i for i, _ in y.top]
    assert len({tuple(c.token_ids) for c in one}) > 2  # (the completions differ: not one token over and over)


def test_two_ranks_generate_one_ranks_tokens_and_logprobs(checkpoint):
    """Greedy and seeded-sampling completions of prompts of several lengths, decoded together, at TP=2 are TP=1's;
    the fingerprint, gathered from the ranks, is the whole model's."""
    runs = generate_at(checkpoint, "cpu", (1, 2), [*PROMPTS, list(range(40, 73))])
    assert runs[1][1] == runs[2][1]
    assert_same_completions(runs[1][0], runs[2][0])


# A model at sizes the Triton kernels take, whose heads divide among 4 GPUs (hmf's 8B layout in small).
GPU_HYBRID = {
    "vocab_size": 512, "hidden_size": 256, "layers": ["attention", "gka", "mamba2", "gka"],
    "tie_word_embeddings": False,
    "eos_token_id": 256, "mlp": {"intermediate_size": 512},
    "attention": {"num_heads": 8, "num_kv_heads": 2, "head_dim": 32, "qk_norm": True},
    "gka": {"num_heads": 8, "head_dim": 32, "num_k_heads": 4, "num_v_heads": 4},
    "mamba2": {"num_heads": 8, "head_dim": 32, "state_size": 64, "n_groups": 4},
}  # fmt: skip


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_on_gpus_two_and_four_ranks_decode_in_cuda_graphs_one_ranks_tokens(tmp_path):
    """NCCL and CUDA graphs (the collectives captured in the decode graphs): TP=2 and TP=4 give TP=1's tokens, with
    KV heads held by two ranks each at TP=4."""
    model = HybridLM(ModelConfig.from_dict(GPU_HYBRID))
    model.init_weights(seed=1, std=None)
    path = write_checkpoint(tmp_path / "gpu", ModelConfig.from_dict(GPU_HYBRID).to_dict(), model.state_dict(),
                            TINY_CHECKPOINT)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (70, 9, 100)]
    runs = generate_at(str(path), "cuda", (1, 2, 4), prompts, tokens=16)
    for size in (2, 4):
        assert runs[size][1] == runs[1][1]
        assert_same_completions(runs[1][0], runs[size][0])


# -- serving ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory):
    """The hybrid served at TP=2 and at TP=1, each in its own `kvfree serve` process."""
    logs = tmp_path_factory.mktemp("tp-logs")
    args = ["--served-model-name", SERVED, "--max-sessions", "4", "--max-context", "512"]
    two = ProcServer(checkpoint, [*args, "--tensor-parallel-size", "2"], logs / "tp2.log").start(timeout=120)
    one = ProcServer(checkpoint, args, logs / "tp1.log").start()
    yield two, one
    two.kill()
    one.kill()


def _chat(server: ProcServer, messages: list[dict], session_id: str | None = None) -> Any:
    extra = {"session_id": session_id} if session_id else None
    return server.openai().chat.completions.create(
        model=SERVED, messages=messages, max_tokens=12, temperature=0, extra_body=extra
    )


def _session(server: ProcServer, turns: list[str]) -> tuple[str, list[dict]]:
    """A session with `turns` asked and answered: (its id, the history ending with the last reply)."""
    with server.http() as http:
        sid = http.post("/v1/sessions", json={}).json()["id"]
    history: list[dict] = []
    for text in turns:
        history.append({"role": "user", "content": text})
        reply = _chat(server, history, sid)
        history.append({"role": "assistant", "content": reply.choices[0].message.content})
    return sid, history


def _move(src: ProcServer, sid: str, dst: ProcServer) -> str:
    """Snapshot session `sid` of `src` and restore it into `dst`: the restored session's id."""
    with src.http() as http:
        data = http.get(f"/v1/sessions/{sid}/snapshot").content
    with dst.http() as http:
        r = http.post("/v1/sessions/restore", content=data, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def test_a_two_rank_server_serves_and_its_snapshots_continue_exactly_at_one_rank(servers):
    """The TP=2 server answers as the TP=1 server does (same replies, turn by turn, from a session); its session's
    snapshot, restored at TP=1, continues with the reply TP=2 gives, only the new turn prefilled; and a TP=1
    snapshot restored at TP=2 likewise."""
    two, one = servers
    turns = ["Hello there, how are you?", "Tell me about the sea."]
    sid_two, history = _session(two, turns)
    sid_one, history_one = _session(one, turns)
    assert history == history_one  # the same replies at either size

    history.append({"role": "user", "content": "And then?"})
    replies = {}
    for src, sid, dst in ((two, sid_two, one), (one, sid_one, two)):
        moved = _move(src, sid, dst)
        here, there = _chat(src, history, sid), _chat(dst, history, moved)
        replies[id(src)] = here.choices[0].message.content
        assert there.choices[0].message.content == here.choices[0].message.content
        cached = there.model_extra["session"]["cached_tokens"]
        assert cached == here.model_extra["session"]["cached_tokens"] > 0
        assert there.usage.prompt_tokens_details.cached_tokens == cached
    # Without a session, the conversation sent again resumes from the prefix cache's checkpoints (the KV caches
    # split over the ranks with the rest of the state), and the reply is the session's.
    for server in (two, one):
        stateless = _chat(server, history)
        assert stateless.usage.prompt_tokens_details.cached_tokens > 0
        assert stateless.choices[0].message.content == replies[id(server)]


def test_a_model_whose_heads_do_not_divide_is_refused_at_start_with_the_layers_name(checkpoint):
    """Three ranks for four heads: `kvfree serve` does not start, exits with an error, and says which layer and
    which count."""
    cmd = [sys.executable, "-m", "kvfree", "serve", checkpoint, "--device", "cpu", "--port", "0",
           "--tensor-parallel-size", "3"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "does not divide among 3 tensor-parallel ranks" in done.stdout + done.stderr
