"""The OpenAI Responses API end to end: a real uvicorn server on a loopback port, driven by the official `openai` SDK.

Stored responses continue from their exact state (`previous_response_id`: only the new input is prefilled, and the
output equals the same conversation sent in full), fork when continued twice, are scoped by API key, and are gone
once deleted; streams carry the typed events in the order the SDK's accumulator expects; tool calls go out as
`function_call` items and come back as `function_call_output` input; a checkpoint that declares reasoning tags
returns its thinking as a `reasoning` item (streamed as `response.reasoning_text.*` events), which comes back as
input.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from kvfree.checkpoints.byte_tokenizer import CHAT_TEMPLATE
from kvfree.engine.sessions.store import DirectoryStore
from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.server.errors import APIError
from kvfree.server.protocol import AssistantMessage, ToolMessage, UserMessage
from kvfree.server.reasoning import ReasoningFormat
from kvfree.server.responses import (
    OutputBuilder,
    ReasoningTokens,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    response_id,
    response_object,
)
from kvfree.server.tools import ToolCallFormat
from tests.paths import TINY_CHECKPOINT
from tests.server_fixtures import (
    THINK_CHAIN,
    TOOL_CALL_TEXT,
    ThreadServer,
    assert_openai_error,
    make_chain_checkpoint,
    make_checkpoint,
    make_tool_checkpoint,
    serve,
    served_fixture,
)

ROOT = Path(__file__).resolve().parents[2]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


THINK = ReasoningFormat("<think>", "</think>")
# The thinking checkpoint's chat template shows a reply's reasoning as the model wrote it (Qwen3's shows it for the
# turns after the last user message only): the reasoning items sent back reach the prompt.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if message['content'] is string %}",
    "{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>\n\n{% endif %}"
    "{% if message['content'] is string %}",
)
REASONING, ANSWER = "Paris is in France.", "It is in France, Europe."  # THINK_CHAIN's two parts


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    thinking = make_chain_checkpoint(root / "thinking", THINK_CHAIN, {
        "reasoning_start": "<think>", "reasoning_end": "</think>", "chat_template": THINKING_TEMPLATE,
    })  # fmt: skip
    return {"tiny": make_checkpoint("tiny", root / "tiny"), "tool": make_tool_checkpoint(root / "tool"),
            "thinking": thinking}  # fmt: skip


server = served_fixture("tiny", "kvfree-tiny", max_sessions=8)
tool_server = served_fixture("tool", "kvfree-tool", max_sessions=4)
thinking_server = served_fixture("thinking", "kvfree-thinking", max_sessions=4)


def respond(client: openai.OpenAI, input: Any, **kw: Any):
    """A greedy response of at most 8 tokens."""
    kw.setdefault("max_output_tokens", 8)
    return client.responses.create(model="kvfree-tiny", input=input, temperature=0, **kw)


def sessions_held(srv: ThreadServer) -> int:
    return sum(srv.app.state.kvfree.engine.stats()["sessions"].values())


# -- stored state -----------------------------------------------------------------------------------------------------


def test_three_turns_continue_the_stored_state(server):
    client = server.openai()
    turns = ["Hello there", "Tell me more", "And then?"]
    history: list[dict[str, str]] = []
    previous = previous_full = None
    for i, text in enumerate(turns):
        r = respond(client, text, instructions="Be terse.", previous_response_id=previous and previous.id)
        assert r.status in ("completed", "incomplete") and r.output_text
        assert r.previous_response_id == (previous and previous.id)
        # The same conversation sent in full, nothing stored: the same greedy output; what it reuses is the prefix
        # cache's (the previous full request's prompt at least), not the stored response's state.
        history.append({"role": "user", "content": text})
        full = respond(client, history, instructions="Be terse.", store=False)
        assert full.output_text == r.output_text
        assert full.usage.input_tokens == r.usage.input_tokens
        full_cached = full.usage.input_tokens_details.cached_tokens
        assert full_cached == 0 if previous_full is None else full_cached >= previous_full.usage.input_tokens
        previous_full = full
        cached = r.usage.input_tokens_details.cached_tokens
        if i == 0:
            assert cached == 0
        else:
            # The whole history: the previous prompt and reply (all but its last sampled token, never fed).
            prev = previous.usage
            assert cached == prev.input_tokens + prev.output_tokens - 1 < r.usage.input_tokens
        history.append({"role": "assistant", "content": r.output_text})
        previous = r
    assert client.responses.retrieve(previous.id).output_text == previous.output_text


def test_continuing_reuses_the_state_even_when_the_reply_text_does_not_encode_back():
    """A random checkpoint writes bytes that are not UTF-8: its reply's text does not encode back
    to its tokens. A continuation still extends the stored tokens, so the whole history is cached."""
    srv = serve(TINY_CHECKPOINT, "kvfree-default", max_sessions=4)
    try:
        client = srv.openai()
        kw = {"model": "kvfree-default", "instructions": "Be brief.", "max_output_tokens": 12, "temperature": 0}
        first = client.responses.create(input="Hi", **kw)
        tok = srv.app.state.kvfree.tokenizer
        reply_ids = srv.app.state.kvfree.responses._items[first.id].turn.tokens[first.usage.input_tokens :]
        assert tok.encode(tok.decode(reply_ids)) != reply_ids  # the text path could not have reused the state
        second = client.responses.create(input="More", previous_response_id=first.id, **kw)
        assert second.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + len(reply_ids) - (
            first.status == "incomplete"
        )  # fmt: skip
    finally:
        srv.stop()


def test_other_instructions_prefill_the_whole_conversation_again(server):
    """The stored state holds the old instructions: with new ones nothing is reused, and the answer is that of the
    conversation sent in full with the new instructions."""
    client = server.openai()
    first = respond(client, "Hello there", instructions="Be terse.")
    r = respond(client, "And then?", instructions="Be kind.", previous_response_id=first.id)
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text}]
    full = respond(client, [*history, {"role": "user", "content": "And then?"}], instructions="Be kind.", store=False)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.output_text == full.output_text and r.usage.input_tokens == full.usage.input_tokens


def test_two_continuations_of_one_response_are_independent_forks(server):
    client = server.openai()
    first = respond(client, "Start here")
    a = respond(client, "Branch A", previous_response_id=first.id)
    b = respond(client, "Branch B", previous_response_id=first.id)
    a_again = respond(client, "Branch A", previous_response_id=first.id)
    assert a_again.output_text == a.output_text  # continuing B did not touch the state A continued from
    for branch, text in ((a, "Branch A"), (b, "Branch B")):
        history = [{"role": "user", "content": "Start here"}, {"role": "assistant", "content": first.output_text}]
        full = respond(client, [*history, {"role": "user", "content": text}], store=False)
        assert full.output_text == branch.output_text
        assert branch.usage.input_tokens_details.cached_tokens > 0
    # Each branch continues on its own.
    assert respond(client, "deeper", previous_response_id=b.id).usage.input_tokens_details.cached_tokens > 0


def test_store_false_keeps_nothing(server):
    client = server.openai()
    held = sessions_held(server)
    r = respond(client, "Forget me", store=False)
    assert r.store is False and sessions_held(server) == held
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    # A continuation that is not stored forks the previous state and drops the fork again.
    kept = respond(client, "Keep me")
    held = sessions_held(server)
    r = respond(client, "Then this", previous_response_id=kept.id, store=False)
    assert r.usage.input_tokens_details.cached_tokens > 0 and sessions_held(server) == held


def test_a_full_server_refuses_at_once_instead_of_queueing_forever(ckpts):
    """Stored responses hold sessions. When idle ones fill every slot and host memory, with no session store to
    spill to, nothing running could ever free a slot: a new request gets a 429 at once (it would wait forever
    otherwise), and deleting a stored response makes room again."""
    srv = serve(ckpts["tiny"], "kvfree-tiny", max_sessions=2, max_host_sessions=1)
    try:
        client = srv.openai()
        kept = [respond(client, f"turn {i}") for i in range(3)]  # two in slots, one moved to host memory
        with pytest.raises(openai.RateLimitError, match="no room for another session"):
            respond(client, "one more")  # a stored response needs a session
        with pytest.raises(openai.RateLimitError, match="no state slot free"):
            respond(client, "not stored", store=False)  # needs only a slot: none can be freed
        client.responses.delete(kept[0].id)
        assert respond(client, "room again").output_text
    finally:
        srv.stop()


def test_a_client_that_leaves_mid_stream_leaves_no_session_behind(server):
    """The stream's request is aborted and the session made for it (stored or forked) deleted once the engine lets
    go of it; nothing is stored."""
    base = sessions_held(server)
    kept = respond(server.openai(), "Keep me")
    held = sessions_held(server)
    assert held == base + 1
    # A reply that cannot end before the client leaves: a JSON list of at least 2,000 numbers, in at most 2,000
    # tokens (a sampled reply could end on <|im_end|> first, be stored, and keep its session: a flake seen in CI).
    endless = {"format": {"type": "json_schema", "name": "endless",
                          "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 2000}}}
    for extra in ({}, {"previous_response_id": kept.id}):
        body = {"input": "Talk for a long time", "stream": True, "max_output_tokens": 2000, "text": endless, **extra}
        with server.http() as http, http.stream("POST", "/v1/responses", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if "output_text.delta" in line)
        # closed mid-stream
        deadline = time.monotonic() + 30
        while sessions_held(server) != held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sessions_held(server) == held


def test_a_record_that_cannot_be_stored_is_a_503_and_leaves_nothing(ckpts, tmp_path):
    store = tmp_path / "store"
    srv = serve(ckpts["tiny"], "kvfree-tiny", max_sessions=4, session_store=str(store))
    try:
        (store / "records").write_text("a file where the records folder should be")
        held = sessions_held(srv)
        with srv.http() as http:
            r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert_openai_error(r, 503)
        assert sessions_held(srv) == held
    finally:
        srv.stop()


def test_unknown_deleted_and_foreign_responses_are_not_found(ckpts):
    srv = serve(ckpts["tiny"], "kvfree-tiny", env={"KVFREE_API_KEYS": "k1,k2"}, max_sessions=4)
    try:
        one, two = srv.openai(api_key="k1"), srv.openai(api_key="k2")
        r = respond(one, "mine")
        with srv.http() as http:
            for key, rid in (("k1", "resp_unknown"), ("k2", r.id)):  # unknown, and another key's
                headers = {"Authorization": f"Bearer {key}"}
                body = {"input": "x", "previous_response_id": rid}
                assert_openai_error(http.post("/v1/responses", json=body, headers=headers), 404, "previous_response_id")
                assert_openai_error(http.get(f"/v1/responses/{rid}", headers=headers), 404)
                assert_openai_error(http.delete(f"/v1/responses/{rid}", headers=headers), 404)
            assert_openai_error(http.post("/v1/responses", json={"input": "x"}), 401)
        with pytest.raises(openai.NotFoundError):
            respond(two, "yours?", previous_response_id=r.id)
        held = sessions_held(srv)
        one.responses.delete(r.id)
        assert sessions_held(srv) == held - 1  # its state is freed
        with pytest.raises(openai.NotFoundError):
            respond(one, "again", previous_response_id=r.id)
        with pytest.raises(openai.NotFoundError):
            one.responses.retrieve(r.id)
    finally:
        srv.stop()


# -- streams ------------------------------------------------------------------------------------------------------


def test_stream_events_in_the_order_the_sdk_expects(server):
    client = server.openai()
    first = respond(client, "Stream after this")
    kw = {"model": "kvfree-tiny", "temperature": 0, "max_output_tokens": 8, "previous_response_id": first.id}
    events = list(client.responses.create(input="go on", stream=True, **kw))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # 8 tokens: max_output_tokens reached
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == events[-2].item.status == "incomplete"  # the message the limit cut, as OpenAI
    assert final.output_text == "".join(deltas) == events[-4].text
    assert final.usage.input_tokens_details.cached_tokens > 0
    # The same request without a stream; the streamed response was stored too.
    assert respond(client, "go on", previous_response_id=first.id).output_text == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


# -- tools ----------------------------------------------------------------------------------------------------------


def test_tool_call_round_trip(tool_server):
    client = tool_server.openai()
    ask = {"model": "kvfree-tool", "tools": [WEATHER], "temperature": 0}
    r = client.responses.create(input="What is the weather in Paris?", **ask)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and r.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")

    # Streamed: the call's item, its arguments, done.
    events = list(client.responses.create(input="What is the weather in Paris?", stream=True, **ask))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    # The SDK's own accumulation of the stream (it needs `response.completed`: the model ended its turn).
    with client.responses.stream(input="What is the weather in Paris?", **ask) as stream:
        final = stream.get_final_response()
    assert [(i.type, i.name, i.arguments) for i in final.output] == [("function_call", call.name, call.arguments)]

    # The tool's result back, continuing the stored response: the model reads it after the stored call.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sky": "clear"})}
    after = client.responses.create(input=[result], previous_response_id=r.id, max_output_tokens=4, **ask)
    assert after.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    # The same turn sent in full (the call as an input item) renders the same prompt.
    full = client.responses.create(
        input=[{"role": "user", "content": "What is the weather in Paris?"}, call.model_dump(), result],
        store=False, max_output_tokens=4, **ask,
    )  # fmt: skip
    assert full.usage.input_tokens == after.usage.input_tokens
    assert [i.type for i in full.output] == [i.type for i in after.output]


# -- reasoning ------------------------------------------------------------------------------------------------------


def think(client: openai.OpenAI, input: Any = "Where is Paris?", **kw: Any):
    return client.responses.create(model="kvfree-thinking", input=input, temperature=0, **kw)


def test_a_thinking_model_returns_its_reasoning_as_a_reasoning_item_before_the_message(thinking_server):
    client = thinking_server.openai()
    r = think(client, reasoning={"effort": "low", "summary": "auto"}, include=["reasoning.encrypted_content"])
    assert r.status == "completed" and [item.type for item in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.id.startswith("rs_") and item.status == "completed"
    assert item.summary == [] and item.encrypted_content is None  # no summarizer, nothing encrypted
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", REASONING)]
    assert r.output_text == ANSWER  # the message holds the content only
    # The reply's tokens: <think>, two of reasoning, </think> | "\n\n", two of answer, <|im_end|>.
    assert r.usage.output_tokens == 8 and r.usage.output_tokens_details.reasoning_tokens == 4
    assert (r.reasoning.effort, r.reasoning.summary) == ("low", "auto")  # echoed
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()  # stored with its reasoning item


def test_a_streamed_thinking_reply_gives_the_reasoning_events_and_the_same_output(thinking_server):
    client = thinking_server.openai()
    events = list(think(client, stream=True, store=False))
    types = [e.type for e in events]
    reasoning = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    text = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning item, output_index 0
        "response.content_part.added",
        *["response.reasoning_text.delta"] * len(reasoning),
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the message, output_index 1
        "response.content_part.added",
        *["response.output_text.delta"] * len(text),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    rid = events[2].item.id
    for e in events[2:-1]:
        item_id = e.item.id if hasattr(e, "item") else e.item_id
        assert e.output_index == (0 if item_id == rid else 1), e
    assert events[3].part.type == "reasoning_text" and events[3 + len(reasoning) + 2].part.text == REASONING
    assert "".join(reasoning) == events[3 + len(reasoning) + 1].text == REASONING and "".join(text) == ANSWER
    final = events[-1].response
    plain = think(client, store=False)
    strip = {"id": True, "created_at": True, "output": {"__all__": {"id"}}}
    assert final.model_dump(exclude=strip) == plain.model_dump(exclude=strip)  # the same output and usage
    assert final.output[0].model_dump() == events[3 + len(reasoning) + 3].item.model_dump()
    # The SDK's own accumulation of the stream.
    with client.responses.stream(model="kvfree-thinking", input="Where is Paris?", temperature=0, store=False) as s:
        accumulated = s.get_final_response()
    assert [i.type for i in accumulated.output] == ["reasoning", "message"] and accumulated.output_text == ANSWER


def test_a_reply_cut_inside_its_reasoning_is_incomplete_and_all_reasoning(thinking_server):
    client = thinking_server.openai()
    r = think(client, max_output_tokens=2)  # <think>, "Paris is "
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(i.type, i.status, i.content[0].text) for i in r.output] == [("reasoning", "incomplete", "Paris is ")]
    assert r.output_text == "" and r.usage.output_tokens == r.usage.output_tokens_details.reasoning_tokens == 2
    streamed = list(think(client, max_output_tokens=2, stream=True, store=False))
    assert streamed[-1].type == "response.incomplete"
    assert [i.model_dump(exclude={"id"}) for i in streamed[-1].response.output] == [
        i.model_dump(exclude={"id"}) for i in r.output
    ]
    # The stored turn (all reasoning, no text) continues from its state.
    after = think(client, "Go on", previous_response_id=r.id, max_output_tokens=4)
    assert after.usage.input_tokens_details.cached_tokens == r.usage.input_tokens + 1  # all but the last


def test_reasoning_items_sent_back_in_input_render_the_turn_as_the_model_wrote_it(thinking_server):
    """The previous output sent back whole (its reasoning item included) is the same prompt as continuing the stored
    response, whose state holds the reply as sampled; without the reasoning item the prompt lacks it."""
    client = thinking_server.openai()
    first = think(client)
    then = {"role": "user", "content": "And Rome?"}
    continued = think(client, [then], previous_response_id=first.id, max_output_tokens=1)
    assert continued.usage.input_tokens_details.cached_tokens == first.usage.input_tokens + 7  # all but <|im_end|>
    ask = {"role": "user", "content": "Where is Paris?"}
    full = think(client, [ask, *(i.model_dump() for i in first.output), then], store=False, max_output_tokens=1)
    assert full.usage.input_tokens == continued.usage.input_tokens
    bare = think(client, [ask, first.output[1].model_dump(), then], store=False, max_output_tokens=1)
    assert bare.usage.input_tokens == full.usage.input_tokens - 5  # <think>, two of reasoning, </think>, "\n\n"


def test_reasoning_items_become_the_reasoning_of_the_assistant_turn_they_precede():
    def item(text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}

    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}
    body = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "q"}, item("a"), call, {"type": "function_call_output", "call_id": "call_1",
        "output": "r"}, item("b"), {"role": "assistant", "content": "x"}, item("c"),
    ]})  # fmt: skip
    messages = body.input_messages()
    assert [type(m) for m in messages] == [UserMessage, AssistantMessage, ToolMessage, AssistantMessage,
                                           AssistantMessage]  # fmt: skip
    assert [(m.reasoning_content, m.content) for m in messages if isinstance(m, AssistantMessage)] == [
        ("a", None), ("b", "x"), ("c", "")  # the last: a turn that was all reasoning
    ]
    assert messages[1].tool_calls[0].id == "call_1"


def test_the_output_builder_puts_tool_calls_after_the_reasoning_and_leaves_tagless_models_alone():
    reply = f"<think>I should call.</think>\n\nLet me check.<tool_call>{TOOL_CALL_TEXT}</tool_call>"
    builder = OutputBuilder(ToolCallFormat("<tool_call>", "</tool_call>"), None, THINK)
    events = [e for i in range(0, len(reply), 3) for e in builder.feed(reply[i : i + 3])] + builder.finish()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [i.type for i in builder.items] == ["reasoning", "message", "function_call"]
    assert [i.output_index for i in events if i.type == "response.output_item.done"] == [0, 1, 2]
    assert builder.items[0].content[0].text == "I should call." and builder.items[2].name == "get_weather"
    reply_message = builder.assistant_message()
    assert (reply_message.reasoning_content, reply_message.content) == ("I should call.", "Let me check.")
    # No reasoning tags declared: the text is the message's, tags and all.
    plain = OutputBuilder(None, None)
    plain.feed("<think>a</think>\n\nb")
    plain.finish()
    assert [(i.type, i.content[0].text) for i in plain.items] == [("message", "<think>a</think>\n\nb")]


def test_reasoning_tokens_are_the_sampled_tokens_through_the_one_that_completes_the_end_tag():
    tok = Tokenizer(TINY_CHECKPOINT)  # byte-level: a tag is several tokens
    cases = [  # reply, finish reason, reasoning tokens
        (" <think>ab</think>\n\ncd", "stop", len(" <think>ab</think>")),
        ("<think>abc", "length", len("<think>abc")),  # cut inside: all of it
        ("<thi", "length", 0),  # never shown to open the block
        ("no thinking", "stop", 0),
    ]
    for reply, finish, expected in cases:
        ids = tok.encode(reply)
        for step in (1, 3, len(ids)):  # however the engine's outputs batch the tokens
            counter = ReasoningTokens(tok, THINK, skip_special_tokens=True)
            for i in range(0, len(ids), step):
                counter.add(ids[i : i + step])
            assert counter.count(finish) == expected, (reply, step)


def test_a_model_without_reasoning_tags_has_no_reasoning_item(server):
    r = respond(server.openai(), "Hello there")
    assert {item.type for item in r.output} == {"message"} and r.usage.output_tokens_details.reasoning_tokens == 0


# -- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"$dynamicRef": "#a"}}}},
         "text.format"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"input": [{"type": "image", "url": "x"}]}, None),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({"input": "x", "reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "content": []}]}, "input[0].summary"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "output_text",
                                                                                   "text": "x"}]}]},
         "input[0].content[0].type"),
    ],
)
def test_bad_requests_get_clear_errors(server, body, param):
    with server.http() as http:
        r = http.post("/v1/responses", json=body)
    error = assert_openai_error(r, 404 if param == "model" else 400)
    if param is not None:
        assert error["param"] == param, error


# -- the record store -------------------------------------------------------------------------------------------


def test_response_records_round_trip_through_a_session_store(tmp_path):
    """Records written to a directory store read back whole after the memory cache dropped them; owners stay
    apart; a deleted record is gone from both."""
    body = ResponsesRequest.model_validate({"input": "hi", "tools": [WEATHER], "metadata": {"k": "v"}})
    records = ResponseStore(DirectoryStore(tmp_path, "fp"), max_cached=2)

    def stored(owner: str) -> StoredResponse:
        response = response_object(body, response_id(), "m", 1.0, [], "completed")
        return StoredResponse(response, owner, "sess_x", [UserMessage(role="user", content="hi")])

    async def run() -> None:
        first, *rest = [stored("k1") for _ in range(3)]
        for s in (first, *rest):
            await records.put(s)
        assert len(records) == 2  # the oldest left the cache, not the store
        again = await records.get(first.response.id, "k1")
        assert again.response.model_dump() == first.response.model_dump() and again.messages == first.messages
        assert again.session_id == "sess_x" and again.owner == "k1"
        for owner, rid in (("k2", first.response.id), ("k1", "resp_" + "0" * 32), ("k1", "../../etc")):
            with pytest.raises(APIError) as err:
                await records.get(rid, owner)
            assert err.value.status == 404
        await records.pop(first.response.id, "k1")
        fresh = ResponseStore(DirectoryStore(tmp_path, "fp"))  # another replica, or this one restarted
        assert (await fresh.get(rest[0].response.id, "k1")).response.model_dump() == rest[0].response.model_dump()
        with pytest.raises(APIError) as err:
            await fresh.get(first.response.id, "k1")
        assert err.value.status == 404

    asyncio.run(run())
