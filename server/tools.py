"""Tool calls: what the chat template is given, and the calls parsed back out of the model's text.

The checkpoint declares its tool-call format in `tokenizer_config.json` (`tool_call_start`, `tool_call_end`): a
call is one JSON object `{"name": ..., "arguments": {...}}` between the two tags. Parsing is forgiving by design:
anything that is not a valid call to an accepted function (malformed JSON, an unknown name, an unclosed tag at
`max_tokens`) stays in the message as plain text instead of failing the request, since the model, not the
client, wrote it.

Whitespace next to a call (the newline before `<tool_call>`, between two calls, after the last) is dropped, so a
reply made only of calls has empty content (the route sends `content: null` then). Text without any call comes
out unchanged.

Two things the route must do for this to work:

- Decode with `skip_special_tokens=False` while tools are in use (`ChatCompletionRequest.to_sampling_params`
  does): kvfree's tokenizers make the tags special tokens, which would otherwise vanish from the text.
- Constrain the reply with the grammar of `tool_choice` (server/structured_outputs.py): the engine then only lets
  the model write valid calls (and, under `"required"` or a named function, nothing else). The parser stays
  forgiving for what a grammar does not rule out: a call cut by `max_tokens` stays text (finish_reason `length`).
  `"none"` hides the tools from the model and nothing is parsed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from openai.types.chat import ChatCompletionMessageToolCall
from openai.types.chat.chat_completion_message_tool_call import Function

from kvfree.server.protocol import (
    AssistantMessage,
    ChatMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    NamedToolChoice,
    SystemMessage,
    ToolChoice,
)


@dataclass(frozen=True)
class ToolCallFormat:
    """The tags around a tool call in the model's output."""

    start: str
    end: str

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any]) -> ToolCallFormat | None:
        """The format a checkpoint declares; None when it declares none (the model was not trained on tools)."""
        start, end = config.get("tool_call_start"), config.get("tool_call_end")
        if isinstance(start, str) and isinstance(end, str) and start and end:
            return cls(start, end)
        return None


def new_call_id() -> str:
    """A tool call id in OpenAI's style: `call_` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


# -- to the template ----------------------------------------------------------------------------------------------


def accepted_tool_names(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> frozenset[str] | None:
    """The functions whose calls are parsed out of the reply; None when nothing is parsed (no tools, "none")."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, NamedToolChoice):
        return frozenset({tool_choice.function.name})
    return frozenset(tool.function.name for tool in tools)


def template_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> list[dict[str, Any]] | None:
    """`tools` for `Tokenizer.apply_chat_template`: OpenAI tool objects as plain dicts, as HF templates expect them.

    None (no tools section in the prompt) when there are no tools or `tool_choice` is "none"; only the named
    function when `tool_choice` names one, so the model is shown exactly what it may call.
    """
    names = accepted_tool_names(tools, tool_choice)
    if names is None or tools is None:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools if tool.function.name in names]


