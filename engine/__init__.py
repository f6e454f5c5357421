"""The model and the runtime: config, mixers, hybrid LM, state pool, sampling, and the offline `LLM` API."""

from engine.config import ModelConfig
from engine.llm import LLM, CompletionOutput
from engine.sampling import SamplingParams
from engine.state_pool import StatePool

__all__ = ["LLM", "CompletionOutput", "ModelConfig", "SamplingParams", "StatePool"]
