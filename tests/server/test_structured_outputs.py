"""Structured outputs: tool calls and JSON valid by construction, with the embedded model and schemas it never saw.

The grammar engine (llguidance, engine/text/grammar.py) is checked on its own against both kinds of tokenizer, then
through `LLM` (free rows beside constrained ones keep their tokens, property-based schemas always validate), then
over HTTP with the official SDK: `tool_choice` required, named, auto and streamed, `response_format`, the Responses
API's `text.format`, vLLM's `structured_outputs`, sessions, and `max_tokens` cutting a constrained reply.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfree.checkpoints import default_checkpoint_path
from kvfree.engine.core.scheduler import Request, Scheduler
from kvfree.engine.core.stepper import Stepper
from kvfree.engine.llm import LLM
from kvfree.engine.protocol import Grammar, GrammarError, SamplingParams
from kvfree.engine.sessions.manager import SessionManager
from kvfree.engine.text.grammar import GrammarCompiler, bitmask_to_bool, fill_masks
from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.server.protocol import ChatTool
from kvfree.server.structured_outputs import tool_call_grammar
from kvfree.server.tools import ToolCallFormat
from tests.paths import TINY_CHECKPOINT
from tests.server_fixtures import assert_openai_error, serve

DEFAULT = default_checkpoint_path()
MODEL = "kvfree-default"

# Tools written for these tests (none is among the embedded model's 42 training schemas). Every string is bounded,
# so a weak model's reply always ends inside max_tokens.
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "schedule_meeting", "description": "Put a meeting in the calendar.",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 30},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
            "minutes": {"type": "integer", "minimum": 15, "maximum": 240},
        }, "required": ["title", "minutes"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_thermostat", "description": "Set a room's temperature.",
        "parameters": {"type": "object", "properties": {
            "room": {"type": "string", "enum": ["kitchen", "office", "bedroom"]},
            "celsius": {"type": "number", "minimum": 10, "maximum": 30},
        }, "required": ["room", "celsius"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "lookup_order", "description": "Find an order by its id.",
        "parameters": {"type": "object", "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        }, "required": ["order_id"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "log_expense", "description": "Record an expense.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number", "minimum": 0, "maximum": 10000},
            "category": {"$ref": "#/$defs/category"},
            "note": {"type": "string", "maxLength": 24},
        }, "required": ["amount", "category"], "additionalProperties": False,
            "$defs": {"category": {"type": "string", "enum": ["travel", "food", "office"]}}}}},
    {"type": "function", "function": {
        "name": "translate_text", "description": "Translate a short text.",
        "parameters": {"type": "object", "properties": {
            "text": {"type": "string", "maxLength": 40},
            "target": {"type": "string", "enum": ["fr", "de", "ja"]},
        }, "required": ["text", "target"], "additionalProperties": False}}},
]  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
PROMPTS = [
    "Set up a 30 minute meeting called Budget review with Ana and Li.",
    "Make the office 21 degrees please.",
    "Where is my order ABC-1234?",
    "I spent 42.50 on lunch with a client.",
    "How do you say good morning in Japanese?",
]
PLACE = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "capital"],
    "additionalProperties": False,
}


def check_calls(calls: list[Any], names: set[str] | None = None) -> None:
    """Each call names one of the tools (of `names`) and its arguments validate against that tool's schema."""
    assert calls, "no tool call"
    for call in calls:
        name, arguments = call.function.name, json.loads(call.function.arguments)
        assert name in (names or SCHEMAS), name
        jsonschema.validate(arguments, SCHEMAS[name])


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server():
    srv = serve(DEFAULT, MODEL, max_sessions=16)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEFAULT, device="cpu", max_sessions=16)


# -- the grammar engine -------------------------------------------------------------------------------------------


def _accepts(compiler: GrammarCompiler, grammar: Grammar, text: str) -> bool:
    matcher = compiler.compile(grammar)
    return all(matcher.consume(t) for t in compiler.tokenizer.encode(text)) and matcher.accepting


