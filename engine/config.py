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
    """The channel mixer after each mixer.

    kind "swiglu": down(silu(gate(h)) * up(h)) after an RMSNorm. kind "koopman": the Spectral Koopman MLP of Echo
    (ska.md §4.5): readout(R silu(lift(h))) after a LayerNorm, R a block-diagonal 2x2 scale-rotation with |lambda|
    clamped to <= 1; `intermediate_size` is its d_k (even; the paper uses ceil(8/3 d / 64) * 64).
    """

    intermediate_size: int
    kind: str = "swiglu"
    gated: bool = False  # koopman only: multiply by sigmoid(gate(h)) before the readout (SwiGLU parameter parity)

    def check(self, where: str) -> None:
        _positive(self, where, "intermediate_size")
        if self.kind not in ("swiglu", "koopman"):
            raise ConfigError(f"{where}.kind: unknown MLP kind {self.kind!r}; known: ['koopman', 'swiglu']")
        if self.kind == "koopman" and self.intermediate_size % 2:
            raise ConfigError(f"{where}.intermediate_size: the Koopman MLP pairs channels, needs an even size")
        if self.gated and self.kind != "koopman":
            raise ConfigError(f"{where}.gated: only the 'koopman' MLP has an optional gate")


@dataclass
class SKAConfig:
    """Spectral Koopman Attention (Echo; shared/design/ska.md). Per head: keys/queries of width `rank`, values of
    width `head_dim`; state 2 r^2 + P r accumulators (+ J, z_prev, m), constant in context length."""

    num_heads: int  # H
    rank: int  # r: Koopman rank per head (key/query width per head)
    head_dim: int  # P: value width per head (the paper uses P = hidden / H)
    chunk_size: int = 64  # S: chunk of the chunk-causal operator, on the absolute position grid
    power_order: int = 2  # K: power filter order (K = 0 is plain ridge retrieval)
    ridge_eps: float = 1e-3  # eps: ridge on the max-norm-normalised Gram (= eps * m^2 on raw stats)
    power_iters: int = 6  # power-iteration steps for sigma_max of the whitened operator (detached)
    eta_init: float = 1.5  # learnable output scale eta (unconstrained)
    gamma_init: float = 1.0  # learnable spectral gain gamma, used clamped to [1, 1.5]
    decode_mode: str = "C"  # "C": chunk-causal (exact parity with the chunked forward); "P": the paper's prefix mode
    # Key max-norm m (only sets the ridge): "causal" = running max over the tokens an operator contains (training,
    # prefill and decode identical); "frozen" = the paper's seq-max of the first segment, then frozen.
    key_norm: str = "causal"
    # dtype of the G/M/C accumulators and of the operator build (Cholesky..J); "float64" keeps long sessions
    # exact (ska.md §5); "float32" is the paper's choice (cheaper training on GPUs with slow fp64).
    accum_dtype: str = "float64"

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "rank", "head_dim", "chunk_size", "power_iters", "ridge_eps")
        if self.power_order < 0:
            raise ConfigError(f"{where}.power_order: must be >= 0, got {self.power_order}")
        if not 1.0 <= self.gamma_init <= 1.5:
            raise ConfigError(f"{where}.gamma_init: gamma is constrained to [1, 1.5], got {self.gamma_init}")
        if self.decode_mode not in ("C", "P"):
            raise ConfigError(f"{where}.decode_mode: must be 'C' or 'P', got {self.decode_mode!r}")
        if self.key_norm not in ("causal", "frozen"):
            raise ConfigError(f"{where}.key_norm: must be 'causal' or 'frozen', got {self.key_norm!r}")
        if self.accum_dtype not in ("float32", "float64"):
            raise ConfigError(f"{where}.accum_dtype: must be 'float32' or 'float64', got {self.accum_dtype!r}")


