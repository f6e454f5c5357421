"""The Gated KalmaNet mixer (docs/design/gka.md §3): gated linear attention whose query is first replaced by a
ridge-regression solution `(H_t + a ||H_t||_F I)^-1 q_t`, computed by a fixed number of Chebyshev steps."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kvfree.engine.layers.base import Mixer, StateSpec
from kvfree.engine.layers.conv import ShortConv
from kvfree.engine.layers.norms import GatedRMSNorm, RMSNorm
from kvfree.engine.step_batch import StepBatch
from kvfree.engine.strict_config import PositiveInt, StrictConfig
from kvfree.kernels.gka import chunk_gka, fused_recurrent_gka, gka_chunked

_L2_EPS = 1e-6  # q, k <- q / (||q|| + 1e-6) (docs/design/gka.md §3 step 4, the HF/FLA form)
_BETA_EPS = 1e-6  # k, v <- (beta + 1e-6) k, v (docs/design/gka.md §3 step 5)


class GKAConfig(StrictConfig):
    """Gated KalmaNet (docs/design/gka.md). Query, key and value heads are equal (no GQA head expansion).

    Field names follow hybrid-model-factory's `gka_config.py` where one exists, to ease conversion.
    """

    num_heads: PositiveInt  # He: heads of q, k, v, the gates and the state
    head_dim: PositiveInt  # D: query/key width per head (H is D x D per head)
    value_head_dim: PositiveInt | None = None  # Dv: value width per head; None means head_dim
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

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim


class GKAMixer(Mixer):
    """q, k, v projections -> one short causal conv over q|k|v (+ SiLU) -> per-head L2 norm of q, k -> write gate
    beta on k and v -> forget gate (Mamba-2 style), alpha gate -> GKA state math (kernels.gka) -> per-head RMSNorm
    (one weight shared by all heads) times SiLU(output gate) -> out projection.

    Heads: He query = key = value heads (no GQA). Session state: `conv` `[K-1, 2 He D + He Dv]` (activation
    dtype; `2 He D` without the v conv), `h` `[He, D, D]` and `s` `[He, D, Dv]` (fp32; docs/design/gka.md §5.1).
    """

    kind = "gka"
    config_class = GKAConfig

    def __init__(self, hidden_size: int, cfg: GKAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        He, D, Dv = cfg.num_heads, cfg.head_dim, cfg.v_head_dim
        self.q_proj = nn.Linear(hidden_size, He * D, bias=False)
        self.k_proj = nn.Linear(hidden_size, He * D, bias=False)
        self.v_proj = nn.Linear(hidden_size, He * Dv, bias=False)
        self.conv_dim = 2 * He * D + (He * Dv if cfg.use_v_conv else 0)
        self.conv = ShortConv(self.conv_dim, cfg.conv_kernel, bias=False)
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
            "conv": StateSpec((c.conv_kernel - 1, self.conv_dim), dtype=None),
            "h": StateSpec((c.num_heads, c.head_dim, c.head_dim), dtype=torch.float32),
            "s": StateSpec((c.num_heads, c.head_dim, c.v_head_dim), dtype=torch.float32),
        }

    # -- shared pieces of the training and serving paths -------------------------------------------------------
    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x `[..., d]` -> the short conv's input `[..., conv_dim]` (q|k|v, or q|k without the v conv) and, without
        the v conv, the raw v projection `[..., He Dv]` (else None)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.cfg.use_v_conv:
            return torch.cat([q, k, v], dim=-1), None
        return torch.cat([q, k], dim=-1), v

    def _op_inputs(
        self, conv_out: torch.Tensor, v: torch.Tensor | None, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The activated conv output `[..., conv_dim]`, the raw v (without the v conv) and x `[..., d]` -> the op's
        q, k `[..., He, D]`, v `[..., He, Dv]` (q, k L2-normalised; k, v scaled by the write gate) in x's dtype,
        and g, alpha `[..., He]` in fp32 (fp64 for fp64 reference runs).

        q, k, v are computed in fp32 and handed over in the activation dtype, as every other mixer's op inputs: a
        bf16 model's prefill then runs its dots on tensor cores in tf32, an fp32 model's at fp32 accuracy (the op
        does its state math in fp32 either way). The gates stay fp32: a decay is exponentiated, and bf16's three
        digits there would bend the memory of a long context."""
        c = self.cfg
        He, D, Dv = c.num_heads, c.head_dim, c.v_head_dim
        if v is None:
            q, k, v = conv_out.split([He * D, He * D, He * Dv], dim=-1)
        else:
            q, k = conv_out.split([He * D, He * D], dim=-1)
        f = torch.promote_types(x.dtype, torch.float32)  # fp32 gate/state math (fp64 for fp64 reference runs)
        q = q.to(f).unflatten(-1, (He, D))
        k = k.to(f).unflatten(-1, (He, D))
        v = v.to(f).unflatten(-1, (He, Dv))
        q = q / (q.norm(dim=-1, keepdim=True) + _L2_EPS)
        k = k / (k.norm(dim=-1, keepdim=True) + _L2_EPS)
        if self.b_proj is not None:
            beta = torch.sigmoid(self.b_proj(x).to(f)).unsqueeze(-1) + _BETA_EPS
            k, v = k * beta, v * beta
        g = -torch.exp(self.A_log.to(f)) * F.softplus(self.a_proj(x).to(f) + self.dt_bias.to(f))
        # Without the alpha-connection alpha = 1: the pure ridge solution.
        alpha = torch.sigmoid(self.alpha_proj(x).to(f)) if self.alpha_proj is not None else torch.ones_like(g)
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
