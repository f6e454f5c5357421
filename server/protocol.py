"""The HTTP API's bodies as pydantic models: requests validated strictly, responses in OpenAI's shape.

Requests are validated strictly: wrong JSON types are errors (no `"5"` for 5, no `true` for 1), NaN and
infinities are refused (Python's JSON parser accepts `NaN` and `Infinity`), and every range matches what
`engine.sampling.SamplingParams` accepts, so a request that validates never fails later in the engine. Unknown
fields are ignored, as OpenAI SDKs and tools send fields (`metadata`, `store`, `service_tier`...) a server may not
know. Known OpenAI fields that would change the output and that kvfree does not implement (`echo`, `suffix`,
`best_of` > n) are refused rather than silently ignored.

The upper bound of `max_tokens` is a server setting, so it is checked by `to_sampling_params(max_tokens_limit)`,
which raises an `APIError` (400) naming the field.

Responses use the `openai` package's own types where they fit kvfree's replies as they are (usage, chat logprobs,
tool calls, the model object), sent with the fields kvfree sets (`AsSet`); the other response models are kvfree's,
each saying why OpenAI's does not fit.

Extensions to OpenAI's schema: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos` and
`structured_outputs` (as in vLLM), `session_id` on requests and `session` on responses (see architecture.md §6),
the server's limits on the model object, and the session bodies.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from openai.types import CompletionUsage, Model
from openai.types.chat import ChatCompletionMessageToolCall
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_usage import PromptTokensDetails
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    WrapSerializer,
    field_validator,
    model_serializer,
    model_validator,
)

from kvfree.engine.protocol import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams
from kvfree.server.errors import invalid_request

# The most completions one request may ask for (`n`): each holds a pool slot while it decodes.
MAX_N = 16
MAX_PROMPTS = 256  # prompts in one batched completions request
# OpenAI's limits on stop sequences and on the number of tools.
MAX_STOP = 4
MAX_TOOLS = 128
# Completions default to OpenAI's 16 tokens when `max_tokens` is not given (chat defaults to the server's limit).
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Seeds are int64 as in OpenAI's API; the engine's generators take [0, 2**63), so negative seeds are folded in.
SEED_MASK = 2**63 - 1


def new_id(prefix: str) -> str:
    """A fresh response or object id, e.g. `chatcmpl-<32 hex>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


class RequestModel(BaseModel):
    """Base of every request body: strict JSON types, finite numbers only, unknown fields ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class ResponseModel(BaseModel):
    """Base of every response body (built by the server, so only lightly checked)."""

    model_config = ConfigDict(extra="ignore")


class _OmitNone(BaseModel):
    """Serializes without the fields that are None: streamed deltas carry only what changed, as OpenAI's do."""

    # No return annotation on purpose: with one, pydantic documents the model as a bare object in the schema.
    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler):
        return {key: value for key, value in handler(self).items() if value is not None}


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0, lt=2**31, description="A token id of the served model's vocabulary.")]
PromptCacheKey = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=r"^[\x20-\x7e]+$",
        description="OpenAI's key for requests that share a prefix (1-128 printable ASCII characters). kvfree's prefix "
        "cache matches prompts by their tokens whatever the key; its load balancer configs route on it (deploy/), so "
        "a conversation's turns reach the replica holding its state.",
    ),
]
StopField = NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None


# -- chat messages ------------------------------------------------------------------------------------------------


class TextContentPart(RequestModel):
    """One part of a message's content. Only text parts: the served models read text only."""

    type: Literal["text"] = Field(description='Always `"text"`.')
    text: str = Field(description="The text.")

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        # Without this an image part fails as "Input should be 'text'", which does not say why.
        if isinstance(data, dict) and data.get("type", "text") != "text":
            raise ValueError(f"only text content parts are supported, got type {data.get('type')!r}")
        return data


MessageContent = str | list[TextContentPart]


class FunctionCall(RequestModel):
    """A call the model made: the function's name and its arguments as a JSON string (as OpenAI sends them)."""

    name: str = Field(description="Name of the function called.")
    arguments: str = Field(description='The arguments, a JSON object serialized as a string (e.g. `"{\\"x\\": 1}"`).')


class ToolCall(RequestModel):
    """A tool call in an assistant message of the history: a call a previous reply made."""

    id: str = Field(description="The call's id; a tool message answers it with `tool_call_id`.")
    type: Literal["function"] = Field(default="function", description='Always `"function"`.')
    function: FunctionCall


class SystemMessage(RequestModel):
    """Instructions for the model. `developer` (OpenAI's newer name) is accepted and rendered as `system`."""

    role: Literal["system", "developer"]
    content: MessageContent
    name: str | None = Field(default=None, description="Accepted for compatibility; not shown to the model.")


class UserMessage(RequestModel):
    """A message from the user."""

    role: Literal["user"]
    content: MessageContent
    name: str | None = Field(default=None, description="Accepted for compatibility; not shown to the model.")


class AssistantMessage(RequestModel):
    """A previous reply of the model: text, tool calls, or both."""

    role: Literal["assistant"]
    content: MessageContent | None = None
    tool_calls: list[ToolCall] | None = Field(
        default=None, validate_default=True, description="Calls the model made in this turn."
    )
    name: str | None = Field(default=None, description="Accepted for compatibility; not shown to the model.")
    reasoning_content: str | None = Field(
        default=None, description="The reasoning this reply came with (as returned); the chat template decides its use."
    )

    @field_validator("tool_calls")
    @classmethod
    def _content_or_calls(cls, calls: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if "content" in info.data and info.data["content"] is None and not calls:
            raise ValueError("an assistant message needs `content` or `tool_calls`")
        return calls


class ToolMessage(RequestModel):
    """The result of a tool call, sent back to the model."""

    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str = Field(description="The `id` of the tool call this answers.")


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


# -- tools --------------------------------------------------------------------------------------------------------


class FunctionDefinition(RequestModel):
    """A function the model may call."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="Letters, digits, `_`, `.`, `-`; 1-64 chars.")
    description: str | None = Field(default=None, description="What the function does; shown to the model.")
    parameters: dict[str, Any] | None = Field(
        default=None, description="JSON Schema of the arguments object; shown to the model, and a call's arguments "
        "always validate against it."
    )
    strict: bool | None = Field(default=None, description="Accepted: the arguments' schema is enforced either way.")


class ChatTool(RequestModel):
    """A tool: only functions."""

    type: Literal["function"] = Field(description='Always `"function"`.')
    function: FunctionDefinition


class ToolChoiceFunctionName(RequestModel):
    name: str = Field(description="The function the model must call.")


class NamedToolChoice(RequestModel):
    """Force a call to one function: `{"type": "function", "function": {"name": "..."}}`."""

    type: Literal["function"]
    function: ToolChoiceFunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(RequestModel):
    include_usage: bool = Field(
        default=False,
        description="Send one more chunk before `data: [DONE]` with empty `choices` and the request's `usage`.",
    )


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`: the schema a JSON reply must satisfy."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$", description="Letters, digits, `_`, `-`; 1-64 chars.")
    description: str | None = None
    schema_: dict[str, Any] = Field(
        default_factory=dict, alias="schema", description="The JSON Schema; the reply always validates against it."
    )
    strict: bool | None = Field(default=None, description="Accepted: the schema is enforced either way.")


