"""Which server a load test talks to: URL validation and the loopback check.

The load generator only ever talks to the URLs it is given (there is no remote default), so a typo must fail
before any request is sent, with a message that says what is wrong with the URL.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "http://127.0.0.1:8000"  # where `kvfree serve` listens by default


class TargetError(ValueError):
    """A URL that cannot be a server's base URL (the message says why)."""


@dataclass(frozen=True)
class Target:
    """One server under test: its base URL (scheme://host[:port][/prefix], no trailing slash) and a label."""

    url: str
    label: str

    @property
    def loopback(self) -> bool:
        return is_loopback(self.url)


def parse_target_url(raw: str) -> str:
    """`raw` normalised to a base URL (`http://host:port[/prefix]`), or a `TargetError` that names the problem.

    A path prefix is kept (a server behind a reverse proxy at `/kvfree`); a trailing `/v1` is dropped because the
    routes are appended with their `/v1`. Queries, fragments and credentials in the URL are refused: they would be
    silently lost or leaked into logs.
    """
    text = raw.strip()
    if not text:
        raise TargetError("the URL is empty; give a server's base URL such as http://127.0.0.1:8000")
    if "://" not in text:
        raise TargetError(f"{raw!r} has no scheme; did you mean http://{text}?")
    try:
        parts = urlsplit(text)
        port = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError as exc:
        raise TargetError(f"{raw!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise TargetError(f"{raw!r}: the scheme must be http or https, not {parts.scheme!r}")
    if not parts.hostname:
        raise TargetError(f"{raw!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise TargetError(f"{raw!r}: put credentials in --api-key, not in the URL")
    if parts.query or parts.fragment:
        raise TargetError(f"{raw!r}: a base URL has no query or fragment")
    if any(c.isspace() for c in text):
        raise TargetError(f"{raw!r} contains whitespace")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    if port is not None:
        netloc += f":{port}"
    return urlunsplit((parts.scheme, netloc, path, "", ""))


def is_loopback(url: str) -> bool:
    """Whether `url` points at this machine (localhost, 127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
