"""The SKA mixer: Spectral Koopman Attention from Echo (docs/design/ska.md), a KV-cache-free retrieval layer.

Keys z, queries q (H heads of width r) and values v (H heads of width P) are projected from the (block-normed)
residual stream; the kernel keeps their raw second-order sums and reads each query out through the ridge /
Koopman power-filter operator J (kernels/ska). Output: o_proj(concat_h y_h), added to the residual by the block
(ungated, W_o zero-initialised: the layer starts as an exact identity; docs/design/ska.md §2.7).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from kvfree.engine.model.layers.base import Mixer, StateSpec
from kvfree.engine.model.step_batch import StepBatch
from kvfree.engine.model.strict_config import PositiveInt, StrictConfig
from kvfree.engine.model.tensor_parallel import ROW, Split, TensorParallel
from kvfree.kernels.ska import SKAState, chunk_ska, decode_graph_safe, fused_recurrent_ska, ska_chunked, ska_empty_state

_ACC = {"float32": torch.float32, "float64": torch.float64}


class SKAConfig(StrictConfig):
    """Spectral Koopman Attention (Echo; docs/design/ska.md). Per head: keys/queries of width `rank`, values of
    width `head_dim`; state 2 r^2 + P r accumulators (+ J, z_prev, m), constant in context length."""

    num_heads: PositiveInt  # H
    rank: PositiveInt  # r: Koopman rank per head (key/query width per head)
    head_dim: PositiveInt  # P: value width per head (the paper uses P = hidden / H)
    chunk_size: PositiveInt = 64  # S: chunk of the chunk-causal operator, on the absolute position grid
    power_order: int = Field(2, ge=0)  # K: power filter order (K = 0 is plain ridge retrieval)
    ridge_eps: float = Field(1e-3, gt=0)  # eps: ridge on the max-norm-normalised Gram (= eps * m^2 on raw stats)
    power_iters: PositiveInt = 6  # power-iteration steps for sigma_max of the whitened operator (detached)
    eta_init: float = 1.5  # learnable output scale eta (unconstrained)
    gamma_init: float = Field(1.0, ge=1.0, le=1.5)  # learnable spectral gain gamma, used clamped to [1, 1.5]
    # "C": chunk-causal (exact parity with the chunked forward); "P": the paper's prefix mode
    decode_mode: Literal["C", "P"] = "C"
    # Key max-norm m (only sets the ridge): "causal" = running max over the tokens an operator contains (training,
    # prefill and decode identical); "frozen" = the paper's seq-max of the first segment, then frozen.
    key_norm: Literal["causal", "frozen"] = "causal"
    # dtype of the G/M/C accumulators and of the operator build (Cholesky..J); "float64" keeps long sessions
    # exact (docs/design/ska.md §5); "float32" is the paper's choice (cheaper training on GPUs with slow fp64).
    accum_dtype: Literal["float32", "float64"] = "float64"


class SKAMixer(Mixer):
    """k_proj, q_proj `[H*r, D]` (orthogonal init), v_proj `[H*P, D]` (xavier), o_proj `[D, H*P]` (zeros), and two
    learnable scalars: eta (output scale, init 1.5) and gamma (spectral gain, used as clamp(gamma, 1, 1.5)).

    Session state per head (ska.md §3.2): `G`, `M` `[H, r, r]` and `C` `[H, P, r]` in `accum_dtype`; `z_prev`
    `[H, r]`, `m` `[H]` and the cached readout `J` `[H, P, r]` in fp32; `pos` `[]` int64 (the chunk grid is
    absolute). Bytes per head: s*(2r^2 + P r) + 4*(r + 1) + 4*P r with s = 8 (float64) or 4; plus 8 per layer.

    `decode_mode` "C" (default): prefill is the chunk-causal extend and decode its token-by-token form, so
    forward == prefill (any split) == decode. "P": the paper's prefix mode (each prefill segment reads one operator
    built from everything up to its end; decode re-estimates inclusively), which intentionally differs from the
    chunk-causal training forward.
    """

    kind = "ska"
    config_class = SKAConfig

    def __init__(self, hidden_size: int, cfg: SKAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, r, P = cfg.num_heads, cfg.rank, cfg.head_dim
        self.k_proj = nn.Linear(hidden_size, H * r, bias=False)
        self.q_proj = nn.Linear(hidden_size, H * r, bias=False)
        self.v_proj = nn.Linear(hidden_size, H * P, bias=False)
        self.o_proj = nn.Linear(H * P, hidden_size, bias=False)
        # Shape (1,) rather than 0-d: scalar tensors trip generic per-parameter code (e.g. shape[-1]).
        self.eta = nn.Parameter(torch.empty(1))
        self.gamma = nn.Parameter(torch.empty(1))
        self.acc_dtype = _ACC[cfg.accum_dtype]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # ska.md §2.1: orthogonal W_k / W_q, W_v xavier_uniform [PROPOSAL], W_o zeros (SKA starts as an identity).
        nn.init.orthogonal_(self.k_proj.weight)
        nn.init.orthogonal_(self.q_proj.weight)
        nn.init.xavier_uniform_(self.v_proj.weight)
        nn.init.zeros_(self.o_proj.weight)
        with torch.no_grad():
            self.eta.fill_(self.cfg.eta_init)
            self.gamma.fill_(self.cfg.gamma_init)

    @classmethod
    def shard_config(cls, cfg: SKAConfig, tp: TensorParallel, what: str) -> SKAConfig:
        """A rank's block of heads. Everything between the projections is per head (the statistics, the key
        max-norm m, the whitening, the power iteration and the ridge readout), so a rank needs no other's heads;
        eta and gamma are held whole."""
        return cfg.model_copy(update={"num_heads": tp.heads(cfg.num_heads, f"{what} num_heads")[0]})

    def weight_splits(self) -> dict[str, Split]:
        return {"k_proj.weight": Split(), "q_proj.weight": Split(), "v_proj.weight": Split(), "o_proj.weight": ROW}

    def state_specs(self, max_context: int) -> dict[str, StateSpec]:
        H, r, P = self.cfg.num_heads, self.cfg.rank, self.cfg.head_dim
        heads = Split()
        return {
            "G": StateSpec((H, r, r), dtype=self.acc_dtype, split=heads),
            "M": StateSpec((H, r, r), dtype=self.acc_dtype, split=heads),
            "C": StateSpec((H, P, r), dtype=self.acc_dtype, split=heads),
            "z_prev": StateSpec((H, r), dtype=torch.float32, split=heads),
            "m": StateSpec((H,), dtype=torch.float32, split=heads),
            "J": StateSpec((H, P, r), dtype=torch.float32, split=heads),
            "pos": StateSpec((), dtype=torch.int64),  # (the chunk grid's position: the same on every rank)
        }

    @property
    def graph_blocker(self) -> str:  # type: ignore[override]
        """Empty where decode runs the Triton kernels (the chunk-boundary rebuild and its Cholesky retries are
        decided on the device); the PyTorch reference branches on the host (`enter.any()`, the retry check)."""
        if decode_graph_safe(self.k_proj.weight.device, torch.float32, self.acc_dtype):  # (z is projected in fp32)
            return ""
        return "decode runs the PyTorch reference (KVFREE_KERNELS, or no CUDA): its chunk-boundary rebuild syncs"

    # -- shared pieces -----------------------------------------------------------------------------------------
    def _proj(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `[..., D]` -> raw keys, queries `[..., H, r]` and values `[..., H, P]`, fp32 (ska.md §2.2 [PROPOSAL])."""
        c = self.cfg
        z = self.k_proj(x).float().unflatten(-1, (c.num_heads, c.rank))
        q = self.q_proj(x).float().unflatten(-1, (c.num_heads, c.rank))
        v = self.v_proj(x).float().unflatten(-1, (c.num_heads, c.head_dim))
        return z, q, v

    def _kw(self) -> dict:
        """The op's parameters (those of `ska_chunked`, `ska_step` and the serving ops alike)."""
        c = self.cfg
        return {
            "chunk_size": c.chunk_size,
            "eps": c.ridge_eps,
            "eta": self.eta.float()[0],
            "gamma": self.gamma.float()[0].clamp(1.0, 1.5),  # docs/design/ska.md §2.1 [PROPOSAL]: clamp, init 1
            "order": c.power_order,
            "power_iters": c.power_iters,
            "key_norm": c.key_norm,
        }

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        """y `[..., H, P]` fp32 -> `[..., D]` (cast to the weight dtype before W_o, docs/design/ska.md §2.7)."""
        return self.o_proj(y.flatten(-2).to(self.o_proj.weight.dtype))

    @staticmethod
    def _pools(state: dict[str, torch.Tensor]) -> SKAState:
        """The layer's pool tensors `[S, ...]` in the op's order (the fields of `SKAState`)."""
        return SKAState(**{name: state[name] for name in SKAState._fields})

    # -- entry points ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Training forward (chunk-causal, docs/design/ska.md §2.8): x `[B, T, D]` -> `[B, T, D]`.

        mask: optional `[B, T]` action mask a_t in {0, 1}; tokens with a_t = 0 (e.g. padding) are still read out but
        are not written into the statistics (eq. 53).
        """
        B = x.shape[0]
        c = self.cfg
        z, q, v = self._proj(x)
        state = ska_empty_state(B, c.num_heads, c.rank, c.head_dim, self.acc_dtype, x.device)
        y, _ = ska_chunked(z, q, v, state, 0, a=mask, **self._kw())
        return self._out(y)

    # -- serving path: project, one op on the pool rows, project out ------------------------------------------
    def prefill(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        z, q, v = self._proj(x)
        y = chunk_ska(
            z, q, v, self._pools(state), batch.state_indices, batch.cu_seqlens, **self._kw(),
            mode=self.cfg.decode_mode, cu_seqlens_cpu=batch.cu_seqlens_cpu,
        )  # fmt: skip
        return self._out(y)

    def decode(self, x: torch.Tensor, state: dict[str, torch.Tensor], batch: StepBatch) -> torch.Tensor:
        z, q, v = self._proj(x)
        y = fused_recurrent_ska(
            z, q, v, self._pools(state), batch.state_indices, **self._kw(), mode=self.cfg.decode_mode
        )
        return self._out(y)