class ResponseFormat(RequestModel):
    """`{"type": "text"}` (free text), `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
    "json_schema": {...}}` (JSON valid for the schema): the reply is constrained while it is generated."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(default=None, description='Required with `"json_schema"`.')

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a json_schema object')
        return self


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` request field: exactly one of `json`, `regex`, `choice`, `grammar`,
    `json_object`. vLLM's other options (`disable_any_whitespace`...) are accepted and ignored: JSON is always
    written compactly, as `json.dumps` writes it."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json", description="A JSON schema.")
    regex: str | None = Field(default=None, description="A regular expression (Rust syntax) the whole reply matches.")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, description="The reply is exactly one of these strings."
    )
    grammar: str | None = Field(
        default=None, min_length=1, description="A Lark grammar (llguidance's dialect), or GBNF (`::=` rules)."
    )
    json_object: bool | None = Field(default=None, description="Any JSON object.")

    model_config = ConfigDict(populate_by_name=True)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            names = ", ".join(name.rstrip("_") for name in given) or "none"
            raise ValueError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                             f"got {names}")  # fmt: skip
        return self


# -- requests -----------------------------------------------------------------------------------------------------


class GenerationRequest(RequestModel):
    """Fields shared by completions and chat completions: the model, sampling, streaming, sessions."""

    model: str | None = Field(
        default=None,
        description="A model id from `GET /v1/models`. Optional here (OpenAI requires it): omitted means the "
        "server's only model.",
    )
    n: int = Field(default=1, ge=1, le=MAX_N, description=f"Number of completions (1-{MAX_N}).")
    stream: bool = Field(default=False, description="Stream the reply as server-sent events ending in `[DONE]`.")
    stream_options: StreamOptions | None = Field(default=None, description="Only with `stream: true`.")
    max_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens to generate per completion; at most the server's limit."
    )
    temperature: float | None = Field(default=None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables.")
    top_k: int = Field(
        default=-1, ge=-1, lt=2**31, description="Keep the k most likely tokens; -1 or 0 disables (extension)."
    )
    min_p: float = Field(
        default=0.0, ge=0, le=1, description="Drop tokens below min_p times the top probability (extension)."
    )
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, description="Penalty on tokens already generated.")
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, description="Penalty per occurrence in the output.")
    repetition_penalty: float = Field(
        default=1.0, gt=0, le=2, description="Divides logits of tokens in the prompt or output; 1 disables (extension)."
    )
    seed: int | None = Field(
        default=None, ge=-(2**63), le=2**63 - 1, description="Same seed, same request: same output (int64)."
    )
    stop: StopField = Field(
        default=None, description=f"Up to {MAX_STOP} non-empty strings; generation stops at any of them."
    )
    stop_token_ids: list[TokenId] = Field(
        default_factory=list, max_length=64, description="Token ids that also stop generation (extension)."
    )
    ignore_eos: bool = Field(default=False, description="Keep generating past end-of-sequence (extension).")
    prompt_cache_key: PromptCacheKey | None = None
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description=f"vLLM's extension: each prompt token's log-probability under the model (the first null), with "
        f"the {MAX_TOP_LOGPROBS} at most most likely tokens at each position and the prompt token's rank. Such a "
        "request prefills its whole prompt (never from the prefix cache); not with `session_id`.",
    )
    return_tokens_as_token_ids: bool = Field(
        default=False,
        description="In `logprobs`, name each token `token_id:<id>` rather than by its text (vLLM's extension): a "
        "client can then send back exactly the tokens generated, whatever their bytes.",
    )
    session_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="Extension: continue this session (from `POST /v1/sessions`); only the prompt's new suffix is "
        "prefilled. With the OpenAI SDK, pass it in `extra_body`.",
    )
    user: str | None = Field(default=None, description="Accepted for compatibility; ignored.")
    logit_bias: dict[str, float] | None = Field(
        default=None,
        description="Token id (as a string, as OpenAI's) -> a value in [-100, 100] added to its logit before "
        "sampling: 100 all but forces the token, -100 all but bans it.",
    )
    response_format: ResponseFormat | None = Field(
        default=None,
        description='`{"type": "json_object"}` or `{"type": "json_schema", "json_schema": {"name": ..., "schema": '
        "{...}}}`: the reply is JSON (valid for the schema), enforced token by token.",
    )
    structured_outputs: StructuredOutputs | None = Field(
        default=None,
        description="vLLM's field (extension): exactly one of `json` (a schema), `regex`, `choice`, `grammar` "
        "(Lark or GBNF), `json_object`. Not with a non-text `response_format`.",
    )

    @field_validator("structured_outputs")
    @classmethod
    def _one_constraint(cls, value: StructuredOutputs | None, info: ValidationInfo) -> StructuredOutputs | None:
        format_ = info.data.get("response_format")
        if value is not None and format_ is not None and format_.type != "text":
            raise ValueError("give either response_format or structured_outputs, not both")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and info.data.get("stream") is False:
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
        return value

    @property
    def include_usage(self) -> bool:
        """Whether a streamed reply ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self, max_tokens: int, logprobs: int | None, skip_special_tokens: bool = True,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:  # fmt: skip
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=self.top_p,
                top_k=max(self.top_k, 0),
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=None if self.seed is None else self.seed & SEED_MASK,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=skip_special_tokens,
                logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            )
        except ValueError as e:
            # The schema's bounds match SamplingParams', so this is a bug guard; its messages start with the field.
            raise invalid_request(str(e), param=str(e).split(" ", 1)[0]) from None


