"""Clients of a kvfree server: `KvfreeClient` / `AsyncKvfreeClient` for sessions and chat turns on them (what the
OpenAI SDK does not cover), and `kvfree chat`, a terminal chat on a session (clients/chat.py)."""

from kvfree.clients.client import AsyncKvfreeClient, KvfreeClient, collect
from kvfree.clients.retry import RetryPolicy
from kvfree.clients.types import ChatDelta, ChatResult, KvfreeAPIError, SessionInfo

__all__ = [
    "AsyncKvfreeClient",
    "ChatDelta",
    "ChatResult",
    "KvfreeAPIError",
    "KvfreeClient",
    "RetryPolicy",
    "SessionInfo",
    "collect",
]
