"""Channel mixers placed after a sequence mixer in a block: SwiGLU and the Spectral Koopman MLP of Echo."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import model_validator
from torch import nn

from kvfree.engine.model.layers.norms import RMSNorm
from kvfree.engine.model.strict_config import PositiveInt, StrictConfig


class MLPConfig(StrictConfig):
    """The channel mixer after each mixer.

    kind "swiglu": down(silu(gate(h)) * up(h)) after an RMSNorm. kind "koopman": the Spectral Koopman MLP of Echo
    (docs/design/ska.md §4.5): readout(R silu(lift(h))) after a LayerNorm, R a block-diagonal 2x2 scale-rotation with
    |lambda| clamped to <= 1; `intermediate_size` is its d_k (even; the paper uses ceil(8/3 d / 64) * 64).
    """

    intermediate_size: PositiveInt
    kind: Literal["swiglu", "koopman"] = "swiglu"
    gated: bool = False  # koopman only: multiply by sigmoid(gate(h)) before the readout (SwiGLU parameter parity)

    @model_validator(mode="after")
    def _check(self) -> MLPConfig:
        if self.kind == "koopman" and self.intermediate_size % 2:
            raise ValueError("intermediate_size: the Koopman MLP pairs channels, needs an even size")
        if self.gated and self.kind != "koopman":
            raise ValueError("gated: only the 'koopman' MLP has an optional gate")
        return self


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[..., hidden]` -> `[..., hidden]`."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed in fp32 whatever the weight dtype (the residual stream is fp32), output in the
    weight's dtype, like RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: `[..., dim]` -> `[..., dim]` in the weight's dtype."""
        w, b = self.weight.float(), self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(self.weight.dtype)


class KoopmanMLP(nn.Module):
    """The Spectral Koopman MLP (Echo §3.3, eq. 14; docs/design/ska.md §4.5), without its norm and residual.

    g = silu(lift(h)) `[..., d_k]`; each pair (g_2i, g_2i+1) is mapped by [[gamma_i, omega_i], [-omega_i, gamma_i]],
    i.e. multiplied by the complex eigenvalue conj(lambda_i), lambda_i = gamma_i + i omega_i, with |lambda_i| clamped
    to <= 1 (the pair is scaled by min(1, 1/|lambda_i|)); optionally z *= sigmoid(gate(h)); out = readout(z).
    The block supplies the pre-LayerNorm and adds the residual: x + readout(z) (`build_mlp`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, gated: bool = False) -> None:
        super().__init__()
        if intermediate_size % 2:
            raise ValueError(f"the Koopman MLP needs an even intermediate size, got {intermediate_size}")
        self.lift = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.readout = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=False) if gated else None
        self.gamma = nn.Parameter(torch.empty(intermediate_size // 2))  # Re(lambda)
        self.omega = nn.Parameter(torch.empty(intermediate_size // 2))  # Im(lambda)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Eigenvalue init (not in the paper; REPO): gamma = 1, omega ~ N(0, 0.1^2), so |lambda| clamps to 1 (a pure
        rotation, the norm-preserving case). The projections are initialised by the model."""
        with torch.no_grad():
            self.gamma.fill_(1.0)
            self.omega.normal_(0.0, 0.1)

    def eigenvalues(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The effective (clamped) (Re, Im) of lambda, `[d_k/2]` each, with |lambda| <= 1."""
        # min(1, 1/|lambda|) as rsqrt(max(|lambda|^2, 1)): no sqrt at 0, so gradients stay finite everywhere.
        scale = torch.rsqrt((self.gamma.float().square() + self.omega.float().square()).clamp_min(1.0))
        return self.gamma.float() * scale, self.omega.float() * scale

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: `[..., hidden]` (already normed) -> `[..., hidden]`."""
        g = F.silu(self.lift(h)).float().unflatten(-1, (-1, 2))
        re, im = self.eigenvalues()
        g1, g2 = g[..., 0], g[..., 1]
        z = torch.stack([re * g1 + im * g2, re * g2 - im * g1], dim=-1).flatten(-2)  # eq. 14, pairs interleaved
        if self.gate is not None:
            z = z * torch.sigmoid(self.gate(h).float())
        return self.readout(z.to(self.readout.weight.dtype))


def build_mlp(hidden_size: int, cfg: MLPConfig, norm_eps: float) -> tuple[nn.Module, nn.Module]:
    """The (pre-norm, MLP) pair of a block for `cfg.kind`; the block computes x + mlp(norm(x)).

    swiglu: RMSNorm + SwiGLU. koopman: LayerNorm + KoopmanMLP (the paper's "h = LayerNorm(x)", out = x + W_r z).
    """
    if cfg.kind == "koopman":
        return LayerNorm(hidden_size, eps=norm_eps), KoopmanMLP(hidden_size, cfg.intermediate_size, cfg.gated)
    return RMSNorm(hidden_size, norm_eps), SwiGLU(hidden_size, cfg.intermediate_size)
