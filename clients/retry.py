"""When to retry a request: on 429 and 503 (the server is busy or shutting down) and on a 409 that carries
`Retry-After` (a session busy with another turn, which ends by itself), after that `Retry-After` when it is sent,
else after an exponential backoff; and on a refused connection (a replica restarting)."""

from __future__ import annotations

from dataclasses import dataclass

RETRY_STATUSES = frozenset({429, 503})


@dataclass(frozen=True)
class RetryPolicy:
    """max_retries: retries after the first attempt. backoff: the first delay (s), doubled each time, at most
    max_backoff; a server's `Retry-After` (seconds) replaces it, also capped at max_backoff."""

    max_retries: int = 3
    backoff: float = 0.5
    max_backoff: float = 8.0

    def delay(self, attempt: int, status: int | None, retry_after: str | None) -> float | None:
        """Seconds to wait before retry number `attempt + 1`, or None when the failure is final.

        status: the response's HTTP status, or None when the connection failed.
        """
        if attempt >= self.max_retries:
            return None
        if status is not None and status not in RETRY_STATUSES and not (status == 409 and retry_after is not None):
            return None
        if retry_after is not None:
            try:
                return min(max(float(retry_after), 0.0), self.max_backoff)
            except ValueError:
                pass  # an HTTP date or garbage: fall back to the backoff
        return min(self.backoff * 2**attempt, self.max_backoff)
