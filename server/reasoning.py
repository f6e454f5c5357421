"""Reasoning content: the model's thinking, split out of its reply as `reasoning_content` (as vLLM's parsers do).

A checkpoint that thinks declares its tags in `tokenizer_config.json` (`reasoning_start`, `reasoning_end`, e.g.
Qwen3's `<think>` and `</think>`). As vLLM's Qwen3 parser: a reply that opens with the start tag (after whitespace)
has reasoning, the text up to the end tag; the content is what follows it, its leading newlines dropped. A reply
that opens the tag and never closes it (cut by max_tokens) is all reasoning; a reply that does not open with the tag
is all content (a template that switched thinking off, e.g. Qwen3's `enable_thinking=False`, closes an empty block
in the prompt). Tool calls are parsed from the content only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Part = tuple[Literal["reasoning", "content"], str]


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags around the model's thinking."""

    start: str
    end: str

    @classmethod
    def from_tokenizer_config(cls, config: Mapping[str, Any]) -> ReasoningFormat | None:
        """The format a checkpoint declares; None when it declares none (its replies have no reasoning part)."""
        start, end = config.get("reasoning_start"), config.get("reasoning_end")
        if isinstance(start, str) and isinstance(end, str) and start and end:
            return cls(start, end)
        return None

    def opening(self, text: str) -> str | None:
        """How the start of a reply `text` stands: None while it may still become the start tag (only whitespace or
        a prefix of the tag so far), else its text with leading whitespace dropped (which starts with the tag exactly
        when the reply has a reasoning part)."""
        body = text.lstrip()
        if not body or (self.start.startswith(body) and body != self.start):
            return None
        return body

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply -> (reasoning or None, content)."""
        body = text.lstrip()
        if not body.startswith(self.start):
            return None, text
        body = body[len(self.start) :]
        if self.end not in body:
            return body, ""
        reasoning, content = body.split(self.end, 1)
        return reasoning, content.lstrip("\n")


class ReasoningStreamParser:
    """Splits streamed model text into reasoning and content parts, the same split as `ReasoningFormat.split`.

    Text that might still be the start of a tag (`</thi` at the end of a piece) is held back until the next piece
    decides it; leading whitespace is held until the first real text shows whether a start tag follows.
    """

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._held = ""
        self._state: Literal["start", "reasoning", "content"] = "start"
        self._strip_newlines = False  # right after the end tag: drop the content's leading newlines

    def feed(self, text: str) -> list[Part]:
        """Take the next piece of the model's text; returns what can be sent now."""
        self._held += text
        out: list[Part] = []
        while True:
            if self._state == "start":
                body = self.fmt.opening(self._held)
                if body is None:
                    return out  # not yet known whether the reply opens with the start tag
                if body.startswith(self.fmt.start):
                    self._held, self._state = body[len(self.fmt.start) :], "reasoning"
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                at = self._held.find(self.fmt.end)
                if at < 0:
                    keep = _partial_suffix(self._held, self.fmt.end)
                    out += _part("reasoning", self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                    return out
                out += _part("reasoning", self._held[:at])
                self._held = self._held[at + len(self.fmt.end) :]
                self._state, self._strip_newlines = "content", True
            else:
                if self._strip_newlines:
                    self._held = self._held.lstrip("\n")
                    if not self._held:
                        return out
                    self._strip_newlines = False
                out += _part("content", self._held)
                self._held = ""
                return out

    def finish(self) -> list[Part]:
        """The model is done: flush what was held (inside an unclosed reasoning block: more reasoning)."""
        held, self._held = self._held, ""
        if self._state == "start":
            return _part("content", held)
        if self._state == "reasoning":
            return _part("reasoning", held)
        return _part("content", held.lstrip("\n") if self._strip_newlines else held)


def _part(kind: Literal["reasoning", "content"], text: str) -> list[Part]:
    return [(kind, text)] if text else []


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag` (it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
