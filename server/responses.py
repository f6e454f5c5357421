"""The OpenAI Responses API (`POST /v1/responses`): its request body, the conversation it stands for, and the output
items and stream events built from the model's text (openai's own response types, serialised as OpenAI sends them).

A response is one assistant turn. Its input items (messages, `function_call`s the model made earlier,
`function_call_output`s with tool results, `reasoning` items the model wrote earlier) become chat messages rendered
by the checkpoint's chat template, after the request's `instructions` and, with `previous_response_id`, after the
stored conversation of that response. The model's text becomes output items in the order it wrote them: for a
checkpoint that declares reasoning tags (server/reasoning.py), first a `reasoning` item with its thinking as
`reasoning_text`; then a `message` with `output_text` for text, one `function_call` per tool call (tool calls are
parsed from the text after the reasoning, as the chat route parses them, server/tools.py).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, get_args

from openai.types.responses import (
    FunctionTool,
    Response,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response_reasoning_item import Content as ReasoningText
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from openai.types.shared import ReasoningEffort
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvfree.engine.protocol import Grammar, SamplingParams
from kvfree.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from kvfree.server.errors import not_found
from kvfree.server.protocol import (
    MAX_TOOLS,
    SEED_MASK,
    AssistantMessage,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedToolChoice,
    PromptCacheKey,
    RequestModel,
    SystemMessage,
    TextContentPart,
    ToolCall,
    ToolChoice,
    ToolChoiceFunctionName,
    ToolMessage,
    UserMessage,
    check_tool_choice,
    check_unique_tool_names,
    one_line,
    resolve_max_tokens,
)
from kvfree.server.reasoning import ReasoningFormat, ReasoningStreamParser
from kvfree.server.structured_outputs import format_grammar
from kvfree.server.tools import ContentDelta, DeltaToolCall, ToolCallFormat, ToolCallStreamParser

if TYPE_CHECKING:  # (a type only: the engine handle opens the store, `EngineHandle.session_store`)
    from kvfree.engine.sessions.store import SessionStore

MAX_METADATA = 16


def response_id() -> str:
    """A response id in OpenAI's style: `resp_` and 32 hex digits."""
    return "resp_" + uuid.uuid4().hex


# -- the request ----------------------------------------------------------------------------------------------------


class InputText(RequestModel):
    """A text part of a message's content (`input_text`; `output_text` in an assistant message sent back)."""

    type: Literal["input_text", "output_text", "text"] = Field(description='`"input_text"` (or `"output_text"`).')
    text: str


class MessageItem(RequestModel):
    """A message: `{"role": "user", "content": "..."}`, with or without `"type": "message"`."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = Field(default=None, description="Accepted (an output item sent back); not used.")
    status: str | None = Field(default=None, description="Accepted (an output item sent back); not used.")


class FunctionCallItem(RequestModel):
    """A tool call the model made in an earlier turn (a `function_call` output item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, description="The call's id; a `function_call_output` answers it.")
    name: str
    arguments: str = Field(description="The arguments, a JSON object serialized as a string.")
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestModel):
    """The result of a tool call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, description="The `call_id` of the `function_call` this answers.")
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None


class ReasoningTextPart(RequestModel):
    type: Literal["reasoning_text"] = Field(description='`"reasoning_text"`.')
    text: str


class SummaryTextPart(RequestModel):
    type: Literal["summary_text"] = Field(description='`"summary_text"`.')
    text: str


class ReasoningItem(RequestModel):
    """The model's thinking in an earlier turn (a `reasoning` output item sent back): the reasoning of the assistant
    turn that follows it (its next assistant message or `function_call`; when neither follows, an assistant turn of
    its own with no text, as a reply cut inside its thinking). Whether the model sees it is the chat template's
    choice, as for chat's `reasoning_content` (Qwen3's shows only the reasoning after the last user message)."""

    type: Literal["reasoning"]
    id: str = Field(min_length=1, description="The item's id (`rs_...`); not used.")
    summary: list[SummaryTextPart] = Field(description="Accepted (`[]` from kvfree); not shown to the model.")
    content: list[ReasoningTextPart] | None = Field(
        default=None, description="The reasoning, as returned; without it the item gives the model nothing to read."
    )
    encrypted_content: str | None = Field(
        default=None, description="Accepted and ignored: kvfree encrypts nothing (its items carry their text in "
        "`content`), and another server's encrypted reasoning cannot be read."
    )
    status: Literal["in_progress", "completed", "incomplete"] | None = Field(
        default=None, description="Accepted (an output item sent back); not used."
    )

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


def _item_kind(data: Any) -> str:
    """The input item's kind: its `type`, `message` when it has none (OpenAI's "easy input message")."""
    if isinstance(data, dict):
        return data.get("type", "message")
    return getattr(data, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionToolParam(RequestModel):
    """A function the model may call (the Responses API's flat form: `name` beside `type`)."""

    type: Literal["function"] = Field(description='Only `"function"` tools.')
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="Letters, digits, `_`, `.`, `-`; 1-64 chars.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="JSON Schema of the arguments; a call's arguments always validate against it."
    )
    strict: bool | None = Field(default=None, description="Accepted: the arguments' schema is enforced either way.")