def resolve_max_tokens(name: str, value: int | None, default: int, limit: int) -> int:
    """The number of tokens to generate: `value` if given (400 naming `name` when over `limit`), else `default`."""
    if value is None:
        return min(default, limit)
    if value > limit:
        raise invalid_request(f"{name} is too large: {value} > {limit}, this server's limit per completion", name)
    return value


class CompletionRequest(GenerationRequest):
    """`POST /v1/completions`: continue a prompt."""

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"model": "kvfree", "prompt": "Once upon a time", "max_tokens": 32}]}
    )

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(
        description=f"Text, token ids, or a batch of up to {MAX_PROMPTS} of either (a list of texts, or of token-id "
        "lists): each prompt gets `n` choices, prompt i's at indexes i*n .. i*n + n - 1."
    )
    max_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Most tokens to generate per completion; at most the server's limit. 0 only with `echo`: the "
        "prompt scored, nothing generated (OpenAI's legacy scoring form).",
    )
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description=f"Return the sampled token's log-probability and the {MAX_TOP_LOGPROBS} at most most likely.",
    )
    echo: bool = Field(
        default=False,
        description="Return the prompt before the completion: its text, and with `logprobs` its tokens' logprobs "
        "(the first null) and offsets, as OpenAI's legacy completions do. Not with `stream` or `session_id`.",
    )
    suffix: str | None = Field(default=None, description="Not supported: must be absent.")
    best_of: int | None = Field(default=None, ge=1, description="Only `best_of == n` (or absent) is supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _batch_size(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_PROMPTS and all(isinstance(p, str | list) for p in value):
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(value)}")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, a batch of one when one was given."""
        batch = isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list)
        return list(self.prompt) if batch else [self.prompt]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and "n" in info.data and value != info.data["n"]:
            raise ValueError(f"best_of other than n is not supported (best_of={value}, n={info.data['n']})")
        return value

    def to_sampling_params(self, max_tokens_limit: int) -> SamplingParams:
        """The engine's parameters. `max_tokens` defaults to 16 (OpenAI's default for completions); 0 (with echo) is
        a request that only scores the prompt, whose parameters say 1 (the engine stops after the prompt). With
        `echo` and `logprobs`, or `prompt_logprobs`, the prompt is scored with the larger of the two k's.

        Raises:
            APIError: 400 naming `max_tokens` when it is over `max_tokens_limit`.
        """
        max_tokens = resolve_max_tokens("max_tokens", self.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, max_tokens_limit)
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return self._sampling_params(max(max_tokens, 1), self.logprobs, prompt_logprobs=max(wanted, default=None))


