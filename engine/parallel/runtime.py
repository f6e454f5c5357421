"""A model ready to step: the runner (model and state pool) of rank 0, the other ranks if any, the tokenizer, the
grammar compiler and the model's fingerprint. What the offline `LLM` and the serving `EngineCore` are built on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfree.checkpoints import default_checkpoint_path
from kvfree.engine.core.model_runner import ModelRunner
from kvfree.engine.model.hybrid_lm import HybridLM, kv_cache_torch_dtype
from kvfree.engine.model.tensor_parallel import ONE_RANK
from kvfree.engine.parallel.ranks import RankSpec, Workers, build_rank, free_address
from kvfree.engine.state.pool import StatePool
from kvfree.engine.state.snapshot import model_fingerprint
from kvfree.engine.text.grammar import GrammarCompiler
from kvfree.engine.text.tokenizer import Tokenizer


@dataclass(eq=False)
class Runtime:
    """A loaded checkpoint, ready to step.

    path: the checkpoint directory. runner: rank 0's model runner (its `model` and `pool`). workers: ranks 1..N-1
    under tensor parallelism (None on one rank); `close()` ends them.
    """

    path: Path
    runner: ModelRunner
    tokenizer: Tokenizer
    grammars: GrammarCompiler
    workers: Workers | None = None
    _fingerprint: str | None = None

    def __post_init__(self) -> None:
        self.model: HybridLM = self.runner.model
        self.pool: StatePool = self.runner.pool

    @property
    def fingerprint(self) -> str:
        """The model's fingerprint (engine/state/snapshot.py), computed once: at start-up under tensor parallelism,
        where every rank must take part."""
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model)
        return self._fingerprint

    def close(self) -> None:
        """End the other tensor-parallel ranks (nothing to do on one); the runtime is unusable afterwards."""
        if self.workers is not None:
            self.runner.release_graphs()
            self.workers.stop()


def start_runtime(
    model: str | Path | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    max_sessions: int | None = None,
    max_context: int = 4096,
    config_overrides: dict[str, Any] | None = None,
    enforce_eager: bool = False,
    tensor_parallel_size: int = 1,
    kv_cache_dtype: str = "auto",
    gpu_memory_utilization: float | None = 0.9,
    step_tokens: int = 8192,
) -> Runtime:
    """Load a checkpoint (None: the one shipped with kvfree) on one rank or, with `tensor_parallel_size` N > 1, on
    N ranks, this process being rank 0 (it starts the others). The arguments are `LLM`'s (engine/llm.py)."""
    path = Path(model) if model is not None else default_checkpoint_path()
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tensor_parallel_size}")
    kv_cache_torch_dtype(kv_cache_dtype)  # (refused now, before other ranks are started)
    address = free_address() if tensor_parallel_size > 1 else ""  # (one rank: no group to meet at)
    spec = RankSpec(tensor_parallel_size, address, str(path), "auto" if device is None else str(device),
                    dtype, max_sessions, max_context, dict(config_overrides or {}), enforce_eager,
                    kv_cache_dtype, gpu_memory_utilization=gpu_memory_utilization,
                    step_tokens=step_tokens)  # fmt: skip
    workers = Workers(spec) if tensor_parallel_size > 1 else None
    try:
        runner = build_rank(spec, workers.tp if workers else ONE_RANK, workers)
    except BaseException:
        if workers is not None:
            workers.stop()
        raise
    tokenizer = Tokenizer(path)
    # Structured output's grammars, for the model's vocabulary (its llguidance tokenizer is built on first use).
    grammars = GrammarCompiler(tokenizer, runner.model.config.vocab_size)
    return Runtime(path, runner, tokenizer, grammars, workers, runner.fingerprint)
