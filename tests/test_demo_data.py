"""The `kvfree-demo` prompt generator and evaluation harness (training/demo_data.py, training/demo_eval.py).

The generator is deterministic for a seed and keeps evaluation schemas and fact values out of the training split;
every tool example's expected call is valid for its schema; the scorer tells a right call from a wrong one; and the
harness runs through a real server: tool calls through chat completions (the "bigram" test checkpoint always calls
`get_weather` for Paris), recall through a prefilled session.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import jsonschema
import pytest
import torch
from openai.types.chat import ChatCompletionMessageToolCall
from openai.types.chat.chat_completion_message_tool_call import Function

from kvfree.engine.tokenizer import Tokenizer
from kvfree.training.demo_data import Example, examples, recall_example, schemas_for, target_reply, tool_schemas
from kvfree.training.demo_eval import evaluate_recall, evaluate_tools, score_tool_reply
from tests.paths import TINY_CHECKPOINT
from tests.server_fixtures import make_checkpoint, make_tool_checkpoint, serve

ROOT = Path(__file__).resolve().parents[1]
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}


def test_examples_are_deterministic_for_a_seed():
    a = [asdict(e) for e in examples("train", 7, 30)]
    assert a == [asdict(e) for e in examples("train", 7, 30)]
    assert a != [asdict(e) for e in examples("train", 8, 30)]
    assert {e["skill"] for e in a} == {"chat", "tools", "recall", "text"}


def test_evaluation_schemas_and_facts_never_reach_the_training_split():
    train, held = {s.name for s in schemas_for("train")}, {s.name for s in schemas_for("eval")}
    assert len(tool_schemas()) >= 36 and len(held) >= 8 and not train & held
    assert train | held == {s.name for s in tool_schemas()}
    shown_in_training = {t["function"]["name"] for e in examples("train", 0, 600) if e.tools for t in e.tools}
    assert shown_in_training <= train and len(shown_in_training) == len(train)
    train_answers = {e.expected.lower() for e in examples("train", 0, 600, skills=("recall",))}
    eval_answers = {e.expected.lower() for e in examples("eval", 0, 200, skills=("recall",))}
    assert train_answers and eval_answers and not train_answers & eval_answers
    assert len(train_answers) > 300  # made up afresh, so answering means copying from the conversation
    text_openers = {e.messages[0]["content"] for e in examples("eval", 0, 40, skills=("text",))}
    assert not text_openers & {e.messages[0]["content"] for e in examples("train", 0, 400, skills=("text",))}
    with pytest.raises(ValueError, match="split"):
        examples("test", 0, 1)  # type: ignore[arg-type]


def test_expected_calls_are_valid_for_their_schemas():
    for ex in examples("eval", 3, 90, skills=("tools",)):
        assert ex.expected["name"] in {t["function"]["name"] for t in ex.tools}
        jsonschema.validate(ex.expected["arguments"], ex.schema)
        assert all(str(v) in ex.messages[-1]["content"] for v in ex.expected["arguments"].values())


def test_chat_template_renders_the_tools_of_an_example():
    tok = Tokenizer(TINY_CHECKPOINT)
    ex = examples("eval", 0, 1, skills=("tools",))[0]
    text = tok.apply_chat_template(ex.messages, add_generation_prompt=True, tools=ex.tools)
    for tool in ex.tools:
        assert tool["function"]["name"] in text
    assert ex.messages[-1]["content"] in text and text.endswith("<|im_start|>assistant\n")


def _call(name: str, arguments: str) -> ChatCompletionMessageToolCall:
    function = Function(name=name, arguments=arguments)
    return ChatCompletionMessageToolCall(id="call_1", type="function", function=function)


def test_tool_scorer():
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
        # The history was prefilled into the session: only the question's tokens were new.
        assert row["prompt_tokens_mean"] - row["cached_tokens_mean"] < 40
    finally:
        srv.stop()


def test_recall_examples_state_the_fact_first_and_ask_last():
    import random

    ex = recall_example(random.Random(0), "eval", filler_turns=3)
    assert ex.expected in ex.messages[1]["content"] and ex.messages[-1]["role"] == "user"
    assert len(ex.messages) == 3 + 2 * 3 + 1 and json.dumps(asdict(ex))


def test_target_replies_parse_back_through_the_server_tool_parser():
    """A tools example's target reply is exactly one call the server parses back to the expected call; a recall
    target states the answer; chat and text have none (the teacher writes them)."""
    from kvfree.server.tools import parse_tool_calls

    for ex in examples("train", 5, 60):
        target = target_reply(ex)
        if ex.skill == "tools":
            names = {t["function"]["name"] for t in ex.tools}
            content, calls = parse_tool_calls(target, "<tool_call>", "</tool_call>", names)
            assert content == "" and len(calls) == 1
            assert calls[0].function.name == ex.expected["name"]
            assert json.loads(calls[0].function.arguments) == ex.expected["arguments"]
        elif ex.skill == "recall":
            assert ex.expected in target and target.endswith(".")
        else:
            assert target is None


def test_teacher_writes_the_training_data(tmp_path):
    """`demo_teacher` with a tiny random Llama (the teacher's architecture) and the byte tokenizer: chat replies
    come from the teacher, deterministically when greedy; tool and recall replies are the known right ones."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from kvfree.training.demo_teacher import main as teacher_main

    default = TINY_CHECKPOINT
    config = json.loads((default / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(default / "tokenizer.json"), eos_token="<|im_end|>")
    tok.chat_template = config["chat_template"]
    teacher = tmp_path / "teacher"
    tok.save_pretrained(teacher)
    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)  # fmt: skip
    LlamaForCausalLM(llama).save_pretrained(teacher)

    outs = []
    for run in range(2):
        out = tmp_path / f"data{run}.jsonl"
        args = ["--teacher", str(teacher), "--n", "6", "--out", str(out), "--device", "cpu", "--max-new-tokens", "5"]
        assert teacher_main(args) == 0
        outs.append([json.loads(line) for line in out.read_text().splitlines()])
    rows = outs[0]
    assert outs[0] == outs[1] and len(rows) == 6
    assert {r["skill"] for r in rows} == {"chat", "tools", "recall", "text"}
    for row, ex in zip(rows, examples("train", 0, 6), strict=True):
        assert row["messages"] == ex.messages
        if ex.skill in ("chat", "text"):
            assert row["source"] == "teacher" and isinstance(row["reply"], str)
        else:
            assert row["source"] == "known" and row["reply"] == target_reply(ex)


def test_teacher_replies_are_read_for_calls_in_the_exact_format():
    """`tool_calls_in` (scoring the teacher outside the server) takes each tagged JSON call with a string name and
    object arguments, and nothing else; a right call then scores as the server's parse of it would."""
    from kvfree.training.demo_eval import tool_calls_in

    paris = {"name": "get_weather", "arguments": {"city": "Paris"}}
    ex = Example("tools", [], [WEATHER_TOOL], paris, 0, WEATHER_PARAMS)
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    calls = tool_calls_in(text)
    assert len(calls) == 1 and score_tool_reply("tool_calls", calls, ex).exact_arguments
    bad = ["<tool_call>not json</tool_call>", '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
           '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', '{"name": "f", "arguments": {}}']  # fmt: skip
    assert all(tool_calls_in(text) == [] for text in bad)
