"""Model configuration: a JSON file (`config.json`) mapped onto validated dataclasses.

A model is a stack of blocks; `layers` names the mixer kind of each block (e.g. `["mamba2", "mamba2", "attention"]`)
and each kind used has its own sub-config under a key of the same name. Loading checks every key and type and
raises `ConfigError` naming the offending key, because a wrong config otherwise surfaces as a shape error deep
inside a layer.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that does not describe a valid model; the message names the key."""


@dataclass
class Mamba2Config:
    """The Mamba-2 mixer (SSD), with the field names of HF `Mamba2Config` where they exist."""

    num_heads: int
    head_dim: int
    state_size: int = 128
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 64
    use_bias: bool = False
    use_conv_bias: bool = True
    # Clamp applied to dt after softplus; None means (0, inf) as in HF.
    time_step_limit: list[float] | None = None
    norm_eps: float = 1e-5

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size")
        if self.num_heads % self.n_groups:
            raise ConfigError(f"{where}.n_groups: {self.n_groups} must divide num_heads ({self.num_heads})")
        if self.time_step_limit is not None and len(self.time_step_limit) != 2:
            raise ConfigError(f"{where}.time_step_limit: expected [min, max], got {self.time_step_limit}")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass
class AttentionConfig:
    """Causal (grouped-query) attention with RoPE; `window` set means sliding-window attention."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    use_bias: bool = False
    window: int | None = None

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "num_kv_heads", "head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{where}.num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"{where}.head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.window is not None and self.window <= 0:
            raise ConfigError(f"{where}.window: must be a positive number of tokens, got {self.window}")


@dataclass
class MLPConfig:
    """The channel mixer after each mixer: a SwiGLU MLP."""

    intermediate_size: int
    kind: str = "swiglu"

    def check(self, where: str) -> None:
        _positive(self, where, "intermediate_size")
        if self.kind != "swiglu":
            raise ConfigError(f"{where}.kind: unknown MLP kind {self.kind!r}; known: ['swiglu']")


@dataclass
class SKAConfig:
    """Spectral Koopman Attention (Echo; shared/design/ska.md)."""

    num_heads: int
    rank: int  # r: Koopman rank per head (key/query width per head)
    head_dim: int  # P: value width per head
    chunk_size: int = 64
    power_order: int = 2  # K
    ridge_eps: float = 1e-3
    power_iters: int = 6
    eta_init: float = 1.5
    gamma_init: float = 1.0
    decode_mode: str = "C"  # "C": chunk-causal (exact parity with the chunked forward); "P": the paper's prefix mode

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "rank", "head_dim", "chunk_size", "power_iters")
        if self.decode_mode not in ("C", "P"):
            raise ConfigError(f"{where}.decode_mode: must be 'C' or 'P', got {self.decode_mode!r}")


@dataclass
class GKAConfig:
    """Gated KalmaNet (shared/design/gka.md)."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    chunk_size: int = 64
    num_iter: int = 30
    ridge_strength: float = 0.02
    norm_eps: float = 1e-6

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "head_dim", "conv_kernel", "chunk_size", "num_iter")


@dataclass
class LatticeConfig:
    """Lattice memory slots (shared/design/lattice.md)."""

    num_heads: int
    head_dim: int

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "head_dim")


@dataclass
class BMojoConfig:
    """B'MOJO fading + eidetic memory (shared/design/bmojo.md)."""

    num_heads: int
    head_dim: int

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "head_dim")


# Which sub-config each mixer kind reads. `swa` is attention with a mandatory window.
MIXER_CONFIG_KEYS: dict[str, str] = {
    "mamba2": "mamba2",
    "attention": "attention",
    "swa": "swa",
    "ska": "ska",
    "gka": "gka",
    "lattice": "lattice",
    "bmojo": "bmojo",
}


@dataclass
class ModelConfig:
    """A whole hybrid model. See architecture.md §2."""

    vocab_size: int
    hidden_size: int
    layers: list[str]
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    mlp: MLPConfig | None = None
    mamba2: Mamba2Config | None = None
    attention: AttentionConfig | None = None
    swa: AttentionConfig | None = None
    ska: SKAConfig | None = None
    gka: GKAConfig | None = None
    lattice: LatticeConfig | None = None
    bmojo: BMojoConfig | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    # Free-form provenance (e.g. "converted from hf-mamba2"); never read by the engine.
    notes: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        _positive(self, "config", "vocab_size", "hidden_size")
        if not self.layers:
            raise ConfigError("config.layers: a model needs at least one layer")
        for i, kind in enumerate(self.layers):
            if kind not in MIXER_CONFIG_KEYS:
                raise ConfigError(
                    f"config.layers[{i}]: unknown mixer kind {kind!r}; known: {sorted(MIXER_CONFIG_KEYS)}"
                )
            if getattr(self, MIXER_CONFIG_KEYS[kind]) is None:
                raise ConfigError(
                    f"config.{MIXER_CONFIG_KEYS[kind]}: layer {i} is {kind!r} but this sub-config is missing"
                )
        for key in (*sorted(set(MIXER_CONFIG_KEYS.values())), "mlp"):
            sub = getattr(self, key)
            if sub is not None:
                sub.check(f"config.{key}")
        if self.swa is not None and self.swa.window is None:
            raise ConfigError("config.swa.window: sliding-window attention needs a window size")
        if self.attention is not None and self.attention.window is not None:
            raise ConfigError("config.attention.window: full attention has no window; use the 'swa' kind")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tid = getattr(self, key)
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise ConfigError(f"config.{key}: {tid} is outside the vocabulary [0, {self.vocab_size})")

    def mixer_config(self, kind: str) -> Any:
        """The sub-config a layer of `kind` is built from."""
        return getattr(self, MIXER_CONFIG_KEYS[kind])

    # -- JSON -----------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None and v != {}}

    @classmethod
    def from_dict(cls, data: Any) -> ModelConfig:
        return _build(cls, data, "config")

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


def _positive(obj: Any, where: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ConfigError(f"{where}.{name}: must be positive, got {value}")


def _build(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a JSON object, checking every key against the field's type annotation."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (known: {sorted(names)})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}.{f.name}: required key is missing")
    return cls(**kwargs)  # ModelConfig.__post_init__ runs the cross-field checks


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {tp}")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
        _, item = typing.get_args(tp)
        return {str(k): _coerce(item, v, f"{where}.{k}") for k, v in value.items()}
    # bool is a subclass of int in Python: reject true/false where a number is expected and vice versa.
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {where}")
