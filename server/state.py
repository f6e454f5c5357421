"""What every route is given: the served state on `app.state.kvfree` (a `StateDep` parameter), and the model check."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from kvfree.engine.text.tokenizer import Tokenizer
from kvfree.server.errors import not_found
from kvfree.server.lifecycle import EngineClient
from kvfree.server.metrics import Metrics
from kvfree.server.responses import ResponseStore
from kvfree.server.settings import ServerSettings
from kvfree.server.snapshot_files import SnapshotFiles


@dataclass
class ServerState:
    """Everything a route needs, kept on `app.state.kvfree`.

    engine: the one way to the engine (server/lifecycle.py). tokenizer: the server's, for prompts, templates and
    logprob tokens; the same object the lifecycle detokenizes the engine's token ids with (server/detokenize.py).
    """

    engine: EngineClient
    tokenizer: Tokenizer
    settings: ServerSettings
    metrics: Metrics
    model_name: str
    responses: ResponseStore = field(default_factory=ResponseStore)  # POST /v1/responses with store
    snapshot_files: SnapshotFiles = field(default_factory=SnapshotFiles)  # snapshots on their way to or from the engine


def state_of(request: Request) -> ServerState:
    """The app's `ServerState`; as a dependency, a route parameter `state: StateDep`."""
    return request.app.state.kvfree


StateDep = Annotated[ServerState, Depends(state_of)]


def check_model(state: ServerState, model: str | None) -> None:
    """A 404 naming `model` when a request names a model this server does not serve."""
    if model is not None and model != state.model_name:
        raise not_found(f"model {model!r} is not served here; this server serves {state.model_name!r}", "model")
