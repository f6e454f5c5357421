"""The model and the runtime: config, mixers, hybrid LM, state pool, sampling, and the offline `LLM` API."""

from kvfree.engine.llm import LLM, CompletionOutput
from kvfree.engine.model.config import ModelConfig
from kvfree.engine.protocol import Grammar, SamplingParams
from kvfree.engine.state.pool import StatePool

__all__ = ["LLM", "CompletionOutput", "Grammar", "ModelConfig", "SamplingParams", "StatePool"]