class ToolChoiceFunction(RequestModel):
    """Force a call to one function: `{"type": "function", "name": "..."}`."""

    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """The reply's form, enforced while it is generated: `{"type": "text"}`, `{"type": "json_object"}`, or
    `{"type": "json_schema", "name": ..., "schema": {...}}` (the Responses API's flat form of chat's
    `response_format`)."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_\-]{1,64}$", description='With `"json_schema"`.')
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description='With `"json_schema"`.')
    strict: bool | None = Field(default=None, description="Accepted: the schema is enforced either way.")

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError('text.format of type "json_schema" needs a name and a schema')
        return self

    def grammar(self) -> Grammar | None:
        """What the reply is held to (None: free text)."""
        return format_grammar(self.type, self.schema_)


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ReasoningConfig(RequestModel):
    """`reasoning`: OpenAI's options for reasoning models, validated as its API does and echoed on the response.

    A checkpoint thinks when it declares reasoning tags and its chat template lets it; these options do not
    change that."""

    effort: ReasoningEffort = Field(
        default=None, description="Validated and echoed; it does not steer how long the model thinks."
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, description="Validated and echoed; no summary is written (kvfree has no summarizer): a "
        "`reasoning` item's `summary` is `[]`, its full text is in `content`.",
    )
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None, description="Deprecated name of `summary`; the same."
    )


class ResponsesRequest(RequestModel):
    """`POST /v1/responses`: the model's next turn, optionally continuing a stored response."""

    model: str | None = Field(default=None, description="Optional: omitted means the server's only model.")
    input: str | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="A user message as a string, or a list of input items (messages, function calls, their "
        "outputs, reasoning items)."
    )
    instructions: str | None = Field(
        default=None, description="A system message before the conversation; not carried over to later responses."
    )
    previous_response_id: str | None = Field(
        default=None,
        min_length=1,
        description="Continue from this stored response's exact state: only this request's input is prefilled. "
        "Several responses may continue the same one (a fork each).",
    )
    tools: list[FunctionToolParam] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = Field(
        default=None, description="Whether the reply may hold several calls (default true); false: at most one."
    )
    max_output_tokens: int | None = Field(default=None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass; default 1.")
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, description="Extension: reproducible sampling.")
    store: bool = Field(default=True, description="Keep the response (and its state) for GET and continuation.")
    prompt_cache_key: PromptCacheKey | None = None
    stream: bool = Field(default=False, description="Stream the Responses API's typed server-sent events.")
    metadata: dict[str, str] | None = Field(default=None, description=f"Up to {MAX_METADATA} key-value pairs.")
    user: str | None = Field(default=None, description="Accepted for compatibility; ignored.")
    text: TextConfig | None = Field(
        default=None, description='`{"format": {...}}`: `text` (default), `json_object` or `json_schema` (enforced).'
    )
    truncation: Literal["disabled"] | None = Field(default=None, description='Only `"disabled"`.')
    reasoning: ReasoningConfig | None = Field(
        default=None, description="Validated and echoed. A checkpoint that declares reasoning tags returns its "
        "thinking as a `reasoning` item (`content`: `reasoning_text`) before its message, whatever this says; "
        "`summary` is always `[]` (no summarizer)."
    )
    include: list[str] | None = Field(
        default=None, description='Accepted; nothing extra is included. `"reasoning.encrypted_content"` is omitted: '
        "kvfree encrypts nothing, its reasoning items carry their text in `content` and can be sent back as they are."
    )

    @field_validator("metadata")
    @classmethod
    def _few_keys(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and len(value) > MAX_METADATA:
            raise ValueError(f"metadata has {len(value)} keys; at most {MAX_METADATA}")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[FunctionToolParam] | None) -> list[FunctionToolParam] | None:
        check_unique_tool_names([tool.name for tool in tools or []])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_matches_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        if choice is None or choice == "none" or "tools" not in info.data:
            return choice  # a bad `tools` has its own error
        named = choice.name if isinstance(choice, ToolChoiceFunction) else None
        check_tool_choice(choice, named, {t.name for t in info.data["tools"] or []})
        return choice

    # -- what the chat machinery takes ----------------------------------------------------------------------------
    def chat_tools(self) -> list[ChatTool] | None:
        """The tools in the chat API's nested form, for the template and the tool-call parser."""
        if not self.tools:
            return None
        return [
            ChatTool(
                type="function",
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in self.tools
        ]

    def chat_tool_choice(self) -> ToolChoice:
        """`tool_choice` in the chat API's form, with OpenAI's default ("auto" with tools, else "none")."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if isinstance(choice, ToolChoiceFunction):
            return NamedToolChoice(type="function", function=ToolChoiceFunctionName(name=choice.name))
        return choice

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.chat_tool_choice() != "none"

    @property
    def text_format(self) -> TextFormat:
        """`text.format`, `{"type": "text"}` when not given."""
        if self.text is None or self.text.format is None:
            return TextFormat(type="text")
        return self.text.format

    def input_messages(self) -> list[ChatMessage]:
        """This request's input as chat messages (instructions not included)."""
        if isinstance(self.input, str):
            return [UserMessage(role="user", content=self.input)]
        return items_to_messages(self.input)

    def to_sampling_params(self, max_tokens_limit: int) -> SamplingParams:
        """The engine's parameters; special tokens stay in the text while tools are in use (their tags are some)."""
        max_tokens = resolve_max_tokens("max_output_tokens", self.max_output_tokens, max_tokens_limit, max_tokens_limit)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=None if self.seed is None else self.seed & SEED_MASK,
            skip_special_tokens=not self.uses_tools,
        )


