"""Structured output in the API: the grammar a reply is held to, from a request's `response_format`, vLLM's
`structured_outputs` or its tools and `tool_choice` (the engine enforces it token by token, engine/text/grammar.py).

Tool calls are constrained in the checkpoint's own format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
server/tools.py), each call's arguments valid for its function's `parameters` schema:

- `tool_choice: "required"`: the reply is one call, or several with `parallel_tool_calls` (the default);
- a named function: calls to that function only;
- `"auto"`: free text, or text and then calls; text never spells a call's opening tag, so whatever the model opens
  is a valid call. With a JSON `response_format` as well, the reply is that JSON or calls;
- `"none"`: tools play no part (a `response_format` still does).

A tag that is one special token of the tokenizer (kvfree's byte-level tokenizers make them so) is matched as that
token, as the model was trained to write it.
"""

from __future__ import annotations

import json
from typing import Any

from kvfree.engine.protocol import Grammar
from kvfree.engine.text.grammar import json_schema_rule, lark_string
from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.server.errors import invalid_request
from kvfree.server.protocol import ChatTool, NamedToolChoice, ResponseFormat, StructuredOutputs, ToolChoice
from kvfree.server.tools import ToolCallFormat


def reply_grammar(
    answer: Grammar | None,
    answer_param: str,
    tools: list[ChatTool] | None,
    choice: ToolChoice,
    parallel: bool | None,
    tokenizer: Tokenizer,
) -> tuple[Grammar | None, str]:
    """The grammar of a whole reply and the request field it comes from (what a 400 names): the tool calls' when
    tools are in use (with `answer` as the alternative to calls under "auto"), else `answer`'s.

    Raises:
        APIError: 400 when tools are in use but the checkpoint declares no tool-call format, or `answer` is not
            JSON (only a JSON reply can stand beside calls: use `response_format`).
    """
    if not tools or choice == "none":
        return answer, answer_param
    fmt = ToolCallFormat.from_tokenizer_config(tokenizer.config)
    if fmt is None:
        raise invalid_request("this model declares no tool-call format (tool_call_start/tool_call_end in its "
                              "tokenizer_config.json), so its calls cannot be enforced: send tool_choice none",
                              "tool_choice")  # fmt: skip
    if answer is not None and answer.kind not in ("json_schema", "json_object"):
        raise invalid_request(f"a {answer.kind} constraint cannot be combined with tools; a JSON response_format "
                              "can", answer_param)  # fmt: skip
    grammar = tool_call_grammar(tools, choice, True if parallel is None else parallel, fmt, tokenizer, answer)
    return grammar, "tools"


def answer_grammar(response_format: ResponseFormat | None, structured: StructuredOutputs | None) -> Grammar | None:
    """The grammar of a reply that is not a tool call, None for free text."""
    if structured is not None:
        if structured.json_ is not None:
            schema = structured.json_
            return Grammar("json_schema", schema) if isinstance(schema, str) else Grammar.json_schema(schema)
        if structured.regex is not None:
            return Grammar("regex", structured.regex)
        if structured.choice is not None:
            return Grammar.choice(structured.choice)
        if structured.grammar is not None:
            return Grammar("lark", structured.grammar)
        return Grammar("json_object")
    if response_format is None:
        return None
    schema = response_format.json_schema.schema_ if response_format.json_schema is not None else None
    return format_grammar(response_format.type, schema)


def format_grammar(kind: str, schema: dict[str, Any] | None) -> Grammar | None:
    """The grammar of a reply format, chat's `response_format` or the Responses API's `text.format`: "text" (None,
    free text), "json_object" or "json_schema" (`schema`)."""
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        return Grammar.json_schema(schema)
    return None


def tool_call_grammar(
    tools: list[ChatTool],
    choice: ToolChoice,
    parallel: bool,
    fmt: ToolCallFormat,
    tokenizer: Tokenizer,
    answer: Grammar | None = None,
) -> Grammar | None:
    """The Lark grammar of a reply under `tool_choice` (None for "none"); `answer`: a JSON reply's grammar, the
    alternative to calls under "auto" (free text when None)."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    open_tag, close_tag = _tag(fmt.start, tokenizer), _tag(fmt.end, tokenizer)
    names = [f"call_{i}" for i in range(len(tools))]
    lines = [f"call_body: ({' | '.join(names)}) {close_tag}"]
    lines += [f"{name}: {json_schema_rule(_call_schema(tool))}" for name, tool in zip(names, tools, strict=True)]
    more = f'("\\n"? {open_tag} call_body)*' if parallel else ""
    if choice == "auto" and answer is None:
        # Text, or text that ends by opening a call (a lazy match: the first opening tag ends it), then the calls.
        tag = _regex_literal(fmt.start)
        lines.append(rf"TEXT: /(.|\n)+/ & ~/(.|\n)*{tag}(.|\n)*/")
        if open_tag.startswith("<["):  # a special token: no text can run into it
            lines.append(f"start: TEXT | TEXT? {open_tag} call_body {more}")
        else:
            lines.append(f"start: TEXT | text_then_call call_body {more}")
            lines.append(rf"text_then_call[lazy]: /(.|\n)*{tag}/")
    elif choice == "auto":
        lines += [f"start: answer | {open_tag} call_body {more}", f"answer: {_inline(answer)}"]
    else:
        lines += [f"start: {open_tag} call_body {more}"]
    return Grammar("lark", "\n".join(lines) + "\n")


def _call_schema(tool: ChatTool) -> dict[str, Any]:
    """One call as a JSON schema: `{"name": <this function>, "arguments": <its parameters>}`, in that order (the
    model writes the name first). The parameters' `$defs` move to the top, where their `#/$defs/...` refs point."""
    parameters = dict(tool.function.parameters or {"type": "object"})
    hoisted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **hoisted,
    }


def _inline(grammar: Grammar) -> str:
    """A JSON answer's grammar as a Lark rule body."""
    if grammar.kind == "json_object":
        return json_schema_rule({"type": "object"})
    return json_schema_rule(json.loads(grammar.source))


def _tag(tag: str, tokenizer: Tokenizer) -> str:
    """A tool-call tag in Lark: the special token it is (`<[id]>`), or its text."""
    ids = tokenizer.encode(tag)
    if len(ids) == 1 and ids[0] in tokenizer.special_token_ids:
        return f"<[{ids[0]}]>"
    return lark_string(tag)


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark `/.../` regex: letters and digits as they are, every other character
    as a hex escape (so neither `/` nor a regex operator can end or change the pattern)."""
    return "".join(ch if ch.isascii() and ch.isalnum() else f"\\x{{{ord(ch):x}}}" for ch in text)
