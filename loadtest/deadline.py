"""A wall-clock deadline that every request loop checks before it starts another request.

Loops in the load generator are bounded twice: by a count (requests per level, turns per session, context lengths)
and by time (a deadline per scenario inside the run's overall `--time-limit`). A request already sent is bounded by
the per-request timeout, so a run always ends by itself.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


@dataclass
class Deadline:
    """`seconds` from creation (math.inf: none). `child(s)` is the earlier of this deadline and s from now."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    @property
    def at(self) -> float:
        return self.start + self.seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def child(self, seconds: float) -> Deadline:
        now = time.monotonic()
        end = min(self.at, now + seconds) if math.isfinite(seconds) else self.at
        return Deadline(end - now, now)
