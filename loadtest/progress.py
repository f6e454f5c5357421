"""Progress bars on stderr while a load test runs (tqdm), or nothing at all.

Bars are off when stderr is not a terminal (CI logs, pipes) or with `--no-progress`, and when tqdm is not
installed: progress is a convenience, never a reason for a run to fail.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any


class Bar:
    """One bar (a no-op when progress is off)."""

    def __init__(self, impl: Any = None) -> None:
        self._impl = impl

    def advance(self, n: int = 1) -> None:
        if self._impl is not None:
            self._impl.update(n)

    def note(self, text: str) -> None:
        """A short status shown after the bar (e.g. the current context length)."""
        if self._impl is not None:
            self._impl.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if self._impl is not None:
            self._impl.close()
            self._impl = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Progress:
    """Makes bars; `enabled=None` means "when stderr is a terminal"."""

    def __init__(self, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # optional: the run goes on without bars
                tqdm = None
            self._tqdm = tqdm

    @property
    def enabled(self) -> bool:
        return self._tqdm is not None

    def bar(self, desc: str, total: float | None, unit: str = "req") -> Bar:
        if self._tqdm is None:
            return Bar()
        # A pseudo-terminal without a window size reports 0 columns, and tqdm would then draw empty bars.
        width = shutil.get_terminal_size().columns
        size = {"dynamic_ncols": True} if _terminal_columns() > 0 else {"ncols": width}
        return Bar(self._tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=True, **size))


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0
