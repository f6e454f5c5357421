"""The checkpoint's chat template: a conversation as prompt text, and generation that stops at the turn's end."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import jinja2

from kvfree.checkpoints import CheckpointError
from kvfree.engine.protocol import SamplingParams
from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.server.errors import invalid_request
from kvfree.server.protocol import ChatMessage
from kvfree.server.tools import template_messages

# Chat templates end an assistant turn with this token; generation must stop there.
TURN_END_TOKENS = ("<|im_end|>",)


def render_chat(
    tok: Tokenizer, messages: list[ChatMessage], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
) -> str:
    """A conversation as prompt text, through the checkpoint's chat template; a 400 naming `messages` when the
    checkpoint has no template or it cannot render these messages."""
    try:
        return tok.apply_chat_template(
            template_messages(messages), add_generation_prompt=add_generation_prompt, tools=tools
        )
    except CheckpointError as exc:
        raise invalid_request(str(exc), "messages") from None
    except jinja2.TemplateError as exc:
        raise invalid_request(f"the chat template could not render these messages: {exc}", "messages") from None


def boundary_prefixes(
    tok: Tokenizer, messages: list[ChatMessage], tools: list[dict[str, Any]] | None, text: str
) -> list[str]:
    """Prompt texts ending at message boundaries of `text` (the conversation rendered for generation), where the
    prefix cache keeps the state for later requests: after the leading system messages (shared by the other
    conversations under that system prompt) and before the last user message (the earlier turns: what a re-sent or
    edited last message resumes from). Each is the template's rendering of the messages before the boundary, kept
    only when `text` begins with it (a template that renders a prefix otherwise marks nothing there)."""
    cuts: set[int] = set()
    leading = 0
    while leading < len(messages) and messages[leading].role in ("system", "developer"):
        leading += 1
    if 0 < leading < len(messages):
        cuts.add(leading)
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=0)
    if last_user > 0:
        cuts.add(last_user)
    prefixes = []
    for cut in sorted(cuts):
        try:
            before = template_messages(messages[:cut])
            prefix = tok.apply_chat_template(before, add_generation_prompt=False, tools=tools)
        except (CheckpointError, jinja2.TemplateError):  # a template that refuses a partial conversation
            continue
        if prefix and len(prefix) < len(text) and text.startswith(prefix):
            prefixes.append(prefix)
    return prefixes


def stop_at_turn_end(params: SamplingParams, tok: Tokenizer) -> SamplingParams:
    """`params` that also stop at the chat template's end-of-turn token (when the tokenizer has one)."""
    ids = [i for t in TURN_END_TOKENS if (i := tok.token_to_id(t)) is not None]
    return replace(params, stop_token_ids=[*params.stop_token_ids, *ids]) if ids else params