class ChatCompletionRequest(GenerationRequest):
    """`POST /v1/chat/completions`: the next assistant message of a conversation."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [{"model": "kvfree", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64}]
        }
    )

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far; at least one message.")
    max_completion_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens to generate; takes precedence over the older `max_tokens`."
    )
    logprobs: bool = Field(default=False, description="Return the log-probability of each output token.")
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description=f"With `logprobs`: also the 0-{MAX_TOP_LOGPROBS} most likely tokens at each position.",
    )
    tools: list[ChatTool] | None = Field(
        default=None, max_length=MAX_TOOLS, description="Functions the model may call; shown to it by the template."
    )
    tool_choice: ToolChoice | None = Field(
        default=None,
        description='`"none"`, `"auto"` (default when tools are given), `"required"`, or a named function. Enforced '
        'while generating: `"required"` and a named function make the reply calls (valid for their functions\' '
        'schemas); with `"auto"` the model may answer in text, but a call it opens is a valid one.',
    )
    parallel_tool_calls: bool | None = Field(
        default=None,
        description="With tools: whether the reply may hold several calls (default true); false: at most one.",
    )

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("logprobs") is False:
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        check_unique_tool_names([tool.function.name for tool in tools or []])
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice_matches_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if choice is None or choice == "none" or "tools" not in info.data:
            return choice  # a bad `tools` has its own error
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        check_tool_choice(choice, named, {t.function.name for t in info.data["tools"] or []})
        return choice

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """`tool_choice` with OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def uses_tools(self) -> bool:
        """Whether tools are shown to the model and tool calls parsed from its output."""
        return bool(self.tools) and self.effective_tool_choice != "none"

    def to_sampling_params(self, max_tokens_limit: int) -> SamplingParams:
        """The engine's parameters.

        `max_completion_tokens` wins over `max_tokens`; with neither the reply may use the server's whole limit.
        With tools in use special tokens are kept in the decoded text, because tool-call tags are special tokens
        in kvfree's tokenizers and the tool parser must see them.

        Raises:
            APIError: 400 naming the field used when it is over `max_tokens_limit`.
        """
        if self.max_completion_tokens is not None:
            name, value = "max_completion_tokens", self.max_completion_tokens
        else:
            name, value = "max_tokens", self.max_tokens
        max_tokens = resolve_max_tokens(name, value, max_tokens_limit, max_tokens_limit)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, skip_special_tokens=not self.uses_tools,
                                     prompt_logprobs=self.prompt_logprobs)  # fmt: skip


