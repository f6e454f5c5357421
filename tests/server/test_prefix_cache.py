"""The prefix cache through a real server and the OpenAI SDK: stateless clients get their conversations' earlier
turns back (`cached_tokens`), and the same replies as with the cache off; a tenant's checkpoints never serve
another's; `prompt_cache_key` is checked; `return_tokens_as_token_ids` names the exact tokens; /metrics counts it."""

from __future__ import annotations

import openai
import pytest

from tests.server_fixtures import assert_openai_error, make_checkpoint, metric_value, serve

SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in one short sentence."}


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The tiny hybrid (Mamba-2 and attention: a KV cache in every checkpoint), with two API keys."""
    path = make_checkpoint("tiny-hybrid", tmp_path_factory.mktemp("ckpt") / "tiny-hybrid")
    return path


@pytest.fixture(scope="module")
def servers(hybrid):
    on = serve(hybrid, "kvfree-hybrid", max_sessions=4, max_context=2048, env={"KVFREE_API_KEYS": "k1,k2"})
    off = serve(hybrid, "kvfree-hybrid", max_sessions=4, max_context=2048, prefix_cache=False)
    yield on, off
    on.stop()
    off.stop()


def chat(client: openai.OpenAI, messages: list[dict], **kw):
    return client.chat.completions.create(model="kvfree-hybrid", messages=messages, temperature=0, max_tokens=8, **kw)


def test_a_stateless_conversation_is_cached_turn_by_turn_and_replies_as_without_the_cache(servers):
    on, off = servers
    client, cold = on.openai(api_key="k1"), off.openai()
    messages = [SYSTEM]
    previous = 0
    for turn, text in enumerate(["Hello there.", "Tell me more.", "And then?"]):
        messages.append({"role": "user", "content": text})
        r, want = chat(client, messages), chat(cold, messages)
        assert r.choices[0].message.content == want.choices[0].message.content
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert want.usage.prompt_tokens_details.cached_tokens == 0
        assert cached >= previous if turn else cached == 0, (turn, cached, previous)
        previous = r.usage.prompt_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    text = on.http().get("/metrics").text
    assert metric_value(text, "kvfree_prefix_cache_checkpoints") > 0
    assert metric_value(text, "kvfree_prefix_cache_events", 'kind="hits"') >= 2
    assert metric_value(text, "kvfree:prefix_cache_hits_total", 'model_name="kvfree-hybrid"') >= previous


def test_the_system_prompt_is_shared_by_a_tenants_conversations_and_by_no_other_tenant(servers):
    on, _ = servers
    system = {"role": "system", "content": "Shared rules: " + "be brief and exact; " * 12}
    first = chat(on.openai(api_key="k1"), [system, {"role": "user", "content": "One."}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    same_tenant = chat(on.openai(api_key="k1"), [system, {"role": "user", "content": "Two, another question."}])
    assert same_tenant.usage.prompt_tokens_details.cached_tokens > 20  # the system prompt's boundary
    other_tenant = chat(on.openai(api_key="k2"), [system, {"role": "user", "content": "Two, another question."}])
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0


def test_prompt_cache_key_is_a_short_string(servers):
    on, _ = servers
    client = on.openai(api_key="k1")
    ok = chat(client, [SYSTEM, {"role": "user", "content": "hi"}], extra_body={"prompt_cache_key": "conv-42"})
    assert ok.choices[0].message.content is not None
    with on.http() as http:
        for bad in ("", "x" * 129, "tab\there", 7):
            body = {"messages": [SYSTEM], "prompt_cache_key": bad}
            r = http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k1"})
            assert_openai_error(r, 400, param="prompt_cache_key")


def test_tokens_as_token_ids_are_the_exact_reply(servers):
    on, _ = servers
    client = on.openai(api_key="k1")
    kw = {"model": "kvfree-hybrid", "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "logprobs": 0}
    r = client.completions.create(extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True}, **kw)
    ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert len(ids) == 6 and all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
    # Sent back, the reply is the state of the output's end: everything but its last token comes from the cache.
    again = client.completions.create(**{**kw, "prompt": [5, 6, 7, 8, *ids, 9]})
    assert again.usage.prompt_tokens_details.cached_tokens == 4 + len(ids) - 1