def _content(content: str | list[InputText]) -> str | list[TextContentPart]:
    if isinstance(content, str):
        return content
    return [TextContentPart(type="text", text=part.text) for part in content]


def items_to_messages(
    items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
) -> list[ChatMessage]:
    """Input items as chat messages: consecutive `function_call`s (after an assistant message or not) are one
    assistant message with several tool calls, as the model wrote them in one turn; a `reasoning` item is the
    `reasoning_content` of the assistant message that follows it (one of its own when none follows)."""
    messages: list[ChatMessage] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they belong to

    def thinking() -> str | None:
        text = "\n".join(reasoning) or None
        reasoning.clear()
        return text

    def flush() -> None:  # reasoning that no assistant message follows: a turn that was all thinking
        if reasoning:
            messages.append(AssistantMessage(role="assistant", content="", reasoning_content=thinking()))

    for item in items:
        if isinstance(item, ReasoningItem):
            if item.text:
                reasoning.append(item.text)
        elif isinstance(item, MessageItem) and item.role == "assistant":
            messages.append(AssistantMessage(role="assistant", content=_content(item.content),
                                             reasoning_content=thinking()))  # fmt: skip
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if isinstance(last, AssistantMessage) and not reasoning:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:  # a new turn (reasoning before a call opens one)
                messages.append(AssistantMessage(role="assistant", content=None, tool_calls=[call],
                                                 reasoning_content=thinking()))  # fmt: skip
        else:
            flush()
            if isinstance(item, MessageItem):
                content = _content(item.content)
                if item.role == "user":
                    messages.append(UserMessage(role="user", content=content))
                else:
                    messages.append(SystemMessage(role=item.role, content=content))
            else:
                output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
                messages.append(ToolMessage(role="tool", content=output, tool_call_id=item.call_id))
    flush()
    return messages


# -- the output -----------------------------------------------------------------------------------------------------