@pytest.mark.parametrize("checkpoint", [DEFAULT, TINY_CHECKPOINT], ids=["hf-bpe-49k", "byte-level"])
def test_each_grammar_kind_accepts_what_it_describes_and_nothing_else(checkpoint) -> None:
    compiler = GrammarCompiler(Tokenizer(checkpoint))
    cases = [
        (Grammar.json_schema(PLACE), '{"city": "Oslo", "country": "Norway", "capital": true}',
         '{"city": "Oslo", "capital": true}'),
        (Grammar("json_object"), '{"a": [1, 2], "b": null}', "[1, 2]"),
        (Grammar("regex", r"[A-Z]{3}-\d{4}"), "ABC-1234", "ABC-12345"),
        (Grammar.choice(["red", "green"]), "green", "blue"),
        (Grammar("lark", 'start: "yes" | "no" NUM\nNUM: /[0-9]+/'), "no42", "no"),
        (Grammar("lark", 'root ::= "a" [0-9]+'), "a17", "b17"),  # GBNF, converted
    ]  # fmt: skip
    for grammar, good, bad in cases:
        assert _accepts(compiler, grammar, good), (grammar.kind, good)
        assert not _accepts(compiler, grammar, bad), (grammar.kind, bad)


@pytest.mark.parametrize("checkpoint", [DEFAULT, TINY_CHECKPOINT], ids=["text-tags", "special-token-tags"])
def test_tool_call_grammars_admit_valid_calls_only(checkpoint) -> None:
    tok = Tokenizer(checkpoint)
    compiler, fmt = GrammarCompiler(tok), ToolCallFormat.from_tokenizer_config(tok.config)
    tools = [ChatTool.model_validate(t) for t in TOOLS]
    call = '<tool_call>{"name": "log_expense", "arguments": {"amount": 12, "category": "food"}}</tool_call>'
    bad_args = '<tool_call>{"name": "log_expense", "arguments": {"amount": 12, "category": "toys"}}</tool_call>'
    unknown = '<tool_call>{"name": "send_email", "arguments": {}}</tool_call>'
    required = tool_call_grammar(tools, "required", True, fmt, tok)
    assert _accepts(compiler, required, call) and _accepts(compiler, required, call + "\n" + call)
    assert not _accepts(compiler, required, "I cannot do that.")
    assert not _accepts(compiler, required, bad_args) and not _accepts(compiler, required, unknown)
    single = tool_call_grammar(tools, "required", False, fmt, tok)
    assert _accepts(compiler, single, call) and not _accepts(compiler, single, call + call)
    auto = tool_call_grammar(tools, "auto", True, fmt, tok)
    assert _accepts(compiler, auto, "Sure, noted.") and _accepts(compiler, auto, "Noted. " + call)
    assert not _accepts(compiler, auto, "Noted. " + bad_args)
    with_json = tool_call_grammar(tools, "auto", True, fmt, tok, Grammar.json_schema(PLACE))
    assert _accepts(compiler, with_json, '{"city": "Oslo", "country": "Norway", "capital": true}')
    assert _accepts(compiler, with_json, call) and not _accepts(compiler, with_json, "Sure.")


def test_bad_grammars_raise_grammar_errors_that_say_what_is_wrong() -> None:
    compiler = GrammarCompiler(Tokenizer(TINY_CHECKPOINT))
    for grammar, words in [
        (Grammar("regex", "a("), "unclosed group"),
        (Grammar.json_schema({"$dynamicRef": "#x"}), "$dynamicRef"),
        (Grammar.json_schema({"type": "string", "format": "idn-email"}), "idn-email"),
        (Grammar("lark", "start: undefined_rule"), "undefined_rule"),
        (Grammar("json_schema", "{not json"), "not valid JSON"),
        (Grammar("choice", "[]"), "non-empty"),
    ]:
        with pytest.raises(GrammarError, match=None) as info:
            compiler.compile(grammar)
        assert words in str(info.value) and "\n" not in str(info.value)


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher() -> None:
    compiler = GrammarCompiler(Tokenizer(TINY_CHECKPOINT))
    grammar = Grammar.choice(["ab", "ac"])
    first, second = compiler.compile(grammar), compiler.compile(Grammar.choice(["ab", "ac"]))
    assert len(compiler._cache) == 1
    tok = compiler.tokenizer
    assert first.consume(tok.encode("a")[0]) and first.consume(tok.encode("b")[0]) and first.stopped
    assert not second.stopped and second.consume(tok.encode("a")[0]) and second.consume(tok.encode("c")[0])