@dataclass
class GKAConfig:
    """Gated KalmaNet (shared/design/gka.md). Query, key and value heads are equal (no GQA head expansion).

    Field names follow hybrid-model-factory's `gka_config.py` where one exists, to ease conversion.
    """

    num_heads: int  # He: heads of q, k, v, the gates and the state
    head_dim: int  # D: query/key width per head (H is D x D per head)
    value_head_dim: int | None = None  # Dv: value width per head; None means head_dim
    conv_kernel: int = 4  # K: short-conv taps on q, k (and v)
    chunk_size: int = 64  # C: tokens per chunk of the parallel prefill
    # r: Chebyshev iterations. A serving knob (`--set gka.num_iter=10`), but it changes the function the model
    # was trained with (gka.md §13.15).
    num_iter: int = 30
    ridge_strength: float = 0.02  # a in lambda_t = a * ||H_t||_F (bounds the condition number by (1+a)/a)
    norm_eps: float = 1e-6  # eps of the per-head RMSNorm
    use_v_conv: bool = True  # short conv + SiLU on v as well as on q and k
    use_beta_gate: bool = True  # write gate beta: k, v scaled by sigmoid(.) + 1e-6
    use_alpha_connection: bool = True  # q' = q + alpha (x - q); False means alpha = 1 (pure ridge solution)
    use_gate: bool = True  # output gate: RMSNorm(o) * w * SiLU(W_g x); False: RMSNorm(o) * w
    gla_rescale: bool = True  # output scale D^-1/2

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "head_dim", "conv_kernel", "chunk_size", "num_iter", "ridge_strength")
        _positive(self, where, "norm_eps")
        if self.value_head_dim is not None and self.value_head_dim <= 0:
            raise ConfigError(f"{where}.value_head_dim: must be positive, got {self.value_head_dim}")


@dataclass
class LatticeConfig:
    """Lattice memory slots (shared/design/lattice.md); every unstated choice of the paper is a field here."""

    num_heads: int
    head_dim: int  # d: slot dimension = value/output width per head
    num_slots: int | None = None  # m: memory slots per head = key/query width; None means head_dim. Needs m <= d.
    variant: str = "dec"  # "dec" (the paper's final Lattice), "enc" or "sim" (Eq. (10) / Eq. (12))
    conv_kernel: int = 4  # the two short convs on the shared q/k projection
    qk_norm: str = "l2"  # "l2": per-head L2-normalised q and k; "none"
    forget_gate: bool = True  # a mu head (Eq. (16)); folded into gamma at load, gamma <- gamma / max(mu, 1e-4)
    learn_s0: bool = False  # S0 a trained parameter (re-orthonormalised) rather than a fixed random buffer
    output_norm: str = "head_rms"  # "head_rms": RMSNorm per head (weight shared by heads); "rms": over H*d; "none"
    norm_eps: float = 1e-5
    # Training only: recompute the token loop in segments of this many tokens in backward (0: store every step).
    grad_checkpoint: int = 64

    @property
    def slots(self) -> int:
        return self.head_dim if self.num_slots is None else self.num_slots

    def check(self, where: str) -> None:
        _positive(self, where, "num_heads", "head_dim", "conv_kernel")
        if self.num_slots is not None and not 0 < self.num_slots <= self.head_dim:
            raise ConfigError(
                f"{where}.num_slots: S0 has orthonormal columns, so 0 < num_slots <= head_dim ({self.head_dim}); "
                f"got {self.num_slots}"
            )
        if self.variant not in ("dec", "enc", "sim"):
            raise ConfigError(f"{where}.variant: must be 'dec', 'enc' or 'sim', got {self.variant!r}")
        if self.qk_norm not in ("l2", "none"):
            raise ConfigError(f"{where}.qk_norm: must be 'l2' or 'none', got {self.qk_norm!r}")
        if self.output_norm not in ("head_rms", "rms", "none"):
            raise ConfigError(f"{where}.output_norm: must be 'head_rms', 'rms' or 'none', got {self.output_norm!r}")
        if self.norm_eps <= 0:
            raise ConfigError(f"{where}.norm_eps: must be positive, got {self.norm_eps}")
        if self.grad_checkpoint < 0:
            raise ConfigError(f"{where}.grad_checkpoint: must be >= 0 (0 disables), got {self.grad_checkpoint}")