class OutputBuilder:
    """The model's text as output items, and the stream events that build them, in order.

    With a reasoning format, the reasoning part of the text (server/reasoning.py) goes into a `reasoning` item, the
    first, opened at the first reasoning text and closed when the content begins (or at the end); the rest is
    content. Content text goes into a `message` item, opened at the first text; a tool call closes it and becomes a
    `function_call` item; text after a call opens a new message. `feed` and `finish` return the events of what they
    added (a non-streaming route just ignores them); `items` is the output so far, and `assistant_message()` the
    turn as a chat message for the conversation's history. Every event gets the next `sequence_number`.
    """

    def __init__(
        self, fmt: ToolCallFormat | None, allowed: frozenset[str] | None, thinking: ReasoningFormat | None = None
    ) -> None:
        self.parser = ToolCallStreamParser(fmt.start, fmt.end, allowed) if fmt is not None else None
        self.thinker = ReasoningStreamParser(thinking) if thinking is not None else None
        self.items: list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionToolCall] = []
        self.sequence = 0
        self._reasoning_item: ResponseReasoningItem | None = None  # the open reasoning item
        self._reasoning: list[str] = []  # its text, in pieces
        self._message: ResponseOutputMessage | None = None  # the open message item
        self._text = ""
        self._calls: list[ToolCall] = []
        self._content = ""
        self._finished = False

    def event(self, cls: type[BaseModel], **fields: Any) -> BaseModel:
        """An event of type `cls` with the next sequence number."""
        event = cls(type=get_args(cls.model_fields["type"].annotation)[0], sequence_number=self.sequence, **fields)
        self.sequence += 1
        return event

    def feed(self, text: str) -> list[BaseModel]:
        if self.thinker is None:
            return self._add_content(text)
        return self._split(self.thinker.feed(text))

    def finish(self, cut: bool = False) -> list[BaseModel]:
        """The model is done: flush held text, close the open items (nothing the second time). `cut`: the reply was
        cut by `max_output_tokens`; the item it ended in (its reasoning, or its message) is then `incomplete`, as
        OpenAI marks it."""
        if self._finished:
            return []
        self._finished = True
        events = self._split(self.thinker.finish()) if self.thinker is not None else []
        status: Literal["completed", "incomplete"] = "incomplete" if cut else "completed"
        events += self._close_reasoning(status)  # (only a reasoning block still open when the reply ended)
        events += self._apply(self.parser.finish()) if self.parser is not None else []
        return events + self._close_message(status)

    def assistant_message(self) -> AssistantMessage:
        """This turn in the conversation's history: its text, its tool calls and its reasoning (empty text when it
        has neither text nor calls: a reply that was all reasoning, or nothing)."""
        return AssistantMessage(
            role="assistant", content=self._content or (None if self._calls else ""), tool_calls=self._calls or None,
            reasoning_content="".join(self._reasoning) or None,
        )  # fmt: skip

    def _split(self, parts: list[tuple[str, str]]) -> list[BaseModel]:
        """The reasoning parser's parts: reasoning into the reasoning item, content (which closes it) on."""
        events: list[BaseModel] = []
        for kind, text in parts:
            if kind == "reasoning":
                events += self._add_reasoning(text)
            else:
                events += self._close_reasoning("completed") + self._add_content(text)
        return events

    def _add_content(self, text: str) -> list[BaseModel]:
        if self.parser is None:
            return self._add_text(text) if text else []
        return self._apply(self.parser.feed(text))

    def _add_reasoning(self, text: str) -> list[BaseModel]:
        events: list[BaseModel] = []
        item = self._reasoning_item
        if item is None:
            item = self._reasoning_item = ResponseReasoningItem(
                id="rs_" + uuid.uuid4().hex, type="reasoning", summary=[], content=[], status="in_progress"
            )
            index = len(self.items)
            self.items.append(item)
            events.append(self.event(ResponseOutputItemAddedEvent, output_index=index, item=item.model_copy()))
            events.append(self.event(ResponseContentPartAddedEvent, item_id=item.id, output_index=index,
                                     content_index=0, part={"type": "reasoning_text", "text": ""}))  # fmt: skip
        self._reasoning.append(text)
        events.append(self.event(ResponseReasoningTextDeltaEvent, item_id=item.id, output_index=self.items.index(item),
                                 content_index=0, delta=text))  # fmt: skip
        return events

    def _close_reasoning(self, status: Literal["completed", "incomplete"]) -> list[BaseModel]:
        if self._reasoning_item is None:
            return []
        item, self._reasoning_item = self._reasoning_item, None
        index = self.items.index(item)
        text = "".join(self._reasoning)
        item.content = [ReasoningText(type="reasoning_text", text=text)]
        item.status = status
        return [
            self.event(ResponseReasoningTextDoneEvent, item_id=item.id, output_index=index, content_index=0, text=text),
            self.event(ResponseContentPartDoneEvent, item_id=item.id, output_index=index, content_index=0,
                       part={"type": "reasoning_text", "text": text}),
            self.event(ResponseOutputItemDoneEvent, output_index=index, item=item),
        ]  # fmt: skip

    def _apply(self, parsed: list[ContentDelta | DeltaToolCall]) -> list[BaseModel]:
        events: list[BaseModel] = []
        for piece in parsed:
            if isinstance(piece, ContentDelta):
                events += self._add_text(piece.text)
            elif piece.id is not None:  # the first of a call's two deltas: the whole call is in the parser
                call = self.parser.tool_calls[piece.index]
                events += self._close_message() + self._add_call(call.id, call.function.name, call.function.arguments)
        return events

    def _add_text(self, text: str) -> list[BaseModel]:
        events: list[BaseModel] = []
        if self._message is None:
            self._message = ResponseOutputMessage(
                id="msg_" + uuid.uuid4().hex, type="message", role="assistant", status="in_progress", content=[]
            )
            self._text = ""
            index = len(self.items)
            self.items.append(self._message)
            events.append(self.event(ResponseOutputItemAddedEvent, output_index=index, item=self._message.model_copy()))
            part = ResponseOutputText(type="output_text", text="", annotations=[], logprobs=[])
            events.append(self.event(ResponseContentPartAddedEvent, item_id=self._message.id, output_index=index,
                                     content_index=0, part=part))  # fmt: skip
        self._text += text
        self._content += text
        events.append(self.event(ResponseTextDeltaEvent, item_id=self._message.id, output_index=len(self.items) - 1,
                                 content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return events

    def _close_message(self, status: Literal["completed", "incomplete"] = "completed") -> list[BaseModel]:
        if self._message is None:
            return []
        message, self._message = self._message, None
        index = self.items.index(message)
        part = ResponseOutputText(type="output_text", text=self._text, annotations=[], logprobs=[])
        message.content = [part]
        message.status = status
        return [
            self.event(ResponseTextDoneEvent, item_id=message.id, output_index=index, content_index=0,
                       text=self._text, logprobs=[]),
            self.event(ResponseContentPartDoneEvent, item_id=message.id, output_index=index, content_index=0,
                       part=part),
            self.event(ResponseOutputItemDoneEvent, output_index=index, item=message),
        ]  # fmt: skip

    def _add_call(self, call_id: str, name: str, arguments: str) -> list[BaseModel]:
        self._calls.append(ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments)))
        item = ResponseFunctionToolCall(
            id="fc_" + uuid.uuid4().hex, type="function_call", call_id=call_id, name=name, arguments="",
            status="in_progress",
        )  # fmt: skip
        index = len(self.items)
        self.items.append(item)
        added = self.event(ResponseOutputItemAddedEvent, output_index=index, item=item.model_copy())
        item.arguments = arguments
        item.status = "completed"
        return [
            added,
            self.event(ResponseFunctionCallArgumentsDeltaEvent, item_id=item.id, output_index=index, delta=arguments),
            self.event(ResponseFunctionCallArgumentsDoneEvent, item_id=item.id, output_index=index,
                       arguments=arguments, name=name),
            self.event(ResponseOutputItemDoneEvent, output_index=index, item=item),
        ]  # fmt: skip