def test_masks_allow_the_end_only_where_the_grammar_is_complete() -> None:
    # The request's end tokens: the tokenizer's EOS (<|im_end|>, which llguidance knows), and two stop tokens it does
    # not, <|endoftext|> (0) and "/" (31: bit 31 of its word, the sign bit of an int32).
    tok = Tokenizer(DEFAULT)
    compiler, vocab = GrammarCompiler(tok), tok.vocab_size
    ends = SamplingParams(stop_token_ids=[0, 31]).end_token_ids(tok.eos_token_id)
    matcher = compiler.compile(Grammar("regex", "[0-9]{1,3}"))

    def allowed() -> torch.Tensor:
        masks = torch.full((3, (vocab + 31) // 32), 7, dtype=torch.int32)  # rows 0 and 2: not written
        fill_masks([matcher], [ends], masks, [1])
        assert (masks[0] == 7).all() and (masks[2] == 7).all()
        return bitmask_to_bool(masks, vocab)[1]

    first = allowed()
    assert not any(first[t] for t in ends)  # nothing written yet: no end
    digits = [i for i in range(vocab) if first[i]]
    assert digits and all(tok.token_bytes(i).isdigit() for i in digits)
    assert matcher.consume(tok.encode("7")[0])
    after = allowed()
    assert all(after[t] for t in ends) and after[tok.encode("1")[0]] and not after[tok.encode("a")[0]]


# -- through the engine -------------------------------------------------------------------------------------------


def test_free_rows_get_the_same_tokens_beside_constrained_ones(llm: LLM) -> None:
    free = [("Once upon a time", SamplingParams(max_tokens=24, temperature=0)),
            ("The ship sailed", SamplingParams(max_tokens=24, temperature=0.9, seed=7))]  # fmt: skip
    constrained = [
        (f"<|im_start|>user\nA city as JSON, {i}<|im_end|>\n<|im_start|>assistant\n",
         SamplingParams(max_tokens=60, temperature=0.8, seed=i, grammar=Grammar.json_schema(PLACE)))
        for i in range(3)
    ]  # fmt: skip
    alone = llm.generate([p for p, _ in free], [s for _, s in free])
    mixed = llm.generate([p for p, _ in constrained + free], [s for _, s in constrained + free])
    assert [o.token_ids for o in mixed[3:]] == [o.token_ids for o in alone]
    for out in mixed[:3]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PLACE)


def test_the_overlapped_step_reads_a_rows_token_before_its_next_mask(llm: LLM) -> None:
    # With overlap the next step is launched before the previous one's tokens are read; a constrained row's step is
    # then split (forward, read, mask, sample). Same tokens as the plain step, and valid JSON.
    def run(overlap: bool) -> list[list[int]]:
        sessions = SessionManager(llm.pool, fingerprint="offline", max_host_sessions=0)
        engine = Stepper(Scheduler(sessions, llm.tokenizer, grammars=llm.grammars), llm.runner, overlap=overlap)
        outputs: list[Any] = []
        prompts = ["<|im_start|>user\nGive a city as JSON<|im_end|>\n<|im_start|>assistant\n", "Once upon a time"]
        grammars = [Grammar.json_schema(PLACE), None]
        for i, (prompt, grammar) in enumerate(zip(prompts, grammars, strict=True)):
            params = SamplingParams(max_tokens=40, temperature=0.7, seed=3, grammar=grammar)
            engine.scheduler.add(Request(f"r{i}", llm.tokenizer.encode(prompt), params))
        while engine.has_work:
            outputs += [out for _, out in engine.step()]
        tokens: dict[str, list[int]] = {"r0": [], "r1": []}
        for out in outputs:
            tokens[out.request_id] += out.token_ids
        return [tokens["r0"], tokens["r1"]]

    plain, overlapped = run(False), run(True)
    assert overlapped == plain
    jsonschema.validate(json.loads(llm.tokenizer.decode(plain[0])), PLACE)


def test_n_choices_each_follow_the_grammar(llm: LLM) -> None:
    req_prompt = "<|im_start|>user\nPick a colour<|im_end|>\n<|im_start|>assistant\n"
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, grammar=Grammar.choice(["red", "green", "blue"]))
    outputs = llm.generate([req_prompt] * 6, [params] * 6)
    assert all(o.text in ("red", "green", "blue") and o.finish_reason == "stop" for o in outputs)


def test_a_logit_bias_cannot_push_the_end_before_the_grammar_allows_it(llm: LLM) -> None:
    eos = llm.tokenizer.eos_token_id
    params = SamplingParams(max_tokens=60, temperature=0, logit_bias={eos: 100.0}, grammar=Grammar.json_schema(PLACE))
    out = llm.generate(["A city:"], params)[0]
    jsonschema.validate(json.loads(out.text), PLACE)


def test_an_engine_refuses_a_grammar_it_cannot_compile(llm: LLM) -> None:
    with pytest.raises(GrammarError, match="unclosed group"):
        llm.generate(["x"], SamplingParams(grammar=Grammar("regex", "a(")))