@dataclass
class BMojoConfig:
    """B'MOJO fading + eidetic memory (shared/design/bmojo.md, chunked semantics C of §3.3).

    One layer = a Mamba-2 mixer (the fading memory, fields `ssm_*`) followed by NoPE attention whose keys are the
    last `window` tokens, `fading_tokens` SSM outputs before the current chunk and the `eidetic_tokens` past tokens
    with the largest innovation score. Memory is rebuilt once per chunk of `window` tokens.
    """

    num_heads: int  # attention query heads
    head_dim: int  # attention head width d_h
    ssm_num_heads: int  # Mamba-2 heads H_s (d_inner = ssm_num_heads * ssm_head_dim)
    ssm_head_dim: int  # Mamba-2 head width P
    num_kv_heads: int | None = None  # GQA key/value heads; None = num_heads
    window: int = 512  # w: sliding window AND chunk length (memory refresh period)
    fading_tokens: int = 1  # m_f: SSM outputs y_{s-m_f..s-1} before the chunk start s; 0 = no fading memory
    eidetic_tokens: int = 64  # m_e: capacity of the top-innovation store; 0 = B'MOJO-F
    predictor_taps: int = 4  # k: fixed running-average predictor of y_t from y_{t-1..t-k}
    wiring: str = "P2"  # "P2": SSM output joins the residual, attention reads norm(u + y); "P1": literal Algorithm 1
    ssm_state_size: int = 128  # N
    ssm_n_groups: int = 1  # G (B/C groups)
    ssm_conv_kernel: int = 4
    ssm_chunk_size: int = 64  # SSD chunk length (numerics only, not semantics)
    ssm_time_step_limit: list[float] | None = None
    use_bias: bool = False
    norm_eps: float = 1e-5

    def check(self, where: str) -> None:
        _positive(
            self, where, "num_heads", "head_dim", "ssm_num_heads", "ssm_head_dim", "window", "predictor_taps",
            "ssm_state_size", "ssm_n_groups", "ssm_conv_kernel", "ssm_chunk_size",
        )  # fmt: skip
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ConfigError(f"{where}.num_kv_heads: {self.num_kv_heads} must be positive and divide num_heads")
        # m_f, m_e <= w: at every chunk boundary the finished chunk alone can fill the store (spec §3.3), so chunks
        # >= 1 never have empty memory slots and the ring (w entries) holds every candidate at publish time.
        for name in ("fading_tokens", "eidetic_tokens"):
            value = getattr(self, name)
            if not 0 <= value <= self.window:
                raise ConfigError(f"{where}.{name}: must be in [0, window={self.window}], got {value}")
        if self.wiring not in ("P1", "P2"):
            raise ConfigError(f"{where}.wiring: must be 'P1' or 'P2', got {self.wiring!r}")
        if self.ssm_num_heads % self.ssm_n_groups:
            raise ConfigError(f"{where}.ssm_n_groups: {self.ssm_n_groups} must divide ssm_num_heads")
        if self.ssm_time_step_limit is not None and len(self.ssm_time_step_limit) != 2:
            raise ConfigError(f"{where}.ssm_time_step_limit: expected [min, max], got {self.ssm_time_step_limit}")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    def mamba2_config(self) -> Mamba2Config:
        """The Mamba-2 sub-config of the fading-memory SSM."""
        return Mamba2Config(
            num_heads=self.ssm_num_heads,
            head_dim=self.ssm_head_dim,
            state_size=self.ssm_state_size,
            n_groups=self.ssm_n_groups,
            conv_kernel=self.ssm_conv_kernel,
            chunk_size=self.ssm_chunk_size,
            use_bias=self.use_bias,
            time_step_limit=self.ssm_time_step_limit,
            norm_eps=self.norm_eps,
        )


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
