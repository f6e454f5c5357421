"""kvfree: a constant-memory inference server for recurrent, KV-cache-free language models.

The one import package. Its subpackages live in the repository's top-level folders and are mapped here by
`pyproject.toml`: `kvfree.engine` (engine/), `kvfree.kernels` (kernels/), `kvfree.server` (server/),
`kvfree.checkpoints` (checkpoints/), `kvfree.training` (training/), `kvfree.clients` (clients/) and
`kvfree.loadtest` (loadtest/). The public Python API is `from kvfree import LLM, SamplingParams, Grammar`.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("kvfree")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

if TYPE_CHECKING:
    from kvfree.engine import LLM, Grammar, SamplingParams

__all__ = ["LLM", "Grammar", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import kvfree.loadtest` or `import kvfree.clients` (HTTP only) does not import torch.
    if name in ("LLM", "SamplingParams", "Grammar"):
        from kvfree import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvfree' has no attribute {name!r}")