def _schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Object schemas of bounded leaves (strings with maxLength, bounded integers, enums, booleans, small arrays).

    Not unbounded numbers: JSON lets a number run on (`19.5000...`), and a weak model sometimes does, until
    max_tokens. Fractions are covered by the fixed schemas above."""
    leaf = st.one_of(
        st.integers(1, 12).map(lambda n: {"type": "string", "maxLength": n}),
        st.tuples(st.integers(-50, 0), st.integers(1, 500)).map(
            lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
        st.just({"type": "boolean"}),
        st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
            lambda options: {"enum": options}),
    )  # fmt: skip
    value = st.one_of(leaf, leaf.map(lambda item: {"type": "array", "items": item, "maxItems": 3}))
    names = st.text("abcdefghij_", min_size=1, max_size=8)
    return st.dictionaries(names, value, min_size=1, max_size=4).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))  # fmt: skip


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas(), seed=st.integers(0, 2**16))
def test_every_reply_validates_against_a_generated_schema(llm: LLM, schema: dict[str, Any], seed: int) -> None:
    prompt = "<|im_start|>user\nFill in this form as JSON<|im_end|>\n<|im_start|>assistant\n"
    params = [SamplingParams(max_tokens=200, temperature=t, seed=seed, grammar=Grammar.json_schema(schema))
              for t in (0.0, 1.0, 1.5)]  # fmt: skip
    for out in llm.generate([prompt] * len(params), params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


# -- over HTTP, with the official SDK -------------------------------------------------------------------------------


def test_required_calls_are_valid_for_their_schemas(server) -> None:
    client = server.openai()
    for i, prompt in enumerate(PROMPTS):
        r = client.chat.completions.create(
            model=MODEL, messages=user(prompt), tools=TOOLS, tool_choice="required", temperature=0.8, seed=i,
            max_tokens=160,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls)


def test_a_named_function_is_the_one_called(server) -> None:
    client = server.openai()
    for name in ("set_thermostat", "lookup_order", "log_expense"):
        choice = {"type": "function", "function": {"name": name}}
        r = client.chat.completions.create(
            model=MODEL, messages=user(PROMPTS[0]), tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=160
        )
        check_calls(r.choices[0].message.tool_calls, {name})


def test_auto_answers_in_text_or_in_valid_calls(server) -> None:
    client = server.openai()
    kinds = set()
    for i, prompt in enumerate(PROMPTS * 2):
        r = client.chat.completions.create(
            model=MODEL, messages=user(prompt), tools=TOOLS, temperature=1.0, seed=i, max_tokens=160
        )
        message = r.choices[0].message
        if message.tool_calls:
            kinds.add("call")
            check_calls(message.tool_calls)
            assert r.choices[0].finish_reason == "tool_calls"
        else:
            kinds.add("text")
            assert "<tool_call>" not in (message.content or "")
    assert "call" in kinds  # (the embedded model calls tools when it is shown some)


def test_streamed_calls_are_valid_and_one_when_parallel_calls_are_off(server) -> None:
    client = server.openai()
    for parallel in (True, False):
        stream = client.chat.completions.create(
            model=MODEL, messages=user(PROMPTS[3]), tools=TOOLS, tool_choice="required", temperature=0.9, seed=11,
            max_tokens=200, stream=True, parallel_tool_calls=parallel,
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for chunk in stream:
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and calls
        assert parallel or len(calls) == 1
        for entry in calls.values():
            jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])


def test_a_constrained_reply_cut_by_max_tokens_has_no_half_parsed_call(server) -> None:
    client = server.openai()
    r = client.chat.completions.create(
        model=MODEL, messages=user(PROMPTS[1]), tools=TOOLS, tool_choice="required", temperature=0, max_tokens=6
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith("<tool_call>")


def test_json_schema_and_json_object_replies_validate(server) -> None:
    client = server.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=user("Name a city as JSON."), response_format=fmt, n=3, temperature=1.0, seed=2,
        max_tokens=120,
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PLACE)
    r = client.chat.completions.create(
        model=MODEL, messages=user("Any JSON object."), response_format={"type": "json_object"}, temperature=0,
        max_tokens=120,
    )
    # (An object with free-form strings may run to max_tokens; whatever was written is an object's beginning.)
    assert r.choices[0].message.content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_responses_text_format_and_completions_structured_outputs(server) -> None:
    client = server.openai()
    resp = client.responses.create(
        model=MODEL, input="Name a city as JSON.", temperature=0, max_output_tokens=120,
        text={"format": {"type": "json_schema", "name": "place", "schema": PLACE}},
    )  # fmt: skip
    jsonschema.validate(json.loads(resp.output_text), PLACE)
    assert resp.text.format.type == "json_schema"
    for field, check in [
        ({"choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
        ({"regex": "[0-9]{4}-[0-9]{2}"}, lambda text: len(text) == 7 and text[4] == "-"),
        ({"json": {"type": "array", "items": {"type": "integer", "maximum": 99}, "maxItems": 3}},
         lambda text: all(isinstance(v, int) for v in json.loads(text))),
        ({"grammar": 'start: "a" DIGITS\nDIGITS: /[0-9]{2}/'}, lambda text: text[0] == "a" and text[1:].isdigit()),
    ]:  # fmt: skip
        r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=0.5, seed=1,
                                      extra_body={"structured_outputs": field})  # fmt: skip
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), (field, r.choices[0].text)


def test_a_constrained_turn_continues_a_session(server) -> None:
    client = server.openai()
    fmt = {"format": {"type": "json_schema", "name": "place", "schema": PLACE}}
    first = client.responses.create(model=MODEL, input="Name a city as JSON.", text=fmt, temperature=0,
                                    max_output_tokens=120)  # fmt: skip
    jsonschema.validate(json.loads(first.output_text), PLACE)
    # The next turn continues the stored state of the first (its own tokens, whatever their spelling): only the new
    # input is prefilled, and the reply is held to the schema again.
    second = client.responses.create(model=MODEL, input="Another one.", previous_response_id=first.id, text=fmt,
                                     temperature=0, max_output_tokens=120)  # fmt: skip
    jsonschema.validate(json.loads(second.output_text), PLACE)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # A chat session too (it starts over when the client's history spells the reply in other tokens).
    session = server.http().post("/v1/sessions", json={}).json()["id"]
    chat_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}}
    r = client.chat.completions.create(model=MODEL, messages=user("Name a city as JSON."), temperature=0,
                                       response_format=chat_format, max_tokens=120,
                                       extra_body={"session_id": session})  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].message.content), PLACE)
    assert server.http().get(f"/v1/sessions/{session}").json()["num_tokens"] >= r.usage.prompt_tokens


def test_grammar_errors_are_400s_naming_the_field(server) -> None:
    http = server.http()
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"$dynamicRef": "#x"}}}
    cases = [
        ("/v1/chat/completions", {"messages": user("x"), "tools": [bad_tool], "tool_choice": "required"}, "tools"),
        ("/v1/chat/completions", {"messages": user("x"), "structured_outputs": {"grammar": "start: nope"}},
         "structured_outputs"),
        ("/v1/chat/completions", {"messages": user("x"), "tools": TOOLS, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format"),
        ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                                                            "schema": {"type": "nope"}}}}, "text.format"),
    ]  # fmt: skip
    for path, body, param in cases:
        r = http.post(path, json={"model": MODEL, **body})
        assert_openai_error(r, 400, param=param)
    # A special token this vocabulary lacks: only compiling for the model's tokenizer (in the engine) finds it.
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                           "structured_outputs": {"grammar": "start: <|no_such_token|>"}})
    assert "no_such_token" in assert_openai_error(r, 400, param=None)["message"]
    # The server still serves afterwards.
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_random_byte_level_model_writes_valid_calls_under_required(tmp_path) -> None:
    srv = serve(TINY_CHECKPOINT, "tiny", max_sessions=4)
    try:
        r = srv.openai().chat.completions.create(
            model="tiny", messages=user("Order?"), tools=TOOLS[2:3], tool_choice="required", temperature=1.0,
            seed=1, max_tokens=120,
        )
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls, {"lookup_order"})
    finally:
        srv.stop()


def test_masks_are_applied_on_the_device_rows_they_belong_to() -> None:
    # (The sampler's part, without a model: the masked row can only pick an allowed token, the other is untouched.)
    from kvfree.engine.core.sampling import SamplingRows, sample

    logits = torch.randn(2, 70)
    masks = torch.zeros(1, 3, dtype=torch.int32)
    masks[0, 1] = 1 << 5  # token 37 only
    rows = SamplingRows.build([SamplingParams(temperature=0)] * 2, [0, 0], [0, 0], 70)
    rows.allowed = (torch.tensor([1]), masks)
    out = sample(logits, rows)
    assert out.token_ids.tolist() == [int(logits[0].argmax()), 37]
    # A mask for every row (the sampler graphs' form): the free row's all bits set.
    rows.allowed = (None, torch.cat([torch.full((1, 3), -1, dtype=torch.int32), masks]))
    assert sample(logits, rows).token_ids.tolist() == [int(logits[0].argmax()), 37]
