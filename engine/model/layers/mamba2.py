"""The Mamba-2 mixer, laid out as HF transformers' `Mamba2Mixer` so its checkpoints convert by renaming."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pydantic import model_validator
from torch import nn

from kvfree.engine.model.layers.base import Mixer, StateSpec
from kvfree.engine.model.layers.conv import ShortConv
from kvfree.engine.model.layers.norms import GatedRMSNorm, RMSNorm
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.strict_config import PositiveInt, StrictConfig
from kvfree.engine.model.tensor_parallel import ROW, ROW_BIAS, Split, TensorParallel
from kvfree.kernels.dispatch import use_triton
from kvfree.kernels.mamba2 import chunk_mamba2, fused_recurrent_mamba2, ssd_chunked
from kvfree.kernels.mamba2.reference import softplus_dt


class Mamba2Config(StrictConfig):
    """The Mamba-2 mixer (SSD), with the field names of HF `Mamba2Config` where they exist."""

    num_heads: PositiveInt
    head_dim: PositiveInt
    state_size: PositiveInt = 128
    n_groups: PositiveInt = 1
    conv_kernel: PositiveInt = 4
    chunk_size: PositiveInt = 64
    use_bias: bool = False
    use_conv_bias: bool = True
    # Clamp applied to dt after softplus; None means (0, inf) as in HF.
    time_step_limit: list[float] | None = None
    norm_eps: float = 1e-5
    # hybrid-model-factory's Mamba-2 (primed from Qwen3 attention): an RMSNorm over each group's N channels of B and
    # of C before the conv, one weight of N for each (as Qwen3's k_norm / q_norm on its heads).
    bc_norm: bool = False
    bc_norm_eps: float = 1e-6

    @model_validator(mode="after")
    def _check(self) -> Mamba2Config:
        if self.num_heads % self.n_groups:
            raise ValueError(f"n_groups: {self.n_groups} must divide num_heads ({self.num_heads})")
        if self.time_step_limit is not None and len(self.time_step_limit) != 2:
            raise ValueError(f"time_step_limit: expected [min, max], got {self.time_step_limit}")
        return self

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim


class Mamba2Mixer(Mixer):
    """in_proj -> (gate, xBC, dt); causal conv + SiLU on xBC; SSD; gated RMSNorm; out_proj.

    Session state: `conv` `[K-1, conv_dim]` (the conv tail, activation dtype) and `ssm` `[H, P, N]` (fp32).
    """

    kind = "mamba2"
    config_class = Mamba2Config

    def __init__(self, hidden_size: int, cfg: Mamba2Config) -> None:
        super().__init__()
        self.cfg = cfg
        H, P, N, G = cfg.num_heads, cfg.head_dim, cfg.state_size, cfg.n_groups
        self.d_inner = H * P
        self.conv_dim = self.d_inner + 2 * G * N
        self.in_proj = nn.Linear(hidden_size, self.d_inner + self.conv_dim + H, bias=cfg.use_bias)
        self.conv = ShortConv(self.conv_dim, cfg.conv_kernel, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = GatedRMSNorm(self.d_inner, group_size=self.d_inner // G, eps=cfg.norm_eps)
        self.B_norm = RMSNorm(N, cfg.bc_norm_eps) if cfg.bc_norm else None
        self.C_norm = RMSNorm(N, cfg.bc_norm_eps) if cfg.bc_norm else None
        self.out_proj = nn.Linear(self.d_inner, hidden_size, bias=cfg.use_bias)
        self._A_cache: tuple[tuple, torch.Tensor] | None = None
        self.reset_parameters()

    @property
    def prefill_graph_blocker(self) -> str:  # type: ignore[override]
        """Empty where prefill runs the Triton conv and SSD kernels, which take device metadata; the PyTorch
        references plan their batched calls on the host."""
        if self.cfg.conv_kernel < 2:
            return "a width-1 conv runs the PyTorch reference, which plans on the host"
        if not use_triton(self.in_proj.weight.device):
            return "prefill runs the PyTorch reference (KVFREE_KERNELS, or no CUDA), which plans on the host"
        return ""

    def reset_parameters(self) -> None:
        H = self.cfg.num_heads
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
            self.D.fill_(1.0)
            # dt log-uniform in [1e-3, 1e-1] at init, stored through the inverse softplus.
            dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.conv.reset_parameters()

    @classmethod
    def shard_config(cls, cfg: Mamba2Config, tp: TensorParallel, what: str) -> Mamba2Config:
        """A rank's block of heads and of the B/C groups they read. The groups must divide among the ranks too: the
        gated RMSNorm's mean runs over a group's channels, so a group split across ranks would need a collective."""
        heads, _ = tp.heads(cfg.num_heads, f"{what} num_heads")
        groups, _ = tp.heads(cfg.n_groups, f"{what} n_groups (its gated norm's groups stay within a rank)")
        return cfg.model_copy(update={"num_heads": heads, "n_groups": groups})

    def _conv_parts(self) -> tuple[int, ...]:
        gn = self.cfg.n_groups * self.cfg.state_size
        return (self.d_inner, gn, gn)

    def weight_splits(self) -> dict[str, Split]:
        in_proj = Split(parts=(self.d_inner, *self._conv_parts(), self.cfg.num_heads))  # z, x, B, C, dt
        conv = Split(parts=self._conv_parts())
        heads = Split()
        splits = {"in_proj.weight": in_proj, "conv.weight": conv, "dt_bias": heads, "A_log": heads, "D": heads,
                  "norm.weight": heads, "out_proj.weight": ROW}  # fmt: skip
        if self.cfg.use_bias:
            splits.update({"in_proj.bias": in_proj, "out_proj.bias": ROW_BIAS})
        if self.cfg.use_conv_bias:
            splits["conv.bias"] = conv
        return splits

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        return {
            "conv": StateSpec((c.conv_kernel - 1, self.conv_dim), dtype=None, split=Split(1, self._conv_parts())),
            "ssm": StateSpec((c.num_heads, c.head_dim, c.state_size), dtype=torch.float32, split=Split()),
        }

    # -- shared pieces of the training and serving paths -------------------------------------------------------
    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Activated conv output `[..., conv_dim]` -> x `[..., H, P]`, B and C `[..., G, N]` (views, no copy)."""
        c = self.cfg
        x, B, C = xbc.split([self.d_inner, c.n_groups * c.state_size, c.n_groups * c.state_size], dim=-1)
        return (
            x.unflatten(-1, (c.num_heads, c.head_dim)),
            B.unflatten(-1, (c.n_groups, c.state_size)),
            C.unflatten(-1, (c.n_groups, c.state_size)),
        )

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[..., D]` -> gate `[..., d_inner]`, xBC `[..., conv_dim]` (before the conv), raw dt `[..., H]`."""
        gate, xbc, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, self.cfg.num_heads], dim=-1)
        if self.B_norm is not None:
            c = self.cfg
            xs, B, C = xbc.split([self.d_inner, c.n_groups * c.state_size, c.n_groups * c.state_size], dim=-1)
            B = self.B_norm(B.unflatten(-1, (c.n_groups, c.state_size))).flatten(-2)
            C = self.C_norm(C.unflatten(-1, (c.n_groups, c.state_size))).flatten(-2)
            xbc = torch.cat([xs, B.to(xs.dtype), C.to(xs.dtype)], dim=-1)
        return gate, xbc, dt

    def _A(self) -> torch.Tensor:
        """A = -exp(A_log), fp32 `[H]`.

        Serving reuses one tensor while A_log is unchanged: no kernel per layer per step, and a fixed address for
        CUDA graphs to read. Training recomputes it so that gradients reach A_log.
        """
        if torch.is_grad_enabled() and self.A_log.requires_grad:
            return -torch.exp(self.A_log.float())
        # Inference tensors (weights created under inference_mode) have no version counter.
        version = 0 if self.A_log.is_inference() else self.A_log._version
        key = (self.A_log.data_ptr(), version, self.A_log.dtype)
        if self._A_cache is None or self._A_cache[0] != key:
            self._A_cache = (key, -torch.exp(self.A_log.detach().float()))
        return self._A_cache[1]

    def _ssm_params(self) -> dict:
        """The op's parameters: A (fp32), D, dt_bias and the dt clamp."""
        limit = self.cfg.time_step_limit
        return {
            "A": self._A(),
            "D": self.D,
            "dt_bias": self.dt_bias,
            "dt_limit": None if limit is None else (float(limit[0]), float(limit[1])),
        }

    def _out(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(y.flatten(-2), gate).to(self.out_proj.weight.dtype))

    # -- training path: whole sequences from given states -----------------------------------------------------
    def _mix(
        self, x: torch.Tensor, conv_tail: torch.Tensor, ssm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Whole sequences x `[B, T, D]` from the given states -> (y `[B, T, D]`, new conv tail, new ssm state)."""
        gate, xbc, dt = self._project(x)
        conv_out, tail = self.conv(xbc, conv_tail)
        xs, Bs, Cs = self._split(F.silu(conv_out))
        p = self._ssm_params()
        dt = softplus_dt(dt, p["dt_bias"], p["dt_limit"], torch.float32)
        y, ssm = ssd_chunked(xs, dt, p["A"], Bs, Cs, p["D"], ssm, self.cfg.chunk_size)
        return self._out(y, gate), tail, ssm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        c = self.cfg
        tail = x.new_zeros(B, c.conv_kernel - 1, self.conv_dim)
        ssm = x.new_zeros(B, c.num_heads, c.head_dim, c.state_size, dtype=torch.float32)
        return self._mix(x, tail, ssm)[0]

    # -- serving path: project, one op on the pool rows, project out ------------------------------------------
    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        gate, xbc, dt = self._project(x)
        xs, Bs, Cs = self._split(self.conv.prefill(xbc, state["conv"], batch, activation="silu"))
        y = chunk_mamba2(
            xs, dt, Bs, Cs, state["ssm"], batch.state_indices, batch.cu_seqlens, **self._ssm_params(),
            chunk_size=self.cfg.chunk_size, cu_seqlens_cpu=batch.cu_seqlens_cpu, device_chunks=batch.device_chunks,
        )  # fmt: skip
        return self._out(y, gate)

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        gate, xbc, dt = self._project(x)
        xs, Bs, Cs = self._split(self.conv.decode(xbc, state["conv"], batch, activation="silu"))
        y = fused_recurrent_mamba2(xs, dt, Bs, Cs, state["ssm"], batch.state_indices, **self._ssm_params())
        return self._out(y, gate)
