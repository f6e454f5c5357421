"""B'MOJO-F, hybrid-model-factory's fading-memory B'MOJO: sliding-window attention over the last W tokens joined
with attention over the "fading tokens" (a recurrent layer's outputs) of the W positions before them.

For the token at position i (docs/design/hmf.md): queries from the token (RoPE at i); in-context keys and values from
tokens i-W+1..i; fading keys and values from the recurrent layer's (`ssm`) outputs at positions i-2W+1..i-W (RoPE at
their own positions); one softmax over both sets. With `tie_attn_weights` both paths share q/k/v projections and
norms, else the fading path has its own (`q_proj_`, ...), its own queries included. kvfree's full B'MOJO (`bmojo`) is
a different layer (docs/design/bmojo.md).

This is the PyTorch reference: serving runs the attention session by session (a host loop; the recurrent layer runs
its own kernels), so decode is not captured in CUDA graphs.

Under tensor parallelism (bmojo.FadingMemoryMixer) a rank holds its block of the recurrent layer (split as its own
kind splits it) and of the attention's heads; the recurrent layer's output is all-reduced, since every fading key and
value reads all its channels. The rings split by KV head; `length` is held whole.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import nn

from kvfree.engine.layers.base import Mixer, StateSpec
from kvfree.engine.layers.bmojo import FadingMemoryMixer
from kvfree.engine.layers.gka import GKAConfig, GKAMixer
from kvfree.engine.layers.mamba2 import Mamba2Config, Mamba2Mixer
from kvfree.engine.layers.norms import RMSNorm
from kvfree.engine.step_batch import StepBatch
from kvfree.engine.strict_config import PositiveInt, StrictConfig
from kvfree.engine.tensor_parallel import Split
from kvfree.kernels.attention import apply_rope


class BMojoFConfig(StrictConfig):
    """B'MOJO-F: the attention's shape (Qwen3's, with q/k RMSNorm), the window W, and the fading layer's config."""

    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    window: PositiveInt  # W: in-context keys i-W+1..i, fading keys i-2W+1..i-W
    rope_theta: float = 10000.0
    qk_norm_eps: float = Field(1e-6, gt=0)
    tie_attn_weights: bool = True
    fading_gka: GKAConfig | None = None  # exactly one of these: the recurrent layer making the fading tokens
    fading_mamba2: Mamba2Config | None = None

    @model_validator(mode="after")
    def _check(self) -> BMojoFConfig:
        if (self.fading_gka is None) == (self.fading_mamba2 is None):
            raise ValueError("bmojo_f: set exactly one of fading_gka and fading_mamba2")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        return self

    @property
    def kv_heads(self) -> int:
        """The KV heads, under the name B'MOJO's config gives them (read by `FadingMemoryMixer`)."""
        return self.num_kv_heads


class _QKV(nn.Module):
    """One path's projections and q/k norms."""

    def __init__(self, hidden: int, c: BMojoFConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, c.num_kv_heads * c.head_dim, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.qk_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.qk_norm_eps)


class BMojoFMixer(FadingMemoryMixer):
    """Session state: the fading layer's own state (names prefixed `ssm_`), the last W in-context keys and values
    `k_ctx`, `v_ctx` `[W, Hkv, D]` and the last 2W fading keys and values `k_fade`, `v_fade` `[2W, Hkv, D]` (rings:
    position p at p % size, keys rotated), and `length` (tokens seen)."""

    kind = "bmojo_f"
    config_class = BMojoFConfig
    graph_blocker = "the attention runs session by session (a host loop over the batch)"

    def __init__(self, hidden_size: int, cfg: BMojoFConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ssm_cls, ssm_cfg = self.ssm_of(cfg)
        self.ssm = ssm_cls(hidden_size, ssm_cfg)
        self.attn = _QKV(hidden_size, cfg)
        self.attn_fading = None if cfg.tie_attn_weights else _QKV(hidden_size, cfg)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, hidden_size, bias=False)

    @staticmethod
    def ssm_of(cfg: BMojoFConfig) -> tuple[type[Mixer], StrictConfig]:
        if cfg.fading_gka is not None:
            return GKAMixer, cfg.fading_gka
        return Mamba2Mixer, cfg.fading_mamba2

    @classmethod
    def _with_blocks(cls, cfg: BMojoFConfig, heads: int, kv_heads: int, ssm: StrictConfig) -> BMojoFConfig:
        field = "fading_gka" if cfg.fading_gka is not None else "fading_mamba2"
        return cfg.model_copy(update={"num_heads": heads, "num_kv_heads": kv_heads, field: ssm})

    def weight_splits(self) -> dict[str, Split]:
        # The q/k norms (one weight of head_dim, shared by the heads) are held whole.
        paths = ["attn."] if self.attn_fading is None else ["attn.", "attn_fading."]
        return self._attention_splits(paths, bias=False)

    def reset_parameters(self) -> None:
        self.ssm.reset_parameters()

    def on_load(self) -> None:
        self.ssm.on_load()

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        specs = {f"ssm_{name}": spec for name, spec in self.ssm.state_specs(max_context).items()}
        ctx, fade = (
            StateSpec((c.window, c.num_kv_heads, c.head_dim), None, split=self.kv_split),
            StateSpec((2 * c.window, c.num_kv_heads, c.head_dim), None, split=self.kv_split),
        )
        return specs | {"k_ctx": ctx, "v_ctx": ctx, "k_fade": fade, "v_fade": fade,
                        "length": StateSpec((), dtype=torch.int64)}  # fmt: skip

    def reset_state(self, state: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        self.ssm.reset_state(self._ssm_state(state), slots)
        for name in ("k_ctx", "v_ctx", "k_fade", "v_fade", "length"):
            state[name].index_fill_(0, slots, 0)

    @staticmethod
    def _ssm_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name[4:]: t for name, t in state.items() if name.startswith("ssm_")}

    # -- the attention of one session ---------------------------------------------------------------------------
    def _qkv(self, path: _QKV, x: torch.Tensor, kv_from: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries from x, keys and values from kv_from `[T, d]`, rotated at pos: q `[T, Hq, D]`, k, v `[T, Hkv, D]`."""
        c = self.cfg
        q = path.q_norm(path.q_proj(x).unflatten(-1, (c.num_heads, c.head_dim)))
        k = path.k_norm(path.k_proj(kv_from).unflatten(-1, (c.num_kv_heads, c.head_dim)))
        v = path.v_proj(kv_from).unflatten(-1, (c.num_kv_heads, c.head_dim))
        return apply_rope(q, pos, c.rope_theta), apply_rope(k, pos, c.rope_theta), v

    def _session(
        self, x: torch.Tensor, fading: torch.Tensor, n: int, rings: dict[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """T new tokens x and their fading tokens `[T, d]` of a session that has seen n tokens -> `[T, Hq D]`;
        `rings` (the session's ring rows, or None for a fresh sequence) receive the new keys and values."""
        c, W = self.cfg, self.cfg.window
        T = x.shape[0]
        pos = torch.arange(n, n + T, device=x.device)
        q, k, v = self._qkv(self.attn, x, x, pos)
        fading_path = self.attn_fading or self.attn
        qf, kf, vf = self._qkv(fading_path, x, fading, pos)
        if rings is not None and n > 0:  # earlier keys from the rings, in position order
            prev_c = torch.arange(max(0, n - W), n, device=x.device)
            prev_f = torch.arange(max(0, n - 2 * W), n, device=x.device)
            k = torch.cat([rings["k_ctx"][prev_c % W].to(k.dtype), k])
            v = torch.cat([rings["v_ctx"][prev_c % W].to(v.dtype), v])
            kf = torch.cat([rings["k_fade"][prev_f % (2 * W)].to(kf.dtype), kf])
            vf = torch.cat([rings["v_fade"][prev_f % (2 * W)].to(vf.dtype), vf])
            pos_c, pos_f = torch.cat([prev_c, pos]), torch.cat([prev_f, pos])
        else:
            pos_c = pos_f = pos
        if rings is not None:
            keep_c, keep_f = pos[-W:], pos[-2 * W :]
            rings["k_ctx"][keep_c % W] = k[-len(keep_c) :].to(rings["k_ctx"].dtype)
            rings["v_ctx"][keep_c % W] = v[-len(keep_c) :].to(rings["v_ctx"].dtype)
            rings["k_fade"][keep_f % (2 * W)] = kf[-len(keep_f) :].to(rings["k_fade"].dtype)
            rings["v_fade"][keep_f % (2 * W)] = vf[-len(keep_f) :].to(rings["v_fade"].dtype)
        g = c.num_heads // c.num_kv_heads
        scale = c.head_dim**-0.5
        f = torch.promote_types(q.dtype, torch.float32)
        s_c = torch.einsum("thd,shd->hts", q.to(f), k.repeat_interleave(g, 1).to(f)) * scale
        s_f = torch.einsum("thd,shd->hts", qf.to(f), kf.repeat_interleave(g, 1).to(f)) * scale
        i = pos[:, None]
        s_c = s_c.masked_fill(~((pos_c[None] <= i) & (pos_c[None] > i - W)), float("-inf"))
        s_f = s_f.masked_fill(~((pos_f[None] <= i - W) & (pos_f[None] > i - 2 * W)), float("-inf"))
        p = torch.softmax(torch.cat([s_c, s_f], dim=-1), dim=-1)  # one softmax over both key sets
        vv = torch.cat([v, vf]).repeat_interleave(g, 1).to(f)
        return torch.einsum("hts,shd->thd", p, vv).flatten(-2).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fading = self._whole(self.ssm(x))
        out = torch.stack([self._session(x[b], fading[b], 0, None) for b in range(x.shape[0])])
        return self.o_proj(out.to(self.o_proj.weight.dtype))

    def _serve(self, x: torch.Tensor, fading: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch,
               lengths: list[int]) -> torch.Tensor:  # fmt: skip
        slots = batch.state_indices.tolist()
        out, start = [], 0
        for slot, T in zip(slots, lengths, strict=True):
            n = int(state["length"][slot])
            rings = {name: state[name][slot] for name in ("k_ctx", "v_ctx", "k_fade", "v_fade")}
            out.append(self._session(x[start : start + T], fading[start : start + T], n, rings))
            state["length"][slot] = n + T
            start += T
        return self.o_proj(torch.cat(out).to(self.o_proj.weight.dtype))

    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        fading = self._whole(self.ssm.prefill(x, self._ssm_state(state), batch))
        cu = batch.cu_seqlens_cpu if batch.cu_seqlens_cpu is not None else batch.cu_seqlens.cpu()
        cu = [int(c) for c in cu]
        return self._serve(x, fading, state, batch, [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)])

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        fading = self._whole(self.ssm.decode(x, self._ssm_state(state), batch))
        return self._serve(x, fading, state, batch, [1] * x.shape[0])