class ReasoningTokens:
    """How many of the reply's tokens are its reasoning (`output_tokens_details.reasoning_tokens`), counted exactly:
    the tokens the model sampled up to and including the one that completes the end tag (tags included), all of
    them while the block is open, none when the reply does not open with the start tag.

    Exact because it counts the sampled tokens themselves, decoded again one at a time as the engine decodes them
    (the same detokenizer, the same `skip_special_tokens`) until the end tag shows. Encoding the reasoning text
    again would not be: the model's tokens need not be the tokenizer's encoding of their text, and the tags and a
    token that spans the end tag and the content would be lost or split. Decoding stops at the end tag, so the cost
    is the reasoning's tokens, once, as they arrive; only a tail of the text, where the tag may be, is kept.
    """

    def __init__(self, tok: Tokenizer, fmt: ReasoningFormat, skip_special_tokens: bool) -> None:
        self.fmt = fmt
        self._detok = IncrementalDetokenizer(tok, skip_special_tokens)
        self._state: Literal["start", "reasoning", "content"] = "start"
        self._text = ""  # "start": all the text so far; "reasoning": a tail that may hold the start of the end tag
        self.tokens = 0

    def add(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if self._state == "content":
                return
            self.tokens += 1
            text = self._text + self._detok.add(token_id)
            if self._state == "start":
                body = self.fmt.opening(text)
                if body is None:
                    self._text = text  # not yet known whether the reply opens with the start tag
                    continue
                if not body.startswith(self.fmt.start):
                    self._state, self.tokens = "content", 0  # no reasoning part
                    return
                self._state, text = "reasoning", body[len(self.fmt.start) :]
            if self.fmt.end in text:
                self._state = "content"
                return
            self._text = text[max(0, len(text) - len(self.fmt.end) + 1) :]

    def count(self, finish_reason: str | None) -> int:
        """The reasoning tokens of the whole reply; a block never closed holds all of it but a final stop token."""
        if self._state == "start":
            return 0  # never shown to open the block: all content
        if self._state == "reasoning" and finish_reason == "stop":
            return self.tokens - 1
        return self.tokens


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> ResponseUsage:
    """Token counts; `input_tokens_details.cached_tokens`: input tokens the previous response's state already held;
    `output_tokens_details.reasoning_tokens`: output tokens of the reasoning item (`ReasoningTokens`)."""
    details: dict[str, int] = {"cached_tokens": cached_tokens}
    if "cache_write_tokens" in InputTokensDetails.model_fields:  # newer SDKs: tokens written to a prompt cache
        details["cache_write_tokens"] = 0
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(**details),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=input_tokens + output_tokens,
    )


