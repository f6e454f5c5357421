"""Sequence mixers (one module per kind) and the pieces they share (norms, short conv, MLP)."""

from __future__ import annotations

import importlib

from kvfree.engine.config import ModelConfig
from kvfree.engine.layers.base import ContextOverflowError, Mixer, PrefillBatch, StateSpec

# kind -> "module:class". Imported on first use, so a model only loads the mixers it has.
MIXERS: dict[str, str] = {
    "mamba2": "kvfree.engine.layers.mamba2:Mamba2Mixer",
    "attention": "kvfree.engine.layers.attention:AttentionMixer",
    "swa": "kvfree.engine.layers.attention:SlidingWindowMixer",
    "ska": "kvfree.engine.layers.ska:SKAMixer",
    "gka": "kvfree.engine.layers.gka:GKAMixer",
    "lattice": "kvfree.engine.layers.lattice:LatticeMixer",
    "bmojo": "kvfree.engine.layers.bmojo:BMojoMixer",
}


def mixer_class(kind: str) -> type[Mixer]:
    module, name = MIXERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def build_mixer(kind: str, config: ModelConfig) -> Mixer:
    """The mixer of `kind` for a model of `config` (the kind's sub-config is read from `config`)."""
    return mixer_class(kind)(config.hidden_size, config.mixer_config(kind))


__all__ = ["MIXERS", "ContextOverflowError", "Mixer", "PrefillBatch", "StateSpec", "build_mixer", "mixer_class"]