def check_unique_tool_names(names: list[str]) -> None:
    """ValueError when a tool name repeats (a validator's message)."""
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"tool names must be unique; repeated: {', '.join(duplicates)}")


def check_tool_choice(choice: object, named: str | None, names: set[str]) -> None:
    """ValueError unless a `tool_choice` other than "none" comes with tools and `named` (the function it names,
    if any) is one of them."""
    if not names:
        label = repr(choice) if isinstance(choice, str) else f"for function {named!r}"
        raise ValueError(f"tool_choice {label} needs tools")
    if named is not None and named not in names:
        raise ValueError(f"tool_choice names function {named!r}, which is not in tools")


class SessionCreateRequest(RequestModel):
    """`POST /v1/sessions`: a new session, empty or prefilled with a prompt or a conversation (not both).

    Messages are rendered without the generation prompt, so that a later chat request carrying the same
    messages plus new ones continues from this state.
    """

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"messages": [{"role": "system", "content": "You are terse."}]}]}
    )

    model: str | None = Field(default=None, description="A model id from `GET /v1/models`; omitted: the only one.")
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        default=None, description="Text or token ids to prefill."
    )
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        default=None, description="A conversation to prefill, rendered with the model's chat template."
    )
    tools: list[ChatTool] | None = Field(
        default=None, max_length=MAX_TOOLS, description="With `messages`: tools to render, as a chat request would."
    )

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(cls, messages: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if messages is not None and info.data.get("prompt") is not None:
            raise ValueError("give `prompt` or `messages`, not both")
        return messages

    @field_validator("tools")
    @classmethod
    def _tools_need_messages(cls, tools: list[ChatTool] | None, info: ValidationInfo) -> list[ChatTool] | None:
        if tools and info.data.get("messages") is None:
            raise ValueError("tools are only used with `messages`")
        return tools


class TokenizeRequest(RequestModel):
    """`POST /tokenize` (vLLM's shape): a prompt, or a conversation rendered with the chat template."""

    model: str | None = Field(default=None, description="A model id from `GET /v1/models`; omitted: the only one.")
    prompt: str | None = Field(default=None, description="Text to tokenize.")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = Field(
        default=None, description="A conversation, rendered as a chat request would render it."
    )
    add_generation_prompt: bool = Field(default=True, description="With `messages`: end with the assistant's turn.")
    add_special_tokens: bool = Field(
        default=True,
        description="vLLM's: accepted for its clients; kvfree's tokenizers add no special tokens to a prompt either "
        "way (a chat template writes its own).",
    )

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give `prompt` or `messages` (one of them)")
        return self


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int = Field(description="The longest prompt this server accepts (tokens).")
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    """`POST /detokenize` (vLLM's shape)."""

    model: str | None = Field(default=None, description="A model id from `GET /v1/models`; omitted: the only one.")
    tokens: list[TokenId] = Field(description="Token ids of the served model's vocabulary.")


class DetokenizeResponse(ResponseModel):
    prompt: str


# -- responses ----------------------------------------------------------------------------------------------------


# How an `openai` type inside a kvfree response is sent: with the fields kvfree set, as the SDK's own `to_dict()` and
# `to_json()` send it. OpenAI's types declare every optional field of OpenAI's API (audio, refusal, service_tier...,
# more with each release); those stay off the wire instead of going out as nulls. The schema is the type's own.
# (No return annotation on purpose: with one, pydantic would document the value by it instead.)
def _fields_set(value: BaseModel, handler: SerializerFunctionWrapHandler, info: SerializationInfo):
    return value.model_dump(mode=info.mode, exclude_unset=True)


AsSet = WrapSerializer(_fields_set)

Usage = Annotated[CompletionUsage, AsSet]
ChatLogprobs = Annotated[ChoiceLogprobs, AsSet]
ReplyToolCall = Annotated[ChatCompletionMessageToolCall, AsSet]


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> CompletionUsage:
    """Token counts of one request (all `n` completions together). `cached_tokens`: prompt tokens not prefilled
    again because the session's state already held them (OpenAI's `prompt_tokens_details.cached_tokens`)."""
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


_USAGE = "Token counts; `prompt_tokens_details.cached_tokens`: prompt tokens a session's state already held."


class SessionUsage(ResponseModel):
    """Extension on responses to requests with `session_id`: how the session's state was used."""

    id: str = Field(description="The session.")
    cached_tokens: int = Field(description="Prompt tokens the session already held (not prefilled again).")
    reset: bool = Field(description="True when the session's tokens were not a prefix of the prompt: prefilled anew.")
    num_tokens: int = Field(description="Tokens the session has consumed after this request.")
    resumed_from: Literal["gpu", "host", "store"] | None = Field(
        default=None,
        description="Where the session's state was when the request came: resident in this replica's GPU pool, "
        "in its host memory, or loaded from the session store (a directory or Redis, e.g. after another replica's "
        "turn).",
    )


# -- completions responses ----------------------------------------------------------------------------------------
# kvfree's own models: OpenAI's `Completion` has the same fields, but its choices must have a finish_reason, which a
# streamed chunk has only at the end and an aborted request never has, and its logprobs cannot hold a null entry.

CompletionFinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


class CompletionLogprobs(ResponseModel):
    """Completions logprobs: parallel lists, one entry per output token (a `top_logprobs` entry is null with
    `logprobs: 0`)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """vLLM's entry of `prompt_logprobs`: a token's log-probability at one prompt position, its rank there (1: the
    most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# Per prompt token (the first null): the token at that position and the `prompt_logprobs` most likely, by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason | None = Field(
        default=None, description="`stop`: a stop string, stop token or end of sequence; `length`: max_tokens."
    )
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="With `prompt_logprobs` (vLLM's).")


class CompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage = Field(description=_USAGE)
    system_fingerprint: str | None = None
    session: SessionUsage | None = None


class CompletionChunk(ResponseModel):
    """One server-sent event of a streamed completion (OpenAI uses the same `object` as the full response)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    session: SessionUsage | None = None


# -- chat responses -----------------------------------------------------------------------------------------------
# kvfree's own models around OpenAI's logprobs and tool calls: OpenAI's `ChatCompletion` and `ChatCompletionChunk`
# also declare `metadata`, `moderation`, `service_tier` (and `obfuscation`), and their choices a finish_reason that
# kvfree may not have (see completions above).


# Not OpenAI's `ChatCompletionMessage`: its schema also has `refusal`, `annotations`, `audio` and custom tool calls,
# none of which kvfree makes, and its `role` has no default.
class ChatCompletionMessage(ResponseModel):
    """The reply: the assistant's text and function calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None = Field(default=None, description="The text; null when the reply is only tool calls.")
    reasoning_content: str | None = Field(
        default=None, description="The model's thinking, for checkpoints that declare reasoning tags; else absent."
    )
    tool_calls: list[ReplyToolCall] | None = None

    # Without a reasoning part the field stays off the wire (OpenAI's message has no such field; `content` and
    # `tool_calls` are still sent as nulls, as OpenAI's are). No return annotation: see `_OmitNone`.
    @model_serializer(mode="wrap")
    def _omit_absent_reasoning(self, handler: SerializerFunctionWrapHandler):
        data = handler(self)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = Field(
        default=None, description="`stop`, `length` (max_tokens), or `tool_calls` (the reply ends in tool calls)."
    )


class ChatCompletionResponse(ResponseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage = Field(description=_USAGE)
    system_fingerprint: str | None = None
    session: SessionUsage | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, description="With `prompt_logprobs` (vLLM's).")


# The deltas are kvfree's, not OpenAI's `ChoiceDelta*`: a delta, and each tool-call piece the parser emits, dumps as
# only what changed wherever it is dumped (`_OmitNone`); OpenAI's types dump every field (`AsSet` works only inside
# a kvfree model).


