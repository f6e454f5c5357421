"""The Lattice mixer (docs/design/lattice.md §6.2): orthogonal-update memory slots with a GELU post-gate.

    p    = x W_qk                       one projection shared by q and k (paper App. A)
    q, k = conv_q(p), conv_k(p)         two short causal depthwise convs over the same input, so one conv tail
    q, k = L2-normalised per head       (qk_norm)
    v    = x W_v;  gamma = sigmoid(x W_s + b_s)[:H];  mu = sigmoid(...)[H:] (forget_gate)
    y    = Lattice recurrence per head  (kernels.lattice)
    out  = W_o (gelu_tanh(x W_g) * Norm(y))

The first state of a session is the orthonormal S0 that ships with the weights (not zeros; reset_state copies it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from kvfree.engine.model.layers.base import Mixer, StateSpec
from kvfree.engine.model.layers.conv import ShortConv
from kvfree.engine.model.layers.norms import RMSNorm
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.strict_config import PositiveInt, StrictConfig
from kvfree.engine.model.tensor_parallel import ROW, Split, TensorParallel
from kvfree.kernels.lattice import (
    chunk_lattice_gated,
    fused_recurrent_lattice_gated,
    lattice_forward,
    orthonormal_columns,
)

# The fold gamma <- gamma / mu needs mu > 0; the same clamp is applied before and after folding so that both compute
# one function (spec §4.4, §7).
MU_MIN = 1e-4
# Gate-bias inits (the paper gives none): gamma = sigmoid(0) = 0.5, mu = sigmoid(3) = 0.95 (almost no forgetting).
GAMMA_BIAS_INIT = 0.0
MU_BIAS_INIT = 3.0


class LatticeConfig(StrictConfig):
    """Lattice memory slots (docs/design/lattice.md); every unstated choice of the paper is a field here."""

    num_heads: PositiveInt
    head_dim: PositiveInt  # d: slot dimension = value/output width per head
    num_slots: int | None = None  # m: memory slots per head = key/query width; None means head_dim. Needs m <= d.
    variant: Literal["dec", "enc", "sim"] = "dec"  # "dec" (the paper's final Lattice), "enc" or "sim" (Eq. 10 / 12)
    conv_kernel: PositiveInt = 4  # the two short convs on the shared q/k projection
    qk_norm: Literal["l2", "none"] = "l2"  # "l2": per-head L2-normalised q and k; "none"
    forget_gate: bool = True  # a mu head (Eq. (16)); folded into gamma at load, gamma <- gamma / max(mu, 1e-4)
    learn_s0: bool = False  # S0 a trained parameter (re-orthonormalised) rather than a fixed random buffer
    # "head_rms": RMSNorm per head (weight shared by heads); "rms": over H*d; "none"
    output_norm: Literal["head_rms", "rms", "none"] = "head_rms"
    norm_eps: float = Field(1e-5, gt=0)
    # Training on the PyTorch path: recompute the token loop in segments of this many tokens in backward (0: store
    # every step). The Triton training kernel always checkpoints every 64 tokens.
    grad_checkpoint: int = Field(64, ge=0)

    @model_validator(mode="after")
    def _check(self) -> LatticeConfig:
        if self.num_slots is not None and not 0 < self.num_slots <= self.head_dim:
            raise ValueError(
                f"num_slots: S0 has orthonormal columns, so 0 < num_slots <= head_dim ({self.head_dim}); "
                f"got {self.num_slots}"
            )
        return self

    @property
    def slots(self) -> int:
        return self.head_dim if self.num_slots is None else self.num_slots


class LatticeMixer(Mixer):
    """Lattice-DEC (or ENC/SIM) with normalised projection, per-slot gates and an orthonormal S0.

    Session state: `S` `[H, d, m]` fp32 (m unit-norm slots of dimension d per head) and `conv` `[K-1, H*m]` (the
    tail of the shared q/k projection, activation dtype).
    """

    kind = "lattice"
    config_class = LatticeConfig

    def __init__(self, hidden_size: int, cfg: LatticeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, d, m = cfg.num_heads, cfg.head_dim, cfg.slots
        self.qk_proj = nn.Linear(hidden_size, H * m, bias=False)
        self.conv_q = ShortConv(H * m, cfg.conv_kernel)
        self.conv_k = ShortConv(H * m, cfg.conv_kernel)
        self.v_proj = nn.Linear(hidden_size, H * d, bias=False)
        self.step_proj = nn.Linear(hidden_size, H * (2 if cfg.forget_gate else 1), bias=True)
        self.g_proj = nn.Linear(hidden_size, H * d, bias=False)
        self.o_proj = nn.Linear(H * d, hidden_size, bias=False)
        self.norm: RMSNorm | None = None
        if cfg.output_norm == "head_rms":
            self.norm = RMSNorm(d, cfg.norm_eps)
        elif cfg.output_norm == "rms":
            self.norm = RMSNorm(H * d, cfg.norm_eps)
        s0 = torch.empty(H, d, m)
        if cfg.learn_s0:
            self.S0 = nn.Parameter(s0)
        else:
            self.register_buffer("S0", s0)  # persistent: saved in the checkpoint with the weights
        self.reset_parameters()

    @classmethod
    def shard_config(cls, cfg: LatticeConfig, tp: TensorParallel, what: str) -> LatticeConfig:
        """A rank's block of the heads. Everything before the out projection is per head: the shared q/k projection
        and its two depthwise convs by channel (a head's m slots), v, the gates, the recurrence on a head's own slots
        (S0 included) and the GELU post-gate; the per-head norm's one weight of d is held whole by every rank.

        output_norm="rms" is refused: its RMS runs over all H*d channels, so a rank would need the other ranks' sums
        of squares (a collective inside the mixer) to compute it."""
        if tp.size == 1:
            return cfg
        if cfg.output_norm == "rms":
            raise ValueError(f"{what}: output_norm 'rms' normalises over every head's output at once; it has no "
                             "tensor-parallel form (use 'head_rms' or 'none')")  # fmt: skip
        heads, _ = tp.heads(cfg.num_heads, f"{what} num_heads")
        return cfg.model_copy(update={"num_heads": heads})

    def weight_splits(self) -> dict[str, Split]:
        c = self.cfg
        heads = Split()  # axis 0 by head: a head's m (or d) rows are contiguous, so a block of rows is a block of heads
        # step_proj holds gamma's H rows, then mu's H: each cut on its own so that a rank keeps [its gammas | its mus].
        step = Split(parts=(c.num_heads, c.num_heads)) if c.forget_gate else heads
        # S0 `[H, d, m]` by head: a rank's template state (reset_state copies its S0) is then its block of the whole
        # one, and re-orthonormalising at load (a QR per head) gives the same block.
        splits = {"qk_proj.weight": heads, "v_proj.weight": heads, "g_proj.weight": heads, "o_proj.weight": ROW,
                  "step_proj.weight": step, "step_proj.bias": step, "S0": heads}  # fmt: skip
        for conv in ("conv_q", "conv_k"):
            splits.update({f"{conv}.weight": heads, f"{conv}.bias": heads})
        return splits

    def reset_parameters(self) -> None:
        H = self.cfg.num_heads
        with torch.no_grad():
            # Random orthonormal slots per head (paper §3.3: "we initialize S0 with orthonormal columns").
            self.S0.copy_(orthonormal_columns(torch.randn(self.S0.shape, dtype=torch.float64)))
            self.step_proj.bias[:H].fill_(GAMMA_BIAS_INIT)
            self.step_proj.bias[H:].fill_(MU_BIAS_INIT)
        self.conv_q.reset_parameters()
        self.conv_k.reset_parameters()

    def on_load(self) -> None:
        """Re-orthonormalise S0 (fp64 QR; a no-op up to rounding on a valid checkpoint)."""
        with torch.no_grad():
            self.S0.copy_(orthonormal_columns(self.S0))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> LatticeMixer:
        # `model.to(bfloat16)` would round S0 like a weight; it is a recurrent state (fp32, architecture.md §8) and
        # bf16 rounding (~4e-3) would break its orthonormality, so it keeps fp32 (or better) whatever the model dtype.
        s0 = self.S0.detach()
        super()._apply(fn, recurse)
        if self.S0.dtype in (torch.float16, torch.bfloat16):
            kept = s0.to(device=self.S0.device, dtype=torch.float32)
            if isinstance(self.S0, nn.Parameter):
                self.S0.data = kept
            else:
                self._buffers["S0"] = kept
        return self

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        c = self.cfg
        return {
            "S": StateSpec((c.num_heads, c.head_dim, c.slots), dtype=torch.float32, split=Split()),
            "conv": StateSpec((c.conv_kernel - 1, c.num_heads * c.slots), dtype=None, split=Split(axis=1)),
        }

    def initial_state(self) -> torch.Tensor:
        """S0 `[H, d, m]` fp32 (or fp64 in a fp64 model) with orthonormal columns; differentiable when learned."""
        s0 = self.S0 if self.S0.dtype == torch.float64 else self.S0.float()
        # A learned S0 moves off the orthonormal set during training; use its Q factor so that training and serving
        # (which re-orthonormalises at load) see the same S0.
        return orthonormal_columns(s0) if self.cfg.learn_s0 else s0

    def reset_state(self, state: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
        S = state["S"]
        s0 = self.initial_state().detach().to(device=S.device, dtype=S.dtype)
        S.index_copy_(0, slots, s0.expand(len(slots), *s0.shape).contiguous())
        state["conv"].index_fill_(0, slots, 0)

    # -- shared pieces of forward, prefill and decode --------------------------------------------------------------
    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-wise projections of x `[..., D]` -> (p `[..., H*m]`, v `[..., H, d]`, step logits `[..., H or 2H]`)."""
        v = self.v_proj(x).unflatten(-1, (self.cfg.num_heads, self.cfg.head_dim))
        return self.qk_proj(x), v, self.step_proj(x)

    def _conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(conv_q weight, bias, conv_k weight, bias), in the order the q/k conv ops take them."""
        return self.conv_q.weight, self.conv_q.bias, self.conv_k.weight, self.conv_k.bias

    def _op_args(self, x: torch.Tensor) -> tuple:
        """The gated ops' trailing arguments: conv filters, variant, q/k norm, the forget-gate clamp, and the post-gate
        (its projection of x, the head norm's weight and eps) when the output norm is per head (or none), so the op
        applies it; None under output_norm="rms", whose norm spans all heads (`_out` applies it)."""
        c = self.cfg
        post = (None, None, 1e-5)
        if c.output_norm != "rms":
            post = (self.g_proj(x), None if self.norm is None else self.norm.weight, c.norm_eps)
        return (*self._conv_params(), c.variant, c.qk_norm == "l2", MU_MIN, *post)

    def _out(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y `[..., H, d]` (fp32), x `[..., D]` -> `[..., D]`."""
        if self.cfg.output_norm == "head_rms":
            y = self.norm(y).flatten(-2)
        elif self.cfg.output_norm == "rms":
            y = self.norm(y.flatten(-2))
        else:
            y = y.flatten(-2)
        gate = F.gelu(self.g_proj(x).float(), approximate="tanh")  # GELU post-gate (paper App. A)
        return self.o_proj((gate * y.float()).to(self.o_proj.weight.dtype))

    # -- entry points ------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        c = self.cfg
        H = c.num_heads
        p, v, step = self._project(x)
        tail = p.new_zeros(B, c.conv_kernel - 1, p.shape[-1])
        q, k = self.conv_q(p, tail)[0], self.conv_k(p, tail)[0]  # same input, so the same tail
        q, k = q.unflatten(-1, (H, c.slots)), k.unflatten(-1, (H, c.slots))
        if c.qk_norm == "l2":
            q, k = F.normalize(q.float(), dim=-1, eps=1e-6), F.normalize(k.float(), dim=-1, eps=1e-6)
        # Training runs the forget gate as trained (it multiplies the state, Eq. (16)); serving folds it into the
        # step size (`lattice_gates`), the same function.
        gamma, mu = torch.sigmoid(step[..., :H].float()), None
        if c.forget_gate:
            mu = torch.sigmoid(step[..., H:].float()).clamp_min(MU_MIN)
        S0 = self.initial_state()
        y, _ = lattice_forward(S0.expand(B, *S0.shape), q, k, v, gamma, mu, c.variant, c.grad_checkpoint)
        return self._out(y, x)

    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        # One op from the projections: the shared-tail convs, the q/k norm, the gates, the exact recurrence (no
        # parallel form exists) and the post-gate, advancing the sessions' conv tails and S in their pool rows.
        p, v, step = self._project(x)
        out = chunk_lattice_gated(
            p, v, step, state["conv"], state["S"], batch.state_indices, batch.cu_seqlens, *self._op_args(x),
            cu_seqlens_cpu=batch.cu_seqlens_cpu,
        )  # fmt: skip
        return self._finish(out, x)

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        p, v, step = self._project(x)
        out = fused_recurrent_lattice_gated(p, v, step, state["conv"], state["S"], batch.state_indices,
                                            *self._op_args(x))  # fmt: skip
        return self._finish(out, x)

    def _finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gated op's result -> `[..., D]`: o_proj of the post-gated `[..., H*d]`, or `_out` of y `[..., H, d]`."""
        return self._out(out, x) if self.cfg.output_norm == "rms" else self.o_proj(out.to(self.o_proj.weight.dtype))
