"""Causal attention mixers: `attention` (full KV cache that grows with context: the memory baseline) and `swa`
(a ring buffer of the last `window` keys and values: bounded state)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from pydantic import Field, model_validator
from torch import nn

from kvfree.engine.model.layers.base import ContextOverflowError, Mixer, StateSpec
from kvfree.engine.model.layers.norms import RMSNorm
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.strict_config import PositiveInt, StrictConfig
from kvfree.engine.model.tensor_parallel import ROW, ROW_BIAS, Split, TensorParallel
from kvfree.kernels.attention import (
    FP8,
    KVCacheFull,
    apply_rope,
    attend,
    chunk_attention,
    decode_graph_safe,
    fused_recurrent_attention,
)


class AttentionConfig(StrictConfig):
    """Causal (grouped-query) attention with RoPE; `window` set means sliding-window attention (kind `swa`)."""

    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    rope_theta: float = 10000.0
    use_bias: bool = False
    window: PositiveInt | None = None
    # Qwen3: an RMSNorm over head_dim (one weight shared by the heads) on every query and key head, before RoPE.
    qk_norm: bool = False
    qk_norm_eps: float = Field(1e-6, gt=0)

    @model_validator(mode="after")
    def _check(self) -> AttentionConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        return self


class AttentionMixer(Mixer):
    """Grouped-query attention with RoPE (and Qwen3's per-head q/k RMSNorm under `qk_norm`).

    Session state: `k`, `v` `[S, Hkv, D]` (activation dtype; keys stored already rotated) and `length` `[]` int64,
    the number of tokens the session has seen. Full attention has S = max_context entries indexed by position;
    sliding-window attention has S = window entries, position p stored at p % window. Serving projects q, k, v and
    calls `chunk_attention` / `fused_recurrent_attention`, which rotate them at each session's positions and update
    its cache rows in place.
    """

    kind = "attention"
    config_class = AttentionConfig

    @property
    def graph_blocker(self) -> str:  # type: ignore[override]
        """Empty where decode runs the Triton kernel (no host read); the PyTorch reference reads the longest length."""
        weight = self.q_proj.weight
        if decode_graph_safe(weight.device, weight.dtype):
            return ""
        return "the keys gathered are sized by a host read of the longest context (`int(n.max())`)"

    def __init__(self, hidden_size: int, cfg: AttentionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(hidden_size, Hq * D, bias=cfg.use_bias)
        self.k_proj = nn.Linear(hidden_size, Hkv * D, bias=cfg.use_bias)
        self.v_proj = nn.Linear(hidden_size, Hkv * D, bias=cfg.use_bias)
        self.o_proj = nn.Linear(Hq * D, hidden_size, bias=cfg.use_bias)
        self.q_norm = RMSNorm(D, cfg.qk_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.qk_norm_eps) if cfg.qk_norm else None
        self.window = cfg.window
        # The KV cache's dtype: None keeps the activation dtype; float8_e4m3fn (`--kv-cache-dtype fp8`) halves a
        # bf16 cache, each session keeping a scale per KV head for k and for v (`k_scale`, `v_scale` state), which
        # start from these (1.0 unless the checkpoint ships calibrated ones, as vLLM's fp8 checkpoints do).
        self.kv_cache_dtype: torch.dtype | None = None
        self.register_buffer("k_scale", torch.ones(cfg.num_kv_heads), persistent=False)
        self.register_buffer("v_scale", torch.ones(cfg.num_kv_heads), persistent=False)

    @classmethod
    def shard_config(cls, cfg: AttentionConfig, tp: TensorParallel, what: str) -> AttentionConfig:
        """A rank's block of query heads and the KV heads they read: KV heads split with them, or, when there are
        fewer KV heads than ranks, each held whole by the ranks whose query heads read it (as vLLM's)."""
        heads, _ = tp.heads(cfg.num_heads, f"{what} num_heads")
        kv_heads, _ = tp.heads(cfg.num_kv_heads, f"{what} num_kv_heads", replicate=True)
        return cfg.model_copy(update={"num_heads": heads, "num_kv_heads": kv_heads})

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 unless there are fewer KV heads than ranks)."""
        whole = self.whole_cfg or self.cfg
        return self.tp.heads(whole.num_kv_heads, "num_kv_heads", replicate=True)[1]

    def weight_splits(self) -> dict[str, Split]:
        kv = Split(replicas=(self.kv_replicas,))
        splits = {"q_proj.weight": Split(), "k_proj.weight": kv, "v_proj.weight": kv, "o_proj.weight": ROW,
                  "k_scale": kv, "v_scale": kv}  # fmt: skip
        if self.cfg.use_bias:
            splits.update({"q_proj.bias": Split(), "k_proj.bias": kv, "v_proj.bias": kv, "o_proj.bias": ROW_BIAS})
        return splits

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        split = Split(axis=1, replicas=(self.kv_replicas,))  # by KV head
        dtype = self.kv_cache_dtype
        if self.window is None:
            kv = StateSpec((max_context, c.num_kv_heads, c.head_dim), dtype=dtype, per_token=True, split=split)
        else:
            kv = StateSpec((self.window, c.num_kv_heads, c.head_dim), dtype=dtype, split=split)
        specs = {"k": kv, "v": kv, "length": StateSpec((), dtype=torch.int64)}
        if dtype == FP8:
            scale = StateSpec((c.num_kv_heads,), dtype=torch.float32, split=Split(replicas=(self.kv_replicas,)))
            specs.update({"k_scale": scale, "v_scale": scale})
        return specs

    def reset_state(self, state: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        super().reset_state(state, slots)
        if "k_scale" in state:  # a new session's scales: the layer's
            state["k_scale"][slots] = self.k_scale.to(state["k_scale"])  # (the buffer may be bf16)
            state["v_scale"][slots] = self.v_scale.to(state["v_scale"])

    def _scales(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        return {"k_scale": state.get("k_scale"), "v_scale": state.get("v_scale")}

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        q = self.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim))
        k = self.k_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        pos = torch.arange(T, device=x.device)
        q, k = apply_rope(q, pos, self.cfg.rope_theta), apply_rope(k, pos, self.cfg.rope_theta)
        mask = pos[None, :] <= pos[:, None]
        if self.window is not None:
            mask &= pos[None, :] > pos[:, None] - self.window
        return self.o_proj(attend(q, k, v, mask.expand(B, T, T)).flatten(-2))

    def _op_params(self) -> dict:
        return {"rope_theta": self.cfg.rope_theta, "window": self.window}

    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        q, k, v = self._qkv(x)
        with _context_limit():
            o = chunk_attention(
                q, k, v, state["k"], state["v"], state["length"], batch.state_indices, batch.cu_seqlens,
                **self._op_params(), cu_seqlens_cpu=batch.cu_seqlens_cpu, **self._scales(state),
            )  # fmt: skip
        return self.o_proj(o.flatten(-2))

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        q, k, v = self._qkv(x)
        with _context_limit():
            o = fused_recurrent_attention(
                q, k, v, state["k"], state["v"], state["length"], batch.state_indices, **self._op_params(),
                **self._scales(state),
            )  # fmt: skip
        return self.o_proj(o.flatten(-2))


@contextmanager
def _context_limit() -> Iterator[None]:
    """The op's full-cache error as the engine's `ContextOverflowError`, naming the setting that sizes the cache."""
    try:
        yield
    except KVCacheFull as e:
        raise ContextOverflowError(f"{e} (raise max_context)") from e


class SlidingWindowMixer(AttentionMixer):
    """`swa`: attention over the last `window` tokens (this one included), with a bounded ring-buffer state."""

    kind = "swa"
