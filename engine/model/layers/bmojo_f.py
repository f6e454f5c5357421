"""B'MOJO-F, hybrid-model-factory's fading-memory B'MOJO: sliding-window attention over the last W tokens joined
with attention over the "fading tokens" (a recurrent layer's outputs) of the W positions before them.

For the token at position i (docs/design/hmf.md): queries from the token (RoPE at i); in-context keys and values from
tokens i-W+1..i; fading keys and values from the recurrent layer's (`ssm`) outputs at positions i-2W+1..i-W (RoPE at
their own positions); one softmax over both sets. With `tie_attn_weights` both paths share q/k/v projections and
norms, else the fading path has its own (`q_proj_`, ...), its own queries included. kvfree's full B'MOJO (`bmojo`) is
a different layer (docs/design/bmojo.md).

The layer projects and rotates (positions from each session's `length`, read on the device); the attention itself and
the rings are the ops of `kvfree.kernels.bmojo_f`, batched over the sessions: `chunk_bmojo_f_attention` (prefill) and
`fused_recurrent_bmojo_f_attention` (decode, which reads nothing on the host in either its Triton or its PyTorch
form, so a decode step is captured in a CUDA graph as the recurrent layer's allows). The training forward runs the
same math on whole sequences (`bmojo_f_attention`). The recurrent layer runs its own kernels.

Under tensor parallelism (bmojo.FadingMemoryMixer) a rank holds its block of the recurrent layer (split as its own
kind splits it) and of the attention's heads; the recurrent layer's output is all-reduced, since every fading key and
value reads all its channels. The rings split by KV head; `length` is held whole.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator
from torch import nn

from kvfree.engine.model.layers.base import Mixer, StateSpec
from kvfree.engine.model.layers.bmojo import FadingMemoryMixer
from kvfree.engine.model.layers.gka import GKAConfig, GKAMixer
from kvfree.engine.model.layers.mamba2 import Mamba2Config, Mamba2Mixer
from kvfree.engine.model.layers.norms import RMSNorm
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.strict_config import PositiveInt, StrictConfig
from kvfree.engine.model.tensor_parallel import Split
from kvfree.kernels.attention import apply_rope
from kvfree.kernels.bmojo_f import bmojo_f_attention, chunk_bmojo_f_attention, fused_recurrent_bmojo_f_attention


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

    @property
    def graph_blocker(self) -> str:  # type: ignore[override]
        """The fading layer's: the attention's decode reads nothing on the host (Triton or PyTorch)."""
        blocker = self.ssm.graph_blocker
        return f"its fading layer ({self.ssm.kind}): {blocker}" if blocker else ""

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

    # -- the attention: projections here, the banded attention and the rings in kvfree.kernels.bmojo_f ----------
    def _project(self, x: torch.Tensor, fading: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries from x, keys and values from x (in-context) and from the fading tokens `[..., T, d]`, the queries
        and keys normed and rotated at `pos` `[T]`: q, qf `[..., T, Hq, D]`; k, v, kf, vf `[..., T, Hkv, D]`. Tied
        weights give the fading path the in-context queries (the same projection of the same x)."""
        c = self.cfg
        fading_path = self.attn_fading or self.attn

        def heads(proj: nn.Linear, src: torch.Tensor, n: int) -> torch.Tensor:
            return proj(src).unflatten(-1, (n, c.head_dim))

        q = self.attn.q_norm(heads(self.attn.q_proj, x, c.num_heads))
        k = self.attn.k_norm(heads(self.attn.k_proj, x, c.num_kv_heads))
        kf = fading_path.k_norm(heads(fading_path.k_proj, fading, c.num_kv_heads))
        parts = [q, k, kf]
        if self.attn_fading is not None:
            parts.append(self.attn_fading.q_norm(heads(self.attn_fading.q_proj, x, c.num_heads)))
        # One rotation for every rotated tensor (the angles computed once); RoPE is per head, so this is each alone.
        rotated = apply_rope(torch.cat(parts, -2), pos, c.rope_theta).split([t.shape[-2] for t in parts], -2)
        q, k, kf = rotated[:3]
        qf = rotated[3] if self.attn_fading is not None else q
        v = heads(self.attn.v_proj, x, c.num_kv_heads)
        vf = heads(fading_path.v_proj, fading, c.num_kv_heads)
        return q, k, v, qf, kf, vf

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return self.o_proj(o.flatten(-2).to(self.o_proj.weight.dtype))

    @staticmethod
    def _rings(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [state[name] for name in ("k_ctx", "v_ctx", "k_fade", "v_fade", "length")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fading = self._whole(self.ssm(x))
        pos = torch.arange(x.shape[1], device=x.device)
        o = bmojo_f_attention(*self._project(x, fading, pos), self.cfg.window, self.cfg.head_dim**-0.5)
        return self._out(o)

    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        fading = self._whole(self.ssm.prefill(x, self._ssm_state(state), batch))
        # Each token's position, on the device: its session's length plus its offset in the packed sequence.
        cu = batch.cu_seqlens
        t = torch.arange(x.shape[0], device=x.device, dtype=cu.dtype)
        seq = torch.searchsorted(cu[1:], t, right=True)
        pos = state["length"].index_select(0, batch.state_indices)[seq] + (t - cu[seq])
        o = chunk_bmojo_f_attention(
            *self._project(x, fading, pos), *self._rings(state), batch.state_indices, batch.cu_seqlens,
            self.cfg.window, self.cfg.head_dim**-0.5, cu_seqlens_cpu=batch.cu_seqlens_cpu,
        )  # fmt: skip
        return self._out(o)

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        fading = self._whole(self.ssm.decode(x, self._ssm_state(state), batch))
        pos = state["length"].index_select(0, batch.state_indices)  # read on the device: capturable
        o = fused_recurrent_bmojo_f_attention(
            *self._project(x, fading, pos), *self._rings(state), batch.state_indices, self.cfg.window,
            self.cfg.head_dim**-0.5,
        )  # fmt: skip
        return self._out(o)
