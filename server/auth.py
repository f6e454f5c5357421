"""Optional API keys: `Authorization: Bearer <key>`, checked in constant time.

Keys come from a file (one per line, `#` comments) and/or an environment variable (comma-separated); with none
configured the server is open. A key's `key_id` (a short hash) names the owner of the sessions it creates, so a
session, its snapshot and the logs never hold a raw key, and another key's sessions look like unknown ones.
The app keeps its `APIKeys` in `app.state.api_keys`; routes get the caller through the `api_key_owner` dependency.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvfree.server.errors import unauthorized

DEFAULT_ENV_VAR = "KVFREE_API_KEYS"

MISSING_KEY_MESSAGE = "Missing API key: send Authorization: Bearer <key>"
INCORRECT_KEY_MESSAGE = "Incorrect API key provided"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def key_id(key: str) -> str:
    """A short, stable, non-reversible name for a key (`key-` and 16 hex digits), used as a session's owner.

    Unsalted on purpose: it must be the same on every replica and after restarts, and API keys are long random
    strings, so the 64-bit hash neither reveals them nor collides in practice.
    """
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]


class APIKeys:
    """The accepted keys, kept as SHA-256 digests only. Empty means authentication is off."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        digests: dict[bytes, str] = {}
        for key in keys:
            if not key or key != key.strip():
                raise ValueError("API keys must be non-empty and have no surrounding whitespace")
            digests[_digest(key)] = key_id(key)
        self._digests = digests

    @classmethod
    def from_sources(
        cls,
        keys_file: Path | None = None,
        env_var: str = DEFAULT_ENV_VAR,
        environ: Mapping[str, str] | None = None,
    ) -> APIKeys:
        """Keys from `keys_file` and the environment variable `env_var`, together.

        File: one key per line; blank lines and lines starting with `#` are skipped, and so is the rest of a line
        after ` #`. Environment: comma-separated, blanks skipped. A file that exists but holds no key is an error
        (the operator meant to turn authentication on); an unset or empty variable just adds nothing.

        Raises:
            ValueError: the file holds no key. OSError: it cannot be read.
        """
        keys: list[str] = []
        if keys_file is not None:
            from_file = parse_keys_file(Path(keys_file).read_text(encoding="utf-8"))
            if not from_file:
                raise ValueError(f"{keys_file}: no API key in the file (one key per line, # for comments)")
            keys += from_file
        env = os.environ if environ is None else environ
        keys += [key.strip() for key in env.get(env_var, "").split(",") if key.strip()]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def owner(self, key: str) -> str | None:
        """The key's `key_id` if it is accepted, else None.

        Constant time in the key: it is hashed, and the digest compared with every accepted digest by
        `hmac.compare_digest`, without stopping at a match, so timing tells nothing about which bytes matched.
        """
        digest = _digest(key)
        found: str | None = None
        for accepted, owner in self._digests.items():
            if hmac.compare_digest(digest, accepted):
                found = owner
        return found


def parse_keys_file(text: str) -> list[str]:
    """The keys in a keys file's text (see `APIKeys.from_sources`)."""
    keys = []
    for line in text.splitlines():
        key = line.split(" #", 1)[0].strip()
        if key and not key.startswith("#"):
            keys.append(key)
    return keys


# auto_error=False: a missing key is answered by us, in OpenAI's shape; the scheme still shows in the OpenAPI docs.
_bearer = HTTPBearer(auto_error=False, description="An API key, when the server was started with some.")


async def api_key_owner(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> str | None:
    """A FastAPI dependency: the caller's owner id (`key_id`), or None when authentication is off.

    The accepted keys are the app's `app.state.api_keys` (an `APIKeys`; an app without them fails closed, with a
    500). Raises the OpenAI-shaped 401 for a missing, non-Bearer or unknown key.
    """
    keys: APIKeys = request.app.state.api_keys
    if not keys.enabled:
        return None
    if credentials is None:
        if request.headers.get("authorization"):
            raise unauthorized(
                f"{MISSING_KEY_MESSAGE} (the Authorization header is not of that form)", code="missing_api_key"
            )
        raise unauthorized(MISSING_KEY_MESSAGE, code="missing_api_key")
    owner = keys.owner(credentials.credentials)
    if owner is None:
        raise unauthorized(INCORRECT_KEY_MESSAGE)
    return owner


# A route parameter `owner: OwnerDep` is the caller's owner id (None: authentication is off).
OwnerDep = Annotated[str | None, Depends(api_key_owner)]
