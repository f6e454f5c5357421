"""The Gated KalmaNet mixer (docs/design/gka.md §3): gated linear attention whose query is first replaced by a
ridge-regression solution `(H_t + a ||H_t||_F I)^-1 q_t`, computed by a fixed number of Chebyshev steps.

The layer is hybrid-model-factory's (hmf) form (docs/design/hmf.md): query, key and value projections may have fewer
heads than the state, expanded by repetition (grouped-query style) or by a low-rank projection added to it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kvfree.engine.model.layers.base import StateSpec
from kvfree.engine.model.layers.grouped_heads import GroupedHeadsConfig, GroupedHeadsMixer
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.strict_config import PositiveInt
from kvfree.engine.model.tensor_parallel import Split
from kvfree.kernels.gka import chunk_gka, fused_recurrent_gka, gka_chunked

_L2_EPS = 1e-6  # q, k <- q / (||q|| + 1e-6) (docs/design/gka.md §3 step 4, the HF/FLA form)
_BETA_EPS = 1e-6  # k, v <- (beta + 1e-6) k, v (docs/design/gka.md §3 step 5)


class GKAConfig(GroupedHeadsConfig):
    """Gated KalmaNet (docs/design/gka.md). Field names follow hybrid-model-factory's `gka_config.py` where one
    exists, to ease conversion. The heads, their expansion and the short conv are `GroupedHeadsConfig`'s."""

    value_head_dim: PositiveInt | None = None  # Dv: value width per head; None means head_dim
    # r: Chebyshev iterations. A serving knob (`--set gka.num_iter=10`), but it changes the function the model
    # was trained with (docs/design/gka.md §13.15).
    num_iter: PositiveInt = 30
    ridge_strength: float = Field(0.02, gt=0)  # a in lambda_t = a * ||H_t||_F (condition number <= (1+a)/a)
    use_v_conv: bool = True  # short conv + SiLU on v as well as on q and k
    use_beta_gate: bool = True  # write gate beta: k, v scaled by sigmoid(.) + 1e-6
    use_alpha_connection: bool = True  # q' = q + alpha (x - q); False means alpha = 1 (pure ridge solution)
    gla_rescale: bool = True  # output scale D^-1/2
    use_forgetting_gate: bool = True  # False: nothing decays (g = 0)
    # False: the key covariance H never decays (H_t = H_{t-1} + k k^T) while S still decays with the forget gate
    # (hmf's flag of the same name; the ops' decay_h). Without the forget gate it changes nothing.
    use_forgetting_gate_kk: bool = True
    # False means the ridge regression is skipped (hmf's num_iter = 0): q' = q. Run as alpha = 0 (q' = q + 0 (x - q)).
    use_solver: bool = True

    @property
    def v_head_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def conv_v(self) -> bool:
        return self.use_v_conv


class GKAMixer(GroupedHeadsMixer):
    """q, k, v projections -> one short causal conv over q|k|v (+ SiLU) -> heads expanded to He -> per-head L2 norm
    of q, k -> write gate beta on k and v -> forget gate (Mamba-2 style), alpha gate -> GKA state math (kernels.gka)
    -> per-head RMSNorm (one weight shared by all heads) times SiLU(output gate) -> out projection.

    Session state: `conv` `[K-1, Hq D + Hk D + Hv Dv]` (activation dtype; without the v conv, no v part), `h`
    `[He, D, D]` and `s` `[He, D, Dv]` (fp32; docs/design/gka.md §5.1).
    """

    kind = "gka"
    config_class = GKAConfig
    cfg: GKAConfig

    def __init__(self, hidden_size: int, cfg: GKAConfig) -> None:
        super().__init__(hidden_size, cfg, beta_bias=True if cfg.use_beta_gate else None)
        self.alpha_proj = nn.Linear(hidden_size, cfg.num_heads, bias=True) if cfg.use_alpha_connection else None
        self._make_output(hidden_size)
        self.scale = cfg.head_dim**-0.5 if cfg.gla_rescale else 1.0
        # The op's parameters, fixed for the layer's life: ridge strength a, Chebyshev steps r, the output scale and
        # whether H decays (without the forget gate g = 0 and H does not decay either way: the default kernels).
        self.op_params = {"ridge": cfg.ridge_strength, "num_iter": cfg.num_iter, "scale": self.scale,
                          "decay_h": cfg.use_forgetting_gate_kk or not cfg.use_forgetting_gate}  # fmt: skip
        self.reset_parameters()

    def weight_splits(self) -> dict[str, Split]:
        splits = super().weight_splits()
        if self.alpha_proj is not None:
            splits |= {"alpha_proj.weight": Split(), "alpha_proj.bias": Split()}
        return splits

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        return {
            "conv": self.conv_state_spec(),
            "h": StateSpec((c.num_heads, c.head_dim, c.head_dim), dtype=torch.float32, split=Split()),
            "s": StateSpec((c.num_heads, c.head_dim, c.v_head_dim), dtype=torch.float32, split=Split()),
        }

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
        q, k, v = self._split_expand(conv_out, v)
        f = torch.promote_types(x.dtype, torch.float32)  # fp32 gate/state math (fp64 for fp64 reference runs)
        q, k, v = q.to(f), k.to(f), v.to(f)
        q = q / (q.norm(dim=-1, keepdim=True) + _L2_EPS)
        k = k / (k.norm(dim=-1, keepdim=True) + _L2_EPS)
        if self.b_proj is not None:
            beta = torch.sigmoid(self.b_proj(x).to(f)).unsqueeze(-1) + _BETA_EPS
            k, v = k * beta, v * beta
        g = self._forget_gate(x, f) if self.cfg.use_forgetting_gate else q.new_zeros(q.shape[:-1])
        if not self.cfg.use_solver:
            alpha = torch.zeros_like(g)  # q' = q + 0 (solution - q): the solve is skipped in effect
        elif self.alpha_proj is not None:
            alpha = torch.sigmoid(self.alpha_proj(x).to(f))
        else:
            alpha = torch.ones_like(g)  # without the alpha-connection, the pure ridge solution
        return q.to(x.dtype), k.to(x.dtype), v.to(x.dtype), g, alpha

    # -- training path: whole sequences from given states -----------------------------------------------------
    def _mix(
        self, x: torch.Tensor, conv_tail: torch.Tensor, h: torch.Tensor, s: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole sequences x `[B, T, d]` from the given states -> (y `[B, T, d]`, conv tail, h, s)."""
        conv_in, v = self._project(x)
        conv_out, tail = self.conv(conv_in, conv_tail)
        q, k, v, g, alpha = self._op_inputs(F.silu(conv_out), v, x)
        o, h, s = gka_chunked(q, k, v, g, alpha, h, s, **self.op_params, chunk_size=self.cfg.chunk_size)
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
            q, k, v, g, alpha, state["h"], state["s"], batch.state_indices, batch.cu_seqlens, **self.op_params,
            chunk_size=self.cfg.chunk_size, cu_seqlens_cpu=batch.cu_seqlens_cpu,
        )  # fmt: skip
        return self._out(o, x)

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        conv_in, v = self._project(x)
        q, k, v, g, alpha = self._op_inputs(self.conv.decode(conv_in, state["conv"], batch, activation="silu"), v, x)
        o = fused_recurrent_gka(q, k, v, g, alpha, state["h"], state["s"], batch.state_indices, **self.op_params)
        return self._out(o, x)