def response_object(
    body: ResponsesRequest,
    rid: str,
    model: str,
    created_at: float,
    output: list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionToolCall],
    status: Literal["in_progress", "completed", "incomplete"],
    usage_: ResponseUsage | None = None,
) -> Response:
    """The response object of `body`, as `POST` returns it, `GET` replays it and stream events carry it."""
    tool_choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
    return Response(
        id=rid,
        object="response",
        created_at=created_at,
        model=model,
        status=status,
        output=list(output),
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        tools=[FunctionTool(**t.model_dump(exclude_none=True)) for t in body.tools or []],
        tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_output_tokens=body.max_output_tokens,
        store=body.store,
        metadata=body.metadata or {},
        text={"format": body.text_format.model_dump(by_alias=True, exclude_none=True)},
        reasoning=body.reasoning.model_dump(exclude_none=True) if body.reasoning is not None else None,
        truncation="disabled",
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        error=None,
        usage=usage_,
        user=body.user,
    )


def now() -> float:
    return float(int(time.time()))


def sse(event: BaseModel) -> str:
    """One Responses API server-sent event: its type on the `event:` line, the JSON on one `data:` line."""
    return f"event: {event.type}\ndata: {one_line(event.model_dump_json())}\n\n"




# -- stored responses -----------------------------------------------------------------------------------------------


@dataclass
class StoredResponse:
    """A stored response: what `GET` returns, who may see it, and how to continue it.

    session_id: the session whose state is the conversation at the end of this response (forked by each
        continuation, so the response itself can be continued again). messages: that conversation as chat
        messages, without instructions (OpenAI does not carry them over), for the template to render it again.
    turn: the tokens behind that state, so that a continuation extends exactly them (`TurnTokens`); None when the
        chat template does not render a reply as header, content, end of turn.
    """

    response: Response
    owner: str | None
    session_id: str
    messages: list[ChatMessage] = field(default_factory=list)
    turn: TurnTokens | None = None


