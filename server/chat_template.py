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


def stop_at_turn_end(params: SamplingParams, tok: Tokenizer) -> SamplingParams:
    """`params` that also stop at the chat template's end-of-turn token (when the tokenizer has one)."""
    ids = [i for t in TURN_END_TOKENS if (i := tok.token_to_id(t)) is not None]
    return replace(params, stop_token_ids=[*params.stop_token_ids, *ids]) if ids else params
