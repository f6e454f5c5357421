"""Causal attention mixers: `attention` (full KV cache that grows with context: the memory baseline) and `swa`
(a ring buffer of the last `window` keys and values: bounded state)."""

from __future__ import annotations

import torch
from pydantic import model_validator
from torch import nn

from kvfree.engine.layers.base import ContextOverflowError, Mixer, PrefillBatch, StateSpec
from kvfree.engine.strict_config import PositiveInt, StrictConfig
from kvfree.kernels.attention import apply_rope, attend


class AttentionConfig(StrictConfig):
    """Causal (grouped-query) attention with RoPE; `window` set means sliding-window attention (kind `swa`)."""

    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    rope_theta: float = 10000.0
    use_bias: bool = False
    window: PositiveInt | None = None

    @model_validator(mode="after")
    def _check(self) -> AttentionConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        return self


class AttentionMixer(Mixer):
    """Grouped-query attention with RoPE.

    Session state: `k`, `v` `[S, Hkv, D]` (activation dtype; keys stored already rotated) and `length` `[]` int64,
    the number of tokens the session has seen. Full attention has S = max_context entries indexed by position;
    sliding-window attention has S = window entries, position p stored at p % window.
    """

    kind = "attention"
    config_class = AttentionConfig

    def __init__(self, hidden_size: int, cfg: AttentionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(hidden_size, Hq * D, bias=cfg.use_bias)
        self.k_proj = nn.Linear(hidden_size, Hkv * D, bias=cfg.use_bias)
        self.v_proj = nn.Linear(hidden_size, Hkv * D, bias=cfg.use_bias)
        self.o_proj = nn.Linear(Hq * D, hidden_size, bias=cfg.use_bias)
        self.window = cfg.window

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        if self.window is None:
            kv = StateSpec((max_context, c.num_kv_heads, c.head_dim), dtype=None, per_token=True)
        else:
            kv = StateSpec((self.window, c.num_kv_heads, c.head_dim), dtype=None)
        return {"k": kv, "v": kv, "length": StateSpec((), dtype=torch.int64)}

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.cfg
        q = self.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim))
        k = self.k_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).unflatten(-1, (c.num_kv_heads, c.head_dim))
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

    def _cache_index(self, positions: torch.Tensor) -> torch.Tensor:
        return positions if self.window is None else positions % self.window

    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: PrefillBatch) -> torch.Tensor:
        q, k, v = self._qkv(x)
        lengths = state["length"].index_select(0, batch.slots).tolist()
        outs = []
        for i, (start, end) in enumerate(batch.offsets):
            slot, n, T = batch.slots[i], lengths[i], end - start
            capacity = state["k"].shape[1]
            if self.window is None and n + T > capacity:
                raise ContextOverflowError(
                    f"session needs {n + T} tokens of context but the attention KV cache holds {capacity} "
                    "(raise max_context)"
                )
            pos = torch.arange(n, n + T, device=x.device)
            qi = apply_rope(q[start:end], pos, self.cfg.rope_theta)
            ki = apply_rope(k[start:end], pos, self.cfg.rope_theta)
            # Keys this chunk may see from before it: all of them, or the last window - 1 for SWA.
            first = 0 if self.window is None else max(0, n - self.window + 1)
            past = torch.arange(first, n, device=x.device)
            keys = torch.cat([state["k"][slot, self._cache_index(past)], ki])
            values = torch.cat([state["v"][slot, self._cache_index(past)], v[start:end]])
            key_pos = torch.cat([past, pos])
            mask = key_pos[None, :] <= pos[:, None]
            if self.window is not None:
                mask &= key_pos[None, :] > pos[:, None] - self.window
            outs.append(attend(qi[None], keys[None], values[None], mask[None])[0])
            # Write this chunk's keys (for SWA only the last `window` of them survive in the ring).
            keep = slice(max(0, T - state["k"].shape[1]), T)
            state["k"][slot, self._cache_index(pos[keep])] = ki[keep].to(state["k"].dtype)
            state["v"][slot, self._cache_index(pos[keep])] = v[start:end][keep].to(state["v"].dtype)
        state["length"].index_add_(0, batch.slots, torch.tensor(batch.lens, device=x.device))
        return self.o_proj(torch.cat(outs).flatten(-2))

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(x)  # [B, H, D]
        n = state["length"].index_select(0, slots)  # [B] tokens seen before this one
        capacity = state["k"].shape[1]
        longest = int(n.max())  # the one host sync of this step: it sizes the keys gathered below
        if self.window is None and longest >= capacity:
            raise ContextOverflowError(
                f"a session reached {longest + 1} tokens but the attention KV cache holds {capacity} "
                "(raise max_context)"
            )
        # apply_rope's token axis is the batch axis here: one position per session.
        q = apply_rope(q, n, self.cfg.rope_theta)
        k = apply_rope(k, n, self.cfg.rope_theta)
        idx = self._cache_index(n)
        state["k"][slots, idx] = k.to(state["k"].dtype)
        state["v"][slots, idx] = v.to(state["v"].dtype)
        # Only the first min(n+1, S) cache entries hold this session's keys; for the ring that is all of them
        # once it has wrapped, and RoPE already encodes the positions so entry order does not matter.
        used = min(longest + 1, capacity)
        keys = state["k"][slots, :used]
        values = state["v"][slots, :used]
        mask = torch.arange(used, device=x.device)[None, :] < (n + 1)[:, None]
        out = attend(q[:, None], keys, values, mask[:, None, :])[:, 0]
        state["length"].index_add_(0, slots, torch.ones_like(n))
        return self.o_proj(out.flatten(-2))


class SlidingWindowMixer(AttentionMixer):
    """`swa`: attention over the last `window` tokens (this one included), with a bounded ring-buffer state."""

    kind = "swa"
