"""What Gated KalmaNet and Gated DeltaNet layers share in hybrid-model-factory's (hmf) form: q, k, v projections with
fewer heads than the state (expanded by repetition or a low-rank projection), one short conv over them, a Mamba-2
style forget gate, a per-head gated RMSNorm and the out projection, with their tensor-parallel splits.

A subclass adds its gates and its op: `_op_inputs` (the conv's output to the op's inputs) and the serving calls.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from kvfree.engine.model.layers.base import Mixer, StateSpec
from kvfree.engine.model.layers.conv import ShortConv
from kvfree.engine.model.layers.norms import GatedRMSNorm, RMSNorm
from kvfree.engine.model.strict_config import PositiveInt, StrictConfig
from kvfree.engine.model.tensor_parallel import ROW, Split, TensorParallel


class GroupedHeadsConfig(StrictConfig):
    """The fields the shared layer reads (GKA's and GDN's configs extend it). Field names follow hmf's.

    Heads: the state, the gates and the output have `num_heads` (He) heads; the q, k and v projections may have
    fewer (`num_q_heads` etc., each dividing He), expanded to He by repeating each head He/Hx times in place (head
    e reads head e // (He/Hx), as hmf's and grouped-query attention's repeat). With `kv_proj_rank`, k and v are
    instead expanded by a low-rank projection (SiLU between its two halves) added to that repeat, or to a learned
    He x Hx mixing of the heads under `kv_learnable_residual`.
    """

    num_heads: PositiveInt  # He: heads of the state, the gates and the output
    head_dim: PositiveInt  # D: query/key width per head
    num_q_heads: PositiveInt | None = None  # Hq: query projection heads; None means He
    num_k_heads: PositiveInt | None = None  # Hk: key projection heads; None means He
    num_v_heads: PositiveInt | None = None  # Hv: value projection heads; None means He
    kv_proj_rank: PositiveInt | None = None  # rank of the low-rank k/v head expansion; None: plain repeat
    kv_learnable_residual: bool = False  # the expansion's residual is a learned head mixing, not a repeat
    conv_kernel: PositiveInt = 4  # K: short-conv taps on q, k (and v)
    chunk_size: PositiveInt = 64  # C: tokens per chunk of the parallel prefill
    norm_eps: float = Field(1e-6, gt=0)  # eps of the per-head RMSNorm
    use_gate: bool = True  # output gate: RMSNorm(o) * w * SiLU(W_g x); False: RMSNorm(o) * w

    @property
    def v_head_dim(self) -> int:
        """Dv: value width per head."""
        return self.head_dim

    @property
    def conv_v(self) -> bool:
        """Whether the short conv covers v as well as q and k."""
        return True

    @property
    def q_heads(self) -> int:
        return self.num_q_heads or self.num_heads

    @property
    def k_heads(self) -> int:
        return self.num_k_heads or self.num_heads

    @property
    def v_heads(self) -> int:
        return self.num_v_heads or self.num_heads

    @model_validator(mode="after")
    def _check_heads(self) -> GroupedHeadsConfig:
        for name, n in (("num_q_heads", self.q_heads), ("num_k_heads", self.k_heads), ("num_v_heads", self.v_heads)):
            if self.num_heads % n:
                raise ValueError(f"{name}: {n} must divide num_heads ({self.num_heads})")
        if max(self.q_heads, self.k_heads, self.v_heads) != self.num_heads:
            raise ValueError(f"num_heads: {self.num_heads} must be the largest of the q, k and v head counts")
        if self.kv_learnable_residual and self.kv_proj_rank is None:
            raise ValueError(
                "kv_learnable_residual: needs kv_proj_rank (the residual belongs to the low-rank expansion)"
            )
        return self


class LowRankLinear(nn.Module):
    """y = linearB(SiLU(linearA(x))): a rank-r projection (hmf's `LinearLowRank` with its SiLU)."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.linearA = nn.Linear(in_features, rank, bias=False)
        self.linearB = nn.Linear(rank, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linearB(F.silu(self.linearA(x)))


class GroupedHeadsMixer(Mixer):
    """The shared layer: `_project` (x -> the short conv's input), `_expand` (q, k, v heads -> He heads),
    `_forget_gate` (log decay g), `_out` (norm, output gate, out projection). Parameter names are hmf's where the
    converter maps them one to one (`q_proj`, `a_proj` = hmf's `gk_proj`, `A_log`, `dt_bias`, `g_proj`, `o_proj`).

    Subclass constructors call `super().__init__(hidden_size, cfg, beta_bias)` and then add their own gates; the
    write gate `b_proj` (He outputs, with a bias in GKA, without in GDN) is made here so that parameters keep one
    creation order (a seeded random model is the same across versions).
    """

    cfg: GroupedHeadsConfig

    def __init__(self, hidden_size: int, cfg: GroupedHeadsConfig, beta_bias: bool | None) -> None:
        """beta_bias: None for no write gate, else whether its projection has a bias."""
        super().__init__()
        self.cfg = cfg
        He, D, Dv = cfg.num_heads, cfg.head_dim, cfg.v_head_dim
        self.q_proj = nn.Linear(hidden_size, cfg.q_heads * D, bias=False)
        self.k_proj = nn.Linear(hidden_size, cfg.k_heads * D, bias=False)
        self.v_proj = nn.Linear(hidden_size, cfg.v_heads * Dv, bias=False)
        self.qk_split = [cfg.q_heads * D, cfg.k_heads * D]
        self.conv_dim = sum(self.qk_split) + (cfg.v_heads * Dv if cfg.conv_v else 0)
        self.qkv_split = [*self.qk_split, cfg.v_heads * Dv]  # the conv output's parts when it covers v
        self.conv = ShortConv(self.conv_dim, cfg.conv_kernel, bias=False)
        self.proj_k = self.proj_v = None
        self.k_rep = self.v_rep = None
        if cfg.kv_proj_rank is not None:
            self.proj_k = LowRankLinear(cfg.k_heads * D, He * D, cfg.kv_proj_rank)
            self.proj_v = LowRankLinear(cfg.v_heads * Dv, He * Dv, cfg.kv_proj_rank)
            if cfg.kv_learnable_residual:
                self.k_rep = nn.Parameter(_repeat_matrix(He, cfg.k_heads))
                self.v_rep = nn.Parameter(_repeat_matrix(He, cfg.v_heads))
        self.a_proj = nn.Linear(hidden_size, He, bias=False)  # forget-gate input
        self.A_log = nn.Parameter(torch.empty(He))
        self.dt_bias = nn.Parameter(torch.empty(He))
        self.b_proj = None if beta_bias is None else nn.Linear(hidden_size, He, bias=beta_bias)

    def _make_output(self, hidden_size: int) -> None:
        """The output gate, the per-head norm (Dv channels normalised together, one weight of Dv shared by every
        head) and the out projection; called by subclasses after their own gates."""
        c = self.cfg
        self.g_proj = nn.Linear(hidden_size, c.num_heads * c.v_head_dim, bias=False) if c.use_gate else None
        if c.use_gate:
            self.norm: nn.Module = GatedRMSNorm(c.v_head_dim, group_size=c.v_head_dim, eps=c.norm_eps,
                                                norm_before_gate=True)  # fmt: skip
        else:
            self.norm = RMSNorm(c.v_head_dim, eps=c.norm_eps)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, hidden_size, bias=False)

    # -- tensor parallelism -----------------------------------------------------------------------------------
    @classmethod
    def shard_config(cls, cfg: GroupedHeadsConfig, tp: TensorParallel, what: str) -> GroupedHeadsConfig:
        """A rank's block of the He state heads and of the q, k, v projection heads they read (a projection with
        fewer heads than ranks is held whole by the ranks that read each head). Each head's state math and its norm
        need nothing from another rank."""
        if tp.size == 1:
            return cfg
        if cfg.kv_proj_rank is not None:
            raise ValueError(f"{what}: the low-rank k/v expansion (kv_proj_rank) reads every k and v head; it has no "
                             "tensor-parallel form yet")  # fmt: skip
        heads, _ = tp.heads(cfg.num_heads, f"{what} num_heads")
        update: dict = {"num_heads": heads}
        for field, n in (("num_q_heads", cfg.q_heads), ("num_k_heads", cfg.k_heads), ("num_v_heads", cfg.v_heads)):
            update[field] = tp.heads(n, f"{what} {field}", replicate=True)[0]
        return cfg.model_copy(update=update)

    @property
    def replicas(self) -> tuple[int, int, int]:
        """How many ranks hold each q, k and v projection head (1 unless there are fewer such heads than ranks)."""
        w = self.whole_cfg or self.cfg
        return tuple(self.tp.heads(n, "heads", replicate=True)[1] for n in (w.q_heads, w.k_heads, w.v_heads))

    def weight_splits(self) -> dict[str, Split]:
        rq, rk, rv = self.replicas
        heads = Split()
        splits = {
            "q_proj.weight": Split(replicas=(rq,)), "k_proj.weight": Split(replicas=(rk,)),
            "v_proj.weight": Split(replicas=(rv,)), "conv.weight": dataclasses.replace(self._conv_split(), axis=0),
            "a_proj.weight": heads, "A_log": heads, "dt_bias": heads, "o_proj.weight": ROW,
        }  # fmt: skip
        if self.b_proj is not None:
            splits["b_proj.weight"] = heads
            if self.b_proj.bias is not None:
                splits["b_proj.bias"] = heads
        if self.g_proj is not None:
            splits["g_proj.weight"] = heads
        return splits

    def _conv_split(self) -> Split:
        """The conv's channels (q | k | v, each by head) along axis 1 of its state `[K-1, channels]`."""
        c = self.cfg
        parts = (c.q_heads * c.head_dim, c.k_heads * c.head_dim) + ((c.v_heads * c.v_head_dim,) if c.conv_v else ())
        return Split(axis=1, parts=parts, replicas=self.replicas[: len(parts)])

    # -- parameters and state ---------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        He = self.cfg.num_heads
        with torch.no_grad():
            # hmf's (and Mamba-2's): A ~ U(0, 16), A_log = log A; dt ~ logU(1e-3, 1e-1) floored at 1e-4,
            # dt_bias = softplus^-1(dt).
            self.A_log.copy_(torch.log(torch.empty(He).uniform_(0, 16).clamp_min(1e-4)))
            dt = torch.exp(torch.rand(He) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            self.norm.weight.fill_(1.0)
        self.conv.reset_parameters()

    def conv_state_spec(self) -> StateSpec:
        """The short conv's state `[K-1, conv_dim]` in the activation dtype."""
        return StateSpec((self.cfg.conv_kernel - 1, self.conv_dim), dtype=None, split=self._conv_split())

    # -- the shared pieces of the training and serving paths ---------------------------------------------------
    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x `[..., d]` -> the short conv's input `[..., conv_dim]` (q|k|v, or q|k without the v conv) and, without
        the v conv, the raw v projection `[..., Hv Dv]` (else None)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.cfg.conv_v:
            return torch.cat([q, k, v], dim=-1), None
        return torch.cat([q, k], dim=-1), v

    def _split_expand(
        self, conv_out: torch.Tensor, v: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The activated conv output `[..., conv_dim]` and the raw v (without the v conv) -> q, k `[..., He, D]`,
        v `[..., He, Dv]` in the activation dtype (the head expansion runs there, as hmf's)."""
        if v is None:
            q, k, v = conv_out.split(self.qkv_split, dim=-1)
        else:
            q, k = conv_out.split(self.qk_split, dim=-1)
        c = self.cfg
        He, D, Dv = c.num_heads, c.head_dim, c.v_head_dim
        q = _repeat_heads(q.unflatten(-1, (c.q_heads, D)), He)
        k_heads, v_heads = k.unflatten(-1, (c.k_heads, D)), v.unflatten(-1, (c.v_heads, Dv))
        if self.k_rep is not None:  # a learned mixing of the heads
            k_res = torch.einsum("eh,...hd->...ed", self.k_rep.to(k.dtype), k_heads)
            v_res = torch.einsum("eh,...hd->...ed", self.v_rep.to(v.dtype), v_heads)
        else:
            k_res, v_res = _repeat_heads(k_heads, He), _repeat_heads(v_heads, He)
        if self.proj_k is None:
            return q, k_res, v_res
        return q, self.proj_k(k).unflatten(-1, (He, D)) + k_res, self.proj_v(v).unflatten(-1, (He, Dv)) + v_res

    def _forget_gate(self, x: torch.Tensor, f: torch.dtype) -> torch.Tensor:
        """x `[..., d]` -> log decay g = -exp(A_log) softplus(a_proj(x) + dt_bias) `[..., He]` in dtype `f`."""
        return -torch.exp(self.A_log.to(f)) * F.softplus(self.a_proj(x).to(f) + self.dt_bias.to(f))

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o `[..., He, Dv]` (fp32), x `[..., d]` -> `[..., d]`: per-head norm, output gate, out projection."""
        if self.g_proj is not None:
            o = self.norm(o, self.g_proj(x).unflatten(-1, (self.cfg.num_heads, self.cfg.v_head_dim)))
        else:
            o = self.norm(o)
        return self.o_proj(o.flatten(-2).to(self.o_proj.weight.dtype))


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[..., Hx, D]` -> `[..., heads, D]`, head e reading head e // (heads / Hx) (grouped-query repeat)."""
    return x if x.shape[-2] == heads else x.repeat_interleave(heads // x.shape[-2], dim=-2)


def _repeat_matrix(heads: int, source_heads: int) -> torch.Tensor:
    """The `[heads, source_heads]` 0/1 matrix of `_repeat_heads` (the learnable residual's initial value)."""
    return torch.eye(source_heads).repeat_interleave(heads // source_heads, dim=0)