class DeltaFunctionCall(_OmitNone, ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OmitNone, ResponseModel):
    """A streamed piece of a tool call: the first has id, type and name (arguments ""), later ones arguments."""

    index: int = Field(description="Which call of the message this piece belongs to (0, 1, ...).")
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_OmitNone, ResponseModel):
    """What a chunk adds to the message; fields that did not change are left out."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None = None


class ChatCompletionChunk(ResponseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    session: SessionUsage | None = None


# -- models -------------------------------------------------------------------------------------------------------


class ModelCard(Model):
    """OpenAI's model object, with the server's limits as extensions (as vLLM's `max_model_len`), so that clients
    and load tests need not probe for them."""

    max_prompt_tokens: int | None = Field(default=None, description="Longest prompt accepted (tokens).")
    max_output_tokens: int | None = Field(default=None, description="Largest max_tokens accepted.")
    max_context: int | None = Field(
        default=None, description="Prompt + output limit of models with attention layers; null: no limit (recurrent)."
    )
    state_bytes_per_session: int | None = Field(default=None, description="Reserved state bytes per pool slot.")
    session_slots: int | None = Field(
        default=None, description="Sessions decoded at once (the GPU pool's slots), each holding `max_context`."
    )


# The `openai` package has no type for the list itself (its SDK pages through `data`).
class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[Annotated[ModelCard, AsSet]]


# -- sessions -----------------------------------------------------------------------------------------------------


class SessionInfo(ResponseModel):
    """A session: a conversation's recurrent state held by the server (fixed size, whatever its length)."""

    id: str
    object: Literal["session"] = "session"
    created: int
    last_used: int | None = Field(default=None, description="Unix time of the last request that used it.")
    model: str
    num_tokens: int = Field(description="Tokens the state has consumed.")
    location: str = Field(
        description="Where the state is now: `gpu`, a state-pool slot, ready to decode (the tier keeps this name on a "
        "CPU-only server, whose pool is in host RAM); `host`: idle, packed in host "
        "memory; `disk`: in the session store (a directory or Redis)."
    )
    state_bytes: int = Field(
        description="Bytes of state the session holds: fixed for recurrent layers, whatever the context; layers "
        "with a KV cache (the attention baseline) add their filled entries."
    )


class SessionList(ResponseModel):
    """A page of sessions, as OpenAI lists objects."""

    object: Literal["list"] = "list"
    data: list[SessionInfo]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class SessionDeleted(ResponseModel):
    id: str
    object: Literal["session.deleted"] = "session.deleted"
    deleted: bool = True


# -- server-sent events -------------------------------------------------------------------------------------------

SSE_DONE = "data: [DONE]\n\n"


# Characters that str.splitlines() (and so httpx's aiter_lines and many SSE readers) treats as line breaks but
# JSON leaves raw; a model emitting one would cut its event in two. Control characters are escaped by JSON already.
_LINE_BREAKS_JSON_KEEPS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def one_line(data: str) -> str:
    for raw, escaped in _LINE_BREAKS_JSON_KEEPS.items():
        data = data.replace(raw, escaped)
    return data


def sse_event(body: BaseModel) -> str:
    """One server-sent event carrying `body` as JSON (a chunk, or an `ErrorResponse` when a stream fails).

    The event is one line whatever the text holds: the Unicode line separators are written as JSON escapes.
    """
    return f"data: {one_line(body.model_dump_json())}\n\n"


class TextEvents:
    """The server-sent events of chunks that differ only in one text field: the hot path of a stream.

    Building and serialising a pydantic chunk per token costs tens of microseconds, on the thread that also
    serves every other stream; here the chunk is serialised once, with a placeholder for the text, and each event
    splices the JSON-escaped text in. `make(text)` builds the chunk (`created` is then that of the first event,
    as every chunk of an OpenAI stream carries the same).
    """

    _PLACEHOLDER = "\x00kvfree-text\x00"

    def __init__(self, make: Callable[[str], BaseModel]) -> None:
        rendered = sse_event(make(self._PLACEHOLDER))
        self._head, self._tail = rendered.split(json.dumps(self._PLACEHOLDER)[1:-1])

    def event(self, text: str) -> str:
        return self._head + one_line(json.dumps(text, ensure_ascii=False)[1:-1]) + self._tail
