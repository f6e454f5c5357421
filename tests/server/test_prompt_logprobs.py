"""Scoring prompts through a real server and the OpenAI SDK: `echo` with `logprobs` on `/v1/completions` (OpenAI's
legacy shape, `max_tokens: 0` too), vLLM's `prompt_logprobs` on completions and chat, batched prompts, and
`/tokenizer_info`; every combination it does not serve is a 400 naming the field."""

from __future__ import annotations

import math

import pytest

from tests.paths import TINY_CHECKPOINT
from tests.server_fixtures import assert_openai_error, serve

NAME = "kvfree-tiny"


@pytest.fixture(scope="module")
def server():
    srv = serve(TINY_CHECKPOINT, NAME, max_sessions=4)
    yield srv
    srv.stop()


def test_echo_returns_the_prompt_and_its_logprobs_first_null(server):
    client = server.openai()
    r = client.completions.create(model=NAME, prompt="Hello there", echo=True, logprobs=1, max_tokens=2,
                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    c = r.choices[0]
    n_prompt = r.usage.prompt_tokens
    assert c.text.startswith("Hello there") and r.usage.completion_tokens == 2
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])  # logprobs: 1, at every position
    assert "".join(lp.tokens[:n_prompt]) == "Hello there" and lp.text_offset[n_prompt] == len("Hello there")
    # Scored without generating: the same prompt part, nothing after it.
    s = client.completions.create(model=NAME, prompt="Hello there", echo=True, logprobs=1, max_tokens=0)
    assert s.choices[0].text == "Hello there" and s.choices[0].finish_reason == "length"
    assert s.usage.completion_tokens == 0
    assert s.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt], abs=1e-5)


def test_a_batch_of_prompts_gets_n_choices_each_in_order(server):
    client = server.openai()
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    r = client.completions.create(model=NAME, prompt=prompts, n=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == list(range(6))
    assert r.usage.prompt_tokens == 2 * 0 + sum(map(len, prompts)) and r.usage.completion_tokens == 18
    for i, prompt in enumerate(prompts):  # each prompt alone gives its choices' text
        alone = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == alone.choices[0].text


def test_vllm_prompt_logprobs_rank_the_prompt_token_among_the_most_likely(server):
    client = server.openai()
    r = client.completions.create(model=NAME, prompt=[5, 6, 7, 8, 9], max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 3})  # fmt: skip
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == 5 and plp[0] is None
    for token, entry in zip([6, 7, 8, 9], plp[1:], strict=True):
        assert sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3]  # the top 3, and the prompt token
        mine = entry[str(token)]
        assert mine["rank"] >= 1 and mine["logprob"] <= max(v["logprob"] for v in entry.values()) + 1e-6
        assert math.isclose(sum(math.exp(v["logprob"]) for k, v in entry.items() if v["rank"] <= 3), sum(
            sorted((math.exp(v["logprob"]) for v in entry.values()), reverse=True)[:3]), rel_tol=1e-5)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})  # fmt: skip
    top = chat.model_extra["prompt_logprobs"]
    assert top[0] is None and len(top) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in top[1:])  # k = 0: the prompt token alone


def test_tokenizer_info_says_the_special_tokens_and_template(server):
    with server.http() as http:
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] and info["chat_template"] and info["model_max_length"] > 0
        ids = http.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "echo": True, "stream": True}, "echo"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": ["a", "b"], "stream": True}, "stream"),
        ({"prompt": ["x"] * 257}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt[1]"),
        ({"prompt": "hi", "echo": True, "session_id": "sess_000000000000000000000000"}, "echo"),
    ],
)
def test_what_completions_cannot_serve_is_a_400_naming_the_field(server, body, param):
    with server.http() as http:
        assert_openai_error(http.post("/v1/completions", json=body), 400, param=param)


def test_chat_prompt_logprobs_with_stream_is_a_400(server):
    with server.http() as http:
        body = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True}
        assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param="prompt_logprobs")
