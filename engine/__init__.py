"""The model and the runtime: config, mixers, hybrid LM, state pool, sampling, and the offline `LLM` API."""

from kvfree.engine.config import ModelConfig
from kvfree.engine.grammar import Grammar
from kvfree.engine.llm import LLM, CompletionOutput
from kvfree.engine.sampling import SamplingParams
from kvfree.engine.state_pool import StatePool

__all__ = ["LLM", "CompletionOutput", "Grammar", "ModelConfig", "SamplingParams", "StatePool"]
