"""Sequence mixers (one module per kind) and the pieces they share (norms, short conv, MLP)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.layers.attention import AttentionMixer, SlidingWindowMixer
from engine.layers.base import ContextOverflowError, Mixer, PrefillBatch, StateSpec
from engine.layers.mamba2 import Mamba2Mixer

MIXERS: dict[str, type[Mixer]] = {cls.kind: cls for cls in (Mamba2Mixer, AttentionMixer, SlidingWindowMixer)}


def build_mixer(kind: str, config: ModelConfig) -> Mixer:
    """The mixer of `kind` for a model of `config` (the kind's sub-config is read from `config`)."""
    return MIXERS[kind](config.hidden_size, config.mixer_config(kind))


__all__ = ["MIXERS", "ContextOverflowError", "Mixer", "PrefillBatch", "StateSpec", "build_mixer"]