def _arguments_object(arguments: str) -> Any:
    # The model writes arguments as an object; OpenAI clients send them back as a JSON string. Showing the model
    # its own format keeps the history in the distribution it was trained on.
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as plain dicts for `Tokenizer.apply_chat_template`.

    `developer` becomes `system` (templates know only the latter) and the arguments of past tool calls are
    turned back from JSON strings into objects, the form the model writes them in. Content parts stay a list of
    `{"type": "text", "text": ...}`: the template decides how to join them.
    """
    out = []
    for message in messages:
        data = message.model_dump(exclude_none=True)
        if isinstance(message, SystemMessage):
            data["role"] = "system"
        if isinstance(message, AssistantMessage) and message.tool_calls:
            for call in data["tool_calls"]:
                call["function"]["arguments"] = _arguments_object(call["function"]["arguments"])
        out.append(data)
    return out


# -- from the model -----------------------------------------------------------------------------------------------


def _parse_call(body: str, allowed: Collection[str] | None) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) from the text between the tags, or None when it is not a valid call."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    name = data.get("name")
    if not isinstance(name, str) or not name or (allowed is not None and name not in allowed):
        return None
    # Some models write "parameters" (the JSON-schema name) instead of "arguments"; both mean the same.
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # arguments already serialized once by the model
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


@dataclass
class ContentDelta:
    """Text of the message outside tool calls."""

    text: str


StreamEvent = ContentDelta | DeltaToolCall


class ToolCallStreamParser:
    """Splits streamed model text into content deltas and tool-call deltas.

    Content is passed on as it comes, except for what might still turn into a call: a possible partial start tag
    at the end of the text (`<tool_` might become `<tool_call>`) and trailing whitespace (it is dropped if a
    call follows). A call is emitted once its end tag has arrived and its JSON parsed, as OpenAI streams calls:
    a first delta with index, id, type, function name and empty arguments, then one with the arguments.

    Args:
        start_tag, end_tag: the checkpoint's tool-call tags.
        allowed_names: functions whose calls are accepted (None: any name); calls to others stay text.
    """

    def __init__(self, start_tag: str, end_tag: str, allowed_names: Collection[str] | None = None) -> None:
        if not start_tag or not end_tag:
            raise ValueError("tool-call tags must be non-empty")
        self.start_tag = start_tag
        self.end_tag = end_tag
        self.allowed_names = None if allowed_names is None else frozenset(allowed_names)
        self.tool_calls: list[ChatCompletionMessageToolCall] = []  # complete calls so far, in order
        self._outside = ""  # text after the last tag not yet emitted: a possible partial start tag
        self._body: str | None = None  # text after a start tag, while inside a call
        self._space = ""  # trailing whitespace of the content, held back
        self._space_before_call = ""  # whitespace held when the current start tag was seen
        self._after_call = False  # no text since the last call: whitespace here is dropped
        self._events: list[StreamEvent] = []

    def feed(self, text: str) -> list[StreamEvent]:
        """Take the next piece of the model's text; returns what can be sent now."""
        self._scan(text)
        return self._take()

    def finish(self) -> list[StreamEvent]:
        """The model is done: flush held text. An unclosed call is plain text."""
        while self._body is not None:
            body, self._body = self._body, None
            at = body.find(self.end_tag)
            if at < 0:
                self._text(self._space_before_call + self.start_tag + body)
                break
            # End tags were passed over as inside a string of JSON that never closed: the first one ends the
            # (invalid) call after all, as text, and what follows is read again (it may hold calls).
            self._text(self._space_before_call + self.start_tag + body[: at + len(self.end_tag)])
            self._space_before_call = ""
            self._scan(body[at + len(self.end_tag) :])
        if self._outside:
            self._text(self._outside)
            self._outside = ""
        if not self._after_call and self._space:
            self._events.append(ContentDelta(self._space))
        self._space = ""
        return self._take()

    # -- internals ----------------------------------------------------------------------------------------------
    def _take(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        return events

    def _scan(self, text: str) -> None:
        while text:
            if self._body is None:
                buf = self._outside + text
                at = buf.find(self.start_tag)
                if at < 0:
                    keep = _partial_suffix(buf, self.start_tag)
                    self._text(buf[: len(buf) - keep])
                    self._outside = buf[len(buf) - keep :]
                    return
                self._text(buf[:at])
                self._outside = ""
                self._space_before_call, self._space = self._space, ""
                self._body = ""
                text = buf[at + len(self.start_tag) :]
            else:
                # Search only where a new end tag can be: it may straddle the previous piece and this one.
                from_ = max(0, len(self._body) - len(self.end_tag) + 1)
                body = self._body + text
                at = body.find(self.end_tag, from_)
                parsed = None
                while at >= 0:
                    parsed = _parse_call(body[:at], self.allowed_names)
                    # An end tag inside a JSON string of the call is part of a value (a grammar-valid call may hold
                    # one): the call goes on to the next end tag.
                    if parsed is not None or not _in_json_string(body, at):
                        break
                    at = body.find(self.end_tag, at + 1)
                if at < 0:
                    self._body = body
                    return
                self._close(body[:at], parsed)
                text = body[at + len(self.end_tag) :]

    def _close(self, body: str, parsed: tuple[str, str] | None) -> None:
        """The end tag arrived: a call when the body parsed (`_parse_call`), else the whole tagged text as content."""
        self._body = None
        if parsed is None:
            self._text(self._space_before_call + self.start_tag + body + self.end_tag)
            return
        name, arguments = parsed
        call = ChatCompletionMessageToolCall(
            id=new_call_id(), type="function", function=Function(name=name, arguments=arguments)
        )
        index = len(self.tool_calls)
        self.tool_calls.append(call)
        self._events.append(
            DeltaToolCall(index=index, id=call.id, type="function", function=DeltaFunctionCall(name=name, arguments=""))
        )
        self._events.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments)))
        self._after_call = True

    def _text(self, text: str) -> None:
        """Content text: emit it, holding back trailing whitespace; whitespace right after a call is dropped."""
        core = text.rstrip()
        if not core:
            self._space += text
            return
        out = self._space + core
        if self._after_call:
            out = out.lstrip()
            self._after_call = False
        self._events.append(ContentDelta(out))
        self._space = text[len(core) :]


def _in_json_string(text: str, at: int) -> bool:
    """Whether position `at` of `text` (JSON, or the start of it) is inside a string: an odd number of unescaped
    quotes before it."""
    inside = escaped = False
    for char in text[:at]:
        if escaped:
            escaped = False
        elif char == "\\" and inside:
            escaped = True
        elif char == '"':
            inside = not inside
    return inside


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the beginning of `tag` (and shorter than it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def parse_tool_calls(
    text: str, start_tag: str, end_tag: str, allowed_names: Collection[str] | None = None
) -> tuple[str, list[ChatCompletionMessageToolCall]]:
    """(content, calls) of a whole reply; exactly what streaming the same text would give.

    Content is the text outside valid calls, whitespace next to calls removed ("" for a reply of calls only).
    Each call's arguments are a JSON string and its id is fresh (`call_...`).
    """
    parser = ToolCallStreamParser(start_tag, end_tag, allowed_names)
    events = parser.feed(text) + parser.finish()
    content = "".join(event.text for event in events if isinstance(event, ContentDelta))
    return content, parser.tool_calls
