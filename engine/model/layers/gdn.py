"""The Gated DeltaNet mixer (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", 2024): a fixed-size state per head,
written by the gated delta rule (kernels/gdn), in hybrid-model-factory's (hmf) form, the linear layer of its GDN
hybrids and of Qwen3-Next: q, k, v projections with fewer heads than the state (grouped-query repeat or a low-rank
expansion), short convs, a Mamba-2 style decay, a sigmoid write strength, and a gated per-head RMSNorm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from kvfree.engine.model.layers.base import StateSpec
from kvfree.engine.model.layers.grouped_heads import GroupedHeadsConfig, GroupedHeadsMixer
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.tensor_parallel import Split
from kvfree.kernels.gdn import chunk_gdn, fused_recurrent_gdn, gdn_chunked

# q, k <- x / sqrt(||x||^2 + 1e-6): the L2 norm of fla's gated-delta-rule kernels (`use_qk_l2norm_in_kernel`),
# which hmf's layer runs.
_L2_EPS = 1e-6


class GDNConfig(GroupedHeadsConfig):
    """Gated DeltaNet. Field names follow hmf's `gdn_config`; the heads, their expansion and the short conv (over q,
    k and v) are `GroupedHeadsConfig`'s."""

    norm_eps: float = Field(1e-5, gt=0)  # eps of the per-head RMSNorm (hmf's default for GDN)
    # beta = 2 sigmoid(.) in (0, 2): the state's transition I - beta k k^T may then have negative eigenvalues
    # (Grazzi et al. 2024, "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues").
    allow_neg_eigval: bool = False


class GDNMixer(GroupedHeadsMixer):
    """q, k, v projections -> one short causal conv over q|k|v (+ SiLU) -> heads expanded to He -> per-head L2 norm
    of q, k -> write strength beta = sigmoid(W_b x), decay g = -exp(A_log) softplus(W_a x + dt_bias) -> the gated
    delta rule (kernels.gdn, output scale D^-1/2) -> per-head RMSNorm times SiLU(output gate) -> out projection.

    Session state: `conv` `[K-1, Hq D + Hk D + Hv D]` (activation dtype) and `s` `[He, D, D]` (fp32).
    """

    kind = "gdn"
    config_class = GDNConfig
    cfg: GDNConfig

    def __init__(self, hidden_size: int, cfg: GDNConfig) -> None:
        super().__init__(hidden_size, cfg, beta_bias=False)
        self._make_output(hidden_size)
        self.scale = cfg.head_dim**-0.5
        self.reset_parameters()

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        return {
            "conv": self.conv_state_spec(),
            "s": StateSpec((c.num_heads, c.head_dim, c.v_head_dim), dtype=torch.float32, split=Split()),
        }

    def _op_inputs(
        self, conv_out: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The activated conv output `[..., conv_dim]` and x `[..., d]` -> the op's q, k `[..., He, D]` (L2-normalised)
        and v `[..., He, Dv]` in x's dtype, and g, beta `[..., He]` in fp32 (fp64 for fp64 reference runs).

        The norms run in fp32 and the results are handed over in the activation dtype, as GKA's; the gates stay
        fp32 (a decay is exponentiated: bf16's three digits there would bend the memory of a long context)."""
        q, k, v = self._split_expand(conv_out, None)
        f = torch.promote_types(x.dtype, torch.float32)
        q, k = q.to(f), k.to(f)
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + _L2_EPS)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + _L2_EPS)
        beta = torch.sigmoid(self.b_proj(x).to(f))
        if self.cfg.allow_neg_eigval:
            beta = 2.0 * beta
        return q.to(x.dtype), k.to(x.dtype), v, self._forget_gate(x, f), beta

    # -- training path: whole sequences from a fresh state ------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        conv_in, _ = self._project(x)
        conv_out, _ = self.conv(conv_in, x.new_zeros(x.shape[0], c.conv_kernel - 1, self.conv_dim))
        q, k, v, g, beta = self._op_inputs(F.silu(conv_out), x)
        s = x.new_zeros(x.shape[0], c.num_heads, c.head_dim, c.v_head_dim, dtype=torch.float32)
        o, _ = gdn_chunked(q, k, v, g, beta, s, self.scale, c.chunk_size)
        return self._out(o, x)

    # -- serving path: project, one op on the pool rows, project out ------------------------------------------
    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        conv_in, _ = self._project(x)
        q, k, v, g, beta = self._op_inputs(self.conv.prefill(conv_in, state["conv"], batch, activation="silu"), x)
        o = chunk_gdn(
            q, k, v, g, beta, state["s"], batch.state_indices, batch.cu_seqlens, self.scale,
            chunk_size=self.cfg.chunk_size, cu_seqlens_cpu=batch.cu_seqlens_cpu,
        )  # fmt: skip
        return self._out(o, x)

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        conv_in, _ = self._project(x)
        q, k, v, g, beta = self._op_inputs(self.conv.decode(conv_in, state["conv"], batch, activation="silu"), x)
        o = fused_recurrent_gdn(q, k, v, g, beta, state["s"], batch.state_indices, self.scale)
        return self._out(o, x)
