"""The B'MOJO mixer (docs/design/bmojo.md): a Mamba-2 fading memory plus NoPE attention over a bounded key set.

Per token t (chunk start s = (t // w) * w), with P2 wiring (spec §3.1; u is the mixer input, already normed by the
block):

    y_t   = Mamba2(u)_t                                   fading memory (composed Mamba2Mixer)
    eps_t = mean((y_t - mean(y_{t-1..t-k}))^2)            innovation score (kernels/bmojo.innovation)
    a_t   = RMSNorm(u_t + y_t);  q, k, v = W_Q a, W_K a, W_V a
    o_t   = attn(q_t ; window(t) ∪ fading(s) ∪ eidetic(s))    memory rebuilt once per chunk (semantics C)
    out_t = y_t + W_O o_t                                 (the block adds the residual)

Fading tokens are W_K/W_V of RMSNorm(y_{s-m_f..s-1}); eidetic tokens are the K/V of the m_e positions p < s with the
largest eps. The engine's block hands the mixer only norm(h), so P2's "RMSNorm_2(h + y)" becomes RMSNorm(u + y) here:
the same layer up to the learned gain of the block norm (u = g * h / rms(h)).

P1 (literal Algorithm 1): y is not added to the output, q/k/v come from u, and fading tokens are RMSNorm(y).

Per-session state (fixed shapes, spec §3.8): the Mamba-2 `conv`/`ssm` states, `y_buf` (last max(k, m_f) outputs,
oldest first, fp32), a ring of the last w K/V (`ring_k`, `ring_v`, slot p % w) with their scores `ring_eps`, the
active fading K/V (`fad_k`, `fad_v`, valid count `fad_n`), the active eidetic store (`eid_k`, `eid_v`, `eid_eps`,
`eid_pos`, valid count `eid_n`) and the position `t`. The memory is published lazily: at the first token of a chunk
(t % w == 0, t > 0), from the ring, which then holds exactly the finished chunk. Zeros are a new session.

Serving runs the SSM through the composed Mamba-2 mixer's own `prefill` / `decode` (which update the `conv` / `ssm`
pool rows in place), then the memory part through one op, `chunk_bmojo` / `fused_recurrent_bmojo`
(kernels/bmojo), which updates the other rows; training runs `Mamba2Mixer.forward` and `bmojo_chunked` from a fresh
state.

Under tensor parallelism (`FadingMemoryMixer`, shared with B'MOJO-F) a rank holds its block of the SSM's heads (as a
`mamba2` layer splits them) and of the attention's heads. y is the SSM's row-parallel out projection, so each rank
all-reduces its partial sum and holds y whole: the innovation score, RMSNorm(u + y) and the fading tokens' norm need
all its channels, and the eidetic selection must be the same on every rank. The K/V states split by KV head; `t`,
`y_buf`, the scores, the eidetic positions and the counts are held whole (identical on every rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from kvfree.engine.model.layers.base import Mixer, StateSpec
from kvfree.engine.model.layers.mamba2 import Mamba2Config, Mamba2Mixer
from kvfree.engine.model.layers.norms import RMSNorm
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.strict_config import PositiveInt, StrictConfig
from kvfree.engine.model.tensor_parallel import ONE_RANK, ROW, ROW_BIAS, Split, TensorParallel
from kvfree.kernels.bmojo import MemoryState, bmojo_chunked, chunk_bmojo, decode_graph_safe, fused_recurrent_bmojo

if TYPE_CHECKING:
    from kvfree.engine.model.layers.bmojo_f import BMojoFConfig

State = dict[str, torch.Tensor]


class BMojoConfig(StrictConfig):
    """B'MOJO fading + eidetic memory (docs/design/bmojo.md, chunked semantics C of §3.3).

    One layer = a Mamba-2 mixer (the fading memory, fields `ssm_*`) followed by NoPE attention whose keys are the
    last `window` tokens, `fading_tokens` SSM outputs before the current chunk and the `eidetic_tokens` past tokens
    with the largest innovation score. Memory is rebuilt once per chunk of `window` tokens.
    """

    num_heads: PositiveInt  # attention query heads
    head_dim: PositiveInt  # attention head width d_h
    ssm_num_heads: PositiveInt  # Mamba-2 heads H_s (d_inner = ssm_num_heads * ssm_head_dim)
    ssm_head_dim: PositiveInt  # Mamba-2 head width P
    num_kv_heads: PositiveInt | None = None  # GQA key/value heads; None = num_heads
    window: PositiveInt = 512  # w: sliding window AND chunk length (memory refresh period)
    fading_tokens: int = 1  # m_f: SSM outputs y_{s-m_f..s-1} before the chunk start s; 0 = no fading memory
    eidetic_tokens: int = 64  # m_e: capacity of the top-innovation store; 0 = B'MOJO-F
    predictor_taps: PositiveInt = 4  # k: fixed running-average predictor of y_t from y_{t-1..t-k}
    # "P2": SSM output joins the residual, attention reads norm(u + y); "P1": literal Algorithm 1
    wiring: Literal["P1", "P2"] = "P2"
    ssm_state_size: PositiveInt = 128  # N
    ssm_n_groups: PositiveInt = 1  # G (B/C groups)
    ssm_conv_kernel: PositiveInt = 4
    ssm_chunk_size: PositiveInt = 64  # SSD chunk length (numerics only, not semantics)
    ssm_time_step_limit: list[float] | None = None
    use_bias: bool = False
    norm_eps: float = Field(1e-5, gt=0)

    @model_validator(mode="after")
    def _check(self) -> BMojoConfig:
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads ({self.num_heads})")
        # m_f, m_e <= w: at every chunk boundary the finished chunk alone can fill the store (bmojo.md §3.3), so
        # chunks >= 1 never have empty memory slots and the ring (w entries) holds every candidate at publish time.
        for name in ("fading_tokens", "eidetic_tokens"):
            value = getattr(self, name)
            if not 0 <= value <= self.window:
                raise ValueError(f"{name}: must be in [0, window={self.window}], got {value}")
        if self.ssm_num_heads % self.ssm_n_groups:
            raise ValueError(f"ssm_n_groups: {self.ssm_n_groups} must divide ssm_num_heads ({self.ssm_num_heads})")
        if self.ssm_time_step_limit is not None and len(self.ssm_time_step_limit) != 2:
            raise ValueError(f"ssm_time_step_limit: expected [min, max], got {self.ssm_time_step_limit}")
        return self

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


class FadingMemoryMixer(Mixer):
    """What B'MOJO and B'MOJO-F share under tensor parallelism: a recurrent mixer `self.ssm` (the fading memory, of
    its own kind) composed with attention whose query heads read `kv_heads` key/value heads.

    A rank holds its block of the SSM as the SSM's kind splits it (its parameters under `ssm.`, its state tensors
    under the subclass's names) and its block of the attention's heads, KV heads held whole by several ranks when
    there are fewer than ranks (as attention's). The SSM's out projection is row-parallel, but its output y feeds
    functions of every channel (the keys' RMSNorm and W_K, B'MOJO's innovation score): `_whole` all-reduces it, so
    every rank holds the y of one rank. The attention's out projection is row-parallel: the block all-reduces it.
    """

    ssm: Mixer
    cfg: BMojoConfig | BMojoFConfig

    @staticmethod
    def ssm_of(cfg: StrictConfig) -> tuple[type[Mixer], StrictConfig]:
        """The SSM's mixer class and config, from the layer's config."""
        raise NotImplementedError

    @classmethod
    def _with_blocks(cls, cfg: StrictConfig, heads: int, kv_heads: int, ssm: StrictConfig) -> StrictConfig:
        """`cfg` with a rank's query heads, KV heads and SSM config."""
        raise NotImplementedError

    @classmethod
    def shard_config(cls, cfg: StrictConfig, tp: TensorParallel, what: str) -> StrictConfig:
        """A rank's block of the SSM (refused as its own kind refuses, e.g. Mamba-2 groups that do not divide) and
        of the attention's query heads and the KV heads they read."""
        if tp.size == 1:
            return cfg
        ssm_cls, ssm_cfg = cls.ssm_of(cfg)
        ssm = ssm_cls.shard_config(ssm_cfg, tp, f"{what} fading-memory SSM ({ssm_cls.kind})")
        heads, _ = tp.heads(cfg.num_heads, f"{what} num_heads")
        kv_heads, _ = tp.heads(cfg.kv_heads, f"{what} num_kv_heads", replicate=True)
        return cls._with_blocks(cfg, heads, kv_heads, ssm)

    # The SSM is built before the ranks are known (`build_mixer` sets them on the layer afterwards); it reads them to
    # split its tensors (GKA's replicated heads), so the layer hands them on.
    @property
    def tp(self) -> TensorParallel:  # type: ignore[override]
        return self.__dict__.get("_tp", ONE_RANK)

    @tp.setter
    def tp(self, tp: TensorParallel) -> None:
        self.__dict__["_tp"] = tp
        self.ssm.tp = tp

    @property
    def whole_cfg(self) -> StrictConfig | None:  # type: ignore[override]
        return self.__dict__.get("_whole_cfg")

    @whole_cfg.setter
    def whole_cfg(self, cfg: StrictConfig | None) -> None:
        self.__dict__["_whole_cfg"] = cfg
        self.ssm.whole_cfg = None if cfg is None else self.ssm_of(cfg)[1]

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 unless there are fewer KV heads than ranks)."""
        whole = self.whole_cfg or self.cfg
        return self.tp.heads(whole.kv_heads, "num_kv_heads", replicate=True)[1]

    @property
    def kv_split(self) -> Split:
        """A K/V state tensor `[n, Hkv, dh]`: by KV head."""
        return Split(axis=1, replicas=(self.kv_replicas,))

    def _attention_splits(self, paths: list[str], bias: bool) -> dict[str, Split]:
        """The SSM's splits under `ssm.`, then each attention path's q (by head) and k, v (by KV head) projections
        (prefix `path`), and the row-parallel out projection `o_proj`."""
        kv = Split(replicas=(self.kv_replicas,))
        splits = {f"ssm.{name}": split for name, split in self.ssm.weight_splits().items()}
        tensors = ("weight", "bias") if bias else ("weight",)
        for path in paths:
            for t in tensors:
                splits.update({f"{path}q_proj.{t}": Split(), f"{path}k_proj.{t}": kv, f"{path}v_proj.{t}": kv})
        splits["o_proj.weight"] = ROW
        if bias:
            splits["o_proj.bias"] = ROW_BIAS
        return splits

    def _whole(self, partial: torch.Tensor) -> torch.Tensor:
        """The SSM's output, whole on every rank, from this rank's row-parallel partial sum (summed in place)."""
        return self.tp.all_reduce(partial)


class BMojoMixer(FadingMemoryMixer):
    """Mamba-2 (fading memory) + innovation-selected eidetic memory + sliding window, one NoPE attention."""

    kind = "bmojo"
    config_class = BMojoConfig

    @property
    def graph_blocker(self) -> str:  # type: ignore[override]
        """Empty where decode runs the Triton op (no host sync, fixed shapes); the reference op syncs."""
        weight = self.q_proj.weight
        if decode_graph_safe(weight.device, weight.dtype):
            return ""
        return "chunk boundaries are found with `nonzero()` on the host (the PyTorch reference decode)"

    def __init__(self, hidden_size: int, cfg: BMojoConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.w, self.m_f, self.m_e = cfg.window, cfg.fading_tokens, cfg.eidetic_tokens
        self.buf_len = max(cfg.predictor_taps, cfg.fading_tokens)
        # The fading memory is a whole Mamba-2 mixer, reused by composition (its own params, conv and SSM state).
        self.ssm = Mamba2Mixer(hidden_size, cfg.mamba2_config())
        Hq, Hkv, dh = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.attn_norm = RMSNorm(hidden_size, cfg.norm_eps)
        self.q_proj = nn.Linear(hidden_size, Hq * dh, bias=cfg.use_bias)
        self.k_proj = nn.Linear(hidden_size, Hkv * dh, bias=cfg.use_bias)
        self.v_proj = nn.Linear(hidden_size, Hkv * dh, bias=cfg.use_bias)
        self.o_proj = nn.Linear(Hq * dh, hidden_size, bias=cfg.use_bias)

    @staticmethod
    def ssm_of(cfg: BMojoConfig) -> tuple[type[Mixer], StrictConfig]:
        return Mamba2Mixer, cfg.mamba2_config()

    @classmethod
    def _with_blocks(cls, cfg: BMojoConfig, heads: int, kv_heads: int, ssm: Mamba2Config) -> BMojoConfig:
        update = {"num_heads": heads, "num_kv_heads": kv_heads, "ssm_num_heads": ssm.num_heads,
                  "ssm_n_groups": ssm.n_groups}  # fmt: skip
        return cfg.model_copy(update=update)

    def weight_splits(self) -> dict[str, Split]:
        return self._attention_splits([""], self.cfg.use_bias)  # attn_norm: held whole (it normalises u + y)

    def reset_parameters(self) -> None:
        self.ssm.reset_parameters()
        with torch.no_grad():
            self.attn_norm.weight.fill_(1.0)

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        Hkv, dh = c.kv_heads, c.head_dim
        i64, f32 = torch.int64, torch.float32
        kv = self.kv_split  # the rest (positions, counts, y and its scores) is the same on every rank: held whole
        specs = {
            "t": StateSpec((), dtype=i64),
            **self.ssm.state_specs(max_context),  # "conv" [K-1, conv_dim] (activation dtype), "ssm" [H, P, N] fp32
            "y_buf": StateSpec((self.buf_len, self.hidden_size), dtype=f32),
            "ring_k": StateSpec((self.w, Hkv, dh), dtype=None, split=kv),
            "ring_v": StateSpec((self.w, Hkv, dh), dtype=None, split=kv),
            "ring_eps": StateSpec((self.w,), dtype=f32),
            "fad_k": StateSpec((self.m_f, Hkv, dh), dtype=None, split=kv),
            "fad_v": StateSpec((self.m_f, Hkv, dh), dtype=None, split=kv),
            "fad_n": StateSpec((), dtype=i64),
            "eid_k": StateSpec((self.m_e, Hkv, dh), dtype=None, split=kv),
            "eid_v": StateSpec((self.m_e, Hkv, dh), dtype=None, split=kv),
            "eid_eps": StateSpec((self.m_e,), dtype=f32),
            "eid_pos": StateSpec((self.m_e,), dtype=i64),
            "eid_n": StateSpec((), dtype=i64),
        }
        return specs

    # -- shared pieces -----------------------------------------------------------------------------------------
    def _kv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        return (
            self.k_proj(a).unflatten(-1, (c.kv_heads, c.head_dim)),
            self.v_proj(a).unflatten(-1, (c.kv_heads, c.head_dim)),
        )

    def _attn_input(self, u: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.attn_norm(u + y) if self.cfg.wiring == "P2" else u

    def _fading_kv(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fading tokens: SSM outputs `[..., D]` through the attention pre-norm and the same W_K, W_V (spec §3.6)."""
        return self._kv(self.attn_norm(y.to(self.attn_norm.weight.dtype)))

    def _output(self, y: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """W_O o (a partial sum under tensor parallelism), plus y under P2. y is whole on every rank and the block
        all-reduces the output, so only rank 0 adds it (as a row-parallel bias)."""
        out = self.o_proj(o.flatten(-2))
        return y + out if self.cfg.wiring == "P2" and self.tp.rank == 0 else out

    def _qkv(self, u: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's q `[..., Hq, dh]` and k, v `[..., Hkv, dh]` from the mixer input u and the SSM output y."""
        a = self._attn_input(u, y)
        k, v = self._kv(a)
        return self.q_proj(a).unflatten(-1, (self.cfg.num_heads, self.cfg.head_dim)), k, v

    def _memory(self, state: State) -> list[torch.Tensor]:
        """The memory-state pool tensors, in the order the ops take them (`MemoryState`)."""
        return [state[name] for name in MemoryState._fields]

    # -- training: whole sequences from a new session's state ----------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        y = self._whole(self.ssm(x))
        q, k, v = self._qkv(x, y)
        specs = self.state_specs(0)
        fresh = MemoryState(
            *(
                torch.zeros((B, *specs[name].shape), dtype=specs[name].dtype or x.dtype, device=x.device)
                for name in MemoryState._fields
            )
        )
        o, _ = bmojo_chunked(q, k, v, y, fresh, [0] * B, [T] * B, self._fading_kv, self.cfg.predictor_taps)
        return self._output(y, o)

    # -- serving: the SSM through the Mamba-2 mixer's serving ops, then one memory op ----------------------------
    def _ssm_state(self, state: State) -> State:
        return {"conv": state["conv"], "ssm": state["ssm"]}

    def prefill(self, x: torch.Tensor, state: State, batch: StepBatch) -> torch.Tensor:
        y = self._whole(self.ssm.prefill(x, self._ssm_state(state), batch))  # writes the conv/ssm rows
        q, k, v = self._qkv(x, y)
        o = chunk_bmojo(
            q, k, v, y, *self._memory(state), batch.state_indices, batch.cu_seqlens, self._fading_kv,
            self.cfg.predictor_taps, cu_seqlens_cpu=batch.cu_seqlens_cpu,
        )  # fmt: skip
        return self._output(y, o)

    def decode(self, x: torch.Tensor, state: State, batch: StepBatch) -> torch.Tensor:
        y = self._whole(self.ssm.decode(x, self._ssm_state(state), batch))  # writes the conv/ssm rows
        q, k, v = self._qkv(x, y)
        o = fused_recurrent_bmojo(
            q, k, v, y, *self._memory(state), batch.state_indices, self._fading_kv, self.cfg.predictor_taps
        )
        return self._output(y, o)


def state_bytes(cfg: BMojoConfig, hidden_size: int, act_bytes: int) -> int:
    """Bytes of one session's state for one B'MOJO layer (spec §8), independent of the context length.

    2*Hkv*dh*(w + m_f + m_e)*b  (ring, fading, eidetic K/V)  + 4*(w + m_e) + 8*m_e  (ring/eidetic scores, positions)
    + 3*8  (t, fad_n, eid_n)  + 4*H_s*P*N  (SSM)  + b*(K-1)*(H_s*P + 2*G*N)  (conv tail)  + 4*max(k, m_f)*d  (y_buf)
    """
    c = cfg
    kv = 2 * c.kv_heads * c.head_dim * (c.window + c.fading_tokens + c.eidetic_tokens) * act_bytes
    scores = 4 * (c.window + c.eidetic_tokens) + 8 * c.eidetic_tokens + 3 * 8
    d_inner = c.ssm_num_heads * c.ssm_head_dim
    ssm = 4 * d_inner * c.ssm_state_size + act_bytes * (c.ssm_conv_kernel - 1) * (
        d_inner + 2 * c.ssm_n_groups * c.ssm_state_size
    )
    return kv + scores + ssm + 4 * max(c.predictor_taps, c.fading_tokens) * hidden_size
