"""What the kvfree client returns: typed session records, chat results and stream events, and the API error."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class KvfreeAPIError(RuntimeError):
    """An error response of the server (OpenAI-shaped): its HTTP status and what the body says."""

    def __init__(
        self, status: int, message: str, type_: str | None = None, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    @classmethod
    def from_response(cls, status: int, body: bytes) -> KvfreeAPIError:
        import json

        try:
            error = json.loads(body)["error"]
            return cls(status, error.get("message", ""), error.get("type"), error.get("param"), error.get("code"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(status, body.decode("utf-8", "replace")[:500] or "no body")


@dataclass(frozen=True)
class SessionInfo:
    """A session held by the server: its id, how many tokens its state has consumed, where it is and its size."""

    id: str
    created: int
    model: str
    num_tokens: int
    location: str
    state_bytes: int
    last_used: int | None = None

    @classmethod
    def of(cls, body: dict[str, Any]) -> SessionInfo:
        return cls(
            id=body["id"],
            created=body["created"],
            model=body["model"],
            num_tokens=body["num_tokens"],
            location=body["location"],
            state_bytes=body["state_bytes"],
            last_used=body.get("last_used"),
        )


@dataclass(frozen=True)
class ChatDelta:
    """One event of a streamed chat reply: new text, and on the last one the finish reason and usage."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    session: dict[str, Any] | None = None  # the server's session usage: id, cached_tokens, ...


@dataclass
class ChatResult:
    """A whole chat reply."""

    text: str
    finish_reason: str | None
    usage: dict[str, Any] = field(default_factory=dict)
    session: dict[str, Any] | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the session already held (0 without a session)."""
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
