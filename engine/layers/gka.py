"""The Gated KalmaNet mixer (docs/design/gka.md §3): gated linear attention whose query is first replaced by a
ridge-regression solution `(H_t + a ||H_t||_F I)^-1 q_t`, computed by a fixed number of Chebyshev steps.

The layer is hybrid-model-factory's (hmf) form (docs/design/hmf.md): query, key and value projections may have fewer
heads than the state, expanded by repetition (grouped-query style) or by a low-rank projection added to it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from kvfree.engine.layers.base import Mixer, StateSpec
from kvfree.engine.layers.conv import ShortConv
from kvfree.engine.layers.norms import GatedRMSNorm, RMSNorm
from kvfree.engine.step_batch import StepBatch
from kvfree.engine.strict_config import PositiveInt, StrictConfig
from kvfree.engine.tensor_parallel import ROW, Split, TensorParallel
from kvfree.kernels.gka import chunk_gka, fused_recurrent_gka, gka_chunked

_L2_EPS = 1e-6  # q, k <- q / (||q|| + 1e-6) (docs/design/gka.md §3 step 4, the HF/FLA form)
_BETA_EPS = 1e-6  # k, v <- (beta + 1e-6) k, v (docs/design/gka.md §3 step 5)


class GKAConfig(StrictConfig):
    """Gated KalmaNet (docs/design/gka.md). Field names follow hybrid-model-factory's `gka_config.py` where one
    exists, to ease conversion.

    Heads: the state, the gates and the output have `num_heads` (He) heads; the q, k and v projections may have
    fewer (`num_q_heads` etc., each dividing He), expanded to He by repeating each head He/Hx times in place (head
    e reads head e // (He/Hx), as hmf's and grouped-query attention's repeat). With `kv_proj_rank`, k and v are
    instead expanded by a low-rank projection (SiLU between its two halves) added to that repeat, or to a learned
    He x Hx mixing of the heads under `kv_learnable_residual`.
    """

    num_heads: PositiveInt  # He: heads of the state, the gates and the output
    head_dim: PositiveInt  # D: query/key width per head (H is D x D per head)
    value_head_dim: PositiveInt | None = None  # Dv: value width per head; None means head_dim
    num_q_heads: PositiveInt | None = None  # Hq: query projection heads; None means He
    num_k_heads: PositiveInt | None = None  # Hk: key projection heads; None means He
    num_v_heads: PositiveInt | None = None  # Hv: value projection heads; None means He
    kv_proj_rank: PositiveInt | None = None  # rank of the low-rank k/v head expansion; None: plain repeat
    kv_learnable_residual: bool = False  # the expansion's residual is a learned head mixing, not a repeat
    conv_kernel: PositiveInt = 4  # K: short-conv taps on q, k (and v)
    chunk_size: PositiveInt = 64  # C: tokens per chunk of the parallel prefill
    # r: Chebyshev iterations. A serving knob (`--set gka.num_iter=10`), but it changes the function the model
    # was trained with (docs/design/gka.md §13.15).
    num_iter: PositiveInt = 30
    ridge_strength: float = Field(0.02, gt=0)  # a in lambda_t = a * ||H_t||_F (condition number <= (1+a)/a)
    norm_eps: float = Field(1e-6, gt=0)  # eps of the per-head RMSNorm
    use_v_conv: bool = True  # short conv + SiLU on v as well as on q and k
    use_beta_gate: bool = True  # write gate beta: k, v scaled by sigmoid(.) + 1e-6
    use_alpha_connection: bool = True  # q' = q + alpha (x - q); False means alpha = 1 (pure ridge solution)
    use_gate: bool = True  # output gate: RMSNorm(o) * w * SiLU(W_g x); False: RMSNorm(o) * w
    gla_rescale: bool = True  # output scale D^-1/2
    use_forgetting_gate: bool = True  # False: nothing decays (g = 0)
    # False means the ridge regression is skipped (hmf's num_iter = 0): q' = q. Run as alpha = 0 (q' = q + 0 (x - q)).
    use_solver: bool = True

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

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
    def _check_heads(self) -> GKAConfig:
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


class GKAMixer(Mixer):
    """q, k, v projections -> one short causal conv over q|k|v (+ SiLU) -> heads expanded to He -> per-head L2 norm
    of q, k -> write gate beta on k and v -> forget gate (Mamba-2 style), alpha gate -> GKA state math (kernels.gka)
    -> per-head RMSNorm (one weight shared by all heads) times SiLU(output gate) -> out projection.

    Session state: `conv` `[K-1, Hq D + Hk D + Hv Dv]` (activation dtype; without the v conv, no v part), `h`
    `[He, D, D]` and `s` `[He, D, Dv]` (fp32; docs/design/gka.md §5.1).
    """

    kind = "gka"
    config_class = GKAConfig

    def __init__(self, hidden_size: int, cfg: GKAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        He, D, Dv = cfg.num_heads, cfg.head_dim, cfg.v_head_dim
        self.q_proj = nn.Linear(hidden_size, cfg.q_heads * D, bias=False)
        self.k_proj = nn.Linear(hidden_size, cfg.k_heads * D, bias=False)
        self.v_proj = nn.Linear(hidden_size, cfg.v_heads * Dv, bias=False)
        self.qk_split = [cfg.q_heads * D, cfg.k_heads * D]
        self.conv_dim = sum(self.qk_split) + (cfg.v_heads * Dv if cfg.use_v_conv else 0)
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
        self.b_proj = nn.Linear(hidden_size, He, bias=True) if cfg.use_beta_gate else None
        self.alpha_proj = nn.Linear(hidden_size, He, bias=True) if cfg.use_alpha_connection else None
        self.g_proj = nn.Linear(hidden_size, He * Dv, bias=False) if cfg.use_gate else None
        # Per-head norm: Dv channels normalised together, one weight of Dv shared by every head.
        if cfg.use_gate:
            self.norm: nn.Module = GatedRMSNorm(Dv, group_size=Dv, eps=cfg.norm_eps, norm_before_gate=True)
        else:
            self.norm = RMSNorm(Dv, eps=cfg.norm_eps)
        self.o_proj = nn.Linear(He * Dv, hidden_size, bias=False)
        self.scale = D**-0.5 if cfg.gla_rescale else 1.0
        self.reset_parameters()

    @classmethod
    def shard_config(cls, cfg: GKAConfig, tp: TensorParallel, what: str) -> GKAConfig:
        """A rank's block of the He state heads and of the q, k, v projection heads they read (a projection with
        fewer heads than ranks is held whole by the ranks that read each head). The Chebyshev solve, the adaptive
        ridge (‖H‖_F of each head) and the per-head norm need nothing from another rank."""
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
        for name in ("b_proj", "alpha_proj"):
            if getattr(self, name) is not None:
                splits.update({f"{name}.weight": heads, f"{name}.bias": heads})
        if self.g_proj is not None:
            splits["g_proj.weight"] = heads
        return splits

    def _conv_split(self) -> Split:
        """The conv's channels (q | k | v, each by head) along axis 1 of its state `[K-1, channels]`."""
        c = self.cfg
        parts = (c.q_heads * c.head_dim, c.k_heads * c.head_dim) + ((c.v_heads * c.v_head_dim,) if c.use_v_conv else ())
        return Split(axis=1, parts=parts, replicas=self.replicas[: len(parts)])

    def reset_parameters(self) -> None:
        He = self.cfg.num_heads
        with torch.no_grad():
            # gka.md §3: A ~ U(0, 16), A_log = log A; dt ~ logU(1e-3, 1e-1) floored at 1e-4, dt_bias = softplus^-1(dt).
            self.A_log.copy_(torch.log(torch.empty(He).uniform_(0, 16).clamp_min(1e-4)))
            dt = torch.exp(torch.rand(He) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            self.norm.weight.fill_(1.0)
        self.conv.reset_parameters()

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        return {
            "conv": StateSpec((c.conv_kernel - 1, self.conv_dim), dtype=None, split=self._conv_split()),
            "h": StateSpec((c.num_heads, c.head_dim, c.head_dim), dtype=torch.float32, split=Split()),
            "s": StateSpec((c.num_heads, c.head_dim, c.v_head_dim), dtype=torch.float32, split=Split()),
        }

    # -- shared pieces of the training and serving paths -------------------------------------------------------
    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x `[..., d]` -> the short conv's input `[..., conv_dim]` (q|k|v, or q|k without the v conv) and, without
        the v conv, the raw v projection `[..., Hv Dv]` (else None)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.cfg.use_v_conv:
            return torch.cat([q, k, v], dim=-1), None
        return torch.cat([q, k], dim=-1), v

    def _expand(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[..., Hq D]`, k `[..., Hk D]`, v `[..., Hv Dv]` -> q, k `[..., He, D]`, v `[..., He, Dv]`."""
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

    def _op_inputs(
        self, conv_out: torch.Tensor, v: torch.Tensor | None, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The activated conv output `[..., conv_dim]`, the raw v (without the v conv) and x `[..., d]` -> the op's
        q, k `[..., He, D]`, v `[..., He, Dv]` (q, k L2-normalised; k, v scaled by the write gate) in x's dtype,
        and g, alpha `[..., He]` in fp32 (fp64 for fp64 reference runs).

        The head expansion runs in the activation dtype (as hmf's); then q, k, v are computed in fp32 and handed
        over in the activation dtype, as every other mixer's op inputs: a bf16 model's prefill then runs its dots
        on tensor cores in tf32, an fp32 model's at fp32 accuracy (the op does its state math in fp32 either way).
        The gates stay fp32: a decay is exponentiated, and bf16's three digits there would bend the memory of a
        long context."""
        if v is None:
            q, k, v = conv_out.split([*self.qk_split, conv_out.shape[-1] - sum(self.qk_split)], dim=-1)
        else:
            q, k = conv_out.split(self.qk_split, dim=-1)
        q, k, v = self._expand(q, k, v)
        f = torch.promote_types(x.dtype, torch.float32)  # fp32 gate/state math (fp64 for fp64 reference runs)
        q, k, v = q.to(f), k.to(f), v.to(f)
        q = q / (q.norm(dim=-1, keepdim=True) + _L2_EPS)
        k = k / (k.norm(dim=-1, keepdim=True) + _L2_EPS)
        if self.b_proj is not None:
            beta = torch.sigmoid(self.b_proj(x).to(f)).unsqueeze(-1) + _BETA_EPS
            k, v = k * beta, v * beta
        if self.cfg.use_forgetting_gate:
            g = -torch.exp(self.A_log.to(f)) * F.softplus(self.a_proj(x).to(f) + self.dt_bias.to(f))
        else:
            g = q.new_zeros(q.shape[:-1])
        if not self.cfg.use_solver:
            alpha = torch.zeros_like(g)  # q' = q + 0 (solution - q): the solve is skipped in effect
        elif self.alpha_proj is not None:
            alpha = torch.sigmoid(self.alpha_proj(x).to(f))
        else:
            alpha = torch.ones_like(g)  # without the alpha-connection, the pure ridge solution
        return q.to(x.dtype), k.to(x.dtype), v.to(x.dtype), g, alpha

    def _op_params(self) -> dict:
        """The op's parameters: ridge strength a, Chebyshev steps r and the output scale."""
        return {"ridge": self.cfg.ridge_strength, "num_iter": self.cfg.num_iter, "scale": self.scale}

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o `[..., He, Dv]` (fp32), x `[..., d]` -> `[..., d]`: per-head norm, output gate, out projection."""
        if self.g_proj is not None:
            o = self.norm(o, self.g_proj(x).unflatten(-1, (self.cfg.num_heads, self.cfg.v_head_dim)))
        else:
            o = self.norm(o)
        return self.o_proj(o.flatten(-2).to(self.o_proj.weight.dtype))

    # -- training path: whole sequences from given states -----------------------------------------------------
    def _mix(
        self, x: torch.Tensor, conv_tail: torch.Tensor, h: torch.Tensor, s: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole sequences x `[B, T, d]` from the given states -> (y `[B, T, d]`, conv tail, h, s)."""
        conv_in, v = self._project(x)
        conv_out, tail = self.conv(conv_in, conv_tail)
        q, k, v, g, alpha = self._op_inputs(F.silu(conv_out), v, x)
        o, h, s = gka_chunked(q, k, v, g, alpha, h, s, **self._op_params(), chunk_size=self.cfg.chunk_size)
        return self._out(o, x), tail, h, s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        c = self.cfg
        tail = x.new_zeros(B, c.conv_kernel - 1, self.conv_dim)
        h = x.new_zeros(B, c.num_heads, c.head_dim, c.head_dim, dtype=torch.float32)
        s = x.new_zeros(B, c.num_heads, c.head_dim, c.v_head_dim, dtype=torch.float32)
        return self._mix(x, tail, h, s)[0]

    # -- serving path: project, one op on the pool rows, project out ------------------------------------------
    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        conv_in, v = self._project(x)
        q, k, v, g, alpha = self._op_inputs(self.conv.prefill(conv_in, state["conv"], batch, activation="silu"), v, x)
        o = chunk_gka(
            q, k, v, g, alpha, state["h"], state["s"], batch.state_indices, batch.cu_seqlens, **self._op_params(),
            chunk_size=self.cfg.chunk_size, cu_seqlens_cpu=batch.cu_seqlens_cpu,
        )  # fmt: skip
        return self._out(o, x)

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        conv_in, v = self._project(x)
        q, k, v, g, alpha = self._op_inputs(self.conv.decode(conv_in, state["conv"], batch, activation="silu"), v, x)
        o = fused_recurrent_gka(q, k, v, g, alpha, state["h"], state["s"], batch.state_indices, **self._op_params())
        return self._out(o, x)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[..., Hx, D]` -> `[..., heads, D]`, head e reading head e // (heads / Hx) (grouped-query repeat)."""
    return x if x.shape[-2] == heads else x.repeat_interleave(heads // x.shape[-2], dim=-2)


def _repeat_matrix(heads: int, source_heads: int) -> torch.Tensor:
    """The `[heads, source_heads]` 0/1 matrix of `_repeat_heads` (the learnable residual's initial value)."""
    return torch.eye(source_heads).repeat_interleave(heads // source_heads, dim=0)