@dataclass
class TurnTokens:
    """The conversation at the end of a response, as tokens and as the template's text.

    tokens: this turn's prompt and the reply as the model sampled it, without a final stop token (the state holds
    them, but for the last one sampled). tail: the text the template writes after a reply (its end of turn, e.g.
    `<|im_end|>\n`). text: the whole conversation rendered, instructions and tools included, the reply as the
    template writes it. A continuation whose prompt text begins with `text` becomes `tokens` plus the encoding of
    `tail` and its new text: the reply is never encoded again, so the stored state is reused even when the
    model's tokens are not what encoding its text would give.
    """

    tokens: list[int]
    tail: str
    text: str

    # Stands in for the reply when the template is rendered to find what it writes around one.
    SENTINEL: ClassVar[str] = "<<kvfree-reply-0b1c>>"

    @classmethod
    def of_turn(
        cls, render: Callable[[list[ChatMessage]], str], prompt_text: str, history: list[ChatMessage],
        reply: AssistantMessage, prompt_ids: list[int], reply_ids: list[int],
    ) -> TurnTokens | None:  # fmt: skip
        """The turn's tokens, or None when the template does not write a reply as `prompt_text` (the header),
        its content, then a fixed tail. `render` renders messages without a generation prompt; `history` holds the
        instructions and the conversation before the reply; `reply_ids` end without their stop token."""
        marked = render([*history, AssistantMessage(role="assistant", content=cls.SENTINEL)])
        head, found, tail = marked.partition(cls.SENTINEL)
        text = render([*history, reply])
        if not found or head != prompt_text or cls.SENTINEL in tail or not text.endswith(tail):
            return None
        return cls(tokens=[*prompt_ids, *reply_ids], tail=tail, text=text)

    def continued(self, full_text: str, encode: Callable[[str], list[int]]) -> list[int] | None:
        """The prompt of a continuation: these tokens, then the rest of `full_text` encoded; None when `full_text`
        does not begin with this conversation as rendered then (other instructions or tools, or a template that
        writes earlier turns differently) and the whole text must be encoded."""
        if not full_text.startswith(self.text):
            return None
        return [*self.tokens, *encode(self.tail + full_text[len(self.text) :])]


class ResponseStore:
    """Stored responses by id, scoped by API key as sessions are: another key's id reads as unknown.

    The state of each lives in its session (GPU slot, host memory or the session store, as the session manager
    moves it); this keeps the small rest in memory and, when the server has a session store, writes it there too
    (`SessionStore.write_record`), so that another replica, or this one after a restart, can continue it.
    """

    ID = re.compile(r"resp_[0-9a-f]{32}")

    def __init__(self, store: SessionStore | None = None, max_cached: int = 10_000) -> None:
        self.store = store
        # Without a store this is the only copy (bounded by the sessions the server can hold, one per response);
        # with one, the least recently used records beyond `max_cached` are dropped here and read back on use.
        self.max_cached = max_cached
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, stored: StoredResponse) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.store.write_record, stored.response.id, encode_stored(stored))
        self._remember(stored)

    async def get(self, response_id: str, owner: str | None, param: str | None = None) -> StoredResponse:
        """The response, or a 404 naming `param` (the same for an unknown id and another key's).

        A store other replicas write (Redis) is read every time: another replica may have deleted the record."""
        shared = self.store is not None and self.store.shared
        stored = None if shared else self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        elif self.store is not None and self.ID.fullmatch(response_id):
            data = await asyncio.to_thread(self.store.read_record, response_id)
            if data is not None:
                stored = decode_stored(data)
                self._remember(stored)
            else:
                self._items.pop(response_id, None)
        if stored is None or stored.owner != owner:
            raise not_found(f"no stored response {response_id!r}", param, code="response_not_found")
        return stored

    async def pop(self, response_id: str, owner: str | None) -> StoredResponse:
        stored = await self.get(response_id, owner, "response_id")
        if self.store is not None:
            await asyncio.to_thread(self.store.delete_record, response_id)
        self._items.pop(response_id, None)
        return stored

    def _remember(self, stored: StoredResponse) -> None:
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while self.store is not None and len(self._items) > self.max_cached:
            self._items.popitem(last=False)


_MESSAGES = TypeAdapter(list[ChatMessage])


def encode_stored(stored: StoredResponse) -> bytes:
    """A stored response as JSON: the response object, its owner, its session, its conversation."""
    return json.dumps(
        {
            "response": stored.response.model_dump(mode="json"),
            "owner": stored.owner,
            "session_id": stored.session_id,
            "messages": _MESSAGES.dump_python(stored.messages, mode="json", exclude_none=True),
            "turn": None if stored.turn is None else asdict(stored.turn),
        }
    ).encode()


def decode_stored(data: bytes) -> StoredResponse:
    raw = json.loads(data)
    return StoredResponse(
        response=Response.model_validate(raw["response"]),
        owner=raw["owner"],
        session_id=raw["session_id"],
        messages=_MESSAGES.validate_python(raw["messages"]),
        turn=TurnTokens(**raw["turn"]) if raw.get("turn") else None,
    )
