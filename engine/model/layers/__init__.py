"""Sequence mixers (one module per kind, each with its config beside it) and the one registry of kinds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvfree.engine.model.layers.attention import AttentionMixer, SlidingWindowMixer
from kvfree.engine.model.layers.base import ContextOverflowError, Mixer, StateSpec
from kvfree.engine.model.layers.bmojo import BMojoMixer
from kvfree.engine.model.layers.bmojo_f import BMojoFMixer
from kvfree.engine.model.layers.gdn import GDNMixer
from kvfree.engine.model.layers.gka import GKAMixer
from kvfree.engine.model.layers.lattice import LatticeMixer
from kvfree.engine.model.layers.mamba2 import Mamba2Mixer
from kvfree.engine.model.layers.ska import SKAMixer
from kvfree.engine.model.tensor_parallel import ONE_RANK, TensorParallel

if TYPE_CHECKING:
    from kvfree.engine.model.config import ModelConfig

# kind -> mixer class. A kind is the name used in config.json's `layers` list and the key of its sub-config
# (`ModelConfig` gets one optional field per kind from this table). Adding a kind means adding it here.
MIXERS: dict[str, type[Mixer]] = {
    cls.kind: cls
    for cls in (
        Mamba2Mixer,
        AttentionMixer,
        SlidingWindowMixer,
        SKAMixer,
        GKAMixer,
        GDNMixer,
        LatticeMixer,
        BMojoMixer,
        BMojoFMixer,
    )
}


def mixer_class(kind: str) -> type[Mixer]:
    """The mixer class registered for `kind`."""
    return MIXERS[kind]


def build_mixer(kind: str, config: ModelConfig, tp: TensorParallel = ONE_RANK, what: str = "") -> Mixer:
    """The mixer of `kind` for a model of `config` (the kind's sub-config is read from `config`); under tensor
    parallelism, this rank's block of it (ValueError naming `what`, e.g. "layers.3 (gka)", when it cannot split)."""
    cls, whole = MIXERS[kind], config.mixer_config(kind)
    mixer = cls(config.hidden_size, cls.shard_config(whole, tp, what or kind))
    if tp.size > 1:
        mixer.tp, mixer.whole_cfg = tp, whole
    return mixer


__all__ = ["MIXERS", "ContextOverflowError", "Mixer", "StateSpec", "build_mixer", "mixer_class"]
