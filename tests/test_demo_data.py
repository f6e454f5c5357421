"""The `kvfree-demo` prompt generator and evaluation harness (training/demo_data.py, training/demo_eval.py).

The generator is deterministic for a seed and keeps the evaluation split's names (verbs, nouns, argument, object and
enum names, enum options, result fields, text subjects) and recall answers out of the training split; values come
from the same generators in both splits, made-up words and, from a `ValueRandom`, real words half the time (never a
recall answer of the evaluation); every tool example's expected call is valid for its schema and stated in its
request; the scorer tells a right call from a wrong one; and the harness runs through a real server: tool calls
through chat completions (the "bigram" test checkpoint always calls `get_weather` for Paris), recall through a
prefilled session.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import asdict
from typing import Any

import jsonschema
import pytest
import torch
from openai.types.chat import ChatCompletionMessageToolCall
from openai.types.chat.chat_completion_message_tool_call import Function

from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.training import demo_data
from kvfree.training.demo_data import (
    ACK,
    SKILLS,
    Example,
    call_text,
    example,
    examples,
    make_schema,
    recall_example,
    target_reply,
    tool_example,
    tool_turn,
)
from kvfree.training.demo_eval import evaluate_recall, evaluate_tools, score_tool_reply
from tests.paths import TINY_CHECKPOINT
from tests.server_fixtures import make_checkpoint, make_tool_checkpoint, serve

pytestmark = pytest.mark.usefixtures("one_thread")  # small ops (a tiny teacher's generation): see conftest.py

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}


def _call_of(ex: Example) -> dict[str, Any]:
    """A tools example's call `{"name", "arguments"}`: its expected value for a lone call, the target assistant turn's
    call for one carried on to its result (`tool_turn`, whose expected value is the result's)."""
    if ex.target_turns:
        (turn,) = ex.target_turns
        (call,) = ex.messages[turn]["tool_calls"]
        return call["function"]
    return ex.expected


def _argument_names(schema: dict[str, Any]) -> set[str]:
    """Every property name of an object schema, those of nested objects included."""
    names = set()
    for name, sub in schema.get("properties", {}).items():
        names.add(name)
        names |= _argument_names(sub)
    return names


def _bank_argument_names(split: str) -> set[str]:
    return set(demo_data._ARGS[split]) | set(demo_data._ENUMS[split]) | set(demo_data._OBJECTS[split])


def _stated(name: str, value: Any) -> list[str]:
    """How a request must state an argument: its name in words and the value (a nested object's fields each so;
    booleans as yes/no)."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _stated(k, v)]
    said = ("yes" if value else "no") if isinstance(value, bool) else str(value)
    return [f"{name.replace('_', ' ')} {said}"]


def test_examples_are_deterministic_for_a_seed():
    """The same seed gives the same examples (a fresh generator each call), another seed others; every skill is in."""
    a = [asdict(e) for e in examples("train", 7, 40)]
    assert a == [asdict(e) for e in examples("train", 7, 40)]
    assert a != [asdict(e) for e in examples("train", 8, 40)]
    assert {e["skill"] for e in a} == set(SKILLS)
    assert [asdict(e) for e in examples("eval", 7, 8)] == [asdict(e) for e in examples("eval", 7, 8)]
    one = [asdict(example(random.Random(s), "train", skill)) for s in range(4) for skill in SKILLS]
    assert one == [asdict(example(random.Random(s), "train", skill)) for s in range(4) for skill in SKILLS]
    with pytest.raises(ValueError, match="skill"):
        example(random.Random(0), "train", "poetry")


NAME_BANKS = ("_VERBS", "_NOUNS", "_ARGS", "_OBJECTS", "_ENUMS")  # argument, object and enum banks: names -> ...


def _name_words(split: str, banks: tuple[str, ...] = NAME_BANKS) -> dict[str, set[str]]:
    """Each word (names split at "_" and " ") of `split`'s verbs, nouns and argument, object and enum names -> the
    names it is a word of."""
    words: dict[str, set[str]] = {}
    for bank in banks:
        for name in getattr(demo_data, bank)[split]:
            for word in re.split(r"[_ ]", name):
                words.setdefault(word, set()).add(name)
    return words


def test_the_word_banks_of_the_two_splits_are_disjoint():
    """Verbs, nouns, argument names (enums and nested objects included), enum options, tool-result fields and text
    subjects: the evaluation split's never occur in the training split's banks. Every evaluation argument draws its
    values from a kind of value training draws too (held-out schemas differ in their names, not their values)."""
    for bank in ("_VERBS", "_NOUNS", "_TEXT_SUBJECTS", "_RESULT_FIELDS"):
        train, held = getattr(demo_data, bank)["train"], getattr(demo_data, bank)["eval"]
        assert train and held and not set(train) & set(held), bank
    assert not _bank_argument_names("train") & _bank_argument_names("eval")
    options = {s: {o for opts in demo_data._ENUMS[s].values() for o in opts} for s in ("train", "eval")}
    assert not options["train"] & options["eval"]
    assert set(demo_data._ARGS["eval"].values()) <= set(demo_data._ARGS["train"].values())


def test_no_evaluation_verb_or_noun_shares_a_word_with_a_training_name():
    """Held-out verbs, nouns, object names and enum names share no word (split at "_" and " ") with any training verb,
    noun or argument, object or enum name, nor with a training enum option: a held-out function's name cannot be
    half read from training."""
    train = set(_name_words("train")) | {o for opts in demo_data._ENUMS["train"].values() for o in opts}
    held = _name_words("eval", ("_VERBS", "_NOUNS", "_OBJECTS", "_ENUMS"))
    assert held and not {w: sorted(held[w]) for w in set(held) & train}


def test_evaluation_argument_names_are_new_though_some_share_a_word_with_training_ones():
    """Held-out argument names are never training ones, but some share a word (`vessel_name` and `guest_name`:
    "name"); the shared words are these, no more (the second run was scored with them: BENCHMARKS.md)."""
    train, held = _name_words("train"), _name_words("eval")
    assert set(train) & set(held) == {"name", "count", "code", "email", "note", "weight", "year", "guest"}


def test_evaluation_words_never_reach_the_training_split():
    """Over hundreds of generated examples (lone calls, calls with their results, chat with unrelated tools): every
    function shown is `verb_noun` of its own split's banks and every argument name (nested fields included) is its
    split's; recall answers of the two splits are disjoint, and training's are made up afresh; text openers' subjects
    differ; an unknown split is refused."""
    verbs = {s: set(demo_data._VERBS[s]) for s in ("train", "eval")}
    nouns = {s: {n.replace(" ", "_") for n in demo_data._NOUNS[s]} for s in ("train", "eval")}
    for split, other in (("train", "eval"), ("eval", "train")):
        cases = examples(split, 0, 300, skills=("tools",)) + examples(split, 1, 120, skills=("chat",))
        if split == "train":
            assert sum(any(m["role"] == "tool" for m in ex.messages) for ex in cases) > 30  # tool_turn is in
        tools = [t["function"] for ex in cases for t in ex.tools or []]
        assert len(tools) > 500
        for fn in tools:
            verb, noun = fn["name"].split("_", 1)
            assert verb in verbs[split] and noun in nouns[split], fn["name"]
            assert verb not in verbs[other] and noun not in nouns[other], fn["name"]
            names = _argument_names(fn["parameters"])
            assert names <= _bank_argument_names(split) and not names & _bank_argument_names(other), names
        assert len({fn["name"] for fn in tools}) > 60  # names made up, not a fixed list
    train_answers = {e.expected.lower() for e in examples("train", 0, 600, skills=("recall",))}
    eval_answers = {e.expected.lower() for e in examples("eval", 0, 200, skills=("recall",))}
    assert train_answers and eval_answers and not train_answers & eval_answers
    assert len(train_answers) > 300  # made up afresh, so answering means copying from the conversation
    subject = {}
    for split in ("train", "eval"):
        openers = [e.messages[0]["content"] for e in examples(split, 0, 200, skills=("text",))]
        subject[split] = {s for s in demo_data._TEXT_SUBJECTS["train"] + demo_data._TEXT_SUBJECTS["eval"]
                          if any(o.endswith(" " + s) for o in openers)}  # fmt: skip
    assert subject["train"] and subject["eval"] and not subject["train"] & subject["eval"]
    assert subject["eval"] <= set(demo_data._TEXT_SUBJECTS["eval"])
    with pytest.raises(ValueError, match="split"):
        examples("test", 0, 1)  # type: ignore[arg-type]


def test_values_mix_real_words_with_made_up_ones_and_never_an_evaluation_answer():
    """With a `ValueRandom` and its word list, `made_up_word` gives a list word (capitalised or not as asked) about
    half the time and otherwise a new word outside the list; a `ValueRandom` without words draws exactly what a
    plain `Random` does, and neither ever gives a list word. Training recall answers stay out of `EVAL_VALUES` even
    when the word list holds evaluation answers (and they are drawn from it otherwise); evaluation answers are the
    facts' own."""
    listed = ["lantern", "Copper", "zeppelin"]
    lower = {w.lower() for w in listed}
    rng = demo_data.ValueRandom(0, listed)
    words = [demo_data.made_up_word(rng, capital=i % 2 == 0) for i in range(400)]
    assert all(w.isalpha() and w.isascii() and (w[0].isupper() or i % 2) for i, w in enumerate(words))
    assert 0.35 < sum(w.lower() in lower for w in words) / len(words) < 0.65
    assert {w.lower() for w in words} > lower and len({w for w in words if w.lower() not in lower}) > 150
    assert {w for i, w in enumerate(words) if i % 2 == 0 and w.lower() in lower} == {"Lantern", "Copper", "Zeppelin"}
    plain = [demo_data.made_up_word(random.Random(s)) for s in range(400)]
    assert plain == [demo_data.made_up_word(demo_data.ValueRandom(s, [])) for s in range(400)]
    assert not {w.lower() for w in plain} & lower

    assert {"leon", "quartz", "greta", "f53", "104"} <= demo_data.EVAL_VALUES
    assert {e.expected.lower() for e in examples("eval", 0, 80, skills=("recall",))} <= demo_data.EVAL_VALUES
    tempting = ["Leon", "quartz", "Marble"]  # two evaluation answers and a word that is none
    rng = demo_data.ValueRandom(1, tempting)
    values = [demo_data.fact_value(rng, kind, "train", []) for kind in demo_data._TRAIN_VALUES for _ in range(100)]
    assert not {v.lower() for v in values} & demo_data.EVAL_VALUES and "Marble" in values
    answers = []
    for seed in range(200):
        ex = recall_example(demo_data.ValueRandom(seed, tempting), "train", 1, questions=3)
        answers += [ex.expected] + [ex.messages[i]["content"].rsplit(" ", 1)[1][:-1] for i in ex.target_turns]
    assert not {a.lower() for a in answers} & demo_data.EVAL_VALUES and "Marble" in answers
    for _, _, _, kind, held in demo_data._FACTS:
        assert demo_data.fact_value(demo_data.ValueRandom(2, tempting), kind, "eval", held) in held


def test_expected_calls_are_valid_and_stated_in_the_request():
    """Each expected call validates against its function's schema (which refuses unknown keys, nested objects
    too), every argument's value is stated in the request beside its name, the function is shown exactly once among
    the tools with that schema, and its distractors (some sharing its verb, some its noun) have other names."""
    shared_verb = shared_noun = 0
    for split in ("train", "eval"):
        for ex in examples(split, 3, 200, skills=("tools",)):
            call = _call_of(ex)
            request = ex.messages[1]["content"]
            jsonschema.validate(call["arguments"], ex.schema)
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(call["arguments"] | {"unknown_key": 1}, ex.schema)
            for name, value in call["arguments"].items():
                if isinstance(value, dict):
                    with pytest.raises(jsonschema.ValidationError):
                        jsonschema.validate(call["arguments"] | {name: value | {"unknown_key": 1}}, ex.schema)
                for said in _stated(name, value):
                    assert said in request, (said, request)
            shown = [t["function"] for t in ex.tools]
            assert [fn["name"] for fn in shown].count(call["name"]) == 1
            assert len({fn["name"] for fn in shown}) == len(shown)
            assert next(fn for fn in shown if fn["name"] == call["name"])["parameters"] == ex.schema
            verb, noun = call["name"].split("_", 1)
            others = [fn["name"].split("_", 1) for fn in shown if fn["name"] != call["name"]]
            shared_verb += any(v == verb for v, _ in others)
            shared_noun += any(n == noun for _, n in others)
    assert shared_verb > 20 and shared_noun > 20  # reading one word of the name is not enough


def test_made_up_schemas_cover_every_json_type():
    """Across made-up functions: strings, integers, numbers, booleans, enums and nested objects all occur, the
    first argument is always required and later ones are sometimes optional."""
    rng = random.Random(0)
    kinds, optional = set(), 0
    for _ in range(300):
        params = make_schema(rng, "train").parameters
        assert params["additionalProperties"] is False and params["required"][0] == next(iter(params["properties"]))
        optional += len(params["required"]) < len(params["properties"])
        for sub in params["properties"].values():
            kinds.add("enum" if "enum" in sub else sub["type"])
    assert kinds == {"string", "integer", "number", "boolean", "enum", "object"} and optional > 20


def test_chat_template_renders_the_tools_of_an_example():
    """The tiny checkpoint's template lists every tool shown and ends with the generation prompt."""
    tok = Tokenizer(TINY_CHECKPOINT)
    ex = examples("eval", 0, 1, skills=("tools",))[0]
    text = tok.apply_chat_template(ex.messages, add_generation_prompt=True, tools=ex.tools)
    for tool in ex.tools:
        assert tool["function"]["name"] in text
    assert ex.messages[-1]["content"] in text and text.endswith("<|im_start|>assistant\n")


def test_tool_turns_carry_the_call_on_to_its_result_and_a_final_answer():
    """`tool_turn`: the call is a target assistant turn in the template's call format, the tool's JSON result
    follows, and the final answer quotes the result's value (the example's expected value)."""
    for seed in range(20):
        ex = tool_turn(random.Random(seed), "train")
        assert [m["role"] for m in ex.messages] == ["system", "user", "assistant", "tool"]
        assert ex.target_turns == [2]
        result = json.loads(ex.messages[3]["content"])
        assert result["status"] == "ok" and ex.expected in result.values()
        assert ex.expected in ex.answer and target_reply(ex) == ex.answer
        lone = tool_example(random.Random(seed), "train")  # the same call before the turn is carried on
        assert _call_of(ex) == lone.expected and lone.answer == call_text(lone.expected)


def _call(name: str, arguments: str) -> ChatCompletionMessageToolCall:
    function = Function(name=name, arguments=arguments)
    return ChatCompletionMessageToolCall(id="call_1", type="function", function=function)


def test_tool_scorer():
    """A right call scores right; another value is right but not exact; a wrong name, an argument against the
    schema, broken JSON, two calls or no call are not."""
    paris = {"name": "get_weather", "arguments": {"city": "Paris"}}
    ex = Example("tools", [], [WEATHER_TOOL], paris, 0, WEATHER_PARAMS)
    right = score_tool_reply("tool_calls", [_call("get_weather", '{"city": "Paris"}')], ex)
    assert right.right and right.exact_arguments
    other_city = score_tool_reply("tool_calls", [_call("get_weather", '{"city": "Rome"}')], ex)
    assert other_city.right and not other_city.exact_arguments
    assert not score_tool_reply("tool_calls", [_call("get_time", '{"city": "Paris"}')], ex).right
    assert not score_tool_reply("tool_calls", [_call("get_weather", '{"city": 3}')], ex).right  # schema: a string
    assert not score_tool_reply("tool_calls", [_call("get_weather", '{"city": ')], ex).formed
    assert not score_tool_reply("tool_calls", [_call("get_weather", "{}")] * 2, ex).formed  # one call, not two
    assert not score_tool_reply("stop", None, ex).formed


def test_harness_through_a_real_server(tmp_path):
    """Tool requests through chat completions (the bigram checkpoint's one call) and recall through a prefilled
    session: only the question's tokens are new."""
    tool_ckpt = make_tool_checkpoint(tmp_path / "tool")
    srv = serve(tool_ckpt, "tool", max_sessions=2)
    try:
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        good = Example("tools", messages, [WEATHER_TOOL], {"name": "get_weather", "arguments": {"city": "Paris"}},
                       0, WEATHER_PARAMS)  # fmt: skip
        other = Example("tools", messages, [WEATHER_TOOL], {"name": "get_time", "arguments": {}}, 0, {})
        report = evaluate_tools(srv.openai(), "tool", [good, other])
        expect = {"requests": 2, "right": 0.5, "well_formed": 1.0, "right_function": 0.5, "exact_arguments": 0.5}
        assert report == expect
    finally:
        srv.stop()

    tiny = make_checkpoint("tiny", tmp_path / "tiny")
    srv = serve(tiny, "tiny", max_sessions=2)
    try:
        report = evaluate_recall(srv.url, "tiny", filler_tokens=[300], per_length=2, max_tokens=4)
        row = report["300"]
        assert row["conversations"] == 2 and 0 <= row["right"] <= 1
        assert row["prompt_tokens_mean"] >= 300
        # The history was prefilled into the session: only the question's turn and the generation prompt were new.
        tok = Tokenizer(tiny)
        turns = [[{"role": "user", "content": fact[1]}] for fact in demo_data._FACTS]
        longest_question = max(len(tok.encode(tok.apply_chat_template(t))) for t in turns)
        assert 0 < row["prompt_tokens_mean"] - row["cached_tokens_mean"] <= longest_question < 60
    finally:
        srv.stop()


def test_recall_examples_state_the_facts_first_and_ask_each_later():
    """One question: fact, filler, question. Several: every fact stated first (each acknowledged), `filler_turns`
    exchanges before the first question, then each question (filler between them), each earlier answer a target
    assistant turn and the last one the example's answer, every answer holding the value its fact stated."""
    ex = recall_example(random.Random(0), "eval", filler_turns=3)
    assert ex.expected in ex.messages[1]["content"] and ex.messages[-1]["role"] == "user"
    assert len(ex.messages) == 3 + 2 * 3 + 1 and json.dumps(asdict(ex)) and not ex.target_turns
    asks = {ask for ask, _ in demo_data.FILLER}
    several = 0
    for seed in range(30):
        ex = recall_example(random.Random(seed), "train", filler_turns=4, questions=3)
        n = len(ex.target_turns) + 1  # questions asked
        facts = [m["content"] for m in ex.messages[1 : 2 * n + 1 : 2]]
        assert all(m["content"] == ACK for m in ex.messages[2 : 2 * n + 1 : 2])
        assert all(m["content"] in asks for m in ex.messages[2 * n + 1 : 2 * n + 9 : 2])  # four filler exchanges
        questions = [ex.messages[i - 1] for i in ex.target_turns] + [ex.messages[-1]]
        assert ex.messages[2 * n + 9] is questions[0]
        assert all(q["role"] == "user" and q["content"] not in asks for q in questions)
        assert len({q["content"] for q in questions}) == n
        answers = [ex.messages[i]["content"] for i in ex.target_turns] + [ex.answer]
        assert all(ex.messages[i]["role"] == "assistant" for i in ex.target_turns)
        assert ex.expected in ex.answer and target_reply(ex) == ex.answer
        values = [a.rsplit(" ", 1)[1].removesuffix(".") for a in answers]  # an answer sentence ends with its value
        assert sorted(values) == sorted(f.rsplit(" ", 1)[1].removesuffix(".") for f in facts)
        several += n > 1
    assert several > 10


def test_target_replies_parse_back_through_the_server_tool_parser():
    """A lone call's target reply is exactly one call the server parses back to the expected call; a call carried on
    to its result has that call as a target turn, and its reply quotes the result; a recall target states the
    answer; chat and text have none (the teacher writes them)."""
    from kvfree.server.tools import parse_tool_calls

    seen = set()
    for ex in examples("train", 5, 120):
        target = target_reply(ex)
        if ex.skill == "tools":
            call = _call_of(ex)
            text = call_text(call) if ex.target_turns else target
            names = {t["function"]["name"] for t in ex.tools}
            content, calls = parse_tool_calls(text, "<tool_call>", "</tool_call>", names)
            assert content == "" and len(calls) == 1
            assert calls[0].function.name == call["name"]
            assert json.loads(calls[0].function.arguments) == call["arguments"]
            if ex.target_turns:
                assert ex.expected in target and ex.messages[-1]["role"] == "tool"
            seen.add("tool_turn" if ex.target_turns else "call")
        elif ex.skill == "recall":
            assert ex.expected in target and target.endswith(".")
        else:
            assert target is None
    assert seen == {"call", "tool_turn"}


def _teacher_folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = json.loads((TINY_CHECKPOINT / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(TINY_CHECKPOINT / "tokenizer.json"), eos_token="<|im_end|>")
    tok.chat_template = config["chat_template"]
    teacher = tmp_path / "teacher"
    tok.save_pretrained(teacher)
    with torch.inference_mode(False):
        torch.manual_seed(0)
        llama = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
        LlamaForCausalLM(llama).save_pretrained(teacher)
    return teacher


def test_teacher_writes_the_training_data(tmp_path):
    """`demo_teacher` with a tiny random Llama (the teacher's architecture) and the byte tokenizer: chat replies
    come from the teacher, deterministically when greedy; tool and recall replies are the known right ones."""
    from kvfree.training.demo_teacher import main as teacher_main

    teacher = _teacher_folder(tmp_path)
    outs = []
    for run in range(2):
        out = tmp_path / f"data{run}.jsonl"
        args = ["--teacher", str(teacher), "--n", "6", "--out", str(out), "--device", "cpu", "--max-new-tokens", "5"]
        assert teacher_main(args) == 0
        outs.append([json.loads(line) for line in out.read_text().split("\n") if line])
    rows = outs[0]
    assert outs[0] == outs[1] and len(rows) == 6
    assert {r["skill"] for r in rows} == set(SKILLS)
    for row, ex in zip(rows, examples("train", 0, 6), strict=True):
        assert row["messages"] == ex.messages and row["tools"] == ex.tools and row["skill"] == ex.skill
        if ex.skill in ("chat", "text"):
            assert row["source"] == "teacher" and isinstance(row["reply"], str)
        else:
            assert row["source"] == "known" and row["reply"] == target_reply(ex) is not None


def test_teacher_replies_are_read_for_calls_in_the_exact_format():
    """`tool_calls_in` (scoring the teacher outside the server) takes each tagged JSON call with a string name and
    object arguments, and nothing else; a right call then scores as the server's parse of it would."""
    from kvfree.training.demo_eval import tool_calls_in

    paris = {"name": "get_weather", "arguments": {"city": "Paris"}}
    ex = Example("tools", [], [WEATHER_TOOL], paris, 0, WEATHER_PARAMS)
    text = "Sure. " + call_text(paris)
    calls = tool_calls_in(text)
    assert len(calls) == 1 and score_tool_reply("tool_calls", calls, ex).exact_arguments
    bad = ["<tool_call>not json</tool_call>", '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
           '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', '{"name": "f", "arguments": {}}']  # fmt: skip
    assert all(tool_calls_in(text) == [] for text in bad)
