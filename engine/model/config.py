"""Model configuration: `config.json` validated into a pydantic `ModelConfig`.

A model is a stack of blocks; `layers` names the mixer kind of each block (e.g. `["mamba2", "mamba2", "attention"]`)
and each kind used has its own sub-config under a key of the same name, whose schema is defined beside its mixer in
`engine/model/layers/<kind>.py`. Loading checks every key and type and raises `ConfigError` naming the offending key
(engine/model/strict_config.py), because a wrong config otherwise surfaces as a shape error deep inside a layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError, create_model, model_validator

from kvfree.engine.model.layers import MIXERS
from kvfree.engine.model.layers.mlp import MLPConfig
from kvfree.engine.model.strict_config import ConfigError, PositiveInt, StrictConfig, config_error

__all__ = ["ConfigError", "ModelConfig", "parse_overrides"]


class _ModelConfigFields(StrictConfig):
    """A whole hybrid model (docs/design/architecture.md §2): the fields every model has.

    `ModelConfig` below adds one optional sub-config per mixer kind, from the registry `engine.model.layers.MIXERS`.
    """

    vocab_size: PositiveInt
    hidden_size: PositiveInt
    layers: list[str]
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    mlp: MLPConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Free-form provenance (e.g. "converted from hf-mamba2"); never read by the engine.
    notes: dict[str, str] = {}

    @model_validator(mode="after")
    def _check(self) -> _ModelConfigFields:
        if not self.layers:
            raise ValueError("layers: a model needs at least one layer")
        for i, kind in enumerate(self.layers):
            if kind not in MIXERS:
                raise ValueError(f"layers[{i}]: unknown mixer kind {kind!r}; known: {sorted(MIXERS)}")
            if getattr(self, kind) is None:
                raise ValueError(f"{kind}: layer {i} is {kind!r} but this sub-config is missing")
        swa, attention = getattr(self, "swa", None), getattr(self, "attention", None)
        if swa is not None and swa.window is None:
            raise ValueError("swa: sliding-window attention needs a window size (swa.window)")
        if attention is not None and attention.window is not None:
            raise ValueError("attention: full attention has no window (attention.window); use the 'swa' kind")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tid = getattr(self, key)
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise ValueError(f"{key}: {tid} is outside the vocabulary [0, {self.vocab_size})")
        return self

    def mixer_config(self, kind: str) -> Any:
        """The sub-config a layer of `kind` is built from."""
        return getattr(self, kind)

    # -- JSON -----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump(exclude_none=True).items() if v != {}}

    @classmethod
    def from_dict(cls, data: Any) -> ModelConfig:
        """Validate a parsed config.json; raises `ConfigError` whose message starts with `config.<key>`."""
        if not isinstance(data, dict):
            raise ConfigError(f"config: expected an object, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise config_error(e, "config", cls) from None

    @staticmethod
    def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
        """A copy of config `data` with dotted keys replaced, e.g. `{"gka.num_iter": 10}` (validated later)."""
        data = json.loads(json.dumps(data))
        for dotted, value in overrides.items():
            *parents, leaf = dotted.split(".")
            node = data
            for i, key in enumerate(parents):
                if not isinstance(node.get(key), dict):
                    raise ConfigError(f"override {dotted!r}: config has no section {'.'.join(parents[: i + 1])!r}")
                node = node[key]
            node[leaf] = value
        return data

    @classmethod
    def load(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


# One optional field per registered mixer kind, named by the kind and typed by the mixer's own config class.
ModelConfig = create_model(
    "ModelConfig",
    __base__=_ModelConfigFields,
    __module__=__name__,
    **{kind: (cls.config_class | None, None) for kind, cls in MIXERS.items()},
)
ModelConfig.__doc__ = _ModelConfigFields.__doc__


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["gka.num_iter=10", ...] -> {"gka.num_iter": 10}; VALUE is read as JSON, else kept as a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. gka.num_iter=10")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
